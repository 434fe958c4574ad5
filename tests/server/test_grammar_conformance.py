"""Guided decoding as JSON Schema, ECMA-262 and vLLM's xgrammar read it (helper-134's review): only well-formed UTF-8
where any character may stand, ECMA-262's spaces in \\s, the standard control escapes, a '^' opening each top-level
option, JSON Schema's equality at any depth, non-ASCII constants as they are, and a Lark grammar refused by name."""

from __future__ import annotations

import json

import jsonschema
import pytest

from server.grammar import Grammar, GrammarError
from server.grammar_ebnf import ebnf_grammar
from server.grammar_regex import regex_grammar
from server.grammar_schema import json_grammar


def matches(grammar: Grammar, text: str | bytes) -> bool:
    """Whether the whole text is a complete match."""
    state = grammar.feed(grammar.initial, text.encode() if isinstance(text, str) else text)
    return state is not None and grammar.accepts(state)


# Encoded surrogates, overlong forms and code points past U+10FFFF: a tokenizer decodes each byte as U+FFFD, so text
# a guide took as one character would arrive as several
NOT_UTF8 = [
    pytest.param(b"\xed\xa0\x80", id="encoded-surrogate-U+D800"),
    pytest.param(b"\xe0\x80\x80", id="overlong-3-byte-NUL"),
    pytest.param(b"\xf0\x80\x80\x80", id="overlong-4-byte-NUL"),
    pytest.param(b"\xf4\x90\x80\x80", id="past-U+10FFFF"),
]


@pytest.mark.parametrize("bad", NOT_UTF8)
def test_a_json_string_refuses_bytes_that_are_not_utf8(bad):
    """RFC 8259 §8.1: JSON text is UTF-8; json.loads refuses these bytes, so response_format json_object must too."""
    text = b'{"a": "' + bad + b'"}'
    with pytest.raises(UnicodeDecodeError):
        text.decode("utf-8")
    assert not matches(json_grammar(None), text)


@pytest.mark.parametrize("bad", NOT_UTF8)
def test_max_length_holds_for_the_text_the_output_decodes_to(bad):
    """A maxLength 1 string takes these bytes as one character, but they decode to 3 or 4 U+FFFD characters."""
    schema = {"type": "string", "maxLength": 1}
    text = b'"' + bad + b'"'
    decoded = json.loads(text.decode("utf-8", errors="replace"))
    assert not jsonschema.Draft202012Validator(schema).is_valid(decoded)
    assert not matches(json_grammar(schema), text)


@pytest.mark.parametrize("pattern", [".", "[^a]"])
@pytest.mark.parametrize("bad", NOT_UTF8)
def test_a_regex_character_is_well_formed_utf8(pattern, bad):
    """guided_regex '.' is one character; the decoded output of these bytes is 3 or 4 characters and does not match."""
    assert not matches(regex_grammar(pattern), bad)


@pytest.mark.parametrize("bad", NOT_UTF8)
def test_an_ebnf_any_character_is_well_formed_utf8(bad):
    assert not matches(ebnf_grammar("root ::= ."), bad)
    assert not matches(ebnf_grammar("root ::= [^a]"), bad)


@pytest.mark.parametrize("space", ["\u00a0", "\u3000", "\u2028"])
def test_a_pattern_non_whitespace_class_refuses_unicode_whitespace(space):
    """ECMA-262 (JSON Schema's regex dialect) and Python's re both count U+00A0, U+3000 and U+2028 as \\s, so '^\\S+$'
    refuses 'a' + space + 'b' (jsonschema says invalid); the guide takes it, as grammar_regex's \\S is the complement of
    ASCII whitespace only."""
    schema = {"type": "string", "pattern": r"^\S+$"}
    instance = f"a{space}b"
    assert not jsonschema.Draft202012Validator(schema).is_valid(instance)
    grammar = json_grammar(schema)
    assert not matches(grammar, json.dumps(instance, ensure_ascii=False))
    assert not matches(grammar, json.dumps(instance))


@pytest.mark.parametrize(("pattern", "text"), [(r"\f", "\f"), (r"\v", "\v"), (r"\0", "\x00"), (r"[\t\f\v ]+", "\f\v")])
def test_control_character_escapes_are_taken(pattern, text):
    """\\f, \\v and \\0 are standard escapes (re, ECMA-262; xgrammar's regex converter maps them); refused now as
    "'\\f' is not supported" (grammar_regex.RegexParser._escape knows only n, t, r, x, u)."""
    import re

    assert re.fullmatch(pattern, text)
    assert matches(regex_grammar(pattern), text)


@pytest.mark.parametrize("pattern", [r"^yes$|^no$", r"^(?:yes)$|^no"])
def test_a_caret_opening_each_top_level_option_is_taken(pattern):
    """re.fullmatch takes '^yes$|^no$', and xgrammar ignores a '^' past the start: a '^' opening each top-level
    option is taken; one inside an option is refused, saying where it may stand."""
    grammar = regex_grammar(pattern)
    assert matches(grammar, "yes") and matches(grammar, "no") and not matches(grammar, "yesno")
    with pytest.raises(GrammarError, match="where a top-level option begins"):
        regex_grammar("a^b")


def test_unique_items_treats_nested_equal_numbers_as_equal():
    """JSON Schema equality: {"a": 1} equals {"a": 1.0} and [1] equals [1.0]; _listed_values only normalises a float
    at the top, so the guide takes an array of two equal items under uniqueItems."""
    for values, text in (([{"a": 1}, {"a": 1.0}], '[{"a": 1}, {"a": 1.0}]'), ([[1], [1.0]], "[[1], [1.0]]")):
        schema = {"type": "array", "uniqueItems": True, "items": {"enum": values}}
        assert not jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))
        assert not matches(json_grammar(schema), text)


def test_enum_and_const_meet_where_their_values_are_equal_numbers():
    """{"enum": [1.0, 2], "const": 1} admits 1 (1 == 1.0 in JSON Schema); refused now as "no value of 'enum' or
    'const' fits" (same_json compares json.dumps texts)."""
    schema = {"enum": [1.0, 2], "const": 1}
    assert jsonschema.Draft202012Validator(schema).is_valid(1)
    grammar = json_grammar(schema)
    assert matches(grammar, "1") or matches(grammar, "1.0")
    assert not matches(grammar, "2")


@pytest.mark.parametrize("value", ["é", "北京"])
def test_a_non_ascii_enum_or_const_string_may_be_written_as_it_is(value):
    """enum/const strings are taken only as json.dumps writes them (ensure_ascii: '"\\u00e9"'), while a pattern's
    strings and other keys are taken only raw; xgrammar writes enum values raw (picojson's serialize). A model that
    writes '"北京"' is refused at its first byte."""
    for schema in ({"enum": [value, "x"]}, {"const": value}):
        assert matches(json_grammar(schema), json.dumps(value, ensure_ascii=False)), schema


@pytest.mark.parametrize("grammar", ['start: "yes" | "no"', '?start: answer\nanswer: "yes"\n      | "no"'])
def test_a_lark_grammar_is_refused_naming_lark(grammar):
    """vLLM converts a grammar that looks like Lark; this server refuses it, saying so, not as a malformed rule."""
    with pytest.raises(GrammarError, match="a Lark grammar"):
        ebnf_grammar(grammar)
    with pytest.raises(GrammarError) as refused:
        ebnf_grammar('root ::= "a"\nstart: "b"')  # GBNF with a stray line: refused as GBNF
    assert "Lark" not in str(refused.value)
