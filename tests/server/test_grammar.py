"""The byte-level grammars of guided decoding, held to what json.dumps writes, what a schema admits and what
re.fullmatch says."""

from __future__ import annotations

import itertools
import json
import random
import re
from decimal import Decimal
from typing import Any

import pytest

import server.grammar
from server.grammar import MAX_DEPTH, MAX_WHITESPACE, Grammar, GrammarError
from server.grammar_regex import choice_grammar, regex_grammar
from server.grammar_schema import json_grammar


def matches(grammar: Grammar, text: str | bytes) -> bool:
    """Whether the whole text is a complete match."""
    state = grammar.feed(grammar.initial, text.encode() if isinstance(text, str) else text)
    return state is not None and grammar.accepts(state)


def refused_at(grammar: Grammar, data: bytes) -> int | None:
    """The offset of the first byte the grammar refuses; None where it takes them all."""
    state = grammar.initial
    for offset, byte in enumerate(data):
        state = grammar.step(state, byte)
        if state is None:
            return offset
    return None


DOCUMENTS: list[dict[str, Any]] = [
    {},
    {"a": 1},
    {"name": "Zoë", "emoji": "🙂", "cjk": "日本語", "quote": 'say "hi" \\ / ', "controls": "\n\t\r\b\f\x00\x1f\x7f"},
    {"numbers": [0, -0, 7, -12, 3.25, -0.5, 1e-07, 6.02e23, 1.5e300, 10**30], "flags": [True, False, None]},
    {"nested": {"list": [[], {}, [{"deep": [1, [2, [3, {"x": []}]]]}]], "empty": ""}},
    {"/slash": "a/b", "": "the empty key", "a\u2028b": "line separator"},
]
STYLES: list[dict[str, Any]] = [
    {},
    {"ensure_ascii": False},
    {"separators": (",", ":")},
    {"indent": 2},
    {"indent": "\t", "sort_keys": True, "ensure_ascii": False},
]


@pytest.mark.parametrize("style", STYLES)
def test_any_object_takes_what_json_dumps_writes(style):
    """Objects as json.dumps writes them in each style (escapes, non-ASCII, every number form, nesting, indents)."""
    grammar = json_grammar(None)
    for document in DOCUMENTS:
        assert matches(grammar, json.dumps(document, **style)), (document, style)


def test_any_object_takes_every_number_form_and_whitespace_inside_the_document():
    """Number forms json.dumps never writes, whitespace in every place inside a document JSON allows it, and every
    escape; none before or after the document, which a model could spend its tokens on."""
    grammar = json_grammar(None)
    assert matches(grammar, '{"e": [1E+3, 0.0e0, -0, 2E5, 1e-0, 10.25E-12, -7]}')
    assert matches(grammar, '{ \t\r\n"a" : [ 1 , 2 ] , "b" :{ } }')
    assert refused_at(grammar, b" {}") == 0 and refused_at(grammar, b"{}\n") == 2
    assert matches(grammar, '{"u": "\\u00E9\\u00e9\\/\\b\\f\\n\\r\\t\\"\\\\"}')


@pytest.mark.parametrize("text", ["[1]", '"object"', "3", "null", "true"])
def test_any_object_refuses_other_values_which_any_value_takes(text):
    """json_object mode wants an object at the top; any-value mode takes the same text."""
    assert refused_at(json_grammar(None), text.encode()) == 0
    assert matches(json_grammar(True), text)


MALFORMED = [
    (b'{"a": 0', b"1}"),  # a leading zero
    (b'{"a": 1, ', b"}"),  # a trailing comma in an object
    (b"[1, 2, ", b"]"),  # a trailing comma in an array
    (b"{", b"'a': 1}"),  # single quotes
    (b'{"a', b'\x01": 1}'),  # an unescaped control character
    (b'{"a', b'\n": 1}'),
    (b'{"a', b'\x1f": 1}'),
    (b'{"', b'\xff": 1}'),  # not a UTF-8 lead byte
    (b'{"', b'\xc0\xaf": 1}'),  # an overlong two-byte lead
    (b'{"', b'\x80": 1}'),  # a continuation byte with no lead
    (b'{"\xc3', b'": 1}'),  # a lead byte without its continuation
    (b'{"\xe2\x82', b'x": 1}'),
    (b'{"a": tru', b"x}"),
    (b'{"a": 1.', b"}"),
    (b'{"a": 1e', b"}"),
    (b'{"a": -', b"}"),
    (b'{"a": ', b"+1}"),
    (b'{"a": ', b".5}"),
    (b'{"a": "\\', b'x"}'),  # an unknown escape
    (b'{"a": "\\u12', b'g4"}'),
    (b'{"a" ', b"1}"),  # no colon
    (b'{"a": 1 ', b'"b": 2}'),  # no comma
    (b'{"a": [1', b"}"),  # brackets that do not pair
    (b'{"a": null', b"1}"),
    (b'{"a": 1}', b"}"),  # past the end
    (b'{"a": 1}', b" "),  # whitespace after the document
    (b"{", b"1: 2}"),  # a key that is not a string
]


@pytest.mark.parametrize(("good", "bad"), MALFORMED)
def test_malformed_json_is_refused_at_its_first_wrong_byte(good, bad):
    """The grammar takes the good prefix and refuses the first byte after it, not later."""
    grammar = json_grammar(True)
    assert refused_at(grammar, good + bad) == len(good)


def test_only_a_complete_document_is_accepted():
    """Every proper prefix is alive but incomplete, so an end id is not allowed mid-way."""
    grammar = json_grammar(None)
    text = b'{"a": [1, {"b": null}], "c": "d\xc3\xa9", "e": 12.5e3}'
    states = [grammar.feed(grammar.initial, text[:end]) for end in range(len(text) + 1)]
    assert all(state is not None for state in states)
    assert [grammar.accepts(state) for state in states] == [False] * len(text) + [True]


def test_a_top_level_number_is_complete_after_each_digit_under_any_value():
    """A number may end after any digit, but not after a sign or a point."""
    grammar = json_grammar(True)
    assert matches(grammar, "1") and matches(grammar, "12") and not matches(grammar, "-")
    assert not matches(grammar, "1.") and matches(grammar, "1.5")


