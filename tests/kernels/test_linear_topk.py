"""The router's top-k inside its logits' linear launch: the bits of the linear kernel then the router kernel."""

from __future__ import annotations

import os
from dataclasses import replace

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from kernels import linear as linear_module
from kernels.linear import (
    MAX_TOPK_COLUMNS,
    TOPK_ROWS,
    TOPK_WARPS,
    Tiles,
    TopK,
    arrival_counters,
    call_tiles,
    k_ranges,
    launch,
    linear,
    linear_topk,
    topk_tiles,
)
from kernels.router import router_topk


def router_inputs(m: int, experts: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 rows [m, k] and a router weight [experts, k] in which experts 1 and E/2 tie in every row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(experts, k, generator=g) / k**0.5).bfloat16()
    w[experts // 2] = w[1]
    return x, w


def assert_same_bits(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Equal ids, and weights equal in every bit."""
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[0].view(torch.int32), want[0].view(torch.int32))


@pytest.mark.parametrize("renormalise", [True, False])
@pytest.mark.parametrize(("experts", "k", "top_k"), [(64, 256, 6), (48, 2560, 5)])  # whole K, and four K ranges
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_row_in_the_logits_launch_has_the_router_kernels_bits(
    seed: int, experts: int, k: int, top_k: int, renormalise: bool
) -> None:
    x, w = router_inputs(TOPK_ROWS, experts, k, seed=seed + experts)
    got = linear_topk(x, w, top_k, renormalise)
    assert_same_bits(got, router_topk(linear(x, w, torch.float32), top_k, renormalise))
    for row in got[1].tolist():  # experts 1 and E/2 tie: the lower id is picked first
        assert experts // 2 not in row or row.index(1) < row.index(experts // 2)


@pytest.mark.parametrize(("experts", "k"), [(64, 256), (48, 2560)])
def test_a_launch_picks_every_row_of_its_row_tiles(experts: int, k: int) -> None:
    """`launch` with a top-k takes any rows (the last arrival of each 16-row tile picks its rows one by one), returns
    the logits `linear` gives, and leaves its arrival counters zero."""
    m, top_k = 19, 4
    x, w = router_inputs(m, experts, k, seed=k)
    split, k_split = k_ranges(experts, k)
    tiles = call_tiles(1, experts, k)
    weights, ids = torch.empty(m, top_k), torch.empty(m, top_k, dtype=torch.int32)
    logits = launch(x, w, torch.float32, tiles, split, k_split, topk=TopK(weights, ids, True))
    want = linear(x, w, torch.float32)
    assert torch.equal(logits.view(torch.int32), want.view(torch.int32))
    assert_same_bits((weights, ids), router_topk(want, top_k))
    assert not arrival_counters(x.device, 64).any()


def test_rows_alone_equal_rows_together() -> None:
    """A row alone (its top-k in the logits' launch) equals it among more rows than TOPK_ROWS (the router kernel)."""
    x, w = router_inputs(TOPK_ROWS + 3, 64, 256, seed=5)
    alone = [linear_topk(x[i : i + 1], w, 4) for i in range(x.shape[0])]
    weights, ids = linear_topk(x, w, 4)
    assert torch.equal(weights, torch.cat([a for a, _ in alone])) and torch.equal(ids, torch.cat([b for _, b in alone]))
    empty = linear_topk(x[:0], w, 4)
    assert empty[0].shape == empty[1].shape == (0, 4)


def test_the_fused_launch_writes_the_top_k(monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to TOPK_ROWS rows no router kernel runs: the linear launch itself stores the top-k."""
    calls = []
    monkeypatch.setattr(linear_module, "router_topk", lambda *a, **kw: calls.append(a) or router_topk(*a, **kw))
    x, w = router_inputs(TOPK_ROWS, 64, 256, seed=6)
    linear_topk(x, w, 4)
    assert calls == []
    linear_topk(torch.cat([x, x]), w, 4)
    assert len(calls) == 1


def test_the_fused_launch_takes_the_logits_tiles_on_at_least_topk_warps(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-row launch that picks its top-k runs `call_tiles`' tiles on TOPK_WARPS warps or more; more rows
    take `call_tiles`' own for their logits."""
    tiles_taken = []
    real_launch = linear_module.launch
    monkeypatch.setattr(linear_module, "launch", lambda x, w, dt, tiles, *a, **kw: tiles_taken.append(tiles)
                        or real_launch(x, w, dt, tiles, *a, **kw))  # fmt: skip
    x, w = router_inputs(TOPK_ROWS + 1, 64, 256, seed=8)
    linear_topk(x[:TOPK_ROWS], w, 4)
    linear_topk(x, w, 4)
    plain = call_tiles(TOPK_ROWS, 64, 256)
    assert tiles_taken == [topk_tiles(TOPK_ROWS, 64, 256), call_tiles(TOPK_ROWS + 1, 64, 256)]
    assert tiles_taken[0].num_warps == max(plain.num_warps, TOPK_WARPS) > plain.num_warps
    assert replace(tiles_taken[0], num_warps=plain.num_warps) == plain


def test_a_top_k_launch_is_refused_where_it_cannot_store() -> None:
    x, w = router_inputs(2, 64, 256, seed=7)
    split, k_split = k_ranges(64, 256)
    good = TopK(torch.empty(2, 4), torch.empty(2, 4, dtype=torch.int32), True)
    small = Tiles(16, 64, 2, 1)
    with pytest.raises(ValueError, match="16-row tiles"):
        launch(x, w, torch.float32, Tiles(64, 64, 4, 1), split, k_split, topk=good)
    with pytest.raises(ValueError, match="16-row tiles"):
        launch(x, w, torch.bfloat16, small, split, k_split, topk=good)
    with pytest.raises(ValueError, match="int32"):
        launch(x, w, torch.float32, small, split, k_split, topk=TopK(good.weights, good.weights, True))
    with pytest.raises(ValueError, match="top-k weights"):
        launch(x, w, torch.float32, small, split, k_split, topk=TopK(good.weights[:1], good.ids, True))
    with pytest.raises(ValueError, match="contiguous"):
        launch(x, w, torch.float32, small, split, k_split, topk=TopK(torch.empty(4, 2).T, good.ids, True))
    with pytest.raises(ValueError, match="picks must be 1 or 2"):
        launch(x, w, torch.float32, small, split, k_split, topk=TopK(good.weights, good.ids, True, picks=4))
    with pytest.raises(ValueError, match="must be on cpu"):
        launch(x, w, torch.float32, small, split, k_split, topk=TopK(good.weights.to("meta"), good.ids, True))
    wide = torch.zeros(MAX_TOPK_COLUMNS + 1, 256).bfloat16()
    with pytest.raises(ValueError, match=f"at most {MAX_TOPK_COLUMNS}"):
        launch(x, wide, torch.float32, small, 1, 256, topk=good)
    with pytest.raises(ValueError, match="0 < k <= E"):
        linear_topk(x, w, 65)
    with pytest.raises(TypeError, match="bf16"):
        linear_topk(x.float(), w, 4)
