"""The fused norm + RoPE compiled on a GPU at QSA's per-rank shapes: every element has the bits of the zc norm
kernel followed by the RoPE kernel, for the index queries, the strided queries and the keys written into a cache."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kernels.norm import zc_rms_norm
from kernels.rope import norm_rope, rope, rope_inv_freq

ROT, THETA, EPS = 64, 10_000_000.0, 1e-6

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels"),
]


@pytest.mark.parametrize("rows", [1, 7, 64, 1024])
@pytest.mark.parametrize(("heads", "dim", "width"), [(4, 128, 128), (12, 256, 512), (1, 256, 256)])
def test_fused_bits_equal_the_two_kernels(rows: int, heads: int, dim: int, width: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(rows * heads)
    fused = (torch.randn(rows, heads, width, device="cuda", generator=gen) * 3).bfloat16()
    x = fused[..., :dim]  # QSA's q is the first half of each head of the fused projection
    weight = (torch.randn(dim, device="cuda", generator=gen) * 0.2).bfloat16()
    pos = torch.randint(0, 200_000, (rows,), device="cuda", generator=gen)
    inv = rope_inv_freq(ROT, THETA, "cuda")
    want = rope(zc_rms_norm(x, weight, EPS), pos, inv)
    assert torch.equal(norm_rope(x, weight, EPS, pos, inv).view(torch.int16), want.view(torch.int16))
    slots = torch.randperm(rows, device="cuda", generator=gen)
    cache = torch.zeros(rows, 4, heads, dim, dtype=torch.bfloat16, device="cuda")
    want_cache = torch.zeros_like(cache)
    rope(zc_rms_norm(x, weight, EPS), pos, inv, dest=want_cache, slot_of_row=slots, dest_index=pos % 4)
    norm_rope(x, weight, EPS, pos, inv, dest=cache, slot_of_row=slots, dest_index=pos % 4)
    assert torch.equal(cache.view(torch.int16), want_cache.view(torch.int16))
