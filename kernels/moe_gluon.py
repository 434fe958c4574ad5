"""The grouped NVFP4 gate-up and down projections in Gluon (Triton's explicit-layout dialect): kernels/moe.py's
`_gate_up_kernel` and `_down_kernel` bit for bit, with fewer instructions while each expert sees few rows
(docs/performance.md, fifteenth to seventeenth sessions).

Triton's tl.dot takes both operands with kWidth 8: in each block of 32 k a thread holds eight consecutive k of its
rows, and each MMA adds four of them, so the MMAs add the same k in the same order here as there, and the bits are
the same in any tile. The weights are the MMA's first operand (16 columns a warp) and the activations its second (8
rows a tile, half of the plan's 16-row tile: a program for the second half stops at once when the tile has at most
eight rows; a down program takes the whole tile where experts average more than six pairs, and half of a prompt's
32-row tile). In a spanned matrix (kernels/fp4_words.py) a thread's words of a span are one load and their scales
another, taken as the operand registers with no data moved. The gate-up issues each K step's loads one step ahead;
the down kernel loads its h once and each column group's weights a group ahead.
Gluon has no interpreter: `gate_up` and `down` decline there, off CUDA, and with FLASHNEXT_GLUON=0 (the same bits
either way), and kernels/moe.py runs its Triton kernels.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton

from kernels.fp4_words import span_k
from kernels.pdl import launch_options

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # a Triton without Gluon: kernels/moe.py runs its Triton kernel
    gluon = gl = None

ENV = "FLASHNEXT_GLUON"  # "0": kernels/moe.py's Triton kernels instead
GATE_UP_WARPS = 2  # column groups of 16, one a warp
GATE_UP_SPAN = 128  # the gate-up's span width, and its K step in spans
GATE_UP_SPANS = 2
PLAN_BLOCK_M = 16  # the decode batches' plan row tile
PROMPT_BLOCK_M = 32  # the prompts' plan row tile (kernels/moe.py's moe_tiles)
GATE_UP_ROWS = DOWN_ROWS = 8  # rows of a 16-row plan tile a program takes (8: halves; 16: the whole tile)
PROMPT_ROWS = 16  # rows of a prompt's 32-row plan tile a down program takes (the gate-up leaves prompts to Triton)
# Where these kernels beat kernels/moe.py's on an H200 (docs/performance.md, sixteenth and seventeenth sessions): the
# gate-up from 80 pairs (8 rows at top-10; below, the Triton kernel's four warps are as fast) up to 6 pairs an expert
# on average (beyond, most tiles hold more than 8 rows and their halves read the weights twice; whole-tile programs
# and prompt tiles tie or lose); the down kernel at every batch, its programs taking the whole 16-row tile beyond 6
# pairs an expert and half a prompt's tile
MAX_PAIRS_PER_EXPERT = 6
GATE_UP_MIN_PAIRS = 80
DOWN_SHAPES = ((40, 2, 2), (320, 4, 4), (None, 4, 8))  # (below this many pairs, warps, column groups a program)
# k a thread holds of an MMA operand's row, as kernels/moe.py's tl.dot takes them (scripts/sass_loop.py reports
# theirs): the same k in each MMA step, so the same bits; the layouts below are built for it
MMA_K_WIDTH = 8


def _bits(n: int) -> list[int]:
    """Powers of two below n (n a power of two)."""
    return [1 << i for i in range(int(math.log2(n)))]


@functools.cache
def _layouts(span: int, block_k: int, warps: int, rows: int) -> dict[str, object]:
    """A kernel's layouts: words [16·warps, block_k / 8] as stored (word 4Bs + Bt + b of a span, B = span / 32, is
    block b of lane t), x as int32 pairs [rows, block_k / 2], and the MMA's operands (kWidth 8; 8 rows an MMA)."""
    blocks = span // 32
    mma = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[warps, 1], instr_shape=[16, 8])
    words = gl.DistributedLinearLayout(
        reg_bases=[[0, b] for b in _bits(blocks)] + [[8, 0]] + [[0, 4 * blocks * b] for b in _bits(block_k // span)],
        lane_bases=[[0, blocks], [0, 2 * blocks], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16 * b, 0] for b in _bits(warps)], block_bases=[], shape=[16 * warps, block_k // 8])  # fmt: skip
    row_halves = [[8 * b, 0] for b in _bits(rows // 8)]  # rows 8 to 15 in a register of their own
    pairs = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2]] + [[0, 16 * b] for b in _bits(block_k // 32)] + row_halves,
        lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]], warp_bases=[[0, 0] for _ in _bits(warps)],
        block_bases=[], shape=[rows, block_k // 2])  # fmt: skip
    return {
        "MMA": mma, "W_OP": gl.DotOperandLayout(0, mma, MMA_K_WIDTH), "X_OP": gl.DotOperandLayout(1, mma, MMA_K_WIDTH),
        "L_W": words, "L_X": pairs,
    }  # fmt: skip


def _jit(fn):
    """gluon.jit, or the function as it is where Triton has no Gluon (`usable` is then False: never launched)."""
    return gluon.jit(fn) if gluon is not None else fn


def _constexpr(value: float) -> object:
    """A module constant as the kernels read it."""
    return gl.constexpr(value) if gl is not None else value


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
def _weights(words, scales, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, SPAN: gl.constexpr, W_OP: gl.constexpr):
    """Spanned words [BLOCK_N, BLOCK_K / 8] and their block scales -> bf16 fp4·scale·2^-7 [BLOCK_N, BLOCK_K]
    in k order, in W_OP; kernels/moe.py's four extractions (kernels/fp4_words.py owns the bits)."""
    w = words.to(gl.uint32, bitcast=True)
    m = _scale_pairs(scales)
    r0 = _packed_mul(w & 0x81C081C0, m)
    r1 = _packed_mul(((w << 13) | (w >> 19)) & 0x81C081C0, m)
    r2 = _packed_mul(((w & 0x00390039) * 0x8008) & 0x81C081C0, m)
    r3 = _packed_mul((((w << 10) | (w >> 22)) & 0x01C001C0) | (((w << 14) | (w >> 18)) & 0x80008000), m)
    lo, hi = _halves(gl.join(gl.join(r0, r2), gl.join(r1, r3)))  # [.., k bit 2, k bit 1]
    v = gl.join(lo, hi).reshape([BLOCK_N, BLOCK_K // SPAN, 4, SPAN // 32, 8])  # [column, span, lane t, block b, k]
    v = v.permute((0, 1, 3, 2, 4)).reshape([BLOCK_N, BLOCK_K])  # k = span·s + 32b + 8t + element
    return gl.convert_layout(v, W_OP)  # a renaming of registers: no data moves


@_jit
def _scale_positions(kw, SPAN: gl.constexpr):
    """Word positions of a spanned row -> the positions of their block scales (kernels/fp4_words.py)."""
    B: gl.constexpr = SPAN // 32
    return 2 * B * (kw // (4 * B)) + B * ((kw // B) % 4 // 2) + kw % B


@_jit
def _x_operand(pairs, ROWS: gl.constexpr, BLOCK_K: gl.constexpr, X_OP: gl.constexpr):
    """int32 pairs [ROWS, BLOCK_K / 2] of bf16 activations -> the MMA's second operand [BLOCK_K, ROWS]."""
    lo, hi = _halves(pairs)
    return gl.convert_layout(gl.join(lo, hi).reshape([ROWS, BLOCK_K]).permute((1, 0)), X_OP)


@_jit
def _gate_up_loads(xp, wp, sp, up_w, up_s, i, BLOCK_K: gl.constexpr):
    """K step i's x pairs, gate words and scales, up words and scales."""
    w = wp + i * (BLOCK_K // 8)
    s = sp + i * (BLOCK_K // 16)
    return gl.load(xp + i * (BLOCK_K // 2)), gl.load(w), gl.load(s), gl.load(w + up_w), gl.load(s + up_s)


@_jit
def _gate_up_kernel(
    x_ptr, pairs_ptr, bounds_ptr, tile_experts_ptr, tile_starts_ptr, w_ptr, s_ptr, s2_ptr, h_ptr, D, INTER,
    stride_xn, stride_we, stride_wn, stride_se, stride_sn, num_programs, TOP_K: gl.constexpr, E: gl.constexpr,
    WARPS: gl.constexpr, ROWS: gl.constexpr, SPAN: gl.constexpr, BLOCK_K: gl.constexpr, MMA: gl.constexpr,
    W_OP: gl.constexpr, X_OP: gl.constexpr, L_W: gl.constexpr, L_X: gl.constexpr, PDL: gl.constexpr,
):  # fmt: skip
    """h [ROWS pairs, 16·WARPS columns] = bf16(silu(x·Wgᵀ) * x·Wuᵀ) for ROWS rows of one plan tile."""
    enter(PDL)
    BLOCK_N: gl.constexpr = 16 * WARPS
    half = gl.program_id(0) // num_programs  # with 8 rows a program, second halves last: most stop at once
    n_blocks = gl.cdiv(INTER, BLOCK_N)
    t = gl.program_id(0) % num_programs // n_blocks
    nb = gl.program_id(0) % n_blocks
    e = gl.load(tile_experts_ptr + t)
    if e >= E:
        return
    first = gl.load(tile_starts_ptr + t) + half * ROWS
    end = gl.load(bounds_ptr + e + 1)
    if first >= end:
        return
    pos = first + gl.arange(0, ROWS, layout=gl.SliceLayout(1, L_X))
    pair = gl.load(pairs_ptr + pos, mask=pos < end, other=0)  # a padded row reads row 0: never stored
    x32 = x_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    xp = (x32 + (pair // TOP_K).to(gl.int64)[:, None] * (stride_xn // 2)
          + gl.arange(0, BLOCK_K // 2, layout=gl.SliceLayout(0, L_X))[None, :])  # fmt: skip
    rows = nb * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L_W))
    kw = gl.arange(0, BLOCK_K // 8, layout=gl.SliceLayout(0, L_W))
    wp = w_ptr + e.to(gl.int64) * stride_we + rows[:, None] * stride_wn + kw[None, :]
    sp = s_ptr + e.to(gl.int64) * stride_se + rows[:, None] * stride_sn + _scale_positions(kw, SPAN)[None, :]
    up_w = INTER * stride_wn
    up_s = INTER * stride_sn
    steps = D // BLOCK_K
    gate = gl.zeros([BLOCK_N, ROWS], gl.float32, MMA)
    up = gl.zeros([BLOCK_N, ROWS], gl.float32, MMA)
    now = _gate_up_loads(xp, wp, sp, up_w, up_s, 0, BLOCK_K)
    for i in range(steps):
        ahead = _gate_up_loads(xp, wp, sp, up_w, up_s, gl.minimum(i + 1, steps - 1), BLOCK_K)  # the last: again
        xa, wg, sg, wu, su = now
        xo = _x_operand(xa, ROWS, BLOCK_K, X_OP)
        gate = gl.nvidia.ampere.mma_v2(_weights(wg, sg, BLOCK_N, BLOCK_K, SPAN, W_OP), xo, gate)
        up = gl.nvidia.ampere.mma_v2(_weights(wu, su, BLOCK_N, BLOCK_K, SPAN, W_OP), xo, up)
        now = ahead
    gate = gate * (gl.load(s2_ptr + e * 2) * 128.0)
    up = up * (gl.load(s2_ptr + e * 2 + 1) * 128.0)
    h = (gate * (1 / (1 + gl.exp(-gate))) * up).to(gl.bfloat16)  # as tl.sigmoid forms it
    pos_o = first + gl.arange(0, ROWS, layout=gl.SliceLayout(0, MMA))
    cols = nb * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
    gl.store(h_ptr + pos_o.to(gl.int64)[None, :] * INTER + cols[:, None], h, mask=(pos_o < end)[None, :])


@_jit
def _down_loads(wp, sp, wp_rest, sp_rest, col_w, col_s, c):
    """Column group c's words and scales: its main spans, then the rest."""
    return gl.load(wp + c * col_w), gl.load(sp + c * col_s), gl.load(wp_rest + c * col_w), gl.load(sp_rest + c * col_s)


@_jit
def _h_operand(h32, first, end, INTER, ROWS: gl.constexpr, k0: gl.constexpr, BLOCK_K: gl.constexpr,
               L_X: gl.constexpr, X_OP: gl.constexpr):  # fmt: skip
    """The program's h over [k0, k0 + BLOCK_K) as the MMA's second operand (a padded row reads the tile's last)."""
    pos = gl.minimum(first + gl.arange(0, ROWS, layout=gl.SliceLayout(1, L_X)), end - 1)
    k_pairs = k0 // 2 + gl.arange(0, BLOCK_K // 2, layout=gl.SliceLayout(0, L_X))
    return _x_operand(gl.load(h32 + pos.to(gl.int64)[:, None] * (INTER // 2) + k_pairs[None, :]), ROWS, BLOCK_K, X_OP)


@_jit
def _weight_pointers(w_e, s_e, first_col, stride_wn, stride_sn, k0: gl.constexpr, BLOCK_N: gl.constexpr,
                     BLOCK_K: gl.constexpr, SPAN: gl.constexpr, L_W: gl.constexpr):  # fmt: skip
    """Pointers to the spanned words and scales of columns [first_col, first_col + BLOCK_N) over [k0, k0 + BLOCK_K)."""
    rows = first_col + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L_W))
    kw = gl.arange(0, BLOCK_K // 8, layout=gl.SliceLayout(0, L_W))
    wp = w_e + rows[:, None] * stride_wn + (k0 // 8 + kw)[None, :]
    sp = s_e + rows[:, None] * stride_sn + (k0 // 16 + _scale_positions(kw, SPAN))[None, :]
    return wp, sp


@_jit
def _down_kernel(
    h_ptr, pairs_ptr, bounds_ptr, tile_experts_ptr, tile_starts_ptr, w_ptr, s_ptr, s2_ptr, y_ptr, D, INTER,
    stride_we, spans_wn, stride_se, spans_sn, num_programs, E: gl.constexpr, WARPS: gl.constexpr,
    ROWS: gl.constexpr, GROUP: gl.constexpr, SPAN: gl.constexpr, MAIN_SPANS: gl.constexpr, REST_SPANS: gl.constexpr,
    MMA: gl.constexpr, W_OP: gl.constexpr, X_OP: gl.constexpr, L_W: gl.constexpr, L_X: gl.constexpr,
    L_W_REST: gl.constexpr, L_X_REST: gl.constexpr, PDL: gl.constexpr,
):  # fmt: skip
    """y [ROWS pairs, GROUP column groups of 16·WARPS] = h·Wdᵀ·scale_2 in fp32 for ROWS rows of one plan tile,
    stored by pair id. I is MAIN_SPANS + REST_SPANS spans (powers of two, as tiles must be): h is loaded once as two
    operands, and each column group's sum runs over the main spans and then the rest from zero, the MMAs in k order
    as kernels/moe.py's; its loads are issued a column group ahead. The row strides come in spans (spans_wn,
    spans_sn), so that the compiler knows a thread's words and scales of a span are aligned for one load (I / 8
    words, 40 at I = 320, is not a multiple of 16)."""
    enter(PDL)
    BLOCK_N: gl.constexpr = 16 * WARPS
    MAIN_K: gl.constexpr = MAIN_SPANS * SPAN
    REST_K: gl.constexpr = REST_SPANS * SPAN
    half = gl.program_id(0) // num_programs
    n_groups = gl.cdiv(D, BLOCK_N * GROUP)
    t = gl.program_id(0) % num_programs // n_groups
    first_col = gl.program_id(0) % n_groups * (BLOCK_N * GROUP)
    e = gl.load(tile_experts_ptr + t)
    if e >= E:
        return
    first = gl.load(tile_starts_ptr + t) + half * ROWS
    end = gl.load(bounds_ptr + e + 1)
    if first >= end:
        return
    h32 = h_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    x_main = _h_operand(h32, first, end, INTER, ROWS, 0, MAIN_K, L_X, X_OP)
    x_rest = _h_operand(h32, first, end, INTER, ROWS, MAIN_K, REST_K, L_X_REST, X_OP)
    w_e = w_ptr + e.to(gl.int64) * stride_we
    s_e = s_ptr + e.to(gl.int64) * stride_se
    stride_wn = spans_wn * (SPAN // 8)
    stride_sn = spans_sn * (SPAN // 16)
    wp, sp = _weight_pointers(w_e, s_e, first_col, stride_wn, stride_sn, 0, BLOCK_N, MAIN_K, SPAN, L_W)
    wp_rest, sp_rest = _weight_pointers(w_e, s_e, first_col, stride_wn, stride_sn, MAIN_K, BLOCK_N, REST_K, SPAN,
                                        L_W_REST)  # fmt: skip
    pos_o = first + gl.arange(0, ROWS, layout=gl.SliceLayout(0, MMA))
    stored = pos_o < end
    pair = gl.load(pairs_ptr + pos_o, mask=stored, other=0)
    cols = first_col + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, MMA))
    y_cols = y_ptr + pair.to(gl.int64)[None, :] * D + cols[:, None]
    scale_2 = gl.load(s2_ptr + e) * 128.0
    col_w = BLOCK_N * stride_wn
    col_s = BLOCK_N * stride_sn
    now = _down_loads(wp, sp, wp_rest, sp_rest, col_w, col_s, 0)
    for c in range(GROUP):
        ahead = _down_loads(wp, sp, wp_rest, sp_rest, col_w, col_s, gl.minimum(c + 1, GROUP - 1))  # the last: again
        w, s, w_rest, s_rest = now
        acc = gl.zeros([BLOCK_N, ROWS], gl.float32, MMA)
        acc = gl.nvidia.ampere.mma_v2(_weights(w, s, BLOCK_N, MAIN_K, SPAN, W_OP), x_main, acc)
        acc = gl.nvidia.ampere.mma_v2(_weights(w_rest, s_rest, BLOCK_N, REST_K, SPAN, W_OP), x_rest, acc)
        gl.store(y_cols + c * BLOCK_N, acc * scale_2, mask=stored[None, :])
        now = ahead


@functools.cache
def _nvidia_ampere_or_later(index: int) -> bool:
    """Whether CUDA device `index` is an NVIDIA GPU with mma.sync for bf16 (compute capability 8.0 or later)."""
    return triton.runtime.driver.active.get_current_target().backend == "cuda" and (
        torch.cuda.get_device_capability(index) >= (8, 0)
    )


def _usable(weights: object, plan: object, interpreting: bool) -> bool:
    """Whether these kernels can run for this bank (`kernels.moe._Weights`) and plan."""
    device = weights.gate_up.device
    if gluon is None or interpreting or os.environ.get(ENV) == "0" or device.type != "cuda":
        return False
    if plan.block_m not in (PLAN_BLOCK_M, PROMPT_BLOCK_M):
        return False
    return _nvidia_ampere_or_later(device.index if device.index is not None else torch.cuda.current_device())


def gate_up_usable(weights: object, plan: object, interpreting: bool = False) -> bool:
    """Whether `gate_up` runs for this NVFP4 bank and plan (16-row plans only)."""
    block_k = GATE_UP_SPAN * GATE_UP_SPANS
    if span_k(weights.d) != GATE_UP_SPAN or weights.d % block_k or weights.inter % (16 * GATE_UP_WARPS):
        return False
    pairs = plan.pairs.numel()
    if plan.block_m != PLAN_BLOCK_M or pairs < GATE_UP_MIN_PAIRS or pairs > MAX_PAIRS_PER_EXPERT * weights.experts:
        return False
    return _usable(weights, plan, interpreting)


def down_shape(pairs: int) -> tuple[int, int]:
    """(warps, column groups a program) of the down kernel for this many pairs: more, narrower programs for fewer."""
    return next((warps, groups) for below, warps, groups in DOWN_SHAPES if below is None or pairs < below)


def down_rows(block_m: int, pairs: int, experts: int) -> int:
    """Rows of a plan tile a down program takes: PROMPT_ROWS of a prompt's tile; of a 16-row tile DOWN_ROWS while
    experts average at most MAX_PAIRS_PER_EXPERT pairs (most tiles then fit in half of one), the whole tile beyond."""
    if block_m != PLAN_BLOCK_M:
        return PROMPT_ROWS
    return DOWN_ROWS if pairs <= MAX_PAIRS_PER_EXPERT * experts else PLAN_BLOCK_M


def down_spans(inter: int) -> tuple[int, int] | None:
    """I's spans as (main, rest), both powers of two, main the larger (5 = 4 + 1, 4 = 2 + 2); None where I is not
    spanned or its spans do not split so."""
    span = span_k(inter)
    spans = inter // span if span else 0
    main = 1 << (spans.bit_length() - 1) if spans else 0
    if main == spans:
        main //= 2
    rest = spans - main
    return (main, rest) if main and rest and rest & (rest - 1) == 0 else None


def down_usable(weights: object, plan: object, interpreting: bool = False) -> bool:
    """Whether `down` runs for this NVFP4 bank and plan: its rows strided in whole spans."""
    span = span_k(weights.inter)
    warps, groups = down_shape(plan.pairs.numel())
    if down_spans(weights.inter) is None or weights.d % (16 * warps * groups):
        return False
    if weights.down.stride(1) % (span // 8) or weights.down_scale.stride(1) % (span // 16):
        return False
    return _usable(weights, plan, interpreting)


def gate_up(x: torch.Tensor, plan: object, weights: object, h: torch.Tensor, top_k: int, interpreting: bool) -> bool:
    """h by plan position from x and the spanned NVFP4 gate-up weights; False, doing nothing, where this kernel
    does not run (kernels/moe.py then runs its own)."""
    if not gate_up_usable(weights, plan, interpreting):
        return False
    w, s = weights.gate_up, weights.gate_up_scale
    block_k = GATE_UP_SPAN * GATE_UP_SPANS
    programs = plan.max_tiles * triton.cdiv(weights.inter, 16 * GATE_UP_WARPS)
    _gate_up_kernel[(PLAN_BLOCK_M // GATE_UP_ROWS * programs,)](
        x, plan.pairs, plan.bounds, plan.tile_experts, plan.tile_starts, w, s, weights.gate_up_scale_2, h, weights.d,
        weights.inter, x.stride(0), w.stride(0), w.stride(1), s.stride(0), s.stride(1), programs, TOP_K=top_k,
        E=weights.experts, WARPS=GATE_UP_WARPS, ROWS=GATE_UP_ROWS, SPAN=GATE_UP_SPAN, BLOCK_K=block_k,
        num_warps=GATE_UP_WARPS, **_layouts(GATE_UP_SPAN, block_k, GATE_UP_WARPS, GATE_UP_ROWS),
        **launch_options(_gate_up_kernel, x.device),
    )  # fmt: skip
    return True


def down(h: torch.Tensor, plan: object, weights: object, y: torch.Tensor, interpreting: bool) -> bool:
    """fp32 y by pair id from h by plan position and the spanned NVFP4 down weights; False, doing nothing, where
    this kernel does not run (kernels/moe.py then runs its own)."""
    if not down_usable(weights, plan, interpreting):
        return False
    w, s = weights.down, weights.down_scale
    span = span_k(weights.inter)
    warps, groups = down_shape(plan.pairs.numel())
    rows = down_rows(plan.block_m, plan.pairs.numel(), weights.experts)
    main, rest = down_spans(weights.inter)
    programs = plan.max_tiles * triton.cdiv(weights.d, 16 * warps * groups)
    rest_layouts = _layouts(span, rest * span, warps, rows)
    _down_kernel[(plan.block_m // rows * programs,)](
        h, plan.pairs, plan.bounds, plan.tile_experts, plan.tile_starts, w, s, weights.down_scale_2, y, weights.d,
        weights.inter, w.stride(0), w.stride(1) // (span // 8), s.stride(0), s.stride(1) // (span // 16), programs,
        E=weights.experts, WARPS=warps, ROWS=rows, GROUP=groups, SPAN=span, MAIN_SPANS=main, REST_SPANS=rest,
        num_warps=warps, **_layouts(span, main * span, warps, rows), L_W_REST=rest_layouts["L_W"],
        L_X_REST=rest_layouts["L_X"],
        **launch_options(_down_kernel, h.device),
    )  # fmt: skip
    return True
