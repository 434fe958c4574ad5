"""The grouped NVFP4 gate-up in Gluon (Triton's explicit-layout dialect): kernels/moe.py's `_gate_up_kernel` bit for
bit, with fewer instructions while each expert sees few rows (docs/performance.md, fifteenth session).

Triton's tl.dot takes both operands with kWidth 8: in each block of 32 k a thread holds eight consecutive k of its
rows, and each MMA adds four of them, so the MMAs add the same k in the same order here as there, and the bits are
the same in any tile. The weights are the MMA's first operand (16 columns) and the activations its second (8 rows a
tile, half of the plan's 16-row tile: a program for the second half stops at once when the tile has at most eight
rows). In a spanned matrix (kernels/fp4_words.py) a thread's words of a span are one 16-byte load and their scales
one 4-byte load, taken as the operand registers with no data moved; each K step's loads are issued one step ahead.
Gluon has no interpreter: `gate_up` declines there, off CUDA, and with FLASHNEXT_GLUON=0 (the same bits either
way), and kernels/moe.py runs its Triton kernel.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton

from kernels.fp4_words import SPAN_K
from kernels.pdl import launch_options

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # a Triton without Gluon: kernels/moe.py runs its Triton kernel
    gluon = gl = None

ENV = "FLASHNEXT_GLUON"  # "0": kernels/moe.py's Triton kernel instead
WARPS = 2  # column groups of 16, one a warp
BLOCK_K = 2 * SPAN_K
ROWS = 8  # rows of a tile half
PLAN_BLOCK_M = 16  # the plan's row tile this kernel reads in halves


def _bits(n: int) -> list[int]:
    """Powers of two below n (n a power of two)."""
    return [1 << i for i in range(int(math.log2(n)))]


@functools.cache
def _layouts() -> dict[str, object]:
    """The kernel's layouts: words [BLOCK_N, BLOCK_K / 8] as stored (position 16s + 4t + b in a span is block b of
    lane t), x as int32 pairs [ROWS, BLOCK_K / 2], and the MMA's operands (kWidth 8)."""
    spans = BLOCK_K // SPAN_K
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, ROWS])
    words = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [8, 0]] + [[0, 16 * b] for b in _bits(spans)],
        lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]], warp_bases=[[16 * b, 0] for b in _bits(WARPS)],
        block_bases=[], shape=[16 * WARPS, BLOCK_K // 8])  # fmt: skip
    pairs = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2]] + [[0, 16 * b] for b in _bits(BLOCK_K // 32)],
        lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]], warp_bases=[[0, 0] for _ in _bits(WARPS)],
        block_bases=[], shape=[ROWS, BLOCK_K // 2])  # fmt: skip
    return {
        "MMA": mma, "W_OP": gl.DotOperandLayout(0, mma, 8), "X_OP": gl.DotOperandLayout(1, mma, 8), "L_W": words,
        "L_X": pairs,
    }  # fmt: skip


def _jit(fn):
    """gluon.jit, or the function as it is where Triton has no Gluon (`usable` is then False: never launched)."""
    return gluon.jit(fn) if gluon is not None else fn


def _constexpr(value: float) -> object:
    """A module constant as the kernels read it."""
    return gl.constexpr(value) if gl is not None else value


_WARPS = _constexpr(WARPS)  # the kernels' copies of the module's widths
_BLOCK_K = _constexpr(BLOCK_K)
_SPAN_K = _constexpr(SPAN_K)
_ROWS = _constexpr(ROWS)
_TWO_POW_119 = _constexpr(2.0**119)


@_jit
def enter(PDL: gl.constexpr):
    """kernels/pdl.py's enter in Gluon: wait for the previous kernel's writes, then let the next kernel launch."""
    if PDL:
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )


@_jit
def _packed_mul(r, s):
    """Packed bf16 pairs times packed bf16 pairs (exact here), as uint32."""
    return gl.inline_asm_elementwise(
        "mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [r, s], dtype=gl.uint32, is_pure=True, pack=1
    )


