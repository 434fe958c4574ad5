"""The MoE router top-k against its PyTorch reference under the Triton interpreter: ties, renormalising, invariance."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from kernels import router as router_module
from kernels.fp32_ops import pairwise_sum
from kernels.router import WIDE_ROWS, _top2, router_topk, router_topk_reference, router_warps

E, K = 16, 4


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64."""
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def tie_order(probs: torch.Tensor, k: int) -> list[list[int]]:
    """Each row's k ids by (probability descending, id ascending), written out independently of torch's sort."""
    return [sorted(range(len(row)), key=lambda e, row=row: (-row[e], e))[:k] for row in probs.tolist()]


def check(logits: torch.Tensor, k: int, renormalise: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel against reference: identical ids, fp32 weights within rounding, no NaN; returns the kernel's."""
    weights, ids = router_topk(logits, k, renormalise)
    ref_w, ref_ids = router_topk_reference(logits, k, renormalise)
    assert weights.shape == ids.shape == (logits.shape[0], k)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert not weights.isnan().any()
    assert torch.equal(ids, ref_ids)
    assert rel_err(weights, ref_w) <= 1e-5 and (weights - ref_w).abs().max().item() <= 1e-6
    return weights, ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_reference(dtype: torch.dtype) -> None:
    logits = (torch.randn(9, E, generator=torch.Generator().manual_seed(0)) * 2).to(dtype)
    weights, _ = check(logits, K)
    assert torch.allclose(weights.sum(-1), torch.ones(9), atol=1e-6)


def test_ties_go_to_the_lower_id() -> None:
    """Logits from a handful of values make exact ties, inside the k and across its edge."""
    logits = torch.randint(-2, 3, (40, E), generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    logits[0] = 0.0
    logits[1, [3, 7, 11]] = 4.0
    _, ids = check(logits, K)
    assert ids.tolist() == tie_order(torch.softmax(logits.float(), -1), K)
    assert ids[0].tolist() == [0, 1, 2, 3]
    assert ids[1].tolist()[:3] == [3, 7, 11]


def test_without_renormalising() -> None:
    logits = torch.randn(6, E, generator=torch.Generator().manual_seed(2)) * 3
    weights, ids = check(logits, K, renormalise=False)
    probs = torch.softmax(logits, -1).gather(1, ids.long())
    assert rel_err(weights, probs) <= 1e-5


@pytest.mark.parametrize(("experts", "k"), [(12, 4), (16, 16), (5, 1)])
def test_other_widths(experts: int, k: int) -> None:
    """Expert counts that are not a power of two (masked lanes), k = E and k = 1."""
    logits = torch.randn(7, experts, generator=torch.Generator().manual_seed(experts)).to(torch.bfloat16)
    check(logits, k)


def test_real_width() -> None:
    """E = 512, k = 10 as the model routes."""
    logits = (torch.randn(3, 512, generator=torch.Generator().manual_seed(3)) * 2).to(torch.bfloat16)
    check(logits, 10)


def test_rows_identical_across_batch_sizes() -> None:
    logits = (torch.randn(7, E, generator=torch.Generator().manual_seed(4)) * 2).to(torch.bfloat16)
    alone = [router_topk(logits[i : i + 1], K) for i in range(7)]
    for batch in (2, 5, 7):
        weights, ids = router_topk(logits[:batch], K)
        assert torch.equal(weights, torch.cat([w for w, _ in alone[:batch]]))
        assert torch.equal(ids, torch.cat([i for _, i in alone[:batch]]))


def test_strided_rows() -> None:
    """A row view with a stride wider than E reads the same logits."""
    wide = torch.randn(5, 2 * E, generator=torch.Generator().manual_seed(5))
    weights, ids = router_topk(wide[:, :E], K)
    ref = router_topk(wide[:, :E].contiguous(), K)
    assert torch.equal(weights, ref[0]) and torch.equal(ids, ref[1])


@pytest.mark.parametrize(("experts", "k"), [(16, 4), (12, 5), (16, 16), (5, 1), (64, 10)])
def test_picks_taken_together_equal_picks_taken_one_by_one(experts: int, k: int) -> None:
    """Two keys a reduction give one key a reduction's ids and weights in every bit: rows of few distinct
    logits (ties inside the k and across its edge), spread rows, and E not a power of two (masked lanes)."""
    g = torch.Generator().manual_seed(experts * 100 + k)
    ties = torch.randint(-2, 3, (24, experts), generator=g).float()
    spread = torch.randn(24, experts, generator=g) * 4
    logits = torch.cat([ties, spread]).to(torch.bfloat16)
    one_by_one = router_topk(logits, k, picks=1)
    assert one_by_one[1].tolist()[:24] == tie_order(torch.softmax(logits[:24].float(), -1), k)
    weights, ids = router_topk(logits, k, picks=2)
    assert torch.equal(ids, one_by_one[1])
    assert torch.equal(weights.view(torch.int32), one_by_one[0].view(torch.int32))


@triton.jit
def _merge_kernel(a_ptr, b_ptr, out_ptr, BLOCK: tl.constexpr):
    """out[:, i] = the i-th of the two largest of each row's descending pairs a [BLOCK, 2] and b."""
    rows = tl.arange(0, BLOCK) * 2
    first, second = _top2(
        tl.load(a_ptr + rows), tl.load(a_ptr + rows + 1), tl.load(b_ptr + rows), tl.load(b_ptr + rows + 1)
    )
    tl.store(out_ptr + rows, first)
    tl.store(out_ptr + rows + 1, second)


def test_a_merge_keeps_the_largest_of_two_pairs() -> None:
    """The reduction's merge of two descending pairs of distinct keys (padded with -1) on every kind of interleaving:
    the GPU's reduction trees merge pairs, the interpreter's only one key at a time."""
    g = torch.Generator().manual_seed(2)
    rows = 256
    keys = torch.stack([torch.randperm(6, generator=g)[:4] for _ in range(rows)]).long()
    keys[: rows // 2, 1::2] = -1  # a single key in each pair: -1 pads it
    a = keys[:, :2].sort(dim=1, descending=True).values.contiguous()
    b = keys[:, 2:].sort(dim=1, descending=True).values.contiguous()
    out = torch.empty_like(a)
    _merge_kernel[(1,)](a, b, out, BLOCK=rows)
    assert torch.equal(out, torch.cat([a, b], dim=1).sort(dim=1, descending=True).values[:, :2])


@pytest.mark.parametrize(("shape", "k", "picks"), [((4, E), 0, 1), ((4, E), E + 1, 1), ((E,), 2, 1), ((4, E), 2, 3)])
def test_bad_arguments(shape: tuple[int, ...], k: int, picks: int) -> None:
    with pytest.raises(ValueError):
        router_topk(torch.zeros(shape), k, picks=picks)


@triton.jit
def _sum_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    """Stores `pairwise_sum` of BLOCK values."""
    tl.store(out_ptr, pairwise_sum(tl.load(x_ptr + tl.arange(0, BLOCK)), BLOCK))


def pairwise_tree(values: list[float]) -> np.float32:
    """Neighbours added in fp32, level by level, as the contract says."""
    level = [np.float32(v) for v in values]
    while len(level) > 1:
        level = [np.float32(level[i] + level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


@pytest.mark.parametrize("block", [2, 16, 512])
def test_the_softmax_sum_is_a_tree_of_neighbour_pairs(block: int) -> None:
    """Large and small values interleave so the pairwise tree, a left-to-right sum and a strided one all differ."""
    g = torch.Generator().manual_seed(block)
    x = torch.randn(block, generator=g) * torch.where(torch.arange(block) % 3 == 0, 1e7, 1.0)
    out = torch.empty(1)
    _sum_kernel[(1,)](x, out, BLOCK=block)
    want = pairwise_tree(x.tolist())
    assert out.item() == want
    if block == 512:
        left_to_right = np.float32(0)
        for v in x.tolist():
            left_to_right = np.float32(left_to_right + np.float32(v))
        assert left_to_right != want  # the input tells the orders apart


def test_a_launch_takes_the_warps_of_its_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """router_topk asks `router_warps` for its rows and padded width, so few rows take the wider programs."""
    asked = []
    monkeypatch.setattr(router_module, "router_warps", lambda rows, block_e: asked.append((rows, block_e)) or 1)
    for rows in (1, WIDE_ROWS + 1):
        router_topk(torch.randn(rows, 48), 4)
    assert asked == [(1, 64), (WIDE_ROWS + 1, 64)]


def test_decode_rounds_spread_a_rows_lanes_over_more_warps() -> None:
    """Up to WIDE_ROWS rows (a round of 64 lanes among them) a program takes a warp per 128 lanes (four for 512
    experts), beyond a warp per 512 (prompts), at least one and at most eight."""
    assert [router_warps(rows, 512) for rows in (1, 4, 64, WIDE_ROWS, WIDE_ROWS + 1)] == [4, 4, 4, 4, 1]
    assert router_warps(1, 64) == router_warps(WIDE_ROWS + 1, 64) == 1
    assert router_warps(1, 2048) == 8 and router_warps(WIDE_ROWS + 1, 2048) == 4