def test_whitespace_runs_are_bounded():
    """Each whitespace run inside a document stops at MAX_WHITESPACE bytes, so a model cannot loop on it; a complete
    document can only end."""
    grammar = json_grammar(None)
    run = b" \t\r\n" * (MAX_WHITESPACE // 4)
    assert len(run) == MAX_WHITESPACE
    assert matches(grammar, b"{" + run + b'"a"' + run + b":" + run + b"1" + run + b"}")
    assert refused_at(grammar, b"{" + run + b" }") == 1 + MAX_WHITESPACE
    assert refused_at(grammar, b'{"a": 1,' + run + b' "b": 2}') == len(b'{"a": 1,') + MAX_WHITESPACE
    complete = grammar.feed(grammar.initial, b"{}")
    assert grammar.accepts(complete) and not grammar.can_continue(complete)


def test_values_nest_at_most_max_depth_deep():
    """MAX_DEPTH nested containers are taken and the next opening bracket is refused."""
    any_value = json_grammar(True)
    assert matches(any_value, "[" * MAX_DEPTH + "]" * MAX_DEPTH)
    assert refused_at(any_value, b"[" * (MAX_DEPTH + 1)) == MAX_DEPTH
    any_object = json_grammar(None)
    opened = '{"a": ' * MAX_DEPTH
    assert matches(any_object, opened + "1" + "}" * MAX_DEPTH)
    assert refused_at(any_object, (opened + "{").encode()) == len(opened)


def test_a_state_repeats_where_the_match_does_and_steps_are_cached():
    """Inside a string the state after each whole character is the same object, which the mask cache relies on."""
    grammar = json_grammar(True)
    inside = grammar.feed(grammar.initial, b'"a')
    assert grammar.feed(inside, b"bc\xc3\xa9") is inside  # the same interned state after each character
    assert grammar.step(inside, ord("x")) is grammar.step(inside, ord("x"))
    assert grammar.feed(inside, b"\xc3") is not inside  # inside a character: not the same place


def test_a_full_step_cache_forgets_old_steps_without_changing_a_match(monkeypatch):
    """A step cache far smaller than a document's states evicts entries but matches the same."""
    monkeypatch.setattr(server.grammar, "STEP_CACHE_STATES", 3)
    grammar = json_grammar(None)
    for document in DOCUMENTS:
        assert matches(grammar, json.dumps(document, indent=2))
    assert not matches(grammar, b'{"a": 01}')
    assert len(grammar._steps) <= 3


# A realistic schema: strings bounded and patterned, an integer, an enum of mixed values, an array of objects with
# an optional number, a nullable string, a recursive tree through $ref, and optional properties.
SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "Person",
    "$defs": {
        "node": {
            "type": "object",
            "properties": {
                "label": {"type": "string", "maxLength": 8},
                "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 3},
            },
            "required": ["label"],
        }
    },
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12, "description": "a display name"},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "user", None, 3, {"custom": [1, "x"]}]},
        "code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{3}$"},
        "tags": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"key": {"type": "string"}, "weight": {"type": "number"}},
                "required": ["key"],
            },
            "minItems": 1,
            "maxItems": 3,
        },
        "nickname": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None},
        "tree": {"$ref": "#/$defs/node"},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "code", "tags"],
}
TEXT_ALPHABET = 'abXZ09 "\\/\n\té日🙂\x01'


def random_text(rng: random.Random, least: int, most: int) -> str:
    """A string of least to most characters, escapes and non-ASCII ones among them."""
    return "".join(rng.choice(TEXT_ALPHABET) for _ in range(rng.randint(least, most)))


