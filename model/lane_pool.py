"""The kernel path's lane states at fixed addresses: one tensor per state and layer, a slot per lane.

A lane that enters a kernel forward is given a slot: its states are copied in and the lane keeps views of its slot,
which the kernels update in place (by each row's slot), so a round needs no stacking and a CUDA graph can replay
over any lanes. QSA caches hold `context` positions per slot. The last slot is scratch: padding rows of a graph's
batch bucket write there. A slot comes back when its lane is garbage collected. Growing the pool (more slots or a
longer context) moves every tensor, so it bumps `generation` (captured graphs are then stale).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence

import torch

from kernels.row_copy import RowCopier
from model.state import AttentionCache, KeptRow, LaneSnapshot, LaneState, restore, restore_positions

MTP = -1  # the cache key of the MTP layer's QSA cache
COPIERS = 16  # restore copiers kept (one a graph's kept stacks; an eager round's stacks are new each round)


class LanePool:
    """Slots for lanes' GDN conv and recurrent states, PLE conv tails and QSA caches, by layer index."""

    def __init__(
        self,
        template: LaneState,
        slots: int,
        context: int,
        ratio: int,
        block_keys: Mapping[int, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]],
    ) -> None:
        if slots < 1 or context < 1:
            raise ValueError(f"a lane pool needs at least one slot and one position, got {slots} and {context}")
        self.slots, self.ratio, self.generation = slots, ratio, 0
        self.context = self._whole_blocks(context)
        self._block_keys = block_keys  # by cache key: (raw index keys [B*ratio, Di], first positions [B]) -> [B, Di]
        self.gdn_conv = {i: _slots_of(t, slots) for i, t in template.gdn_conv.items()}
        self.gdn_recurrent = {i: _slots_of(t, slots) for i, t in template.gdn_recurrent.items()}
        self.ple_conv = {i: _slots_of(t, slots) for i, t in template.ple_conv.items()}
        caches = _caches(template)
        self.keys = {i: _rows_of(c.keys, slots, self.context) for i, c in caches.items()}
        self.values = {i: _rows_of(c.values, slots, self.context) for i, c in caches.items()}
        self.index_keys = {i: _rows_of(c.index_keys, slots, self.context) for i, c in caches.items()}
        self.block_keys = {i: _rows_of(c.index_keys, slots, self.block_capacity) for i, c in caches.items()}
        self.free = list(range(slots - 1, -1, -1))
        self.lanes: weakref.WeakValueDictionary[int, LaneState] = weakref.WeakValueDictionary()
        self.copiers: dict[tuple[int, int, int], RowCopier] = {}  # by kept stacks' ids: a graph's restores share one

    def _whole_blocks(self, context: int) -> int:
        """`context` rounded up to whole indexer blocks: a row's block never reaches past its slot."""
        return -(-context // self.ratio) * self.ratio

    @property
    def scratch(self) -> int:
        """The slot padding rows write to."""
        return self.slots

    @property
    def block_capacity(self) -> int:
        """Block-key rows per slot: every complete block of the context, plus a scratch row."""
        return self.context // self.ratio + 1

    def nbytes(self) -> int:
        """Bytes the pool holds."""
        groups = (self.gdn_conv, self.gdn_recurrent, self.ple_conv, self.keys, self.values, self.index_keys)
        tensors = [t for g in (*groups, self.block_keys) for t in g.values()]
        return sum(t.numel() * t.element_size() for t in tensors)

    def place(self, lanes: list[LaneState], end: int) -> None:
        """Give every lane without a slot one (growing the pool when none is free), with room up to position
        `end` in every slot."""
        if end > self.context:
            self._grow(self.slots, max(end, 2 * self.context))
        for lane in lanes:
            if lane.slot is None:
                if not self.free:
                    self._grow(2 * self.slots, self.context)
                self._adopt(lane, self.free.pop())

    def _adopt(self, lane: LaneState, slot: int) -> None:
        """Copy a lane's states into `slot` and rebind the lane to views of it."""
        for ours, theirs in (
            (self.gdn_conv, lane.gdn_conv),
            (self.gdn_recurrent, lane.gdn_recurrent),
            (self.ple_conv, lane.ple_conv),
        ):
            for i, t in theirs.items():
                ours[i][slot].copy_(t)
        for key, cache in _caches(lane).items():
            n = cache.length
            self.keys[key][slot, :n] = cache.keys[:n]
            self.values[key][slot, :n] = cache.values[:n]
            self.index_keys[key][slot, :n] = cache.index_keys[:n]
            blocks = min(cache.blocks, n // self.ratio)
            if blocks:
                self.block_keys[key][slot, :blocks] = cache.block_keys[:blocks]
            if n // self.ratio > blocks:  # blocks a copy left out derive from the raw keys
                lo, hi = blocks * self.ratio, n // self.ratio * self.ratio
                firsts = torch.arange(lo, hi, self.ratio, device=cache.keys.device)
                raw = self.index_keys[key][slot, lo:hi]
                self.block_keys[key][slot, blocks : n // self.ratio] = self._block_keys[key](raw, firsts)
        lane.slot = slot
        self._bind(lane)
        self.lanes[slot] = lane
        weakref.finalize(lane, self._release, slot)

    def restore(self, restores: Sequence[tuple[LaneState, LaneSnapshot]]) -> None:
        """`model.state.restore` of each (lane, snapshot): the lanes of this pool whose snapshots are rows of one
        forward's kept states (`KeptRow`s of one row) in one `copy_rows` launch for all their layers, any other
        lane as `restore` puts it back. The same bits either way: each state is copied as it is. A lane listed twice
        is refused before anything is copied. The copier of a forward's stacks is kept for the next restore from them
        (a graph's stacks are the same tensors every replay)."""
        if len({id(lane) for lane, _ in restores}) != len(restores):
            raise ValueError("LanePool.restore: a lane is listed twice")
        batches: dict[tuple[int, int, int], list[tuple[LaneState, LaneSnapshot]]] = {}
        for lane, snap in restores:
            rows = (snap.gdn_conv, snap.gdn_recurrent, snap.ple_conv)
            pooled = lane.slot is not None and self.lanes.get(lane.slot) is lane
            if pooled and all(isinstance(r, KeptRow) and r.row == rows[0].row for r in rows):
                batches.setdefault(tuple(id(r.stacks) for r in rows), []).append((lane, snap))
            else:
                restore(lane, snap)
        for key, batch in batches.items():
            first = batch[0][1]
            groups = ((self.gdn_conv, first.gdn_conv), (self.gdn_recurrent, first.gdn_recurrent),
                      (self.ple_conv, first.ple_conv))  # fmt: skip
            pairs = [(row.stacks[i], slots[i]) for slots, row in groups for i in row.stacks]
            copier = self.copiers.get(key)
            if copier is None or not copier.serves(pairs):  # made for other (or freed) tensors: make one anew
                if len(self.copiers) >= COPIERS:  # drop those of freed stacks first; all only if that made no room
                    self.copiers = {k: c for k, c in self.copiers.items() if not c.stale()}
                    if len(self.copiers) >= COPIERS:
                        self.copiers.clear()
                copier = self.copiers[key] = RowCopier(pairs)
            copier([(snap.gdn_conv.row, lane.slot) for lane, snap in batch])
            for lane, snap in batch:
                restore_positions(lane, snap)

    def _release(self, slot: int) -> None:
        """A collected lane's slot is free again."""
        self.free.append(slot)

    def _bind(self, lane: LaneState) -> None:
        """Point a placed lane's states at its slot."""
        slot = lane.slot
        lane.gdn_conv = {i: t[slot] for i, t in self.gdn_conv.items()}
        lane.gdn_recurrent = {i: t[slot] for i, t in self.gdn_recurrent.items()}
        lane.ple_conv = {i: t[slot] for i, t in self.ple_conv.items()}
        for key, cache in _caches(lane).items():
            bound = AttentionCache(
                self.keys[key][slot],
                self.values[key][slot],
                self.index_keys[key][slot],
                cache.length,
                self.block_keys[key][slot],
                cache.length // self.ratio,
                fixed=True,
            )
            if key == MTP:
                lane.mtp_attention = bound
            else:
                lane.attention[key] = bound

    def _grow(self, slots: int, context: int) -> None:
        """Reallocate every tensor for `slots` slots of `context` positions, keeping what the slots hold."""
        old_slots, old_blocks = self.slots, self.block_capacity
        self.slots, self.context = slots, self._whole_blocks(context)
        for group in (self.gdn_conv, self.gdn_recurrent, self.ple_conv):
            for i, t in group.items():
                group[i] = _resized(t, slots + 1, None, old_slots)
        for group in (self.keys, self.values, self.index_keys):
            for i, t in group.items():
                group[i] = _resized(t, slots + 1, self.context, old_slots)
        for i, t in self.block_keys.items():
            self.block_keys[i] = _resized(t, slots + 1, self.block_capacity, old_slots, old_blocks - 1)
        self.free = list(range(slots - 1, old_slots - 1, -1)) + self.free
        self.generation += 1
        for lane in list(self.lanes.values()):
            self._bind(lane)


def _caches(lane: LaneState) -> dict[int, AttentionCache]:
    """A lane's QSA caches by cache key (the MTP layer's under MTP)."""
    caches = dict(lane.attention)
    if lane.mtp_attention is not None:
        caches[MTP] = lane.mtp_attention
    return caches


def _slots_of(t: torch.Tensor, slots: int) -> torch.Tensor:
    """Zeroed [slots + 1, *t.shape] (the last slot is scratch)."""
    return t.new_zeros((slots + 1, *t.shape))


def _rows_of(t: torch.Tensor, slots: int, rows: int) -> torch.Tensor:
    """Zeroed [slots + 1, rows, *t.shape[1:]]: `rows` positions of a per-position tensor for every slot."""
    return t.new_zeros((slots + 1, rows, *t.shape[1:]))


def _resized(t: torch.Tensor, slots: int, rows: int | None, kept: int, kept_rows: int | None = None) -> torch.Tensor:
    """A zeroed tensor of `slots` slots (and `rows` positions) holding t's first `kept` slots (and rows)."""
    shape = (slots, *t.shape[1:]) if rows is None else (slots, rows, *t.shape[2:])
    out = t.new_zeros(shape)
    if rows is None:
        out[:kept] = t[:kept]
    else:
        n = t.shape[1] if kept_rows is None else kept_rows
        out[:kept, :n] = t[:kept, :n]
    return out
