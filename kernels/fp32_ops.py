"""Elementwise fp32 steps the kernels share, with the interpreter's own forms: rounding to the activation dtype
(nearest even), exp (libdevice's expf on the GPU) and the sigmoid built from it."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def round_to_act(x, ACT_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 -> act, round to nearest even (on the bits under the interpreter, whose cast truncates)."""
    if not ACT_BF16:
        return x
    elif INTERPRET:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return x.to(tl.bfloat16)


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