def random_node(rng: random.Random, depth: int) -> dict[str, Any]:
    """A random tree node of the schema's $defs."""
    node: dict[str, Any] = {"label": random_text(rng, 0, 8)}
    if depth < 3 and rng.random() < 0.6:
        node["children"] = [random_node(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return node


def random_person(rng: random.Random) -> dict[str, Any]:
    """A random instance of SCHEMA, its optional properties each left out at random, in the schema's order."""
    number = rng.choice([rng.randint(-100, 100), rng.uniform(-1e6, 1e6), rng.random() * 1e-9, 1e300])
    values = {
        "name": random_text(rng, 1, 12),
        "age": rng.choice([0, -7, rng.randint(-(10**20), 10**20)]),
        "role": rng.choice(SCHEMA["properties"]["role"]["enum"]),
        "code": "".join(rng.choice("ABCZ") for _ in range(2)) + "-" + str(rng.randint(100, 999)),
        "tags": [
            {"key": random_text(rng, 0, 5), **({"weight": number} if rng.random() < 0.5 else {})}
            for _ in range(rng.randint(1, 3))
        ],
        "nickname": rng.choice([None, random_text(rng, 0, 20)]),
        "tree": random_node(rng, 0),
        "active": rng.random() < 0.5,
    }
    required = SCHEMA["required"]
    return {name: value for name, value in values.items() if name in required or rng.random() < 0.5}


def test_random_instances_of_a_realistic_schema_are_accepted():
    """Random instances of SCHEMA, optional properties left out at random, escapes and non-ASCII in strings."""
    grammar = json_grammar(SCHEMA)
    rng = random.Random(7)
    for _ in range(150):
        person = random_person(rng)
        assert matches(grammar, json.dumps(person, ensure_ascii=rng.random() < 0.5)), person


BASE_PERSON: dict[str, Any] = {
    "name": "Ada",
    "age": 36,
    "role": {"custom": [1, "x"]},
    "code": "AB-123",
    "tags": [{"key": "math", "weight": 1.5}],
    "tree": {"label": "root", "children": [{"label": "leaf"}]},
}


def changed(**changes: Any) -> dict[str, Any]:
    """BASE_PERSON with some properties replaced (None as a value: left out)."""
    person = dict(BASE_PERSON)
    for name, value in changes.items():
        if value is None:
            del person[name]
        else:
            person[name] = value
    return person


VIOLATIONS = {
    "missing required key": changed(age=None),
    "extra key": {**BASE_PERSON, "extra": 1},
    "integer as a string": changed(age="36"),
    "integer with a fraction": changed(age=36.5),
    "integer with an exponent": changed(age=3e8),
    "boolean as a string": {**BASE_PERSON, "active": "yes"},
    "wrong order": {"age": 36, **changed(age=None)},
    "too many items": changed(tags=[{"key": "k"}] * 4),
    "too few items": changed(tags=[]),
    "item missing its required key": changed(tags=[{"weight": 1}]),
    "string too long": changed(name="abcdefghijklm"),
    "string too short": changed(name=""),
    "pattern with lowercase": changed(code="ab-123"),
    "pattern too short": changed(code="AB-12"),
    "pattern too long": changed(code="AB-1234"),
    "not in the enum": changed(role="root"),
    "enum object written otherwise": changed(role={"custom": [1, "y"]}),
    "nullable string as a number": {**BASE_PERSON, "nickname": 5},
    "tree node without a label": changed(tree={"label": "r", "children": [{"children": []}]}),
    "tree label too long": changed(tree={"label": "r", "children": [{"label": "123456789"}]}),
    "tree with too many children": changed(tree={"label": "r", "children": [{"label": "c"}] * 4}),
}


def test_the_base_instance_of_the_violations_is_accepted():
    """BASE_PERSON is valid, so each violation fails for its change alone."""
    assert matches(json_grammar(SCHEMA), json.dumps(BASE_PERSON))


@pytest.mark.parametrize("name", VIOLATIONS)
def test_a_document_violating_the_realistic_schema_is_refused(name):
    """One change that breaks the schema makes the whole document fail."""
    assert not matches(json_grammar(SCHEMA), json.dumps(VIOLATIONS[name]))


def test_enum_and_const_values_are_written_as_json_dumps_writes_them():
    """Constants take json.dumps's own spacing and escapes, or its non-ASCII characters as they are (as xgrammar
    writes them), no other spelling."""
    grammar = json_grammar({"enum": [{"a": [1, 2]}, "é", 1.5]})
    assert matches(grammar, '{"a": [1, 2]}') and matches(grammar, '"\\u00e9"') and matches(grammar, "1.5")
    assert matches(grammar, '"é"') and not matches(grammar, '"\\u00E9"')
    assert not matches(grammar, '{"a":[1,2]}') and not matches(grammar, "1.50")
    const = json_grammar({"const": None})
    assert matches(const, "null") and not matches(const, "nul")


def test_enum_values_are_those_of_the_declared_type():
    """An enum value of another type than `type` names is left out."""
    grammar = json_grammar({"type": "string", "enum": ["a", 1, None, "b"]})
    assert matches(grammar, '"a"') and matches(grammar, '"b"')
    assert not matches(grammar, "1") and not matches(grammar, "null")


def test_keys_are_written_as_json_dumps_writes_the_property_names():
    """A property name needing escapes is written as json.dumps escapes it."""
    grammar = json_grammar({"properties": {'say "hi"': {}, "é": {}}, "required": ['say "hi"', "é"]})
    assert matches(grammar, json.dumps({'say "hi"': 1, "é": 2}))
    assert not matches(grammar, json.dumps({'say "hi"': 1, "é": 2}, ensure_ascii=False))


def test_optional_properties_may_be_left_out_but_keep_their_order():
    """Optional properties may go missing; the required one may not; none may move or repeat."""
    grammar = json_grammar({"type": "object", "properties": {"a": {}, "b": {}, "c": {}}, "required": ["b"]})
    for present in (["b"], ["a", "b"], ["b", "c"], ["a", "b", "c"]):
        assert matches(grammar, json.dumps(dict.fromkeys(present, 1)))
    for present in ([], ["a"], ["c", "b"], ["b", "a"], ["a", "b", "b"]):
        text = "{" + ", ".join(f'"{name}": 1' for name in present) + "}"
        assert not matches(grammar, text), text
    all_optional = json_grammar({"properties": {"a": {}, "b": {}}})
    assert matches(all_optional, "{ }") and matches(all_optional, '{"b": 2}') and not matches(all_optional, '{"b": 2,}')


def test_additional_properties_without_properties():
    """Without properties: values of a schema, no keys at all, or any object."""
    values = json_grammar({"type": "object", "additionalProperties": {"type": "integer"}})
    assert matches(values, '{"x": 1, "y": -2}') and matches(values, "{}")
    assert not matches(values, '{"x": "1"}')
    none = json_grammar({"type": "object", "additionalProperties": False})
    assert matches(none, "{ }") and not matches(none, '{"x": 1}')
    any_object = json_grammar({"type": "object"})
    assert matches(any_object, '{"x": [1, {"y": null}]}') and not matches(any_object, "[]")


@pytest.mark.parametrize("schema", [True, {}, {"description": "anything"}])
def test_a_schema_that_constrains_nothing_takes_any_value(schema):
    """True, {} and a schema of annotations alone take any JSON value."""
    grammar = json_grammar(schema)
    for text in ["1", '"x"', "[]", '{"a": [null, true]}', "-0.5e-3"]:
        assert matches(grammar, text)


def test_types_and_their_keywords():
    """A list of types, integer against number, and a type implied by its keywords."""
    nullable = json_grammar({"type": ["string", "null"], "maxLength": 1})
    assert matches(nullable, '"a"') and matches(nullable, "null")
    assert not matches(nullable, '"ab"') and not matches(nullable, "1")
    integer = json_grammar({"type": "integer"})
    assert matches(integer, "-12") and not matches(integer, "1.0") and not matches(integer, "1e3")
    number = json_grammar({"type": "number"})
    assert matches(number, "1.0") and matches(number, "1e3") and not matches(number, '"1"')
    inferred = json_grammar({"items": {"type": "boolean"}, "maxItems": 2})  # array keywords: an array
    assert matches(inferred, "[true, false]") and not matches(inferred, "[true, true, true]")
    assert not matches(inferred, "{}")


def test_string_lengths_count_characters_whatever_their_encoding():
    """An escape, a \\u escape, a surrogate pair and a multi-byte character each count as one character."""
    grammar = json_grammar({"type": "string", "minLength": 2, "maxLength": 2})
    for text in ["é\n", "🙂a", '"\\']:
        assert matches(grammar, json.dumps(text)) and matches(grammar, json.dumps(text, ensure_ascii=False))
    assert matches(grammar, '"\\u00e9\\u00E9"')
    for text in ["a", "abc", "🙂🙂🙂"]:
        assert not matches(grammar, json.dumps(text)) and not matches(grammar, json.dumps(text, ensure_ascii=False))


def test_a_surrogate_escape_must_be_half_of_a_pair():
    """A high surrogate escape needs a low one after it; a lone one of either is refused."""
    grammar = json_grammar({"type": "string"})
    assert matches(grammar, '"\\ud83d\\ude42"') and matches(grammar, '"\\uD7FF\\uE000"')
    assert not matches(grammar, '"\\ud83d"') and not matches(grammar, '"\\ude42"')
    assert not matches(grammar, '"\\ud83d\\u0041"')


def test_compositions_and_references():
    """allOf of one schema, oneOf as anyOf, recursion to the root and to a definition named with ~1."""
    assert matches(json_grammar({"allOf": [{"type": "integer"}]}), "3")
    assert not matches(json_grammar({"allOf": [{"type": "integer"}]}), '"3"')
    one_of = json_grammar({"oneOf": [{"type": "integer"}, {"const": "x"}]})
    assert matches(one_of, "3") and matches(one_of, '"x"') and not matches(one_of, '"y"')
    chain = {
        "type": "object",
        "properties": {"next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
        "required": ["next"],
    }
    assert matches(json_grammar(chain), '{"next": ' * 5 + "null" + "}" * 5)
    assert not matches(json_grammar(chain), '{"next": {}}')
    old_style = {"definitions": {"a/b": {"type": "boolean"}}, "$ref": "#/definitions/a~1b"}
    assert matches(json_grammar(old_style), "true") and not matches(json_grammar(old_style), "1")


def test_a_grammar_that_admits_no_complete_output_is_refused():
    """A schema or pattern with no finite match is refused when compiled rather than leading a model nowhere."""
    endless = {"type": "object", "properties": {"child": {"$ref": "#"}}, "required": ["child"]}
    for schema in (endless, {"$ref": "#"}, {"type": "string", "pattern": "[^\\s\\S]"}):
        with pytest.raises(GrammarError, match="admits no complete output") as caught:
            json_grammar(schema)
        assert caught.value.where == ""
    with pytest.raises(GrammarError) as caught:
        regex_grammar(r"[^\s\S]")
    assert caught.value.where == "pattern"


def test_a_branch_that_cannot_finish_is_never_entered():
    """An alternative that could never complete is pruned, so its first byte is refused."""
    endless = {"type": "object", "properties": {"child": {"$ref": "#/$defs/endless"}}, "required": ["child"]}
    grammar = json_grammar({"$defs": {"endless": endless}, "anyOf": [{"$ref": "#/$defs/endless"}, {"type": "null"}]})
    assert matches(grammar, "null") and refused_at(grammar, b'{"child": ') == 0
    assert refused_at(regex_grammar(r"a|[^\s\S]b"), b"b") == 0


def test_left_recursion_with_a_way_out_matches():
    """A schema that refers to itself before any byte still matches through its other branch."""
    grammar = json_grammar({"anyOf": [{"$ref": "#"}, {"type": "null"}]})
    assert matches(grammar, "null") and not matches(grammar, "1")


def test_a_string_pattern_matches_the_content_as_re_fullmatch_does():
    """A pattern holds against the decoded content, whose quote, backslash and control characters are escaped."""
    rng = random.Random(3)
    alphabet = 'a"\\\nz9 é\x01'
    for pattern in [r'[a"\\]+', r".{0,3}", r"[^a-z]*", r"\w+\s?\d*", r"é+|z\n?", r'(a|")\\?']:
        grammar = json_grammar({"type": "string", "pattern": pattern})
        outcomes = set()
        for _ in range(300):
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 4)))
            expected = re.fullmatch(pattern, text, re.ASCII) is not None
            assert matches(grammar, json.dumps(text, ensure_ascii=False)) == expected, (pattern, text)
            outcomes.add(expected)
        assert outcomes == {True, False}, pattern


