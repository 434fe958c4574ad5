"""Objects in guided decoding: keys beside the listed properties, counted members, keys of a pattern."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from server.grammar import Grammar, GrammarError
from server.grammar_schema import json_grammar


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
    """An other key is none of the listed names; other keys are written as json.dumps(ensure_ascii=False) writes them,
    so no escape spells a name either; a name with more after it, or less, is another key."""
    grammar = json_grammar(
        {"properties": {"a": {}, 'q"é': {}}, "additionalProperties": {"type": "integer"}, "required": ["a"]}
    )
    assert matches(grammar, '{"a": 0, "ab": 1, "": 2, "a\\n": 3, "q\\"": 4, "q\\"éé": 5, "é": 6}')
    assert matches(grammar, '{"a": 0, "q\\"\\u00e9": 1}')  # the listed property, as json.dumps writes its name
    for key in ('"a"', '"q\\"é"'):  # a listed name as an other key
        assert not matches(grammar, '{"a": 0, "b": 1, ' + key + ": 1}"), key
    for key in ('"\\u0061"', '"\\u00e9"', '"\\/"'):  # escapes json.dumps(ensure_ascii=False) does not write
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


def member_text(members: list[tuple[str, Any]]) -> str:
    """An object's text from its members in order (a key may come twice)."""
    return "{" + ", ".join(f"{json.dumps(key)}: {json.dumps(value)}" for key, value in members) + "}"


@pytest.mark.parametrize(("least", "most"), [(0, None), (1, 2), (2, 3), (3, None)])
def test_keys_of_listed_names_come_once_each_within_the_member_counts(least, most):
    """propertyNames of an enum (pydantic's dict keyed by an Enum or a Literal): keys among its values, each once, in
    any order, minProperties to maxProperties of them; every object of up to three keys is taken exactly then."""
    schema = {
        "type": "object",
        "propertyNames": {"enum": ["a", "b", "c", 1]},
        "additionalProperties": {"type": "integer"},
    }
    schema |= {"minProperties": least} | ({} if most is None else {"maxProperties": most})
    grammar = json_grammar(schema)
    for members in documents(3):
        keys = [key for key, _ in members]
        expected = (
            set(keys) <= {"a", "b", "c"}
            and least <= len(keys) <= (3 if most is None else most)
            and all(isinstance(value, int) for _, value in members)
        )
        assert matches(grammar, member_text(members)) == expected, member_text(members)
    assert not matches(grammar, member_text([("a", 1), ("b", 2), ("a", 3)]))
    if least == 0:  # whitespace runs stay bounded in the empty object too
        assert matches(grammar, "{" + " " * 20 + "}") and not matches(grammar, "{" + " " * 21 + "}")


def test_a_listed_key_comes_once_however_often_the_enum_lists_it():
    """An enum that lists a key twice still lets it come once."""
    grammar = json_grammar({"type": "object", "propertyNames": {"enum": ["a", "a", "b"]}})
    assert matches(grammar, '{"a": 1, "b": 2}') and not matches(grammar, '{"a": 1, "a": 2}')


def test_many_dicts_keyed_by_an_enum_of_eight_values_fit():
    """Each subset node of a dict keyed by listed values joins the next by calls, so a model of a dozen dicts keyed by
    an 8-value Enum compiles, and takes their dumps."""
    import enum

    from pydantic import create_model

    names = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    Phonetic = enum.Enum("Phonetic", {name.upper(): name for name in names})
    Model = create_model("Model", **{f"field{i}": (dict[Phonetic, int], ...) for i in range(12)})
    grammar = json_grammar(Model.model_json_schema())
    keyed = {member: index for index, member in enumerate(Phonetic)}
    assert matches(grammar, Model(**{f"field{i}": keyed for i in range(12)}).model_dump_json())


@pytest.mark.parametrize(
    "rules",
    [
        {},
        {"propertyNames": {"enum": ["a"]}},
        {"propertyNames": {"enum": list("abcdefghi")}},
        {"maxProperties": 3},
    ],
)
def test_objects_of_other_keys_nest_as_deep_as_objects_of_properties(rules):
    """A recursive dict (additionalProperties a $ref back to it; keys listed, or counted) nests as deep as a recursive
    object of properties: each level one call frame of the MAX_DEPTH."""

    def deepest(schema: dict[str, Any]) -> int:
        grammar = json_grammar({"$defs": {"T": schema}, "$ref": "#/$defs/T"})
        return max(depth for depth in range(1, 80) if matches(grammar, '{"a": ' * depth + "{}" + "}" * depth))

    by_properties = deepest({"type": "object", "properties": {"a": {"$ref": "#/$defs/T"}}})
    assert by_properties > 60
    assert deepest({"type": "object", "additionalProperties": {"$ref": "#/$defs/T"}} | rules) == by_properties


