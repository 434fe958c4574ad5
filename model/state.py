"""Per-lane state: everything one sequence carries from one forward to the next."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class AttentionCache:
    """A QSA layer's keys (normed, RoPE'd), values and raw indexer keys, one row per absolute position. The kernel
    path also keeps the indexer's keys of the first `blocks` complete blocks; they derive from the raw keys, so a
    copy leaves them out and the next kernel forward rebuilds them."""

    keys: torch.Tensor
    values: torch.Tensor
    index_keys: torch.Tensor
    length: int = 0
    block_keys: torch.Tensor | None = None
    blocks: int = 0
    fixed: bool = False  # a lane pool's slot: its buffers never move, so it cannot grow

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
            if self.fixed:
                raise ValueError(f"attention cache write up to {end} exceeds its slot's {self.keys.shape[0]} positions")
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


@dataclass(slots=True, weakref_slot=True)
class LaneState:
    """One sequence's state: GDN conv tails and fp32 recurrent states, PLE conv tails and n-gram history,
    QSA caches of the trunk and of the MTP layer, and the number of tokens folded in. On the kernel path a lane
    holds a lane-pool slot (`slot`) and its tensors are views of it, updated in place."""

    gdn_conv: dict[int, torch.Tensor] = field(default_factory=dict)
    gdn_recurrent: dict[int, torch.Tensor] = field(default_factory=dict)
    ple_conv: dict[int, torch.Tensor] = field(default_factory=dict)
    ngram_history: torch.Tensor | None = None
    attention: dict[int, AttentionCache] = field(default_factory=dict)
    mtp_attention: AttentionCache | None = None
    length: int = 0
    mtp_length: int = 0
    mtp_pending: torch.Tensor | None = None  # the last folded row's wide state, until its next token is known
    slot: int | None = None  # the lane-pool slot its tensors view (kernel path), or None: tensors of its own


class KeptRow(Mapping[int, torch.Tensor]):
    """One row of a forward's kept states by layer, `stacks[i][row]`, each viewed only when read: a verify round keeps
    the states after every row of every window, of which a restore reads one a lane (and the pool's restore none:
    it copies from the stacks by row, `LanePool.restore`)."""

    __slots__ = ("row", "stacks")

    def __init__(self, stacks: Mapping[int, torch.Tensor], row: int) -> None:
        self.stacks, self.row = stacks, row

    def __getitem__(self, layer: int) -> torch.Tensor:
        return self.stacks[layer][self.row]

    def __iter__(self) -> Iterator[int]:
        return iter(self.stacks)

    def __len__(self) -> int:
        return len(self.stacks)


@dataclass(frozen=True, slots=True)
class LaneSnapshot:
    """The part of a lane's state that cannot be cut back by position: recurrent and conv states, the n-gram
    history, and the token count (QSA caches are truncated to it on restore)."""

    gdn_conv: Mapping[int, torch.Tensor]
    gdn_recurrent: Mapping[int, torch.Tensor]
    ple_conv: Mapping[int, torch.Tensor]
    ngram_history: torch.Tensor
    length: int


def snapshot(lane: LaneState) -> LaneSnapshot:
    """What a restore needs: references to a lane's own tensors (the reference forward replaces them, never writes
    in place), copies of a pooled lane's (the kernels update its slot in place)."""
    take = dict if lane.slot is None else (lambda states: {i: t.clone() for i, t in states.items()})
    return LaneSnapshot(
        gdn_conv=take(lane.gdn_conv),
        gdn_recurrent=take(lane.gdn_recurrent),
        ple_conv=take(lane.ple_conv),
        ngram_history=lane.ngram_history,
        length=lane.length,
    )


def restore(lane: LaneState, snap: LaneSnapshot) -> None:
    """Put a lane back to a snapshot: rows folded after it leave no trace (a pooled lane's slot is written over)."""
    if lane.slot is None:
        lane.gdn_conv, lane.gdn_recurrent, lane.ple_conv = (
            dict(snap.gdn_conv),
            dict(snap.gdn_recurrent),
            dict(snap.ple_conv),
        )
    else:
        for ours, theirs in (
            (lane.gdn_conv, snap.gdn_conv),
            (lane.gdn_recurrent, snap.gdn_recurrent),
            (lane.ple_conv, snap.ple_conv),
        ):
            for i, t in theirs.items():
                ours[i].copy_(t)
    restore_positions(lane, snap)


