"""The gate kernels against their references (today's model formulas), bit for bit, and their rows by batch.

Under the interpreter the kernels' exp and log1p are correctly rounded (fp64, rounded once to fp32); torch's CPU ones
are within 1 ulp of that and differ between a tensor's vector body and its scalar tail. So exactness is checked with
the references' exp and log1p correctly rounded too (every other operation and rounding is then compared bit for
bit), that 1 ulp is checked on its own, and the kernels against the untouched references within what it allows.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

from collections.abc import Callable

import pytest
import torch

from kernels.gates import (
    gated_add,
    gated_add_reference,
    gdn_gates,
    gdn_gates_reference,
    sigmoid_mul,
    sigmoid_mul_reference,
    silu_mul,
    silu_mul_reference,
)

# zeros, the softplus threshold and its fp32 neighbours, exp's fp32 overflow (88.72) and subnormal (-87.3) edges
SPECIAL = (
    0.0, -0.0, 1e-8, -1e-8, 0.5, -0.5, 15.0, 19.5, 19.9, 19.99, 19.999998, 20.0, 20.000002, 20.01, 20.1, 20.5, 25.0,
    -20.0, 87.0, 88.7, 88.75, 89.0, 100.0, 1000.0, -87.0, -88.5, -93.0, -100.0, -104.0, -110.0, -1000.0,
)  # fmt: skip
SCALES = (1e-3, 0.1, 1.0, 5.0, 20.0, 100.0)
N, H, D = 64, 37, 300
DTYPES = (torch.bfloat16, torch.float32)
TORCH_EXP, TORCH_LOG1P = torch.exp, torch.log1p


def values(n: int, c: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[n, c] normal noise at a scale per row from 1e-3 to 100, starting with the SPECIAL values (then rounded)."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor(SCALES)[torch.randint(len(SCALES), (n, 1), generator=g)]
    x = torch.randn(n, c, generator=g) * scale
    k = min(len(SPECIAL), x.numel())
    x.view(-1)[:k] = torch.tensor(SPECIAL[:k])
    return x.to(dtype)


def gdn_inputs(act: torch.dtype, param: torch.dtype, n: int = N) -> tuple[torch.Tensor, ...]:
    """b, a [n, H] in act and a_log, dt_bias [H] in param; dt_bias is 0 on some heads, so a hits 20 exactly."""
    g = torch.Generator().manual_seed(7)
    a_log = torch.randn(H, generator=g) * 2
    dt_bias = torch.randn(H, generator=g)
    dt_bias[::4] = 0.0
    return values(n, H, act, 1), values(n, H, act, 2), a_log.to(param), dt_bias.to(param)


def bits(t: torch.Tensor) -> torch.Tensor:
    """t's bit patterns (so -0.0 differs from 0.0 and NaN equals itself)."""
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def assert_same_bits(out: torch.Tensor, ref: torch.Tensor) -> None:
    """out and ref have one dtype, one shape and the same bits."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    differ = bits(out) != bits(ref)
    assert not differ.any(), f"{int(differ.sum())} differ, first at {differ.nonzero()[0].tolist()}"


def correctly_rounded(op: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """op evaluated in fp64 and rounded once to the input's dtype."""
    return lambda x: op(x.double()).to(x.dtype)