@pytest.mark.parametrize(
    ("pattern", "least", "most"),
    [
        (r"[a-z]+", 2, 5),
        (r'[a"\\]*', 1, 3),
        (r"(ab|a)*z?", 0, 4),
        (r"é+|z\n?", 2, None),
        (r"\w{2,6}", None, 3),
        (r".{0,3}9", 3, 3),
        (r"(a|\x01)(a|b)*", 4, None),
        (r'(?!a|"$)[a"\\]*', 1, 3),
        (r"(?=.*z)(?=.*\d).+", 3, 5),
    ],
)
def test_a_pattern_with_lengths_takes_its_matches_of_those_lengths_only(pattern, least, most):
    """minLength and maxLength beside a pattern (pydantic's constr) count the decoded characters of its matches."""
    schema = {"type": "string", "pattern": pattern} | {
        key: value for key, value in (("minLength", least), ("maxLength", most)) if value is not None
    }
    grammar = json_grammar(schema)
    rng = random.Random(5)
    alphabet = 'ab"\\\nz9 é\x01'
    outcomes = set()
    for _ in range(600):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 7)))
        if rng.random() < 0.5:  # often a match of the pattern, which random text seldom is
            text = "".join(rng.choice("abzé\n") for _ in range(rng.randint(0, 7)))
        expected = re.fullmatch(pattern, text, re.ASCII) is not None and (least or 0) <= len(text) <= (most or 99)
        assert matches(grammar, json.dumps(text, ensure_ascii=False)) == expected, (pattern, text)
        outcomes.add(expected)
    assert outcomes == {True, False}, pattern


def test_a_pydantic_constr_with_lengths_and_a_pattern_is_guided():
    from pydantic import BaseModel, constr

    class Code(BaseModel):
        code: constr(min_length=2, max_length=4, pattern=r"^[a-z]+$")  # type: ignore[valid-type]

    grammar = json_grammar(Code.model_json_schema())
    assert matches(grammar, Code(code="abc").model_dump_json())
    assert refused_at(grammar, b'{"code":"abcde') == len(b'{"code":"abcd')
    assert refused_at(grammar, b'{"code":"a"') == len(b'{"code":"a')


def test_a_pydantic_http_url_is_guided_to_its_2083_characters():
    """pydantic writes HttpUrl as a string of 1 to 2083 characters (its uri format is an annotation)."""
    from pydantic import BaseModel, HttpUrl

    class Link(BaseModel):
        url: HttpUrl

    grammar = json_grammar(Link.model_json_schema())
    longest = b'{"url":"' + b"u" * 2083
    assert matches(grammar, longest + b'"}') and refused_at(grammar, longest + b"u") == len(longest)
    assert not matches(grammar, b'{"url":""}')


def test_long_strings_of_the_same_lengths_share_a_routine_so_many_fit():
    """Six HttpUrl fields fit (five, each string laid out apart, were too large), each still bounded."""
    from pydantic import BaseModel, HttpUrl

    class Links(BaseModel):
        a: HttpUrl
        b: HttpUrl
        c: HttpUrl
        d: HttpUrl
        e: HttpUrl
        f: HttpUrl

    grammar = json_grammar(Links.model_json_schema())
    links = {name: "u" * (2083 if name == "c" else 5) for name in "abcdef"}
    assert matches(grammar, json.dumps(links, separators=(",", ":")))
    opened = b'{"a":"uuuuu","b":"uuuuu","c":"'
    assert refused_at(grammar, opened + b"u" * 2084) == len(opened) + 2083


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "integer", "multipleOf": 5},
        {"type": "number", "multipleOf": 3, "minimum": -7, "maximum": 20},
        {"type": "integer", "multipleOf": 7.0, "exclusiveMinimum": 0, "exclusiveMaximum": 70},
        {"multipleOf": 1, "maximum": -250},
        {"type": "integer", "multipleOf": 12, "minimum": 13, "maximum": 300},
    ],
)
def test_multiple_of_a_whole_number_takes_its_multiples_within_the_bounds_written_as_integers(schema):
    """Every integer from -400 to 400 is taken exactly when it is a multiple in the bounds; other forms of a multiple
    (a fraction, an exponent, a leading zero) are not."""
    grammar = json_grammar(schema)
    step = int(schema["multipleOf"])
    low = schema.get("minimum", schema.get("exclusiveMinimum", -(10**9)) + ("exclusiveMinimum" in schema))
    high = schema.get("maximum", schema.get("exclusiveMaximum", 10**9) - ("exclusiveMaximum" in schema))
    for number in range(-400, 401):
        assert matches(grammar, str(number)) == (number % step == 0 and low <= number <= high), number
    assert not any(matches(grammar, text) for text in ("12.0", "1.2e1", "012", "-0"))


