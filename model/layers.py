"""A decoder layer: optional PLE, then the mixer (GDN or QSA) and the MoE, each between hyper-connections."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from kernels.host import to_device
from model.config import LINEAR, FlashNextConfig
from model.gdn import GatedDeltaNet
from model.hyper import GatedResidual
from model.moe import SparseMoE
from model.parallel import ShardPlan
from model.ple import PLELayer
from model.qsa import QSAttention
from model.state import AttentionCache, LaneState


@dataclass(slots=True)
class Segment:
    """One lane's run of consecutive rows inside a batch."""

    lane: LaneState
    start: int
    length: int

    @property
    def rows(self) -> slice:
        return slice(self.start, self.start + self.length)


@dataclass(slots=True)
class ForwardBatch:
    """The rows of one forward: token ids and absolute positions [N], grouped by lane into segments; `starts`, when
    its maker holds them on the host, each segment's first position (`batch_from_starts`)."""

    token_ids: torch.Tensor
    positions: torch.Tensor
    segments: list[Segment]
    starts: tuple[int, ...] | None = None


def batch_from_starts(token_ids: torch.Tensor, segments: list[Segment], starts: Sequence[int]) -> ForwardBatch:
    """A batch whose segments' positions run on from `starts`: the positions are copied to the token ids' device
    without waiting for the GPU, and the kernel path reads `starts` instead of copying the positions back."""
    positions = [p for seg, first in zip(segments, starts, strict=True) for p in range(first, first + seg.length)]
    return ForwardBatch(token_ids, to_device(token_ids.device, positions, torch.long), segments, tuple(starts))


class DecoderLayer(nn.Module):
    """Layer `index` of the trunk (or the MTP layer when `mtp` is set)."""

    def __init__(
        self, cfg: FlashNextConfig, plan: ShardPlan, index: int, kind: str, ple_index: int | None, mtp: bool = False
    ) -> None:
        super().__init__()
        self.index, self.kind, self.is_mtp = index, kind, mtp
        if kind == LINEAR:
            self.linear_attn = GatedDeltaNet(cfg, plan)
        else:
            self.self_attn = QSAttention(cfg, plan)
        self.mlp = SparseMoE(cfg, plan)
        self.ple = PLELayer(cfg, ple_index, plan) if ple_index is not None else None
        self.attn_hyper_connection = GatedResidual(cfg)
        self.mlp_hyper_connection = GatedResidual(cfg)

    def init_lane(self, lane: LaneState, dtype: torch.dtype, device: torch.device) -> None:
        """Give a fresh lane this layer's zeroed state."""
        if self.kind == LINEAR:
            lane.gdn_conv[self.index], lane.gdn_recurrent[self.index] = self.linear_attn.new_state(dtype, device)
        elif self.is_mtp:
            lane.mtp_attention = self.self_attn.new_cache(dtype, device)
        else:
            lane.attention[self.index] = self.self_attn.new_cache(dtype, device)
        if self.ple is not None:
            width = self.ple.conv1d.weight.shape[0]
            lane.ple_conv[self.index] = torch.zeros(self.ple.tail_len, width, dtype=dtype, device=device)

    def cache_of(self, lane: LaneState) -> AttentionCache:
        """This QSA layer's cache in a lane (the MTP layer keeps its own)."""
        return lane.mtp_attention if self.is_mtp else lane.attention[self.index]

    def forward(self, wide: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Wide residual [N, wide] in, out; lane state updated for every segment."""
        if self.ple is not None:
            parts = []
            for seg in batch.segments:
                lane = seg.lane
                delta, lane.ple_conv[self.index] = self.ple(
                    wide[seg.rows], lane.ngram_history, batch.token_ids[seg.rows], lane.ple_conv[self.index]
                )
                parts.append(delta)
            wide = wide + torch.cat(parts)
        x, inject = self.attn_hyper_connection.read(wide)
        parts = []
        for seg in batch.segments:
            lane, rows = seg.lane, seg.rows
            if self.kind == LINEAR:
                out, lane.gdn_conv[self.index], lane.gdn_recurrent[self.index] = self.linear_attn(
                    x[rows], lane.gdn_conv[self.index], lane.gdn_recurrent[self.index]
                )
            else:
                out = self.self_attn(x[rows], batch.positions[rows], self.cache_of(lane))
            parts.append(out)
        wide = GatedResidual.write(wide, torch.cat(parts), inject)
        x, inject = self.mlp_hyper_connection.read(wide)
        return GatedResidual.write(wide, self.mlp(x), inject)
