"""JSON numbers between a schema's bounds (minimum, maximum and their exclusive forms): a small deterministic
automaton over the numbers' text, the JSON syntax without an exponent read beside a digit-by-digit comparison with
each bound."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal

MAX_BOUND_DIGITS = 40  # digits a bound may take written out in full (integer and fraction)
MINUS, POINT = ord("-"), ord(".")
DIGITS = tuple(range(ord("0"), ord("9") + 1))

# a comparison with a bound's digits so far: ("int", digits read, relation of those to the bound's first ones),
# ("frac", fraction digits read, 0) while the integer parts are equal, or ("done", relation)
Comparison = tuple
# the syntax: start, "0", an integer of more digits, a point, fraction digits
SYNTAX_MOVES = {
    "start": {**{ord("0"): "zero"}, **{digit: "whole" for digit in DIGITS[1:]}},
    "zero": {POINT: "point"},
    "whole": {**{digit: "whole" for digit in DIGITS}, POINT: "point"},
    "point": {digit: "fraction" for digit in DIGITS},
    "fraction": {digit: "fraction" for digit in DIGITS},
}
SYNTAX_ENDS = frozenset({"zero", "whole", "fraction"})


@dataclass(frozen=True, slots=True)
class Bound:
    """One side of a range: its value, and whether the value itself is in the range."""

    value: Decimal
    inclusive: bool


@dataclass(frozen=True, slots=True)
class NumberAutomaton:
    """States 0 to len(moves) - 1, 0 the start: `moves[state]` maps a byte to the next state; a number may end at
    the `accepting` states. Every state leads to one of those."""

    moves: tuple[dict[int, int], ...]
    accepting: frozenset[int]


def bound_digits(value: Decimal) -> tuple[str, str]:
    """A value's magnitude as integer digits (no leading zeros; '0' for none) and fraction digits (no trailing
    zeros); ValueError past MAX_BOUND_DIGITS."""
    integer, _, fraction = format(abs(value), "f").partition(".")
    integer, fraction = integer.lstrip("0") or "0", fraction.rstrip("0")
    if len(integer) + len(fraction) > MAX_BOUND_DIGITS:
        raise ValueError(f"a bound of more than {MAX_BOUND_DIGITS} digits written out")
    return integer, fraction


def sign(difference: int) -> int:
    """-1, 0 or 1, as the difference is negative, zero or positive."""
    return (difference > 0) - (difference < 0)


class Comparer:
    """A number's magnitude compared with a bound's, one byte of its text at a time."""

    def __init__(self, value: Decimal) -> None:
        self.integer, self.fraction = bound_digits(value)

    def step(self, state: Comparison, byte: int) -> Comparison:
        """The comparison after one more byte (a digit or the point) of a well-formed magnitude."""
        if state[0] == "done":
            return state
        if state[0] == "int":
            _, read, relation = state
            if byte == POINT:
                relation = self._integer_relation(read, relation)
                return ("frac", 0, 0) if relation == 0 else ("done", relation)
            if read >= len(self.integer):  # longer than the bound's integer part
                return ("int", len(self.integer) + 1, 0)
            return ("int", read + 1, relation or sign(byte - ord(self.integer[read])))
        _, read, _ = state
        if read < len(self.fraction):
            relation = sign(byte - ord(self.fraction[read]))
            return ("frac", read + 1, 0) if relation == 0 else ("done", relation)
        return ("done", 1) if byte != ord("0") else state  # past the bound's digits: its zeros

    def relation(self, state: Comparison) -> int:
        """How the magnitude read so far, ended there, compares with the bound: -1, 0 or 1."""
        if state[0] == "done":
            return state[1]
        if state[0] == "int":  # no fraction: below a bound with one where the integer parts are equal
            return self._integer_relation(state[1], state[2]) or -int(bool(self.fraction))
        return -1 if state[1] < len(self.fraction) else 0  # the bound's digits left hold a nonzero one

    def _integer_relation(self, read: int, relation: int) -> int:
        """An integer part of `read` digits against the bound's (no leading zeros: the longer is the larger)."""
        return sign(read - len(self.integer)) or relation


