"""An experiment on one H200: the grouped NVFP4 gate_up kernel written in Gluon (Triton's explicit-layout dialect),
with K permuted so that each thread's tensor-core operands come from contiguous memory, against kernels/moe.py's.

Why: Triton gathers the MMA operands with about 100 register moves a K step (docs/performance.md, twelfth session).
Here the weights are the MMA's first operand (16 columns by 16 k) and the activations its second (16 k by 8 rows),
and within each span of 128 k, thread q of a quad takes actual k in [32q, 32q + 32) for its columns and its row:
MMA slot (step s, index 2q + 8h + b) holds actual k = 32q + 16(s // 4) + 4(s % 4) + 2h + b. Both operands use the
same map, so each MMA still adds x[k]·w[k] over one set of 16 k; the sets (and so the bits) differ from the natural
order's, but they depend on nothing but k, so every row's bits are the same in any batch and any tile. The words
(eight codes each, kernels/fp4_words.py's layout) and the activations (as int32 pairs) load as 16-byte vectors
straight into the layouts the MMA takes, and one block scale serves a thread's 16 codes of a column. Variants:
loads into registers at the top of each K step; cp.async copies through shared memory in stages, of the activations
and weights or of the weights alone (the activations then load into registers each step).

python3 scripts/gpu_gluon_gate_up.py --out $OUT   # tp=2's per-rank widths: E=512, d=2560, I=320, top-10
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]

from gpu_check_moe import Shape, packed_bank  # noqa: E402
from gpu_timing import graph_median_us  # noqa: E402

from kernels import moe  # noqa: E402
from kernels.fp4_words import kernel_bank  # noqa: E402
from kernels.pdl import launch_options  # noqa: E402

TWO_POW_119 = gl.constexpr(2.0**119)
SPAN = 128  # k one permutation covers
REPLAYS = 20
# name: (warps, column tiles a warp, row tiles of 8, spans a K step, stages: 0 loads into registers, split: the
# operand's first half of columns are gate's and its second half up's, so each warp runs one of them)
VARIANTS = {
    "registers, 2 warps, 32x8, k512": (2, 1, 1, 4, 0, 0),
    "cp.async x+w, 2 warps, 32x8, k256, 4 stages": (2, 1, 1, 2, 4, 0),
    "cp.async w, 2 warps, 32x8, k256, 4 stages": (2, 1, 1, 2, 4, 0),
    "cp.async w, 2 warps, 32x8, k128, 4 stages": (2, 1, 1, 1, 4, 0),
    "cp.async w, 2 warps, 32x8, k256, 3 stages": (2, 1, 1, 2, 3, 0),
    "cp.async w, 2 warps, 32x8, k256, 6 stages": (2, 1, 1, 2, 6, 0),
    "cp.async w, split 4 warps, 32x8, k256, 4 stages": (4, 1, 1, 2, 4, 1),
    "cp.async w, split 2 warps, 16x8, k256, 4 stages": (2, 1, 1, 2, 4, 1),
}
# cp.async variants that copy only the weights (the activations load into registers each step)
X_SMEM = {name: 0 for name in VARIANTS if name.startswith("cp.async w,")}
Launch = tuple[Callable[[], None], torch.Tensor, object]  # the call, its h, its plan (None: h by pair id)
TIMED = {rows: list(VARIANTS) for rows in (1, 8, 64)}
SETS = {1: 32, 8: 8, 64: 4}  # routings a timed graph cycles through, so the weights are cold


def _bits(n: int) -> list[int]:
    """Powers of two below n (n a power of two)."""
    return [1 << i for i in range(int(math.log2(n)))]


def layouts(warps: int, col_reps: int, row_reps: int, spans: int) -> dict[str, object]:
    """The kernel's layouts for BLOCK_N = 16·warps·col_reps weight columns, BLOCK_M = 8·row_reps rows and
    BLOCK_K = 128·spans: words [N, 16U] and x pairs [M, 64U] as loaded, and the MMA's operands."""
    block_n, block_m = 16 * warps * col_reps, 8 * row_reps
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[warps, 1], instr_shape=[16, 8])
    warp_cols = [[16 * b, 0] for b in _bits(warps)]
    col_regs = [[8, 0]] + [[16 * warps * b, 0] for b in _bits(col_reps)]
    words = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2]] + [[0, 16 * b] for b in _bits(spans)] + col_regs,
        lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
        warp_bases=warp_cols, block_bases=[], shape=[block_n, 16 * spans])  # fmt: skip
    words3 = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 1, 0]] + [[0, 8 * b, 0] for b in _bits(spans)] + [[c, 0, 0] for c, _ in col_regs],
        lane_bases=[[0, 2, 0], [0, 4, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[c, 0, 0] for c, _ in warp_cols], block_bases=[], shape=[block_n, 8 * spans, 2])  # fmt: skip
    pairs = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8]] + [[0, 64 * b] for b in _bits(spans)]
        + [[8 * b, 0] for b in _bits(row_reps)],
        lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[0, 0] for _ in _bits(warps)], block_bases=[], shape=[block_m, 64 * spans])  # fmt: skip
    copy = gl.BlockedLayout([1, 4], [32 // (4 * spans), 4 * spans], [warps, 1], [1, 0])
    return {
        "MMA": mma, "W_OP": gl.DotOperandLayout(0, mma, 2), "X_OP": gl.DotOperandLayout(1, mma, 2), "L_W": words,
        "L_W3": words3, "L_S": gl.SliceLayout(2, words3), "L_X": pairs, "COPY": copy, "BLOCK_N": block_n,
        "BLOCK_M": block_m, "SPANS": spans, "L_OUT": gl.BlockedLayout([1, 1], [32 // block_m, block_m], [warps, 1],
        [1, 0]),
    }  # fmt: skip


@gluon.jit
def _bf16_pairs(words):
    """kernels/moe.py's four extractions: register j holds elements 2j and 2j+1 as bf16 patterns of fp4·2^-126."""
    w = words.to(gl.uint32, bitcast=True)
    r0 = w & 0x81C081C0
    r1 = ((w << 13) | (w >> 19)) & 0x81C081C0
    r2 = ((w & 0x00390039) * 0x8008) & 0x81C081C0
    r3 = (((w << 10) | (w >> 22)) & 0x01C001C0) | (((w << 14) | (w >> 18)) & 0x80008000)
    return r0, r1, r2, r3


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
def _w_operand(words, scales, BLOCK_N: gl.constexpr, SPANS: gl.constexpr, L_W3: gl.constexpr, W_OP: gl.constexpr):
    """words [N, 16U] int32 and scales [N, 8U] fp8 -> bf16 weights [N, 128U] in MMA slot order (no data moves)."""
    w3 = gl.convert_layout(words.reshape([BLOCK_N, 8 * SPANS, 2]), L_W3, assert_trivial=True)
    r0, r1, r2, r3 = _bf16_pairs(w3)
    sp = gl.expand_dims(_scale_pairs(scales), 2)
    sp, r0 = gl.broadcast(sp, r0)
    p = gl.join(gl.join(_hmul2(r0, sp), _hmul2(r1, sp)), gl.join(_hmul2(r2, sp), _hmul2(r3, sp)))
    lo, hi = _halves(p)  # [column, block, k bit 3, k bit 1, k bit 2] of actual k
    v = gl.join(lo, hi).reshape([BLOCK_N, SPANS, 4, 2, 2, 2, 2, 2])  # [c, span, q, a4, a3, a1, a2, a0]
    v = v.permute((0, 1, 3, 4, 6, 5, 2, 7)).reshape([BLOCK_N, 128 * SPANS])  # slot = (span a4 a3 a2 a1 q a0)
    return gl.convert_layout(v, W_OP, assert_trivial=True)


@gluon.jit
def _x_operand(x, BLOCK_M: gl.constexpr, SPANS: gl.constexpr, X_OP: gl.constexpr):
    """x as int32 pairs [M, 64U] -> bf16 [128U, M] in MMA slot order (no data moves)."""
    lo, hi = _halves(x)
    v = gl.join(lo, hi).reshape([BLOCK_M, SPANS, 4, 2, 2, 2, 2, 2])  # [r, span, q, a4, a3, a2, a1, a0]
    v = v.permute((1, 3, 4, 5, 6, 2, 7, 0)).reshape([128 * SPANS, BLOCK_M])
    return gl.convert_layout(v, X_OP, assert_trivial=True)


@gluon.jit
def _store_h(gate, up, s2_ptr, h_ptr, tile_starts_ptr, bounds_ptr, t, e, nb, INTER, BLOCK_N: gl.constexpr,
             BLOCK_M: gl.constexpr, LAYOUT: gl.constexpr):  # fmt: skip
    """h = bf16(silu(gate) · up), the sums scaled by scale_2·2^7, stored at the tile's plan positions."""
    gate = gate * (gl.load(s2_ptr + e * 2) * 128.0)
    up = up * (gl.load(s2_ptr + e * 2 + 1) * 128.0)
    h = (gate * (1 / (1 + gl.exp(-gate))) * up).to(gl.bfloat16)
    pos = gl.load(tile_starts_ptr + t) + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, LAYOUT))
    ok = pos < gl.load(bounds_ptr + e + 1)
    cols = nb * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LAYOUT))
    gl.store(h_ptr + pos.to(gl.int64)[None, :] * INTER + cols[:, None], h, mask=ok[None, :])


