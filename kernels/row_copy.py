"""Rows of many tensors copied in one launch: the lane pool's restore of every lane a verify round rejected drafts of
(model/lane_pool.py), one launch whatever the lanes and layers, where a copy per lane and tensor took thousands.

`copy_rows(pairs, rows)` takes (source, destination) tensor pairs, each two stacks along dim 0 of contiguous rows of
one shape and dtype, and (source row, destination row) pairs that apply to every tensor pair. Each destination row
gets its source row's bytes, moved as 32-bit words (16-bit or single bytes where a row's size, stride or address is
not a multiple of 4), so every bit is kept, NaN payloads included. No two copies may touch one byte: a destination
tensor appears once and is no source, its rows do not overlap, and a destination row appears once. One program
copies up to CHUNK words of one row of one tensor pair: the grid is (the chunks of every pair's row, the rows). The
tensors' addresses go to the kernel in a table, so sources and destinations must stay allocated until the launch has
run (stream order: a tensor freed after the call is reused only by later work on its stream).
"""

from __future__ import annotations

import functools
import itertools
import math
import weakref
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kernels.host import to_device
from kernels.pdl import enter, launch_options

CHUNK = 4096  # words one program copies
_WORD_TYPES = {4: tl.int32, 2: tl.int16, 1: tl.int8}


