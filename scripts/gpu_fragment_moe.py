"""An experiment on one H200: NVFP4 words stored in the tensor cores' fragment order, read by a Gluon gate_up and by
kernels/moe.py's Triton kernels, against kernels/moe.py on today's word layout.

Why: the fourteenth session's Gluon gate_up was 20% faster at 64 rows, but it permuted K, so its bits differed from
kernels/moe.py's and every MoE path would have had to move to its order. Here the words move instead. Word (column
group ng of 16, step s of 16 k, lane 4g + t) holds the eight codes that lane's mma.m16n8k16 A fragment takes:
register j = 2·kh + nh holds column 16ng + 8nh + g at k = 16s + 8kh + 2t and + 1. Steps go in increasing order and
each MMA adds one natural 16-set of k, as kernels/moe.py's do, so the bits should not change. Words of V = 4
consecutive steps of a lane are adjacent (one 16-byte load); the block scales keep their layout.

python3 scripts/gpu_fragment_moe.py --out $OUT   # tp=2's per-rank widths: E=512, d=2560, I=320, top-10
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]

from gpu_check_moe import Shape, packed_bank  # noqa: E402

from kernels import moe  # noqa: E402
from kernels.fp4_words import to_words  # noqa: E402
from kernels.pdl import launch_options  # noqa: E402

TWO_POW_119 = gl.constexpr(2.0**119)
V_STEPS = 4
V = gl.constexpr(V_STEPS)  # steps of 16 k whose words a lane loads at once
REPLAYS = 20
# name: (role, warps, column groups a warp, row reps, quads of steps a K step, prefetch one K step ahead)
VARIANTS = {
    "wA, 2 warps, 32x8, k512": ("wA", 2, 1, 1, 8, 0),
    "wA, 2 warps, 32x8, k256, prefetch": ("wA", 2, 1, 1, 4, 1),
    "wA, 1 warp, 16x8, k256, prefetch": ("wA", 1, 1, 1, 4, 1),
    "xA, 2 warps, 16x32, k512": ("xA", 2, 1, 1, 8, 0),
    "xA, 2 warps, 16x32, k256, prefetch": ("xA", 2, 1, 1, 4, 1),
    "xA, 1 warp, 16x16, k256, prefetch": ("xA", 1, 1, 1, 4, 1),
    "xA, 4 warps, 32x64, k256, prefetch": ("xA", 4, 1, 2, 4, 1),
    "xA, 4 warps, 64x64, k128, prefetch": ("xA", 4, 1, 4, 2, 1),
}
# name: (warps, column tiles a warp, blocks of 32 k a K step, row tiles of 8, prefetch, spanned words)
TODAY = {
    "spanned, 2 warps, 32x8, k256, prefetch": (2, 1, 8, 1, 1, 1),
}
Launch = tuple[Callable[[], None], torch.Tensor, object]
SETS = {1: 32, 8: 8, 64: 4, 1024: 1}


def fragment_packed(packed: torch.Tensor) -> torch.Tensor:
    """Checkpoint codes uint8 [..., N, K/2] -> the same codes reordered so that, read as words of eight, word
    (ng, s // V, lane, s % V) holds lane's A fragment of column group ng at step s (element 2j + b: register j)."""
    *lead, n, half = packed.shape
    k = 2 * half
    codes = torch.stack((packed & 0xF, packed >> 4), -1).reshape(
        *lead, n // 16, 2, 8, k // (16 * V_STEPS), V_STEPS, 2, 4, 2
    )
    lead_dims = list(range(len(lead)))
    at = len(lead)  # dims: ng, nh, g, q, v, kh, t, b -> ng, q, g, t, v, kh, nh, b
    codes = codes.permute(*lead_dims, *(at + i for i in (0, 3, 2, 6, 4, 5, 1, 7))).reshape(*lead, n, half, 2)
    return (codes[..., 0] | (codes[..., 1] << 4)).contiguous()


def fragment_bank(packed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint-layout bank as kernels take it, with the words in fragment order."""
    out = {key: value for key, value in packed.items() if not key.endswith("_packed")}
    for key in ("gate_up", "down"):
        out[f"{key}_words"] = to_words(fragment_packed(packed[f"{key}_packed"]))
    return out


def spanned_bank(bank: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Today's kernel bank with the words and scales of each matrix whose K is a multiple of 128 moved within each
    128-k span: word position 16s + 4t + b takes natural word 16s + 4b + t, scale position 8s + 4h + b takes group
    8s + 2b + h."""
    out = dict(bank)
    for key in ("gate_up", "down"):
        w, sc = bank[f"{key}_words"], bank[f"{key}_scale"]
        if w.shape[-1] % 16:
            continue
        out[f"{key}_words"] = w.reshape(*w.shape[:-1], -1, 4, 4).transpose(-1, -2).reshape(w.shape).contiguous()
        out[f"{key}_scale"] = sc.reshape(*sc.shape[:-1], -1, 4, 2).transpose(-1, -2).reshape(sc.shape).contiguous()
    return out


@triton.jit
def _weight_tile_spanned(
    w_ptr, s_ptr, rows, row_ok, k0, K, stride_wn, stride_sn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, FP4: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """kernels/moe.py's weight tile from spanned words and scales (K a multiple of 128)."""
    kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    kg = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    words = tl.load(w_ptr + rows[:, None] * stride_wn + (16 * (kw // 16) + 4 * (kw % 4) + (kw // 4) % 4)[None, :],
                    mask=row_ok[:, None], other=0)  # fmt: skip
    scale = tl.load(s_ptr + rows[:, None] * stride_sn + (8 * (kg // 8) + 4 * (kg % 2) + (kg // 2) % 4)[None, :],
                    mask=row_ok[:, None], other=0.0)  # fmt: skip
    r0, r1, r2, r3 = moe._bf16_pairs(words)
    l0, h0 = moe._halves(r0, INTERPRET)
    l1, h1 = moe._halves(r1, INTERPRET)
    l2, h2 = moe._halves(r2, INTERPRET)
    l3, h3 = moe._halves(r3, INTERPRET)
    low = tl.join(tl.join(l0, l2), tl.join(l1, l3))
    high = tl.join(tl.join(h0, h2), tl.join(h1, h3))
    codes = tl.join(low, high).reshape(BLOCK_N, BLOCK_K // 16, 16)
    w = codes * (scale.to(codes.dtype) * moe.TWO_POW_119)[:, :, None]
    return w.reshape(BLOCK_N, BLOCK_K).to(tl.bfloat16)


@triton.jit
def _weight_tile_spanned_loads(
    w_ptr, s_ptr, rows, row_ok, k0, K, stride_wn, stride_sn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, FP4: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """The same tile, the words and scales loaded in memory order and put back in natural order in registers."""
    SPANS: tl.constexpr = BLOCK_K // 128
    kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    kg = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    words = tl.load(w_ptr + rows[:, None] * stride_wn + kw[None, :], mask=row_ok[:, None], other=0)
    words = tl.permute(words.reshape(BLOCK_N, SPANS, 4, 4), (0, 1, 3, 2)).reshape(BLOCK_N, BLOCK_K // 8)
    scale = tl.load(s_ptr + rows[:, None] * stride_sn + kg[None, :], mask=row_ok[:, None], other=0.0)
    scale = tl.permute(scale.reshape(BLOCK_N, SPANS, 2, 4), (0, 1, 3, 2)).reshape(BLOCK_N, BLOCK_K // 16)
    r0, r1, r2, r3 = moe._bf16_pairs(words)
    l0, h0 = moe._halves(r0, INTERPRET)
    l1, h1 = moe._halves(r1, INTERPRET)
    l2, h2 = moe._halves(r2, INTERPRET)
    l3, h3 = moe._halves(r3, INTERPRET)
    low = tl.join(tl.join(l0, l2), tl.join(l1, l3))
    high = tl.join(tl.join(h0, h2), tl.join(h1, h3))
    codes = tl.join(low, high).reshape(BLOCK_N, BLOCK_K // 16, 16)
    w = codes * (scale.to(codes.dtype) * moe.TWO_POW_119)[:, :, None]
    return w.reshape(BLOCK_N, BLOCK_K).to(tl.bfloat16)


@triton.jit
def _weight_tile_fragment(
    w_ptr, s_ptr, rows, row_ok, k0, K, stride_wn, stride_sn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, FP4: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """kernels/moe.py's weight tile, from fragment-order words (rows in aligned groups of 16, K a multiple of 64)."""
    NG: tl.constexpr = BLOCK_N // 16
    QB: tl.constexpr = BLOCK_K // (16 * V)
    first = tl.min(tl.reshape(rows, [NG, 16]), axis=1)
    ok = tl.max(tl.reshape(row_ok.to(tl.int32), [NG, 16]), axis=1) > 0
    q = k0 // (16 * V) + tl.arange(0, QB)
    lane = tl.arange(0, 32)
    v = tl.arange(0, V)
    q_ok = q < K // (16 * V)
    mask = ok[:, None, None, None] & q_ok[None, :, None, None]
    off = (first[:, None, None, None] * stride_wn + q[None, :, None, None] * (32 * V) + lane[None, None, :, None] * V
           + v[None, None, None, :])  # fmt: skip
    words = tl.load(w_ptr + off, mask=mask, other=0)
    s_off = ((first[:, None, None, None] + (lane // 4)[None, None, :, None]) * stride_sn
             + (q * V)[None, :, None, None] + v[None, None, None, :])  # fmt: skip
    s0 = tl.load(s_ptr + s_off, mask=mask, other=0.0)
    s1 = tl.load(s_ptr + s_off + 8 * stride_sn, mask=mask, other=0.0)
    r0, r1, r2, r3 = moe._bf16_pairs(words)
    l0, h0 = moe._halves(r0, INTERPRET)
    l1, h1 = moe._halves(r1, INTERPRET)
    l2, h2 = moe._halves(r2, INTERPRET)
    l3, h3 = moe._halves(r3, INTERPRET)
    m0 = s0.to(l0.dtype) * moe.TWO_POW_119
    m1 = s1.to(l0.dtype) * moe.TWO_POW_119
    lo = tl.join(tl.join(l0 * m0, l2 * m0), tl.join(l1 * m1, l3 * m1))  # [..., kh, nh]
    hi = tl.join(tl.join(h0 * m0, h2 * m0), tl.join(h1 * m1, h3 * m1))
    w = tl.join(lo, hi).reshape(NG, QB, 8, 4, V, 2, 2, 2)  # ng, q, g, t, v, kh, nh, b
    w = tl.permute(w, (0, 6, 2, 1, 4, 5, 3, 7))  # ng, nh, g, q, v, kh, t, b
    return w.reshape(BLOCK_N, BLOCK_K).to(tl.bfloat16)


def fragment_moe_module(tile: object = None, name: str = "moe_fragment"):
    """A fresh copy of kernels/moe.py whose kernels read fragment-order (or `tile`'s) words."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "kernels" / "moe.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    module._weight_tile = tile or _weight_tile_fragment
    return module


def _bits(n: int) -> list[int]:
    """Powers of two below n (n a power of two)."""
    return [1 << i for i in range(int(math.log2(n)))]


def layouts(role: str, warps: int, col_reps: int, row_reps: int, quads: int) -> dict[str, object]:
    """Layouts for 16·warps·col_reps columns (NG groups of 16) and BLOCK_K = 64·quads. Role "wA": the weights are the
    MMA's first operand and x its second (8-row tiles); "xA": x first (16-row tiles), the weights second, as
    kernels/moe.py's tl.dot has them. Words load as [NG, quads, 32, V]; x pairs as [BLOCK_M, 32·quads]."""
    ng = warps * col_reps
    words = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2]] + [[0, b, 0, 0] for b in _bits(quads)]
        + [[warps * b, 0, 0, 0] for b in _bits(col_reps)],
        lane_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [0, 0, 4, 0], [0, 0, 8, 0], [0, 0, 16, 0]],
        warp_bases=[[b, 0, 0, 0] for b in _bits(warps)], block_bases=[], shape=[ng, quads, 32, V])  # fmt: skip
    steps = [[0, 4], [0, 8], [0, 16]] + [[0, 32 * b] for b in _bits(quads)]
    lanes = [[0, 1], [0, 2], [1, 0], [2, 0], [4, 0]]
    if role == "wA":
        mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[warps, 1], instr_shape=[16, 8])
        block_m = 8 * row_reps
        rows = [[8 * b, 0] for b in _bits(row_reps)]
        w_op, x_op = gl.DotOperandLayout(0, mma, 2), gl.DotOperandLayout(1, mma, 2)
    else:
        mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, warps], instr_shape=[16, 8])
        block_m = 16 * row_reps
        rows = [[16 * b, 0] for b in _bits(row_reps)]
        w_op, x_op = gl.DotOperandLayout(1, mma, 2), gl.DotOperandLayout(0, mma, 2)
        steps = [[8, 0], *steps]  # a thread's rows g and g + 8
    pairs = gl.DistributedLinearLayout(
        reg_bases=steps + rows, lane_bases=lanes, warp_bases=[[0, 0] for _ in _bits(warps)], block_bases=[],
        shape=[block_m, 32 * quads])  # fmt: skip
    return {"MMA": mma, "W_OP": w_op, "X_OP": x_op, "L_W": words, "L_X": pairs, "NG": ng, "BLOCK_M": block_m,
            "QUADS": quads}  # fmt: skip


@gluon.jit
def _hmul2(r, s):
    """Packed bf16 pairs times packed bf16 pairs, as uint32."""
    return gl.inline_asm_elementwise(
        "mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [r, s], dtype=gl.uint32, is_pure=True, pack=1
    )


@gluon.jit
def _scale_pairs(scale):
    """fp8 e4m3 block scales -> uint32 holding bf16(scale·2^119) in both halves (exact)."""
    f = scale.to(gl.float32) * TWO_POW_119
    return gl.inline_asm_elementwise(
        "cvt.rn.bf16x2.f32 $0, $1, $1;", "=r,f", [f], dtype=gl.uint32, is_pure=True, pack=1
    )


@gluon.jit
def _halves(r):
    """uint32 -> its (low, high) bf16 halves."""
    return gl.inline_asm_elementwise(
        "mov.b32 {$0, $1}, $2;", "=h,=h,r", [r], dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=1
    )


@gluon.jit
def _registers(words, s0, s1):
    """Fragment words and their two column sets' scales -> the four A-fragment registers, scaled (packed bf16)."""
    w = words.to(gl.uint32, bitcast=True)
    r0 = w & 0x81C081C0
    r1 = ((w << 13) | (w >> 19)) & 0x81C081C0
    r2 = ((w & 0x00390039) * 0x8008) & 0x81C081C0
    r3 = (((w << 10) | (w >> 22)) & 0x01C001C0) | (((w << 14) | (w >> 18)) & 0x80008000)
    m0 = _scale_pairs(s0)
    m1 = _scale_pairs(s1)
    return _hmul2(r0, m0), _hmul2(r1, m1), _hmul2(r2, m0), _hmul2(r3, m1)


@gluon.jit
def _w_first(words, s0, s1, NG: gl.constexpr, QUADS: gl.constexpr, W_OP: gl.constexpr):
    """Role wA: bf16 weights [16·NG, 64·QUADS] in W_OP (no moves)."""
    p0, p1, p2, p3 = _registers(words, s0, s1)
    lo, hi = _halves(gl.join(gl.join(p0, p2), gl.join(p1, p3)))  # [.., kh, nh]
    v = gl.join(lo, hi).reshape([NG, QUADS, 8, 4, 4, 2, 2, 2])  # ng, q, g, t, v, kh, nh, b
    v = v.permute((0, 6, 2, 1, 4, 5, 3, 7)).reshape([16 * NG, 64 * QUADS])
    return gl.convert_layout(v, W_OP, assert_trivial=True)


@gluon.jit
def _w_second_half(p_lo, p_hi, NG: gl.constexpr, QUADS: gl.constexpr, W_OP: gl.constexpr):
    """Role xA: one half (columns 16ng + 8nh + g of one nh) as bf16 [64·QUADS, 8·NG] in W_OP (no moves)."""
    lo, hi = _halves(gl.join(p_lo, p_hi))  # [.., kh]
    v = gl.join(lo, hi).reshape([NG, QUADS, 8, 4, 4, 2, 2])  # ng, q, g, t, v, kh, b
    v = v.permute((1, 4, 5, 3, 6, 0, 2)).reshape([64 * QUADS, 8 * NG])
    return gl.convert_layout(v, W_OP, assert_trivial=True)


@gluon.jit
def _x_second(x, BLOCK_M: gl.constexpr, QUADS: gl.constexpr, X_OP: gl.constexpr):
    """Role wA: x as int32 pairs [M, 32·QUADS] -> bf16 [64·QUADS, M] in X_OP (no moves)."""
    lo, hi = _halves(x)
    v = gl.join(lo, hi).reshape([BLOCK_M, 64 * QUADS]).permute((1, 0))
    return gl.convert_layout(v, X_OP, assert_trivial=True)


@gluon.jit
def _x_first(x, BLOCK_M: gl.constexpr, QUADS: gl.constexpr, X_OP: gl.constexpr):
    """Role xA: x as int32 pairs [M, 32·QUADS] -> bf16 [M, 64·QUADS] in X_OP (no moves)."""
    lo, hi = _halves(x)
    return gl.convert_layout(gl.join(lo, hi).reshape([BLOCK_M, 64 * QUADS]), X_OP, assert_trivial=True)


@gluon.jit
def _silu_mul(gate, up, s2_ptr, e):
    """bf16(silu(gate) · up) of the sums scaled by scale_2·2^7, as kernels/moe.py forms it."""
    gate = gate * (gl.load(s2_ptr + e * 2) * 128.0)
    up = up * (gl.load(s2_ptr + e * 2 + 1) * 128.0)
    return (gate * (1 / (1 + gl.exp(-gate))) * up).to(gl.bfloat16)


@gluon.jit
def _gate_up_fragment(
    x_ptr, pairs_ptr, bounds_ptr, tile_experts_ptr, tile_starts_ptr, w_ptr, s_ptr, s2_ptr, h_ptr, D, INTER,
    stride_xn, stride_we, stride_wn, stride_se, stride_sn, TOP_K: gl.constexpr, E: gl.constexpr,
    NG: gl.constexpr, BLOCK_M: gl.constexpr, QUADS: gl.constexpr, MMA: gl.constexpr, W_OP: gl.constexpr,
    X_OP: gl.constexpr, L_W: gl.constexpr, L_X: gl.constexpr, X_FIRST: gl.constexpr, PREFETCH: gl.constexpr,
    sums_ptr=None, SUMS: gl.constexpr = False,
):  # fmt: skip
    """h for one tile of one expert's pairs from fragment-order words, operands loaded into registers (PREFETCH: one
    K step ahead)."""
    BLOCK_N: gl.constexpr = 16 * NG
    BLOCK_K: gl.constexpr = 64 * QUADS
    n_blocks = gl.cdiv(INTER, BLOCK_N)
    t = gl.program_id(0) // n_blocks
    nb = gl.program_id(0) % n_blocks
    e = gl.load(tile_experts_ptr + t)
    if e >= E:
        return
    pos = gl.load(tile_starts_ptr + t) + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, L_X))
    ok = pos < gl.load(bounds_ptr + e + 1)
    pair = gl.load(pairs_ptr + pos, mask=ok, other=0)  # a padded row reads row 0: its sums are never stored
    x32 = x_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    xp = (x32 + (pair // TOP_K).to(gl.int64)[:, None] * (stride_xn // 2)
          + gl.arange(0, 32 * QUADS, layout=gl.SliceLayout(0, L_X))[None, :])  # fmt: skip
    L3: gl.constexpr = gl.SliceLayout(3, L_W)
    L2: gl.constexpr = gl.SliceLayout(2, L3)
    ng = nb * NG + gl.arange(0, NG, layout=gl.SliceLayout(1, L2))
    q = gl.arange(0, QUADS, layout=gl.SliceLayout(0, L2))
    lane = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    vv = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L_W))))
    ng4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(ng, 1), 2), 3)
    q4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(q, 0), 2), 3)
    lane4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(lane, 0), 1), 3)
    v4 = gl.expand_dims(gl.expand_dims(gl.expand_dims(vv, 0), 1), 2)
    wp = w_ptr + e.to(gl.int64) * stride_we + ng4 * (16 * stride_wn) + q4 * 128 + lane4 * 4 + v4
    sp = s_ptr + e.to(gl.int64) * stride_se + (ng4 * 16 + lane4 // 4) * stride_sn + q4 * 4 + v4
    up_w = INTER * stride_wn
    s8 = 8 * stride_sn
    up_s = INTER * stride_sn
    W_STEP: gl.constexpr = QUADS * 32 * V
    S_STEP: gl.constexpr = BLOCK_K // 16
    steps = D // BLOCK_K
    xa = gl.load(xp)
    wg, sg0, sg1 = gl.load(wp), gl.load(sp), gl.load(sp + s8)
    wu, su0, su1 = gl.load(wp + up_w), gl.load(sp + up_s), gl.load(sp + up_s + s8)
    if X_FIRST:
        g0 = gl.zeros([BLOCK_M, 8 * NG], gl.float32, MMA)
        g1 = gl.zeros([BLOCK_M, 8 * NG], gl.float32, MMA)
        u0 = gl.zeros([BLOCK_M, 8 * NG], gl.float32, MMA)
        u1 = gl.zeros([BLOCK_M, 8 * NG], gl.float32, MMA)
    else:
        g0 = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
        u0 = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
        g1 = g0
        u1 = u0
    for i in range(steps):
        if PREFETCH:
            j = gl.minimum(i + 1, steps - 1)  # the last step loads itself again, unused
            xn = gl.load(xp + j * (BLOCK_K // 2))
            wgn, sg0n, sg1n = gl.load(wp + j * W_STEP), gl.load(sp + j * S_STEP), gl.load(sp + j * S_STEP + s8)
            wun = gl.load(wp + j * W_STEP + up_w)
            su0n, su1n = gl.load(sp + j * S_STEP + up_s), gl.load(sp + j * S_STEP + up_s + s8)
        else:
            xa = gl.load(xp + i * (BLOCK_K // 2))
            wg, sg0, sg1 = gl.load(wp + i * W_STEP), gl.load(sp + i * S_STEP), gl.load(sp + i * S_STEP + s8)
            wu = gl.load(wp + i * W_STEP + up_w)
            su0, su1 = gl.load(sp + i * S_STEP + up_s), gl.load(sp + i * S_STEP + up_s + s8)
        if X_FIRST:
            xo = _x_first(xa, BLOCK_M, QUADS, X_OP)
            p0, p1, p2, p3 = _registers(wg, sg0, sg1)
            g0 = gl.nvidia.ampere.mma_v2(xo, _w_second_half(p0, p2, NG, QUADS, W_OP), g0)
            g1 = gl.nvidia.ampere.mma_v2(xo, _w_second_half(p1, p3, NG, QUADS, W_OP), g1)
            p0, p1, p2, p3 = _registers(wu, su0, su1)
            u0 = gl.nvidia.ampere.mma_v2(xo, _w_second_half(p0, p2, NG, QUADS, W_OP), u0)
            u1 = gl.nvidia.ampere.mma_v2(xo, _w_second_half(p1, p3, NG, QUADS, W_OP), u1)
        else:
            xo = _x_second(xa, BLOCK_M, QUADS, X_OP)
            g0 = gl.nvidia.ampere.mma_v2(_w_first(wg, sg0, sg1, NG, QUADS, W_OP), xo, g0)
            u0 = gl.nvidia.ampere.mma_v2(_w_first(wu, su0, su1, NG, QUADS, W_OP), xo, u0)
        if PREFETCH:
            xa, wg, sg0, sg1, wu, su0, su1 = xn, wgn, sg0n, sg1n, wun, su0n, su1n
    start = gl.load(tile_starts_ptr + t)
    end = gl.load(bounds_ptr + e + 1)
    if X_FIRST:
        pos_o = start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, MMA))
        n = gl.arange(0, 8 * NG, layout=gl.SliceLayout(0, MMA))
        cols = nb * BLOCK_N + 16 * (n // 8) + n % 8
        out = h_ptr + pos_o.to(gl.int64)[:, None] * INTER + cols[None, :]
        gl.store(out, _silu_mul(g0, u0, s2_ptr, e), mask=(pos_o < end)[:, None])
        gl.store(out + 8, _silu_mul(g1, u1, s2_ptr, e), mask=(pos_o < end)[:, None])
    else:
        pos_o = start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA))
        cols = nb * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
        out = h_ptr + pos_o.to(gl.int64)[None, :] * INTER + cols[:, None]
        gl.store(out, _silu_mul(g0, u0, s2_ptr, e), mask=(pos_o < end)[None, :])
        if SUMS:  # the scaled fp32 sums, by plan position: [position, gate or up, column]
            sums = sums_ptr + pos_o.to(gl.int64)[None, :] * (2 * INTER) + cols[:, None]
            gl.store(sums, g0 * (gl.load(s2_ptr + e * 2) * 128.0), mask=(pos_o < end)[None, :])
            gl.store(sums + INTER, u0 * (gl.load(s2_ptr + e * 2 + 1) * 128.0), mask=(pos_o < end)[None, :])


def layouts_today(warps: int, col_reps: int, blocks: int, row_reps: int, spanned: bool = False) -> dict[str, object]:
    """Layouts for today's words with kWidth 8 operands (as Triton's tl.dot takes them): weights first,
    BLOCK_N = 16·warps·col_reps, BLOCK_K = 32·blocks, BLOCK_M = 8·row_reps; words [N, 4·blocks], x [M, K]."""
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[warps, 1], instr_shape=[16, 8])
    k_regs = [[0, 4 * b] for b in _bits(blocks)]
    k_lanes = [[0, 1], [0, 2]]
    if spanned:  # word position 16s + 4t + b holds natural word 16s + 4b + t
        k_regs = [[0, 1], [0, 2]] + [[0, 16 * b] for b in _bits(blocks // 4)]
        k_lanes = [[0, 4], [0, 8]]
    words = gl.DistributedLinearLayout(
        reg_bases=([*k_regs[:2], [8, 0], *k_regs[2:]] if spanned else [[8, 0], *k_regs])
        + [[16 * warps * b, 0] for b in _bits(col_reps)],
        lane_bases=[*k_lanes, [1, 0], [2, 0], [4, 0]], warp_bases=[[16 * b, 0] for b in _bits(warps)],
        block_bases=[], shape=[16 * warps * col_reps, 4 * blocks])  # fmt: skip
    x = gl.DistributedLinearLayout(  # x as int32 pairs: four consecutive a thread
        reg_bases=[[0, 1], [0, 2]] + [[0, 16 * b] for b in _bits(blocks)] + [[8 * b, 0] for b in _bits(row_reps)],
        lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]], warp_bases=[[0, 0] for _ in _bits(warps)],
        block_bases=[], shape=[8 * row_reps, 16 * blocks])  # fmt: skip
    return {"MMA": mma, "W_OP": gl.DotOperandLayout(0, mma, 8), "X_OP": gl.DotOperandLayout(1, mma, 8),
            "L_W": words, "L_X": x, "BLOCK_N": 16 * warps * col_reps, "BLOCK_M": 8 * row_reps,
            "BLOCK_K": 32 * blocks, "SPANNED": spanned}  # fmt: skip


@gluon.jit
def _w_today(words, scales, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, W_OP: gl.constexpr, SPANNED: gl.constexpr):
    """Today's words [N, K/8] and each word's block scale -> bf16 [N, K] in W_OP (no moves)."""
    p0, p1, p2, p3 = _registers(words, scales, scales)
    lo, hi = _halves(gl.join(gl.join(p0, p2), gl.join(p1, p3)))  # [.., k bit 2, k bit 1]
    v = gl.join(lo, hi)
    if SPANNED:  # [n, span, t, b, element] -> natural k = 128·span + 32b + 8t + element
        v = v.reshape([BLOCK_N, BLOCK_K // 128, 4, 4, 8]).permute((0, 1, 3, 2, 4))
    return gl.convert_layout(v.reshape([BLOCK_N, BLOCK_K]), W_OP, assert_trivial=not SPANNED)


@gluon.jit
def _step_loads(xp, wp, sp, up_w, up_s, i, BLOCK_K: gl.constexpr):
    """K step i's x pairs, gate words and scales, up words and scales."""
    w = wp + i * (BLOCK_K // 8)
    sc = sp + i * (BLOCK_K // 16)
    return gl.load(xp + i * (BLOCK_K // 2)), gl.load(w), gl.load(sc), gl.load(w + up_w), gl.load(sc + up_s)


@gluon.jit
def _gate_up_today(
    x_ptr, pairs_ptr, bounds_ptr, tile_experts_ptr, tile_starts_ptr, w_ptr, s_ptr, s2_ptr, h_ptr, D, INTER,
    stride_xn, stride_we, stride_wn, stride_se, stride_sn, TOP_K: gl.constexpr, E: gl.constexpr,
    BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, MMA: gl.constexpr, W_OP: gl.constexpr,
    X_OP: gl.constexpr, L_W: gl.constexpr, L_X: gl.constexpr, PREFETCH: gl.constexpr, SPANNED: gl.constexpr,
):  # fmt: skip
    """h for one tile of one expert's pairs from today's words (or spanned ones), kWidth 8 operands in registers."""
    n_blocks = gl.cdiv(INTER, BLOCK_N)
    t = gl.program_id(0) // n_blocks
    nb = gl.program_id(0) % n_blocks
    e = gl.load(tile_experts_ptr + t)
    if e >= E:
        return
    pos = gl.load(tile_starts_ptr + t) + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, L_X))
    ok = pos < gl.load(bounds_ptr + e + 1)
    pair = gl.load(pairs_ptr + pos, mask=ok, other=0)  # a padded row reads row 0: its sums are never stored
    x32 = x_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    xp = (x32 + (pair // TOP_K).to(gl.int64)[:, None] * (stride_xn // 2)
          + gl.arange(0, BLOCK_K // 2, layout=gl.SliceLayout(0, L_X))[None, :])  # fmt: skip
    rows = nb * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L_W))
    kw = gl.arange(0, BLOCK_K // 8, layout=gl.SliceLayout(0, L_W))
    wp = w_ptr + e.to(gl.int64) * stride_we + rows[:, None] * stride_wn + kw[None, :]
    if SPANNED:  # scale position 8s + 4h + b holds group 8s + 2b + h
        sp = (
            s_ptr
            + e.to(gl.int64) * stride_se
            + rows[:, None] * stride_sn
            + (8 * (kw // 16) + 4 * ((kw // 4) % 4 // 2) + kw % 4)[None, :]
        )
    else:
        sp = s_ptr + e.to(gl.int64) * stride_se + rows[:, None] * stride_sn + (kw // 2)[None, :]
    up_w = INTER * stride_wn
    up_s = INTER * stride_sn
    steps = D // BLOCK_K
    gate = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
    up = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
    a = _step_loads(xp, wp, sp, up_w, up_s, 0, BLOCK_K)
    b = _step_loads(xp, wp, sp, up_w, up_s, gl.minimum(1, steps - 1), BLOCK_K)
    for i in range(steps):
        if PREFETCH == 0:
            a = _step_loads(xp, wp, sp, up_w, up_s, i, BLOCK_K)
        if PREFETCH == 1:
            b = _step_loads(xp, wp, sp, up_w, up_s, gl.minimum(i + 1, steps - 1), BLOCK_K)
        if PREFETCH == 2:
            c = _step_loads(xp, wp, sp, up_w, up_s, gl.minimum(i + 2, steps - 1), BLOCK_K)
        xa, wg, sg, wu, su = a
        lo, hi = _halves(xa)
        xo = gl.convert_layout(gl.join(lo, hi).reshape([BLOCK_M, BLOCK_K]).permute((1, 0)), X_OP, assert_trivial=True)
        gate = gl.nvidia.ampere.mma_v2(_w_today(wg, sg, BLOCK_N, BLOCK_K, W_OP, SPANNED), xo, gate)
        up = gl.nvidia.ampere.mma_v2(_w_today(wu, su, BLOCK_N, BLOCK_K, W_OP, SPANNED), xo, up)
        if PREFETCH == 1:
            a = b
        if PREFETCH == 2:
            a = b
            b = c
    pos_o = gl.load(tile_starts_ptr + t) + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, MMA))
    cols = nb * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
    out = h_ptr + pos_o.to(gl.int64)[None, :] * INTER + cols[:, None]
    gl.store(out, _silu_mul(gate, up, s2_ptr, e), mask=(pos_o < gl.load(bounds_ptr + e + 1))[None, :])


@triton.jit
def _gate_up_sums(
    x_ptr, pairs_ptr, bounds_ptr, tile_experts_ptr, tile_starts_ptr, w_ptr, s_ptr, s2_ptr, sums_ptr, D, INTER,
    stride_xn, stride_we, stride_wn, stride_se, stride_sn, TOP_K: tl.constexpr, E: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """kernels/moe.py's gate_up loop on today's words, storing the scaled fp32 sums (gate, up) by plan position."""
    n_blocks = tl.cdiv(INTER, BLOCK_N)
    t = tl.program_id(0) // n_blocks
    nb = tl.program_id(0) % n_blocks
    e, pos, ok, pair = moe._tile_rows(pairs_ptr, bounds_ptr, tile_experts_ptr, tile_starts_ptr, t, E, BLOCK_M)
    if e >= E:
        return
    x_rows = x_ptr + (pair // TOP_K).to(tl.int64)[:, None] * stride_xn
    cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < INTER
    w_e = w_ptr + e.to(tl.int64) * stride_we
    s_e = s_ptr + e.to(tl.int64) * stride_se
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        a = tl.load(x_rows + (k0 + tl.arange(0, BLOCK_K))[None, :], mask=ok[:, None], other=0.0)
        wg = moe._weight_tile(w_e, s_e, cols, col_ok, k0, D, stride_wn, stride_sn, BLOCK_N, BLOCK_K, True, True, False)
        gate = moe._mma(a, wg, gate, False)
        wu = moe._weight_tile(
            w_e, s_e, cols + INTER, col_ok, k0, D, stride_wn, stride_sn, BLOCK_N, BLOCK_K, True, True, False
        )
        up = moe._mma(a, wu, up, False)
    sums = sums_ptr + pos.to(tl.int64)[:, None] * (2 * INTER) + cols[None, :]
    tl.store(sums, gate * (tl.load(s2_ptr + e * 2) * 128.0), mask=ok[:, None])
    tl.store(sums + INTER, up * (tl.load(s2_ptr + e * 2 + 1) * 128.0), mask=ok[:, None])


class Bench:
    """One random NVFP4 bank at tp=2's per-rank widths in both word layouts, and the gate_up launches on them."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        shape = Shape()
        self.e, self.d, self.i, self.k = shape.experts, shape.hidden, shape.inter, shape.top_k
        packed = packed_bank(shape, torch.Generator(device=device).manual_seed(0), device)
        from kernels.fp4_words import kernel_bank

        self.bank = kernel_bank(packed)
        self.fbank = fragment_bank(packed)
        self.moe_f = fragment_moe_module()
        self.sbank = spanned_bank(self.bank)
        self.moe_s = fragment_moe_module(_weight_tile_spanned, "moe_spanned")
        self.moe_s2 = fragment_moe_module(_weight_tile_spanned_loads, "moe_spanned_loads")

    def routing(self, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, d] bf16 and n rows of k distinct random experts."""
        gen = torch.Generator(device=self.device).manual_seed(seed)
        x = torch.randn(n, self.d, device=self.device, generator=gen).bfloat16()
        ids = torch.rand(n, self.e, device=self.device, generator=gen).argsort(dim=1)[:, : self.k]
        return x, ids.to(torch.int32).contiguous()

    def triton(self, x: torch.Tensor, ids: torch.Tensor, fragment: bool | str) -> Launch:
        """kernels/moe.py's gate_up as moe_forward launches it, on today's words or (its copy) on fragment words
        (or on spanned words: fragment == "spanned")."""
        mod = {False: moe, True: self.moe_f, "spanned": self.moe_s, "spanned loads": self.moe_s2}[fragment]
        bank = {False: self.bank, True: self.fbank, "spanned": self.sbank, "spanned loads": self.sbank}[fragment]
        n, wb, dev = ids.shape[0], mod._weights(bank), self.device
        tiles = mod.moe_tiles(n, self.k, self.e)
        h = torch.empty(n * self.k, self.i, dtype=torch.bfloat16, device=dev)
        args = (wb.gate_up, wb.gate_up_scale, wb.gate_up_scale_2)
        strides = (wb.gate_up.stride(0), wb.gate_up.stride(1), wb.gate_up_scale.stride(0), wb.gate_up_scale.stride(1))
        common = {
            "BLOCK_M": tiles.block_m, "BLOCK_N": tiles.gate_up_n, "BLOCK_K": tiles.gate_up_k, "EVEN_K": True,
            "FP4": True, "INTERPRET": False, "num_warps": tiles.num_warps, "num_stages": tiles.num_stages,
        }  # fmt: skip
        programs = triton.cdiv(self.i, tiles.gate_up_n)
        if n < mod.PAIR_ROWS:
            wts = torch.full((n, self.k), 1.0 / self.k, device=dev)
            order_ids = torch.empty(n * self.k, dtype=torch.int32, device=dev)
            order_wts = torch.empty(n * self.k, dtype=torch.float32, device=dev)
            kernel = mod._gate_up_pairs_kernel

            def call() -> None:
                kernel[(n * self.k * programs,)](
                    x, ids, wts, *args, h, order_ids, order_wts, self.d, self.i, x.stride(0), *strides,
                    TOP_K=self.k, K_POW2=triton.next_power_of_2(self.k), **common, **launch_options(kernel, dev),
                )  # fmt: skip

            return call, h, "pairs"
        plan = mod.moe_plan(ids, self.e, tiles.block_m)
        kernel = mod._gate_up_kernel

        def call() -> None:
            kernel[(plan.max_tiles * programs,)](
                x, plan.pairs, plan.bounds, plan.tile_experts, plan.tile_starts, *args, h, self.d, self.i,
                x.stride(0), *strides, TOP_K=self.k, E=self.e, **common, **launch_options(kernel, dev),
            )  # fmt: skip

        return call, h, plan

    def gluon(self, x: torch.Tensor, ids: torch.Tensor, variant: str) -> Launch:
        """One Gluon variant's launch on fragment words, on a plan of its own row tiles."""
        role, warps, col_reps, row_reps, quads, prefetch = VARIANTS[variant]
        lay = layouts(role, warps, col_reps, row_reps, quads)
        n, wb = ids.shape[0], moe._weights(self.fbank)
        plan = moe.moe_plan(ids, self.e, lay["BLOCK_M"])
        h = torch.empty(n * self.k, self.i, dtype=torch.bfloat16, device=self.device)
        grid = (plan.max_tiles * triton.cdiv(self.i, 16 * lay["NG"]),)

        def call() -> None:
            _gate_up_fragment[grid](
                x, plan.pairs, plan.bounds, plan.tile_experts, plan.tile_starts, wb.gate_up, wb.gate_up_scale,
                wb.gate_up_scale_2, h, self.d, self.i, x.stride(0), wb.gate_up.stride(0), wb.gate_up.stride(1),
                wb.gate_up_scale.stride(0), wb.gate_up_scale.stride(1), TOP_K=self.k, E=self.e,
                X_FIRST=role == "xA", PREFETCH=prefetch, num_warps=warps, **lay,
            )  # fmt: skip

        return call, h, plan

    def today(self, x: torch.Tensor, ids: torch.Tensor, variant: str) -> Launch:
        """A Gluon launch on today's words (kWidth 8), on a plan of its own row tiles."""
        warps, col_reps, blocks, row_reps, prefetch, spanned = TODAY[variant]
        lay = layouts_today(warps, col_reps, blocks, row_reps, bool(spanned))
        n, wb = ids.shape[0], moe._weights(self.sbank if spanned else self.bank)
        plan = moe.moe_plan(ids, self.e, lay["BLOCK_M"])
        h = torch.empty(n * self.k, self.i, dtype=torch.bfloat16, device=self.device)
        grid = (plan.max_tiles * triton.cdiv(self.i, lay["BLOCK_N"]),)

        def call() -> None:
            _gate_up_today[grid](
                x, plan.pairs, plan.bounds, plan.tile_experts, plan.tile_starts, wb.gate_up, wb.gate_up_scale,
                wb.gate_up_scale_2, h, self.d, self.i, x.stride(0), wb.gate_up.stride(0), wb.gate_up.stride(1),
                wb.gate_up_scale.stride(0), wb.gate_up_scale.stride(1), TOP_K=self.k, E=self.e, PREFETCH=prefetch,
                num_warps=warps, **lay,
            )  # fmt: skip

        return call, h, plan


def by_pair(h: torch.Tensor, plan: object) -> torch.Tensor:
    """h in pair-id order (grouped kernels store by plan position; the pairs kernel by place, the same here since
    every row's experts are distinct and compared sorted)."""
    if isinstance(plan, str):
        return h
    out = torch.empty_like(h)
    out[plan.pairs[: h.shape[0]].long()] = h
    return out


def run(call: Callable[[], None], h: torch.Tensor, plan: object) -> torch.Tensor:
    """One launch, synchronised; its h by pair id."""
    call()
    torch.cuda.synchronize()
    return by_pair(h, plan)


def differing(a: torch.Tensor, b: torch.Tensor) -> int:
    """bf16 elements whose bits differ."""
    return int((a.view(torch.int16) != b.view(torch.int16)).sum())


def main(argv: list[str] | None = None) -> int:
    from gpu_timing import graph_median_us

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for fragment_moe.json")
    ap.add_argument("--rows", default="1,8,64,1024")
    ap.add_argument("--today", action="store_true", help="only the Gluon kernels on today's words")
    args = ap.parse_args(argv)
    bench = Bench(torch.device("cuda"))
    log: dict[str, object] = {}

    def say(key: str, value: object) -> None:
        log[key] = value
        print(f"{key}: {value}", flush=True)

    if args.today:
        return today_main(bench, args, say, log)

    for rows in (8, 64, 256):
        x, ids = bench.routing(rows, 1)
        now = run(*bench.triton(x, ids, False))
        say(
            f"{rows} rows: Triton on fragment words, elements differing from today",
            differing(run(*bench.triton(x, ids, True)), now),
        )
        for variant in VARIANTS:
            try:
                got = run(*bench.gluon(x, ids, variant))
                say(f"{rows} rows: {variant}, elements differing from today", differing(got, now))
            except Exception as exc:  # an experiment: report a variant that fails to build and go on
                say(f"{variant}: failed", repr(exc)[:400])
    x, ids = bench.routing(64, 1)
    now = run(*bench.triton(x, ids, False))

    def alone(launch: Callable[[torch.Tensor, torch.Tensor], Launch]) -> int:
        """Elements of rows 0, 17 and 63, each run alone, whose bits differ from today's kernels' in the 64."""
        count = 0
        for r in (0, 17, 63):
            call, h, plan = launch(x[r : r + 1], ids[r : r + 1])
            got = run(call, h, plan)
            if plan == "pairs":  # stored by place: the row's slots in ascending expert order
                by_slot = torch.empty_like(got)
                by_slot[ids[r].long().argsort()] = got
                got = by_slot
            count += differing(got, now[r * bench.k : (r + 1) * bench.k])
        return count

    say(
        "Triton pairs kernel, today's words: rows alone against in 64, differing",
        alone(lambda a, b: bench.triton(a, b, False)),
    )
    say(
        "Triton pairs kernel, fragment words: rows alone against today's in 64, differing",
        alone(lambda a, b: bench.triton(a, b, True)),
    )
    for variant in VARIANTS:
        say(
            f"{variant}: rows alone against today's in 64, differing",
            alone(lambda a, b, v=variant: bench.gluon(a, b, v)),
        )
    x, ids = bench.routing(64, 1)
    wb_now, wb_frag = moe._weights(bench.bank), moe._weights(bench.fbank)
    tiles = moe.moe_tiles(64, bench.k, bench.e)
    plan = moe.moe_plan(ids, bench.e, tiles.block_m)
    sums_now = torch.zeros(64 * bench.k, 2 * bench.i, device=x.device)
    _gate_up_sums[(plan.max_tiles * triton.cdiv(bench.i, tiles.gate_up_n),)](
        x, plan.pairs, plan.bounds, plan.tile_experts, plan.tile_starts, wb_now.gate_up, wb_now.gate_up_scale,
        wb_now.gate_up_scale_2, sums_now, bench.d, bench.i, x.stride(0), wb_now.gate_up.stride(0),
        wb_now.gate_up.stride(1), wb_now.gate_up_scale.stride(0), wb_now.gate_up_scale.stride(1), TOP_K=bench.k,
        E=bench.e, BLOCK_M=tiles.block_m, BLOCK_N=tiles.gate_up_n, BLOCK_K=tiles.gate_up_k,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    sums_now = by_pair(sums_now, plan)
    variant = "wA, 2 warps, 32x8, k512"
    role, warps, col_reps, row_reps, quads, prefetch = VARIANTS[variant]
    lay = layouts(role, warps, col_reps, row_reps, quads)
    gplan = moe.moe_plan(ids, bench.e, lay["BLOCK_M"])
    sums_g = torch.zeros(64 * bench.k, 2 * bench.i, device=x.device)
    h_g = torch.empty(64 * bench.k, bench.i, dtype=torch.bfloat16, device=x.device)
    _gate_up_fragment[(gplan.max_tiles * triton.cdiv(bench.i, 16 * lay["NG"]),)](
        x, gplan.pairs, gplan.bounds, gplan.tile_experts, gplan.tile_starts, wb_frag.gate_up, wb_frag.gate_up_scale,
        wb_frag.gate_up_scale_2, h_g, bench.d, bench.i, x.stride(0), wb_frag.gate_up.stride(0),
        wb_frag.gate_up.stride(1), wb_frag.gate_up_scale.stride(0), wb_frag.gate_up_scale.stride(1), TOP_K=bench.k,
        E=bench.e, X_FIRST=False, PREFETCH=prefetch, num_warps=warps, sums_ptr=sums_g, SUMS=True, **lay,
    )  # fmt: skip
    torch.cuda.synchronize()
    sums_g = by_pair(sums_g, gplan)
    diff = sums_g.view(torch.int32) != sums_now.view(torch.int32)
    say("64 rows: fp32 gate and up sums differing, Gluon against kernels/moe.py's loop", int(diff.sum()))
    if diff.any():
        ulps = (sums_g.view(torch.int32).long() - sums_now.view(torch.int32).long()).abs()[diff]
        say("  their fp32 ulps apart: max, median", (int(ulps.max()), float(ulps.float().median())))
    h_now = run(*bench.triton(x, ids, False))
    hd = by_pair(h_g, gplan).view(torch.int16) != h_now.view(torch.int16)
    say("64 rows: h differing", int(hd.sum()))
    g, u = sums_now[:, : bench.i], sums_now[:, bench.i :]
    say("  of those, with both sums equal", int((hd & ~diff[:, : bench.i] & ~diff[:, bench.i :]).sum()))
    torch_h = (g * (1 / (1 + torch.exp(-g))) * u).bfloat16()
    say(
        "  torch's epilogue on today's sums: h differing from today's",
        int((torch_h.view(torch.int16) != h_now.view(torch.int16)).sum()),
    )
    for rows in (int(r) for r in args.rows.split(",")):
        sets = [bench.routing(rows, 100 + s) for s in range(SETS[rows])]
        captured = len(sets) * max(1, 32 // len(sets))
        for name, make in (
            ("today", lambda r: bench.triton(*r, False)),
            ("Triton, fragment", lambda r: bench.triton(*r, True)),
        ):
            say(f"{rows} rows: {name} us", graph_median_us([make(r)[0] for r in sets], captured, REPLAYS))
        for variant in VARIANTS:
            try:
                say(
                    f"{rows} rows: {variant} us",
                    graph_median_us([bench.gluon(*r, variant)[0] for r in sets], captured, REPLAYS),
                )
            except Exception as exc:
                say(f"{rows} rows: {variant} failed", repr(exc)[:400])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fragment_moe.json").write_text(json.dumps(log, indent=1))
    return 0


def today_main(bench: Bench, args: argparse.Namespace, say: Callable[[str, object], None], log: dict) -> int:
    """Bits and times of the Gluon gate_up on today's words against kernels/moe.py's."""
    from gpu_timing import graph_median_us

    for rows in (2, 64, 1024):
        x, ids = bench.routing(rows, 1)
        now = run(*bench.triton(x, ids, False))
        got = run(*bench.triton(x, ids, "spanned"))
        say(f"{rows} rows: Triton on spanned words, elements differing from today", differing(got, now))
        got = run(*bench.triton(x, ids, "spanned loads"))
        say(f"{rows} rows: Triton, spanned words in memory order, elements differing from today", differing(got, now))
        for variant in TODAY:
            say(
                f"{rows} rows: {variant}, elements differing from today",
                differing(run(*bench.today(x, ids, variant)), now),
            )
    x, ids = bench.routing(64, 1)
    now = run(*bench.triton(x, ids, False))
    for variant in TODAY:
        count = 0
        for r in (0, 17, 63):
            got = run(*bench.today(x[r : r + 1], ids[r : r + 1], variant))
            count += differing(got, now[r * bench.k : (r + 1) * bench.k])
        say(f"{variant}: rows 0, 17, 63 alone against today's in 64, differing", count)
    for rows in (int(r) for r in args.rows.split(",")):
        sets = [bench.routing(rows, 100 + s) for s in range(SETS[rows])]
        captured = len(sets) * max(1, 32 // len(sets))
        say(f"{rows} rows: today us", graph_median_us([bench.triton(*r, False)[0] for r in sets], captured, REPLAYS))
        calls = [bench.triton(*r, "spanned loads")[0] for r in sets]
        say(f"{rows} rows: Triton, spanned words in memory order us", graph_median_us(calls, captured, REPLAYS))
        for variant in TODAY:
            calls = [bench.today(*r, variant)[0] for r in sets]
            say(f"{rows} rows: {variant} us", graph_median_us(calls, captured, REPLAYS))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gluon_today_words.json").write_text(json.dumps(log, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