@pytest.mark.parametrize("most", [None, 1, 2])
def test_free_keys_take_one_to_max_properties_members(most):
    """Keys of any string, values of a schema, at least one member and at most maxProperties (pydantic's dict with
    lengths); every object of up to three keys is taken exactly then."""
    schema = {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1}
    grammar = json_grammar(schema if most is None else schema | {"maxProperties": most})
    for members in documents(3):
        expected = 1 <= len(members) <= (most or 3) and all(isinstance(value, int) for _, value in members)
        assert matches(grammar, member_text(members)) == expected, member_text(members)
    empty = json_grammar({"type": "object", "maxProperties": 0})
    assert matches(empty, "{ }") and not matches(empty, '{"a": 1}')


def test_keys_of_property_names_keywords_and_of_a_pattern_property():
    """propertyNames' string keywords and patternProperties' one pattern (fully matched, as a string's pattern is)
    decide the keys; the pattern's schema the values."""
    lengths = json_grammar({"type": "object", "propertyNames": {"minLength": 2, "maxLength": 3}})
    assert matches(lengths, '{"ab": 1, "\\u00e9\\u00e9\\u00e9": [], "abc": null}')
    assert not matches(lengths, '{"a": 1}') and not matches(lengths, '{"abcd": 1}')
    patterned = json_grammar(
        {"type": "object", "patternProperties": {"^[a-z]+$": {"type": "integer"}}, "propertyNames": {"maxLength": 2}}
    )
    assert matches(patterned, '{"ab": 1, "z": 2}')
    for text in ('{"Ab": 1}', '{"abc": 1}', '{"": 1}', '{"ab": "1"}', '{"a1": 1}'):
        assert not matches(patterned, text), text
    nothing = json_grammar({"type": "object", "propertyNames": {"type": "integer"}})
    assert matches(nothing, "{}") and not matches(nothing, '{"1": 1}')


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"type": "object", "patternProperties": {"(a": {}}}, "/patternProperties/(a"),
        ({"type": "object", "patternProperties": {"a": {}, "b": {}}}, "/patternProperties"),
        ({"type": "object", "patternProperties": {"a": {"type": "no"}}}, "/patternProperties/a/type"),
        ({"type": "object", "patternProperties": {"a": {}}, "additionalProperties": True}, "/additionalProperties"),
        (
            {"type": "object", "patternProperties": {"a": {}}, "propertyNames": {"pattern": "b"}},
            "/propertyNames/pattern",
        ),
        ({"type": "object", "patternProperties": {"a": {}}, "propertyNames": {"enum": ["a"]}}, "/propertyNames"),
        ({"type": "object", "propertyNames": {"minimum": 1}}, "/propertyNames/minimum"),
        ({"type": "object", "propertyNames": {"enum": [1]}}, "/propertyNames"),
        (
            {"type": "object", "propertyNames": {"$ref": "#/$defs/k"}, "$defs": {"k": {"pattern": "("}}},
            "/$defs/k/pattern",
        ),
        ({"type": "object", "minProperties": 2}, "/minProperties"),
        ({"type": "object", "minProperties": 3, "maxProperties": 2}, "/minProperties"),
        ({"type": "object", "propertyNames": {"enum": ["a", "b"]}, "minProperties": 3}, "/minProperties"),
        ({"type": "object", "additionalProperties": False, "minProperties": 1}, "/minProperties"),
        ({"type": "object", "maxProperties": -1}, "/maxProperties"),
        ({"properties": {"a": {}}, "maxProperties": 1}, "/maxProperties"),
        ({"properties": {"a": {}}, "propertyNames": {"maxLength": 1}}, "/propertyNames"),
        ({"type": "object", "propertyNames": {"enum": ["a", "a"]}, "minProperties": 2}, "/minProperties"),
        ({"type": "object", "propertyNames": {"$ref": ["x"]}}, "/propertyNames/$ref"),
        ({"type": "array", "items": {"$ref": {}}, "uniqueItems": True}, "/items/$ref"),
        ({"type": "object", "patternProperties": {"(": False}}, "/patternProperties/("),
        ({"type": "object", "patternProperties": {"(": {}}, "maxProperties": 0}, "/patternProperties/("),
        ({"type": "object", "additionalProperties": {"type": "no"}, "maxProperties": 0}, "/additionalProperties/type"),
        (
            {"type": "object", "propertyNames": {"pattern": "("}, "additionalProperties": False},
            "/propertyNames/pattern",
        ),
    ],
)
def test_object_keywords_that_cannot_be_honoured_are_refused_naming_them(schema, where):
    """Several patterns, key keywords beside a pattern property, counts keys could break by repeating, and counts or
    key rules beside properties are refused, each naming its place."""
    with pytest.raises(GrammarError) as caught:
        json_grammar(schema)
    assert caught.value.where == where


