"""`most_likely`: a row's most likely ids in a stable descending sort's order, ties to the lower id, in one top-k."""

from __future__ import annotations

import pytest
import torch

from server.runner import most_likely


@pytest.mark.parametrize("most", [1, 3, 20])
def test_most_likely_orders_as_a_stable_descending_sort_with_many_ties(most: int) -> None:
    """Values rounded to bf16, as a bf16 lm_head's logits are, tie often; -inf, -0.0 and 0.0 are among them."""
    rows = torch.randn(6, 300, generator=torch.Generator().manual_seed(most)).bfloat16().float()
    rows[0, ::7] = rows[0, 3]  # a tie across many ids
    rows[1, :40] = 9.0  # more tied maxima than `most`
    rows[2, 5:9] = float("-inf")
    rows[3, 10], rows[3, 11] = -0.0, 0.0
    rows[4] = float("-inf")
    expected = torch.sort(rows, dim=-1, descending=True, stable=True).indices[:, :most]
    assert torch.equal(most_likely(rows, most), expected)


def test_a_rows_ids_do_not_depend_on_the_rows_beside_it() -> None:
    rows = torch.randn(9, 500, generator=torch.Generator().manual_seed(1)).bfloat16().float()
    together = most_likely(rows, 5)
    assert all(torch.equal(most_likely(rows[i : i + 1], 5)[0], together[i]) for i in range(9))