@gluon.jit
def _weight_rows(r, nb, INTER, BLOCK_N: gl.constexpr, SPLIT: gl.constexpr):
    """The weight rows of operand columns r: gate's then up's halves (SPLIT), or gate's only (up at + INTER)."""
    if SPLIT:
        return (r // (BLOCK_N // 2)) * INTER + nb * (BLOCK_N // 2) + r % (BLOCK_N // 2)
    return nb * BLOCK_N + r


@gluon.jit
def _finish(gate, up, acc, s2_ptr, h_ptr, tile_starts_ptr, bounds_ptr, t, e, nb, INTER, BLOCK_N: gl.constexpr,
            BLOCK_M: gl.constexpr, MMA: gl.constexpr, L_OUT: gl.constexpr, SPLIT: gl.constexpr):  # fmt: skip
    """Store h: from gate and up, or (SPLIT) from acc's two halves, parted through shared memory."""
    if SPLIT:
        part = gl.allocate_shared_memory(gl.float32, [BLOCK_N, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        part.store(acc)
        gl.thread_barrier()
        g = part.slice(0, BLOCK_N // 2).load(L_OUT)
        u = part.slice(BLOCK_N // 2, BLOCK_N // 2).load(L_OUT)
        _store_h(g, u, s2_ptr, h_ptr, tile_starts_ptr, bounds_ptr, t, e, nb, INTER, BLOCK_N // 2, BLOCK_M, L_OUT)
    else:
        _store_h(gate, up, s2_ptr, h_ptr, tile_starts_ptr, bounds_ptr, t, e, nb, INTER, BLOCK_N, BLOCK_M, MMA)


@gluon.jit
def _gate_up_registers(
    x_ptr, pairs_ptr, bounds_ptr, tile_experts_ptr, tile_starts_ptr, w_ptr, s_ptr, s2_ptr, h_ptr, D, INTER,
    stride_xn, stride_we, stride_wn, stride_se, stride_sn, TOP_K: gl.constexpr, E: gl.constexpr,
    BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, SPANS: gl.constexpr, MMA: gl.constexpr, W_OP: gl.constexpr,
    X_OP: gl.constexpr, L_W: gl.constexpr, L_W3: gl.constexpr, L_S: gl.constexpr, L_X: gl.constexpr,
    COPY: gl.constexpr, L_OUT: gl.constexpr, SPLIT: gl.constexpr,
):  # fmt: skip
    """h for one tile of one expert's pairs, each K step's operands loaded into registers at its top."""
    BLOCK_K: gl.constexpr = 128 * SPANS
    n_blocks = gl.cdiv(INTER, BLOCK_N // 2 if SPLIT else BLOCK_N)
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
          + gl.arange(0, 64 * SPANS, layout=gl.SliceLayout(0, L_X))[None, :])  # fmt: skip
    cols = _weight_rows(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L_W)), nb, INTER, BLOCK_N, SPLIT)
    wp = (w_ptr + e.to(gl.int64) * stride_we + (cols * stride_wn)[:, None]
          + gl.arange(0, 16 * SPANS, layout=gl.SliceLayout(0, L_W))[None, :])  # fmt: skip
    s_cols = _weight_rows(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L_S)), nb, INTER, BLOCK_N, SPLIT)
    sp = (s_ptr + e.to(gl.int64) * stride_se + (s_cols * stride_sn)[:, None]
          + gl.arange(0, 8 * SPANS, layout=gl.SliceLayout(0, L_S))[None, :])  # fmt: skip
    gate = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
    up = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
    for _ in range(0, D, BLOCK_K):
        xb = _x_operand(gl.load(xp), BLOCK_M, SPANS, X_OP)
        wg = _w_operand(gl.load(wp), gl.load(sp), BLOCK_N, SPANS, L_W3, W_OP)
        gate = gl.nvidia.ampere.mma_v2(wg, xb, gate)
        if not SPLIT:
            wu = _w_operand(
                gl.load(wp + INTER * stride_wn), gl.load(sp + INTER * stride_sn), BLOCK_N, SPANS, L_W3, W_OP
            )
            up = gl.nvidia.ampere.mma_v2(wu, xb, up)
        xp += BLOCK_K // 2
        wp += BLOCK_K // 8
        sp += BLOCK_K // 16
    _finish(gate, up, gate, s2_ptr, h_ptr, tile_starts_ptr, bounds_ptr, t, e, nb, INTER, BLOCK_N, BLOCK_M, MMA, L_OUT,
            SPLIT)  # fmt: skip


@gluon.jit
def _issue(xs, wgs, wus, sgs, sus, stage, xp, wp, sp, up_words, up_scales, SPLIT: gl.constexpr,
           X_SMEM: gl.constexpr):  # fmt: skip
    """Start copying one K step's x pairs, gate (and up) words and scales into `stage` of the buffers."""
    if X_SMEM:
        gl.nvidia.ampere.async_copy.async_copy_global_to_shared(xs.index(stage), xp)
    gl.nvidia.ampere.async_copy.async_copy_global_to_shared(wgs.index(stage), wp)
    gl.nvidia.ampere.async_copy.async_copy_global_to_shared(sgs.index(stage), sp)
    if not SPLIT:
        gl.nvidia.ampere.async_copy.async_copy_global_to_shared(wus.index(stage), wp + up_words)
        gl.nvidia.ampere.async_copy.async_copy_global_to_shared(sus.index(stage), sp + up_scales)
    gl.nvidia.ampere.async_copy.commit_group()


@gluon.jit
def _gate_up_async(
    x_ptr, pairs_ptr, bounds_ptr, tile_experts_ptr, tile_starts_ptr, w_ptr, s_ptr, s2_ptr, h_ptr, D, INTER,
    stride_xn, stride_we, stride_wn, stride_se, stride_sn, TOP_K: gl.constexpr, E: gl.constexpr,
    BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, SPANS: gl.constexpr, MMA: gl.constexpr, W_OP: gl.constexpr,
    X_OP: gl.constexpr, L_W: gl.constexpr, L_W3: gl.constexpr, L_S: gl.constexpr, L_X: gl.constexpr,
    COPY: gl.constexpr, L_OUT: gl.constexpr, SPLIT: gl.constexpr, STAGES: gl.constexpr,
    X_SMEM: gl.constexpr = 1,
):  # fmt: skip
    """The same h, each K step's operands copied STAGES - 1 steps ahead into shared memory (D a multiple of K step)."""
    BLOCK_K: gl.constexpr = 128 * SPANS
    SMEM: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    UP_STAGES: gl.constexpr = 1 if SPLIT else STAGES
    n_blocks = gl.cdiv(INTER, BLOCK_N // 2 if SPLIT else BLOCK_N)
    t = gl.program_id(0) // n_blocks
    nb = gl.program_id(0) % n_blocks
    e = gl.load(tile_experts_ptr + t)
    if e >= E:
        return
    pos = gl.load(tile_starts_ptr + t) + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, COPY))
    pair = gl.load(pairs_ptr + pos, mask=pos < gl.load(bounds_ptr + e + 1), other=0)
    x32 = x_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    xp = (x32 + (pair // TOP_K).to(gl.int64)[:, None] * (stride_xn // 2)
          + gl.arange(0, 64 * SPANS, layout=gl.SliceLayout(0, COPY))[None, :])  # fmt: skip
    cols = _weight_rows(gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, COPY)), nb, INTER, BLOCK_N, SPLIT)
    wp = (w_ptr + e.to(gl.int64) * stride_we + (cols * stride_wn)[:, None]
          + gl.arange(0, 16 * SPANS, layout=gl.SliceLayout(0, COPY))[None, :])  # fmt: skip
    s32 = s_ptr.to(gl.pointer_type(gl.int32), bitcast=True)  # the scales copy as int32, four at a time
    sp = (s32 + e.to(gl.int64) * (stride_se // 4) + (cols * (stride_sn // 4))[:, None]
          + gl.arange(0, 2 * SPANS, layout=gl.SliceLayout(0, COPY))[None, :])  # fmt: skip
    up_words = INTER * stride_wn
    up_scales = INTER * (stride_sn // 4)
    xs = gl.allocate_shared_memory(gl.int32, [STAGES if X_SMEM else 1, BLOCK_M, 64 * SPANS], SMEM)
    pos_x = gl.load(tile_starts_ptr + t) + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, L_X))
    pair_x = gl.load(pairs_ptr + pos_x, mask=pos_x < gl.load(bounds_ptr + e + 1), other=0)
    xq = (x32 + (pair_x // TOP_K).to(gl.int64)[:, None] * (stride_xn // 2)
          + gl.arange(0, 64 * SPANS, layout=gl.SliceLayout(0, L_X))[None, :])  # fmt: skip
    wgs = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, 16 * SPANS], SMEM)
    wus = gl.allocate_shared_memory(gl.int32, [UP_STAGES, BLOCK_N, 16 * SPANS], SMEM)
    sgs = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N, 2 * SPANS], SMEM)
    sus = gl.allocate_shared_memory(gl.int32, [UP_STAGES, BLOCK_N, 2 * SPANS], SMEM)
    steps = D // BLOCK_K
    for i in gl.static_range(STAGES - 1):
        _issue(xs, wgs, wus, sgs, sus, i, xp + i * (BLOCK_K // 2), wp + i * (BLOCK_K // 8),
               sp + i * (BLOCK_K // 64), up_words, up_scales, SPLIT, X_SMEM)  # fmt: skip
    gate = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
    up = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
    for i in range(steps):
        gl.nvidia.ampere.async_copy.wait_group(STAGES - 2)
        gl.thread_barrier()
        stage = i % STAGES
        xa = xs.index(stage).load(L_X) if X_SMEM else gl.load(xq + i * (BLOCK_K // 2))
        wg = wgs.index(stage).load(L_W)
        sg = sgs.index(stage)._reinterpret(gl.uint8, [BLOCK_N, 8 * SPANS], SMEM).load(L_S)
        if not SPLIT:
            wu = wus.index(stage).load(L_W)
            su = sus.index(stage)._reinterpret(gl.uint8, [BLOCK_N, 8 * SPANS], SMEM).load(L_S)
        ahead = gl.minimum(i + STAGES - 1, steps - 1)  # past the end the last step is copied again, unused
        _issue(xs, wgs, wus, sgs, sus, (i + STAGES - 1) % STAGES, xp + ahead * (BLOCK_K // 2),
               wp + ahead * (BLOCK_K // 8), sp + ahead * (BLOCK_K // 64), up_words, up_scales, SPLIT,
               X_SMEM)  # fmt: skip
        xb = _x_operand(xa, BLOCK_M, SPANS, X_OP)
        gate = gl.nvidia.ampere.mma_v2(
            _w_operand(wg, sg.to(gl.float8e4nv, bitcast=True), BLOCK_N, SPANS, L_W3, W_OP), xb, gate
        )
        if not SPLIT:
            up = gl.nvidia.ampere.mma_v2(
                _w_operand(wu, su.to(gl.float8e4nv, bitcast=True), BLOCK_N, SPANS, L_W3, W_OP), xb, up
            )
    gl.nvidia.ampere.async_copy.wait_group(0)
    _finish(gate, up, gate, s2_ptr, h_ptr, tile_starts_ptr, bounds_ptr, t, e, nb, INTER, BLOCK_N, BLOCK_M, MMA, L_OUT,
            SPLIT)  # fmt: skip


class Bench:
    """One random NVFP4 bank at tp=2's per-rank widths and the gate_up launches to compare on it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        shape = Shape()
        self.e, self.d, self.i, self.k = shape.experts, shape.hidden, shape.inter, shape.top_k
        self.bank = kernel_bank(packed_bank(shape, torch.Generator(device=device).manual_seed(0), device))
        self.wb = moe._weights(self.bank)

    def routing(self, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, d] bf16 and n rows of k distinct random experts."""
        gen = torch.Generator(device=self.device).manual_seed(seed)
        x = torch.randn(n, self.d, device=self.device, generator=gen).bfloat16()
        ids = torch.rand(n, self.e, device=self.device, generator=gen).argsort(dim=1)[:, : self.k]
        return x, ids.to(torch.int32).contiguous()

    def _weight_args(self) -> tuple[object, ...]:
        """The bank's gate_up arguments, in the kernels' order after h."""
        wb = self.wb
        return (wb.gate_up, wb.gate_up_scale, wb.gate_up_scale_2)

    def triton(self, x: torch.Tensor, ids: torch.Tensor) -> Launch:
        """kernels/moe.py's gate_up as moe_forward launches it (the pairs kernel below PAIR_ROWS rows)."""
        n, wb, dev = ids.shape[0], self.wb, self.device
        tiles = moe.moe_tiles(n, self.k, self.e)
        h = torch.empty(n * self.k, self.i, dtype=torch.bfloat16, device=dev)
        strides = (wb.gate_up.stride(0), wb.gate_up.stride(1), wb.gate_up_scale.stride(0), wb.gate_up_scale.stride(1))
        common = {
            "BLOCK_M": tiles.block_m, "BLOCK_N": tiles.gate_up_n, "BLOCK_K": tiles.gate_up_k, "EVEN_K": True,
            "FP4": True, "INTERPRET": False, "num_warps": tiles.num_warps, "num_stages": tiles.num_stages,
        }  # fmt: skip
        programs = triton.cdiv(self.i, tiles.gate_up_n)
        if n < moe.PAIR_ROWS:
            wts = torch.full((n, self.k), 1.0 / self.k, device=dev)
            order_ids = torch.empty(n * self.k, dtype=torch.int32, device=dev)
            order_wts = torch.empty(n * self.k, dtype=torch.float32, device=dev)
            kernel = moe._gate_up_pairs_kernel

            def call() -> None:
                kernel[(n * self.k * programs,)](
                    x, ids, wts, *self._weight_args(), h, order_ids, order_wts, self.d, self.i, x.stride(0),
                    *strides, TOP_K=self.k, K_POW2=triton.next_power_of_2(self.k), **common,
                    **launch_options(kernel, dev),
                )  # fmt: skip

            return call, h, None
        plan = moe.moe_plan(ids, self.e, tiles.block_m)
        kernel = moe._gate_up_kernel

        def call() -> None:
            kernel[(plan.max_tiles * programs,)](
                x, plan.pairs, plan.bounds, plan.tile_experts, plan.tile_starts, *self._weight_args(), h, self.d,
                self.i, x.stride(0), *strides, TOP_K=self.k, E=self.e, **common, **launch_options(kernel, dev),
            )  # fmt: skip

        return call, h, plan

    def gluon(self, x: torch.Tensor, ids: torch.Tensor, variant: str) -> Launch:
        """One Gluon variant's launch on a plan of its own row tiles."""
        warps, col_reps, row_reps, spans, stages, split = VARIANTS[variant]
        lay = layouts(warps, col_reps, row_reps, spans)
        n, wb = ids.shape[0], self.wb
        plan = moe.moe_plan(ids, self.e, lay["BLOCK_M"])
        h = torch.empty(n * self.k, self.i, dtype=torch.bfloat16, device=self.device)
        kernel, extra = (_gate_up_registers, {})
        if stages:
            kernel, extra = _gate_up_async, {"STAGES": stages, "X_SMEM": X_SMEM.get(variant, 1)}
        grid = (plan.max_tiles * triton.cdiv(self.i, lay["BLOCK_N"] // (2 if split else 1)),)

        def call() -> None:
            kernel[grid](
                x, plan.pairs, plan.bounds, plan.tile_experts, plan.tile_starts, *self._weight_args(), h, self.d,
                self.i, x.stride(0), wb.gate_up.stride(0), wb.gate_up.stride(1), wb.gate_up_scale.stride(0),
                wb.gate_up_scale.stride(1), TOP_K=self.k, E=self.e, SPLIT=split, num_warps=warps, **lay, **extra,
            )  # fmt: skip

        return call, h, plan

    def reference(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """fp32 h per pair id from the dequantized experts, rounded to bf16."""
        h = torch.empty(ids.numel(), self.i, dtype=torch.float32, device=self.device)
        xf = x.float()
        for e in torch.unique(ids).tolist():
            rows, slot = torch.where(ids == e)
            gate, up, _ = moe.expert_weights(self.bank, e)
            g = xf[rows] @ gate.T
            h[rows * self.k + slot] = (torch.nn.functional.silu(g) * (xf[rows] @ up.T)).bfloat16().float()
        return h


def by_pair(h: torch.Tensor, plan: object) -> torch.Tensor:
    """h in pair-id order (the grouped kernels store it by plan position)."""
    if plan is None:
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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for gluon_gate_up.json")
    args = ap.parse_args(argv)
    bench = Bench(torch.device("cuda"))
    log: dict[str, object] = {}
    x, ids = bench.routing(64, 1)
    ref = bench.reference(x, ids)
    now = run(*bench.triton(x, ids))
    log["kernels/moe.py: rel. error at 64 rows"] = ((now.float() - ref).norm() / ref.norm()).item()
    first = None
    for variant in VARIANTS:
        got = run(*bench.gluon(x, ids, variant))
        first = got if first is None else first
        log[f"{variant}: rel. error at 64 rows"] = ((got.float() - ref).norm() / ref.norm()).item()
        log[f"{variant}: elements differing from the first variant"] = differing(got, first)
        log[f"{variant}: elements differing from kernels/moe.py"] = differing(got, now)
    alone = 0
    for r in (0, 17, 63):
        got = run(*bench.gluon(x[r : r + 1].contiguous(), ids[r : r + 1].contiguous(), next(iter(VARIANTS))))
        alone += differing(got, first[r * bench.k : (r + 1) * bench.k])
    log["rows 0, 17, 63 alone against in 64: elements differing"] = alone
    for key, value in log.items():
        print(f"{key}: {value}", flush=True)
    for rows, variants in TIMED.items():
        sets = [bench.routing(rows, 100 + s) for s in range(SETS[rows])]
        captured = len(sets) * max(1, 32 // len(sets))
        calls = [bench.triton(*r)[0] for r in sets]
        log[f"{rows} rows: kernels/moe.py us"] = graph_median_us(calls, captured, REPLAYS)
        print(f"{rows} rows: kernels/moe.py {log[f'{rows} rows: kernels/moe.py us']:.1f} us", flush=True)
        for variant in variants:
            calls = [bench.gluon(*r, variant)[0] for r in sets]
            log[f"{rows} rows: {variant} us"] = graph_median_us(calls, captured, REPLAYS)
            print(f"{rows} rows: {variant} {log[f'{rows} rows: {variant} us']:.1f} us", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gluon_gate_up.json").write_text(json.dumps(log, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
