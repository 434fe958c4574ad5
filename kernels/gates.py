"""The elementwise gates around the GDN, shared-expert, QSA and PLE projections, each site in one launch (QSA's in
its attention's merge).

`gdn_gates(b, a, a_log, dt_bias)` gives beta = act_b(1 / (1 + exp(-b))) in b's dtype and
g = (-exp(a_log)) · softplus(a + dt_bias) in fp32, with softplus(x) = x above 20, else log1p(exp(x)) (exp rounded to
fp32 before log1p; a_log and dt_bias [H] broadcast over the rows); `silu_mul(gate, up)` gives
act(act(g / (1 + exp(-g))) · up); `gated_add(routed, gate_logit, shared)` gives
act(routed + act(act(1 / (1 + exp(-z))) · shared)) with one logit z per row; `sigmoid_mul(x, gate)` gives
act(x · act(1 / (1 + exp(-gate)))) over [N, H, D] views (PLE's gated values; QSA's output gate is formed by
`sigmoid_gated`, its element, in the attention's merge launch). Every input is
widened to fp32, each operation runs in fp32 in the order written (divisions correctly rounded, no fused
multiply-adds), and `act(·)` rounds fp32 to the activation dtype, to nearest even: bf16 in the model (torch's bf16
ops compute in fp32 and round once, so these are its bits), nothing for fp32. exp and log1p are libdevice's on the
GPU without flushing subnormals, as torch's CUDA ops use them; under the interpreter they are numpy's fp64 ones
rounded once to fp32 (correctly rounded), within 1 ulp of torch's CPU ones.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels.fp32_ops import add_rn, div_rn, mul_rn, round_to_act
from kernels.pdl import enter, launch_options

# The interpreter has no libdevice, and its bf16 casts truncate and lose subnormals: there they go through the bits.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK = 1024
NUM_WARPS = 4


@triton.jit
def _f32(x, INTERPRET: tl.constexpr):
    """x (bf16 or fp32) in fp32, exactly; a bf16 x is widened on its bits under the interpreter."""
    if INTERPRET and x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _round(x, ACT_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """x rounded to act, kept in fp32 for the next operation."""
    return _f32(round_to_act(x, ACT_BF16, INTERPRET), INTERPRET)


@triton.jit
def _exp(x, INTERPRET: tl.constexpr):
    """exp in fp32: libdevice's expf on the GPU, numpy's fp64 exp rounded once to fp32 under the interpreter."""
    if INTERPRET:
        big = x > 88.72283172607422  # the largest fp32 whose exp rounds to a finite fp32
        e = tl.exp(tl.where(big, 0.0, x).to(tl.float64)).to(tl.float32)
        return tl.where(big, float("inf"), e)
    else:
        return libdevice.exp(x)


@triton.jit
def _sigmoid(x, INTERPRET: tl.constexpr):
    """1 / (1 + exp(-x)) in fp32, the sum and the correctly rounded division in PTX (no kernel option flushes them)."""
    one = tl.full(x.shape, 1.0, tl.float32)
    return div_rn(one, add_rn(one, _exp(-x, INTERPRET), INTERPRET), INTERPRET)


@triton.jit
def _softplus(x, INTERPRET: tl.constexpr):
    """x above 20, else log1p(exp(x)), in fp32 with exp rounded to fp32 first (libdevice's log1p on the GPU)."""
    if INTERPRET:
        # log1p(e) = log(u) · e / (u - 1) with u = 1 + e in fp64 cancels u's rounding; then rounded once to fp32
        e = _exp(tl.where(x > 20.0, 0.0, x), INTERPRET).to(tl.float64)
        u = 1.0 + e
        lp = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0))).to(tl.float32)
    else:
        lp = libdevice.log1p(libdevice.exp(x))
    return tl.where(x > 20.0, x, lp)