def test_pydantic_dicts_with_constrained_keys_or_lengths_are_guided():
    """pydantic's dict keyed by an Enum, a Literal or a constr, and a dict with lengths: what its dumps write is taken,
    and what its validation refuses is refused."""
    import enum
    from typing import Annotated, Literal

    from pydantic import BaseModel, Field, StringConstraints, ValidationError

    class Color(enum.Enum):
        RED = "red"
        BLUE = "blue"

    class Palette(BaseModel):
        by_color: dict[Color, int]
        by_side: dict[Literal["left", "right"], float]
        by_code: dict[Annotated[str, StringConstraints(pattern=r"^[a-z]{2}$")], str]
        some: Annotated[dict[str, bool], Field(min_length=1, max_length=2)]

    grammar = json_grammar(Palette.model_json_schema())
    good = Palette(
        by_color={Color.BLUE: 1, Color.RED: 2}, by_side={"right": 0.5}, by_code={"ab": "x"}, some={"k": True}
    )
    assert matches(grammar, good.model_dump_json())
    bad = [
        '{"by_color": {"green": 1}, "by_side": {}, "by_code": {}, "some": {"k": true}}',
        '{"by_color": {}, "by_side": {"up": 1}, "by_code": {}, "some": {"k": true}}',
        '{"by_color": {}, "by_side": {}, "by_code": {"abc": "x"}, "some": {"k": true}}',
        '{"by_color": {}, "by_side": {}, "by_code": {}, "some": {}}',
        '{"by_color": {}, "by_side": {}, "by_code": {}, "some": {"a": true, "b": true, "c": false}}',
    ]
    for text in bad:
        with pytest.raises(ValidationError):
            Palette.model_validate_json(text)
        assert not matches(grammar, text), text


@pytest.mark.parametrize("extra", [None, "integer", "any"])
def test_all_of_object_schemas_joins_their_properties(extra):
    """allOf of object schemas (OpenAPI's inheritance, through a $ref): the properties of each in turn, the required
    ones of all; other keys only where one schema allows them and none forbids them; every object of up to three keys
    is taken exactly when that holds."""
    mixin: dict[str, Any] = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"description": "id"}}}
    if extra is not None:
        mixin["additionalProperties"] = True if extra == "any" else {"type": extra}
    schema = {
        "$defs": {"Base": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}},
        "allOf": [{"$ref": "#/$defs/Base"}, {"title": "only a title"}, mixin],
    }
    grammar = json_grammar(schema)
    for members in documents(3):
        keys = [key for key, _ in members]
        listed = [key for key in keys if key in ("a", "b")]
        kinds = {"a": "integer", "b": "string"}
        expected = (
            "a" in keys
            and keys[: len(listed)] == listed
            and listed == sorted(listed)
            and (extra is not None or keys == listed)
            and all(is_type(value, kinds.get(key, extra or "any")) for key, value in members)
        )
        assert matches(grammar, member_text(members)) == expected, member_text(members)


