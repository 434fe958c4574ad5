"""Grammars for guided decoding (JSON, a JSON Schema subset, regular expressions, fixed choices), matched a byte at a
time: outputs are UTF-8 and a byte-level token may end inside a character."""

from __future__ import annotations

import json
import math
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from decimal import Decimal
from functools import partial
from typing import Any

from server.grammar_formats import FORMAT_PATTERNS
from server.grammar_numbers import (
    MAX_BOUND_DIGITS,
    Bound,
    NumberAutomaton,
    bound_digits,
    bounded_numbers,
    multiples_of,
)
from server.grammar_runs import RUN_COPIES, Copy, Runs
from server.grammar_utf8 import FIRST_WIDE, LAST_CODE, CodeRanges, complement, merged, utf8_sequences

State = frozenset[tuple[int, ...]]
"""Where a match stands: stacks, each the return nodes of the calls in progress followed by the current node."""

Emit = Callable[[int], int]
"""Adds one part of a grammar to a network from a start node and answers the node where the part ends."""

MAX_DEPTH = 64  # calls in progress at once: nested JSON containers, items of counted arrays, $ref recursion
MAX_STACKS = 10_000  # stacks one state may hold; only wildly ambiguous grammars come near it
MAX_NODES = 200_000
MAX_CLOSURE_WORK = 4_000_000  # states one lookahead's automaton may visit in all (a nested counted one is refused)
MAX_REPEAT = 1000  # the largest repeat count or item count
MAX_STRING_LENGTH = 4096  # the largest minLength or maxLength (pydantic's HttpUrl has 2083)
MAX_MULTIPLE = 1000  # the largest multipleOf in its last digit's units (a state for each remainder, beside each state
# of the number's automaton)
MAX_UNIQUE_VALUES = 8  # the most values unique items may choose among (a node per subset of them)
SHARED_STRING_LENGTH = 256  # strings allowed more characters than this share one routine per pair of lengths
MAX_WHITESPACE = 20  # bytes in one run of JSON whitespace, so that a model cannot loop on it
STEP_CACHE_STATES = 65_536

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
REPEAT_COUNT = re.compile(r"\{([0-9]*)(,?)([0-9]*)\}")


class GrammarError(ValueError):
    """A schema, pattern or choice list that cannot be compiled; `where` names the part at fault (a JSON pointer
    into the schema like '/properties/age/minimum', or 'pattern', or 'choice[2]')."""

    def __init__(self, message: str, where: str) -> None:
        super().__init__(message)
        self.where = where


def bits(values: Iterable[int]) -> int:
    """A byte or ASCII set as a bit mask: bit b set for each value b."""
    mask = 0
    for value in values:
        mask |= 1 << value
    return mask


def members(mask: int) -> list[int]:
    """The values whose bits a mask sets, in order."""
    return [value for value in range(mask.bit_length()) if mask >> value & 1]


ASCII = (1 << 128) - 1
DIGITS = bits(b"0123456789")
NONZERO_DIGITS = bits(b"123456789")
HEX_DIGITS = bits(b"0123456789abcdefABCDEF")
WHITESPACE = bits(b" \t\n\r")
CONTINUATION = bits(range(0x80, 0xC0))
LEADS = ((bits(range(0xC2, 0xE0)), 1), (bits(range(0xE0, 0xF0)), 2), (bits(range(0xF0, 0xF5)), 3))
STRING_ASCII = bits(byte for byte in range(0x20, 0x80) if byte not in b'"\\')  # unescaped in a JSON string
SIMPLE_ESCAPES = bits(b'"\\/bfnrt')


def pointer_to(pointer: str, *keys: str | int) -> str:
    """A JSON pointer extended by keys, each escaped (~ as ~0, / as ~1)."""
    return pointer + "".join("/" + str(key).replace("~", "~0").replace("/", "~1") for key in keys)


def local_definition(reference: Any) -> tuple[str, str] | None:
    """The (section, name) a '#/$defs/NAME' or '#/definitions/NAME' reference names; None for any other."""
    match = REFERENCE.fullmatch(reference) if isinstance(reference, str) else None
    return None if match is None else (match.group(1), match.group(2).replace("~1", "/").replace("~0", "~"))


class Network:
    """A recursive transition network under construction: nodes joined by byte-class, epsilon and call edges. Each
    routine (a sub-network that calls enter) has one exit node, where it returns to its caller."""

    def __init__(self, blame: str) -> None:
        self.blame = blame  # the `where` of the error a grammar too large to build gets
        self.size = 0
        self.moves: dict[int, list[tuple[int, int]]] = {}
        self.epsilons: dict[int, list[int]] = {}
        self.calls: dict[int, list[tuple[int, int]]] = {}
        self.exits: set[int] = set()
        self.runs: list[list[Copy]] = []  # each counted repeat's copies of its part, in order

    def node(self) -> int:
        """A new node."""
        if self.size >= MAX_NODES:
            raise GrammarError("the grammar is too large for guided decoding", self.blame)
        self.size += 1
        return self.size - 1

    def routine(self) -> tuple[int, int]:
        """A new routine's entry and exit nodes."""
        entry, exit_node = self.node(), self.node()
        self.exits.add(exit_node)
        return entry, exit_node

    def move(self, source: int, mask: int, target: int | None = None) -> int:
        """An edge taken on any byte of the mask, to `target` (a new node where None); answers the target."""
        target = self.node() if target is None else target
        self.moves.setdefault(source, []).append((mask, target))
        return target

    def epsilon(self, source: int, target: int) -> None:
        """An edge taken without a byte."""
        self.epsilons.setdefault(source, []).append(target)

    def call(self, source: int, entry: int) -> int:
        """A call of the routine entered at `entry`; answers the node it returns to."""
        target = self.node()
        self.calls.setdefault(source, []).append((entry, target))
        return target

    def literal(self, start: int, data: bytes) -> int:
        """The bytes in order."""
        for byte in data:
            start = self.move(start, 1 << byte)
        return start

    def literals(self, start: int, texts: Iterable[bytes]) -> int:
        """Any one of the byte strings, laid out as a trie so that a prefix they share has one node."""
        end = self.node()
        branches: dict[tuple[int, int], int] = {}
        for text in dict.fromkeys(texts):
            node = start
            for byte in text:
                if (node, byte) not in branches:
                    branches[node, byte] = self.move(node, 1 << byte)
                node = branches[node, byte]
            self.epsilon(node, end)
        return end

    def either(self, start: int, parts: list[Emit]) -> int:
        """Any one of the parts."""
        if len(parts) == 1:
            return parts[0](start)
        end = self.node()
        for part in parts:
            self.epsilon(part(start), end)
        return end

    def repeat(self, start: int, part: Emit, least: int, most: int | None) -> int:
        """The part `least` times, then more up to `most` times in all (any number where None); the required
        copies and the optional ones are kept as two runs (grammar_runs.py)."""
        copies: list[Copy] = []

        def copy(node: int) -> int:
            first = self.size
            end = part(node)
            copies.append(Copy(node, first, self.size, end))
            return end

        for _ in range(least):
            start = copy(start)
        self._keep_run(copies)
        end = self.node()
        if most is None:  # a loop: `end` takes the part again
            self.epsilon(start, end)
            self.epsilon(part(end), end)
            return end
        copies = []
        for _ in range(most - least):  # nested, (x(x)?)? rather than x?x?, so that each count has one path
            self.epsilon(start, end)
            start = copy(start)
        self.epsilon(start, end)
        self._keep_run(copies)
        return end

    def _keep_run(self, copies: list[Copy]) -> None:
        """Keep a repeat's required or optional copies as a run, where there are enough to be worth indexing."""
        if len(copies) >= RUN_COPIES:
            self.runs.append(copies)

    def optional(self, start: int, part: Emit) -> int:
        """The part or nothing."""
        return self.repeat(start, part, 0, 1)


