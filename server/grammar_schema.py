"""JSON Schemas for guided decoding (`guided_json`, `response_format`, tool parameters): the subset SchemaCompiler
honours, laid into a grammar's network; a keyword it cannot honour is refused naming its JSON pointer."""

from __future__ import annotations

import contextlib
import json
import math
import re
from decimal import Decimal
from functools import partial
from typing import Any

from server.grammar import (
    MAX_REPEAT,
    Emit,
    Grammar,
    GrammarError,
    JsonBuilder,
    Network,
)
from server.grammar_formats import FORMAT_PATTERNS
from server.grammar_numbers import (
    MAX_BOUND_DIGITS,
    Bound,
    NumberAutomaton,
    bound_digits,
    bounded_numbers,
    multiples_of,
)
from server.grammar_regex import (
    RegexEmitter,
    RegexParser,
    other_keys,
)

MAX_STRING_LENGTH = 4096  # the largest minLength or maxLength (pydantic's HttpUrl has 2083)
MAX_MULTIPLE = 1000  # the largest multipleOf in its last digit's units (a state for each remainder, beside each state
# of the number's automaton)
MAX_UNIQUE_VALUES = 8  # the most values unique items may choose among (a node per subset of them)
SHARED_STRING_LENGTH = 256  # strings allowed more characters than this share one routine per pair of lengths

