"""The linear kernel compiled on a GPU at the row-parallel projections' shapes: every tile path gives a row its bits."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kernels.gates import silu_mul
from kernels.linear import (
    BLOCK_K,
    Tiles,
    TopK,
    k_ranges,
    launch,
    linear,
    linear_silu_mul,
    linear_topk,
    pair_rows,
    pick_tiles,
    topk_tiles,
)
from kernels.router import router_topk

# (N, K) per rank at tp=2: attention o_proj, GDN out_proj, the shared expert's down_proj, GDN's fused in_proj, the
# fused in_proj_qkv of issue 6's targets, a slice of the vocab head's columns
SHAPES = [(2560, 3072), (2560, 2048), (2560, 1024), (8240, 2560), (5120, 2560), (20000, 2560)]
ROWS = (1, 2, 7, 24, 33, 64, 100, 300)


def test_the_shapes_take_every_tile_path() -> None:
    """The shapes and row counts below cover whole K (in BLOCK_K- and deeper K tiles), a fused split and a split
    summed by the second kernel."""
    paths = set()
    for n, k in SHAPES:
        split, _ = k_ranges(n, k)
        for m in ROWS:
            tiles = pick_tiles(m, n, k)
            paths.add("whole" if split == 1 else "fused" if tiles.block_m == 16 else "sum-kernel")
            paths.add("deep" if tiles.block_k > BLOCK_K else "shallow")
    assert paths == {"whole", "fused", "sum-kernel", "deep", "shallow"}


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


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels")
@pytest.mark.parametrize(("n", "k", "split", "k_split"), [(8240, 2560, 1, 2560), (2560, 3072, 4, 768)])
def test_deeper_k_tiles_give_the_same_bits(n: int, k: int, split: int, k_split: int) -> None:
    """A K tile of 256 or 512 runs the same chain of MMA steps as BLOCK_K ones: every element's bits equal, 1 to 16
    rows, 16 to 64 columns wide."""
    gen = torch.Generator(device="cuda").manual_seed(n)
    x = torch.randn(16, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) / k**0.5).bfloat16()
    for m in (1, 4, 16):
        want = launch(x[:m], w, torch.float32, Tiles(16, 16, 2, 4), split, k_split)
        for block_k in (256, 512):
            for width in (16, 32, 64):
                if split == 1 or k_split % block_k == 0:
                    got = launch(x[:m], w, torch.float32, Tiles(16, width, 2, 3, block_k), split, k_split)
                    assert torch.equal(got, want), (m, block_k, width)


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels")
def test_router_top_k_in_the_logits_launch_has_the_router_kernels_bits() -> None:
    """The router's shape (512 experts, K = 2,560 in four ranges, top-10) and one with K whole (64 experts, K = 256,
    top-6): the top-k the linear launch stores equals the router kernel's over `linear`'s logits in every bit, rows
    with tied experts included, for one row (`linear_topk`) and for 19 rows (two row tiles, each picked by its last
    column tile), whose launch on `pick_tiles`' two warps and on `topk_tiles`' four also stores `linear`'s logits."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    for experts, k, top_k in ((512, 2560, 10), (64, 256, 6)):
        w = (torch.randn(experts, k, device="cuda", generator=gen) / k**0.5).bfloat16()
        w[experts - 3] = w[7]  # two experts tie in every row
        split, k_split = k_ranges(experts, k)
        for trial in range(10):
            x = (torch.randn(19, k, device="cuda", generator=gen) * (1 + trial)).bfloat16()
            for renormalise in (True, False):
                for m in (1, 19):
                    want_logits = linear(x[:m], w, torch.float32)
                    want_w, want_ids = router_topk(want_logits, top_k, renormalise)
                    if m == 1:
                        weights, ids = linear_topk(x[:m], w, top_k, renormalise)
                        assert torch.equal(ids, want_ids), (experts, trial)
                        assert torch.equal(weights.view(torch.int32), want_w.view(torch.int32)), (experts, trial)
                        continue
                    for tiles in (pick_tiles(1, experts, k), topk_tiles(1, experts, k)):  # two warps, four
                        weights = torch.empty(m, top_k, device="cuda")
                        ids = torch.empty(m, top_k, dtype=torch.int32, device="cuda")
                        topk = TopK(weights, ids, renormalise)
                        logits = launch(x[:m], w, torch.float32, tiles, split, k_split, topk=topk)
                        assert torch.equal(logits.view(torch.int32), want_logits.view(torch.int32)), (experts, tiles)
                        assert torch.equal(ids, want_ids), (experts, trial, tiles)
                        assert torch.equal(weights.view(torch.int32), want_w.view(torch.int32)), (experts, trial, tiles)


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels")
@pytest.mark.parametrize(("width", "k"), [(320, 2560), (160, 2560), (64, 256)])
def test_silu_pairs_have_the_bits_of_linear_then_silu_mul(width: int, k: int) -> None:
    """The shared expert's gate-up at tp=2's width (and half of it) with silu·up and the gate logit in its epilogue:
    h and the logit equal `linear` over [gate; up; logit] then `silu_mul`, bit for bit, at 1 to 300 rows (16-row
    tiles with the fused range sums, wide tiles with the sum kernel, and whole K at 256), and each row alone equals
    it batched."""
    gen = torch.Generator(device="cuda").manual_seed(width)
    x = torch.randn(max(ROWS), k, device="cuda", generator=gen).bfloat16()
    gate, up, logit = (
        (torch.randn(n, k, device="cuda", generator=gen) * 3 / k**0.5).bfloat16() for n in (width, width, 1)
    )
    pairs = pair_rows(gate, up, logit)
    alone = [linear_silu_mul(x[i : i + 1], pairs) for i in range(max(ROWS))]
    for m in ROWS:
        y = linear(x[:m], torch.cat([gate, up, logit]))
        h, gate_logit = linear_silu_mul(x[:m], pairs)
        assert torch.equal(h.view(torch.int16), silu_mul(y[:, :width], y[:, width : 2 * width]).view(torch.int16)), m
        assert torch.equal(gate_logit.view(torch.int16), y[:, 2 * width :].contiguous().view(torch.int16)), m
        assert torch.equal(h.view(torch.int16), torch.cat([a[0] for a in alone[:m]]).view(torch.int16)), f"{m} alone"
        assert torch.equal(gate_logit.view(torch.int16), torch.cat([a[1] for a in alone[:m]]).view(torch.int16)), m
