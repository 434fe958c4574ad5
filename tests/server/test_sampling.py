"""Tests for server/sampling.py: greedy ties, keyed draws, filters, dtype independence and the draw's spread."""

from __future__ import annotations

import pytest
import torch

from server.protocol import fresh_seed
from server.sampling import SamplingParamError, _mix64, draw_uniform, sample_token

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.0, -0.5, -3.0])


def draw(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    seed: int = 1234,
    position: int = 0,
) -> int:
    """sample_token with the filters off unless asked."""
    return sample_token(logits, temperature, top_k, top_p, min_p, seed, position)


def test_mix_is_splitmix64() -> None:
    """The mix reproduces splitmix64's published first outputs, so every machine draws the same numbers."""
    assert _mix64(0) == 0xE220A8397B1DCDAF
    assert _mix64(1234567) == 6457827717110365317


def test_draw_uniform_range_and_spread() -> None:
    """Draws lie in [0, 1), average near 0.5 and fill every tenth of the interval."""
    draws = [draw_uniform(42, position) for position in range(10_000)]
    assert all(0.0 <= u < 1.0 for u in draws)
    assert abs(sum(draws) / len(draws) - 0.5) < 0.015
    deciles = [0] * 10
    for u in draws:
        deciles[int(u * 10)] += 1
    assert min(deciles) > 900
    assert draw_uniform(42, 7) == draw_uniform(42, 7)
    assert draw_uniform(42, 7) != draw_uniform(43, 7)
    assert draw_uniform(-1, 7) == draw_uniform(2**64 - 1, 7)


def test_fresh_seed_is_63_bit() -> None:
    """Fresh seeds are non-negative 63-bit integers and differ between calls."""
    seeds = {fresh_seed() for _ in range(8)}
    assert all(0 <= seed < 2**63 for seed in seeds)
    assert len(seeds) > 1


def test_greedy_picks_argmax_and_lower_id_on_ties() -> None:
    """Temperature 0 is argmax, and a tie goes to the lower token id."""
    assert draw(LOGITS, temperature=0) == 0
    assert draw(torch.tensor([0.0, 3.0, 1.0, 3.0, 3.0]), temperature=0) == 1
    assert draw(torch.tensor([-float("inf"), 0.5, 0.5]), temperature=0) == 1


def test_greedy_ignores_seed_and_position() -> None:
    """Temperature 0 gives the same token for any seed and position."""
    logits = torch.randn(300, generator=torch.Generator().manual_seed(0))
    expected = int(torch.argmax(logits))
    assert {draw(logits, temperature=0, seed=seed, position=seed * 3) for seed in range(50)} == {expected}


def test_same_key_same_token_and_seeds_differ() -> None:
    """The same (seed, position) repeats its token; two seeds on a flat distribution draw different sequences."""
    flat = torch.zeros(16)
    first = [draw(flat, seed=1234, position=p) for p in range(200)]
    again = [draw(flat, seed=1234, position=p) for p in range(200)]
    neighbour = [draw(flat, seed=1235, position=p) for p in range(200)]
    assert first == again
    assert len(set(first)) >= 2
    assert first != neighbour


def test_empirical_distribution_matches_softmax() -> None:
    """Over many positions the draws follow softmax(logits / T) (a chi-square bound, deterministic seeds)."""
    temperature, count = 0.8, 6000
    expected = torch.softmax(LOGITS / temperature, dim=-1) * count
    observed = torch.zeros(len(LOGITS))
    for position in range(count):
        observed[draw(LOGITS, temperature=temperature, seed=99, position=position)] += 1
    chi_square = float(((observed - expected) ** 2 / expected).sum())
    assert chi_square < 20.5  # the 99.9% point of chi-square with 5 degrees of freedom


def test_top_k_one_is_greedy_and_top_k_limits_candidates() -> None:
    """top_k=1 always gives the argmax; top_k=2 only ever gives the two most likely tokens."""
    logits = torch.randn(500, generator=torch.Generator().manual_seed(1))
    greedy = draw(logits, temperature=0)
    assert {draw(logits, temperature=1.5, top_k=1, position=p) for p in range(100)} == {greedy}
    assert {draw(LOGITS, top_k=2, position=p) for p in range(300)} == {0, 1}


