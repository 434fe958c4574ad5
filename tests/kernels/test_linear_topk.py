"""The router's top-k inside its logits' linear launch: the bits of the linear kernel then the router kernel."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from kernels import linear as linear_module
from kernels.linear import TOPK_ROWS, Tiles, TopK, k_ranges, launch, linear, linear_topk
from kernels.router import router_topk


def router_inputs(m: int, experts: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 rows [m, k] and a router weight [experts, k] whose logits have ties (rows repeat, columns repeat)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(experts, k, generator=g) / k**0.5).bfloat16()
    w[experts // 2] = w[1]  # two experts with equal logits in every row: the lower id must win
    return x, w


@pytest.mark.parametrize("renormalise", [True, False])
@pytest.mark.parametrize(("experts", "k", "top_k"), [(64, 256, 6), (48, 1280, 5)])  # whole K, and four K ranges
@pytest.mark.parametrize("m", sorted({1, TOPK_ROWS, TOPK_ROWS + 1, 3, 17}))
def test_fused_top_k_has_the_router_kernels_bits(m: int, experts: int, k: int, top_k: int, renormalise: bool) -> None:
    x, w = router_inputs(m, experts, k, seed=m + experts)
    weights, ids = linear_topk(x, w, top_k, renormalise)
    want_w, want_ids = router_topk(linear(x, w, torch.float32), top_k, renormalise)
    assert torch.equal(ids, want_ids)
    assert torch.equal(weights.view(torch.int32), want_w.view(torch.int32))
    for row in ids.tolist():  # experts 1 and E/2 tie in every row: the lower id is picked first
        assert experts // 2 not in row or row.index(1) < row.index(experts // 2)


def test_rows_alone_equal_rows_together() -> None:
    """A row alone (its top-k in the logits' launch) equals it among more rows than TOPK_ROWS (the router kernel)."""
    x, w = router_inputs(TOPK_ROWS + 3, 64, 256, seed=5)
    alone = [linear_topk(x[i : i + 1], w, 4) for i in range(x.shape[0])]
    weights, ids = linear_topk(x, w, 4)
    assert torch.equal(weights, torch.cat([a for a, _ in alone])) and torch.equal(ids, torch.cat([b for _, b in alone]))


def test_the_fused_launch_writes_the_top_k(monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to TOPK_ROWS rows no router kernel runs: the linear launch itself stores the top-k."""
    calls = []
    monkeypatch.setattr(linear_module, "router_topk", lambda *a, **kw: calls.append(a) or router_topk(*a, **kw))
    x, w = router_inputs(TOPK_ROWS, 64, 256, seed=6)
    linear_topk(x, w, 4)
    assert calls == []
    linear_topk(torch.cat([x, x]), w, 4)
    assert len(calls) == 1


def test_a_top_k_launch_is_refused_where_it_cannot_store() -> None:
    x, w = router_inputs(2, 64, 256, seed=7)
    split, k_split = k_ranges(64, 256)
    good = TopK(torch.empty(2, 4), torch.empty(2, 4, dtype=torch.int32), True)
    with pytest.raises(ValueError, match="16-row tiles"):
        launch(x, w, torch.float32, Tiles(64, 64, 4, 1), split, k_split, topk=good)
    with pytest.raises(ValueError, match="16-row tiles"):
        launch(x, w, torch.bfloat16, Tiles(16, 64, 2, 1), split, k_split, topk=good)
    with pytest.raises(ValueError, match="int32"):
        launch(x, w, torch.float32, Tiles(16, 64, 2, 1), split, k_split, topk=TopK(good.weights, good.weights, True))
    with pytest.raises(ValueError, match="top-k weights"):
        launch(x, w, torch.float32, Tiles(16, 64, 2, 1), split, k_split, topk=TopK(good.weights[:1], good.ids, True))
    with pytest.raises(ValueError, match="0 < k <= E"):
        linear_topk(x, w, 65)