def test_multiple_of_that_cannot_be_honoured_is_refused_naming_it():
    for step in (0.1234, 1e-41, 0, -3, True, "5", 1001, 5000, float("inf"), 10**400, 10**5000):
        with pytest.raises(GrammarError) as refused:
            json_grammar({"type": "integer", "multipleOf": step})
        assert refused.value.where == "/multipleOf", step
    from pydantic import BaseModel, conint

    class Box(BaseModel):
        count: conint(multiple_of=4, ge=0)  # type: ignore[valid-type]

    grammar = json_grammar(Box.model_json_schema())
    assert matches(grammar, '{"count":12}') and not matches(grammar, '{"count":10}')
    assert not matches(grammar, '{"count":-4}')


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "number", "multipleOf": 0.25},
        {"type": "number", "multipleOf": 0.01, "minimum": -1.5, "exclusiveMaximum": 2},
        {"type": "number", "multipleOf": 1.5, "exclusiveMinimum": -3},
        {"multipleOf": 0.3, "maximum": 2.7},
        {"type": "integer", "multipleOf": 0.5, "minimum": -2},
    ],
)
def test_multiple_of_a_fraction_takes_its_multiples_within_the_bounds_with_no_more_fraction_digits(schema):
    """Every number from -3 to 3 written with 0 to 3 fraction digits is taken exactly when it is a decimal multiple
    of multipleOf within the bounds and has at most the fraction digits multipleOf has; no exponent."""
    grammar = json_grammar(schema)
    step = Decimal(str(schema["multipleOf"]))
    places = max(-step.as_tuple().exponent, 0)
    low = Decimal(str(schema.get("minimum", schema.get("exclusiveMinimum", -100))))
    high = Decimal(str(schema.get("maximum", schema.get("exclusiveMaximum", 100))))
    for written in range(4):
        for units in range(-3 * 10**written, 3 * 10**written + 1):
            value = Decimal(units).scaleb(-written)
            text = f"{value:.{written}f}"
            expected = (
                value % step == 0
                and written <= places
                and (low < value if "exclusiveMinimum" in schema else low <= value)
                and (value < high if "exclusiveMaximum" in schema else value <= high)
                and (written == 0 or schema.get("type") != "integer")
            )
            assert matches(grammar, text) == expected, text
    assert not any(matches(grammar, text) for text in ("1.5e0", "15E-1", "01.5", ".5", "-0.0"))


def test_a_pydantic_float_multiple_of_a_fraction_is_guided():
    """pydantic's float with multiple_of: its dumps are taken, and what is taken validates."""
    from typing import Annotated

    from pydantic import BaseModel, Field

    class Reading(BaseModel):
        value: Annotated[float, Field(multiple_of=0.1, ge=0, le=1)]

    grammar = json_grammar(Reading.model_json_schema())
    for tenths in range(11):
        text = Reading(value=tenths / 10).model_dump_json()
        assert matches(grammar, text) and Reading.model_validate_json(text).value == tenths / 10, text
    for bad in ('{"value":0.05}', '{"value":1.1}', '{"value":-0.1}', '{"value":1e-1}'):
        assert not matches(grammar, bad), bad


def test_a_pydantic_decimal_is_guided_as_a_number_or_a_decimal_string():
    """pydantic writes a Decimal as a number or a string whose pattern opens with a negative lookahead."""
    from pydantic import BaseModel

    class Price(BaseModel):
        amount: Decimal

    grammar = json_grammar(Price.model_json_schema())
    for good in ('{"amount":12.5}', '{"amount":"12.50"}', '{"amount":"-0.5"}', '{"amount":".5"}'):
        assert matches(grammar, good), good
    for bad in ('{"amount":""}', '{"amount":"+."}', '{"amount":"-"}', '{"amount":"1e3"}'):
        assert not matches(grammar, bad), bad


def test_a_pydantic_condecimal_is_guided_as_a_number_or_a_string_of_its_digits():
    """pydantic writes condecimal(max_digits, decimal_places) as a number or a string whose pattern holds a lookahead
    inside a group: the strings taken are those pydantic validates."""
    from pydantic import BaseModel, ValidationError, condecimal

    class Price(BaseModel):
        amount: condecimal(max_digits=5, decimal_places=2)  # type: ignore[valid-type]

    grammar = json_grammar(Price.model_json_schema())
    for text in ("123.45", "1234.5", "12.345", "-0012.50", "123", "1234", "+.5", ".", "0.1", "99999"):
        document = json.dumps({"amount": text})
        try:
            Price.model_validate_json(document)
            valid = True
        except ValidationError:
            valid = False
        assert matches(grammar, document) == valid, text


def test_a_string_pattern_takes_non_ascii_characters_as_they_are_only():
    """In a patterned string a non-ASCII character is written as itself, never as a \\u escape."""
    grammar = json_grammar({"type": "string", "pattern": "é"})
    assert matches(grammar, '"é"') and not matches(grammar, '"\\u00e9"')


UNSUPPORTED = [
    "not",
    "if",
    "then",
    "else",
    "contains",
    "dependentRequired",
    "unevaluatedProperties",
    "x-unknown",
]