def test_top_k_keeps_every_id_tied_with_the_kth() -> None:
    """A top_k that cuts through tied probabilities keeps the whole tie (vLLM keeps each logit not below the k-th)."""
    tied = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0])
    assert {draw(tied, top_k=1, position=p) for p in range(200)} == {1, 2, 3}
    assert {draw(tied, top_k=2, position=p) for p in range(200)} == {1, 2, 3}
    assert {draw(torch.tensor([2.0, 1.0, 1.0, 0.5]), top_k=1, position=p) for p in range(100)} == {0}


def test_top_p_tiny_keeps_only_the_top_token() -> None:
    """A tiny top_p keeps just the most likely token."""
    assert {draw(LOGITS, top_p=1e-6, position=p) for p in range(100)} == {0}


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass() -> None:
    """top_p keeps tokens until their mass reaches top_p: 0.5 + 0.3 covers 0.79 but not 0.81."""
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    assert {draw(logits, top_p=0.79, position=p) for p in range(300)} == {0, 1}
    assert {draw(logits, top_p=0.81, position=p) for p in range(300)} == {0, 1, 2}


def test_min_p() -> None:
    """min_p=1 keeps only the maximum; min_p=0.5 drops tokens under half the top probability."""
    assert {draw(LOGITS, min_p=1.0, position=p) for p in range(100)} == {0}
    logits = torch.log(torch.tensor([0.4, 0.3, 0.19, 0.11]))
    assert {draw(logits, min_p=0.5, position=p) for p in range(300)} == {0, 1}


def test_bf16_and_fp32_logits_agree() -> None:
    """The same logit values in bf16 and fp32 give the same tokens."""
    bf16 = torch.randn(2000, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    fp32 = bf16.float()
    for position in range(100):
        params = {"temperature": 0.9, "top_k": 40, "top_p": 0.95, "min_p": 0.01, "position": position}
        assert draw(bf16, **params) == draw(fp32, **params)
    assert draw(bf16, temperature=0) == draw(fp32, temperature=0)


def test_row_view_equals_its_copy() -> None:
    """A strided row cut from a batch draws as its contiguous copy does."""
    batch = torch.randn(1000, 8, generator=torch.Generator().manual_seed(3))
    for position in range(50):
        assert draw(batch[:, 5], position=position) == draw(batch[:, 5].clone(), position=position)


@pytest.mark.parametrize(
    ("logits", "params"),
    [
        (torch.zeros(2, 4), {}),
        (LOGITS, {"temperature": -1.0}),
        (LOGITS, {"top_k": -1}),
        (LOGITS, {"top_p": 0.0}),
        (LOGITS, {"min_p": 1.5}),
        (torch.tensor([0.0, float("nan")]), {}),
        (torch.full((4,), -float("inf")), {"temperature": 0}),
    ],
)
def test_bad_input_is_refused(logits: torch.Tensor, params: dict[str, float]) -> None:
    """Wrong shapes, out-of-range parameters and logits without a finite maximum raise ValueError."""
    with pytest.raises(ValueError):
        draw(logits, **params)


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"temperature": -1.0, "top_p": 0.0}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": -0.5}, "min_p"),
        ({"temperature": 1e-40}, "temperature"),  # every logit over it is infinite
    ],
)
def test_a_draw_its_parameters_make_fail_names_the_first_field_at_fault(params: dict[str, float], param: str) -> None:
    """The request's own field is named, so the client hears of it as a bad request (400), not a server error."""
    with pytest.raises(SamplingParamError) as caught:
        draw(LOGITS, **params)
    assert caught.value.param == param


def test_logits_without_a_finite_maximum_are_not_the_parameters_fault() -> None:
    """The model's logits, not the request, are at fault: a plain ValueError, which stays a server error."""
    with pytest.raises(ValueError) as caught:
        draw(torch.tensor([0.0, float("nan")]))
    assert not isinstance(caught.value, SamplingParamError)
