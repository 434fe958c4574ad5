"""Objects in guided decoding: keys beside the listed properties, counted members, keys of a pattern."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from server.grammar import Grammar, GrammarError, json_grammar


def matches(grammar: Grammar, text: str) -> bool:
    """Whether the whole text is a complete match."""
    state = grammar.feed(grammar.initial, text.encode())
    return state is not None and grammar.accepts(state)


def is_type(value: Any, name: str) -> bool:
    """Whether a value from JSON is of the type ("any" for any)."""
    return name == "any" or (isinstance(value, int) if name == "integer" else isinstance(value, str))


KEYS = ("a", "b", "c", "d")
VALUES = (1, "x")


def documents(most: int) -> list[list[tuple[str, Any]]]:
    """Every object of up to `most` distinct keys of KEYS in any order, each value one of VALUES."""
    found: list[list[tuple[str, Any]]] = [[]]
    for size in range(1, most + 1):
        for keys in itertools.permutations(KEYS, size):
            found += [list(zip(keys, values, strict=True)) for values in itertools.product(VALUES, repeat=size)]
    return found


@pytest.mark.parametrize("extra", ["integer", "any"])
def test_other_keys_follow_the_listed_properties_with_values_of_additional_properties(extra):
    """Beside properties, additionalProperties takes keys not listed, after the listed ones (which keep their order
    and their required ones); every object of up to three keys is taken exactly when that holds."""
    properties = {"a": "integer", "b": "string"}
    schema = {
        "type": "object",
        "properties": {name: {"type": kind} for name, kind in properties.items()},
        "required": ["a"],
        "additionalProperties": True if extra == "any" else {"type": extra},
    }
    grammar = json_grammar(schema)
    for members in documents(3):
        keys = [key for key, _ in members]
        listed = [key for key in keys if key in properties]
        expected = (
            "a" in keys
            and keys[: len(listed)] == listed
            and listed == sorted(listed)
            and all(is_type(value, properties.get(key, extra)) for key, value in members)
        )
        text = "{" + ", ".join(f"{json.dumps(key)}: {json.dumps(value)}" for key, value in members) + "}"
        assert matches(grammar, text) == expected, text


def test_no_other_key_spells_a_listed_name():
    """An other key is none of the listed names, however escaped (other keys are written as json.dumps writes them);
    a name with more after it is another key."""
    grammar = json_grammar(
        {"properties": {"a": {}, 'q"é': {}}, "additionalProperties": {"type": "integer"}, "required": ["a"]}
    )
    assert matches(grammar, '{"a": 0, "ab": 1, "": 2, "a\\n": 3, "q\\"": 4, "q\\"éé": 5, "é": 6}')
    assert matches(grammar, '{"a": 0, "q\\"\\u00e9": 1}')  # the listed property, as json.dumps writes its name
    for key in ('"a"', '"\\u0061"', '"q\\"é"', '"\\u00e9"'):
        assert not matches(grammar, '{"a": 0, ' + key + ": 1}"), key


def test_a_required_name_properties_lacks_is_listed_after_them_with_a_value_of_additional_properties():
    """A required name not in properties must be present, after the listed properties, its value following
    additionalProperties; with additionalProperties false it is refused naming the entry of `required`."""
    grammar = json_grammar(
        {"properties": {"a": {}}, "required": ["z", "z"], "additionalProperties": {"type": "string"}}
    )
    assert matches(grammar, '{"z": "1"}') and matches(grammar, '{"a": 1, "z": "1", "y": "2"}')
    for text in ('{"a": 1}', '{"z": 1}', '{"y": "1", "z": "1"}', '{"z": "1", "a": 1}', '{"z": "1", "z": "2"}'):
        assert not matches(grammar, text), text
    with pytest.raises(GrammarError) as caught:
        json_grammar({"properties": {"a": {}}, "required": ["a", "z"], "additionalProperties": False})
    assert caught.value.where == "/required/1"


def test_a_bad_additional_properties_beside_properties_is_refused_naming_it():
    """additionalProperties must be a schema; its faults are named where they are."""
    for value, where in ((3, "/additionalProperties"), ({"type": "nothing"}, "/additionalProperties/type")):
        with pytest.raises(GrammarError) as caught:
            json_grammar({"properties": {"a": {}}, "additionalProperties": value})
        assert caught.value.where == where


def test_a_pydantic_model_that_allows_extra_fields_is_guided():
    """pydantic's extra="allow" writes additionalProperties true beside the fields: a dump with extra fields is taken
    and validates."""
    from pydantic import BaseModel, ConfigDict

    class Order(BaseModel):
        model_config = ConfigDict(extra="allow")
        item: str
        count: int = 1

    grammar = json_grammar(Order.model_json_schema())
    text = Order(item="tea", note="hot", tags=["a", {"b": None}]).model_dump_json()
    assert matches(grammar, text)
    assert Order.model_validate_json(text).model_extra == {"note": "hot", "tags": ["a", {"b": None}]}
    assert not matches(grammar, '{"count": 2, "item": "tea"}')