@pytest.mark.parametrize("keyword", UNSUPPORTED)
def test_an_unsupported_keyword_is_refused_with_its_pointer(keyword):
    """Each keyword outside the subset is refused, naming its JSON pointer."""
    schema = {"type": "object", "properties": {"age": {"type": "integer", keyword: 1}}}
    with pytest.raises(GrammarError, match=f"'{keyword}' is not supported in guided decoding") as caught:
        json_grammar(schema)
    assert caught.value.where == f"/properties/age/{keyword}"


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"properties": {"a/b~c": {"multipleOf": 0.1234}}}, "/properties/a~1b~0c/multipleOf"),
        (
            {"$defs": {"n": {"items": {"anyOf": [{}, {"multipleOf": 0.1234}]}}}, "$ref": "#/$defs/n"},
            "/$defs/n/items/anyOf/1/multipleOf",
        ),
        (
            {"type": "array", "items": {"type": "string", "contentEncoding": "base64"}, "minItems": 2},
            "/items/contentEncoding",
        ),
    ],
)
def test_an_unsupported_keyword_deep_in_a_schema_is_refused_with_its_pointer(schema, where):
    """The pointer escapes ~ and /, and reaches into definitions, lists of schemas and items."""
    with pytest.raises(GrammarError) as caught:
        json_grammar(schema)
    assert caught.value.where == where


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        (False, ""),
        ("a schema", ""),
        ({"properties": {"a": 3}}, "/properties/a"),
        ({"properties": {"a": False}, "required": ["a"]}, "/properties/a"),
        ({"type": "strin"}, "/type"),
        ({"type": ["string", "float"]}, "/type/1"),
        ({"properties": {"a": {}}, "required": ["a", "b"]}, "/required/1"),
        ({"type": "object", "required": ["a"]}, "/required"),
        ({"$ref": "#/$defs/missing"}, "/$ref"),
        ({"$ref": "https://example.com/schema.json"}, "/$ref"),
        ({"allOf": []}, "/allOf"),
        ({"anyOf": []}, "/anyOf"),
        ({"anyOf": [{"type": "string"}], "minLength": 2}, "/minLength"),
        ({"$ref": "#", "type": "string"}, "/type"),
        ({"enum": ["a"], "maxLength": 3}, "/maxLength"),
        ({"enum": []}, "/enum"),
        ({"type": "string", "enum": [1, 2]}, "/enum"),
        ({"type": "string", "pattern": "(a"}, "/pattern"),
        ({"type": "string", "pattern": "a", "minLength": 3, "maxLength": 2}, "/minLength"),
        ({"type": "string", "pattern": "(a|b)*c{0,500}", "maxLength": 1000}, "/maxLength"),
        ({"type": "string", "pattern": "(?!a)(?:a{1000}){1000}"}, "/pattern"),
        ({"type": "string", "pattern": "(?:a{1000}){1000}", "maxLength": 1000}, "/pattern"),
        ({"type": "string", "minLength": 3, "maxLength": 2}, "/minLength"),
        ({"type": "array", "maxItems": 1001}, "/maxItems"),
        ({"type": "string", "maxLength": 4097}, "/maxLength"),
        ({"type": "integer", "minimum": 10**309}, "/minimum"),  # no float holds it
        ({"type": "integer", "maximum": -(10**5000)}, "/maximum"),  # str() cannot write it
        ({"type": "number", "multipleOf": 0.5, "minimum": 0.1, "maximum": 0.4}, "/multipleOf"),  # no multiple within
        ({"type": "array", "minItems": -1}, "/minItems"),
        ({"properties": {"tree": {"$ref": "#/$defs/n"}}, "$defs": {"n": {"type": "nothing"}}}, "/$defs/n/type"),
    ],
)
def test_a_schema_that_cannot_be_compiled_is_refused_naming_the_part_at_fault(schema, where):
    """Schemas of the wrong shape or combining keywords the subset cannot honour together."""
    with pytest.raises(GrammarError) as caught:
        json_grammar(schema)
    assert caught.value.where == where


REGEX_CASES = [
    (r"[a-z]{2,6}-[0-9]{2}", "az-09", ["ab-12", "abcdef-99", "abcdefg-99"]),
    (r"(ab|a)*b?", "ab", []),
    (r"a{2}|b{1,}|c{,2}", "abc", []),
    (r"^\d+(\.\d+)?$", "0.1", ["3.14159", "10.0"]),
    (r"[^abc]x", "abcxé", []),
    (r"\w+\s\W", "a_ !é\n", []),
    (r".+", "a\né", []),
    (r"(?:x|y)(?P<n>z+)(?<m>q?)", "xyzq", []),
    (r"[\d\-.]+", "1-.a", []),
    (r"\u00e9\x41+", "éA", []),
    (r"[]a]+", "]a[", []),
    (r"a+?b*?", "ab", []),
    (r"(a|)+b", "ab", []),
    (r"🙂{2}|日本", "🙂日本", []),
    (r"[\t\n ]*\/\\", "\t\n /\\", []),
    (r"\S\D\s", "a1 é", []),
    (r"(a|b)*a(a|b){3}", "ab", []),
    (r"", "a", []),
    (r"[é-ÿ]+x|[^éa]", "éÿxaā日", []),
    (r"[\u4e00-\u9fff]{2}[^\u0100-\uffff]", "日本a🙂ā", []),
    (r"[a-zé🙂]+", "aé🙂ü", []),
    (r"(?!a)\w+", "ab1", []),
    (r"(?!ab$)[ab]+", "ab", []),
    (r"^(?!^[-+.]*$)[+-]?0*\d*\.?\d*$", "+-.01", ["-0012.50", "+.5", "1."]),  # pydantic's Decimal
    (r"(?!a)(?!bb)[abc]*", "abc", []),
    (r"(?!é|🙂$)[^x]+", "é🙂ax", []),
    (r"(?!(a|b)$)(?:[ab]|é)+", "abé", []),
    (r"(?!a)b|a", "ab", []),  # a lookahead guards its own option only
    (r"(?!a)a|ab", "ab", []),
    (r"b|(?!a)[ab]+", "ab", []),
    (r"(?!a$)[a\n]*", "a\n", []),  # '$' in a lookahead also matches before a newline that ends the string
    (r"(?=.*[A-Z])(?=.*\d)[A-Za-z\d]{3,5}", "aA1", ["Ab1", "abc1"]),  # positive lookaheads: a password's rules
    (r"(?=ab$|b)[ab]{0,3}", "ab", []),  # a requirement's options: a whole match or a beginning
    (r"(?!a)(?=.*b)[abc]{1,4}", "abc", []),
    (r"(?=a*$)[ab]*|c", "abc", []),  # a requirement guards its own option only
    (r"(?=)x?|(?=[ab]{2})(?!ab)[abc]*", "abcx", []),
    (r"(?=.*\n$)[a\n]{1,3}", "a\n", []),
    (r"a(?=b)[ab]*", "ab", []),  # lookaheads inside: the rest of the string from where they stand
    (r"(?:a|(?=b.$)[ab]+)c?", "abc", []),
    (r"x?(?!ab)[ab]{0,3}", "abx", []),
    (r"[ab](?=[ab]*$)(?!.*bb)[ab]*", "ab.", []),
    (r"(a$)|b$|(?:c|a(?!b)$)", "abc", []),  # '$' where a match ends: before groups' ')'s, then a '|' or the end
    (r"^(?!^[-+.]*$)[+-]?0*(?:\d{0,3}|(?=[\d.]{1,6}0*$)\d{0,3}\.\d{0,2}0*$)", "01.-", ["-0012.50", "123.45"]),
]


