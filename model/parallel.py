"""Tensor parallelism: which slice of each weight a rank holds, and the two collectives the forward needs."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from model.config import FlashNextConfig

if TYPE_CHECKING:  # the kernels load Triton: not at import, before a test or script has chosen the interpreter
    from kernels.peer import PeerSum
    from model.peer_sums import PeerSums

COLLECTIVES = ("combine", "gather")


@dataclass(slots=True)
class CollectiveCounts:
    """Per collective: calls made and bytes of this rank's data its peers received (payload times world - 1)."""

    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COLLECTIVES, 0))
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COLLECTIVES, 0))

    def add(self, op: str, payload: torch.Tensor, world: int) -> None:
        """Count one call of `op` that sent `payload` to each of the other ranks."""
        self.calls[op] += 1
        self.bytes[op] += payload.numel() * payload.element_size() * (world - 1)


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This rank's place in the tensor-parallel group (world 1: no collectives at all), and its collective counts."""

    rank: int = 0
    world: int = 1
    counts: CollectiveCounts = field(default_factory=CollectiveCounts, compare=False, repr=False)
    peer: PeerSums | None = field(default=None, compare=False, repr=False)

    def span(self, total: int, what: str) -> tuple[int, int]:
        """This rank's contiguous share [lo, hi) of `total` units."""
        if total % self.world:
            raise ValueError(f"{what} ({total}) does not split over {self.world} ranks")
        size = total // self.world
        return self.rank * size, (self.rank + 1) * size

    def combine(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' partial outputs in fp32, rounded once: every rank gets the bits of `combine_ordered`."""
        if self.world == 1:
            return partial
        copy = partial.to(torch.float32, memory_format=torch.contiguous_format, copy=True)  # never reduce in place
        return self.reduce(copy).to(partial.dtype)

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The ranks' partials summed in fp32, not rounded (the consumer rounds once, as `combine` does): `partial`
        itself at one rank; at two an fp32 contiguous partial is summed in place, with no copy."""
        if self.world == 1:
            return partial
        if self.world > 2:  # three or more fp32 terms round differently in different orders: fix the order
            return self.sum_ordered(partial)
        # two terms: p0 + p1 is one IEEE addition, the same bits in either order, whatever the reduction's algorithm
        total = partial if partial.dtype == torch.float32 and partial.is_contiguous() else partial.float().contiguous()
        self.counts.add("combine", total, self.world)
        dist.all_reduce(total)
        return total

    def pending(self, partial: torch.Tensor) -> torch.Tensor | PeerSum:
        """The ranks' partials summed for the next hyper write: a `PeerSum` it sums itself where peer sums are open
        (model/peer_sums.py) and the round small enough, else `reduce`'s fp32 sum."""
        exchanged = self.peer.pending(partial) if self.peer is not None and self.world == 2 else None
        if exchanged is None:
            return self.reduce(partial)
        self.counts.add("combine", partial, self.world)
        return exchanged

    def combine_ordered(self, partial: torch.Tensor) -> torch.Tensor:
        """Gather the ranks' partials in fp32 and sum them rank 0's first, rounded once."""
        return self.sum_ordered(partial).to(partial.dtype)

    def sum_ordered(self, partial: torch.Tensor) -> torch.Tensor:
        """Gather the ranks' partials in fp32 and sum them rank 0's first, in fp32."""
        local = partial.float().contiguous()
        self.counts.add("combine", local, self.world)
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total

    def gather(self, local: torch.Tensor, dim: int = -1, out: torch.Tensor | None = None) -> torch.Tensor:
        """Concatenate the ranks' slices along `dim`, in rank order (into `out` when given)."""
        if self.world == 1:
            return local if out is None else out.copy_(local)
        local = local.contiguous()
        self.counts.add("gather", local, self.world)
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local)
        return torch.cat(parts, dim=dim, out=out)


@dataclass(frozen=True, slots=True)
class Shard:
    """The pieces of a checkpoint tensor a rank reads along `dim` (of `full` units), concatenated in order."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    full: int

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's pieces of a whole tensor."""
        return torch.cat([tensor.narrow(self.dim, lo, hi - lo) for lo, hi in self.ranges], dim=self.dim)