JSON_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
PYTHON_TYPES: dict[str, type | tuple[type, ...]] = {
    "object": dict, "array": list, "string": str, "number": (int, float), "null": type(None)
}  # fmt: skip
ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly", "writeOnly"}
    | {"discriminator"}  # OpenAPI's hint beside oneOf (pydantic's tagged unions); the options' consts decide
)
DEFINITIONS = ("$defs", "definitions")
COMPOSITIONS = ("$ref", "anyOf", "oneOf", "allOf")
TYPE_KEYWORDS = {
    "object": (
        "properties",
        "required",
        "additionalProperties",
        "patternProperties",
        "propertyNames",
        "minProperties",
        "maxProperties",
    ),
    "array": ("items", "prefixItems", "additionalItems", "minItems", "maxItems", "uniqueItems"),
    "string": ("minLength", "maxLength", "pattern", "format"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
}
SUPPORTED = frozenset({"type", "enum", "const"}).union(ANNOTATIONS, DEFINITIONS, COMPOSITIONS, *TYPE_KEYWORDS.values())
REFERENCE = re.compile(r"#/(\$defs|definitions)/([^/]+)")


def pointer_to(pointer: str, *keys: str | int) -> str:
    """A JSON pointer extended by keys, each escaped (~ as ~0, / as ~1)."""
    return pointer + "".join("/" + str(key).replace("~", "~0").replace("/", "~1") for key in keys)


def not_a_schema(value: Any, pointer: str) -> GrammarError:
    """The error for a value where a schema should be that no value can meet: false, or not a schema at all."""
    if value is False:
        return GrammarError("a false schema admits no value", pointer)
    return GrammarError("a schema must be a JSON object or a boolean", pointer)


def local_definition(reference: Any) -> tuple[str, str] | None:
    """The (section, name) a '#/$defs/NAME' or '#/definitions/NAME' reference names; None for any other."""
    match = REFERENCE.fullmatch(reference) if isinstance(reference, str) else None
    return None if match is None else (match.group(1), match.group(2).replace("~1", "/").replace("~0", "~"))


class SchemaCompiler(JsonBuilder):
    """Adds the JSON text a schema admits to a network; a keyword it cannot honour is refused with its pointer.

    Honoured: type (a name or a list), properties (in their order), required, additionalProperties (a schema for the
    keys `properties` does not list, written after those; absent beside properties: no other keys), and without
    properties propertyNames (string keywords, or an enum or const), one pattern of patternProperties, minProperties and
    maxProperties (keys of up to 8 listed values come once each; a minimum above 1 needs them), items, prefixItems (or
    items as a list, with additionalItems), minItems, maxItems, uniqueItems (items of a few listed values), minLength,
    maxLength, pattern (over the string's decoded characters, fully; lengths too), format (those of grammar_formats.py,
    not beside a pattern; others are annotations), minimum, maximum, exclusiveMinimum and exclusiveMaximum (numbers then
    written without an exponent), multipleOf (of at most 1000 in its last digit's units: numbers then have no more
    fraction digits than it, none for a whole one), enum and const (beside type only, as json.dumps writes them), anyOf,
    oneOf (as anyOf), allOf (schemas of annotations alone aside, one as it is, several only as objects of properties,
    required and additionalProperties, each value constrained by one of them), $ref to '#' and '#/$defs/NAME'
    ('#/definitions/NAME'), and the annotations (OpenAPI's discriminator among them), which are ignored. A composition
    beside another constraint is refused."""

    def __init__(self, network: Network, root: Any) -> None:
        super().__init__(network)
        self.root = root
        self._routines: dict[str, int] = {}  # a schema's pointer -> the entry of its routine
        self._strings: dict[tuple[int, int], int] = {}  # (least, most) -> the entry of a long string's routine
        self._comma_entry: int | None = None  # the entry of the comma's routine (`_comma`)

    def root_value(self, start: int) -> int:
        """A value of the root schema (through its routine, which '#' may call again)."""
        return self.network.call(start, self.routine(self.root, ""))

    def routine(self, schema: Any, pointer: str) -> int:
        """The entry of the routine for a schema, compiled once (a recursive $ref calls it while it is compiled)."""
        entry = self._routines.get(pointer)
        if entry is None:
            entry, exit_node = self.network.routine()
            self._routines[pointer] = entry
            self.network.epsilon(self.value(entry, schema, pointer), exit_node)
        return entry

    def value(self, start: int, schema: Any, pointer: str) -> int:
        """A value the schema at `pointer` admits."""
        if schema is True:
            return self.any_value(start)
        if not isinstance(schema, dict):
            raise not_a_schema(schema, pointer)
        for key in schema:
            if key not in SUPPORTED:
                raise GrammarError(f"'{key}' is not supported in guided decoding", pointer_to(pointer, key))
        composition = next((key for key in COMPOSITIONS if key in schema), None)
        if composition is not None:
            self._alone(schema, composition, (), pointer)
            return self._composed(start, schema, composition, pointer)
        if "enum" in schema or "const" in schema:
            self._alone(schema, "enum" if "enum" in schema else "const", ("type", "enum", "const"), pointer)
            return self._constants(start, schema, pointer)
        types = self._types(schema, pointer)
        if not types:
            return self.any_value(start)
        return self.network.either(
            start, [partial(self._typed, name=name, schema=schema, pointer=pointer) for name in types]
        )

    def _alone(self, schema: dict[str, Any], keyword: str, companions: tuple[str, ...], pointer: str) -> None:
        """Refuse a constraint beside `keyword` other than its companions (annotations and definitions aside)."""
        for key in schema:
            if key != keyword and key not in companions and key not in ANNOTATIONS and key not in DEFINITIONS:
                raise GrammarError(
                    f"'{key}' cannot be combined with '{keyword}' in guided decoding", pointer_to(pointer, key)
                )

    def _composed(self, start: int, schema: dict[str, Any], keyword: str, pointer: str) -> int:
        """A value of a $ref, anyOf, oneOf (taken as anyOf) or allOf (`_all_of`)."""
        where = pointer_to(pointer, keyword)
        if keyword == "$ref":
            return self.network.call(start, self._referenced(schema["$ref"], where))
        options = schema[keyword]
        if not isinstance(options, list) or not options:
            raise GrammarError(f"'{keyword}' must be a non-empty list of schemas", where)
        if keyword == "allOf":
            return self._all_of(start, options, where)
        parts = [partial(self.value, schema=option, pointer=pointer_to(where, i)) for i, option in enumerate(options)]
        return self.network.either(start, parts)

    def _all_of(self, start: int, options: list[Any], where: str) -> int:
        """A value of every schema of allOf: those of annotations alone left out, one left as it is, several (through
        their $refs) joined where they are objects of properties, required and additionalProperties (`_joined`)."""
        written = [(option, pointer_to(where, i)) for i, option in enumerate(options)]
        kept = [(option, at, self._resolved(option, at)) for option, at in written]
        kept = [(option, at, part) for option, at, part in kept if not self._admits_all(part[0])]
        if len(kept) <= 1:  # compiled as written, so that a $ref is a call of its routine
            return self.value(start, *kept[0][:2]) if kept else self.any_value(start)
        parts = [part for _, _, part in kept]
        for part, at in parts:
            if not isinstance(part, dict):
                raise not_a_schema(part, at)
            for key in part:
                if key not in ("type", "properties", "required", "additionalProperties", *ANNOTATIONS, *DEFINITIONS):
                    raise GrammarError(
                        f"'{key}' in one of several schemas of 'allOf' is not supported (only objects of properties, "
                        "required and additionalProperties are joined)", pointer_to(at, key),
                    )  # fmt: skip
            if "object" not in self._types({"type": "object"} | part, at):
                raise GrammarError("several schemas of 'allOf' are joined only as objects", pointer_to(at, "type"))
            if not isinstance(part.get("properties", {}), dict):
                raise GrammarError("'properties' must be an object", pointer_to(at, "properties"))
        return self._record(start, *self._joined(parts))

    def _joined(
        self, parts: list[tuple[dict[str, Any], str]]
    ) -> tuple[list[tuple[str, Any, str]], frozenset[str], tuple[Any, str] | None]:
        """Object schemas of allOf as one record: the names any lists (their order, then the required ones none lists),
        each with the one schema that constrains it there (a part that does not list it constrains it by its
        additionalProperties; one that forbids it leaves it out), the names any requires, and other keys where every
        part's additionalProperties allows them and one at least names it."""
        required: dict[str, str] = {}  # a required name -> the pointer of its first entry in a `required`
        for part, at in parts:
            for index, name in enumerate(self._required(part, at)):
                required.setdefault(name, pointer_to(at, "required", index))
        names = dict.fromkeys([name for part, _ in parts for name in part.get("properties", {})] + list(required))
        listed = []
        for name in names:
            rules = []
            for part, at in parts:
                if name in part.get("properties", {}):
                    rules.append((part["properties"][name], pointer_to(at, "properties", name)))
                else:
                    rules.append((part.get("additionalProperties", True), pointer_to(at, "additionalProperties")))
            rule = self._one_rule(rules)
            if rule is None and name in required:
                where = required[name]
                raise GrammarError(f"required property {name!r} is forbidden by another schema of 'allOf'", where)
            listed.append((name, False, "") if rule is None else (name, *rule))
        stated = [(part["additionalProperties"], pointer_to(at, "additionalProperties")) for part, at in parts
                  if "additionalProperties" in part]  # fmt: skip
        extra = None
        if stated and all(value is not False for value, _ in stated):
            extra = self._one_rule(stated)
        return listed, frozenset(required), extra

    def _one_rule(self, rules: list[tuple[Any, str]]) -> tuple[Any, str] | None:
        """The one schema (and its pointer) of several a value must meet, those of annotations alone aside (True where
        none is left); None where one is false; several that differ are refused."""
        if any(rule is False for rule, _ in rules):
            return None
        left = [(rule, at) for rule, at in rules if not self._admits_all(rule)]
        for rule, at in left[1:]:
            if not same_json(rule, left[0][0]):
                raise GrammarError("a value constrained by more than one schema of 'allOf' is not supported", at)
        return left[0] if left else (True, rules[0][1])

    @staticmethod
    def _admits_all(schema: Any) -> bool:
        """Whether a schema is true or holds annotations and definitions alone (so admits any value)."""
        return schema is True or (
            isinstance(schema, dict) and all(k in ANNOTATIONS or k in DEFINITIONS for k in schema)
        )

    def _resolved(self, schema: Any, pointer: str) -> tuple[Any, str]:
        """The schema a chain of bare $refs leads to, and its pointer."""
        seen: set[str] = set()
        while isinstance(schema, dict) and set(schema) - ANNOTATIONS == {"$ref"}:
            reference = schema["$ref"]
            if isinstance(reference, str) and reference in seen:
                break
            schema, pointer = self._definition(reference, pointer_to(pointer, "$ref"))  # refuses a non-string
            seen.add(reference)
        return schema, pointer

    def _referenced(self, reference: Any, where: str) -> int:
        """The entry of the routine a $ref names."""
        return self.routine(*self._definition(reference, where))

    def _definition(self, reference: Any, where: str) -> tuple[Any, str]:
        """The schema a $ref names and its pointer: '#' (the root) or '#/$defs/NAME' ('#/definitions/NAME')."""
        if reference == "#":
            return self.root, ""
        named = local_definition(reference)
        if named is None:
            raise GrammarError("only '#', '#/$defs/NAME' and '#/definitions/NAME' references are supported", where)
        section, name = named
        definitions = self.root.get(section)
        if not isinstance(definitions, dict) or name not in definitions:
            raise GrammarError(f"{reference!r} names no definition", where)
        return definitions[name], pointer_to("", section, name)

    def _constants(self, start: int, schema: dict[str, Any], pointer: str) -> int:
        """One of the values of `enum` or `const` (those of the declared type), written as json.dumps writes it, its
        non-ASCII characters escaped or, as xgrammar writes them, as they are."""
        texts = {text for value in self._constant_values(schema, pointer) for text in spellings(value)}
        return self.network.literals(start, sorted(texts))

    def _constant_values(self, schema: dict[str, Any], pointer: str) -> list[Any]:
        """The values of `enum` or `const` of the declared type, each a JSON value; none is an error."""
        where = pointer_to(pointer, "enum" if "enum" in schema else "const")
        values = schema["enum"] if "enum" in schema else [schema["const"]]
        if not isinstance(values, list) or not values:
            raise GrammarError("'enum' must be a non-empty list", where)
        if "enum" in schema and "const" in schema:
            values = [value for value in values if same_json(value, schema["const"])]
        types = self._types(schema, pointer)
        values = [value for value in values if not types or any(is_json_type(value, name) for name in types)]
        if not values:
            raise GrammarError("no value of 'enum' or 'const' fits the schema's other keywords", where)
        try:
            json.dumps(values, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise GrammarError(f"not a JSON value ({exc})", where) from exc
        return values

    def _types(self, schema: dict[str, Any], pointer: str) -> list[str]:
        """The types a schema admits: its `type`, else those its type keywords imply (none: any value)."""
        if "type" not in schema:
            return [name for name, keywords in TYPE_KEYWORDS.items() if any(key in schema for key in keywords)]
        declared = schema["type"]
        names = [declared] if isinstance(declared, str) else declared
        where = pointer_to(pointer, "type")
        if not isinstance(names, list) or not names:
            raise GrammarError("'type' must be a type name or a non-empty list of them", where)
        for index, name in enumerate(names):
            if name not in JSON_TYPES:
                raise GrammarError(
                    f"unknown type {name!r}", pointer_to(where, index) if isinstance(declared, list) else where
                )
        return list(dict.fromkeys(names))

    def _typed(self, start: int, name: str, schema: dict[str, Any], pointer: str) -> int:
        """A value of one JSON type under the schema's keywords for that type."""
        if name == "object":
            return self._object(start, schema, pointer)
        if name == "array":
            return self._array(start, schema, pointer)
        if name == "string":
            return self._string(start, schema, pointer)
        if name in ("number", "integer"):
            low, high = self._bound(schema, "minimum", pointer), self._bound(schema, "maximum", pointer)
            step = self._multiple(schema, pointer)
            if low is None and high is None and step is None:
                return self.number(start, integer=name == "integer")
            whole = step is not None and step[1] == 0
            numbers = bounded_numbers(low, high, integer=name == "integer" or whole)
            if numbers is None:
                where = pointer_to(pointer, next(key for key in TYPE_KEYWORDS["number"] if key in schema))
                raise GrammarError(f"no {name} lies within the schema's bounds", where)
            if step is not None:
                numbers = multiples_of(numbers, *step)
            if numbers is None:
                where = pointer_to(pointer, "multipleOf")
                raise GrammarError(f"no {name} within the schema's bounds is a multiple of 'multipleOf'", where)
            return self._automaton(start, numbers)
        return self.network.literals(start, [b"true", b"false"] if name == "boolean" else [b"null"])

    def _object(self, start: int, schema: dict[str, Any], pointer: str) -> int:
        """An object: its `properties` in order, those not `required` optional, then (where `additionalProperties` is
        not false) the required names `properties` lacks and any other keys, their values following it; with no
        `properties`, an open object (`_open_object`)."""
        required = self._required(schema, pointer)
        properties = schema.get("properties")
        if properties is None:
            return self._open_object(start, schema, required, pointer)
        if not isinstance(properties, dict):
            raise GrammarError("'properties' must be an object", pointer_to(pointer, "properties"))
        for key in ("patternProperties", "propertyNames", "minProperties", "maxProperties"):
            if key in schema:
                raise GrammarError(f"'{key}' beside 'properties' is not supported", pointer_to(pointer, key))
        extra = schema.get("additionalProperties", False)
        extra_pointer = pointer_to(pointer, "additionalProperties")
        listed = [(name, subschema, pointer_to(pointer, "properties", name)) for name, subschema in properties.items()]
        for index, name in enumerate(required):
            if name in properties or name in required[:index]:
                continue
            if extra is False:
                raise GrammarError(
                    f"required property {name!r} is not in 'properties'", pointer_to(pointer, "required", index)
                )
            listed.append((name, extra, extra_pointer))  # a required key 'properties' leaves to additionalProperties
        return self._record(start, listed, frozenset(required), None if extra is False else (extra, extra_pointer))

    def _required(self, schema: dict[str, Any], pointer: str) -> list[str]:
        """The names `required` lists."""
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(name, str) for name in required):
            raise GrammarError("'required' must be a list of property names", pointer_to(pointer, "required"))
        return required

    def _open_object(self, start: int, schema: dict[str, Any], required: list[str], pointer: str) -> int:
        """An object of `minProperties` to `maxProperties` members, of keys `propertyNames` admits and values of
        `additionalProperties` (absent or true: any), or of keys fully matching the one pattern of
        `patternProperties` and values of its schema. Keys of a few listed values come once each; other keys may
        repeat, so `minProperties` above 1 needs listed ones."""
        if required:
            raise GrammarError("'required' needs 'properties' in guided decoding", pointer_to(pointer, "required"))
        least = self._count(schema, "minProperties", pointer) or 0
        most = self._count(schema, "maxProperties", pointer)
        if most is not None and least > most:
            raise GrammarError("'minProperties' is above 'maxProperties'", pointer_to(pointer, "minProperties"))
        values, values_pointer, pattern = self._member_values(schema, pointer)
        key = self._keys(schema, pattern, pointer)
        if values is False or key is False:
            most = 0
        distinct = isinstance(key, list) and len(key) <= MAX_UNIQUE_VALUES
        if distinct:
            most = len(key) if most is None else min(most, len(key))
        elif least > 1:
            where = pointer_to(pointer, "minProperties")
            raise GrammarError(
                f"'minProperties' above 1 needs keys of 1 to {MAX_UNIQUE_VALUES} listed values (others may repeat)",
                where,
            )
        if most is not None and least > most:
            where = pointer_to(pointer, "minProperties")
            raise GrammarError("'minProperties' is above the number of members the object may hold", where)
        if key is None and values is True and least == 0 and most is None:
            return self.any_object(start)
        network = self.network
        if most == 0:
            self._compile_unused(key, values, values_pointer)
            return network.literal(self.whitespace(network.literal(start, b"{")), b"}")
        value_entry = self._value_entry(values, values_pointer)
        if distinct:
            return self._keyed_object(start, key, value_entry, least, most)
        key_entry = self._key_routine(
            partial(network.literals, texts=key) if isinstance(key, list) else key or self.string
        )
        inside = self.whitespace(network.literal(start, b"{"))
        end = network.node()
        if least == 0:
            network.move(inside, 1 << ord("}"), end)
        first = self._member_call(inside, key_entry, value_entry)
        following = partial(self._member_call, key_entry=key_entry, value_entry=value_entry, after_comma=True)
        after = network.repeat(first, following, 0, None if most is None else most - 1)
        network.move(self.whitespace(after), 1 << ord("}"), end)
        return end

    def _value_entry(self, schema: Any, pointer: str) -> int:
        """The entry of a routine for a value of the schema (a bare $ref's own routine), so that a value nested in a
        member takes one call frame, as one laid in place takes for its $ref."""
        if isinstance(schema, dict) and set(schema) - ANNOTATIONS == {"$ref"}:
            return self._referenced(schema["$ref"], pointer_to(pointer, "$ref"))
        return self.routine(schema, pointer)

    def _key_routine(self, key: Emit) -> int:
        """The entry of a routine for a member's key and its colon (it returns before the value)."""
        entry, exit_node = self.network.routine()
        self.network.epsilon(self.whitespace(self.network.literal(self.whitespace(key(entry)), b":")), exit_node)
        return entry

    def _member_call(self, start: int, key_entry: int, value_entry: int, after_comma: bool = False) -> int:
        """A member as calls: a comma before it where `after_comma`, its key and colon, then its value."""
        if after_comma:
            start = self.network.call(start, self._comma())
        return self.network.call(self.network.call(start, key_entry), value_entry)

    def _comma(self) -> int:
        """The entry of the routine of a comma between items, whitespace around it (laid out once)."""
        if self._comma_entry is None:
            entry, exit_node = self.network.routine()
            self.network.epsilon(self.separator(entry), exit_node)
            self._comma_entry = entry
        return self._comma_entry

    def _compile_unused(self, key: Emit | list[bytes] | bool | None, values: Any, values_pointer: str) -> None:
        """Compile an object's key and value schemas that no member can use, off the grammar's paths, so that their
        faults are refused as they are where members are written."""
        if callable(key):
            key(self.network.node())
        if values is not False:
            self.value(self.network.node(), values, values_pointer)

    def _member_values(self, schema: dict[str, Any], pointer: str) -> tuple[Any, str, tuple[str, str] | None]:
        """An open object's values: their schema and its pointer, and (pattern, its pointer) where they are those of
        the one pattern of `patternProperties`."""
        patterned = schema.get("patternProperties")
        if patterned is None:
            return schema.get("additionalProperties", True), pointer_to(pointer, "additionalProperties"), None
        where = pointer_to(pointer, "patternProperties")
        if not isinstance(patterned, dict) or len(patterned) != 1:
            raise GrammarError("'patternProperties' of other than one pattern is not supported", where)
        if schema.get("additionalProperties", False) is not False:
            where = pointer_to(pointer, "additionalProperties")
            raise GrammarError("'additionalProperties' beside 'patternProperties' is not supported", where)
        ((pattern, values),) = patterned.items()
        return values, pointer_to(where, pattern), (pattern, pointer_to(where, pattern))

    def _keys(
        self, schema: dict[str, Any], pattern: tuple[str, str] | None, pointer: str
    ) -> Emit | list[bytes] | bool | None:
        """An open object's keys: the texts of listed ones (`propertyNames`' enum or const), an emitter of key strings
        (its string keywords, and the pattern of `patternProperties`), False where no key fits, or None for any."""
        names, where = self._resolved(schema.get("propertyNames", True), pointer_to(pointer, "propertyNames"))
        if names is False:
            return False
        if names is True:
            names = {}
        if not isinstance(names, dict):
            raise not_a_schema(names, where)
        if "enum" in names or "const" in names:
            self._alone(names, "enum" if "enum" in names else "const", ("type", "enum", "const"), where)
            if pattern is not None:
                raise GrammarError("listed key names beside 'patternProperties' are not supported", where)
            listed = list(
                dict.fromkeys(value for value in self._constant_values(names, where) if isinstance(value, str))
            )
            if not listed:
                raise GrammarError("no value of 'enum' or 'const' is a string", where)
            return [json.dumps(value).encode() for value in listed]
        for key in names:
            if key not in ANNOTATIONS and key not in ("type", *TYPE_KEYWORDS["string"]):
                raise GrammarError(f"'{key}' is not supported in 'propertyNames'", pointer_to(where, key))
        if "string" not in self._types({"type": "string", **names}, where):
            return False
        if pattern is not None:
            if "pattern" in names or "format" in names:
                where = pointer_to(where, "pattern" if "pattern" in names else "format")
                raise GrammarError("a key pattern beside 'patternProperties' is not supported", where)
            names = {**names, "pattern": pattern[0]}
        if set(names) - ANNOTATIONS <= {"type"}:
            return None
        return partial(self._key_string, schema=names, where=where, pattern_where=pattern and pattern[1])

    def _key_string(self, start: int, schema: dict[str, Any], where: str, pattern_where: str | None) -> int:
        """A key string of a string schema; a fault of a pattern taken from `patternProperties` is named there."""
        try:
            return self._string(start, schema, where)
        except GrammarError as error:
            if pattern_where is not None and error.where == pointer_to(where, "pattern"):
                raise GrammarError(str(error), pattern_where) from None
            raise

    def _keyed_object(self, start: int, keys: list[bytes], value_entry: int, least: int, most: int | None) -> int:
        """An object of `least` to `most` members of distinct listed keys (`_distinct`)."""
        members = []
        for key in keys:
            key_entry = self._key_routine(partial(self.network.literal, data=key))
            members.append(partial(self._member_call, key_entry=key_entry, value_entry=value_entry))
        return self._distinct(start, b"{}", members, least, most)

    def _distinct(self, start: int, brackets: bytes, items: list[Emit], least: int, most: int | None) -> int:
        """A container in `brackets` of `least` to `most` items, each a different one of `items` (calls of routines),
        in any order: a node for each subset written so far, joined to the next by calls (the comma and the closing
        bracket are routines too, so that a subset node is a few nodes)."""
        network = self.network
        close_entry, close_exit = network.routine()
        network.epsilon(network.literal(self.whitespace(close_entry), brackets[1:]), close_exit)
        end, after = network.node(), {0: self.whitespace(network.literal(start, brackets[:1]))}
        for written in sorted(range(1 << len(items)), key=int.bit_count):
            if written not in after:
                continue
            count, here = written.bit_count(), after[written]
            if count >= least and written == 0:
                network.move(here, 1 << brackets[1], end)  # `here` is after the whitespace the routine would take
            elif count >= least:
                network.epsilon(network.call(here, close_entry), end)
            if most is not None and count >= most:
                continue
            next_item = here if written == 0 else network.call(here, self._comma())
            for index, item in enumerate(items):
                if not written >> index & 1:
                    target = after.setdefault(written | 1 << index, network.node())
                    network.epsilon(item(next_item), target)
        return end

    def _record(
        self,
        start: int,
        listed: list[tuple[str, Any, str]],
        required: frozenset[str],
        extra: tuple[Any, str] | None,
    ) -> int:
        """An object of the listed (name, schema, pointer) properties in their order, each required one present (a
        false one never); with `extra` (additionalProperties' schema and pointer), then members of any other keys (none
        a listed name) whose values follow it."""
        network = self.network
        none_yet: int | None = self.whitespace(network.literal(start, b"{"))  # no member written, none required passed
        written: int | None = None  # just after the last member written
        members: list[tuple[Emit, Emit, bool, bool]] = []  # (key, value, required, repeated)
        for name, subschema, where in listed:
            if subschema is False:  # a forbidden name
                if name in required:
                    raise GrammarError(f"required property {name!r} admits no value", where)
                continue
            key = partial(network.literal, data=json.dumps(name).encode())
            members.append((key, partial(self.value, schema=subschema, pointer=where), name in required, False))
        if extra is not None:
            other = partial(self._other_key, names=[name for name, _, _ in listed])
            members.append((other, partial(self.value, schema=extra[0], pointer=extra[1]), False, True))
        for key, value, needed, repeated in members:
            key_start = network.node()
            if none_yet is not None:
                network.epsilon(none_yet, key_start)
            if written is not None:
                network.epsilon(self.separator(written), key_start)
            member_end = self.member(key(key_start), value)
            if repeated:
                network.epsilon(self.separator(member_end), key_start)
            if needed:
                none_yet, written = None, member_end
                continue
            merged = network.node()
            for node in (member_end, written):
                if node is not None:
                    network.epsilon(node, merged)
            written = merged
        end = network.node()
        if none_yet is not None:
            network.move(none_yet, 1 << ord("}"), end)
        if written is not None:
            network.move(self.whitespace(written), 1 << ord("}"), end)
        return end

    def _other_key(self, start: int, names: list[str]) -> int:
        """A key none of `names`, written as json.dumps(ensure_ascii=False) writes it (so no escape spells a name)."""
        key = RegexEmitter(self.network, in_json_string=True).emit_pattern(
            self.network.literal(start, b'"'), other_keys(names)
        )
        return self.network.literal(key, b'"')

    def _array(self, start: int, schema: dict[str, Any], pointer: str) -> int:
        """An array of `minItems` to `maxItems` values: the first ones following `prefixItems` in turn, the rest
        following `items` (a list `items` is the prefix and `additionalItems` the rest, as before JSON Schema
        2020-12)."""
        prefix, prefix_pointer, rest, rest_pointer = self._array_parts(schema, pointer)
        least = self._count(schema, "minItems", pointer) or 0
        most = self._count(schema, "maxItems", pointer)
        if most is not None and least > most:
            raise GrammarError("'minItems' is above 'maxItems'", pointer_to(pointer, "minItems"))
        if self._unique(schema, pointer):
            if prefix:
                where = pointer_to(pointer, "uniqueItems")
                raise GrammarError("'uniqueItems' beside a prefix of items is not supported in guided decoding", where)
            return self._unique_array(start, rest, rest_pointer, least, most, pointer)
        unfillable = next((index for index, item in enumerate(prefix) if item is False), None)
        if unfillable is not None:  # an item no value can be: the array ends before it
            prefix, rest = prefix[:unfillable], False
        if rest is False:
            if least > len(prefix):
                where = pointer_to(pointer, "minItems")
                raise GrammarError("'minItems' is above the number of items the array may hold", where)
            most = len(prefix) if most is None else min(most, len(prefix))
        if not prefix and (rest is True or rest == {}) and least == 0 and most is None:
            return self.any_array(start)
        reached = prefix if most is None else prefix[:most]  # items past maxItems are never compiled
        entries = [self.routine(item, pointer_to(prefix_pointer, index)) for index, item in enumerate(reached)]
        network = self.network
        inside = self.whitespace(network.literal(start, b"["))
        end = network.node()
        if least == 0:
            network.move(inside, 1 << ord("]"), end)
        if most == 0:
            return end
        rest_reached = rest is not False and (most is None or most > len(prefix))
        rest_entry = self.routine(rest, rest_pointer) if rest_reached else None
        after = network.call(inside, entries[0] if entries else rest_entry)
        count = 1
        while count < len(entries) and (most is None or count < most):
            if count >= least:
                network.move(self.whitespace(after), 1 << ord("]"), end)
            after = self._next_item(after, entries[count])
            count += 1
        if rest_entry is not None and (most is None or count < most):
            following = partial(self._next_item, entry=rest_entry)
            after = network.repeat(after, following, max(least - count, 0), None if most is None else most - count)
        network.move(self.whitespace(after), 1 << ord("]"), end)
        return end

    @staticmethod
    def _unique(schema: dict[str, Any], pointer: str) -> bool:
        """Whether the array's items must differ."""
        unique = schema.get("uniqueItems", False)
        if not isinstance(unique, bool):
            raise GrammarError("'uniqueItems' must be true or false", pointer_to(pointer, "uniqueItems"))
        return unique

    def _unique_array(
        self, start: int, items: Any, items_pointer: str, least: int, most: int | None, pointer: str
    ) -> int:
        """An array of distinct values of a few listed ones (pydantic's set of an Enum or Literal): a node for each
        subset of them written so far."""
        texts = self._listed_values(items, items_pointer, pointer_to(pointer, "uniqueItems"))
        if least > len(texts):
            where = pointer_to(pointer, "minItems")
            raise GrammarError("'minItems' is above the number of distinct values the items may take", where)
        calls = []
        for written in texts:  # one value's spellings
            entry, exit_node = self.network.routine()
            self.network.epsilon(self.network.literals(entry, written), exit_node)
            calls.append(partial(self.network.call, entry=entry))
        return self._distinct(start, b"[]", calls, least, most)

    def _listed_values(self, items: Any, pointer: str, where: str) -> list[list[bytes]]:
        """The spellings of each of the few values an item may be (an enum, a const, a boolean or null, through
        $refs), each value once; anything else is refused naming `where`."""
        items, pointer = self._resolved(items, pointer)
        values = None
        if isinstance(items, dict) and ("enum" in items or "const" in items):
            self._alone(items, "enum" if "enum" in items else "const", ("type", "enum", "const"), pointer)
            values = self._constant_values(items, pointer)
        elif isinstance(items, dict) and set(items) - ANNOTATIONS == {"type"} and isinstance(items["type"], str):
            values = {"boolean": [True, False], "null": [None]}.get(items["type"])
        if not values or len(values) > MAX_UNIQUE_VALUES:
            raise GrammarError(
                f"'uniqueItems' is supported only for items of 1 to {MAX_UNIQUE_VALUES} listed values (an enum, a "
                "const, a boolean or null)", where
            )  # fmt: skip
        texts: dict[str, list[bytes]] = {}  # each value's identity (1.0 is 1 to JSON Schema) -> its spellings
        for value in values:
            texts.setdefault(json_identity(value), spellings(value))
        return list(texts.values())

    def _array_parts(self, schema: dict[str, Any], pointer: str) -> tuple[list[Any], str, Any, str]:
        """The prefix's schemas and pointer, and the schema of the items after them and its pointer."""
        items = schema.get("items", True)
        if "prefixItems" in schema:
            prefix, prefix_pointer = schema["prefixItems"], pointer_to(pointer, "prefixItems")
            if isinstance(items, list):
                raise GrammarError("'items' must be a schema beside 'prefixItems'", pointer_to(pointer, "items"))
            rest, rest_pointer = items, pointer_to(pointer, "items")
        elif isinstance(items, list):
            prefix, prefix_pointer = items, pointer_to(pointer, "items")
            rest, rest_pointer = schema.get("additionalItems", True), pointer_to(pointer, "additionalItems")
        else:
            return [], pointer_to(pointer, "prefixItems"), items, pointer_to(pointer, "items")
        if not isinstance(prefix, list):
            raise GrammarError("a prefix of items must be a list of schemas", prefix_pointer)
        return prefix, prefix_pointer, rest, rest_pointer

    def _next_item(self, start: int, entry: int) -> int:
        """A comma, then one more item (a call of its routine)."""
        return self.network.call(self.separator(start), entry)

    def _string(self, start: int, schema: dict[str, Any], pointer: str) -> int:
        """A string of `minLength` to `maxLength` characters, or one whose content fully matches `pattern` or the
        pattern of a `format` in FORMAT_PATTERNS (another format is an annotation, as JSON Schema takes it)."""
        least = self._count(schema, "minLength", pointer, MAX_STRING_LENGTH)
        most = self._count(schema, "maxLength", pointer, MAX_STRING_LENGTH)
        enforced = self._format(schema)
        shapes = [key for key, given in (("pattern", "pattern" in schema), ("format", enforced is not None)) if given]
        if most is not None and (least or 0) > most:
            raise GrammarError("'minLength' is above 'maxLength'", pointer_to(pointer, "minLength"))
        if not shapes:
            return self._plain_string(start, least or 0, most)
        if len(shapes) > 1:
            where = pointer_to(pointer, "format")
            raise GrammarError("'format' cannot be combined with 'pattern' in guided decoding", where)
        where = pointer_to(pointer, shapes[0])
        pattern = schema["pattern"] if shapes[0] == "pattern" else enforced
        if not isinstance(pattern, str):
            raise GrammarError("'pattern' must be a string", where)
        parsed = RegexParser(pattern, where).parse()
        emitter, opened = RegexEmitter(self.network, in_json_string=True), self.network.literal(start, b'"')
        try:
            content = emitter.emit_pattern(opened, parsed, least or 0, most, where)
        except GrammarError as error:
            if error.where == where or (least is None and most is None):
                raise
            length = pointer_to(pointer, "maxLength" if most is not None else "minLength")
            raise GrammarError(f"the {shapes[0]} with its lengths is too large for guided decoding", length) from None
        return self.network.literal(content, b'"')

    def _plain_string(self, start: int, least: int, most: int | None) -> int:
        """A string of `least` to `most` characters; a long one calls a routine every such string shares (each of its
        characters is a small network of its own: a few pydantic HttpUrl fields laid out apart fill the network)."""
        if most is None or most <= SHARED_STRING_LENGTH:
            return self.string(start, least, most)
        entry = self._strings.get((least, most))
        if entry is None:
            entry, exit_node = self.network.routine()
            self._strings[least, most] = entry
            self.network.epsilon(self.string(entry, least, most), exit_node)
        return self.network.call(start, entry)

    @staticmethod
    def _format(schema: dict[str, Any]) -> str | None:
        """The pattern of the schema's `format` where guided decoding enforces it."""
        name = schema.get("format")
        return FORMAT_PATTERNS.get(name) if isinstance(name, str) else None

    def _bound(self, schema: dict[str, Any], side: str, pointer: str) -> Bound | None:
        """The tighter of `side` ("minimum" or "maximum") and its exclusive form (a number; or, as in draft 4, a
        boolean that makes `side` exclusive); None where neither bounds the value."""
        exclusive_key = "exclusive" + side[0].upper() + side[1:]
        value, exclusive = schema.get(side), schema.get(exclusive_key)
        if isinstance(exclusive, bool):
            if exclusive and value is None:
                raise GrammarError(f"'{exclusive_key}' true needs '{side}'", pointer_to(pointer, exclusive_key))
            return None if value is None else self._bound_value(value, not exclusive, pointer_to(pointer, side))
        bounds = [] if value is None else [self._bound_value(value, True, pointer_to(pointer, side))]
        if exclusive is not None:
            bounds.append(self._bound_value(exclusive, False, pointer_to(pointer, exclusive_key)))
        # the tighter: the larger minimum or the smaller maximum; of two at one value, the exclusive one
        sense = 1 if side == "minimum" else -1
        return max(bounds, key=lambda bound: (sense * bound.value, not bound.inclusive), default=None)

    @staticmethod
    def _bound_value(value: Any, inclusive: bool, where: str) -> Bound:
        """A bound from a keyword's value: a finite number of at most MAX_BOUND_DIGITS digits written out."""
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise GrammarError("must be a finite number", where)
        if isinstance(value, float) and not math.isfinite(value):
            raise GrammarError("must be a finite number", where)
        if isinstance(value, int) and abs(value) >= 10**MAX_BOUND_DIGITS:  # str() could not even write some
            raise GrammarError(f"a bound of more than {MAX_BOUND_DIGITS} digits written out", where)
        bound = Bound(Decimal(str(value)), inclusive)
        try:
            bound_digits(bound.value)
        except ValueError as exc:
            raise GrammarError(str(exc), where) from None
        return bound

    def _automaton(self, start: int, automaton: NumberAutomaton) -> int:
        """The automaton's bytes from `start` (its state 0) to the node its accepting states lead to."""
        network = self.network
        nodes = [start, *(network.node() for _ in automaton.moves[1:])]
        end = network.node()
        for state, moves in enumerate(automaton.moves):
            masks: dict[int, int] = {}
            for byte, after in moves.items():
                masks[after] = masks.get(after, 0) | 1 << byte
            for after, mask in masks.items():
                network.move(nodes[state], mask, nodes[after])
            if state in automaton.accepting:
                network.epsilon(nodes[state], end)
        return end

    @staticmethod
    def _multiple(schema: dict[str, Any], pointer: str) -> tuple[int, int] | None:
        """multipleOf as (digits, places), its value digits·10^-places with at most MAX_MULTIPLE as digits (None where
        absent): a whole number makes the numbers integers, a fraction allows them `places` fraction digits."""
        step = schema.get("multipleOf")
        if step is None:
            return None
        where = pointer_to(pointer, "multipleOf")
        finite = isinstance(step, int) or (isinstance(step, float) and math.isfinite(step))
        if isinstance(step, bool) or not finite or step <= 0:
            raise GrammarError("'multipleOf' must be a number above 0", where)
        digits, places = 0, 0
        if not isinstance(step, int) or step <= MAX_MULTIPLE:  # a larger whole one is refused unwritten (str() limits)
            _, figures, exponent = Decimal(str(step)).normalize().as_tuple()
            digits, places = int("".join(map(str, figures))) * 10 ** max(exponent, 0), max(-exponent, 0)
        if not 0 < digits <= MAX_MULTIPLE or places > MAX_BOUND_DIGITS:
            raise GrammarError(
                f"'multipleOf' is supported only as a number of at most {MAX_MULTIPLE} in its last digit's units "
                f"(such as 5, 0.25 or 0.001), with at most {MAX_BOUND_DIGITS} fraction digits", where,
            )  # fmt: skip
        return digits, places

    def _count(self, schema: dict[str, Any], key: str, pointer: str, limit: int = MAX_REPEAT) -> int | None:
        """A count keyword's value (None where absent), 0 to `limit`."""
        count = schema.get(key)
        if count is None:
            return None
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= limit:
            raise GrammarError(f"'{key}' must be a whole number from 0 to {limit}", pointer_to(pointer, key))
        return count


def spellings(value: Any) -> list[bytes]:
    """A constant's texts: as json.dumps writes it, and with its non-ASCII characters as they are (as xgrammar writes
    them), where that is another text (a lone surrogate is written escaped only)."""
    texts = [json.dumps(value).encode()]
    with contextlib.suppress(UnicodeEncodeError):
        raw = json.dumps(value, ensure_ascii=False).encode()
        if raw != texts[0]:
            texts.append(raw)
    return texts


def _integral(value: Any) -> Any:
    """A JSON value with every integral number an int, at any depth (1.0 is 1 to JSON Schema; true stays true)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral(item) for item in value]
    if isinstance(value, dict):
        return {key: _integral(item) for key, item in value.items()}
    return value


def json_identity(value: Any) -> str:
    """A text two JSON values share exactly where JSON Schema holds them equal (true is not 1, 1.0 is 1 at any depth,
    key order does not matter)."""
    return json.dumps(_integral(value), sort_keys=True)


def same_json(first: Any, second: Any) -> bool:
    """Whether two JSON values are equal, as JSON Schema compares them."""
    return json_identity(first) == json_identity(second)


def is_json_type(value: Any, name: str) -> bool:
    """Whether a Python value from JSON is of a JSON Schema type (1.0 is an integer, true is not)."""
    if isinstance(value, bool):
        return name == "boolean"
    if name == "integer":
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    return name in PYTHON_TYPES and isinstance(value, PYTHON_TYPES[name])


def json_grammar(schema: dict | bool | None = None) -> Grammar:
    """None: any JSON object (response_format json_object); a dict: a JSON Schema (subset below); True: any JSON value.

    The document starts and ends with its value (no whitespace around it, which a model could spend its tokens on);
    whitespace runs inside it are at most MAX_WHITESPACE bytes and values nest at most MAX_DEPTH deep; SchemaCompiler
    tells the keywords honoured. Errors in a schema name its JSON pointer ('' for the root)."""
    network = Network("")
    entry, exit_node = network.routine()
    if schema is None or schema is True:
        builder = JsonBuilder(network)
        value: Emit = builder.any_object if schema is None else builder.any_value
    else:
        builder = SchemaCompiler(network, schema)
        value = builder.root_value
    network.epsilon(value(entry), exit_node)
    return Grammar(network, entry)
