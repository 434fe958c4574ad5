"""The greedy draw and the drafts' argmax compiled on a GPU at the real vocabulary: each row's first maximum, as
torch's argmax gives it."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kernels.sample import GREEDY_BLOCK, argmax_tokens, greedy_tokens, greedy_tokens_reference

VOCAB = 248_320

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 64, 257])
def test_greedy_tokens_equal_torchs_argmax_at_the_real_vocabulary(rows: int, dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(rows)
    logits = (torch.randn(rows, VOCAB, generator=gen, device="cuda") * 4).to(dtype)
    logits[0, [VOCAB - 1, GREEDY_BLOCK + 7, 5 * GREEDY_BLOCK + 7]] = 40.0  # ties across and within lanes
    if rows > 1:
        logits[1, 1000] = float("nan")
        logits[-1] = float("-inf")
    got, expected = greedy_tokens(logits), greedy_tokens_reference(logits)
    assert torch.equal(got, expected) and got[0] == GREEDY_BLOCK + 7
    alone = torch.cat([greedy_tokens(logits[i : i + 1]) for i in range(rows)])
    assert torch.equal(alone, got)
    assert torch.equal(argmax_tokens(logits), torch.argmax(logits.float(), dim=-1))  # NaN and -inf rows too
