"""Token masks of guided decoding over the shipped tokenizer: each token's bytes, the ids a grammar's state allows
(held to feeding every token's bytes one by one), the end ids, and outputs driven by the masks alone."""

from __future__ import annotations

import json
import random
import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from model.shipped import SHIPPED_MODEL
from server.grammar import Grammar, State
from server.grammar_ebnf import ebnf_grammar
from server.grammar_regex import choice_grammar, regex_grammar
from server.grammar_schema import json_grammar
from server.token_masks import ENDED, GuideMasks, TokenVocabulary, byte_level_alphabet
from server.tokenizer import load_tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "size": {"enum": ["S", "M", "L"]},
        "count": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "[a-z]{1,4}"}, "maxItems": 2},
    },
    "required": ["name", "size"],
}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    """The shipped tokenizer as the server loads it."""
    return load_tokenizer(SHIPPED_MODEL, None)


@pytest.fixture(scope="module")
def vocabulary(tokenizer) -> TokenVocabulary:
    """The shipped tokenizer's token bytes."""
    return TokenVocabulary.from_tokenizer(tokenizer, len(tokenizer))


def fed_mask(grammar: Grammar, vocabulary: TokenVocabulary, state: State, end_ids: tuple[int, ...]) -> torch.Tensor:
    """The allowed ids worked out the slow way: every token's bytes fed to the grammar, then the end ids' rule."""
    mask = torch.zeros(vocabulary.size, dtype=torch.bool)
    for token_id in range(vocabulary.size):
        piece = vocabulary.token_bytes(token_id)
        mask[token_id] = bool(piece) and grammar.feed(state, piece) is not None
    mask[list(end_ids)] = False
    mask[list(end_ids)] = grammar.accepts(state) or not mask.any()
    return mask


def test_the_shipped_tokenizer_is_read_as_byte_level(vocabulary, tokenizer):
    """The shipped tokenizer's space and newline tokens stand for those bytes."""
    assert vocabulary.size == len(tokenizer) == 4096
    assert vocabulary.token_bytes(tokenizer.convert_tokens_to_ids("Ġ")) == b" "
    assert vocabulary.token_bytes(tokenizer.convert_tokens_to_ids("Ċ")) == b"\n"


@pytest.mark.parametrize(
    "text",
    [
        '{"a": 1}',
        "héllo wörld, ça va?",
        "日本語のテキストと中文",
        "emoji 🙂🚀 and ∑ math",
        "tabs\tand\nnew lines\r\n  indented    runs",
        "code: def f(x):\n    return x ** 2  # ok",
        " leading space and trailing ",
    ],
)
def test_the_bytes_of_a_texts_tokens_are_its_utf8(tokenizer, vocabulary, text):
    """Token bytes joined give back the text, non-ASCII and whitespace runs included."""
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(vocabulary.token_bytes(token_id) for token_id in token_ids) == text.encode()


def test_special_tokens_and_ids_past_the_tokenizer_have_no_bytes(tokenizer):
    """Special tokens and ids past the tokenizer (a wider model vocabulary) have no bytes and are never allowed."""
    vocabulary = TokenVocabulary.from_tokenizer(tokenizer, 4200)
    assert vocabulary.size == 4200
    think_end = tokenizer.convert_tokens_to_ids("</think>")
    for token_id in [*tokenizer.all_special_ids, think_end, 4096, 4199, 4200, -1]:
        assert vocabulary.token_bytes(token_id) is None, token_id
    masks = GuideMasks(json_grammar(True), vocabulary, (tokenizer.eos_token_id,))
    inside = masks.grammar.feed(masks.grammar.initial, b'"')
    assert masks.allowed(inside).shape == (4200,)
    assert not masks.allowed(inside)[4096:].any() and not masks.allowed(inside)[think_end]


def test_the_byte_level_alphabet_covers_every_byte_once():
    """GPT-2's alphabet maps 256 characters onto the 256 bytes, the shifted ones from chr(256) on."""
    alphabet = byte_level_alphabet()
    assert sorted(alphabet.values()) == list(range(256))
    assert alphabet["A"] == ord("A") and alphabet["Ġ"] == ord(" ") and alphabet["Ā"] == 0
    assert max(map(ord, alphabet)) == 256 + 67


NESTED_LISTS = 'root ::= "[" (item (", " item){0,30})? "]"\nitem ::= [a-c]+ | "é" | root'  # EBNF, recursive
JSON_EBNF = r"""
root ::= value
value ::= "{" ws (pair ("," ws pair)*)? "}" | "[" ws (value ws ("," ws value ws){0,20})? "]"
  | string | [0-9.e-]+ | "true"
pair ::= string ws ":" ws value ws
string ::= "\"" ([^"\\] | "\\" ["\\n])* "\""
ws ::= [ \n]*
"""  # JSON-like, recursive, with a counted repeat of recursive values

