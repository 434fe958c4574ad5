"""The PLE layer's n-gram hash in one launch: each row's table rows from its token window (model/ple.py's
`ngram_row_ids`, as the kernel path forms it from windows: `ngram_rows_reference`).

A row's window [n] holds its last n tokens, oldest first. A token at or before the window's last earlier eos counts
as eos; order s (0 = the row's own token) mixes the xor of token·multiplier[s] over orders 0..s, and head h of order
s = h // heads_per_ngram + 1 takes mixed_s mod modulus[h] + offset[h]. All in int64 on non-negative values (the
multipliers keep every product below 2^63), so the GPU's and the interpreter's remainders agree.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.pdl import enter, launch_options

BLOCK_ROWS = 32


@triton.jit
def _ngram_rows_kernel(
    win_ptr, mult_ptr, mod_ptr, off_ptr, out_ptr, N, stride_w, base, eos, WIDTH: tl.constexpr,
    HEADS_PER: tl.constexpr, LO: tl.constexpr, HI: tl.constexpr, H_POW2: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """BLOCK rows: table rows of heads [LO, HI) minus `base` (the rank's first local row)."""
    enter(PDL)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < N
    at = win_ptr + rows.to(tl.int64) * stride_w
    last_eos = tl.full((BLOCK,), -1, tl.int32)
    for c in tl.static_range(WIDTH - 1):  # the last earlier column holding eos wins
        last_eos = tl.where(tl.load(at + c, mask=ok, other=0) == eos, c, last_eos)
    heads = LO + tl.arange(0, H_POW2)
    live = heads < HI
    order = heads // HEADS_PER + 1
    mixed = tl.zeros((BLOCK,), tl.int64)
    picked = tl.zeros((BLOCK, H_POW2), tl.int64)
    for s in tl.static_range(WIDTH):
        col = WIDTH - 1 - s
        token = tl.where(last_eos < col, tl.load(at + col, mask=ok, other=0).to(tl.int64), eos)
        mixed = mixed ^ (token * tl.load(mult_ptr + s))
        picked = tl.where((order == s)[None, :], mixed[:, None], picked)
    modulus = tl.load(mod_ptr + heads, mask=live, other=1)
    offset = tl.load(off_ptr + heads, mask=live, other=0)
    out = picked % modulus[None, :] + offset[None, :] - base
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * (HI - LO) + (heads - LO)[None, :], out,
             mask=ok[:, None] & live[None, :])  # fmt: skip


def ngram_rows(
    windows: torch.Tensor, eos: int, multipliers: torch.Tensor, moduli: torch.Tensor, offsets: torch.Tensor,
    heads_per_ngram: int, heads: tuple[int, int], base: int = 0,
) -> torch.Tensor:  # fmt: skip
    """Table rows [N, hi - lo] int64 of heads [lo, hi) for windows [N, n] (int64 tokens, oldest first), minus base;
    multipliers [n], moduli and offsets [heads] int64 on the windows' device."""
    n, width = windows.shape
    lo, hi = heads
    if windows.dtype != torch.int64 or windows.stride(1) != 1:
        raise ValueError(f"windows: expected int64 [N, n] with contiguous columns, got {windows.dtype}")
    if multipliers.shape != (width,) or multipliers.dtype != torch.int64:
        raise ValueError(f"multipliers: expected int64 [{width}], got {multipliers.dtype} {tuple(multipliers.shape)}")
    if not 0 <= lo < hi <= moduli.shape[0] or hi > (width - 1) * heads_per_ngram:
        raise ValueError(f"heads: ({lo}, {hi}) outside the {(width - 1) * heads_per_ngram} heads")
    out = torch.empty(n, hi - lo, dtype=torch.int64, device=windows.device)
    if n:
        _ngram_rows_kernel[(triton.cdiv(n, BLOCK_ROWS),)](
            windows, multipliers, moduli, offsets, out, n, windows.stride(0), base, eos, WIDTH=width,
            HEADS_PER=heads_per_ngram, LO=lo, HI=hi, H_POW2=triton.next_power_of_2(hi - lo), BLOCK=BLOCK_ROWS,
            num_warps=4, **launch_options(_ngram_rows_kernel, windows.device),
        )  # fmt: skip
    return out


def ngram_rows_reference(
    windows: torch.Tensor, eos: int, multipliers: list[int], moduli: torch.Tensor, offsets: torch.Tensor,
    heads_per_ngram: int,
) -> torch.Tensor:  # fmt: skip
    """Table rows [N, heads] of every head for windows [N, n], with torch ops (the kernel path's earlier form)."""
    width = windows.shape[1]
    marks = torch.where(windows[:, :-1] == eos, torch.arange(width - 1, device=windows.device), -1)
    last_eos = torch.cat((torch.full_like(windows[:, :1], -1), marks), dim=1).amax(dim=1)  # -1: no earlier eos
    mixed, blocks = None, []
    for shift, mult in enumerate(multipliers):
        col = width - 1 - shift
        token = torch.where(last_eos < col, windows[:, col], eos)
        term = token * mult
        mixed = term if mixed is None else torch.bitwise_xor(mixed, term)
        if shift >= 1:
            sl = slice((shift - 1) * heads_per_ngram, shift * heads_per_ngram)
            blocks.append(torch.remainder(mixed[:, None], moduli[None, sl]) + offsets[None, sl])
    return torch.cat(blocks, dim=-1)
