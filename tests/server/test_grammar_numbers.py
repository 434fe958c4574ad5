"""Bounded JSON numbers: the automaton takes exactly the number texts (no exponent) whose value lies within the
bounds, and schemas with minimum and maximum guide outputs to them."""

from __future__ import annotations

import itertools
import json
import random
from decimal import Decimal

import pytest

from server.grammar import GrammarError
from server.grammar_numbers import Bound, NumberAutomaton, bounded_numbers
from server.grammar_schema import json_grammar

INTEGERS = [str(value) for value in range(-130, 131)]
DECIMALS = [
    f"{whole}.{fraction}"
    for whole in ("0", "1", "-0", "-1", "12", "-12")
    for fraction in ("0", "5", "05", "50", "25", "999", "001")
]
MALFORMED = ["", "-", "01", "-01", "00", "1.", ".5", "1e3", "--1", "+1", "1.2.3", "0x1"]


def takes(automaton: NumberAutomaton | None, text: str) -> bool:
    """Whether the automaton reads the whole text and may end there."""
    if automaton is None:
        return False
    state = 0
    for byte in text.encode():
        if byte not in automaton.moves[state]:
            return False
        state = automaton.moves[state][byte]
    return state in automaton.accepting


def within(value: Decimal, low: Bound | None, high: Bound | None) -> bool:
    """The bounds' rule, on the value."""
    above = low is None or value > low.value or (low.inclusive and value == low.value)
    below = high is None or value < high.value or (high.inclusive and value == high.value)
    return above and below


def plain_json_number(text: str, integer: bool) -> bool:
    """Whether a text is a JSON number without an exponent (an integer where `integer`), other than -0."""
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or "e" in text.lower()
        or (text.startswith("-0") and Decimal(text) == 0)
    ):
        return False
    return isinstance(value, int) or not integer


BOUND_VALUES = ["-100", "-12.5", "-1", "-0.05", "0", "0.5", "1", "9.99", "12", "100"]


@pytest.mark.parametrize("integer", [True, False])
def test_the_automaton_takes_exactly_the_numbers_within_the_bounds(integer):
    """Every pair of bounds from a list (either side absent, inclusive or not) against integers, decimals and
    malformed texts: taken exactly where the text is a plain JSON number within both bounds."""
    sides = [None] + [Bound(Decimal(value), inclusive) for value in BOUND_VALUES for inclusive in (True, False)]
    for low, high in itertools.product(sides, sides):
        automaton = bounded_numbers(low, high, integer)
        for text in INTEGERS + DECIMALS + MALFORMED:
            expected = plain_json_number(text, integer) and within(Decimal(text), low, high)
            assert takes(automaton, text) == expected, (low, high, text)


def test_every_state_leads_to_an_end_and_empty_ranges_give_none():
    """No dead state is kept; a range no number (or no integer) lies in gives None."""
    automaton = bounded_numbers(Bound(Decimal("-3.25"), True), Bound(Decimal("17"), False), False)
    for state in range(len(automaton.moves)):
        seen, frontier = {state}, [state]
        while frontier and not seen & automaton.accepting:
            frontier = [after for node in frontier for after in automaton.moves[node].values() if after not in seen]
            seen.update(frontier)
        assert seen & automaton.accepting, state
    assert bounded_numbers(Bound(Decimal("0.2"), True), Bound(Decimal("0.8"), True), True) is None
    assert bounded_numbers(Bound(Decimal(5), False), Bound(Decimal(5), True), False) is None
    assert bounded_numbers(Bound(Decimal(5), True), Bound(Decimal(5), True), False) is not None


def test_random_long_bounds_hold_digit_by_digit():
    """Bounds of many digits, and numbers near them: the automaton agrees with Decimal's comparison."""
    rng = random.Random(5)
    for _ in range(60):
        low, high = sorted(Decimal(rng.randint(-(10**9), 10**9)) / 10 ** rng.randint(0, 6) for _ in range(2))
        bounds = Bound(low, rng.random() < 0.5), Bound(high, rng.random() < 0.5)
        automaton = bounded_numbers(*bounds, False)
        for value in (low, high, (low + high) / 2, low - Decimal("1e-7"), high + Decimal("1e-7"), Decimal(0)):
            for nudge in (Decimal(0), Decimal("1e-9"), Decimal("-1e-9")):
                number = value + nudge
                text = format(number, "f")
                if "." in text:
                    text = text.rstrip("0").rstrip(".") or "0"
                if text.startswith("-") and Decimal(text) == 0:
                    text = "0"
                assert takes(automaton, text) == within(Decimal(text), *bounds), (bounds, text)


def matches(schema: dict, text: str) -> bool:
    """Whether the schema's grammar takes the whole text."""
    grammar = json_grammar(schema)
    state = grammar.feed(grammar.initial, text.encode())
    return state is not None and grammar.accepts(state)


def test_a_tool_schemas_bounds_guide_its_numbers():
    """An integer from 1 to 14 and a number above 0 (a tool's parameters): in-range values pass, others and
    exponents do not; the keywords alone imply a number; draft 4's boolean exclusiveMinimum makes minimum exclusive."""
    schema = {
        "type": "object",
        "properties": {
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1.5},
        },
        "required": ["days", "ratio"],
    }
    assert matches(schema, '{"days": 14, "ratio": 1.5}') and matches(schema, '{"days": 1, "ratio": 0.001}')
    for text in ('{"days": 0, "ratio": 1}', '{"days": 15, "ratio": 1}', '{"days": 3, "ratio": 0}',
                 '{"days": 3, "ratio": 1.51}', '{"days": 3.5, "ratio": 1}', '{"days": 3, "ratio": 1e-3}'):  # fmt: skip
        assert not matches(schema, text), text
    assert matches({"minimum": -2.5}, "-2.5") and not matches({"minimum": -2.5}, "-3")
    assert matches({"type": ["integer", "string"], "maximum": -1}, '"x"') and not matches({"maximum": -1}, "0")
    draft4 = {"type": "integer", "minimum": 3, "exclusiveMinimum": True}
    assert not matches(draft4, "3") and matches(draft4, "4")
    assert not matches({"type": "integer", "maximum": 5, "exclusiveMaximum": 5}, "5")  # the tighter: exclusive


@pytest.mark.parametrize(
    ("schema", "where", "says"),
    [
        ({"type": "integer", "minimum": 5, "maximum": 2}, "/minimum", "no integer lies within"),
        ({"type": "integer", "minimum": 0.2, "maximum": 0.8}, "/minimum", "no integer lies within"),
        ({"type": "number", "exclusiveMinimum": 1, "exclusiveMaximum": 1}, "/exclusiveMinimum", "no number"),
        ({"type": "number", "maximum": "3"}, "/maximum", "finite number"),
        ({"type": "number", "minimum": True}, "/minimum", "finite number"),
        ({"type": "integer", "exclusiveMaximum": True}, "/exclusiveMaximum", "needs 'maximum'"),
        ({"type": "number", "minimum": 1e300}, "/minimum", "digits"),
    ],
)
def test_bounds_that_cannot_be_honoured_are_refused_naming_the_keyword(schema, where, says):
    with pytest.raises(GrammarError) as refused:
        json_grammar(schema)
    assert refused.value.where == where and says in str(refused.value)