class ShardPlan:
    """Maps parameter names to this rank's slices: heads of QSA and GDN, the experts' and shared expert's width,
    the vocabulary and the n-gram heads; everything else (router, norms, hyper-connections, indexer,
    embeddings) is replicated."""

    def __init__(self, cfg: FlashNextConfig, tp: TensorParallel) -> None:
        self.cfg, self.tp = cfg, tp
        c = cfg
        heads = tp.span(c.num_attention_heads, "num_attention_heads")
        group = c.num_attention_heads // c.num_key_value_heads
        kv = (heads[0] // group, (heads[1] - 1) // group + 1)
        self.q_rows = (heads[0] * 2 * c.head_dim, heads[1] * 2 * c.head_dim)
        self.kv_rows = (kv[0] * c.head_dim, kv[1] * c.head_dim)
        self.o_cols = (heads[0] * c.head_dim, heads[1] * c.head_dim)
        v_heads = tp.span(c.linear_num_value_heads, "linear_num_value_heads")
        ratio = c.linear_num_value_heads // c.linear_num_key_heads
        k_heads = (v_heads[0] // ratio, (v_heads[1] - 1) // ratio + 1)
        qk, dk, dv = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_key_head_dim, c.linear_value_head_dim
        self.gdn_key_heads = k_heads[1] - k_heads[0]
        self.gdn_value_heads = v_heads[1] - v_heads[0]
        self.qkv_rows = (
            (k_heads[0] * dk, k_heads[1] * dk),
            (qk + k_heads[0] * dk, qk + k_heads[1] * dk),
            (2 * qk + v_heads[0] * dv, 2 * qk + v_heads[1] * dv),
        )
        self.v_rows = (v_heads[0] * dv, v_heads[1] * dv)
        self.v_heads = v_heads
        self.expert_cols = tp.span(c.moe_intermediate_size, "moe_intermediate_size")
        self.shared_cols = tp.span(c.shared_expert_intermediate_size, "shared_expert_intermediate_size")
        self.vocab = tp.span(c.vocab_size, "vocab_size")
        self.ngram_heads = tp.span(c.ngram_heads, "the n-gram head count")
        self.heads = heads

    @property
    def local_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def local_kv_heads(self) -> int:
        return (self.kv_rows[1] - self.kv_rows[0]) // self.cfg.head_dim

    def check_expert_blocks(self, block: int) -> None:
        """Refuse (naming moe_intermediate_size) a share of the experts' width not made of whole `block`-wide blocks."""
        lo, hi = self.expert_cols
        if lo % block or hi % block:
            raise ValueError(
                f"moe_intermediate_size: {self.cfg.moe_intermediate_size} gives rank {self.tp.rank} the columns "
                f"[{lo}, {hi}), not whole {block}-wide NVFP4 scale blocks"
            )

    def expert_shard(self, projection: str, packed: int = 1) -> Shard | None:
        """One expert's slice: gate/up rows or down columns of the intermediate width, `packed` values per unit."""
        if self.tp.world == 1:
            return None
        lo, hi = self.expert_cols
        full = self.cfg.moe_intermediate_size
        if projection == "down_proj":
            if lo % packed:
                raise ValueError(f"moe_intermediate_size: a rank's share starts at {lo}, inside a {packed}-wide block")
            return Shard(1, ((lo // packed, hi // packed),), full // packed)
        return Shard(0, ((lo, hi),), full)

    def shard(self, name: str) -> Shard | None:
        """The slice of parameter `name` this rank holds, None when it is replicated."""
        if self.tp.world == 1:
            return None
        c = self.cfg
        i, shared, cols = c.moe_intermediate_size, self.shared_cols, self.expert_cols
        qk = c.linear_num_key_heads * c.linear_key_head_dim
        v_width = c.linear_num_value_heads * c.linear_value_head_dim
        q_full, kv_full = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        rules: list[tuple[str, Shard]] = [
            (r"linear_attn\.(in_proj_qkv|conv1d)\.weight", Shard(0, self.qkv_rows, 2 * qk + v_width)),
            (r"linear_attn\.in_proj_z\.weight", Shard(0, (self.v_rows,), v_width)),
            (r"linear_attn\.(in_proj_[ba]\.weight|A_log|dt_bias)", Shard(0, (self.v_heads,), c.linear_num_value_heads)),
            (r"linear_attn\.out_proj\.weight", Shard(1, (self.v_rows,), v_width)),
            (r"self_attn\.q_proj\.weight", Shard(0, (self.q_rows,), 2 * q_full)),
            (r"self_attn\.[kv]_proj\.weight", Shard(0, (self.kv_rows,), kv_full)),
            (r"self_attn\.o_proj\.weight", Shard(1, (self.o_cols,), q_full)),
            (r"mlp\.experts\.gate_up_proj", Shard(1, (cols, (i + cols[0], i + cols[1])), 2 * i)),
            (r"mlp\.experts\.down_proj", Shard(2, (cols,), i)),
            (r"mlp\.shared_expert\.(gate|up)_proj\.weight", Shard(0, (shared,), c.shared_expert_intermediate_size)),
            (r"mlp\.shared_expert\.down_proj\.weight", Shard(1, (shared,), c.shared_expert_intermediate_size)),
            (r"^lm_head\.weight", Shard(0, (self.vocab,), c.vocab_size)),
        ]
        for pattern, shard in rules:
            if re.search(pattern, name):
                return shard
        return None
