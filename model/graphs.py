"""CUDA graphs of the kernel path's forwards, captured once per kind and batch bucket.

Four kinds: `trunk` (any rows: decode rows, prompt chunks, drafts' windows whose states are not kept), `verify` (the
trunk keeping every row's state, for verify windows), `prompt` (the trunk with GDN's prompt-pass kernels, keeping the
states after up to PROMPT_KEEPS listed rows) and `mtp` (the MTP layer's rows); prompt and MTP graphs give the logits
of up to `listed_logits` listed rows only. A forward of n rows replays the graph of the smallest bucket >= n: its rows
are copied into the graph's static inputs (token, position, lane-pool slot, n-gram window, MTP hidden row) and the
rest of the bucket is padding that writes only the pool's scratch slot. The kernels index state by each row's slot
and give a row the same bits whatever the batch, so a replay equals the eager forward bit for bit whatever the rows'
layout. Every graph writes its logits and the states it keeps into one set of buffers (`SharedOutputs`, sized by the
largest bucket), read before the next replay. The graphs are captured once, at start, on every rank in the same order
(their collectives must pair up); if the pool later grows, its tensors move and the graphs are no longer used.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

from kernels.gdn import run_firsts
from kernels.gdn_chunk import CHUNK, ChunkPlan, Run, plan_chunks, recurrent_lanes
from kernels.host import copy_in
from model.kernel_blocks import Round, SharedOutputs
from model.lane_pool import LanePool

# (round, token ids, hidden rows or None) -> (logits, pre-mixer wide states)
Body = Callable[[Round, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor]]
PROMPT_KEEPS = 8  # rows a prompt graph keeps states after (the cache grid's, message ends', a prompt's last but one)
PROMPT_FIRST = 128  # the smallest prompt bucket: smaller rounds with kept rows fit a verify graph
LISTED_LOGITS = 320  # rows a prompt or MTP graph gives logits for, unless the server says (lanes × window rows)
LISTING_KINDS = ("prompt", "mtp")  # the kinds that give the logits of listed rows only


def buckets_for(max_rows: int, first: int = 1) -> tuple[int, ...]:
    """Batch buckets up to `max_rows`: powers of two from `first`, then `max_rows` itself."""
    sizes, size = [], first
    while size < max_rows:
        sizes.append(size)
        size *= 2
    return (*sizes, max_rows)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Collect cyclic garbage now and not again until the block ends: a CUDA graph destroyed by a collection during a
    capture ends that capture with an error (torch.cuda.graph no longer collects before it captures)."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class RoundGraphs:
    """The captured forwards of one model, by kind and bucket. Off CUDA (the Triton interpreter in tests) a replay
    runs the same padded body eagerly."""

    def __init__(
        self,
        pool: LanePool,
        bodies: Mapping[str, Body],
        max_rows: Mapping[str, int],
        ngram_size: int,
        eos: int,
        wide: int,
        dtype: torch.dtype,
        device: torch.device,
        listed_logits: int = LISTED_LOGITS,
    ) -> None:
        self.pool, self.bodies, self.capture = pool, dict(bodies), device.type == "cuda"
        self.generation = pool.generation
        self.buckets = {
            kind: buckets_for(rows, PROMPT_FIRST if kind == "prompt" else 1) for kind, rows in max_rows.items()
        }
        top = max(rows for rows in max_rows.values())
        self.tokens = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.slots = torch.full((top,), pool.scratch, dtype=torch.long, device=device)
        self.windows = torch.full((top, ngram_size), eos, dtype=torch.long, device=device)
        self.hidden = torch.zeros(top, wide, dtype=dtype, device=device)
        self.keep_rows = torch.zeros(PROMPT_KEEPS, dtype=torch.long, device=device)
        self.keep_places = torch.full((top,), -1, dtype=torch.int32, device=device)
        chunks = max(top // CHUNK, 1)  # a prompt round's GDN chunks (`plan_chunks`) and its other rows' lanes
        self.chunk_rows = torch.full((chunks,), -1, dtype=torch.int32, device=device)
        self.chunk_runs = torch.zeros((chunks, 3), dtype=torch.int32, device=device)
        self.recurrent_lanes = torch.full((top,), pool.scratch, dtype=torch.long, device=device)
        # the rows that start the recurrence's runs: one a lane at most, and the padding's
        self.recurrent_firsts = torch.full((min(top, pool.slots + 1),), -1, dtype=torch.int32, device=device)
        self.listed_logits = listed_logits
        self.logit_rows = torch.zeros(listed_logits, dtype=torch.long, device=device)
        self.shared = SharedOutputs()  # every bucket's logits and kept states
        self.rounds: dict[tuple[str, int], Round] = {}
        self.outputs: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self.replays = dict.fromkeys(self.buckets, 0)

    def covers(self, kind: str, rows: int, keeps: int = 0, logits: int = 0) -> bool:
        """Whether a graph of `kind` runs `rows` rows keeping the states after `keeps` of them and giving `logits`
        rows' logits: within its largest bucket (a prompt graph keeps up to PROMPT_KEEPS; prompt and MTP graphs give
        up to `listed_logits` rows' logits), the pool unmoved."""
        buckets = self.buckets.get(kind)
        kept = keeps <= PROMPT_KEEPS if kind == "prompt" else keeps == 0 or kind == "verify"
        listed = kind not in LISTING_KINDS or logits <= self.listed_logits
        return bool(buckets) and rows <= buckets[-1] and kept and listed and self.pool.generation == self.generation

    def first_entries(self, size: int) -> int:
        """Entries of a bucket's list of the recurrence's run starts: a run a lane at most, and the padding's."""
        return min(size, self.recurrent_firsts.shape[0])

    def bucket_of(self, kind: str, rows: int) -> int:
        """The smallest bucket of `kind` holding `rows` rows."""
        return next(b for b in self.buckets[kind] if b >= rows)

    def _round(self, kind: str, size: int) -> Round:
        """A bucket's static inputs as a Round: every row may complete an indexer block (padding's keys go to the
        scratch block row); `verify` keeps every row's state, `prompt` the listed rows' (`keep_places`)."""
        positions, pool = self.positions[:size], self.pool
        completes = (positions + 1) % pool.ratio == 0
        dest = torch.where(completes, (positions + 1) // pool.ratio - 1, pool.block_capacity - 1)
        rows = torch.arange(size, device=positions.device)
        windows = None if kind == "mtp" else self.windows[:size]
        wanted = self.logit_rows[: min(size, self.listed_logits)] if kind in LISTING_KINDS else None
        if kind == "prompt":
            keep, places, chunks = self.keep_rows, self.keep_places[:size], max(size // CHUNK, 1)
            return Round(
                pool, self.slots[:size], positions, windows, rows, dest, keep, True, keep_places=places,
                logit_rows=wanted, shared=self.shared,
                chunks=ChunkPlan(self.chunk_rows[:chunks], self.chunk_runs[:chunks]),
                recurrent_lanes=self.recurrent_lanes[:size],
                recurrent_firsts=self.recurrent_firsts[: self.first_entries(size)],
            )  # fmt: skip
        keep = rows if kind == "verify" else None
        return Round(
            pool, self.slots[:size], positions, windows, rows, dest, keep, logit_rows=wanted, shared=self.shared,
            single_rows=kind == "trunk",
        )  # fmt: skip

    def _run_body(self, kind: str, size: int) -> tuple[Round, tuple[torch.Tensor, torch.Tensor]]:
        rnd = self._round(kind, size)
        hidden = self.hidden[:size] if kind == "mtp" else None
        return rnd, self.bodies[kind](rnd, self.tokens[:size], hidden)

    def capture_all(self) -> None:
        """Capture every kind's buckets, largest first (they share one memory pool), on padding rows only."""
        if not self.capture:
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        mempool = torch.cuda.graph_pool_handle()
        with collector_paused():
            for kind, buckets in self.buckets.items():
                for size in sorted(buckets, reverse=True):
                    with torch.cuda.stream(stream):
                        for _ in range(2):  # compile the kernels and make this stream's counters before capturing
                            self._run_body(kind, size)
                    stream.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=mempool, stream=stream):
                        self.rounds[kind, size], self.outputs[kind, size] = self._run_body(kind, size)
                    self.graphs[kind, size] = graph
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def run(
        self,
        kind: str,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        windows: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
        keep_rows: Sequence[int] = (),
        logit_rows: torch.Tensor | None = None,
        runs: Sequence[Run] = (),
    ) -> tuple[torch.Tensor, torch.Tensor, Round]:
        """Logits and pre-mixer wide states of n rows (copies), and the bucket's Round (its kept states are in the
        shared buffers: read them before the next replay), by replaying the graph of their bucket (its inputs copied
        in without waiting for the GPU, host ones through pinned memory); a
        prompt graph keeps the states after `keep_rows` (ascending), in their order, and runs GDN's chunked form over
        the whole chunks of the lanes' `runs`; prompt and MTP graphs give the logits of `logit_rows` only (None:
        every row), in their order."""
        n = token_ids.shape[0]
        size = self.bucket_of(kind, n)
        wanted = n
        if kind == "prompt":
            places = torch.full((size,), -1, dtype=torch.int32)
            places[list(keep_rows)] = torch.arange(len(keep_rows), dtype=torch.int32)
            copy_in(self.keep_places[:size], places)
            copy_in(self.keep_rows, torch.tensor([*keep_rows, *[0] * (PROMPT_KEEPS - len(keep_rows))]))
            plan = plan_chunks(runs, size, torch.device("cpu"))
            copy_in(self.chunk_rows[: plan.chunk_rows.shape[0]], plan.chunk_rows)
            copy_in(self.chunk_runs[: plan.runs.shape[0]], plan.runs)
            lanes = torch.cat((recurrent_lanes(slots, runs), slots.new_full((size - n,), self.pool.scratch)))
            copy_in(self.recurrent_lanes[:size], lanes)
            entries = self.first_entries(size)
            copy_in(self.recurrent_firsts[:entries], run_firsts(lanes, entries))
        if kind in LISTING_KINDS:
            rows = torch.arange(n) if logit_rows is None else logit_rows
            wanted = rows.shape[0]
            copy_in(self.logit_rows[:wanted], rows)
            self.logit_rows[wanted:].zero_()  # row 0's logits again: computed, never returned
        copy_in(self.tokens[:n], token_ids)
        copy_in(self.positions[:n], positions)
        copy_in(self.slots[:n], slots)
        if windows is not None:
            copy_in(self.windows[:n], windows)
        if hidden is not None:
            copy_in(self.hidden[:n], hidden)
        if size > n:  # the bucket's padding rows
            self.tokens[n:size].zero_()
            self.positions[n:size].zero_()
            self.slots[n:size].fill_(self.pool.scratch)
        if self.capture:
            self.graphs[kind, size].replay()
            rnd, (logits, wide) = self.rounds[kind, size], self.outputs[kind, size]
        else:
            rnd, (logits, wide) = self._run_body(kind, size)
        self.replays[kind] += 1
        return logits[:wanted].clone(), wide[:n].clone(), rnd