class Magnitudes:
    """Unsigned JSON number texts whose value lies within the bounds: states are (syntax, the comparison with the
    low bound, the comparison with the high one or None)."""

    def __init__(self, low: Bound, high: Bound | None, integer: bool) -> None:
        self.low, self.high, self.integer = low, high, integer
        self.low_comparer = Comparer(low.value)
        self.high_comparer = Comparer(high.value) if high is not None else None
        self.start = ("start", ("int", 0, 0), ("int", 0, 0) if high is not None else None)

    def moves(self, state: tuple) -> dict[int, tuple]:
        """The state after each byte that may come next."""
        syntax, low_state, high_state = state
        following = {}
        for byte, after in SYNTAX_MOVES[syntax].items():
            if self.integer and byte == POINT:
                continue
            high_after = self.high_comparer.step(high_state, byte) if self.high_comparer is not None else None
            following[byte] = (after, self.low_comparer.step(low_state, byte), high_after)
        return following

    def accepts(self, state: tuple) -> bool:
        """Whether a number may end here: a whole number, within both bounds."""
        syntax, low_state, high_state = state
        if syntax not in SYNTAX_ENDS:
            return False
        above = self.low_comparer.relation(low_state)
        if above < 0 or (above == 0 and not self.low.inclusive):
            return False
        if self.high_comparer is None:
            return True
        below = self.high_comparer.relation(high_state)
        return below < 0 or (below == 0 and self.high.inclusive)


def bounded_numbers(low: Bound | None, high: Bound | None, integer: bool) -> NumberAutomaton | None:
    """The automaton of JSON numbers (integers where `integer`; never an exponent) within the bounds: the
    non-negative ones written plain, the negative ones after a minus; None where no number lies within them."""
    zero = Decimal(0)
    parts: dict[str, Magnitudes] = {}
    if high is None or high.value >= zero:
        parts["plain"] = Magnitudes(low if low is not None and low.value >= zero else Bound(zero, True), high, integer)
    if low is None or low.value < zero:
        least = Bound(-high.value, high.inclusive) if high is not None and high.value < zero else Bound(zero, False)
        parts["minus"] = Magnitudes(least, Bound(-low.value, low.inclusive) if low is not None else None, integer)

    def moves(state: tuple) -> dict[int, tuple]:
        if state == ("sign",):
            following = {MINUS: ("minus", parts["minus"].start)} if "minus" in parts else {}
            if "plain" in parts:
                plain = parts["plain"]
                following.update({byte: ("plain", after) for byte, after in plain.moves(plain.start).items()})
            return following
        name, inner = state
        return {byte: (name, after) for byte, after in parts[name].moves(inner).items()}

    def accepts(state: tuple) -> bool:
        return state != ("sign",) and parts[state[0]].accepts(state[1])

    return automaton_of(("sign",), moves, accepts)


def automaton_of(
    start: tuple, moves: Callable[[tuple], dict[int, tuple]], accepts: Callable[[tuple], bool]
) -> NumberAutomaton | None:
    """The states reachable from `start` that lead to an accepting one, numbered from 0 (None where none does)."""
    edges: dict[tuple, dict[int, tuple]] = {}
    queue = deque([start])
    while queue:
        state = queue.popleft()
        if state not in edges:
            edges[state] = moves(state)
            queue.extend(edges[state].values())
    live = {state for state in edges if accepts(state)}
    while True:
        grown = {state for state, following in edges.items() if any(after in live for after in following.values())}
        if grown <= live:
            break
        live |= grown
    if start not in live:
        return None
    ordered = [start, *(state for state in edges if state in live and state != start)]
    numbers = {state: number for number, state in enumerate(ordered)}
    return NumberAutomaton(
        tuple({byte: numbers[after] for byte, after in edges[state].items() if after in live} for state in ordered),
        frozenset(numbers[state] for state in ordered if accepts(state)),
    )


def multiples_of(numbers: NumberAutomaton, step: int, places: int = 0) -> NumberAutomaton | None:
    """The numbers of an automaton (no exponent) that are multiples of step·10^-places: at most `places` fraction
    digits, and the digits read as one integer, scaled by the fraction digits not written, a multiple of `step`. Each
    state sits beside the remainder so far (a minus leaves it as it is) and the fraction digits read (None before a
    point); None where no number is such a multiple."""

    def moves(state: tuple) -> dict[int, tuple]:
        inner, remainder, fraction = state
        following = {}
        for byte, after in numbers.moves[inner].items():
            if byte == POINT:
                following[byte] = (after, remainder, 0)
            elif byte not in DIGITS:
                following[byte] = (after, remainder, fraction)
            elif fraction is None or fraction < places:
                counted = None if fraction is None else fraction + 1
                following[byte] = (after, (remainder * 10 + byte - DIGITS[0]) % step, counted)
        return following

    def accepts(state: tuple) -> bool:
        inner, remainder, fraction = state
        return inner in numbers.accepting and remainder * 10 ** (places - (fraction or 0)) % step == 0

    return automaton_of((0, 0, None), moves, accepts)
