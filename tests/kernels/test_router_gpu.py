"""The router on the GPU at the model's width: picks taken two a reduction have one key a reduction's bits, and a row's
picks are the same on every warp count its program takes."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kernels.router import WIDE_ROWS, router_topk, router_warps


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels")
@pytest.mark.parametrize("renormalise", [True, False])
def test_picks_taken_together_equal_picks_taken_one_by_one(renormalise: bool) -> None:
    """512 experts, top-10, 4,096 rows: few distinct logits (ties at every rank), spread bf16 and fp32 rows."""
    gen = torch.Generator(device="cuda").manual_seed(21)
    ties = torch.randint(-3, 4, (4096, 512), device="cuda", generator=gen).bfloat16()
    spread = (torch.randn(4096, 512, device="cuda", generator=gen) * 3).bfloat16()
    wide = torch.randn(4096, 512, device="cuda", generator=gen) * 8
    for logits in (ties, spread, wide):
        weights, ids = router_topk(logits, 10, renormalise, picks=1)
        got_w, got_ids = router_topk(logits, 10, renormalise, picks=2)
        assert torch.equal(got_ids, ids)
        assert torch.equal(got_w.view(torch.int32), weights.view(torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels")
@pytest.mark.parametrize("renormalise", [True, False])
def test_a_rows_picks_are_the_same_alone_among_few_rows_and_among_many(renormalise: bool) -> None:
    """512 experts, top-10: each row alone and among WIDE_ROWS (its program on four warps) equals it among
    WIDE_ROWS + 1 (on one), for tied, spread bf16 and wide fp32 logits."""
    many = WIDE_ROWS + 1
    assert router_warps(WIDE_ROWS, 512) != router_warps(many, 512)
    gen = torch.Generator(device="cuda").manual_seed(22)
    ties = torch.randint(-3, 4, (many, 512), device="cuda", generator=gen).bfloat16()
    spread = (torch.randn(many, 512, device="cuda", generator=gen) * 3).bfloat16()
    wide = torch.randn(many, 512, device="cuda", generator=gen) * 8
    for logits in (ties, spread, wide):
        weights, ids = router_topk(logits, 10, renormalise)
        few_w, few_ids = router_topk(logits[:WIDE_ROWS], 10, renormalise)
        assert torch.equal(few_ids, ids[:WIDE_ROWS])
        assert torch.equal(few_w.view(torch.int32), weights[:WIDE_ROWS].view(torch.int32))
        for row in range(0, many, 9):
            one_w, one_ids = router_topk(logits[row : row + 1], 10, renormalise)
            assert torch.equal(one_ids, ids[row : row + 1])
            assert torch.equal(one_w.view(torch.int32), weights[row : row + 1].view(torch.int32))
