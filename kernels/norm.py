"""Row norms and the small row reductions beside them, each row computed exactly as it would be alone.

`zc_rms_norm` (zero-centred RMSNorm: q/k norms, the indexer's norms, the PLE and MTP norms), `gated_rms_norm` (the
GDN output norm), `group_dot` (the PLE gate's per-stream dot product) and `block_mean` (the indexer's pooled block
keys). Every input is a set of rows [M, G, C]: M rows of G groups of C features, any row and group strides, the
features contiguous; a reduction runs over one group's C features.

Reduction order (the exactness contract). A program reduces a tile of BLOCK_R (row, group) pairs, each over
BLOCK_C = min(next_pow2(C), 1024) fp32 lanes that add the products of its features chunk by chunk in increasing
order, then one tree sum over the lanes per pair; a pair's lanes come from C alone (the zc norm's calls of few
pairs take smaller tiles, `program_rows`, in which Triton lays a pair's lanes out as in a whole tile) and every
pair reduces in the same pattern wherever it sits in the tile. `gated_rms_norm` instead sums each chunk's rounded
squares as a tree of neighbour pairs (`gated_norm_pairs`), whose bits depend on no tile shape or layout, so the
fused GDN kernel (kernels/gdn_step.py) gives them too. `block_mean` adds its R rows in increasing order. So a row's
bits never depend on M or on the other rows. In fp32: rstd = 1 / sqrt(Σx² / C + eps) (IEEE division and square root),
sigmoid(v) = 1 / (1 + exp(-v)), silu(v) = v / (1 + exp(-v)), exp from libdevice. Outputs are rounded once to the
activation dtype (bf16 or fp32), to nearest even, at the places the model's reference rounds.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.fp32_ops import add_rn, exp_f32, mul_rn, pairwise_row_sums, round_to_act
from kernels.pdl import enter, launch_options

# The interpreter truncates fp32 -> bf16 casts, so there rounding is done on the bits.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_BLOCK = 1024
TILE = 4096
NUM_WARPS = 4
FEW_PAIRS = 1024  # pairs up to which a zc norm call takes small tiles (`program_rows`)
FEW_GATED_PAIRS = 2048  # pairs up to which a gated norm call takes GATED_FEW_TILE (`gated_norm_tile`)
GATED_FEW_TILE = (4, 4)  # (pairs a program, warps) of a gated norm call of few pairs


def block_c(c: int) -> int:
    """Lanes of one group's reduction, from its width alone."""
    return min(triton.next_power_of_2(c), MAX_BLOCK)


