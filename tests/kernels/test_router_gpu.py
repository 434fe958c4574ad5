"""The router's picks taken two a reduction on the GPU, at the model's width: one key a reduction's bits."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kernels.router import router_topk


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