def utf8_char(network: Network, start: int, end: int) -> None:
    """Edges from `start` to `end` over any one non-ASCII UTF-8 character. Only the structure is checked (a lead byte
    and its count of continuation bytes): overlong three- and four-byte forms and encoded surrogates pass."""
    after = end
    needing = []  # needing[n]: the node where n + 1 continuation bytes are still to come
    for _ in range(3):
        before = network.node()
        network.move(before, CONTINUATION, after)
        needing.append(before)
        after = before
    for mask, continuations in LEADS:
        network.move(start, mask, needing[continuations - 1])


def wide_chars(network: Network, start: int, ranges: CodeRanges, end: int) -> None:
    """Edges from `start` to `end` over any one character of the non-ASCII code point ranges, in well-formed UTF-8
    (`utf8_char` takes every non-ASCII character more loosely)."""
    branches: dict[tuple[int, int], int] = {}
    last_moves: set[tuple[int, int]] = set()
    for low, high in ranges:
        for sequence in utf8_sequences(low, high):
            node = start
            for first, last in sequence[:-1]:
                mask = bits(range(first, last + 1))
                if (node, mask) not in branches:
                    branches[node, mask] = network.move(node, mask)
                node = branches[node, mask]
            first, last = sequence[-1]
            last_moves.add((node, bits(range(first, last + 1))))
    for node, mask in sorted(last_moves):
        network.move(node, mask, end)


def live_nodes(network: Network) -> set[int]:
    """The nodes from which the exit of their routine can be reached: through byte and epsilon edges, and calls of
    routines whose entry is live (that can return)."""
    sources: dict[int, list[int]] = {}  # node -> the nodes with a byte or epsilon edge to it
    for source, moves in network.moves.items():
        for _, target in moves:
            sources.setdefault(target, []).append(source)
    for source, targets in network.epsilons.items():
        for target in targets:
            sources.setdefault(target, []).append(source)
    calls: dict[int, list[tuple[int, int, int]]] = {}  # entry or return node -> (source, entry, return) of its calls
    for source, edges in network.calls.items():
        for entry, back in edges:
            calls.setdefault(entry, []).append((source, entry, back))
            calls.setdefault(back, []).append((source, entry, back))
    live: set[int] = set()
    pending = list(network.exits)
    while pending:
        node = pending.pop()
        if node in live:
            continue
        live.add(node)
        pending.extend(sources.get(node, ()))
        pending.extend(source for source, entry, back in calls.get(node, ()) if entry in live and back in live)
    return live


_UNKNOWN: Any = object()  # a step not cached yet
StepEntry = tuple[State, dict[int, "State | None"], list[int], set[int]]
"""A state's cache entry: its interned copy, its steps by byte, [the most stacks one of those steps' closures
visited], and the bytes whose steps the cap on stacks refused."""