@_jit
def _scale_pairs(scale):
    """fp8 e4m3 block scales -> uint32 holding bf16(scale·2^119) in both halves (exact)."""
    f = scale.to(gl.float32) * _TWO_POW_119
    return gl.inline_asm_elementwise(
        "cvt.rn.bf16x2.f32 $0, $1, $1;", "=r,f", [f], dtype=gl.uint32, is_pure=True, pack=1
    )


@_jit
def _halves(r):
    """uint32 -> its (low, high) bf16 halves: one PTX move."""
    return gl.inline_asm_elementwise(
        "mov.b32 {$0, $1}, $2;", "=h,=h,r", [r], dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=1
    )


@_jit
def _weights(words, scales, BLOCK_N: gl.constexpr, W_OP: gl.constexpr):
    """Spanned words [BLOCK_N, BLOCK_K / 8] and their block scales -> bf16 fp4·scale·2^-7 [BLOCK_N, BLOCK_K]
    in k order, in W_OP; kernels/moe.py's four extractions (kernels/fp4_words.py owns the bits)."""
    w = words.to(gl.uint32, bitcast=True)
    m = _scale_pairs(scales)
    r0 = _packed_mul(w & 0x81C081C0, m)
    r1 = _packed_mul(((w << 13) | (w >> 19)) & 0x81C081C0, m)
    r2 = _packed_mul(((w & 0x00390039) * 0x8008) & 0x81C081C0, m)
    r3 = _packed_mul((((w << 10) | (w >> 22)) & 0x01C001C0) | (((w << 14) | (w >> 18)) & 0x80008000), m)
    lo, hi = _halves(gl.join(gl.join(r0, r2), gl.join(r1, r3)))  # [.., k bit 2, k bit 1]
    v = gl.join(lo, hi).reshape([BLOCK_N, _BLOCK_K // _SPAN_K, 4, 4, 8])  # [column, span, lane t, block b, k]
    v = v.permute((0, 1, 3, 2, 4)).reshape([BLOCK_N, _BLOCK_K])  # k = 128·span + 32b + 8t + element
    return gl.convert_layout(v, W_OP)  # a renaming of registers: no data moves


@_jit
def _step_loads(xp, wp, sp, up_w, up_s, i):
    """K step i's x pairs, gate words and scales, up words and scales."""
    w = wp + i * (_BLOCK_K // 8)
    s = sp + i * (_BLOCK_K // 16)
    return gl.load(xp + i * (_BLOCK_K // 2)), gl.load(w), gl.load(s), gl.load(w + up_w), gl.load(s + up_s)


@_jit
def _gate_up_kernel(
    x_ptr, pairs_ptr, bounds_ptr, tile_experts_ptr, tile_starts_ptr, w_ptr, s_ptr, s2_ptr, h_ptr, D, INTER,
    stride_xn, stride_we, stride_wn, stride_se, stride_sn, num_programs, TOP_K: gl.constexpr, E: gl.constexpr,
    MMA: gl.constexpr, W_OP: gl.constexpr, X_OP: gl.constexpr, L_W: gl.constexpr, L_X: gl.constexpr,
    PDL: gl.constexpr,
):  # fmt: skip
    """h [8 pairs, 16·WARPS columns] = bf16(silu(x·Wgᵀ) * x·Wuᵀ) for one half of one plan tile."""
    enter(PDL)
    BLOCK_N: gl.constexpr = 16 * _WARPS
    half = gl.program_id(0) // num_programs  # second halves last: most stop at once
    n_blocks = gl.cdiv(INTER, BLOCK_N)
    t = gl.program_id(0) % num_programs // n_blocks
    nb = gl.program_id(0) % n_blocks
    e = gl.load(tile_experts_ptr + t)
    if e >= E:
        return
    first = gl.load(tile_starts_ptr + t) + half * _ROWS
    end = gl.load(bounds_ptr + e + 1)
    if first >= end:
        return
    pos = first + gl.arange(0, _ROWS, layout=gl.SliceLayout(1, L_X))
    pair = gl.load(pairs_ptr + pos, mask=pos < end, other=0)  # a padded row reads row 0: never stored
    x32 = x_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    xp = (x32 + (pair // TOP_K).to(gl.int64)[:, None] * (stride_xn // 2)
          + gl.arange(0, _BLOCK_K // 2, layout=gl.SliceLayout(0, L_X))[None, :])  # fmt: skip
    rows = nb * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L_W))
    kw = gl.arange(0, _BLOCK_K // 8, layout=gl.SliceLayout(0, L_W))
    wp = w_ptr + e.to(gl.int64) * stride_we + rows[:, None] * stride_wn + kw[None, :]
    s_pos = 8 * (kw // 16) + 4 * ((kw // 4) % 4 // 2) + kw % 4  # word position -> its scale's position
    sp = s_ptr + e.to(gl.int64) * stride_se + rows[:, None] * stride_sn + s_pos[None, :]
    up_w = INTER * stride_wn
    up_s = INTER * stride_sn
    steps = D // _BLOCK_K
    gate = gl.zeros([BLOCK_N, _ROWS], gl.float32, MMA)
    up = gl.zeros([BLOCK_N, _ROWS], gl.float32, MMA)
    now = _step_loads(xp, wp, sp, up_w, up_s, 0)
    for i in range(steps):
        ahead = _step_loads(xp, wp, sp, up_w, up_s, gl.minimum(i + 1, steps - 1))  # the last loads itself again
        xa, wg, sg, wu, su = now
        lo, hi = _halves(xa)
        xo = gl.convert_layout(gl.join(lo, hi).reshape([_ROWS, _BLOCK_K]).permute((1, 0)), X_OP)
        gate = gl.nvidia.ampere.mma_v2(_weights(wg, sg, BLOCK_N, W_OP), xo, gate)
        up = gl.nvidia.ampere.mma_v2(_weights(wu, su, BLOCK_N, W_OP), xo, up)
        now = ahead
    gate = gate * (gl.load(s2_ptr + e * 2) * 128.0)
    up = up * (gl.load(s2_ptr + e * 2 + 1) * 128.0)
    h = (gate * (1 / (1 + gl.exp(-gate))) * up).to(gl.bfloat16)  # as tl.sigmoid forms it
    pos_o = first + gl.arange(0, _ROWS, layout=gl.SliceLayout(0, MMA))
    cols = nb * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
    gl.store(h_ptr + pos_o.to(gl.int64)[None, :] * INTER + cols[:, None], h, mask=(pos_o < end)[None, :])


@functools.cache
def _nvidia_ampere_or_later(index: int) -> bool:
    """Whether CUDA device `index` is an NVIDIA GPU with mma.sync for bf16 (compute capability 8.0 or later)."""
    return triton.runtime.driver.active.get_current_target().backend == "cuda" and (
        torch.cuda.get_device_capability(index) >= (8, 0)
    )


def usable(device: torch.device, d: int, inter: int, plan_block_m: int) -> bool:
    """Whether `gate_up` runs for a spanned NVFP4 bank of these widths on `device` with plans of this row tile."""
    if gluon is None or os.environ.get(ENV) == "0" or device.type != "cuda":
        return False
    if d % BLOCK_K or inter % (16 * WARPS) or plan_block_m != PLAN_BLOCK_M:
        return False
    return _nvidia_ampere_or_later(device.index if device.index is not None else torch.cuda.current_device())


def gate_up(x: torch.Tensor, plan: object, weights: object, h: torch.Tensor, top_k: int, interpreting: bool) -> bool:
    """h by plan position from x and the spanned NVFP4 gate-up weights; False, doing nothing, where this kernel
    does not run (kernels/moe.py then runs its own)."""
    if interpreting or not usable(x.device, weights.d, weights.inter, plan.block_m):
        return False
    w, s = weights.gate_up, weights.gate_up_scale
    programs = plan.max_tiles * triton.cdiv(weights.inter, 16 * WARPS)
    _gate_up_kernel[(2 * programs,)](
        x, plan.pairs, plan.bounds, plan.tile_experts, plan.tile_starts, w, s, weights.gate_up_scale_2, h, weights.d,
        weights.inter, x.stride(0), w.stride(0), w.stride(1), s.stride(0), s.stride(1), programs, TOP_K=top_k,
        E=weights.experts, num_warps=WARPS, **_layouts(), **launch_options(_gate_up_kernel, x.device),
    )  # fmt: skip
    return True