def block_r(c: int) -> int:
    """(row, group) pairs one program reduces, from the width alone (a tile of TILE elements)."""
    return max(1, TILE // block_c(c))


def small_tile_rows(c: int) -> int:
    """Pairs a zc norm program of few pairs takes: 1,024 lanes' worth (at most a whole tile). Triton lays a tile's
    threads, then its warps, along the features first, so a pair's reduction runs over the same lanes in this tile
    as in a whole one, with the same bits (tests/kernels/test_norm_layout.py compiles both for sm_90 and compares
    the reductions' layouts; the GPU tests compare the bits)."""
    return min(block_r(c), NUM_WARPS * max(1, 256 // block_c(c)))


def program_rows(pairs: int, c: int) -> int:
    """Pairs a zc norm program takes for a call of `pairs` pairs: a small tile up to FEW_PAIRS (decode rows: more
    programs, fewer idle lanes), a whole tile above; each pair's bits are the same either way."""
    return small_tile_rows(c) if pairs <= FEW_PAIRS else block_r(c)


@triton.jit
def _tile_rows(G, R, stride_m, stride_g, BLOCK_R: tl.constexpr):
    """This program's (row, group) pairs: flat index r = row·G + group, their offsets, mask and groups."""
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    return r, (r // G) * stride_m + (r % G) * stride_g, r < R, r % G


@triton.jit
def _sum_squares(
    x_ptr,
    offs,
    ok,
    C,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    """Σ x² over each pair's C features in fp32: lane sums chunk by chunk, then one tree sum per pair."""
    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        x = tl.load(x_ptr + offs[:, None] + cols[None, :], mask=ok[:, None] & (cols < C)[None, :], other=0.0)
        x = x.to(tl.float32)
        acc += x * x
    return tl.sum(acc, axis=1)


@triton.jit
def _rstd(total, C, eps):
    """1 / sqrt(total / C + eps), IEEE division and square root."""
    return tl.div_rn(tl.full(total.shape, 1.0, tl.float32), tl.sqrt_rn(tl.div_rn(total, C.to(tl.float32)) + eps))


@triton.jit(do_not_specialize=["R"])
def _zc_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    G,
    R,
    C,
    stride_xm,
    stride_xg,
    stride_wg,
    eps,
    ACT_BF16: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    """BLOCK_R (row, group) pairs: act(x · rstd · (1 + w))."""
    enter(PDL)
    r, offs, ok, grp = _tile_rows(G, R, stride_xm, stride_xg, BLOCK_R)
    rstd = _rstd(_sum_squares(x_ptr, offs, ok, C, BLOCK_R, BLOCK_C), C, eps)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = ok[:, None] & (cols < C)[None, :]
        x = tl.load(x_ptr + offs[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + grp[:, None] * stride_wg + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        out = round_to_act(x * rstd[:, None] * (1.0 + w), ACT_BF16, INTERPRET)
        tl.store(out_ptr + r[:, None] * C + cols[None, :], out, mask=mask)


@triton.jit(do_not_specialize=["R"])
def _gated_norm_kernel(
    x_ptr,
    z_ptr,
    w_ptr,
    out_ptr,
    G,
    R,
    C,
    stride_xm,
    stride_xg,
    stride_zm,
    stride_zg,
    eps,
    SILU: tl.constexpr,
    ACT_BF16: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    """BLOCK_R (row, group) pairs: `gated_norm_pairs`."""
    enter(PDL)
    r, offs, ok, _ = _tile_rows(G, R, stride_xm, stride_xg, BLOCK_R)
    z_offs = (r // G) * stride_zm + (r % G) * stride_zg
    gated_norm_pairs(
        x_ptr, z_ptr, w_ptr, out_ptr, r, offs, z_offs, ok, C, eps, SILU, ACT_BF16, BLOCK_R, BLOCK_C, INTERPRET
    )  # fmt: skip


@triton.jit
def gated_norm_pairs(
    x_ptr,
    z_ptr,
    w_ptr,
    out_ptr,
    r,
    offs,
    z_offs,
    ok,
    C,
    eps,
    SILU: tl.constexpr,
    ACT_BF16: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """(row, group) pairs r (x at offs, z at z_offs, out at r·C): x rounded to act, act(act(w · act(x · rstd)) ·
    gate(z)), the gate in fp32; Σx² a tree of neighbour pairs of rounded squares per chunk, chunks added in order,
    so a pair's bits depend on no tile shape or compile option (the fused GDN kernel runs it on a window's pairs)."""
    total = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        x = tl.load(x_ptr + offs[:, None] + cols[None, :], mask=ok[:, None] & (cols < C)[None, :], other=0.0)
        x = round_to_act(x.to(tl.float32), ACT_BF16, INTERPRET).to(tl.float32)
        total = add_rn(total, pairwise_row_sums(mul_rn(x, x, INTERPRET), BLOCK_R, BLOCK_C), INTERPRET)
    rstd = _rstd(total, C, eps)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = ok[:, None] & (cols < C)[None, :]
        x = tl.load(x_ptr + offs[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = round_to_act(x, ACT_BF16, INTERPRET).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < C, other=0.0).to(tl.float32)
        normed = round_to_act(x * rstd[:, None], ACT_BF16, INTERPRET).to(tl.float32)
        scaled = round_to_act(w[None, :] * normed, ACT_BF16, INTERPRET).to(tl.float32)
        z = tl.load(z_ptr + z_offs[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        one = tl.full(z.shape, 1.0, tl.float32)
        gate = tl.div_rn(z if SILU else one, add_rn(one, exp_f32(-z, INTERPRET), INTERPRET))
        tl.store(out_ptr + r[:, None] * C + cols[None, :], round_to_act(scaled * gate, ACT_BF16, INTERPRET), mask=mask)


@triton.jit(do_not_specialize=["R"])
def _group_dot_kernel(
    a_ptr,
    b_ptr,
    out_ptr,
    G,
    R,
    C,
    stride_am,
    stride_ag,
    stride_bm,
    stride_bg,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):
    """BLOCK_R (row, group) pairs: Σ a·b in fp32, lane sums chunk by chunk, then one tree sum per pair."""
    enter(PDL)
    r, a_offs, ok, _ = _tile_rows(G, R, stride_am, stride_ag, BLOCK_R)
    b_offs = (r // G) * stride_bm + (r % G) * stride_bg
    acc = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        mask = ok[:, None] & (cols < C)[None, :]
        a = tl.load(a_ptr + a_offs[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + b_offs[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        acc += a * b
    tl.store(out_ptr + r, tl.sum(acc, axis=1), mask=ok)


@triton.jit
def _block_mean_kernel(
    x_ptr,
    out_ptr,
    slot_ptr,
    first_ptr,
    C,
    stride_x,
    stride_s,
    RATIO: tl.constexpr,
    GATHER: tl.constexpr,
    ACT_BF16: tl.constexpr,
    BLOCK_C: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    """One block and BLOCK_C features: act((x_0 + x_1 + ... + x_{R-1}) / R), rows added in order in fp32; the rows
    are the block's R consecutive rows of x, or with GATHER rows first[b].. of slot slot[b] of a pool."""
    enter(PDL)
    blk = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = cols < C
    if GATHER:
        slot, at = tl.load(slot_ptr + blk).to(tl.int64), tl.load(first_ptr + blk).to(tl.int64)
        first = x_ptr + slot * stride_s + at * stride_x + cols
    else:
        first = x_ptr + blk * RATIO * stride_x + cols
    acc = tl.load(first, mask=ok, other=0.0).to(tl.float32)
    for r in tl.static_range(1, RATIO):
        acc += tl.load(first + r * stride_x, mask=ok, other=0.0).to(tl.float32)
    mean = tl.div_rn(acc, tl.full(acc.shape, RATIO, tl.float32))
    tl.store(out_ptr + blk * C + cols, round_to_act(mean, ACT_BF16, INTERPRET), mask=ok)


def row_groups(x: torch.Tensor, name: str) -> torch.Tensor:
    """x as [M, G, C]: a [M, C] tensor is one group per row; the feature dim must be contiguous."""
    if x.dim() == 2:
        x = x.unsqueeze(1)
    if x.dim() != 3 or (x.stride(2) != 1 and x.shape[2] > 1):
        raise ValueError(f"{name}: expected [M, C] or [M, G, C] with contiguous features, got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"{name}: expected bf16 or fp32, got {x.dtype}")
    return x


def _norm_weight(weight: torch.Tensor, g: int, c: int) -> int:
    """The weight's stride between groups: 0 for one weight [C] shared by the groups, C for one per group [G·C]."""
    if weight.dim() != 1 or weight.numel() not in (c, g * c) or weight.stride(0) != 1:
        raise ValueError(f"weight: expected contiguous [{c}] or [{g * c}], got {tuple(weight.shape)}")
    return 0 if weight.numel() == c else c


def zc_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x · rsqrt(mean(x²) + eps) · (1 + w)` over the last dim of x [M, C] or [M, G, C]; out contiguous, x's dtype.

    weight is [C] (shared by the groups) or [G·C] (one slice per group: an RMS per group of a wide row)."""
    x3 = row_groups(x, "x")
    m, g, c = x3.shape
    stride_wg = _norm_weight(weight, g, c)
    if weight.device != x.device:
        raise ValueError("x and weight must be on one device")
    out = torch.empty((m, g, c), dtype=x.dtype, device=x.device)
    if out.numel():
        rows = program_rows(m * g, c)
        _zc_norm_kernel[(triton.cdiv(m * g, rows),)](
            x3, weight, out, g, m * g, c, x3.stride(0), x3.stride(1), stride_wg, eps,
            ACT_BF16=x.dtype == torch.bfloat16, BLOCK_R=rows, BLOCK_C=block_c(c), INTERPRET=INTERPRET,
            num_warps=NUM_WARPS, **launch_options(_zc_norm_kernel, x3.device),
        )  # fmt: skip
    return out.view(x.shape)


def zc_rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain-PyTorch `zc_rms_norm`."""
    x3 = row_groups(x, "x")
    w = weight.float().view(-1, x3.shape[2])
    xf = x3.float()
    rstd = 1.0 / torch.sqrt(xf.pow(2).sum(-1, keepdim=True) / x3.shape[2] + eps)
    return (xf * rstd * (1.0 + w)).to(x.dtype).reshape(x.shape)


def gated_norm_tile(pairs: int, c: int) -> tuple[int, int]:
    """(pairs a program, warps) of a gated norm call of `pairs` pairs: up to FEW_GATED_PAIRS (decode and verify rows)
    GATED_FEW_TILE, so that more programs share them, else a whole tile on NUM_WARPS; the bits are the same either
    way (`gated_norm_pairs`' sums depend on no tile shape)."""
    return GATED_FEW_TILE if pairs <= FEW_GATED_PAIRS else (block_r(c), NUM_WARPS)


def gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    act: str,
    tile: tuple[int, int] | None = None,
) -> torch.Tensor:
    """GDN output norm of x [M, G, C] (rounded to gate's dtype first), times act(gate) [M, G, C]; gate's dtype out.

    `weight · act(x · rstd)` is rounded once more before the gate multiplies it, as the model does. `tile`: (pairs a
    program, a power of two; warps) in place of `gated_norm_tile`'s (benchmarks and tests)."""
    x3, z3 = row_groups(x, "x"), row_groups(gate, "gate")
    if x3.shape != z3.shape:
        raise ValueError(f"gate: shape {tuple(gate.shape)} differs from x's {tuple(x.shape)}")
    if act not in ("sigmoid", "silu"):
        raise ValueError(f"act: expected 'sigmoid' or 'silu', got {act!r}")
    m, g, c = x3.shape
    _norm_weight(weight, 1, c)
    out = torch.empty((m, g, c), dtype=gate.dtype, device=x.device)
    if out.numel():
        rows, warps = tile or gated_norm_tile(m * g, c)
        _gated_norm_kernel[(triton.cdiv(m * g, rows),)](
            x3, z3, weight, out, g, m * g, c, x3.stride(0), x3.stride(1), z3.stride(0), z3.stride(1), eps,
            SILU=act == "silu", ACT_BF16=gate.dtype == torch.bfloat16, BLOCK_R=rows, BLOCK_C=block_c(c),
            INTERPRET=INTERPRET, num_warps=warps, enable_fp_fusion=True, enable_reflect_ftz=False,
            **launch_options(_gated_norm_kernel, x3.device),
        )  # fmt: skip
    return out.view(gate.shape)


def gated_rms_norm_reference(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, act: str
) -> torch.Tensor:
    """Plain-PyTorch `gated_rms_norm`."""
    dtype = gate.dtype
    xf = x.to(dtype).float()
    normed = (xf * (1.0 / torch.sqrt(xf.pow(2).sum(-1, keepdim=True) / x.shape[-1] + eps))).to(dtype)
    scaled = (weight.float() * normed.float()).to(dtype).float()
    z = gate.float()
    activated = (z if act == "silu" else torch.ones_like(z)) / (1.0 + torch.exp(-z))
    return (scaled * activated).to(dtype)


def group_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Σ a·b over the last dim of a, b [M, G, C] (or [M, C]) in fp32: [M, G]."""
    a3, b3 = row_groups(a, "a"), row_groups(b, "b")
    if a3.shape != b3.shape:
        raise ValueError(f"b: shape {tuple(b.shape)} differs from a's {tuple(a.shape)}")
    m, g, c = a3.shape
    out = torch.empty((m, g), dtype=torch.float32, device=a.device)
    if out.numel():
        rows = block_r(c)
        _group_dot_kernel[(triton.cdiv(m * g, rows),)](
            a3, b3, out, g, m * g, c, a3.stride(0), a3.stride(1), b3.stride(0), b3.stride(1),
            BLOCK_R=rows, BLOCK_C=block_c(c), num_warps=NUM_WARPS, **launch_options(_group_dot_kernel, a3.device),
        )  # fmt: skip
    return out


def group_dot_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Plain-PyTorch `group_dot`."""
    return (row_groups(a, "a").float() * row_groups(b, "b").float()).sum(-1)


def block_mean(
    x: torch.Tensor, ratio: int, *, slots: torch.Tensor | None = None, firsts: torch.Tensor | None = None
) -> torch.Tensor:
    """Means of each `ratio` consecutive rows of x [B·ratio, C] in fp32, rounded to x's dtype: [B, C]. With `slots`
    and `firsts` (contiguous int32/int64 [B]) x is a pool [S, P, C] and block b's rows are
    x[slots[b], firsts[b] : firsts[b] + ratio], read in place (the same sums as over those rows gathered); the indices
    are not checked against the pool (slots[b] < S, firsts[b] + ratio <= P), as a graph replay reads them."""
    if ratio < 1:
        raise ValueError(f"ratio: expected 1 or more, got {ratio}")
    gather = slots is not None or firsts is not None
    if gather:
        if slots is None or firsts is None or slots.dim() != 1 or firsts.shape != slots.shape:
            raise ValueError("slots, firsts: expected both, as int tensors [B] of one shape")
        if slots.dtype not in (torch.int32, torch.int64) or firsts.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"slots, firsts: expected int32 or int64, got {slots.dtype} and {firsts.dtype}")
        if not (slots.is_contiguous() and firsts.is_contiguous()):
            raise ValueError("slots, firsts: expected contiguous tensors")
        if x.dim() != 3 or x.stride(2) != 1:
            raise ValueError(f"x: expected a pool [S, P, C] with contiguous features, got {tuple(x.shape)}")
        if slots.device != x.device or firsts.device != x.device:
            raise ValueError(f"slots, firsts: expected on x's {x.device}, got {slots.device} and {firsts.device}")
    elif x.dim() != 2 or x.shape[0] % ratio or x.stride(1) != 1:
        raise ValueError(f"x: expected [B·{ratio}, C] with contiguous features, got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"x: expected bf16 or fp32, got {x.dtype}")
    blocks, c = (slots.numel() if gather else x.shape[0] // ratio), x.shape[-1]
    out = torch.empty((blocks, c), dtype=x.dtype, device=x.device)
    if out.numel():
        bc = block_c(c)
        index = (slots, firsts) if gather else (out, out)
        _block_mean_kernel[(blocks, triton.cdiv(c, bc))](
            x, out, *index, c, x.stride(-2), x.stride(0) if gather else 0, RATIO=ratio, GATHER=gather,
            ACT_BF16=x.dtype == torch.bfloat16, BLOCK_C=bc, INTERPRET=INTERPRET, num_warps=NUM_WARPS,
            **launch_options(_block_mean_kernel, x.device),
        )  # fmt: skip
    return out


def block_mean_reference(x: torch.Tensor, ratio: int) -> torch.Tensor:
    """Plain-PyTorch `block_mean`."""
    return x.float().unflatten(0, (-1, ratio)).mean(1).to(x.dtype)
