"""`most_likely`: a row's most likely ids in a stable descending sort's order, ties to the lower id, in one top-k."""

from __future__ import annotations

import pytest
import torch

from server.runner import most_likely


@pytest.mark.parametrize("most", [1, 3, 20])
def test_most_likely_orders_log_probabilities_as_a_stable_descending_sort_with_many_ties(most: int) -> None:
    """Log-softmaxes of bf16 logits (which tie often), all at or below 0, as the runner takes them; ties, -inf, -0.0
    and 0.0 among the most likely."""
    logits = (3 * torch.randn(6, 300, generator=torch.Generator().manual_seed(most))).bfloat16().float()
    rows = torch.log_softmax(logits, dim=-1)
    top = rows.max(dim=-1, keepdim=True).values
    rows[0, ::7] = top[0]  # a tie across many ids at the top
    rows[1, :40] = top[1]  # more tied maxima than `most`
    rows[2, 5:9] = float("inf") * -1
    rows[2, :5] = float("-inf")  # a row whose first ids can never be drawn
    rows[3, 10], rows[3, 11] = 0.0, -0.0
    rows[4] = float("-inf")
    rows[5, 50:53] = torch.tensor([-1e-40, -1e-39, -3e-45])  # subnormals, near the top
    expected = torch.sort(rows, dim=-1, descending=True, stable=True).indices[:, :most]
    got = most_likely(rows, most)
    assert torch.equal(got[[0, 1, 2, 4, 5]], expected[[0, 1, 2, 4, 5]])
    assert got[3, 0] == 10 and (most == 1 or got[3, 1] == 11)  # 0.0 before -0.0, as a stable sort finds them


def test_a_rows_ids_do_not_depend_on_the_rows_beside_it() -> None:
    rows = torch.log_softmax(torch.randn(9, 500, generator=torch.Generator().manual_seed(1)).bfloat16().float(), -1)
    together = most_likely(rows, 5)
    assert all(torch.equal(most_likely(rows[i : i + 1], 5)[0], together[i]) for i in range(9))
