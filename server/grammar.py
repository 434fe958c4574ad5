"""The matcher of guided decoding's grammars: a recursive transition network over bytes (`Network`), run a byte at a
time as a pushdown automaton (`Grammar`; outputs are UTF-8 and a byte-level token may end inside a character), and
the JSON text it is built of (`JsonBuilder`). grammar_regex.py compiles patterns and choices into it, grammar_schema.py
JSON Schemas."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

from server.grammar_runs import RUN_COPIES, Copy, Runs
from server.grammar_utf8 import CodeRanges, utf8_sequences

State = frozenset[tuple[int, ...]]
"""Where a match stands: stacks, each the return nodes of the calls in progress followed by the current node."""

Emit = Callable[[int], int]
"""Adds one part of a grammar to a network from a start node and answers the node where the part ends."""
MAX_DEPTH = 64  # calls in progress at once: nested JSON containers, items of counted arrays, $ref recursion
MAX_STACKS = 10_000  # stacks one state may hold; only wildly ambiguous grammars come near it
MAX_NODES = 200_000
MAX_REPEAT = 1000  # the largest repeat count or item count
MAX_WHITESPACE = 20  # bytes in one run of JSON whitespace, so that a model cannot loop on it
STEP_CACHE_STATES = 65_536


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
# a lead byte, the continuation bytes that may follow it at once (where narrower than CONTINUATION: no overlong form,
# no surrogate, nothing past U+10FFFF) and how many continuation bytes follow in all
LEADS = (
    (bits(range(0xC2, 0xE0)), CONTINUATION, 1),
    (bits([0xE0]), bits(range(0xA0, 0xC0)), 2),
    (bits([*range(0xE1, 0xED), 0xEE, 0xEF]), CONTINUATION, 2),
    (bits([0xED]), bits(range(0x80, 0xA0)), 2),
    (bits([0xF0]), bits(range(0x90, 0xC0)), 3),
    (bits(range(0xF1, 0xF4)), CONTINUATION, 3),
    (bits([0xF4]), bits(range(0x80, 0x90)), 3),
)
STRING_ASCII = bits(byte for byte in range(0x20, 0x80) if byte not in b'"\\')  # unescaped in a JSON string
SIMPLE_ESCAPES = bits(b'"\\/bfnrt')


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
    """Edges from `start` to `end` over any one non-ASCII character in well-formed UTF-8 (RFC 3629: no overlong form,
    no encoded surrogate, nothing past U+10FFFF), its continuation bytes' nodes shared by every lead byte."""
    after = end
    needing = [end]  # needing[n]: the node where n continuation bytes are still to come
    for _ in range(3):
        before = network.node()
        network.move(before, CONTINUATION, after)
        needing.append(before)
        after = before
    for lead, second, continuations in LEADS:
        if second == CONTINUATION:
            network.move(start, lead, needing[continuations])
        else:  # the second byte narrowed: a node of its own, then the shared rest
            network.move(network.move(start, lead), second, needing[continuations - 1])


def wide_chars(network: Network, start: int, ranges: CodeRanges, end: int) -> None:
    """Edges from `start` to `end` over any one character of the non-ASCII code point ranges, in well-formed UTF-8
    (`utf8_char` takes every non-ASCII character in fewer nodes)."""
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
