"""The linear kernel's and the router's masks and bounds: nothing stored past an output, nothing read past K, no
K tile, column tile or sum block left out."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

from unittest import mock

import torch

import kernels.linear as linear_module
from kernels.linear import (
    BLOCK_K,
    Gates,
    Tiles,
    k_ranges,
    launch,
    linear,
    linear_reference,
    linear_silu_mul,
    linear_topk,
    pair_rows,
)
from kernels.router import router_topk
from tests.kernels.sentinels import outputs_with_slack, untouched
from tests.kernels.test_linear import rel_err

TAIL = 16 * 64 * 4  # a whole 16-row, 64-column tile's lanes past an output, and then some


def bf16(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).bfloat16()


def test_no_launch_stores_past_its_outputs() -> None:
    """Every output (and the fp32 range workspace) made inside a longer buffer: the tail keeps its sentinels."""
    x, w = bf16(3, 300, seed=1), bf16(48, 300, seed=2, scale=300**-0.5)
    cases = (
        ((3, 48),),  # whole K, 16-row tiles
        ((3, 48), (3, 3, 48)),  # 3 K ranges, the last arrival adds
    )
    launches = ((Tiles(16, 64, 2, 1), 1, 384), (Tiles(16, 64, 2, 1), 3, 128))
    for shapes, (tiles, split, k_split) in zip(cases, launches, strict=True):
        with outputs_with_slack(shapes, TAIL, torch.float32) as slack:
            launch(x, w, torch.float32, tiles, split, k_split)
        assert len(slack) == len(shapes) and untouched(slack), (tiles, split)
    x5 = bf16(5, 300, seed=3)
    with outputs_with_slack(((5, 48), (3, 5, 48)), TAIL, torch.float32) as slack:  # wide tiles, the sum kernel adds
        launch(x5, w, torch.float32, Tiles(64, 64, 4, 1), 3, 128)
    assert len(slack) == 2 and untouched(slack)
    for tiles, split, k_split in launches:  # gates, h and inject
        with outputs_with_slack(((3, 44), (3, 4)), TAIL, torch.bfloat16) as slack:  # the gates' outputs made inside
            gates = Gates(torch.empty(3, 44, dtype=torch.bfloat16), torch.empty(3, 4, dtype=torch.bfloat16), 4)
            launch(x, w * 40, torch.float32, tiles, split, k_split, gates=gates)
        assert len(slack) == 2 and untouched(slack), split
    gate, up, logit = bf16(7, 256, seed=4, scale=0.2), bf16(7, 256, seed=5, scale=0.2), bf16(1, 256, seed=6, scale=0.2)
    with outputs_with_slack(((3, 7), (3, 1)), TAIL, torch.bfloat16) as slack:  # silu·up pairs: h and logit
        linear_silu_mul(bf16(3, 256, seed=7), pair_rows(gate, up, logit))
    assert len(slack) == 2 and untouched(slack)
    xr, wr = bf16(1, 2560, seed=8), bf16(48, 2560, seed=9, scale=2560**-0.5)
    split, _ = k_ranges(48, 2560)
    assert split > 1
    with outputs_with_slack(((1, 5), (1, 48), (split, 1, 48)), TAIL) as slack:  # top-k in the logits' launch
        linear_topk(xr, wr, 5)
    assert len(slack) == 4 and untouched(slack)
    with outputs_with_slack(((7, 3),), TAIL) as slack:  # the router kernel: weights and ids
        router_topk(torch.randn(7, 12, generator=torch.Generator().manual_seed(10)), 3)
    assert len(slack) == 2 and untouched(slack)


def test_the_last_k_range_ends_at_k() -> None:
    """K = 129 (whole) and 1281 (2 ranges, the last ending one past a tile): the bits of K padded with zeros; and
    K = 1408, whole tiles whose 2 ranges of 768 overrun K: the reference's sums."""
    for m in (1, 40):  # the last arrival adds the ranges; wide tiles and the sum kernel
        for k in (129, 1281, 1408):
            x, w = bf16(m, k, seed=k), bf16(48, k, seed=k + 1, scale=k**-0.5)
            got = linear(x, w, torch.float32)
            assert rel_err(got, linear_reference(x, w, torch.float32)) <= 1e-5, (m, k)
            pad = -k % BLOCK_K
            xp, wp = torch.nn.functional.pad(x, (0, pad)), torch.nn.functional.pad(w, (0, pad))
            assert k_ranges(48, k + pad) == k_ranges(48, k)
            assert torch.equal(got.view(torch.int32), linear(xp, wp, torch.float32).view(torch.int32)), (m, k)
    assert k_ranges(48, 1408) == (2, 768)


