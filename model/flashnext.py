"""The Flash Next text model: embeddings, the decoder stack, the final mixer and lm_head, and the MTP layer."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from model.config import FlashNextConfig
from model.hyper import GatedResidual, linear
from model.layers import DecoderLayer, ForwardBatch, Segment
from model.mtp import MTPLayer
from model.parallel import ShardPlan, TensorParallel
from model.state import LaneSnapshot, LaneState, restore, snapshot


@dataclass(slots=True)
class ForwardOutput:
    """Logits of the requested rows, every row's pre-mixer wide state (the MTP layer's input), and by segment index
    and row offset the lane's snapshots asked for (to keep a prefix of a verify window, or a state mid-chunk; a
    replayed graph's snapshots view buffers the next verify or prompt forward writes: copy them out before it)."""

    logits: torch.Tensor
    hidden: torch.Tensor
    snapshots: dict[int, dict[int, LaneSnapshot]]


class FlashNextModel(nn.Module):
    """The forward over batches of lane segments: the reference, or with `kernels` the Triton kernel path.

    The reference folds rows in one at a time: on the CPU, PyTorch's vectorised elementwise kernels round a value
    differently in a vector body than in a scalar tail, so only single-row tensors give each row the bits it would
    have alone (the exactness contract). The kernel path (model/kernel_path.py) runs all rows of a round through each
    layer at once, on kernels whose row bits do not depend on the batch."""

    def __init__(
        self, cfg: FlashNextConfig, with_mtp: bool = True, tp: TensorParallel | None = None, kernels: bool = False
    ) -> None:
        super().__init__()
        self.cfg, self.kernels = cfg, kernels
        self.tp = tp or TensorParallel()
        self.plan = ShardPlan(cfg, self.tp)
        # the checkpoint fills the table: no random init (on the meta device, normal_ would import torch._dynamo)
        table = torch.empty(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=table, _freeze=True)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, self.plan, i, kind, cfg.ple_layers.index(i) if i in cfg.ple_layers else None)
            for i, kind in enumerate(cfg.layer_types)
        )
        self.hyper_connection_mixer = GatedResidual(cfg, inject=False)
        vocab = self.plan.vocab
        self.lm_head = linear(cfg.hidden_size, vocab[1] - vocab[0])
        self.mtp = MTPLayer(cfg, self.plan) if with_mtp and cfg.mtp_num_hidden_layers else None
        self.lane_pool = None  # the kernel path's lane states (model/lane_pool.py), made on its first forward
        self.round_graphs = None  # the kernel path's captured forwards (model/graphs.py), when enabled

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def new_lane(self) -> LaneState:
        """A lane with zeroed state and an n-gram history of eos."""
        lane = LaneState()
        for layer in self.layers:
            layer.init_lane(lane, self.dtype, self.device)
        if self.mtp is not None:
            self.mtp.layers[0].init_lane(lane, self.dtype, self.device)
        lane.ngram_history = torch.full((self.cfg.ngram_size - 1,), self.cfg.eos_token_id, device=self.device)
        return lane

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head logits of pre-mixer wide rows [N, wide], one row at a time."""
        rows = [self.vocab_logits(self.hyper_connection_mixer.read(row[None])[0]) for row in hidden]
        return torch.cat(rows) if rows else hidden.new_zeros(0, self.cfg.vocab_size)

    def vocab_logits(self, mixed: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary: each rank's lm_head rows, gathered in rank order."""
        return self.tp.gather(self.lm_head(mixed), dim=-1)

    @torch.no_grad()
    def forward(
        self,
        batch: ForwardBatch,
        logit_rows: torch.Tensor | None = None,
        snapshot_rows: Mapping[int, Collection[int]] | None = None,
    ) -> ForwardOutput:
        """Fold every segment's rows into its lane; logits for `logit_rows` (all rows if None); the lane's snapshot
        after each row offset that `snapshot_rows` lists for a segment index."""
        wanted = snapshot_rows or {}
        if self.kernels:
            return _kernel_path().forward(self, batch, logit_rows, wanted)
        hidden = torch.empty(batch.token_ids.shape[0], self.cfg.wide_size, dtype=self.dtype, device=self.device)
        snapshots: dict[int, dict[int, LaneSnapshot]] = {i: {} for i in wanted}
        for index, seg in enumerate(batch.segments):
            lane = seg.lane
            first = int(batch.positions[seg.start])
            if first != lane.length:
                raise ValueError(f"segment starts at position {first} but its lane holds {lane.length} tokens")
            for r in range(seg.start, seg.start + seg.length):
                row = ForwardBatch(batch.token_ids[r : r + 1], batch.positions[r : r + 1], [Segment(lane, 0, 1)])
                wide = self.embed_tokens(row.token_ids).repeat(1, self.cfg.hc_count)
                for layer in self.layers:
                    wide = layer(wide, row)
                hidden[r] = wide[0]
                lane.ngram_history = torch.cat((lane.ngram_history[1:], row.token_ids))
                lane.length += 1
                if r - seg.start in wanted.get(index, ()):
                    snapshots[index][r - seg.start] = snapshot(lane)
        rows = hidden if logit_rows is None else hidden[logit_rows]
        return ForwardOutput(logits=self.logits(rows), hidden=hidden, snapshots=snapshots)

    def restore_lanes(self, restores: Sequence[tuple[LaneState, LaneSnapshot]]) -> None:
        """Put each lane back to its snapshot (`model.state.restore`); on the kernel path its pooled lanes together
        (`LanePool.restore`: one launch)."""
        if self.lane_pool is not None:
            self.lane_pool.restore(restores)
            return
        for lane, snap in restores:
            restore(lane, snap)

    @torch.no_grad()
    def mtp_forward(
        self, batch: ForwardBatch, hidden: torch.Tensor, logit_rows: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft logits for position p+2 from rows (token p+1 at position p, trunk wide state at p), of `logit_rows`
        only (None: every row), and the MTP's own pre-mixer wide states of every row for chaining."""
        if self.mtp is None:
            raise RuntimeError("this checkpoint has no MTP layer")
        if self.kernels:
            return _kernel_path().mtp_forward(self, batch, hidden, logit_rows)
        logits, wides = [], []
        for seg in batch.segments:
            for r in range(seg.start, seg.start + seg.length):
                row = ForwardBatch(batch.token_ids[r : r + 1], batch.positions[r : r + 1], [Segment(seg.lane, 0, 1)])
                mixed, wide = self.mtp(self.embed_tokens(row.token_ids), hidden[r : r + 1], row)
                logits.append(self.vocab_logits(mixed))
                wides.append(wide)
                seg.lane.mtp_length = int(batch.positions[r]) + 1
        every = torch.cat(logits)
        return every if logit_rows is None else every[logit_rows.to(every.device)], torch.cat(wides)


def _kernel_path() -> ModuleType:
    """The kernel path's module, imported on first use: it imports Triton, whose interpreter setting
    (TRITON_INTERPRET) must be fixed before the kernels are defined."""
    from model import kernel_path

    return kernel_path


def single_lane_batch(lane: LaneState, token_ids: torch.Tensor, start: int) -> ForwardBatch:
    """A batch of one lane's consecutive rows from absolute position `start`."""
    positions = torch.arange(start, start + token_ids.shape[0], device=token_ids.device)
    return ForwardBatch(token_ids=token_ids, positions=positions, segments=[Segment(lane, 0, token_ids.shape[0])])