GRAMMARS = {
    "object": (json_grammar(None), [b"", b"{", b'{"a', b'{"a": ', b'{"a": [1', b'{"a": 1}', b'{"a": "\\u1', b'{"\xe6']),
    "schema": (json_grammar(SCHEMA), [b"", b'{"name": "ab', b'{"name": "ab", "size": ', b'{"name": "", "size": "S"']),
    "regex": (regex_grammar(r"[a-c]+x?\d{2}|é+"), [b"", b"ab", b"abx1", b"\xc3"]),
    "choice": (choice_grammar(["stack", "queue", "heap"]), [b"", b"st", b"stack"]),
    "ebnf": (ebnf_grammar(NESTED_LISTS), [b"", b"[", b"[ab, [c", b"[a, [b, [c]], ", b"[\xc3", b"[a" + b", a" * 28]),
}


@pytest.mark.parametrize("name", GRAMMARS)
def test_a_mask_allows_exactly_the_tokens_whose_bytes_the_grammar_takes(vocabulary, tokenizer, name):
    """The trie walk gives the same mask as feeding every token's bytes, for several grammars and states."""
    grammar, prefixes = GRAMMARS[name]
    end_ids = (tokenizer.eos_token_id,)
    masks = GuideMasks(grammar, vocabulary, end_ids)
    for prefix in prefixes:
        state = grammar.feed(grammar.initial, prefix)
        allowed = masks.allowed(state)
        assert allowed.dtype == torch.bool and allowed.shape == (vocabulary.size,)
        assert torch.equal(allowed, fed_mask(grammar, vocabulary, state, end_ids)), prefix
        assert allowed[end_ids[0]] == grammar.accepts(state), prefix


