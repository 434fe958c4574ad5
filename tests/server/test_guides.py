"""A guided request's cursor: the packed masks of a window's draw rows, before and after its guide starts, past a
draft its grammar refuses, and the grammars' masks kept across requests."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from model.shipped import SHIPPED_MODEL
from server.guide_spec import GuideError, GuideSpec
from server.guides import MASK_SETS, Guides, packed

THINK_END = 4095
CHOICE = GuideSpec("choice", json.dumps(["yes", "no"]))


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(SHIPPED_MODEL))


@pytest.fixture(scope="module")
def guides(tokenizer) -> Guides:
    return Guides(tokenizer, 4100)  # a few ids past the tokenizer's, as a model's padded vocabulary has


def allowed_ids(bits: bytes, vocab: int = 4100) -> list[int]:
    """The ids whose bits are set: bit i of byte i // 8, lowest bit first."""
    return [i for i in range(vocab) if bits[i // 8] >> (i % 8) & 1]


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_packed_sets_bit_i_of_byte_i_over_8_lowest_first() -> None:
    mask = torch.zeros(19, dtype=torch.bool)
    mask[[0, 3, 8, 18]] = True
    assert packed(mask) == bytes([0b0000_1001, 0b0000_0001, 0b0000_0100])


def test_each_draw_row_gets_the_mask_after_the_drafts_before_it(tokenizer, guides):
    cursor = guides.cursor(CHOICE, (tokenizer.eos_token_id,))
    (y,), (es,) = ids(tokenizer, "y"), ids(tokenizer, "es")
    first, after_y, after_yes = cursor.row_masks((y, es))
    assert y in allowed_ids(first) and es not in allowed_ids(first) and tokenizer.eos_token_id not in allowed_ids(first)
    assert es in allowed_ids(after_y) and y not in allowed_ids(after_y)
    assert allowed_ids(after_yes) == [tokenizer.eos_token_id]  # the grammar is complete: only its end may come
    assert all(i < len(tokenizer) for i in allowed_ids(first))  # ids past the tokenizer's are never allowed
    cursor.take(y)
    assert cursor.row_masks(()) == (after_y,)


def test_rows_past_a_refused_draft_repeat_the_last_mask(tokenizer, guides):
    cursor = guides.cursor(CHOICE, (tokenizer.eos_token_id,))
    (x,), (y,) = ids(tokenizer, "x"), ids(tokenizer, "y")
    masks = cursor.row_masks((x, y, y))
    assert masks[1] == masks[2] == masks[3] == masks[0]  # x is refused: the rows after it are never kept


def test_before_its_guide_starts_nothing_is_masked_and_rows_after_the_start_are(tokenizer, guides):
    cursor = guides.cursor(CHOICE.after(THINK_END), (tokenizer.eos_token_id,))
    words = ids(tokenizer, " maybe")
    assert cursor.row_masks(tuple(words)) == ()  # no row is guided: no masks at all
    masks = cursor.row_masks((words[0], THINK_END))
    assert masks[0] == masks[1] == b"\xff" * len(masks[2])  # rows before the start may take any id
    assert allowed_ids(masks[2]) == allowed_ids(guides.cursor(CHOICE, (tokenizer.eos_token_id,)).row_masks(())[0])
    cursor.take(words[0])
    cursor.take(THINK_END)
    (y,) = ids(tokenizer, "y")
    cursor.take(y)
    with pytest.raises(GuideError, match="does not allow it"):
        cursor.take(y)


def test_a_grammars_masks_are_kept_for_the_next_request_with_the_same_end_ids(tokenizer, guides):
    end = (tokenizer.eos_token_id,)
    assert guides.cursor(CHOICE, end).masks is guides.cursor(CHOICE, end).masks
    assert guides.cursor(CHOICE.after(THINK_END), end).masks is guides.cursor(CHOICE, end).masks
    assert guides.cursor(CHOICE, (7,)).masks is not guides.cursor(CHOICE, end).masks


def test_a_grammar_served_after_older_ones_were_dropped_gets_its_own_masks(tokenizer):
    """More grammars than are kept, each a choice of one word: every cursor's first mask is its own grammar's."""
    guides, end = Guides(tokenizer, 4100), (tokenizer.eos_token_id,)
    for index in range(3 * MASK_SETS):
        spec = GuideSpec("choice", json.dumps([f"{index}zz"]))
        cursor = guides.cursor(spec, end)
        (first,) = cursor.row_masks(())
        assert allowed_ids(first) == cursor.masks.allowed(spec.grammar().initial).nonzero().flatten().tolist()
        assert ids(tokenizer, f"{index}zz")[0] in allowed_ids(first)