@triton.jit(do_not_specialize=["total"])
def _gdn_gates_kernel(
    b_ptr,
    a_ptr,
    a_log_ptr,
    dt_bias_ptr,
    beta_ptr,
    g_ptr,
    total,
    H,
    stride_b,
    stride_a,
    B_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    """beta = act_b(sigmoid(b)) and g = (-exp(a_log)) · softplus(a + dt_bias) for BLOCK elements of [N, H] (b and a
    rows at their own strides, the outputs contiguous)."""
    enter(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < total
    row, head = offs // H, offs % H
    b = tl.load(b_ptr + row * stride_b + head, mask=ok, other=0.0)
    a = tl.load(a_ptr + row * stride_a + head, mask=ok, other=0.0)
    beta, g = gdn_gate_values(b, a, tl.load(a_log_ptr + head), tl.load(dt_bias_ptr + head), B_BF16, INTERPRET)
    tl.store(beta_ptr + offs, beta, mask=ok)
    tl.store(g_ptr + offs, g, mask=ok)


@triton.jit
def gdn_gate_values(b, a, a_log, dt_bias, B_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """(act_b(sigmoid(b)), (-exp(a_log)) · softplus(a + dt_bias) in fp32) from the loaded values, every sum and
    product rounded apart (the bits of a kernel compiled with FMA contraction too)."""
    beta = round_to_act(_sigmoid(_f32(b, INTERPRET), INTERPRET), B_BF16, INTERPRET)
    x = add_rn(_f32(a, INTERPRET), _f32(dt_bias, INTERPRET), INTERPRET)
    decay = -_exp(_f32(a_log, INTERPRET), INTERPRET)
    return beta, mul_rn(decay, _softplus(x, INTERPRET), INTERPRET)


@triton.jit
def silu_mul_value(gate, up, ACT_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """act(act(g / (1 + exp(-g))) · up) of act values gate and up, widened to fp32 (the launch compiled without fused
    multiply-adds, subnormals kept: `_launch`'s options)."""
    g = _f32(gate, INTERPRET)
    act = _round(tl.div_rn(g, 1.0 + _exp(-g, INTERPRET)), ACT_BF16, INTERPRET)
    return round_to_act(act * _f32(up, INTERPRET), ACT_BF16, INTERPRET)


@triton.jit(do_not_specialize=["total"])
def _silu_mul_kernel(
    gate_ptr,
    up_ptr,
    out_ptr,
    total,
    C,
    stride_gate,
    stride_up,
    ACT_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    """out = act(act(silu(gate)) · up) for BLOCK elements of [N, C] (inputs' rows at their own strides)."""
    enter(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < total
    row, col = offs // C, offs % C
    gate = tl.load(gate_ptr + row * stride_gate + col, mask=ok, other=0.0)
    up = tl.load(up_ptr + row * stride_up + col, mask=ok, other=0.0)
    tl.store(out_ptr + offs, silu_mul_value(gate, up, ACT_BF16, INTERPRET), mask=ok)


@triton.jit(do_not_specialize=["total"])
def _gated_add_kernel(
    routed_ptr,
    logit_ptr,
    shared_ptr,
    out_ptr,
    total,
    D,
    stride_logit,
    ACT_BF16: tl.constexpr,
    OUT_F32: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    """out = act(routed + act(act(sigmoid(logit of the row)) · shared)) for BLOCK elements of [N, D] (OUT_F32: the
    same act-rounded values stored as fp32)."""
    enter(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < total
    z = tl.load(logit_ptr + (offs // D) * stride_logit, mask=ok, other=0.0)
    shared = tl.load(shared_ptr + offs, mask=ok, other=0.0)
    routed = tl.load(routed_ptr + offs, mask=ok, other=0.0)
    value = gated_value(routed, z, shared, ACT_BF16, INTERPRET)
    tl.store(out_ptr + offs, value if OUT_F32 else round_to_act(value, ACT_BF16, INTERPRET), mask=ok)


@triton.jit
def gated_value(routed, z, shared, ACT_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """act(act(routed) + act(act(sigmoid(z)) · shared)) in fp32 from loaded values (bf16 or fp32), exact in act: the
    sum, product and division in PTX, rounded apart and subnormals kept, so a kernel compiled with FMA contraction or
    ftz gives the same bits (exp flushes only results below fp32's normal range, which leave 1 + exp unchanged)."""
    gate = _round(_sigmoid(_f32(z, INTERPRET), INTERPRET), ACT_BF16, INTERPRET)
    scaled = _round(mul_rn(gate, _f32(shared, INTERPRET), INTERPRET), ACT_BF16, INTERPRET)
    routed = _round(_f32(routed, INTERPRET), ACT_BF16, INTERPRET)
    return _round(add_rn(routed, scaled, INTERPRET), ACT_BF16, INTERPRET)


@triton.jit
def sigmoid_gated(x, gate, ACT_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """act(act(x) · act(sigmoid(gate))) for x and gate as loaded (bf16 or fp32): `sigmoid_mul`'s element. x is rounded
    to act first (nothing for an act x), so a kernel can gate its fp32 results as their act values."""
    x = _round(_f32(x, INTERPRET), ACT_BF16, INTERPRET)
    return round_to_act(
        x * _round(_sigmoid(_f32(gate, INTERPRET), INTERPRET), ACT_BF16, INTERPRET), ACT_BF16, INTERPRET
    )


@triton.jit(do_not_specialize=["total"])
def _sigmoid_mul_kernel(
    x_ptr,
    gate_ptr,
    out_ptr,
    total,
    H,
    D,
    stride_xn,
    stride_xh,
    stride_xd,
    stride_gn,
    stride_gh,
    stride_gd,
    ACT_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    """out = act(x · act(sigmoid(gate))) for BLOCK elements of [N, H, D], out contiguous, x and gate at their own
    strides (0 where a view broadcasts)."""
    enter(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < total
    n, h, d = offs // (H * D), offs // D % H, offs % D
    x = tl.load(x_ptr + n * stride_xn + h * stride_xh + d * stride_xd, mask=ok, other=0.0)
    g = tl.load(gate_ptr + n * stride_gn + h * stride_gh + d * stride_gd, mask=ok, other=0.0)
    tl.store(out_ptr + offs, sigmoid_gated(x, g, ACT_BF16, INTERPRET), mask=ok)


def _check(t: torch.Tensor, name: str, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> None:
    """Raise TypeError if t's dtype is not in dtypes, ValueError if its shape is not `shape`."""
    if t.dtype not in dtypes:
        raise TypeError(f"{name}: expected dtype in {dtypes}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")


def _check_rows(t: torch.Tensor, name: str) -> None:
    """Raise unless t is a bf16 or fp32 [N, C] tensor."""
    if t.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"{name}: expected bf16 or fp32, got {t.dtype}")
    if t.dim() != 2:
        raise ValueError(f"{name}: expected [N, C], got shape {list(t.shape)}")


def contiguous_columns(t: torch.Tensor) -> torch.Tensor:
    """t itself when its columns are contiguous (its rows may sit at any stride), else a contiguous copy."""
    return t if t.stride(1) == 1 or t.shape[1] == 1 else t.contiguous()


def _check_device(**tensors: torch.Tensor) -> None:
    """Raise ValueError unless the tensors share one device."""
    if len({t.device for t in tensors.values()}) != 1:
        raise ValueError(f"{', '.join(tensors)} must be on one device")


def _launch(
    kernel: triton.runtime.JITFunction, total: int, device: torch.device, *args: object, **consts: object
) -> None:
    """One of these kernels over `total` elements, BLOCK a program: each fp32 step rounded (no fused multiply-adds),
    subnormals kept."""
    if total:
        kernel[(triton.cdiv(total, BLOCK),)](
            *args, BLOCK=BLOCK, INTERPRET=INTERPRET, num_warps=NUM_WARPS, enable_fp_fusion=False,
            enable_reflect_ftz=False, **consts, **launch_options(kernel, device),
        )  # fmt: skip


def check_gdn_gates(b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor) -> None:
    """Raise on the dtypes, shapes or devices gdn_gates cannot take."""
    _check_rows(b, "b")
    floats = (torch.bfloat16, torch.float32)
    _check(a, "a", tuple(b.shape), floats)
    _check(a_log, "a_log", (b.shape[1],), floats)
    _check(dt_bias, "dt_bias", (b.shape[1],), floats)
    _check_device(b=b, a=a, a_log=a_log, dt_bias=dt_bias)


def gdn_gates(
    b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(beta [N, H] in b's dtype, g [N, H] fp32) from the b and a projections [N, H] and a_log, dt_bias [H]."""
    check_gdn_gates(b, a, a_log, dt_bias)
    b, a, a_log, dt_bias = contiguous_columns(b), contiguous_columns(a), a_log.contiguous(), dt_bias.contiguous()
    beta = torch.empty(b.shape, dtype=b.dtype, device=b.device)
    g = torch.empty(b.shape, dtype=torch.float32, device=b.device)
    _launch(
        _gdn_gates_kernel, b.numel(), b.device, b, a, a_log, dt_bias, beta, g, b.numel(), b.shape[1], b.stride(0),
        a.stride(0), B_BF16=b.dtype == torch.bfloat16,
    )  # fmt: skip
    return beta, g


def gdn_gates_reference(
    b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-PyTorch gdn_gates: the model's `sigmoid(b)` and `-A_log.exp() * softplus(a + dt_bias)`."""
    check_gdn_gates(b, a, a_log, dt_bias)
    beta = (1.0 / (1.0 + torch.exp(-b.float()))).to(b.dtype)
    x = a.float() + dt_bias.float()
    return beta, -a_log.float().exp() * torch.where(x > 20, x, torch.log1p(torch.exp(x)))


def _check_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> None:
    """Raise on the dtypes, shapes or devices silu_mul cannot take."""
    _check_rows(gate, "gate")
    _check(up, "up", tuple(gate.shape), (gate.dtype,))
    _check_device(gate=gate, up=up)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up for the gate and up projections [N, I], in their dtype."""
    _check_silu_mul(gate, up)
    gate, up = contiguous_columns(gate), contiguous_columns(up)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    _launch(
        _silu_mul_kernel, gate.numel(), gate.device, gate, up, out, gate.numel(), gate.shape[1], gate.stride(0),
        up.stride(0), ACT_BF16=gate.dtype == torch.bfloat16,
    )  # fmt: skip
    return out


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Plain-PyTorch silu_mul: the model's `silu(gate) * up`."""
    _check_silu_mul(gate, up)
    gf = gate.float()
    return (gf / (1.0 + torch.exp(-gf))).to(gate.dtype) * up


def _check_gated_add(routed: torch.Tensor, gate_logit: torch.Tensor, shared: torch.Tensor) -> None:
    """Raise on the dtypes, shapes or devices gated_add cannot take."""
    _check_rows(routed, "routed")
    _check(gate_logit, "gate_logit", (routed.shape[0], 1), (routed.dtype,))
    _check(shared, "shared", tuple(routed.shape), (routed.dtype,))
    _check_device(routed=routed, gate_logit=gate_logit, shared=shared)


def gated_add(
    routed: torch.Tensor, gate_logit: torch.Tensor, shared: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """routed + sigmoid(gate_logit) · shared for routed, shared [N, D] and the shared-expert gate logits [N, 1];
    `out_dtype=torch.float32` stores the same values (rounded to routed's dtype) as fp32, ready to all-reduce."""
    _check_gated_add(routed, gate_logit, shared)
    if out_dtype not in (None, routed.dtype, torch.float32):
        raise TypeError(f"gated_add: out_dtype must be {routed.dtype} or fp32, got {out_dtype}")
    routed, gate_logit, shared = routed.contiguous(), contiguous_columns(gate_logit), shared.contiguous()
    out = torch.empty(routed.shape, dtype=out_dtype or routed.dtype, device=routed.device)
    _launch(
        _gated_add_kernel, routed.numel(), routed.device, routed, gate_logit, shared, out, routed.numel(),
        routed.shape[1], gate_logit.stride(0), ACT_BF16=routed.dtype == torch.bfloat16,
        OUT_F32=out.dtype != routed.dtype,
    )  # fmt: skip
    return out


def gated_add_reference(routed: torch.Tensor, gate_logit: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """Plain-PyTorch gated_add: the model's `routed + sigmoid(gate_logit) * shared`."""
    _check_gated_add(routed, gate_logit, shared)
    gate = (1.0 / (1.0 + torch.exp(-gate_logit.float()))).to(gate_logit.dtype)
    return routed + gate * shared


def _check_sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> None:
    """Raise on the dtypes, shapes or devices sigmoid_mul cannot take."""
    if x.dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"x: expected bf16 or fp32, got {x.dtype}")
    if x.dim() != 3:
        raise ValueError(f"x: expected [N, H, D], got shape {list(x.shape)}")
    _check(gate, "gate", tuple(x.shape), (x.dtype,))
    _check_device(x=x, gate=gate)


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x · sigmoid(gate) for x, gate [N, H, D] views at any strides (expanded ones too), contiguous, in x's dtype."""
    _check_sigmoid_mul(x, gate)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(
        _sigmoid_mul_kernel, x.numel(), x.device, x, gate, out, x.numel(), x.shape[1], x.shape[2], *x.stride(),
        *gate.stride(), ACT_BF16=x.dtype == torch.bfloat16,
    )  # fmt: skip
    return out


def sigmoid_mul_reference(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Plain-PyTorch sigmoid_mul: the model's `x * sigmoid(gate)`, the sigmoid in fp32 over exp."""
    _check_sigmoid_mul(x, gate)
    return x * (1.0 / (1.0 + torch.exp(-gate.float()))).to(gate.dtype)
