"""Rotary position embedding (rotate-half pairing) in one launch, its result written to rows or into a cache.

`rope` rotates the first `rot` = 2·len(inv_freq) dims of every head of x [N, H, D] (or [N, D]) by its row's position
and passes the other dims through, with the bits of the model's `apply_rope(x, *rope_cos_sin(positions, rot, theta,
x.dtype))`; `scatter_rows` copies rows into a cache. Each element is computed as that reference does, in this order
(act = x's dtype, bf16 or fp32; every rounding to nearest even; "act(...)" a rounding only when act is bf16):
  inv_freq[j] = 1 / theta^(2j / rot)            fp32, by torch (`rope_inv_freq`, computed once by the caller)
  f = fp32(position) · inv_freq[j]              one fp32 product
  c = act(cos f), s = act(sin f)                cos/sin in fp32
  out[j]        = act(act(x[j] · c) + act(-x[j + rot/2] · s))    for j < rot/2, the sum in fp32
  out[j + rot/2] = act(act(x[j + rot/2] · c) + act(x[j] · s))
  out[d] = x[d] for d >= rot.
No multiply is fused into an add (fp fusion is off). A row's bits depend on nothing but its own inputs.

Guaranteed bits. On the GPU cos/sin are libdevice's __nv_cosf/__nv_sinf, the functions torch's CUDA cos/sin of
fp32 compute, so every element equals the torch CUDA reference bit for bit (this rests on those two calling one
function; the tests run under the interpreter only). Under TRITON_INTERPRET=1 cos/sin are
numpy's fp32 ones, which can differ from torch CPU's in the last place; everything else (the product, the roundings,
the rotation, the pass-through) is exact there too, so an element equals the reference given the same cos/sin tables,
and the reference built on torch's tables wherever numpy's and torch's tables agree.

Cache form: with `dest` [S, C, H, D] (or [S, C, D] for one head) and `slot_of_row` [N], row i goes to
dest[slot_of_row[i], dest_index[i]] (dest_index defaults to positions), as `dest[slot_of_row, dest_index] = rows`
would, and `rope` returns dest itself. Indices are not checked: they must lie in dest, and (slot, index) pairs must be
distinct, and no output may overlap the input. Inputs may have any row and head strides with the last dim
contiguous; so may out and dest.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels.fp32_ops import round_to_act
from kernels.norm import NUM_WARPS as NORM_WARPS
from kernels.norm import _norm_weight, _rstd, _sum_squares, _tile_rows, block_c, program_rows, row_groups
from kernels.pdl import enter, launch_options

# The interpreter truncates fp32 -> bf16 casts, so there rounding is done on the bits.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TILE = 4096
MAX_PASS = 256
NUM_WARPS = 4
INTERPRET_ROWS = 16  # rows a program takes under the interpreter, which runs them one by one (no bits change)


def rope_inv_freq(rotary_dim: int, theta: float, device: torch.device | str) -> torch.Tensor:
    """The fp32 inverse frequencies [rotary_dim / 2], computed by torch as `rope_cos_sin` does."""
    if rotary_dim < 2 or rotary_dim % 2:
        raise ValueError(f"rotary_dim: expected an even number >= 2, got {rotary_dim}")
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float, device=device) / rotary_dim))


@triton.jit
def _cos_sin(f, INTERPRET: tl.constexpr):
    """(cos f, sin f) in fp32: libdevice's cosf/sinf on the GPU, numpy's under the interpreter."""
    if INTERPRET:
        return tl.cos(f), tl.sin(f)
    else:
        return libdevice.cos(f), libdevice.sin(f)


@triton.jit
def _rotate_store(x1, x2, cos, sin, out_at, j, mask, half, ACT_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """Store the rotate-half pair (x1, x2) turned by (cos, sin), each product and sum rounded as the model does."""
    a1 = round_to_act(x1 * cos, ACT_BF16, INTERPRET).to(tl.float32)
    b1 = round_to_act(-x2 * sin, ACT_BF16, INTERPRET).to(tl.float32)
    a2 = round_to_act(x2 * cos, ACT_BF16, INTERPRET).to(tl.float32)
    b2 = round_to_act(x1 * sin, ACT_BF16, INTERPRET).to(tl.float32)
    tl.store(out_at + j, round_to_act(a1 + b1, ACT_BF16, INTERPRET), mask=mask)
    tl.store(out_at + half + j, round_to_act(a2 + b2, ACT_BF16, INTERPRET), mask=mask)


@triton.jit
def _rope_kernel(
    x_ptr,
    pos_ptr,
    inv_ptr,
    out_ptr,
    slot_ptr,
    index_ptr,
    N,
    H,
    D,
    half,
    stride_xn,
    stride_xh,
    stride_os,
    stride_oc,
    stride_oh,
    ROTATE: tl.constexpr,
    SCATTER: tl.constexpr,
    ACT_BF16: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_P: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    """ROWS rows, BLOCK_H heads: rotate the first 2·half dims (ROTATE; else half is 0), copy the rest, to out[n] or
    the row's cache entry."""
    enter(PDL)
    n = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    n_ok = n < N
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = n_ok[:, None, None] & (heads < H)[None, :, None]
    x_at = x_ptr + n[:, None, None] * stride_xn + heads.to(tl.int64)[None, :, None] * stride_xh
    if SCATTER:
        slot = tl.load(slot_ptr + n, mask=n_ok, other=0).to(tl.int64)
        out_row = out_ptr + slot * stride_os + tl.load(index_ptr + n, mask=n_ok, other=0).to(tl.int64) * stride_oc
    else:
        out_row = out_ptr + n * stride_os
    out_at = out_row[:, None, None] + heads.to(tl.int64)[None, :, None] * stride_oh
    if ROTATE:
        j = tl.arange(0, BLOCK_HALF)
        pos = tl.load(pos_ptr + n, mask=n_ok, other=0).to(tl.float32)
        f = pos[:, None] * tl.load(inv_ptr + j, mask=j < half, other=0.0)[None, :]
        cos, sin = _cos_sin(f, INTERPRET)
        cos = round_to_act(cos, ACT_BF16, INTERPRET).to(tl.float32)[:, None, :]
        sin = round_to_act(sin, ACT_BF16, INTERPRET).to(tl.float32)[:, None, :]
        mask = ok & (j < half)[None, None, :]
        x1 = tl.load(x_at + j[None, None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_at + half + j[None, None, :], mask=mask, other=0.0).to(tl.float32)
        _rotate_store(x1, x2, cos, sin, out_at, j[None, None, :], mask, half, ACT_BF16, INTERPRET)
    for c0 in range(2 * half, D, BLOCK_P):
        cols = c0 + tl.arange(0, BLOCK_P)
        keep = ok & (cols < D)[None, None, :]
        tl.store(out_at + cols[None, None, :], tl.load(x_at + cols[None, None, :], mask=keep), mask=keep)


@triton.jit
def _normed(x_ptr, w_ptr, offs, grp, stride_wg, cols, mask, rstd, ACT_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """The zc norm's output at `cols` of each pair, rounded to act and widened again (the norm kernel's bits)."""
    x = tl.load(x_ptr + offs[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + grp[:, None] * stride_wg + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    return round_to_act(x * rstd[:, None] * (1.0 + w), ACT_BF16, INTERPRET).to(tl.float32)


@triton.jit(do_not_specialize=["R"])
def _norm_rope_kernel(
    x_ptr,
    w_ptr,
    pos_ptr,
    inv_ptr,
    out_ptr,
    slot_ptr,
    index_ptr,
    G,
    R,
    C,
    half,
    stride_xm,
    stride_xg,
    stride_wg,
    stride_os,
    stride_oc,
    stride_oh,
    eps,
    SCATTER: tl.constexpr,
    ACT_BF16: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    """BLOCK_R (row, head) pairs: the zc norm of `_zc_norm_kernel` (its tile, its sums), then `_rope_kernel`'s
    rotation of the normed values, to out [M, G, C] or the row's cache entry."""
    enter(PDL)
    r, offs, ok, grp = _tile_rows(G, R, stride_xm, stride_xg, BLOCK_R)
    rstd = _rstd(_sum_squares(x_ptr, offs, ok, C, BLOCK_R, BLOCK_C), C, eps)
    n = r // G
    if SCATTER:
        slot = tl.load(slot_ptr + n, mask=ok, other=0).to(tl.int64)
        entry = tl.load(index_ptr + n, mask=ok, other=0).to(tl.int64)
        out_at = out_ptr + slot * stride_os + entry * stride_oc + grp * stride_oh
    else:
        out_at = out_ptr + r * C
    j = tl.arange(0, BLOCK_HALF)
    mask = ok[:, None] & (j < half)[None, :]
    x1 = _normed(x_ptr, w_ptr, offs, grp, stride_wg, j, mask, rstd, ACT_BF16, INTERPRET)
    x2 = _normed(x_ptr, w_ptr, offs, grp, stride_wg, half + j, mask, rstd, ACT_BF16, INTERPRET)
    f = tl.load(pos_ptr + n, mask=ok, other=0).to(tl.float32)[:, None] * tl.load(inv_ptr + j, mask=j < half, other=0.0)
    cos, sin = _cos_sin(f, INTERPRET)
    cos = round_to_act(cos, ACT_BF16, INTERPRET).to(tl.float32)
    sin = round_to_act(sin, ACT_BF16, INTERPRET).to(tl.float32)
    _rotate_store(x1, x2, cos, sin, out_at[:, None], j[None, :], mask, half, ACT_BF16, INTERPRET)
    for c0 in range(2 * half, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        keep = ok[:, None] & (cols < C)[None, :]
        rest = _normed(x_ptr, w_ptr, offs, grp, stride_wg, cols, keep, rstd, ACT_BF16, INTERPRET)
        tl.store(out_at[:, None] + cols[None, :], round_to_act(rest, ACT_BF16, INTERPRET), mask=keep)


def _heads(x: torch.Tensor, name: str) -> torch.Tensor:
    """x as [N, H, D] (a [N, D] tensor is one head), bf16 or fp32, the last dim contiguous."""
    if x.dim() == 2:
        x = x.unsqueeze(1)
    if x.dim() != 3 or (x.stride(2) != 1 and x.shape[2] > 1):
        raise ValueError(f"{name}: expected [N, D] or [N, H, D] with a contiguous last dim, got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"{name}: expected bf16 or fp32, got {x.dtype}")
    return x


def _indices(t: torch.Tensor, n: int, name: str) -> None:
    """Raise unless t is a contiguous int32/int64 [n]."""
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}: expected int32 or int64, got {t.dtype}")
    if t.shape != (n,) or not t.is_contiguous():
        raise ValueError(f"{name}: expected contiguous [{n}], got {tuple(t.shape)}")


def _cache(
    dest: torch.Tensor, x3: torch.Tensor, slot_of_row: torch.Tensor | None, index: torch.Tensor, index_name: str
) -> torch.Tensor:
    """dest as [S, C, H, D] (a [S, C, D] cache has one head), checked against x3 [N, H, D] and the indices."""
    dest4 = dest.unsqueeze(2) if dest.dim() == 3 else dest
    if dest4.dim() != 4 or dest4.shape[2:] != x3.shape[1:] or (dest4.stride(3) != 1 and dest4.shape[3] > 1):
        want = f"[S, C, {x3.shape[1]}, {x3.shape[2]}]" + (f" or [S, C, {x3.shape[2]}]" if x3.shape[1] == 1 else "")
        raise ValueError(f"dest: expected {want} with a contiguous last dim, got {tuple(dest.shape)}")
    if dest.dtype != x3.dtype:
        raise TypeError(f"dest: dtype {dest.dtype} differs from the rows' {x3.dtype}")
    if slot_of_row is None:
        raise ValueError("slot_of_row: required with dest")
    _indices(slot_of_row, x3.shape[0], "slot_of_row")
    _indices(index, x3.shape[0], index_name)
    return dest4


def _launch(
    x3: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor | None,
    out4: torch.Tensor,
    slot_of_row: torch.Tensor | None,
    index: torch.Tensor | None,
) -> None:
    """One launch over x3's N rows into out4 ([N, 1, H, D] rows, or a cache [S, C, H, D] with slot_of_row/index)."""
    if len({t.device for t in (x3, positions, out4, inv_freq, slot_of_row, index) if t is not None}) != 1:
        raise ValueError("every tensor must be on one device")
    n, h, d = x3.shape
    if n == 0 or h == 0 or d == 0:
        return
    half = 0 if inv_freq is None else inv_freq.numel()
    block_half = triton.next_power_of_2(max(half, 1))
    block_p = min(triton.next_power_of_2(max(d - 2 * half, 1)), MAX_PASS)
    block_h = min(triton.next_power_of_2(h), max(1, TILE // max(block_half, block_p)))
    rows = INTERPRET_ROWS if INTERPRET else 1
    scatter = slot_of_row is not None
    _rope_kernel[(triton.cdiv(n, rows), triton.cdiv(h, block_h))](
        x3, positions, positions if inv_freq is None else inv_freq, out4,
        slot_of_row if scatter else positions, index if scatter else positions,
        n, h, d, half, x3.stride(0), x3.stride(1), out4.stride(0), out4.stride(1), out4.stride(2),
        ROTATE=half > 0, SCATTER=scatter, ACT_BF16=x3.dtype == torch.bfloat16, ROWS=rows, BLOCK_H=block_h,
        BLOCK_HALF=block_half, BLOCK_P=block_p, INTERPRET=INTERPRET, num_warps=NUM_WARPS, enable_fp_fusion=False,
        **launch_options(_rope_kernel, x3.device),
    )  # fmt: skip


def rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    dest: torch.Tensor | None = None,
    slot_of_row: torch.Tensor | None = None,
    dest_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """RoPE of x [N, H, D] or [N, D] at positions [N], returned in out (new and contiguous when None; it must not
    overlap x), or, with dest, written to dest[slot_of_row, dest_index or positions] and dest returned."""
    x3 = _heads(x, "x")
    _indices(positions, x3.shape[0], "positions")
    if inv_freq.dtype != torch.float32:
        raise TypeError(f"inv_freq: expected fp32, got {inv_freq.dtype}")
    if inv_freq.dim() != 1 or inv_freq.numel() < 1 or 2 * inv_freq.numel() > x3.shape[2] or inv_freq.stride(0) != 1:
        raise ValueError(f"inv_freq: expected contiguous [1..{x3.shape[2] // 2}], got {tuple(inv_freq.shape)}")
    if dest is not None:
        if out is not None:
            raise ValueError("out: not allowed with dest")
        index, name = (positions, "positions") if dest_index is None else (dest_index, "dest_index")
        _launch(x3, positions, inv_freq, _cache(dest, x3, slot_of_row, index, name), slot_of_row, index)
        return dest
    if slot_of_row is not None or dest_index is not None:
        raise ValueError("slot_of_row, dest_index: only with dest")
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out3 = _heads(out, "out")
    if out3.shape != x3.shape or out.dtype != x.dtype:
        raise ValueError(f"out: expected {x.dtype} {tuple(x.shape)}, got {out.dtype} {tuple(out.shape)}")
    _launch(x3, positions, inv_freq, out3.unsqueeze(1), None, None)
    return out


def norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    dest: torch.Tensor | None = None,
    slot_of_row: torch.Tensor | None = None,
    dest_index: torch.Tensor | None = None,
) -> torch.Tensor:
    """`rope(zc_rms_norm(x, weight, eps), positions, inv_freq, ...)` in one launch with both kernels' bits: x [N, H, D]
    or [N, D] (any row and head strides); returned new and contiguous, or written into dest as `rope` does."""
    x3 = row_groups(x, "x")
    n, h, d = x3.shape
    stride_wg = _norm_weight(weight, h, d)
    _indices(positions, n, "positions")
    if inv_freq.dtype != torch.float32 or inv_freq.dim() != 1 or not 1 <= 2 * inv_freq.numel() <= d:
        raise ValueError(f"inv_freq: expected fp32 [1..{d // 2}], got {inv_freq.dtype} {tuple(inv_freq.shape)}")
    if block_c(d) < d:
        raise ValueError(f"x: a head of {d} features exceeds the norm's one-chunk width {block_c(d)}")
    if dest is None:
        if slot_of_row is not None or dest_index is not None:
            raise ValueError("slot_of_row, dest_index: only with dest")
        out = torch.empty((n, h, d), dtype=x.dtype, device=x.device)
        out4, index = out.unsqueeze(1), None
    else:
        index, name = (positions, "positions") if dest_index is None else (dest_index, "dest_index")
        out4 = _cache(dest, x3, slot_of_row, index, name)
    devices = {t.device for t in (x3, weight, positions, inv_freq, out4, slot_of_row, index) if t is not None}
    if len(devices) != 1:
        raise ValueError("every tensor must be on one device")
    if n and h and d:
        rows = program_rows(n * h, d)
        scatter = dest is not None
        _norm_rope_kernel[(triton.cdiv(n * h, rows),)](
            x3, weight, positions, inv_freq, out4, slot_of_row if scatter else positions,
            index if scatter else positions, h, n * h, d, inv_freq.numel(), x3.stride(0), x3.stride(1), stride_wg,
            out4.stride(0), out4.stride(1), out4.stride(2), eps, SCATTER=scatter,
            ACT_BF16=x.dtype == torch.bfloat16, BLOCK_R=rows, BLOCK_C=block_c(d),
            BLOCK_HALF=triton.next_power_of_2(inv_freq.numel()), INTERPRET=INTERPRET, num_warps=NORM_WARPS,
            enable_fp_fusion=False, **launch_options(_norm_rope_kernel, x3.device),
        )  # fmt: skip
    return dest if dest is not None else out.view(x.shape)


def scatter_rows(dest: torch.Tensor, slot_of_row: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> None:
    """`dest[slot_of_row, positions] = rows` in one launch: rows [N, H, D] or [N, D], dest [S, C, H, D] or [S, C, D]."""
    x3 = _heads(rows, "rows")
    _launch(x3, positions, None, _cache(dest, x3, slot_of_row, positions, "positions"), slot_of_row, positions)


def rope_reference(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Plain-PyTorch `rope`: the model's cos/sin tables and rotate-half rotation."""
    x3 = _heads(x, "x")
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
    rot = emb.shape[-1]
    x_rot, x_pass = x3[..., :rot], x3[..., rot:]
    rotated = torch.cat((-x_rot[..., rot // 2 :], x_rot[..., : rot // 2]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1).view(x.shape)
