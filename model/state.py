"""Per-lane state: everything one sequence carries from one forward to the next."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class AttentionCache:
    """A QSA layer's keys (normed, RoPE'd), values and raw indexer keys, one row per absolute position."""

    keys: torch.Tensor
    values: torch.Tensor
    index_keys: torch.Tensor
    length: int = 0

    @classmethod
    def empty(
        cls, kv_heads: int, head_dim: int, index_dim: int, dtype: torch.dtype, device: torch.device
    ) -> AttentionCache:
        """A cache with room for a few rows; it grows on demand."""
        cap = 16
        return cls(
            keys=torch.zeros(cap, kv_heads, head_dim, dtype=dtype, device=device),
            values=torch.zeros(cap, kv_heads, head_dim, dtype=dtype, device=device),
            index_keys=torch.zeros(cap, index_dim, dtype=dtype, device=device),
        )

    def write(self, start: int, keys: torch.Tensor, values: torch.Tensor, index_keys: torch.Tensor) -> None:
        """Write rows at absolute positions start.. (dropping anything past them: truncation by position)."""
        end = start + keys.shape[0]
        if start > self.length:
            raise ValueError(f"attention cache write at {start} leaves a gap after {self.length}")
        if end > self.keys.shape[0]:
            cap = max(end, 2 * self.keys.shape[0])
            self.keys = _grow(self.keys, cap)
            self.values = _grow(self.values, cap)
            self.index_keys = _grow(self.index_keys, cap)
        self.keys[start:end] = keys
        self.values[start:end] = values
        self.index_keys[start:end] = index_keys
        self.length = end


def _grow(t: torch.Tensor, cap: int) -> torch.Tensor:
    out = torch.zeros((cap, *t.shape[1:]), dtype=t.dtype, device=t.device)
    out[: t.shape[0]] = t
    return out


@dataclass(slots=True)
class LaneState:
    """One sequence's state: GDN conv tails and fp32 recurrent states, PLE conv tails and n-gram history,
    QSA caches of the trunk and of the MTP layer, and the number of tokens folded in."""

    gdn_conv: dict[int, torch.Tensor] = field(default_factory=dict)
    gdn_recurrent: dict[int, torch.Tensor] = field(default_factory=dict)
    ple_conv: dict[int, torch.Tensor] = field(default_factory=dict)
    ngram_history: torch.Tensor | None = None
    attention: dict[int, AttentionCache] = field(default_factory=dict)
    mtp_attention: AttentionCache | None = None
    length: int = 0
    mtp_length: int = 0