def test_all_of_drops_a_property_one_schema_forbids_and_takes_any_value_of_annotations_alone():
    """A property one schema of allOf forbids (its additionalProperties false) is left out; a required name no schema
    lists takes any value; allOf of annotations alone takes any value, of one schema that schema."""
    forbidding = json_grammar(
        {"allOf": [{"properties": {"a": {}}, "additionalProperties": False}, {"properties": {"b": {}}}]}
    )
    assert matches(forbidding, '{"a": 1}') and not matches(forbidding, '{"a": 1, "b": 2}')
    required = json_grammar({"allOf": [{"properties": {"a": {}}}, {"type": "object", "required": ["z"]}]})
    assert matches(required, '{"a": 1, "z": [null]}') and not matches(required, '{"a": 1}')
    assert matches(json_grammar({"allOf": [{}, {"description": "x"}]}), "[1]")
    single = json_grammar({"allOf": [{"title": "t"}, {"type": "string", "maxLength": 1}]})
    assert matches(single, '"a"') and not matches(single, '"ab"')


def test_a_property_whose_schema_is_false_is_no_key_at_all():
    """A property of the false schema (in properties, or forbidden by one schema of allOf) is never written, neither
    listed nor as an other key."""
    plain = json_grammar({"properties": {"a": False, "b": {}}, "additionalProperties": {"type": "integer"}})
    joined = json_grammar(
        {"allOf": [{"properties": {"a": False}, "additionalProperties": True}, {"properties": {"b": {}}}]}
    )
    for grammar in (plain, joined):
        assert matches(grammar, '{"b": 1, "c": 2}') and matches(grammar, "{}")
        assert not matches(grammar, '{"a": 1}') and not matches(grammar, '{"b": 1, "a": 2}')


@pytest.mark.parametrize(
    "schema",
    [
        {
            "$defs": {"T": {"type": "object", "properties": {"next": {"allOf": [{"$ref": "#/$defs/T"}]}}}},
            "$ref": "#/$defs/T",
        },
        {"type": "object", "properties": {"next": {"allOf": [{"$ref": "#"}], "description": "pydantic v1's wrapper"}}},
    ],
)
def test_all_of_one_reference_back_into_itself_recurses_through_its_routine(schema):
    """allOf of one $ref (pydantic v1 wraps a described model field so) compiles as the $ref would: a recursive one
    is a call of its routine, not laid out again without end."""
    grammar = json_grammar(schema)
    assert matches(grammar, '{"next": {"next": {}}}') and not matches(grammar, '{"next": 1}')


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"allOf": [{"additionalProperties": None}, {"type": "object"}]}, "/allOf/0/additionalProperties"),
        ({"allOf": [{"type": "string"}, {"maxLength": 3}]}, "/allOf/0/type"),
        ({"allOf": [{"type": "object"}, {"maxLength": 3}]}, "/allOf/1/maxLength"),
        (
            {"allOf": [{"properties": {"a": {"type": "integer"}}}, {"properties": {"a": {"minimum": 0}}}]},
            "/allOf/1/properties/a",
        ),
        (
            {
                "allOf": [
                    {"properties": {"a": {}}, "additionalProperties": {"type": "integer"}},
                    {"properties": {"b": {"type": "string"}}},
                ]
            },
            "/allOf/1/properties/b",
        ),
        (
            {
                "allOf": [
                    {"properties": {"a": {}}, "additionalProperties": False},
                    {"properties": {"b": {}}, "required": ["b"]},
                ]
            },
            "/allOf/1/required/0",
        ),
        (
            {
                "allOf": [
                    {"type": "object", "additionalProperties": {"type": "integer"}},
                    {"type": "object", "additionalProperties": {"type": "string"}},
                ]
            },
            "/allOf/1/additionalProperties",
        ),
        ({"allOf": [False, {"type": "object"}]}, "/allOf/0"),
        ({"allOf": [{"properties": 3}, {"type": "object"}]}, "/allOf/0/properties"),
        ({"allOf": [{"$ref": "#/$defs/A"}, {"type": "object"}], "$defs": {"A": {"anyOf": [{}]}}}, "/$defs/A/anyOf"),
        ({"allOf": [{"properties": {"a": {"type": "no"}}}, {"type": "object"}]}, "/allOf/0/properties/a/type"),
    ],
)
def test_all_of_that_cannot_be_joined_is_refused_naming_the_part_at_fault(schema, where):
    """Several schemas that are not objects, a value two of them constrain, a required name one forbids."""
    with pytest.raises(GrammarError) as caught:
        json_grammar(schema)
    assert caught.value.where == where
