"""The linear kernel compiled on a GPU at the row-parallel projections' shapes: every tile path gives a row its bits."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kernels.linear import k_ranges, linear, pick_tiles

# (N, K) per rank at tp=2: attention o_proj, GDN out_proj, the shared expert's down_proj
SHAPES = [(2560, 3072), (2560, 2048), (2560, 1024)]
ROWS = (1, 2, 7, 33, 64, 100, 300)


def test_the_shapes_take_every_tile_path() -> None:
    """The shapes and row counts below cover whole K, a fused split and a split summed by the second kernel."""
    paths = set()
    for n, k in SHAPES:
        split, _ = k_ranges(n, k)
        for m in ROWS:
            tiles = pick_tiles(m, n, split)
            paths.add("whole" if split == 1 else "fused" if tiles.block_m == 16 else "sum-kernel")
    assert paths == {"whole", "fused", "sum-kernel"}


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels")
@pytest.mark.parametrize(("n", "k"), SHAPES)
@pytest.mark.parametrize("out", ["bf16", "fp32", "round_bf16"])
def test_rows_alone_equal_rows_batched(n: int, k: int, out: str) -> None:
    """Each row of a batch of up to 300 equals the row run alone, and `round_bf16` equals the bf16 output."""
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    x = torch.randn(max(ROWS), k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16()
    dtype = torch.bfloat16 if out == "bf16" else torch.float32
    round_bf16 = out == "round_bf16"
    alone = torch.cat([linear(x[i : i + 1], w, dtype, round_bf16) for i in range(max(ROWS))])
    for m in ROWS:
        batched = linear(x[:m], w, dtype, round_bf16)
        assert torch.equal(batched, alone[:m]), f"{m} rows"
        if round_bf16:
            assert torch.equal(batched, linear(x[:m], w).float()), f"{m} rows, round_bf16 against bf16"