@pytest.mark.parametrize(("pattern", "alphabet", "extra"), REGEX_CASES)
def test_a_regex_matches_what_re_fullmatch_matches(pattern, alphabet, extra):
    """Every short string over the alphabet, and some longer ones, match exactly where re.fullmatch (re.ASCII) does."""
    grammar = regex_grammar(pattern)
    pattern = pattern.replace("(?<", "(?P<")  # Python's re spells a named group (?P<name>...) only
    texts = ["".join(chars) for length in range(6) for chars in itertools.product(alphabet, repeat=length)]
    outcomes = set()
    for text in [*texts[:3000], *extra]:
        expected = re.fullmatch(pattern, text, re.ASCII) is not None
        assert matches(grammar, text) == expected, (pattern, text)
        outcomes.add(expected)
    assert outcomes == {True, False} or pattern == "", pattern


def test_a_regex_matches_bytes_of_whole_characters_only():
    """'.' takes a whole UTF-8 character, never a bad byte or half of one."""
    grammar = regex_grammar(".")
    assert matches(grammar, "é") and matches(grammar, "🙂") and not matches(grammar, "\n")
    assert refused_at(grammar, b"\xff") == 0 and not matches(grammar, b"\xc3")


def test_a_class_of_non_ascii_ranges_takes_well_formed_utf8_of_its_characters_only():
    """A class naming non-ASCII characters takes each whole, in well-formed UTF-8: no other character sharing its
    lead byte, no overlong form, no half of one."""
    grammar = regex_grammar("[é-ÿ\u4e00-\u9fff]")
    assert matches(grammar, "é") and matches(grammar, "ÿ") and matches(grammar, "日")
    assert refused_at(grammar, "À".encode()) == 1 and refused_at(grammar, b"\xc1\xa9") == 0
    assert refused_at(grammar, "ā".encode()) == 0 and not matches(grammar, "é".encode()[:1])
    assert refused_at(grammar, "\u4dff".encode()) == 1
    around_surrogates = regex_grammar("[\ud7ff-\ue000]")
    assert matches(around_surrogates, "\ud7ff") and matches(around_surrogates, "\ue000")
    assert refused_at(around_surrogates, b"\xed\xa0\x80") == 1


@pytest.mark.parametrize(
    "pattern",
    [
        r"(a)\1",
        r"(a$|b)c",
        r"(a$)?",
        r"(?!a",
        r"(?:(?=a)a)*",
        r"(a(?!b))+",
        r"(?=(?=a)a)a",
        r"b(?=^a)a",  # '^' in a lookahead inside: it could match nothing but the start
        r"a(?!^)",
        r"(?<=a)b",
        r"(?<!a)b",
        r"\bword",
        r"(?i)a",
        r"(?P=n)",
        r"a{1001}",
        pytest.param("a{0," + "1" * 4301 + "}", id="a count past int()'s digit limit"),
        r"(a{1000}){1000}",
        pytest.param(r"(?!(a{0,100}){1,100}$)a*", id="a lookahead whose state sets would take minutes to follow"),
        r"a{2,1}",
        r"a**",
        r"a++",
        r"*a",
        r"(a",
        r"a)",
        r"[a",
        r"x^y",
        r"a$b",
        r"a{",
        r"\p{L}",
        "a\\",
        r"[z-a]",
        r"\ud800",
        "a\ud800",
    ],
)
def test_a_regex_outside_the_subset_is_refused(pattern):
    """Back-references, lookarounds, flags, huge or inverted counts and bad syntax."""
    with pytest.raises(GrammarError) as caught:
        regex_grammar(pattern)
    assert caught.value.where == "pattern"


def test_a_choice_is_exactly_one_of_the_strings():
    """A choice matches whole strings only, even where one is a prefix of another."""
    grammar = choice_grammar(["yes", "no", "yesterday", "né"])
    for choice in ["yes", "no", "yesterday", "né"]:
        assert matches(grammar, choice)
    assert not matches(grammar, "ye") and not matches(grammar, "yest") and not matches(grammar, "n")
    assert refused_at(grammar, b"nope") == 2 and refused_at(grammar, b"yes!") == 3
    assert matches(choice_grammar([""]), "") and refused_at(choice_grammar([""]), b"a") == 0


@pytest.mark.parametrize(
    ("choices", "where"), [([], "choice"), (["a", 3], "choice[1]"), ("ab", "choice"), (["a", "b\ud800"], "choice[1]")]
)
def test_a_choice_list_that_cannot_be_compiled_is_refused(choices, where):
    """An empty list, a non-string and a non-list each name the part at fault."""
    with pytest.raises(GrammarError) as caught:
        choice_grammar(choices)
    assert caught.value.where == where


ARRAY_VALUES = [0, "a", True, None]
TUPLE_SCHEMAS: list[tuple[dict[str, Any], list[str | None], str | bool | None, int, int | None]] = [
    # (schema, the prefix's types, the rest's type (True: any, False: none), minItems, maxItems)
    ({"prefixItems": [{"type": "integer"}, {"type": "string"}], "minItems": 2, "maxItems": 2}, ["integer", "string"],
     True, 2, 2),
    ({"prefixItems": [{"type": "integer"}, {"type": "string"}]}, ["integer", "string"], True, 0, None),
    ({"prefixItems": [{"type": "integer"}], "items": {"type": "boolean"}}, ["integer"], "boolean", 0, None),
    ({"prefixItems": [{"type": "integer"}], "items": False, "minItems": 1}, ["integer"], False, 1, None),
    ({"prefixItems": [{}, {"type": "null"}], "items": {"type": "string"}, "minItems": 3, "maxItems": 4}, [None, "null"],
     "string", 3, 4),
    ({"prefixItems": [{"type": "string"}, {"type": "string"}, {"type": "integer"}], "maxItems": 1}, ["string"], False,
     0, 1),
    ({"prefixItems": [], "items": {"type": "integer"}, "minItems": 1}, [], "integer", 1, None),
    ({"prefixItems": [{"type": "integer"}, False]}, ["integer"], False, 0, None),  # no value can be the second
    ({"prefixItems": [{"type": "integer"}, {"uniqueItems": True}], "maxItems": 1}, ["integer"], False, 0, 1),
    ({"prefixItems": [{"type": "null"}], "items": {"uniqueItems": True}, "maxItems": 1}, ["null"], False, 0, 1),
    ({"items": [{"type": "boolean"}, {"type": "integer"}], "additionalItems": False}, ["boolean", "integer"], False, 0,
     None),
    ({"items": [{"type": "boolean"}], "additionalItems": {"type": "null"}}, ["boolean"], "null", 0, None),
    ({"type": "array", "items": [{"type": "string"}]}, ["string"], True, 0, None),
]  # fmt: skip


