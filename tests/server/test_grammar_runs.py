"""Counted repeats' stand-in states: a state and the one that stands in for it take the same byte strings up to the
horizon, everywhere along long runs; the token masks share one walk along a run and stay exact."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from server.grammar import Grammar, State
from server.grammar_regex import regex_grammar
from server.grammar_schema import json_grammar
from server.token_masks import HORIZON, GuideMasks, TokenVocabulary

RUNS = {  # a grammar with long counted repeats, a small alphabet that exercises it, and outputs along it
    "class": (regex_grammar("[a-c]{40}x"), b"abcx", [b"a" * n for n in range(0, 41, 3)]),
    "range": (regex_grammar("b[ab]{5,40}c"), b"abc", [b"b" + b"a" * n for n in range(0, 41, 4)]),
    "groups": (regex_grammar("(?:ab{2,12}c){1,30}d"), b"abcd", [b"abbc" * n + b"abbb" for n in range(0, 30, 4)]),
    "starred part": (regex_grammar("(?:a[0-9]*){30}"), b"a09", [b"a1" * n + b"a" for n in range(0, 30, 3)]),
    "nullable part": (regex_grammar("(?:a?b?){20}c"), b"abc", [b"ab" * n for n in range(0, 20, 3)]),
    "maxLength": (
        json_grammar({"type": "object", "properties": {"s": {"type": "string", "minLength": 4, "maxLength": 40}}}),
        b'a"}\\',
        [b'{"s": "' + b"a" * n for n in range(0, 41, 3)],
    ),
    "long maxLength": (  # a long string is a call of a routine the schema's long strings share
        json_grammar({"type": "object", "properties": {"s": {"type": "string", "maxLength": 300}}}),
        b'a"}\\',
        [b'{"s": "' + b"a" * n for n in range(0, 301, 23)],
    ),
    "pattern and maxLength": (
        json_grammar({"type": "string", "pattern": "^[A-Z][a-z]*$", "minLength": 3, "maxLength": 40}),
        b'Aa"',
        [b'"A' + b"a" * n for n in range(0, 40, 3)],
    ),
    "maxItems": (
        json_grammar({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 30}),
        b"1,]",
        [b"[" + b"1," * n for n in range(0, 30, 3)],
    ),
}


def strings(alphabet: bytes, longest: int) -> list[bytes]:
    """Every byte string over the alphabet of 1 to `longest` bytes."""
    return [bytes(chars) for length in range(1, longest + 1) for chars in itertools.product(alphabet, repeat=length)]


def taken(grammar: Grammar, state: State, data: bytes) -> tuple[bool, ...]:
    """After each prefix of the bytes: whether the grammar takes it, and whether it accepts there."""
    marks = []
    for byte in data:
        state = grammar.step(state, byte)
        if state is None:
            return (*marks, False)
        marks.append(grammar.accepts(state))
    return tuple(marks)


@pytest.mark.parametrize("name", RUNS)
def test_a_stand_in_takes_the_same_strings_as_its_state_up_to_the_horizon(name):
    """For every state along a run and every string of up to `horizon` bytes over the grammar's alphabet, the state
    and its stand-in both refuse it at the same byte or both take it, accepting at the same places; at least one
    state along each run that can have one has a stand-in of its own."""
    grammar, alphabet, outputs = RUNS[name]
    horizon = 4
    probes = strings(alphabet, horizon)
    moved = 0
    for output in outputs:
        state = grammar.feed(grammar.initial, output)
        assert state is not None, output
        stand_in = grammar.stand_in(state, horizon)
        moved += stand_in != state
        assert grammar.accepts(stand_in) == grammar.accepts(state), output
        for probe in probes:
            assert taken(grammar, stand_in, probe) == taken(grammar, state, probe), (output, probe)
    assert moved or name == "nullable part", "no state along the run has a stand-in"


def test_states_far_from_a_runs_end_share_a_stand_in_and_those_near_it_do_not():
    """`[a-z]{1000}`: every state until 16 + 3 copies from the end stands in with the first, the last ones are their
    own; a horizon as long as the run leaves every state its own."""
    grammar = regex_grammar("[a-z]{1000}")
    states = [grammar.feed(grammar.initial, b"q" * n) for n in range(1, 1000)]
    stand_ins = {grammar.stand_in(state, 16) for state in states[:-20]}
    assert len(stand_ins) == 1
    assert all(grammar.stand_in(state, 16) == state for state in states[-18:])
    assert all(grammar.stand_in(state, 1000) == state for state in states)


def fed_mask(masks: GuideMasks, state: State) -> torch.Tensor:
    """The allowed ids the slow way: every token's bytes fed to the grammar, then the end ids' rule."""
    vocabulary, grammar = masks.vocabulary, masks.grammar
    mask = torch.tensor(
        [
            bool(piece := vocabulary.token_bytes(i)) and grammar.feed(state, piece) is not None
            for i in range(vocabulary.size)
        ]
    )
    mask[list(masks.end_ids)] = False
    mask[list(masks.end_ids)] = grammar.accepts(state) or not mask.any()
    return mask


def test_a_long_runs_masks_walk_the_short_tokens_once_and_stay_exact(monkeypatch):
    """Along `[a-z ]{300}` then `!`, with tokens up to twice the horizon long: every mask equals the brute force's,
    while the short tokens are walked only for the run's first state and the few near its end."""
    rng = random.Random(3)
    pieces = [bytes([b]) for b in range(256)] + [
        bytes(rng.choice(b"ab !z") for _ in range(rng.randint(2, 2 * HORIZON))) for _ in range(1500)
    ]
    vocabulary = TokenVocabulary(pieces, len(pieces) + 1)
    assert len(vocabulary.long_trie) and len(vocabulary.trie)
    grammar = regex_grammar("[a-z ]{300}!")
    masks = GuideMasks(grammar, vocabulary, (len(pieces),))
    short_walks = []
    walk = masks._walk
    monkeypatch.setattr(
        masks,
        "_walk",
        lambda state, trie: (
            short_walks.append(state) if trie is vocabulary.trie else None,
            walk(state, trie),
        )[1],
    )
    for length in range(0, 301, 7):
        state = grammar.feed(grammar.initial, b"ab z" * (length // 4) + b"a" * (length % 4))
        assert torch.equal(masks.allowed(state), fed_mask(masks, state)), length
    assert len(short_walks) <= 1 + (HORIZON + 3) // 7 + 1


def test_states_on_either_side_of_the_stack_cap_keep_their_own_masks_in_either_order():
    """`(?:a{1,999}){1,15}b` after 720 a's holds 9,991 stacks, and one more 'a' passes MAX_STACKS, which the grammar
    then refuses; after 17 a's it takes one. Both share a stand-in, yet each gets its own mask, whichever comes first
    (a review's counterexample: the first one's mask was served to the other)."""
    grammar = regex_grammar("(?:a{1,999}){1,15}b")
    small, big = grammar.feed(grammar.initial, b"a" * 17), grammar.feed(grammar.initial, b"a" * 720)
    assert grammar.stand_in(small, HORIZON) == grammar.stand_in(big, HORIZON)
    assert grammar.feed(big, b"a") is None and grammar.feed(small, b"a") is not None
    vocabulary = TokenVocabulary([b"a", b"b"], 3)
    for order in ((small, big), (big, small)):
        masks = GuideMasks(grammar, vocabulary, (2,))
        for state in order:
            assert torch.equal(masks.allowed(state), fed_mask(masks, state))