def test_end_ids_are_allowed_exactly_where_the_grammar_accepts(vocabulary, tokenizer):
    """Every end id is allowed after each complete prefix of a document and at no other."""
    end_ids = (tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    grammar = json_grammar(None)
    masks = GuideMasks(grammar, vocabulary, end_ids)
    text = b'{"k": [1, 2.5], "v": "x"}'
    for end in range(len(text) + 1):
        state = grammar.feed(grammar.initial, text[:end])
        assert masks.allowed(state)[list(end_ids)].tolist() == [grammar.accepts(state)] * 2
    assert grammar.accepts(grammar.feed(grammar.initial, text))


def test_a_dead_end_allows_the_end_ids_so_the_output_can_end():
    """Where no token fits, the end ids are allowed; empty and special tokens never are."""
    vocabulary = TokenVocabulary([b"a", b"b", b"", None], 5)
    grammar = regex_grammar("ac|b")
    masks = GuideMasks(grammar, vocabulary, (3, 99))
    assert masks.end_ids == (3,)  # an id past the vocabulary is never drawn
    assert masks.allowed(grammar.initial).tolist() == [True, True, False, False, False]
    after_a = masks.advance(grammar.initial, 0)
    assert after_a is not None and not grammar.accepts(after_a)
    assert masks.allowed(after_a).tolist() == [False, False, False, True, False]
    assert masks.advance(after_a, 3) is ENDED


def test_advance_follows_the_grammar_and_ends_at_an_end_id(vocabulary, tokenizer):
    """Advancing through a choice's tokens, an end id where it is complete, and nothing but end ids after."""
    eos = tokenizer.eos_token_id
    grammar = choice_grammar(["yes please", "no"])
    masks = GuideMasks(grammar, vocabulary, (eos,))
    assert masks.advance(grammar.initial, eos) is None  # nothing written yet: the grammar does not accept
    assert masks.advance(grammar.initial, tokenizer.encode("maybe", add_special_tokens=False)[0]) is None
    state = grammar.initial
    for token_id in tokenizer.encode("yes please", add_special_tokens=False):
        assert masks.allowed(state)[token_id] and not masks.allowed(state)[eos]
        state = masks.advance(state, token_id)
        assert state is not None
    assert grammar.accepts(state) and masks.advance(state, tokenizer.encode("!", add_special_tokens=False)[0]) is None
    assert masks.advance(state, eos) is ENDED
    assert masks.allowed(ENDED).nonzero().flatten().tolist() == [eos]
    assert masks.advance(ENDED, eos) is ENDED and masks.advance(ENDED, tokenizer.encode("no")[0]) is None


def test_a_repeated_state_gets_the_cached_mask(vocabulary, tokenizer):
    """A state met again, even after other bytes, gets the same tensor."""
    grammar = json_grammar(True)
    masks = GuideMasks(grammar, vocabulary, (tokenizer.eos_token_id,))
    inside = grammar.feed(grammar.initial, b'"ab')
    assert masks.allowed(inside) is masks.allowed(inside)
    assert masks.allowed(grammar.feed(grammar.initial, b'"abcd')) is masks.allowed(inside)  # the same place
    assert masks.allowed(grammar.initial) is not masks.allowed(inside)


CLOSERS = [b'"', b"}", b"]", b":", b"0"]  # bytes that bring a JSON document nearer its end, in preference order
PUNCTUATION = re.compile(rb'["{}\[\]:,]')
NOT_WHITESPACE = re.compile(rb"\S")


def drive(masks: GuideMasks, rng: random.Random, free_steps: int, limit: int) -> bytes:
    """An output made by the masks alone: for `free_steps` steps random allowed tokens (half the time one holding a
    JSON punctuation byte, else one not all whitespace, where there are such), then the first allowed of CLOSERS
    (else the lowest allowed id) until only end ids are allowed; fails past `limit` steps."""
    vocabulary, state, output = masks.vocabulary, masks.grammar.initial, b""
    ids = {vocabulary.token_bytes(token_id): token_id for token_id in range(vocabulary.size)}
    closer_ids = [ids[closer] for closer in CLOSERS]
    for step in range(limit):
        allowed = masks.allowed(state).clone()
        allowed[list(masks.end_ids)] = False
        if not allowed.any():
            return output
        candidates = allowed.nonzero().flatten().tolist()
        if step < free_steps:
            wanted = PUNCTUATION if rng.random() < 0.5 else NOT_WHITESPACE
            token_id = rng.choice([i for i in candidates if wanted.search(vocabulary.token_bytes(i))] or candidates)
        else:
            token_id = ([i for i in closer_ids if allowed[i]] or candidates)[0]
        state = masks.advance(state, token_id)
        assert state is not None, (output, token_id)
        output += vocabulary.token_bytes(token_id)
    raise AssertionError(f"no end within {limit} steps: {output!r}")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_an_output_driven_by_the_object_masks_alone_parses_as_an_object(vocabulary, tokenizer, seed):
    """Random allowed tokens, then closing ones, give a document json.loads parses as an object."""
    masks = GuideMasks(json_grammar(None), vocabulary, (tokenizer.eos_token_id,))
    output = drive(masks, random.Random(seed), free_steps=100, limit=500)
    assert isinstance(json.loads(output), dict), output


@pytest.mark.parametrize("seed", [0, 1])
def test_an_output_driven_by_the_schema_masks_alone_follows_the_schema(vocabulary, tokenizer, seed):
    """Random allowed tokens, then closing ones, give a document of the schema's keys in its order."""
    masks = GuideMasks(json_grammar(SCHEMA), vocabulary, (tokenizer.eos_token_id,))
    document = json.loads(drive(masks, random.Random(seed), free_steps=30, limit=400))
    assert list(document)[:2] == ["name", "size"] and set(document) <= set(SCHEMA["properties"])
    assert isinstance(document["name"], str) and len(document["name"]) <= 12 and document["size"] in ("S", "M", "L")


class SentencePieceLike:
    """A stand-in for a transformers tokenizer without a fast backend, holding what from_tokenizer reads."""

    def __init__(self) -> None:
        self.tokens = ["▁hello", "<0x0A>", "<0xE6>", "wor▁ld", "</s>", "<tool>", "<s>"]
        self.all_special_ids = [4]
        self.added_tokens_decoder = {
            5: SimpleNamespace(content="<tool>", special=False),
            6: SimpleNamespace(content="<s>", special=True),
        }

    def __len__(self) -> int:
        """The number of tokens."""
        return len(self.tokens)

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        """The token strings of ids."""
        return [self.tokens[token_id] for token_id in token_ids]


def test_a_sentencepiece_style_tokenizer_gives_spaces_and_fallback_bytes():
    """Without a byte-level backend: '▁' is a space, '<0xHH>' a byte, added tokens their content."""
    vocabulary = TokenVocabulary.from_tokenizer(SentencePieceLike(), 8)
    pieces = [vocabulary.token_bytes(token_id) for token_id in range(8)]
    assert pieces == [b" hello", b"\n", b"\xe6", b"wor ld", None, b"<tool>", None, None]


def test_string_states_whose_many_bytes_loop_back_get_the_brute_forces_masks():
    """Inside a JSON string most bytes lead back to the same state, and a quote, a backslash, a UTF-8 lead or a
    control byte leave it: the mask is the brute force's in states whose loops differ (a key, a value, a class)."""
    rng = random.Random(7)
    pieces = [bytes([b]) for b in range(256)] + [
        bytes(rng.choice(b'ab "\\:,{}[]x\xc3\xa9\n0') for _ in range(rng.randint(2, 6))) for _ in range(3000)
    ]
    vocabulary = TokenVocabulary(pieces, len(pieces) + 3)
    for grammar, text in (
        (json_grammar(None), b'{"ke'),
        (json_grammar(None), b'{"key": "va'),
        (
            json_grammar({"type": "object", "properties": {"a": {"type": "string", "pattern": "[a-zA-Z :]*"}}}),
            b'{"a": "',
        ),
    ):
        state = grammar.feed(grammar.initial, text)
        mask = GuideMasks(grammar, vocabulary, ()).allowed(state)
        assert torch.equal(mask, fed_mask(grammar, vocabulary, state, ())), text


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_tries_levels_give_back_every_tokens_bytes(seed):
    """Rebuilt from the levels' bytes and children, the ids ending at each node are exactly the tokens of its bytes,
    its key range holds exactly the keys under it, and its count of nodes below is right: keys that are prefixes of
    others, repeated pieces, and bytes 0 and 255 (the padding's and the highest)."""
    rng = random.Random(seed)
    pieces = [bytes(rng.choice(b"\x00ab\xff") for _ in range(rng.randint(0, 7))) for _ in range(400)]
    pieces += [None, b"\x00", b"\x00\x00", b"ab", b"ab"]
    vocabulary = TokenVocabulary(pieces, len(pieces) + 2)
    trie = vocabulary.trie
    keys: dict[int, bytes] = {}
    prefixes = {key[:length] for key in trie.keys for length in range(1, len(key) + 1)}  # every node's bytes
    paths, parents = [b""], [0] * len(trie.levels[0].data)  # the root's path; the first depth's nodes hang from it
    for level in trie.levels:
        paths = [paths[parent] + bytes([byte]) for parent, byte in zip(parents, level.data.tolist(), strict=True)]
        assert len(set(paths)) == len(paths)  # each node a distinct prefix
        keys.update((len(keys), paths[node]) for node in level.end_nodes.tolist())
        ranges = zip(paths, level.first_keys.tolist(), level.last_keys.tolist(), level.below.tolist(), strict=True)
        for path, first, last, below in ranges:
            assert [key for key in trie.keys if key.startswith(path)] == trie.keys[first:last]  # each node's keys
            assert below == len({p for p in prefixes if len(p) > len(path) and p.startswith(path)})  # nodes below
        parents = torch.arange(len(paths)).repeat_interleave(torch.diff(level.children)).tolist()
    assert not parents  # the deepest nodes have no children
    rebuilt = {
        token_id: keys[key] for token_id, key in zip(trie.token_ids.tolist(), trie.end_of_id.tolist(), strict=True)
    }
    assert rebuilt == {token_id: piece for token_id, piece in enumerate(pieces) if piece}
    assert len(vocabulary.trie) == len({piece for piece in pieces if piece})


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_masks_over_random_vocabularies_are_the_brute_forces(seed):
    """Random pieces of JSON's bytes, some past the horizon, masked from states along random outputs of the object
    grammar, a schema's and a recursive EBNF grammar's: each mask equals feeding every token's bytes."""
    rng = random.Random(seed)
    alphabet = b' {}[]:,"\\ab1.e-tn\n\xc3\xa9'
    pieces = [bytes([b]) for b in range(256)] + [
        bytes(rng.choice(alphabet) for _ in range(rng.choice((2, 3, 5, 9, 20, 40)))) for _ in range(1200)
    ]
    vocabulary = TokenVocabulary(pieces, len(pieces) + 1)
    for grammar in (json_grammar(None), json_grammar(SCHEMA), ebnf_grammar(JSON_EBNF)):
        masks = GuideMasks(grammar, vocabulary, (len(pieces),))
        state = grammar.initial
        for _ in range(12):
            mask = masks.allowed(state)
            assert torch.equal(mask, fed_mask(grammar, vocabulary, state, masks.end_ids))
            choices = [token_id for token_id in mask.nonzero().squeeze(1).tolist() if token_id < len(pieces)]
            if not choices:
                break
            state = grammar.feed(state, pieces[rng.choice(choices)])
