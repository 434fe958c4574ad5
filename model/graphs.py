"""CUDA graphs of the kernel path's decode round: one row per lane, captured once per batch bucket.

A round of n single-row segments replays the graph of the smallest bucket >= n: its rows are copied into the
graph's static inputs (token, position, lane-pool slot, n-gram window) and the rest of the bucket is padding that
writes only the pool's scratch slot. The kernels give a row the same bits whatever the batch, so a replayed round
equals the eager one bit for bit. The graphs are captured once, at start, on every rank in the same order (their
collectives must pair up); if the pool later grows, its tensors move and the graphs are no longer used.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from model.kernel_blocks import Round
from model.lane_pool import LanePool
from model.layers import ForwardBatch

Body = Callable[[torch.Tensor, Round], tuple[torch.Tensor, torch.Tensor]]


def buckets_for(max_rows: int) -> tuple[int, ...]:
    """Batch buckets up to `max_rows`: powers of two, then `max_rows` itself."""
    sizes, size = [], 1
    while size < max_rows:
        sizes.append(size)
        size *= 2
    return (*sizes, max_rows)


class DecodeGraphs:
    """The captured decode rounds of one model, by bucket. Off CUDA (the Triton interpreter in tests) a replay
    runs the same padded body eagerly."""

    def __init__(
        self, pool: LanePool, body: Body, ngram_size: int, eos: int, max_rows: int, device: torch.device
    ) -> None:
        self.pool, self.body, self.capture = pool, body, device.type == "cuda"
        self.generation = pool.generation
        self.buckets = buckets_for(max_rows)
        top = self.buckets[-1]
        self.tokens = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.slots = torch.full((top,), pool.scratch, dtype=torch.long, device=device)
        self.windows = torch.full((top, ngram_size), eos, dtype=torch.long, device=device)
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = 0

    def covers(self, batch: ForwardBatch) -> bool:
        """Whether a graph runs this batch: one row per lane, within the largest bucket, pool unmoved."""
        n = batch.token_ids.shape[0]
        one_row_each = len(batch.segments) == n
        return one_row_each and n <= self.buckets[-1] and self.pool.generation == self.generation

    def bucket_of(self, n: int) -> int:
        """The smallest bucket holding n rows."""
        return next(b for b in self.buckets if b >= n)

    def _round(self, size: int) -> Round:
        """The static inputs of a bucket as a Round: every row may complete a block (padding's keys go to the
        scratch block row)."""
        positions, pool = self.positions[:size], self.pool
        completes = (positions + 1) % pool.ratio == 0
        dest = torch.where(completes, (positions + 1) // pool.ratio - 1, pool.block_capacity - 1)
        rows = torch.arange(size, device=positions.device)
        return Round(pool, self.slots[:size], positions, self.windows[:size], rows, dest, None)

    def _run_body(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.body(self.tokens[:size], self._round(size))

    def capture_all(self) -> None:
        """Capture every bucket, largest first (they share one memory pool), on padding rows only."""
        if not self.capture:
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        mempool = torch.cuda.graph_pool_handle()
        for size in sorted(self.buckets, reverse=True):
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile the kernels and make this stream's counters before capturing
                    self._run_body(size)
            stream.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool, stream=stream):
                self.outputs[size] = self._run_body(size)
            self.graphs[size] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def run(
        self, token_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, windows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and pre-mixer wide states of n decode rows, by replaying their bucket's graph."""
        n = token_ids.shape[0]
        size = self.bucket_of(n)
        self.tokens[:n].copy_(token_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(slots)
        self.windows[:n].copy_(windows)
        self.tokens[n:size].zero_()
        self.positions[n:size].zero_()
        self.slots[n:size].fill_(self.pool.scratch)
        if self.capture:
            self.graphs[size].replay()
            logits, wide = self.outputs[size]
        else:
            logits, wide = self._run_body(size)
        self.replays += 1
        return logits[:n].clone(), wide[:n].clone()
