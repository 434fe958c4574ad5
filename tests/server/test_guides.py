"""A guided request's cursor: the packed masks of a window's draw rows, before and after its guide starts, past a
draft its grammar refuses, and the grammars' masks kept across requests."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from model.shipped import SHIPPED_MODEL
from server.grammar_ebnf import ebnf_grammar
from server.grammar_regex import choice_grammar, regex_grammar
from server.grammar_schema import json_grammar
from server.guide_spec import GuideError, GuideSpec
from server.guides import MASK_SETS, Guides, likely_text, packed
from server.token_masks import GuideMasks, TokenVocabulary

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


PLEASE = GuideSpec("choice", json.dumps(["yes please", "no"]))


def test_drafts_stop_at_the_first_the_grammar_refuses_then_take_the_text_it_forces(tokenizer, guides):
    """A lane's proposed drafts are kept up to the first its grammar refuses; from there the tokens of the text the
    grammar forces fill the window, never past its depth."""
    cursor = guides.cursor(PLEASE, (tokenizer.eos_token_id,))
    (y,), (x,) = ids(tokenizer, "y"), ids(tokenizer, "x")
    assert cursor.drafts((x, y), 3) == ()  # "y" or "n": nothing is forced at the start
    cursor.take(y)
    rest = ids(tokenizer, "es please")
    assert len(rest) > 2
    assert cursor.drafts((x, y, y), 3) == tuple(rest[:3])
    assert cursor.drafts((x,), 1) == (rest[0],)
    assert cursor.drafts((rest[0], x), 3) == (
        rest[0],
        *ids(tokenizer, "es please"[len(tokenizer.decode(rest[0])) :])[:2],
    )
    assert cursor.drafts(tuple(rest), 8) == tuple(rest)  # the grammar is complete after them: nothing more is forced


def test_an_end_id_is_kept_as_a_draft_only_where_the_output_is_complete(tokenizer, guides):
    eos = tokenizer.eos_token_id
    cursor = guides.cursor(PLEASE, (eos,))
    (n,), (x,) = ids(tokenizer, "n"), ids(tokenizer, "x")
    assert cursor.drafts((n, eos, x), 3) == (n, *ids(tokenizer, "o"))  # "n" is not complete: "o" is forced
    (no,) = ids(tokenizer, "no")
    assert cursor.drafts((no, eos, x), 3) == (no, eos)


def test_drafts_before_the_guide_starts_are_kept_as_proposed(tokenizer, guides):
    cursor = guides.cursor(CHOICE.after(THINK_END), (tokenizer.eos_token_id,))
    words = tuple(ids(tokenizer, " maybe so"))
    assert cursor.drafts(words, 3) == words[:3]
    (x,), (y,) = ids(tokenizer, "x"), ids(tokenizer, "y")
    assert cursor.drafts((words[0], THINK_END, x), 3) == (words[0], THINK_END)  # "yes" or "no" after: none forced
    assert cursor.drafts((words[0], THINK_END, y), 4) == (words[0], THINK_END, y, *ids(tokenizer, "es")[:1])


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "size": {"enum": ["S", "M"]}, "tags": {"type": "array"}},
    "required": ["name", "size", "tags"],
}


@pytest.mark.parametrize(
    ("grammar", "output", "likely"),
    [
        (json_grammar(SCHEMA), b"", b'{"name": "'),
        (json_grammar(SCHEMA), b'{"name": "Al', b""),  # inside a string: any character
        (json_grammar(SCHEMA), b'{"name": "Al"', b', "size": "'),
        (json_grammar(SCHEMA), b'{"name": "Al",', b' "size": "'),
        (json_grammar(SCHEMA), b'{"name": "Al" , "size": "M"', b', "tags": ['),
        (json_grammar(None), b'{"a"', b": "),
        (regex_grammar(r"a[ \t]*b"), b"a", b"b"),
        (regex_grammar(r"a\tb+"), b"a", b"\tb"),  # ends where "b" completes a match
        (choice_grammar(["yes please", "no"]), b"", b""),
        (choice_grammar(["yes please", "no"]), b"yes", b" please"),
    ],
)
def test_the_likely_text_is_the_forced_text_with_json_whitespace_as_json_dumps_writes_it(grammar, output, likely):
    state = grammar.feed(grammar.initial, output)
    assert likely_text(grammar, state, output[-1:], 64) == likely
    assert likely_text(grammar, state, output[-1:], 3) == likely[:3]


def test_drafts_inside_a_character_the_grammar_forces_are_made_without_failing(tokenizer, guides):
    """A byte-level token may end inside a character ('中' is three bytes): the text forced from there begins with
    the character's last bytes, which no text spells, so no forced token is drafted there (it used to raise, which
    stopped the engine); once the character is whole the next one's tokens are."""
    cursor = guides.cursor(GuideSpec("choice", json.dumps(["中文", "x"])), (tokenizer.eos_token_id,))
    single = {guides.vocabulary.token_bytes(i): i for i in range(len(tokenizer))}
    first, *rest = "中".encode()
    cursor.take(single[bytes([first])])
    assert cursor.drafts((), 3) == ()
    for byte in rest:
        cursor.take(single[bytes([byte])])
    assert cursor.drafts((), 3) == tuple(ids(tokenizer, "文"))[:3]