def admitted(value: Any, type_name: str | bool | None) -> bool:
    """Whether a value has the type (None or True: any type; False: none)."""
    if type_name is None or type_name is True:
        return True
    if type_name is False:
        return False
    return {"integer": type(value) is int, "string": type(value) is str, "boolean": type(value) is bool,
            "null": value is None}[type_name]  # fmt: skip


@pytest.mark.parametrize(("schema", "prefix", "rest", "least", "most"), TUPLE_SCHEMAS)
def test_an_array_follows_prefix_items_in_turn_then_items_as_json_schema_says(schema, prefix, rest, least, most):
    """Every array of up to five items from a small pool, compact and as json.dumps writes it, is taken exactly when
    its first items have the prefix's types in turn, the later ones the rest's, and its length is within bounds."""
    grammar = json_grammar(schema)
    for length in range(6):
        for array in itertools.product(ARRAY_VALUES, repeat=length):
            wanted = least <= length <= (length if most is None else most) and all(
                admitted(value, prefix[index] if index < len(prefix) else rest) for index, value in enumerate(array)
            )
            for text in (json.dumps(list(array)), json.dumps(list(array), separators=(",", ":"))):
                assert matches(grammar, text) == wanted, (schema, text)


def test_a_tuple_field_of_a_pydantic_model_is_guided():
    """pydantic writes a tuple as prefixItems with minItems and maxItems; a model's own JSON is taken, a wrong tuple
    is refused at its first wrong byte."""
    from pydantic import BaseModel

    class Point(BaseModel):
        label: str
        at: tuple[int, float]

    grammar = json_grammar(Point.model_json_schema())
    assert matches(grammar, Point(label="p", at=(3, 0.5)).model_dump_json())
    assert refused_at(grammar, b'{"label":"p","at":[3,0.5,') == len(b'{"label":"p","at":[3,0.5')
    assert refused_at(grammar, b'{"label":"p","at":["') == len(b'{"label":"p","at":[')


def test_a_tagged_union_of_pydantic_models_is_guided_by_its_options():
    """pydantic writes a discriminated union as oneOf with OpenAPI's discriminator, an annotation: each option's const
    tag holds its own fields."""
    from typing import Annotated, Literal

    from pydantic import BaseModel, Field

    class Cat(BaseModel):
        kind: Literal["cat"]
        lives: int

    class Dog(BaseModel):
        kind: Literal["dog"]
        bark: str

    class Pet(BaseModel):
        pet: Annotated[Cat | Dog, Field(discriminator="kind")]

    schema = Pet.model_json_schema()
    assert "discriminator" in schema["properties"]["pet"]
    grammar = json_grammar(schema)
    assert matches(grammar, Pet(pet=Cat(kind="cat", lives=9)).model_dump_json())
    assert matches(grammar, json.dumps({"pet": {"kind": "dog", "bark": "woof"}}))
    assert refused_at(grammar, b'{"pet":{"kind":"cat","bark"') == len(b'{"pet":{"kind":"cat","')


@pytest.mark.parametrize(("least", "most"), [(0, None), (1, 2), (2, 3), (0, 0)])
def test_unique_items_of_listed_values_are_each_written_once_at_most(least, most):
    """Every array of up to four items from a small pool, compact and spaced, is taken exactly when each item is a
    listed value as json.dumps writes it, none twice (1.0 is 1), and the count is within bounds."""
    schema = {"items": {"enum": ["a", 1, None, 1.0, {"k": [True]}]}, "uniqueItems": True, "minItems": least}
    grammar = json_grammar(schema | ({} if most is None else {"maxItems": most}))
    listed = {'"a"', "1", "null", '{"k": [true]}'}
    for length in range(5):
        for array in itertools.product(["a", 1, None, True, "b", {"k": [True]}], repeat=length):
            texts = [json.dumps(item) for item in array]
            wanted = (
                set(texts) <= listed and len(set(texts)) == length and least <= length <= (9 if most is None else most)
            )
            assert matches(grammar, json.dumps(list(array))) == wanted, array
            compact = json.dumps(list(array), separators=(",", ":"))
            assert matches(grammar, compact) == (wanted and {"k": [True]} not in array), array  # written as listed
    if least == 0:  # whitespace runs stay bounded in the empty array too
        assert matches(grammar, "[" + " " * 20 + "]") and not matches(grammar, "[" + " " * 21 + "]")
    with pytest.raises(GrammarError) as refused:
        json_grammar(schema | {"minItems": 5})
    assert refused.value.where == "/minItems"


def test_a_set_of_an_enum_and_a_frozenset_of_bools_from_pydantic_are_guided():
    import enum

    from pydantic import BaseModel

    class Color(enum.Enum):
        RED = "red"
        BLUE = "blue"

    class Palette(BaseModel):
        colors: set[Color]
        flags: frozenset[bool]

    grammar = json_grammar(Palette.model_json_schema())
    assert matches(grammar, '{"colors":["blue","red"],"flags":[false]}')
    assert refused_at(grammar, b'{"colors":["red","red"') == len(b'{"colors":["red","')
    assert refused_at(grammar, b'{"colors":[],"flags":[true,true') == len(b'{"colors":[],"flags":[true,')


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"prefixItems": {"type": "string"}}, "/prefixItems"),
        ({"prefixItems": [{"type": "string"}], "items": [{"type": "string"}]}, "/items"),
        ({"prefixItems": [{"type": "string"}], "items": False, "minItems": 2}, "/minItems"),
        ({"items": [{}], "additionalItems": False, "minItems": 2}, "/minItems"),
        ({"prefixItems": [{"type": "string"}, {"multipleOf": 0.1234}]}, "/prefixItems/1/multipleOf"),
        ({"items": [{"type": "string"}], "additionalItems": {"uniqueItems": True}}, "/additionalItems/uniqueItems"),
        ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "/uniqueItems"),  # pydantic's set[str]
        ({"items": {"enum": list(range(9))}, "uniqueItems": True}, "/uniqueItems"),
        ({"items": {"type": "boolean"}, "uniqueItems": 1}, "/uniqueItems"),
        ({"items": {"type": ["boolean"]}, "uniqueItems": True}, "/uniqueItems"),
        ({"items": {"enum": "ab"}, "uniqueItems": True}, "/items/enum"),
        ({"prefixItems": [{"const": 1}], "uniqueItems": True}, "/uniqueItems"),
    ],
)
def test_a_prefix_of_items_that_cannot_be_compiled_is_refused_naming_the_part_at_fault(schema, where):
    with pytest.raises(GrammarError) as caught:
        json_grammar(schema)
    assert caught.value.where == where
