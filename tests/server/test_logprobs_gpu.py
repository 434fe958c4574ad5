"""On a GPU a row's logprobs do not depend on the rows taken with it: torch's log-softmax and `most_likely` give each
row of a batch the bits it gets alone, at the real vocabulary's width (concurrent = solo holds for logprobs)."""

from __future__ import annotations

import pytest
import torch

from server.runner import most_likely

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")]


@pytest.mark.parametrize("rows", [2, 7, 64, 256])
def test_each_rows_logprobs_and_most_likely_ids_are_its_own_alone(rows: int) -> None:
    generator = torch.Generator(device="cuda").manual_seed(rows)
    logits = (4 * torch.randn(rows, 248_320, device="cuda", generator=generator)).bfloat16()
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = most_likely(logprobs, 20)
    for row in range(rows):
        alone = torch.log_softmax(logits[row : row + 1].float(), dim=-1)
        assert torch.equal(alone, logprobs[row : row + 1])
        assert torch.equal(most_likely(alone, 20), ids[row : row + 1])
    expected = torch.sort(logprobs, dim=-1, descending=True, stable=True).indices[:, :20]
    assert torch.equal(ids, expected)  # ties (bf16 logits tie often) to the lower id
