"""The GDN gated norm compiled on a GPU at tp=2's per-rank width: every launch tile (pairs a program, warps) gives the
whole tile's bits, which the CPU tests cannot show (the interpreter has no layouts and ignores warps)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from gpu_sweep_gated_norm import EPS, HEADS, WIDTH

from kernels.norm import NUM_WARPS, block_r, gated_norm_tile, gated_rms_norm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels"),
]


@pytest.mark.parametrize("rows", [1, 4, 10, 64])
@pytest.mark.parametrize("act", ["sigmoid", "silu"])
def test_every_tile_gives_the_whole_tiles_bits(rows: int, act: str) -> None:
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, HEADS, WIDTH, generator=gen, device="cuda") * 3
    z = torch.randn(rows, HEADS, WIDTH, generator=gen, device="cuda").bfloat16()
    w = (1.0 + 0.1 * torch.randn(WIDTH, generator=gen, device="cuda")).bfloat16()
    whole = gated_rms_norm(x, z, w, EPS, act, tile=(block_r(WIDTH), NUM_WARPS))
    tiles = {(1, 1), (1, 2), (2, 2), (4, 4), (8, 4), gated_norm_tile(rows * HEADS, WIDTH)}
    for tile in sorted(tiles):
        assert torch.equal(gated_rms_norm(x, z, w, EPS, act, tile=tile), whole), tile