def restore_positions(lane: LaneState, snap: LaneSnapshot) -> None:
    """The part of `restore` that is bookkeeping: the n-gram history, the token count and the QSA caches' lengths."""
    lane.ngram_history = snap.ngram_history
    lane.length = snap.length
    for cache in lane.attention.values():
        cache.length = min(cache.length, snap.length)


def slot_state_bytes(template: LaneState, context: int, ratio: int) -> int:
    """Bytes one lane of `context` positions takes (a lane-pool slot exactly; the reference path keeps no block
    keys), from a fresh lane's tensors (this rank's shapes): fixed states, then per position QSA keys, values and
    raw index keys, and per block an index key."""
    fixed = [*template.gdn_conv.values(), *template.gdn_recurrent.values(), *template.ple_conv.values()]
    caches = [c for c in (*template.attention.values(), template.mtp_attention) if c is not None]
    row = sum(t[0].numel() * t.element_size() for c in caches for t in (c.keys, c.values, c.index_keys))
    block = sum(c.index_keys[0].numel() * c.index_keys.element_size() for c in caches)
    return sum(t.numel() * t.element_size() for t in fixed) + context * row + (context // ratio + 1) * block


def _copy_cache(cache: AttentionCache | None, share: bool, limit: int | None = None) -> AttentionCache | None:
    if cache is None:
        return None
    n = cache.length if limit is None else min(cache.length, limit)
    parts = (cache.keys[:n], cache.values[:n], cache.index_keys[:n])
    return AttentionCache(*(parts if share else (t.clone() for t in parts)), n)


def copy_lane(lane: LaneState, share_caches: bool = False, at: LaneSnapshot | None = None) -> LaneState:
    """A copy holding exactly the lane's folded prefix, or with `at` the prefix up to that snapshot of it (its
    states, the QSA caches cut to its length). With `share_caches` the QSA caches are views of the lane's own rows
    instead of copies: a lane only ever writes at or past its length, so the prefix a kept state sees never changes;
    whoever resumes from it copies (two lanes must never write into one buffer). A pooled lane's caches are always
    copied: its slot goes to another lane once it is gone."""
    states = at or lane
    limit = None if at is None else at.length
    share_caches = share_caches and lane.slot is None
    return LaneState(
        gdn_conv={i: t.clone() for i, t in states.gdn_conv.items()},
        gdn_recurrent={i: t.clone() for i, t in states.gdn_recurrent.items()},
        ple_conv={i: t.clone() for i, t in states.ple_conv.items()},
        ngram_history=states.ngram_history.clone(),
        attention={i: _copy_cache(c, share_caches, limit) for i, c in lane.attention.items()},
        mtp_attention=_copy_cache(lane.mtp_attention, share_caches),
        length=states.length,
        mtp_length=lane.mtp_length,
        mtp_pending=None if lane.mtp_pending is None else lane.mtp_pending.clone(),
    )


def lane_bytes(lane: LaneState) -> int:
    """Bytes a lane's tensors hold; a cache counts its whole buffer (a kept state's views keep the lane's buffer
    alive, so this errs on the side of the budget when states share one)."""
    tensors = [*lane.gdn_conv.values(), *lane.gdn_recurrent.values(), *lane.ple_conv.values(), lane.ngram_history]
    if lane.mtp_pending is not None:
        tensors.append(lane.mtp_pending)
    caches = [c for c in (*lane.attention.values(), lane.mtp_attention) if c is not None]
    kept = [t for c in caches for t in (c.keys, c.values, c.index_keys, c.block_keys) if t is not None]
    buffers = [t.untyped_storage().nbytes() for t in kept]
    return sum(t.numel() * t.element_size() for t in tensors) + sum(buffers)