def test_nothing_past_k_is_read() -> None:
    """Row-strided x and w whose columns past K hold inf: the products of those columns never enter a sum."""
    m, n, k = 3, 48, 300
    x, w = bf16(m, k, seed=11), bf16(n, k, seed=12, scale=k**-0.5)
    xs = torch.full((m, k + 20), float("inf"), dtype=torch.bfloat16)
    ws = torch.full((n, k + 20), float("inf"), dtype=torch.bfloat16)
    xs[:, :k], ws[:, :k] = x, w
    got = linear(xs[:, :k], ws[:, :k], torch.float32)
    assert not got.isnan().any()
    assert torch.equal(got, linear(x, w, torch.float32))


def test_every_column_tile_and_sum_block_is_launched() -> None:
    """N one past a 64-column tile; and M·N one past a multiple of the sum kernel's block (wide tiles, K cut)."""
    x, w = bf16(3, 96, seed=13), bf16(65, 96, seed=14, scale=96**-0.5)
    assert rel_err(linear(x, w, torch.float32), linear_reference(x, w, torch.float32)) <= 1e-5
    x, w = bf16(41, 1280, seed=15), bf16(25, 1280, seed=16, scale=1280**-0.5)
    assert k_ranges(25, 1280)[0] > 1 and 41 * 25 % 1024 == 1
    got = linear(x, w, torch.float32)
    assert rel_err(got, linear_reference(x, w, torch.float32)) <= 1e-5
    assert torch.equal(got[[0, 40]], torch.cat([linear(x[i : i + 1], w, torch.float32) for i in (0, 40)]))


def test_each_tile_is_added_and_each_row_tile_picked_once() -> None:
    """One 16-row tile of K cut into 2 and 4 ranges: its ranges are added and stored once (by the last arrival), and
    the top-k launch picks its row once; every counter is back to zero."""
    calls = []

    def counting(real):
        return lambda *a, **kw: calls.append(real) or real(*a, **kw)

    for k in (1280, 2560):
        x, w = bf16(1, k, seed=k), bf16(48, k, seed=k + 2, scale=k**-0.5)
        assert k_ranges(48, k)[0] in (2, 4)
        calls.clear()
        with mock.patch.object(linear_module, "_store", counting(linear_module._store)):
            linear(x, w, torch.float32)
        assert len(calls) == 1, k
        calls.clear()
        with mock.patch.object(linear_module, "topk_row", counting(linear_module.topk_row)):
            linear_topk(x, w, 5)
        assert len(calls) == 1, k
    assert not linear_module.arrival_counters(torch.device("cpu"), 64).any()


def test_the_range_sums_past_n_are_not_read() -> None:
    """The top-k launch's fp32 range workspace made inside a buffer whose tail is NaN: its picks are still the router
    kernel's over `linear`'s logits."""
    x, w = bf16(1, 2560, seed=17), bf16(48, 2560, seed=18, scale=2560**-0.5)
    split, _ = k_ranges(48, 2560)
    with outputs_with_slack(((split, 1, 48),), TAIL, torch.float32, fill=float("nan")) as slack:
        got = linear_topk(x, w, 5)
    assert len(slack) == 1
    want = router_topk(linear(x, w, torch.float32), 5)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0].view(torch.int32), want[0].view(torch.int32))