@triton.jit
def _copy_rows_kernel(table_ptr, chunk_pair_ptr, rows_ptr, WORD: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
    """Chunk program_id(0) of its tensor pair's row, for row pair program_id(1): destination row = source row. A table
    row: source and destination addresses, their row strides in words, words a row, the tensor pair's first chunk."""
    chunk = tl.program_id(0)
    row_pair = tl.program_id(1)
    enter(PDL)
    entry = table_ptr + tl.load(chunk_pair_ptr + chunk).to(tl.int64) * 6
    src_base = tl.load(entry).to(tl.pointer_type(WORD))
    dst_base = tl.load(entry + 1).to(tl.pointer_type(WORD))
    words = tl.load(entry + 4)
    offs = (chunk - tl.load(entry + 5)) * CHUNK + tl.arange(0, CHUNK)
    ok = offs < words
    src = src_base + tl.load(rows_ptr + 2 * row_pair) * tl.load(entry + 2) + offs
    dst = dst_base + tl.load(rows_ptr + 2 * row_pair + 1) * tl.load(entry + 3) + offs
    tl.store(dst, tl.load(src, mask=ok), mask=ok)


def _rows_contiguous(t: torch.Tensor) -> bool:
    """Whether each row of a stack is contiguous in memory (its strides those of a contiguous row)."""
    if t.is_contiguous():
        return True
    expected = 1
    for size, stride in reversed(list(zip(t.shape[1:], t.stride()[1:], strict=True))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _layout(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[int, int, int, int, int]]:
    """Each pair's (source address, destination address, their row strides and a row, in bytes), in one pass;
    refuses, saying why, a pair `copy_rows` cannot copy or copies that would touch one byte twice."""
    layout, sources, destinations, devices = [], [], [], set()
    for j, (src, dst) in enumerate(pairs):
        if src.dim() < 1 or dst.dim() < 1 or src.shape[0] == 0 or dst.shape[0] == 0:
            raise ValueError(f"copy_rows: pair {j} is not two stacks of rows")
        if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
            raise ValueError(f"copy_rows: pair {j} has rows {tuple(src.shape[1:])} {src.dtype} and "
                             f"{tuple(dst.shape[1:])} {dst.dtype}")  # fmt: skip
        if not (_rows_contiguous(src) and _rows_contiguous(dst)):
            raise ValueError(f"copy_rows: pair {j} has rows that are not contiguous")
        size = src.element_size()
        row = math.prod(src.shape[1:]) * size
        dst_stride = dst.stride(0) * size
        if dst.shape[0] > 1 and abs(dst_stride) < row:
            raise ValueError(f"copy_rows: pair {j}'s destination rows overlap")
        layout.append((src.data_ptr(), dst.data_ptr(), src.stride(0) * size, dst_stride, row))
        sources.append(src.untyped_storage().data_ptr())
        destinations.append(dst.untyped_storage().data_ptr())
        devices.update((src.device, dst.device))
    if len(devices) > 1:
        raise ValueError(f"copy_rows: the tensors are on {len(devices)} devices, not one")
    if len(set(destinations)) != len(destinations):
        raise ValueError("copy_rows: two pairs share a destination storage")
    shared = set(sources) & set(destinations)
    if shared:
        j = next(j for j, storage in enumerate(sources) if storage in shared)
        raise ValueError(f"copy_rows: pair {j}'s source shares a storage with a destination")
    return layout


def _stack_rows(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[int, int]:
    """Rows of the shortest source and destination stack (none without pairs)."""
    return (min(s.shape[0] for s, _ in pairs), min(d.shape[0] for _, d in pairs)) if pairs else (0, 0)


def _check_rows(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], rows: Sequence[tuple[int, int]]) -> None:
    """Refuse row pairs outside a stack, or a destination row named twice."""
    _check_row_range(_stack_rows(pairs), rows)


def _check_row_range(stack_rows: tuple[int, int], rows: Sequence[tuple[int, int]]) -> None:
    """Refuse row pairs outside stacks of (source, destination) rows, or a destination row named twice."""
    if not rows or not stack_rows[0]:
        return
    sources, targets = zip(*rows, strict=True)
    if min(sources) < 0 or max(sources) >= stack_rows[0]:
        raise ValueError(f"copy_rows: a source row of {sorted(set(sources))} is outside a source stack")
    if min(targets) < 0 or max(targets) >= stack_rows[1]:
        raise ValueError(f"copy_rows: a destination row of {sorted(set(targets))} is outside a destination stack")
    if len(set(targets)) != len(targets):
        raise ValueError("copy_rows: a destination row appears twice")


def _word(layout: list[tuple[int, int, int, int, int]]) -> int:
    """The widest of 4, 2 and 1 bytes that divides every address, stride and row size of a layout."""
    bits = 0
    for entry in layout:
        for value in entry:
            bits |= value
    return 4 if bits % 4 == 0 else 2 if bits % 2 == 0 else 1


def word_bytes(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """The kernel's word for these pairs: the widest of 4, 2 and 1 bytes that divides every row's size, stride and
    address."""
    return _word(_layout(pairs))


class RowCopier:
    """`copy_rows` for fixed tensor pairs: checked and tabled once (a model's restores copy the same hundred-odd
    pairs every round), then each call copies its row pairs in one launch. It holds the tensors only weakly, and
    `serves` says whether it was made for these very tensors."""

    def __init__(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        layout = _layout(pairs)
        self.refs = [(weakref.ref(src), weakref.ref(dst)) for src, dst in pairs]
        self.stack_rows = _stack_rows(pairs)
        self.table: torch.Tensor | None = None
        if not pairs:
            return
        self.width = _word(layout)
        words = tuple(row // self.width for *_, row in layout)
        self.device = pairs[0][0].device
        self.chunk_of, firsts = _chunk_map(words, self.device)
        entries = [
            [src, dst, src_stride // self.width, dst_stride // self.width, n, first]
            for (src, dst, src_stride, dst_stride, _), n, first in zip(layout, words, firsts, strict=True)
        ]
        self.table = to_device(self.device, entries, torch.int64)

    def serves(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> bool:
        """Whether these are the pairs it was made for, the same tensor objects in the same order, all alive."""
        return len(pairs) == len(self.refs) and all(
            src_ref() is src and dst_ref() is dst
            for (src_ref, dst_ref), (src, dst) in zip(self.refs, pairs, strict=True)
        )

    def stale(self) -> bool:
        """Whether its first source is gone: it can serve no pairs again (an eager round's stacks, after the round)."""
        return bool(self.refs) and self.refs[0][0]() is None

    def __call__(self, rows: Sequence[tuple[int, int]]) -> None:
        """dst[d] = src[s] for every pair and every (source row, destination row), in one launch."""
        _check_row_range(self.stack_rows, rows)
        if self.table is None or not rows:
            return
        row_pairs = to_device(self.device, list(itertools.chain.from_iterable(rows)), torch.int64)
        _copy_rows_kernel[(self.chunk_of.shape[0], len(rows))](
            self.table, self.chunk_of, row_pairs, WORD=_WORD_TYPES[self.width], CHUNK=CHUNK,
            **launch_options(_copy_rows_kernel, self.device),
        )  # fmt: skip


def copy_rows(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], rows: Sequence[tuple[int, int]]) -> None:
    """For every (source, destination) tensor pair and every (source row, destination row): dst[d] = src[s], bit for
    bit, in one launch (nothing when either list is empty)."""
    RowCopier(pairs)(rows)


@functools.cache
def _chunk_map(words: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, tuple[int, ...]]:
    """For rows of `words` words a pair: each chunk's tensor pair (int32 on `device`, copied before this returns, so
    any stream may read it) and each pair's first chunk; made once per shape, as a model's restores all have one."""
    chunks = [triton.cdiv(n, CHUNK) for n in words]
    firsts = tuple(itertools.accumulate(chunks, initial=0))[:-1]
    pair_of = [j for j, n in enumerate(chunks) for _ in range(n)]
    return torch.tensor(pair_of, dtype=torch.int32).to(device), firsts


def copy_rows_reference(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], rows: Sequence[tuple[int, int]]) -> None:
    """`copy_rows` by torch copies, one a row and pair."""
    _layout(pairs)
    _check_rows(pairs, rows)
    for src, dst in pairs:
        for s, d in rows:
            dst[d].copy_(src[s])
