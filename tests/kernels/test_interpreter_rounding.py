"""fp32 -> bf16 casts that the Triton interpreter truncates (or, for subnormals, mangles) where compiled code and
torch round to nearest even: each test runs a kernel under the interpreter in bf16 and compares its bits with the
kernel's own fp32 values rounded once to nearest even."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np
import pytest
import torch

import kernels.qsa as qsa
from kernels.conv import causal_conv_update, causal_conv_update_reference
from kernels.moe import moe_forward

FP32_TINY = 2.0**-126  # below this an fp32 (and a bf16) value is subnormal


def _share(a: torch.Tensor, b: torch.Tensor) -> str:
    """The share of elements that differ, as a message."""
    return f"{(a != b).float().mean().item():.0%} of the outputs differ"


def test_qsa_attention_rounds_its_probabilities_to_nearest_before_the_value_dot() -> None:
    """The attention's bf16 probabilities for the p·V dot are p rounded to nearest even, as the compiled cast rounds."""
    # Two selected keys a row, unit vectors e0 and e1 (scale 1/4 for D = 16): every score, the softmax's total, the
    # p·V sum (two exact products) and the division are single fp32 roundings, so only p's bf16 cast can differ.
    rows, heads, dim = 32, 4, 16
    gen = torch.Generator().manual_seed(0)
    q = torch.zeros(rows, heads, dim)
    q[:, :, :2] = torch.randn(rows, heads, 2, generator=gen) * 2
    q = q.bfloat16()
    k_cache = torch.zeros(rows, 2, 1, dim)
    k_cache[:, 0, 0, 0] = 1.0
    k_cache[:, 1, 0, 1] = 1.0
    k_cache = k_cache.bfloat16()
    v_cache = torch.randn(rows, 2, 1, dim, generator=gen).bfloat16()
    lanes = torch.arange(rows, dtype=torch.int32)
    idx = torch.tensor([[0, 1]] * rows, dtype=torch.int32)
    counts = torch.full((rows,), 2, dtype=torch.int32)

    s = q[:, :, :2].float() * 0.25
    p = torch.from_numpy(np.exp((s - s.max(-1, keepdim=True).values).numpy()))  # the interpreter's exp: numpy's
    total = p[..., 0] + p[..., 1]

    def merged(pb: torch.Tensor) -> torch.Tensor:
        return (pb[..., 0:1] * v_cache[:, 0].float() + pb[..., 1:2] * v_cache[:, 1].float()) / total[..., None]

    exact = qsa.qsa_sparse_attention(q.float(), k_cache.float(), v_cache.float(), lanes, idx, counts)
    assert torch.allclose(exact, merged(p), rtol=0.0, atol=1e-6)  # the fp32 kernel (p uncast) forms this sum
    out = qsa.qsa_sparse_attention(q, k_cache, v_cache, lanes, idx, counts)
    want = merged(p.bfloat16().float()).bfloat16()
    assert torch.equal(out, want), _share(out, want)


def test_conv_bf16_outputs_keep_subnormals_as_the_reference() -> None:
    """A bf16 conv output in bf16's subnormal range is its fp32 sum rounded to nearest even, the reference's bits."""
    # round_to_act rounds on the bits, then casts the rounded fp32 to bf16 with the interpreter's cast, which
    # mangles subnormals (2^-127 becomes 0, 1.0e-39 becomes 4.4e-39 ...).
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(11, 96, generator=gen) * 2.0**-64).bfloat16()
    tail = (torch.randn(2, 3, 96, generator=gen) * 2.0**-64).bfloat16()
    weight = (torch.randn(96, 4, generator=gen) * 2.0**-64).bfloat16()
    lanes = torch.ones(11, dtype=torch.long)
    out = causal_conv_update(x, tail.clone(), weight, lanes, 1, None)
    ref = causal_conv_update_reference(x, tail.clone(), weight, lanes, 1, None)
    exact = causal_conv_update(x.float(), tail.float(), weight.float(), lanes, 1, None)
    assert (ref.float().abs() < FP32_TINY).float().mean() > 0.5  # mostly subnormal outputs
    assert torch.equal(exact.bfloat16(), ref)  # the fp32 sums are the reference's: only the last rounding may differ
    assert torch.equal(out, ref), _share(out, ref)


@pytest.mark.parametrize("rows", [1, 7])  # the pairs path (down launch adds) and the grouped path (combine launch)
def test_moe_bf16_output_keeps_subnormals(rows: int) -> None:
    """A bf16 MoE output in bf16's subnormal range is the fp32 output rounded to nearest even."""
    experts, d, inter, top_k = 8, 64, 32, 2
    gen = torch.Generator().manual_seed(0)
    bank = {
        "gate_up": (torch.randn(experts, 2 * inter, d, generator=gen) * d**-0.5).bfloat16(),
        "down": (torch.randn(experts, d, inter, generator=gen) * inter**-0.5 * 2.0**-124).bfloat16(),
    }
    x = torch.randn(rows, d, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(rows)]).to(torch.int32)
    w = torch.rand(rows, top_k, generator=gen) + 0.1
    w = w / w.sum(-1, keepdim=True)
    out32 = moe_forward(x, ids, w, bank, out_dtype=torch.float32)
    out = moe_forward(x, ids, w, bank)
    assert (out32.abs() < FP32_TINY).float().mean() > 0.3  # many subnormal outputs
    want = out32.bfloat16()
    assert torch.equal(out, want), _share(out, want)