class Grammar:
    """A compiled grammar; immutable and hashable states; safe to share between threads for reading."""

    def __init__(self, network: Network, entry: int) -> None:
        live = live_nodes(network)
        if entry not in live:
            raise GrammarError("the grammar admits no complete output", network.blame)
        nodes = range(network.size)
        # edges into nodes that cannot finish are dropped, so that no state is a dead end (the depth limit aside)
        self._moves = tuple(tuple(edge for edge in network.moves.get(node, ()) if edge[1] in live) for node in nodes)
        self._epsilons = tuple(tuple(t for t in network.epsilons.get(node, ()) if t in live) for node in nodes)
        self._calls = tuple(
            tuple(call for call in network.calls.get(node, ()) if call[0] in live and call[1] in live) for node in nodes
        )
        self._exits = frozenset(network.exits)
        self._runs = Runs.of(
            network.runs, list(zip(self._moves, self._epsilons, self._calls, strict=True)), self._exits
        )
        self._steps: dict[State, StepEntry] = {}
        self._lock = threading.Lock()
        initial, _ = self._close([(entry,)])
        if initial is None:
            raise GrammarError("the grammar is too ambiguous to match", network.blame)
        self.initial: State = self._interned(initial)[0]

    def __getstate__(self) -> dict[str, Any]:
        """The compiled network and the initial state, for a pickle (the step cache and its lock stay behind)."""
        return {name: value for name, value in self.__dict__.items() if name not in ("_steps", "_lock")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A pickled grammar with an empty step cache of its own."""
        self.__dict__.update(state)
        self._steps, self._lock = {}, threading.Lock()
        self._interned(self.initial)

    def step(self, state: State, byte: int) -> State | None:
        """The state after one more byte; None where the byte cannot come next."""
        entry = self._steps.get(state)
        if entry is not None:
            after = entry[1].get(byte, _UNKNOWN)
            if after is not _UNKNOWN:
                return after
        return self._remember(state, byte, *self._advance(state, byte))

    def feed(self, state: State, data: bytes) -> State | None:
        """The state after the bytes in order; None as soon as one cannot come next."""
        for byte in data:
            state = self.step(state, byte)
            if state is None:
                return None
        return state

    def accepts(self, state: State) -> bool:
        """Whether the bytes so far are a complete match."""
        return any(len(stack) == 1 and stack[0] in self._exits for stack in state)

    def stand_in(self, state: State, horizon: int) -> State:
        """A state that takes the same byte strings of up to `horizon` bytes as `state`, and accepts where it does:
        each node inside a long counted repeat moved to the copy that stands for it (so `{1000}` or a `maxLength`
        meets few distinct ones), else `state` itself."""
        if not self._runs:
            return state
        return frozenset(tuple(self._runs.canonical(node, horizon) for node in stack) for stack in state)

    def candidates(self, state: State) -> int:
        """The bytes some edge takes from `state`, as a bit mask (the grammar may still refuse some of them)."""
        candidates = 0
        for stack in state:
            for mask, _ in self._moves[stack[-1]]:
                candidates |= mask
        return candidates

    def can_continue(self, state: State) -> bool:
        """Whether some byte may still come next."""
        return any(self.step(state, byte) is not None for byte in members(self.candidates(state)))

    def width(self, state: State) -> int:
        """The most stacks a closure visited in the steps from `state` worked out so far (0 where none is cached):
        how near the state's next bytes came to MAX_STACKS."""
        entry = self._steps.get(state)
        return 0 if entry is None else entry[2][0]

    def refused_by_cap(self, state: State, byte: int) -> bool:
        """Whether the step from `state` on `byte`, just worked out or read by `step`, was refused because its
        closure passed MAX_STACKS (so a byte the grammar takes looks refused)."""
        entry = self._steps.get(state)
        return entry is not None and byte in entry[3]

    def _advance(self, state: State, byte: int) -> tuple[State | None, int]:
        """The state after a byte, worked out from the network, and the stacks its closure visited."""
        moved = []
        for stack in state:
            for mask, target in self._moves[stack[-1]]:
                if mask >> byte & 1:
                    moved.append((*stack[:-1], target))
        return self._close(moved) if moved else (None, 0)

    def _close(self, stacks: list[tuple[int, ...]]) -> tuple[State | None, int]:
        """The stacks reachable without a byte (epsilon edges, calls, returns), keeping those that can take a byte
        or have matched everything (None where there are none, or too many to follow), and how many it visited."""
        seen: set[tuple[int, ...]] = set()
        kept = []
        while stacks:
            stack = stacks.pop()
            if stack in seen:
                continue
            seen.add(stack)
            if len(seen) > MAX_STACKS:
                return None, len(seen)
            node, below = stack[-1], stack[:-1]
            if self._moves[node] or (not below and node in self._exits):
                kept.append(stack)
            stacks.extend((*below, target) for target in self._epsilons[node])
            if len(stack) <= MAX_DEPTH:
                stacks.extend((*below, back, entry) for entry, back in self._calls[node])
            if below and node in self._exits:
                stacks.append(below)
        return frozenset(kept) or None, len(seen)

    def _remember(self, state: State, byte: int, after: State | None, width: int) -> State | None:
        """Cache a step and the stacks its closure visited, answering the interned copy of the state it leads to."""
        with self._lock:
            if after is not None:
                after = self._interned(after)[0]
            entry = self._interned(state)
            entry[1][byte] = after
            entry[2][0] = max(entry[2][0], width)
            if after is None and width > MAX_STACKS:
                entry[3].add(byte)
        return after

    def _interned(self, state: State) -> StepEntry:
        """The cache entry of a state, made where missing (the oldest entry goes when the cache is full)."""
        entry = self._steps.get(state)
        if entry is None:
            if len(self._steps) >= STEP_CACHE_STATES:
                del self._steps[next(iter(self._steps))]
            entry = self._steps[state] = (state, {}, [0], set())
        return entry


class JsonBuilder:
    """Adds JSON text to a network: whitespace, strings, numbers, literals, and any value, object or array (nested
    values through calls, so that the nesting is bounded by MAX_DEPTH)."""

    def __init__(self, network: Network) -> None:
        self.network = network
        self._object_body: int | None = None  # entry of the routine for any object after its '{'
        self._array_body: int | None = None

    def whitespace(self, start: int) -> int:
        """A run of 0 to MAX_WHITESPACE JSON whitespace bytes."""
        return self.network.repeat(start, partial(self.network.move, mask=WHITESPACE), 0, MAX_WHITESPACE)

    def string_char(self, start: int) -> int:
        """One character of a JSON string's content: unescaped, a short escape, or \\u escapes."""
        network = self.network
        end = network.move(start, STRING_ASCII)
        utf8_char(network, start, end)
        escape = network.move(start, 1 << ord("\\"))
        network.move(escape, SIMPLE_ESCAPES, end)
        self._code_unit(network.move(escape, 1 << ord("u")), end)
        return end

    def _code_unit(self, start: int, end: int) -> None:
        """Edges from just after a \\u to `end` over the hex digits of one character: not a surrogate, or a high
        surrogate then \\u and a low one (one character, as json.dumps writes one outside the BMP); a lone
        surrogate is refused."""
        network = self.network
        self._hex(network.move(start, HEX_DIGITS & ~bits(b"dD")), 3, end)
        first_d = network.move(start, bits(b"dD"))
        self._hex(network.move(first_d, bits(b"01234567")), 2, end)
        high = self._hex(network.move(first_d, bits(b"89abAB")), 2)
        low = network.move(network.literal(high, b"\\u"), bits(b"dD"))
        self._hex(network.move(low, bits(b"cdefCDEF")), 2, end)

    def _hex(self, start: int, count: int, end: int | None = None) -> int:
        """`count` hex digits, the last one to `end` (a new node where None)."""
        for _ in range(count - 1):
            start = self.network.move(start, HEX_DIGITS)
        return self.network.move(start, HEX_DIGITS, end)

    def string(self, start: int, least: int = 0, most: int | None = None) -> int:
        """A JSON string of `least` to `most` characters (any number where None)."""
        content = self.network.repeat(self.network.literal(start, b'"'), self.string_char, least, most)
        return self.network.literal(content, b'"')

    def number(self, start: int, integer: bool = False) -> int:
        """A JSON number; an integer (no fraction or exponent) where `integer`."""
        network = self.network
        signed = network.optional(start, partial(network.literal, data=b"-"))
        whole = network.move(signed, 1 << ord("0"))
        network.epsilon(network.repeat(network.move(signed, NONZERO_DIGITS), self._digit, 0, None), whole)
        if integer:
            return whole
        return network.optional(network.optional(whole, self._fraction), self._exponent)

    def any_value(self, start: int) -> int:
        """Any JSON value."""
        words = [partial(self.network.literal, data=word) for word in (b"true", b"false", b"null")]
        return self.network.either(start, [self.string, self.number, self.any_object, self.any_array, *words])

    def any_object(self, start: int) -> int:
        """Any JSON object."""
        if self._object_body is None:
            entry, exit_node = self.network.routine()
            self._object_body = entry
            self.network.epsilon(self.listing(entry, self.any_member, b"}"), exit_node)
        return self.network.call(self.network.literal(start, b"{"), self._object_body)

    def any_array(self, start: int) -> int:
        """Any JSON array."""
        if self._array_body is None:
            entry, exit_node = self.network.routine()
            self._array_body = entry
            self.network.epsilon(self.listing(entry, self.any_value, b"]"), exit_node)
        return self.network.call(self.network.literal(start, b"["), self._array_body)

    def any_member(self, start: int) -> int:
        """An object member of any key and value."""
        return self.member(self.string(start), self.any_value)

    def member(self, key_end: int, value: Emit) -> int:
        """The rest of an object member after its key: the colon and the value."""
        return value(self.whitespace(self.network.literal(self.whitespace(key_end), b":")))

    def listing(self, start: int, item: Emit, closing: bytes) -> int:
        """Any number of items joined by commas, then the closing bracket; `start` is just after the opening one."""
        network = self.network
        inside = self.whitespace(start)
        item_start, end = network.node(), network.node()
        network.epsilon(inside, item_start)
        network.move(inside, 1 << closing[0], end)
        after = self.whitespace(item(item_start))
        network.epsilon(self.whitespace(network.literal(after, b",")), item_start)
        network.move(after, 1 << closing[0], end)
        return end

    def separator(self, start: int) -> int:
        """A comma between two items, with whitespace around it."""
        return self.whitespace(self.network.literal(self.whitespace(start), b","))

    def _digit(self, start: int) -> int:
        """One decimal digit."""
        return self.network.move(start, DIGITS)

    def _digits(self, start: int) -> int:
        """One or more decimal digits."""
        return self.network.repeat(start, self._digit, 1, None)

    def _fraction(self, start: int) -> int:
        """A number's fraction: a point, digits."""
        return self._digits(self.network.literal(start, b"."))

    def _exponent(self, start: int) -> int:
        """A number's exponent: e or E, a sign or none, digits."""
        marked = self.network.move(start, bits(b"eE"))
        return self._digits(self.network.optional(marked, partial(self.network.move, mask=bits(b"+-"))))


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
        if schema is False:
            raise GrammarError("a false schema admits no value", pointer)
        if not isinstance(schema, dict):
            raise GrammarError("a schema must be a JSON object or a boolean", pointer)
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
        kept = [(option, pointer_to(where, i)) for i, option in enumerate(options)]
        kept = [(option, at) for option, at in kept if not self._admits_all(self._resolved(option, at)[0])]
        if len(kept) <= 1:  # compiled as written, so that a $ref is a call of its routine
            return self.value(start, *kept[0]) if kept else self.any_value(start)
        parts = [self._resolved(option, at) for option, at in kept]
        for part, at in parts:
            if not isinstance(part, dict):
                message = (
                    "a false schema admits no value" if part is False else "a schema must be a JSON object or a boolean"
                )
                raise GrammarError(message, at)
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
        """One of the values of `enum` or `const` (those of the declared type), written as json.dumps writes it."""
        return self.network.literals(
            start, [json.dumps(value).encode() for value in self._constant_values(schema, pointer)]
        )

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
            raise GrammarError("a schema must be a JSON object or a boolean", where)
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
        items = []
        for text in texts:
            entry, exit_node = self.network.routine()
            self.network.epsilon(self.network.literal(entry, text), exit_node)
            items.append(partial(self.network.call, entry=entry))
        return self._distinct(start, b"[]", items, least, most)

    def _listed_values(self, items: Any, pointer: str, where: str) -> list[bytes]:
        """The texts of the few values an item may be (an enum, a const, a boolean or null, through $refs), each
        once; anything else is refused naming `where`."""
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
        texts: dict[str, bytes] = {}  # each value's identity (1.0 is 1 to JSON Schema) -> its text
        for value in values:
            same = int(value) if isinstance(value, float) and value.is_integer() else value
            texts.setdefault(json.dumps(same, sort_keys=True), json.dumps(value).encode())
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


def same_json(first: Any, second: Any) -> bool:
    """Whether two JSON values are equal (true is not 1, key order does not matter)."""
    return json.dumps(first, sort_keys=True) == json.dumps(second, sort_keys=True)


def is_json_type(value: Any, name: str) -> bool:
    """Whether a Python value from JSON is of a JSON Schema type (1.0 is an integer, true is not)."""
    if isinstance(value, bool):
        return name == "boolean"
    if name == "integer":
        return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    return name in PYTHON_TYPES and isinstance(value, PYTHON_TYPES[name])


@dataclass(frozen=True, slots=True)
class Chars:
    """A set of characters: the ASCII ones as a bit mask, and the non-ASCII ones as code point ranges."""

    ascii: int
    wide: CodeRanges = ()

    @staticmethod
    def span(low: int, high: int) -> Chars:
        """The code points from low to high."""
        ascii_part = bits(range(low, min(high, 0x7F) + 1))
        return Chars(ascii_part, ((max(low, FIRST_WIDE), high),) if high >= FIRST_WIDE else ())

    def __or__(self, other: Chars) -> Chars:
        """The characters of either set."""
        return Chars(self.ascii | other.ascii, merged(self.wide + other.wide))

    def negated(self) -> Chars:
        """Every character not in the set."""
        return Chars(ASCII & ~self.ascii, complement(self.wide))

    def __and__(self, other: Chars) -> Chars:
        """The characters of both sets."""
        return (self.negated() | other.negated()).negated()

    def __bool__(self) -> bool:
        """Whether the set holds a character."""
        return bool(self.ascii or self.wide)


@dataclass(frozen=True, slots=True)
class Text:
    """A literal non-ASCII character."""

    char: str


@dataclass(frozen=True, slots=True)
class Concat:
    """Parts one after another."""

    parts: tuple[RegexNode, ...]


@dataclass(frozen=True, slots=True)
class Alternation:
    """Any one of the options."""

    options: tuple[RegexNode, ...]


@dataclass(frozen=True, slots=True)
class Repeat:
    """A part `least` to `most` times (any number where None)."""

    part: RegexNode
    least: int
    most: int | None


@dataclass(frozen=True, slots=True)
class Ahead:
    """A lookahead where it stands inside a pattern: the rest of the string must match one of its options (or, where
    `negative`, none of them), from there."""

    options: tuple[LookOption, ...]
    negative: bool


RegexNode = Chars | Text | Concat | Alternation | Repeat | Ahead


@dataclass(frozen=True, slots=True)
class LookOption:
    """An option of a lookahead at a top-level option's start: a match of `tree` begins the string, or where `whole`
    (the option ended in '$', and `tree` ends in the newline '$' may stand before) is all of it."""

    tree: RegexNode
    whole: bool


@dataclass(frozen=True, slots=True)
class Guarded:
    """A top-level option of a pattern: the strings of `tree` that none of the exclusions before it (negative
    lookaheads' options, (?!a|b) as (?!a)(?!b)) matches, and that each requirement (a positive lookahead, any one of
    its options) matches."""

    tree: RegexNode
    exclusions: tuple[LookOption, ...] = ()
    requirements: tuple[tuple[LookOption, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class Pattern:
    """A parsed pattern: the strings of any of its top-level options."""

    options: tuple[Guarded, ...]


EVERY_WIDE = ((FIRST_WIDE, LAST_CODE),)
ANY_BUT_NEWLINE = Chars(ASCII & ~(1 << ord("\n")), EVERY_WIDE)
EVERY_CHAR = Chars(ASCII, EVERY_WIDE)
CLASS_ESCAPES = {
    "d": Chars(DIGITS),
    "w": Chars(bits(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_")),
    "s": Chars(bits(b" \t\n\r\f\v")),
}
CLASS_ESCAPES |= {name.upper(): chars.negated() for name, chars in CLASS_ESCAPES.items()}
CHAR_ESCAPES = {"n": "\n", "t": "\t", "r": "\r"}


def other_keys(names: Iterable[str]) -> Pattern:
    """Strings of any characters other than the names (each excluded as the whole string)."""
    excluded = (LookOption(Concat(tuple(Chars.span(ord(c), ord(c)) for c in name)), whole=True) for name in names)
    return Pattern((Guarded(Repeat(EVERY_CHAR, 0, None), tuple(excluded)),))


class RegexParser:
    """Parses the regex subset guided decoding supports into a tree (\\d, \\w and \\s are ASCII only, as under
    re.ASCII); anything else is refused with a GrammarError naming `where`."""

    def __init__(self, pattern: str, where: str) -> None:
        self.pattern = pattern
        self.where = where
        self.position = 0
        self.depth = 0  # groups open
        self.excluding = False  # in a lookahead, where a '$' may end an option
        self.excluded_whole = False  # the lookahead's option being parsed ended in '$'

    def parse(self) -> Pattern:
        """The whole pattern, option by option; a leading '^' and a '$' where a match ends are dropped, as the match is
        always whole; lookaheads at an option's start (negative ones as in pydantic's Decimal pattern, positive ones as
        in a password's rules) guard that option, and those inside (condecimal's) are `Ahead` nodes."""
        if self.pattern.startswith("^"):
            self.position = 1
        options = [self._guarded()]
        while self._accept("|"):
            options.append(self._guarded())
        if self.position < len(self.pattern):
            raise self._error("unbalanced ')'")
        return Pattern(tuple(options))

    def _guarded(self) -> Guarded:
        """A top-level option and the lookaheads it opens with."""
        exclusions: list[LookOption] = []
        requirements: list[tuple[LookOption, ...]] = []
        while True:
            if self._accept("(?!"):
                exclusions += self._look_options()
            elif self._accept("(?="):
                requirements.append(tuple(self._look_options()))
            else:
                return Guarded(self._sequence(), tuple(exclusions), tuple(requirements))

    def _look_options(self) -> list[LookOption]:
        """A lookahead's options after its '(?!' or '(?=', to its ')'; a '^' may open the lookahead and a '$' end an
        option, outside any group."""
        self._accept("^")
        exclusions, self.excluding = [], True
        while True:
            self.excluded_whole = False
            tree = self._sequence()
            if self.excluded_whole:  # Python's '$' also matches before a newline that ends the string
                tree = Concat((tree, Repeat(Chars(1 << ord("\n")), 0, 1)))
            exclusions.append(LookOption(tree, self.excluded_whole))
            if not self._accept("|"):
                break
        self.excluding = False
        if not self._accept(")"):
            raise self._error("missing ')'")
        return exclusions

    def _error(self, message: str) -> GrammarError:
        """A GrammarError at the current position."""
        return GrammarError(f"{message} at position {self.position} of the pattern", self.where)

    def _peek(self) -> str | None:
        """The next character, not taken."""
        return self.pattern[self.position] if self.position < len(self.pattern) else None

    def _take(self) -> str:
        """The next character, taken; the end of the pattern is an error."""
        char = self._peek()
        if char is None:
            raise self._error("unexpected end")
        self.position += 1
        return char

    def _accept(self, text: str) -> bool:
        """Take `text` if it comes next."""
        if self.pattern.startswith(text, self.position):
            self.position += len(text)
            return True
        return False

    def _alternation(self) -> RegexNode:
        """Sequences joined by '|'."""
        options = [self._sequence()]
        while self._accept("|"):
            options.append(self._sequence())
        return options[0] if len(options) == 1 else Alternation(tuple(options))

    def _sequence(self) -> RegexNode:
        """Repeated atoms up to a '|', a ')' or the end."""
        parts = []
        while (char := self._peek()) is not None and char not in "|)":
            if char == "$" and not self.excluding and self._ends_whole_match():
                self.position += 1  # the match is whole anyway
                continue
            if char == "$" and self._ends_excluded_option():
                self.position += 1
                self.excluded_whole = True
                continue
            parts.append(self._repeated())
        return parts[0] if len(parts) == 1 else Concat(tuple(parts))

    def _ends_whole_match(self) -> bool:
        """Whether the '$' here ends what a match takes: only the ')'s of the groups open follow it, then the end of
        the pattern or a '|' of its top level."""
        rest = self.pattern[self.position + 1 :]
        closing = len(rest) - len(rest.lstrip(")"))
        return closing == self.depth and rest[closing : closing + 1] in ("", "|")

    def _ends_excluded_option(self) -> bool:
        """Whether the '$' here ends an option of a lookahead (a '|' or its ')' comes next, outside any group)."""
        following = self.pattern[self.position + 1 : self.position + 2]
        return self.excluding and self.depth == 0 and following != "" and following in "|)"

    def _repeated(self) -> RegexNode:
        """An atom and its quantifier, if any (a lazy one matches the same whole strings)."""
        atom = self._atom()
        bounds = self._quantifier()
        if bounds is None:
            return atom
        self._accept("?")
        if (char := self._peek()) is not None and char in "*+?{":
            raise self._error("a repeat of a repeat (possessive or nested quantifiers) is not supported")
        if bounds[1] != 1 and has_ahead(atom):
            raise self._error("a lookahead inside a repeat is not supported")
        return Repeat(atom, *bounds)

    def _quantifier(self) -> tuple[int, int | None] | None:
        """The bounds of a quantifier taken here, or None."""
        for symbol, bounds in (("*", (0, None)), ("+", (1, None)), ("?", (0, 1))):
            if self._accept(symbol):
                return bounds
        if self._peek() != "{":
            return None
        match = REPEAT_COUNT.match(self.pattern, self.position)
        if match is None or not (match.group(1) or match.group(3)):
            raise self._error("a '{' that does not start a repeat count must be escaped")
        self.position = match.end()
        if max(len(match.group(n).lstrip("0")) for n in (1, 3)) > len(str(MAX_REPEAT)):  # not read: of any length
            raise self._error(f"repeat counts above {MAX_REPEAT} are not supported")
        least = int(match.group(1) or 0)
        most = least if not match.group(2) else (int(match.group(3)) if match.group(3) else None)
        if max(least, most or 0) > MAX_REPEAT:
            raise self._error(f"repeat counts above {MAX_REPEAT} are not supported")
        if most is not None and least > most:
            raise self._error("a repeat's minimum is above its maximum")
        return least, most

    def _atom(self) -> RegexNode:
        """A group, class, '.', escape or literal character."""
        char = self._take()
        if char in "*+?{":
            raise self._error(f"nothing to repeat before '{char}'")
        if char == "(":
            return self._group()
        if char == "[":
            return self._char_class()
        if char == ".":
            return ANY_BUT_NEWLINE
        if char in "^$":
            raise self._error("'^' is only accepted at the start, and '$' where a match ends")
        if char == "\\":
            return self._char(self._escape())
        if 0xD800 <= ord(char) <= 0xDFFF:
            raise self._error("a lone surrogate is not a character")
        return self._char(char)

    def _group(self) -> RegexNode:
        """A group's content, after its '(': plain, non-capturing or named, or a lookahead (`Ahead`)."""
        for opening, negative in (("?=", False), ("?!", True)):
            if self._accept(opening):
                if self.excluding:
                    raise self._error("a lookahead inside a lookahead is not supported")
                depth, self.depth = self.depth, 0  # a '$' ends the lookahead's options at its own top level
                options = self._look_options()
                self.depth = depth
                return Ahead(tuple(options), negative)
        if self._accept("?") and not self._accept(":"):
            self._group_name()
        self.depth += 1
        tree = self._alternation()
        self.depth -= 1
        if not self._accept(")"):
            raise self._error("missing ')'")
        return tree

    def _group_name(self) -> None:
        """Take a group's name after its '(?': 'P<name>' or '<name>'; lookarounds, flags and the rest are refused."""
        if not (self._accept("P<") or self._accept("<")) or (self._peek() or "=") in "=!":
            raise self._error(
                "only (?:...), named groups, (?!...) and (?=...) are supported (no lookbehinds, flags or references)"
            )
        name, closed, _ = self.pattern[self.position :].partition(">")
        if not closed or not name.isidentifier():
            raise self._error("a group name must be an identifier followed by '>'")
        self.position += len(name) + 1

    def _char_class(self) -> Chars:
        """A class's characters, after its '[' (a ']' first is a member, as in Python)."""
        negate = self._accept("^")
        chars = Chars(0)
        first = True
        while (char := self._take()) != "]" or first:
            first = False
            low = self._class_member(char)
            if isinstance(low, Chars):
                chars |= low
            elif self._peek() == "-" and self.pattern[self.position + 1 : self.position + 2] not in ("", "]"):
                self.position += 1
                high = self._class_member(self._take())
                if isinstance(high, Chars) or ord(high) < ord(low):
                    raise self._error("bad class range")
                chars |= Chars.span(ord(low), ord(high))
            else:
                chars |= Chars.span(ord(low), ord(low))
        return chars.negated() if negate else chars

    def _class_member(self, char: str) -> Chars | str:
        """A class member: a shorthand class or one character."""
        return self._escape() if char == "\\" else char

    def _escape(self) -> Chars | str:
        """What an escape after its backslash stands for: a shorthand class or one character."""
        char = self._take()
        if char in CLASS_ESCAPES:
            return CLASS_ESCAPES[char]
        if char in CHAR_ESCAPES:
            return CHAR_ESCAPES[char]
        if char in "ux":
            digits = self.pattern[self.position : self.position + (4 if char == "u" else 2)]
            if len(digits) != (4 if char == "u" else 2) or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise self._error(f"'\\{char}' needs {4 if char == 'u' else 2} hex digits")
            self.position += len(digits)
            code = int(digits, 16)
            if 0xD800 <= code < 0xE000:
                raise self._error("a surrogate is not a character")
            return chr(code)
        if char.isascii() and not char.isalnum():
            return char
        raise self._error(f"'\\{char}' is not supported")

    def _char(self, member: Chars | str) -> RegexNode:
        """The tree of one matched character or shorthand class."""
        if isinstance(member, Chars):
            return member
        return Chars(1 << ord(member)) if member.isascii() else Text(member)


class CharacterAutomaton:
    """A regex tree as states joined by single characters (a Chars or Text each) and epsilons, from `first` to
    `last`; counted repeats are laid out copy by copy."""

    def __init__(self, tree: RegexNode, where: str) -> None:
        self.where = where  # the pattern's place, which a pattern too large to lay out is refused naming
        self.size = 0
        self.work = 0  # states its closures have visited
        self.moves: dict[int, list[tuple[Chars | Text, int]]] = {}
        self.epsilons: dict[int, list[int]] = {}
        self.aheads: list[Ahead] = []  # the lookaheads inside, in the order laid out
        self.marks: dict[tuple[int, int], int] = {}  # an epsilon where a lookahead stands -> its index in `aheads`
        self.first = self._state()
        self.last = self._build(self.first, tree)

    def closure(self, states: set[int]) -> frozenset[int]:
        """The states and those their epsilons reach (refused past MAX_CLOSURE_WORK states in all)."""
        found, pending = set(states), list(states)
        while pending:
            for target in self.epsilons.get(pending.pop(), ()):
                if target not in found:
                    found.add(target)
                    pending.append(target)
        self.work += len(found)
        if self.work > MAX_CLOSURE_WORK:
            raise GrammarError("the pattern's lookahead is too large for guided decoding", self.where)
        return frozenset(found)

    def moves_from(self, states: frozenset[int]) -> list[tuple[Chars | Text, int]]:
        """The character edges out of the states."""
        return [move for state in states for move in self.moves.get(state, ())]

    def after(self, states: frozenset[int], chars: Chars) -> frozenset[int]:
        """The states after a character of `chars`, which each edge out of `states` takes all or none of."""
        taken: dict[Chars | Text, bool] = {}  # each atom tested once, however many edges carry it
        targets = set()
        for atom, target in self.moves_from(states):
            if atom not in taken:
                taken[atom] = bool(as_chars(atom) & chars)
            if taken[atom]:
                targets.add(target)
        return self.closure(targets)

    def _state(self) -> int:
        if self.size >= MAX_NODES:
            raise GrammarError("the pattern is too large for guided decoding", self.where)
        self.size += 1
        return self.size - 1

    def _epsilon(self, source: int, target: int) -> None:
        self.epsilons.setdefault(source, []).append(target)

    def _build(self, start: int, tree: RegexNode) -> int:
        """The tree's strings from `start`; answers the state they end in."""
        if isinstance(tree, Ahead):
            end = self._state()
            self._epsilon(start, end)
            self.marks[start, end] = len(self.aheads)
            self.aheads.append(tree)
            return end
        if isinstance(tree, Chars | Text):
            end = self._state()
            self.moves.setdefault(start, []).append((tree, end))
            return end
        if isinstance(tree, Concat):
            for part in tree.parts:
                start = self._build(start, part)
            return start
        if isinstance(tree, Alternation):
            end = self._state()
            for option in tree.options:
                self._epsilon(self._build(start, option), end)
            return end
        for _ in range(tree.least):
            start = self._build(start, tree.part)
        end = self._state()
        if tree.most is None:  # a loop: `end` takes the part again
            self._epsilon(start, end)
            self._epsilon(self._build(end, tree.part), end)
            return end
        for _ in range(tree.most - tree.least):
            self._epsilon(start, end)
            start = self._build(start, tree.part)
        self._epsilon(start, end)
        return end


Guards = tuple[frozenset[int], ...]  # each lookahead option's automaton's states after what was taken
ProductKey = tuple[int, int, Guards, int]  # (the pattern's state, the characters counted, the guards, requirements met)


class PatternProduct:
    """A pattern option's character automaton crossed with the count of characters taken (which stops at `most`, or
    stays at `least` once there where None) and with each lookahead option's automaton, followed as a set of its
    states: the exclusions' first, then the requirements' options, then the options of the lookaheads inside (empty
    until the path passes where one stands), and a bit for each requirement met (those inside met until then)."""

    def __init__(self, emitter: RegexEmitter, option: Guarded, least: int, most: int | None, where: str) -> None:
        self.emitter, self.least, self.most = emitter, least, most
        self.automaton = CharacterAutomaton(option.tree, where)
        looks = [(look, None) for look in option.exclusions]
        looks += [(look, index) for index, options in enumerate(option.requirements) for look in options]
        requirements, self.starting = len(option.requirements), len(looks)
        self.inside: list[tuple[list[int], int | None]] = []  # each lookahead inside: its options' places, requirement
        for ahead in self.automaton.aheads:
            index = None if ahead.negative else requirements
            requirements += not ahead.negative
            self.inside.append((list(range(len(looks), len(looks) + len(ahead.options))), index))
            looks += [(look, index) for look in ahead.options]
        # (automaton, whole, the requirement it is an option of: None for an exclusion)
        self.looks = [(CharacterAutomaton(look.tree, where), look.whole, index) for look, index in looks]
        self.every_requirement = (1 << requirements) - 1
        self.met_inside = sum(1 << index for _, index in self.inside if index is not None)
        self.nodes: dict[ProductKey, int] = {}
        self.pending: list[ProductKey] = []

    def emit(self, start: int) -> int:
        """The product's strings from `start`; answers the node they end at."""
        network = self.emitter.network
        end = network.node()
        started = tuple(
            look.closure({look.first}) if place < self.starting else frozenset()
            for place, (look, _, _) in enumerate(self.looks)
        )
        first = self._node(self.automaton.first, 0, started, self.met_inside)
        if first is None:
            return end  # an exclusion matches the empty string, or a requirement cannot be met: nothing is taken
        network.epsilon(start, first)
        while self.pending:
            key = self.pending.pop()
            state, count, guarded, met = key
            here = self.nodes[key]
            if state == self.automaton.last and count >= self.least and self._ends_well(guarded, met):
                network.epsilon(here, end)
            for target in self.automaton.epsilons.get(state, ()):
                ahead = self.automaton.marks.get((state, target))
                passed = (guarded, met) if ahead is None else self._passed(ahead, guarded, met)
                if (node := self._node(target, count, *passed)) is not None:
                    network.epsilon(here, node)
            if count == self.most:
                continue
            after = min(count + 1, self.least if self.most is None else self.most)
            for atom, target in self.automaton.moves.get(state, ()):
                for part, guarded_after in self._split(as_chars(atom), guarded):
                    if (node := self._node(target, after, guarded_after, met)) is not None:
                        network.epsilon(self.emitter.emit(here, part), node)
        return end

    def _node(self, state: int, count: int, guarded: Guards, met: int) -> int | None:
        """The network node of a product state, made and queued the first time; None where an exclusion's match
        begins what was taken, or a requirement can no longer be met (nothing from there is taken). A requirement
        whose option has matched a beginning is met, and its options are no longer followed."""
        for (look, whole, index), states in zip(self.looks, guarded, strict=True):
            if index is None and not whole and look.last in states:
                return None
            if index is not None and not whole and look.last in states:
                met |= 1 << index
        guarded = tuple(
            frozenset() if index is not None and met >> index & 1 else states
            for (_, _, index), states in zip(self.looks, guarded, strict=True)
        )
        alive = {index for (_, _, index), states in zip(self.looks, guarded, strict=True) if states}
        if any(not met >> index & 1 and index not in alive for index in range(self.every_requirement.bit_length())):
            return None
        key = (state, count, guarded, met)
        if key not in self.nodes:
            self.nodes[key] = self.emitter.network.node()
            self.pending.append(key)
        return self.nodes[key]

    def _passed(self, ahead: int, guarded: Guards, met: int) -> tuple[Guards, int]:
        """The guards and requirements met once a path passes where the lookahead inside stands: its options start
        from there, and a requirement it is is not met yet."""
        places, index = self.inside[ahead]
        guarded = tuple(
            look.closure({look.first}) if place in places else states
            for place, ((look, _, _), states) in enumerate(zip(self.looks, guarded, strict=True))
        )
        return guarded, met if index is None else met & ~(1 << index)

    def _ends_well(self, guarded: Guards, met: int) -> bool:
        """Whether the string may end here: no exclusion matches all of it, and each requirement not met by a
        beginning has an option that matches all of it."""
        for (look, whole, index), states in zip(self.looks, guarded, strict=True):
            if look.last in states:
                if index is None and whole:
                    return False
                if index is not None:
                    met |= 1 << index
        return met == self.every_requirement

    def _split(self, chars: Chars, guarded: Guards) -> list[tuple[Chars, Guards]]:
        """The characters cut into parts each lookahead option's automaton takes alike, each with its states after
        it."""
        parts = [chars]
        for (look, _, _), states in zip(self.looks, guarded, strict=True):
            for cut in {as_chars(atom) for atom, _ in look.moves_from(states)}:  # each set once, however many edges
                parts = [piece for part in parts for piece in (part & cut, part & cut.negated()) if piece]
        return [
            (part, tuple(look.after(states, part) for (look, _, _), states in zip(self.looks, guarded, strict=True)))
            for part in parts
        ]


def length_range(tree: RegexNode) -> tuple[int, int | None]:
    """The fewest and most characters of the tree's strings (None: no most)."""
    if isinstance(tree, Ahead):
        return 0, 0
    if isinstance(tree, Chars | Text):
        return 1, 1
    if isinstance(tree, Concat):
        ranges = [length_range(part) for part in tree.parts]
        highs = [high for _, high in ranges]
        return sum(low for low, _ in ranges), None if None in highs else sum(h for h in highs if h is not None)
    if isinstance(tree, Alternation):
        ranges = [length_range(option) for option in tree.options]
        highs = [high for _, high in ranges]
        return min(low for low, _ in ranges), None if None in highs else max(h for h in highs if h is not None)
    low, high = length_range(tree.part)
    return low * tree.least, None if tree.most is None or (high is None and tree.most) else (high or 0) * tree.most


def within_lengths(tree: RegexNode, least: int, most: int | None) -> RegexNode | None:
    """The tree with its strings of `least` to `most` characters only, where its one repeat of a single character
    beside fixed-length parts can take the bounds (the usual '[a-z]+' and '[A-Z][a-z]*'); else None."""
    if least == 0 and most is None:
        return tree
    parts = tree.parts if isinstance(tree, Concat) else (tree,)
    ranges = [length_range(part) for part in parts]
    free = [i for i, (low, high) in enumerate(ranges) if low != high]
    if len(free) != 1 or not isinstance(repeat := parts[free[0]], Repeat) or not isinstance(repeat.part, Chars | Text):
        return None
    fixed = sum(low for i, (low, _) in enumerate(ranges) if i != free[0])
    low = max(repeat.least, least - fixed)
    high = repeat.most if most is None else most - fixed if repeat.most is None else min(repeat.most, most - fixed)
    if high is not None and low > high:
        return None
    bounded = Repeat(repeat.part, low, high)
    return Concat((*parts[: free[0]], bounded, *parts[free[0] + 1 :])) if isinstance(tree, Concat) else bounded


def has_ahead(tree: RegexNode) -> bool:
    """Whether a lookahead stands anywhere inside the tree."""
    if isinstance(tree, Ahead):
        return True
    if isinstance(tree, Concat | Alternation):
        return any(has_ahead(part) for part in (tree.parts if isinstance(tree, Concat) else tree.options))
    return isinstance(tree, Repeat) and has_ahead(tree.part)


def as_chars(atom: Chars | Text) -> Chars:
    """A character automaton's atom as a set of characters."""
    return atom if isinstance(atom, Chars) else Chars.span(ord(atom.char), ord(atom.char))


class RegexEmitter:
    """Adds a regex tree to a network, matching raw UTF-8, or inside a JSON string the characters as json.dumps
    writes them with ensure_ascii=False (", \\ and control characters escaped, the rest as they are)."""

    def __init__(self, network: Network, in_json_string: bool) -> None:
        self.network = network
        self.in_json_string = in_json_string

    def emit(self, start: int, tree: RegexNode) -> int:
        """The tree's strings from `start`."""
        network = self.network
        if isinstance(tree, Chars):
            return self._chars(start, tree)
        if isinstance(tree, Text):
            return network.literal(start, tree.char.encode())
        if isinstance(tree, Concat):
            for part in tree.parts:
                start = self.emit(start, part)
            return start
        if isinstance(tree, Alternation):
            return network.either(start, [partial(self.emit, tree=option) for option in tree.options])
        return network.repeat(start, partial(self.emit, tree=tree.part), tree.least, tree.most)

    def emit_pattern(
        self, start: int, pattern: Pattern, least: int = 0, most: int | None = None, where: str = "pattern"
    ) -> int:
        """The pattern's strings of `least` to `most` characters (or more where None) that no exclusion refuses;
        `where` is the pattern's place, named by the error of one too large to lay out."""
        options = [partial(self._option, option=o, least=least, most=most, where=where) for o in pattern.options]
        return self.network.either(start, options)

    def _option(self, start: int, option: Guarded, least: int, most: int | None, where: str) -> int:
        """A top-level option's strings within the lengths: as they are where its own lengths are within them, its
        one repeat of a character bounded where that can be done, else through the product."""
        shortest, longest = length_range(option.tree)
        least = 0 if least <= shortest else least
        most = None if most is not None and longest is not None and longest <= most else most
        if not option.exclusions and not option.requirements and not has_ahead(option.tree):
            bounded = within_lengths(option.tree, least, most)
            if bounded is not None:
                return self.emit(start, bounded)
        return PatternProduct(self, option, least, most, where).emit(start)

    def _chars(self, start: int, chars: Chars) -> int:
        """One character of the set: where it holds every non-ASCII character ('.', a negated class) those are
        taken by their UTF-8 structure alone, as in a JSON string (`utf8_char`), else in well-formed UTF-8."""
        network = self.network
        plain = chars.ascii & STRING_ASCII if self.in_json_string else chars.ascii
        end = network.node()
        if plain:
            network.move(start, plain, end)
        if self.in_json_string:
            escaped = [json.dumps(chr(code))[1:-1].encode() for code in members(chars.ascii & ~STRING_ASCII)]
            if escaped:
                network.epsilon(network.literals(start, escaped), end)
        if chars.wide == EVERY_WIDE:
            utf8_char(network, start, end)
        elif chars.wide:
            wide_chars(network, start, chars.wide, end)
        return end


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


def regex_grammar(pattern: str) -> Grammar:
    """Outputs that fully match the pattern (as re.fullmatch under re.ASCII, over the output's text)."""
    if not isinstance(pattern, str):
        raise GrammarError("a pattern must be a string", "pattern")
    network = Network("pattern")
    entry, exit_node = network.routine()
    end = RegexEmitter(network, in_json_string=False).emit_pattern(entry, RegexParser(pattern, "pattern").parse())
    network.epsilon(end, exit_node)
    return Grammar(network, entry)


def choice_grammar(choices: list[str]) -> Grammar:
    """Outputs equal to one of the strings."""
    if not isinstance(choices, list) or not choices:
        raise GrammarError("a choice needs a non-empty list of strings", "choice")
    for index, choice in enumerate(choices):
        if not isinstance(choice, str):
            raise GrammarError("each choice must be a string", f"choice[{index}]")
        if any(0xD800 <= ord(char) <= 0xDFFF for char in choice):
            raise GrammarError("a choice may not hold a lone surrogate (it is no UTF-8 text)", f"choice[{index}]")
    network = Network("choice")
    entry, exit_node = network.routine()
    network.epsilon(network.literals(entry, [choice.encode() for choice in choices]), exit_node)
    return Grammar(network, entry)
