"""The runner's logit adjustments before a draw: a request's logit bias, -inf for its stop tokens while its draws
are among its first min_tokens (up to the position where they may stop it, not at it), and guide masks."""

from __future__ import annotations

import math

import pytest
import torch

from rankwire.header import DrawSpec
from server.runner import _biased, _guide_mask


def test_stop_tokens_are_ruled_out_before_the_first_position_that_may_stop_and_beat_a_bias_on_the_same_id() -> None:
    held = DrawSpec(0.0, 0, 1.0, 0.0, 1, logit_bias=((3, 100.0), (5, 2.0)), suppress_ids=(3, 7), suppress_before=20)
    plain = DrawSpec(0.0, 0, 1.0, 0.0, 2)
    logits = torch.zeros(4, 10, dtype=torch.bfloat16)
    out = _biased(logits, [(held, 18), (held, 19), (held, 20), (plain, 19)])
    expected = torch.zeros(4, 10)
    expected[:2, [3, 7]] = -math.inf
    expected[:3, 5] = 2.0
    expected[2, 3] = 100.0
    assert out.dtype == torch.float32 and torch.equal(out, expected)
    assert not logits.any()  # the round's logits themselves are left as they were
    assert _biased(logits, [(plain, 19)]) is logits  # nothing to add: no copy


def test_allowed_ids_keep_their_biased_values_and_every_other_id_of_their_row_is_ruled_out() -> None:
    """vLLM's allowed_token_ids: only the listed ids may be drawn; a bias still reaches them, and a suppressed stop
    token stays out even where it is allowed."""
    held = DrawSpec(
        0.0, 0, 1.0, 0.0, 1, ((4, 1.5), (6, 9.0)), suppress_ids=(2,), suppress_before=5, allowed_ids=(2, 4, 8)
    )
    plain = DrawSpec(0.0, 0, 1.0, 0.0, 2)
    logits = torch.arange(20, dtype=torch.float32).reshape(2, 10)
    out = _biased(logits, [(held, 4), (plain, 4)])
    expected = torch.full((10,), -math.inf)
    expected[4], expected[8] = 4 + 1.5, 8
    assert torch.equal(out[0], expected) and torch.equal(out[1], logits[1])
    assert _biased(logits, [(held, 5), (plain, 4)])[0, 2] == 2  # past min_tokens: the allowed stop token is back


def test_a_guide_mask_rules_out_every_id_whose_bit_is_clear_on_its_own_row_only() -> None:
    """Bit i of byte i // 8, lowest bit first: ids 0, 3 and 9 allowed in a vocabulary of 10 (two bytes)."""
    bits = bytes([0b0000_1001, 0b0000_0010])
    held = DrawSpec(0.0, 0, 1.0, 0.0, 1, logit_bias=((3, 2.0),), allowed_ids=(0, 3, 4))
    plain = DrawSpec(0.0, 0, 1.0, 0.0, 2)
    logits = torch.arange(30, dtype=torch.float32).reshape(3, 10)
    out = _biased(logits, [(held, 4), (plain, 4), (plain, 5)], [bits, b"", bits])
    first, third = torch.full((10,), -math.inf), torch.full((10,), -math.inf)
    first[0], first[3] = 0, 3 + 2.0  # its allowed ids and its mask both hold: 4 is out, 9 is out
    third[[0, 3, 9]] = torch.tensor([20.0, 23.0, 29.0])
    assert torch.equal(out[0], first) and torch.equal(out[1], logits[1]) and torch.equal(out[2], third)
    assert _biased(logits, [(plain, 4)] * 3, [b"", b"", b""]) is logits  # no mask on any row: no copy


def test_a_guide_mask_of_the_wrong_width_is_refused() -> None:
    """Its bytes must be exactly the vocabulary's bits rounded up to whole bytes."""
    assert _guide_mask(b"\xff\x01", 9, torch.device("cpu")).tolist() == [False] * 9
    with pytest.raises(ValueError, match="a guide mask of 1 bytes for a vocabulary of 10 ids"):
        _guide_mask(b"\xff", 10, torch.device("cpu"))
