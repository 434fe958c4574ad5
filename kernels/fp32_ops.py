"""Elementwise fp32 steps the kernels share, with the interpreter's own forms: rounding to the activation dtype
(nearest even), exp (libdevice's expf on the GPU) and the sigmoid built from it; a sum and a multiply that no compile
option fuses into a multiply-add, a division that no ftz option flushes, and sums as trees of neighbour pairs, which
no layout reorders. A kernel compiled with FMA contraction gives these steps the bits a kernel compiled without it
gives them."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def round_to_act(x, ACT_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 -> act, round to nearest even (on the bits under the interpreter, whose cast truncates)."""
    if not ACT_BF16:
        return x
    elif INTERPRET:  # the top half of the rounded bits: the interpreter's float cast garbles subnormals too
        bits = x.to(tl.uint32, bitcast=True)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def negative_zeros(SHAPE: tl.constexpr):
    """fp32 -0.0s (the exact additive identity) of SHAPE, made from their bits: Triton up to 3.6 compiles
    `tl.full(shape, -0.0)` to +0.0, taking any value equal to zero for its null constant."""
    return tl.full(SHAPE, 0x80000000, tl.uint32).to(tl.float32, bitcast=True)


@triton.jit
def exp_f32(x, INTERPRET: tl.constexpr):
    """exp in fp32: libdevice's expf on the GPU (not tl.exp's ex2.approx), numpy's under the interpreter."""
    if INTERPRET:
        return tl.exp(x)
    else:
        return libdevice.exp(x)


@triton.jit
def sigmoid_f32(x, INTERPRET: tl.constexpr):
    """1 / (1 + exp(-x)) in fp32, correctly rounded division."""
    return tl.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + exp_f32(-x, INTERPRET))


@triton.jit
def hyper_gates(a, HC: tl.constexpr, INTERPRET: tl.constexpr):
    """The hyper read's gates from its fp32 sums a, with v = a / hc: (silu(v) = v / (1 + exp(-v)), 2·sigmoid(v))."""
    v = tl.div_rn(a, tl.full(a.shape, HC, tl.float32))
    return tl.div_rn(v, 1.0 + exp_f32(-v, INTERPRET)), 2.0 * sigmoid_f32(v, INTERPRET)


@triton.jit
def add_rn(x, y, INTERPRET: tl.constexpr):
    """x + y rounded to nearest even, never contracted with a product into a fused multiply-add."""
    if INTERPRET:
        return x + y
    else:  # PTX rather than libdevice, whose add_rn flushes subnormals when libdevice is built with ftz
        return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=r,r,r", [x, y], tl.float32, True, 1)


@triton.jit
def mul_rn(x, y, INTERPRET: tl.constexpr):
    """x · y rounded to nearest even, never contracted with a sum into a fused multiply-add."""
    if INTERPRET:
        return x * y
    else:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [x, y], tl.float32, True, 1)


@triton.jit
def div_rn(x, y, INTERPRET: tl.constexpr):
    """x / y correctly rounded, subnormals kept whatever the kernel's ftz setting."""
    if INTERPRET:
        return tl.div_rn(x, y)
    else:
        return tl.inline_asm_elementwise("div.rn.f32 $0, $1, $2;", "=r,r,r", [x, y], tl.float32, True, 1)


@triton.jit
def pairwise_sum(x, BLOCK: tl.constexpr):
    """Σ x over a power-of-two block as a balanced tree of pairs: each level adds two neighbours, a + b, which no
    layout can reorder."""
    for level in tl.static_range(1, BLOCK.bit_length()):
        x = tl.sum(tl.reshape(x, (BLOCK >> level, 2)), axis=1)
    return tl.sum(x, axis=0)


@triton.jit
def pairwise_row_sums(x, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """`pairwise_sum` of each row of x [ROWS, BLOCK]: [ROWS]."""
    for level in tl.static_range(1, BLOCK.bit_length()):
        x = tl.sum(tl.reshape(x, (ROWS, BLOCK >> level, 2)), axis=2)
    return tl.sum(x, axis=1)