@pytest.fixture
def exact_math(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.exp, Tensor.exp and torch.log1p correctly rounded, as the kernels' are under the interpreter."""
    monkeypatch.setattr(torch, "exp", correctly_rounded(TORCH_EXP))
    monkeypatch.setattr(torch.Tensor, "exp", correctly_rounded(TORCH_EXP))
    monkeypatch.setattr(torch, "log1p", correctly_rounded(TORCH_LOG1P))


def ulps(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """How many representable fp32 values apart x and y are, elementwise."""

    def ordered(t: torch.Tensor) -> torch.Tensor:
        v = t.view(torch.int32).long()
        return torch.where(v < 0, -(v & 0x7FFFFFFF), v)

    return (ordered(x) - ordered(y)).abs()


def assert_near(out: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | float = 0.0) -> None:
    """out within 2^-20 of ref relative to |ref| + scale (a few fp32 ulps), 2^-7 (about one ulp) for bf16."""
    o, r = out.double(), ref.double()
    rel = 2.0**-7 if out.dtype == torch.bfloat16 else 2.0**-20
    assert ((o - r).abs() <= rel * (r.abs() + scale) + 2.0**-140).all()


def test_torch_exp_and_log1p_are_within_one_ulp_of_correctly_rounded() -> None:
    x = torch.cat((torch.linspace(-110.0, 110.0, 400_001), torch.tensor(SPECIAL)))
    assert ulps(torch.exp(x), correctly_rounded(TORCH_EXP)(x)).max() <= 1
    e = torch.exp(x[x <= 20])
    assert ulps(torch.log1p(e), correctly_rounded(TORCH_LOG1P)(e)).max() <= 1


@pytest.mark.parametrize("param", DTYPES)
@pytest.mark.parametrize("act", DTYPES)
def test_gdn_gates_match_reference(act: torch.dtype, param: torch.dtype, exact_math: None) -> None:
    b, a, a_log, dt_bias = gdn_inputs(act, param)
    beta, g = gdn_gates(b, a, a_log, dt_bias)
    ref_beta, ref_g = gdn_gates_reference(b, a, a_log, dt_bias)
    assert beta.dtype == act and g.dtype == torch.float32
    assert_same_bits(beta, ref_beta)
    assert_same_bits(g, ref_g)


@pytest.mark.parametrize("act", DTYPES)
def test_silu_mul_matches_reference(act: torch.dtype, exact_math: None) -> None:
    gate, up = values(N, D, act, 3), values(N, D, act, 4)
    assert_same_bits(silu_mul(gate, up), silu_mul_reference(gate, up))


@pytest.mark.parametrize("act", DTYPES)
def test_gated_add_matches_reference(act: torch.dtype, exact_math: None) -> None:
    routed, logit, shared = values(N, D, act, 5), values(N, 1, act, 6), values(N, D, act, 4)
    assert_same_bits(gated_add(routed, logit, shared), gated_add_reference(routed, logit, shared))


def test_gated_add_keeps_subnormal_results() -> None:
    """Results below bf16's normal range keep their bits in bf16 and in fp32 out (the interpreter's cast drops them)."""
    shared = torch.tensor([[2.0**-128, 2.0**-130, 3 * 2.0**-133, 1.0]]).bfloat16()
    routed, logit = torch.zeros_like(shared), torch.zeros(1, 1, dtype=torch.bfloat16)
    want = gated_add_reference(routed, logit, shared)
    assert want[0, :3].ne(0).all()
    assert_same_bits(gated_add(routed, logit, shared), want)
    assert_same_bits(gated_add(routed, logit, shared, torch.float32), want.float())


@pytest.mark.parametrize("act", DTYPES)
def test_gated_add_into_fp32_holds_the_act_values(act: torch.dtype) -> None:
    """The MoE's partial at two ranks: the act-dtype result's values in fp32, ready to be all-reduced in place."""
    routed, logit, shared = values(N, D, act, 5), values(N, 1, act, 6), values(N, D, act, 4)
    wide = gated_add(routed, logit, shared, torch.float32)
    assert_same_bits(wide, gated_add(routed, logit, shared).float())
    with pytest.raises(TypeError, match="out_dtype"):
        gated_add(routed, logit, shared, torch.float16)


@pytest.mark.parametrize("act", DTYPES)
def test_sigmoid_mul_matches_reference(act: torch.dtype, exact_math: None) -> None:
    x, gate = values(N, D, act, 9).view(N, 4, D // 4), values(N, D, act, 10).view(N, 4, D // 4)
    out = sigmoid_mul(x, gate)
    assert out.is_contiguous()
    assert_same_bits(out, sigmoid_mul_reference(x, gate))


def test_sigmoid_mul_takes_strided_and_expanded_views(exact_math: None) -> None:
    """QSA's gate: the second half of each head in a fused projection; PLE's: one gate a stream times one value row."""
    fused = values(N, 4 * 2 * 8 + 3, torch.bfloat16, 11)
    gate = fused[:, 3:].unflatten(-1, (4, 16)).chunk(2, dim=-1)[1]
    x = values(N, 4 * 8, torch.bfloat16, 12).view(N, 4, 8)
    assert not gate.is_contiguous()
    assert_same_bits(sigmoid_mul(x, gate), sigmoid_mul(x, gate.contiguous()))
    value, stream_gate = values(N, D, torch.bfloat16, 13), values(N, 4, torch.bfloat16, 14)
    value, stream_gate = value.unsqueeze(-2).expand(N, 4, D), stream_gate.unsqueeze(-1).expand(N, 4, D)
    expanded = sigmoid_mul(value, stream_gate)
    assert_same_bits(expanded, sigmoid_mul(value.contiguous(), stream_gate.contiguous()))
    assert_same_bits(expanded, sigmoid_mul_reference(value, stream_gate))


@pytest.mark.parametrize("act", DTYPES)
def test_kernels_near_references_with_torch_math(act: torch.dtype) -> None:
    b, a, a_log, dt_bias = gdn_inputs(act, act)
    for out, ref in zip(gdn_gates(b, a, a_log, dt_bias), gdn_gates_reference(b, a, a_log, dt_bias), strict=True):
        assert_near(out, ref)
    gate, up = values(N, D, act, 3), values(N, D, act, 4)
    assert_near(silu_mul(gate, up), silu_mul_reference(gate, up))
    routed, logit = values(N, D, act, 5), values(N, 1, act, 6)
    assert_near(gated_add(routed, logit, up), gated_add_reference(routed, logit, up), up.double().abs())
    x3, gate3 = up.view(N, 4, D // 4), routed.view(N, 4, D // 4)
    assert_near(sigmoid_mul(x3, gate3), sigmoid_mul_reference(x3, gate3))


@pytest.mark.parametrize("act", DTYPES)
def test_references_share_one_sigmoid(act: torch.dtype) -> None:
    """beta, the shared expert's gate and sigmoid_mul's gate: one fp32 formula over exp, rounded once."""
    b, a, a_log, dt_bias = gdn_inputs(act, act)
    beta, _ = gdn_gates_reference(b, a, a_log, dt_bias)
    sigmoid = sigmoid_mul_reference(torch.ones_like(b).unsqueeze(-1), b.unsqueeze(-1)).squeeze(-1)
    assert_same_bits(beta, sigmoid)
    up = values(N, D, act, 4)
    routed, logit = values(N, D, act, 5), values(N, 1, act, 6)
    gate = sigmoid_mul_reference(torch.ones_like(logit).unsqueeze(-1), logit.unsqueeze(-1)).squeeze(-1)
    assert_same_bits(gated_add_reference(routed, logit, up), routed + gate * up)


def run_all(act: torch.dtype, rows: slice) -> list[torch.Tensor]:
    """Every kernel output for the given rows of the test inputs."""
    b, a, a_log, dt_bias = gdn_inputs(act, act)
    gate, up, routed, logit = values(N, D, act, 3), values(N, D, act, 4), values(N, D, act, 5), values(N, 1, act, 6)
    return [
        *gdn_gates(b[rows], a[rows], a_log, dt_bias),
        silu_mul(gate[rows], up[rows]),
        gated_add(routed[rows], logit[rows], up[rows]),
        sigmoid_mul(up[rows].unflatten(-1, (4, D // 4)), routed[rows].unflatten(-1, (4, D // 4))),
    ]


@pytest.mark.parametrize("act", DTYPES)
def test_rows_identical_across_batch_sizes(act: torch.dtype) -> None:
    full = run_all(act, slice(0, N))
    for n in (1, 2, 7, 64):
        for start in sorted({0, 29 % (N - n + 1), N - n}):
            for out, whole in zip(run_all(act, slice(start, start + n)), full, strict=True):
                assert_same_bits(out, whole[start : start + n])


def test_strided_inputs_give_the_contiguous_bits() -> None:
    wide = values(N, 2 * D, torch.bfloat16, 3)
    gate, up, logit = wide[:, ::2], wide[:, 1::2], values(N, 2, torch.bfloat16, 6)[:, 1:]
    assert not gate.is_contiguous() and not logit.is_contiguous()
    assert_same_bits(silu_mul(gate, up), silu_mul(gate.contiguous(), up.contiguous()))
    assert_same_bits(gated_add(gate, logit, up), gated_add(gate.contiguous(), logit.contiguous(), up.contiguous()))
    _, _, a_log, dt_bias = gdn_inputs(torch.bfloat16, torch.float32)
    heads = values(N, 2 * H, torch.bfloat16, 1)
    b, a = heads[:, ::2], heads[:, 1::2]
    strided, packed = gdn_gates(b, a, a_log, dt_bias), gdn_gates(b.contiguous(), a.contiguous(), a_log, dt_bias)
    for out, ref in zip(strided, packed, strict=True):
        assert_same_bits(out, ref)


def test_row_strided_slices_of_one_projection_give_the_contiguous_bits() -> None:
    """The kernel path hands the kernels column ranges of one fused projection's output: rows at a wider stride."""
    fused = values(N, 2 * D + 1, torch.bfloat16, 7)
    gate, up, logit = fused[:, :D], fused[:, D : 2 * D], fused[:, 2 * D :]
    assert gate.stride(0) == 2 * D + 1 and logit.stride(0) == 2 * D + 1
    assert_same_bits(silu_mul(gate, up), silu_mul(gate.contiguous(), up.contiguous()))
    assert_same_bits(gated_add(up, logit, gate), gated_add(up.contiguous(), logit.contiguous(), gate.contiguous()))
    _, _, a_log, dt_bias = gdn_inputs(torch.bfloat16, torch.float32)
    heads = values(N, 3 * H, torch.bfloat16, 8)
    b, a = heads[:, H : 2 * H], heads[:, 2 * H :]
    strided, packed = gdn_gates(b, a, a_log, dt_bias), gdn_gates(b.contiguous(), a.contiguous(), a_log, dt_bias)
    for out, ref in zip(strided, packed, strict=True):
        assert_same_bits(out, ref)


@pytest.mark.parametrize("act", DTYPES)
def test_zero_rows(act: torch.dtype) -> None:
    empty = torch.empty(0, H, dtype=act)
    beta, g = gdn_gates(empty, empty, torch.zeros(H), torch.zeros(H))
    assert beta.shape == (0, H) and beta.dtype == act and g.shape == (0, H) and g.dtype == torch.float32
    rows = torch.empty(0, D, dtype=act)
    out = silu_mul(rows, rows)
    assert out.shape == (0, D) and out.dtype == act
    out = gated_add(rows, torch.empty(0, 1, dtype=act), rows)
    assert out.shape == (0, D) and out.dtype == act
    heads = torch.empty(0, 4, D, dtype=act)
    out = sigmoid_mul(heads, heads)
    assert out.shape == (0, 4, D) and out.dtype == act


BF = torch.bfloat16
X, P, LOGIT = torch.zeros(3, 4, dtype=BF), torch.zeros(4), torch.zeros(3, 1, dtype=BF)


@pytest.mark.parametrize(
    ("fn", "args", "error", "name"),
    [
        (gdn_gates, (X[0], X[0], P, P), ValueError, "b"),
        (gdn_gates, (X.half(), X, P, P), TypeError, "b"),
        (gdn_gates, (X, X[:2], P, P), ValueError, "a"),
        (gdn_gates, (X, X.to(torch.int32), P, P), TypeError, "a"),
        (gdn_gates, (X, X, P[:3], P), ValueError, "a_log"),
        (gdn_gates, (X, X, P, P.double()), TypeError, "dt_bias"),
        (silu_mul, (X.double(), X), TypeError, "gate"),
        (silu_mul, (X, X[:, :3]), ValueError, "up"),
        (silu_mul, (X, X.float()), TypeError, "up"),
        (gated_add, (X[None], LOGIT, X), ValueError, "routed"),
        (gated_add, (X, X[:, :2], X), ValueError, "gate_logit"),
        (gated_add, (X, LOGIT.float(), X), TypeError, "gate_logit"),
        (gated_add, (X, LOGIT, X.float()), TypeError, "shared"),
        (gated_add, (X, LOGIT, X[:2]), ValueError, "shared"),
        (sigmoid_mul, (X, X), ValueError, "x"),
        (sigmoid_mul, (X[None].half(), X[None]), TypeError, "x"),
        (sigmoid_mul, (X[None], X[None, :2]), ValueError, "gate"),
        (sigmoid_mul, (X[None], X[None].float()), TypeError, "gate"),
    ],
)
def test_rejects_bad_inputs(fn: Callable[..., object], args: tuple, error: type[Exception], name: str) -> None:
    with pytest.raises(error, match=f"^{name}:"):
        fn(*args)