def test_forced_text_that_spells_a_special_token_is_drafted_in_plain_tokens(tokenizer, guides):
    eos = tokenizer.eos_token_id
    cursor = guides.cursor(GuideSpec("choice", json.dumps(["a" + tokenizer.eos_token, "b"])), (eos,))
    (a,) = ids(tokenizer, "a")
    cursor.take(a)
    drafts = cursor.drafts((), 3)
    assert drafts and eos not in drafts
    assert (
        b"".join(guides.vocabulary.token_bytes(token) for token in drafts)
        == tokenizer.eos_token.encode()[: sum(len(guides.vocabulary.token_bytes(token)) for token in drafts)]
    )


def test_the_text_before_a_guide_starts_does_not_steer_its_whitespace(tokenizer, guides):
    """A think block that ends with ':' does not make the guided text's likely start a space."""
    cursor = guides.cursor(GuideSpec("regex", "[ ]?x").after(THINK_END), (tokenizer.eos_token_id,))
    for token in (*ids(tokenizer, "so:"), THINK_END):
        cursor.take(token)
    assert cursor.drafts((), 2) == tuple(ids(tokenizer, "x"))


def test_a_token_drawn_under_a_mask_the_cap_on_stacks_cut_ends_the_guide(tokenizer, guides):
    """An inherently ambiguous grammar doubles its ways to read the output at each '(': past the cap the grammar
    refuses steps it should take, so the mask leaves tokens out. A token drawn under that mask ends the request with
    an error rather than an output steered by the cut."""
    cursor = guides.cursor(GuideSpec("grammar", 'root ::= "(" root? root? ")" | "x"'), (tokenizer.eos_token_id,))
    (opening,) = ids(tokenizer, "(")
    depth = 0
    while depth < 40:
        allowed = cursor.masks.allowed(cursor.state).nonzero().squeeze(1).tolist()  # the row's mask, made
        if cursor.masks.cut(cursor.state):
            break
        cursor.take(opening)
        depth += 1
    assert 5 < depth < 40
    with pytest.raises(GuideError, match="too ambiguous"):
        cursor.take(allowed[0])


def test_only_steps_a_walk_looks_up_make_its_mask_cut():
    """A state one '(' before the cut has a complete mask, however many steps past it other walks took before (a
    state's widest closure so far counts those too, and once made its mask look cut)."""
    grammar = ebnf_grammar('root ::= "(" root? root? ")" | "x"')  # its own, with no steps taken yet
    vocabulary = TokenVocabulary([b"(", b"x", b")", None], 4)
    states = [grammar.initial]
    while len(states) < 40:
        masks = GuideMasks(grammar, vocabulary, (3,))
        masks.allowed(states[-1])
        if masks.cut(states[-1]):
            break
        states.append(grammar.feed(states[-1], b"("))
    before, at = states[-2], states[-1]
    for _ in range(2):  # before's mask made anew after the cut state's walk, in a mask set of its own
        masks = GuideMasks(grammar, vocabulary, (3,))
        assert masks.allowed(before)[0] and not masks.cut(before)
        masks.allowed(at)
        assert masks.cut(at)
