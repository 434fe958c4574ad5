"""The fused norm + RoPE compiled on a GPU at QSA's per-rank shapes: every element has the bits of the zc norm
kernel followed by the RoPE kernel, for the index queries, the strided queries and the keys written into a cache;
and a call of few rows (few-pair programs) has the bits of the same rows in a call of whole tiles."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kernels.norm import FEW_PAIRS, zc_rms_norm
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


@pytest.mark.parametrize(("heads", "dim"), [(4, 128), (12, 256), (1, 256)])
def test_few_rows_take_few_pair_programs_with_the_whole_tiles_bits(heads: int, dim: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(heads * dim)
    rows = FEW_PAIRS // heads + 64  # past FEW_PAIRS: whole tiles
    x = (torch.randn(rows, heads, 2 * dim, device="cuda", generator=gen) * 3).bfloat16()[..., :dim]
    weight = (torch.randn(dim, device="cuda", generator=gen) * 0.2).bfloat16()
    pos = torch.randint(0, 200_000, (rows,), device="cuda", generator=gen)
    inv = rope_inv_freq(ROT, THETA, "cuda")
    whole_rope, whole_norm = norm_rope(x, weight, EPS, pos, inv), zc_rms_norm(x, weight, EPS)
    for lo, hi in ((0, 1), (5, 8), (rows - 3, rows), (rows - FEW_PAIRS // heads, rows)):  # few-pair programs
        assert (hi - lo) * heads <= FEW_PAIRS
        got = norm_rope(x[lo:hi], weight, EPS, pos[lo:hi], inv)
        assert torch.equal(got.view(torch.int16), whole_rope[lo:hi].view(torch.int16)), (lo, hi)
        got = zc_rms_norm(x[lo:hi], weight, EPS)
        assert torch.equal(got.view(torch.int16), whole_norm[lo:hi].view(torch.int16)), (lo, hi)
