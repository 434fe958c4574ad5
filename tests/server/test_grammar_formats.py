"""String formats in guided JSON: each enforced format takes exactly what its pattern (run by Python's re) takes,
valid samples pass and invalid ones do not; other formats are annotations; a format alone shapes a string."""

from __future__ import annotations

import json
import random
import re

import pytest

from server.grammar import GrammarError
from server.grammar_formats import FORMAT_PATTERNS
from server.grammar_schema import json_grammar

SAMPLES = {  # format: (valid texts, invalid texts)
    "date": (["2026-12-06", "0001-01-31"], ["2026-13-01", "2026-00-10", "2026-1-01", "26-12-06", "2026-12-32"]),
    "time": (
        ["14:11:00Z", "23:59:60z", "00:00:00.125+01:00", "09:30:00-08:00"],
        ["14:11:00", "24:00:00Z", "14:60:00Z", "14:11Z", "14:11:00+1:00"],
    ),
    "date-time": (
        ["2026-12-06T14:11:00Z", "2026-12-06t14:11:00.5-05:30"],
        ["2026-12-06 14:11:00Z", "2026-12-06T14:11"],
    ),
    "duration": (["P1Y2M3DT4H5M6S", "PT5M", "P3W", "P1D", "PT1H30M"], ["P", "PT", "P1H", "1Y", "P1Y1W"]),
    "uuid": (["123e4567-e89b-12d3-a456-426614174000"], ["123e4567e89b12d3a456426614174000", "123e4567-e89b-12d3-a456"]),
    "ipv4": (["192.168.0.1", "0.0.0.0", "255.255.255.255"], ["256.1.1.1", "01.2.3.4", "1.2.3", "1.2.3.4.5"]),
    "hostname": (["example.com", "a", "xn--bcher-kva.example", "a-b.c"], ["-a.com", "a-.com", "a..b", "a_b.com"]),
    "email": (["a.b+c@example.co", "x@a-b.org"], ["a@b", "@example.com", "a..b@example.com", "a@-b.com"]),
}


def matches(schema: dict, text: str) -> bool:
    """Whether the schema's grammar takes the whole JSON text."""
    grammar = json_grammar(schema)
    state = grammar.feed(grammar.initial, text.encode())
    return state is not None and grammar.accepts(state)


@pytest.mark.parametrize("name", sorted(FORMAT_PATTERNS))
def test_each_format_takes_its_valid_samples_and_refuses_the_invalid(name):
    valid, invalid = SAMPLES[name]
    for text in valid:
        assert matches({"type": "string", "format": name}, json.dumps(text)), text
    for text in invalid:
        assert not matches({"type": "string", "format": name}, json.dumps(text)), text


@pytest.mark.parametrize("name", sorted(FORMAT_PATTERNS))
def test_each_format_takes_exactly_what_its_pattern_matches(name):
    """Random mutations of the samples (characters dropped, doubled or swapped for one of the format's alphabet):
    the grammar agrees with re.fullmatch of the same pattern."""
    rng = random.Random(name)
    alphabet = sorted(set("".join(SAMPLES[name][0] + SAMPLES[name][1])) | set("0123456789-.:"))
    texts = list(SAMPLES[name][0] + SAMPLES[name][1])
    for _ in range(150):
        text = list(rng.choice([text for text in texts if text]))
        at = rng.randrange(len(text))
        edit = rng.randrange(3)
        if edit == 0:
            del text[at]
        elif edit == 1:
            text.insert(at, text[at])
        else:
            text[at] = rng.choice(alphabet)
        texts.append("".join(text))
    pattern = re.compile(FORMAT_PATTERNS[name])
    for text in texts:
        expected = pattern.fullmatch(text) is not None
        assert matches({"type": "string", "format": name}, json.dumps(text)) == expected, text


def test_an_enforced_format_with_lengths_takes_its_matches_of_those_lengths_only():
    bounded = {"type": "string", "format": "email", "maxLength": 7}
    assert matches(bounded, '"a@b.io"') and not matches(bounded, '"ab@cd.io"')
    assert not matches(bounded, '"abcdefg"')
    assert matches({"type": "string", "format": "email", "maxLength": 254}, '"a@b.io"')  # RFC 5321's longest
    with pytest.raises(GrammarError, match="admits no complete output"):  # every date has 10 characters
        json_grammar({"type": "string", "format": "date", "minLength": 11})


def test_other_formats_are_annotations_and_a_format_alone_shapes_a_string():
    assert matches({"type": "string", "format": "uri"}, '"not a uri at all"')
    assert matches({"type": "integer", "format": "int32"}, "12")
    assert matches({"format": "date"}, '"2026-12-06"') and not matches({"format": "date"}, "12")


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"type": "string", "pattern": "[0-9]+", "format": "uuid"}, "/format"),
    ],
)
def test_an_enforced_format_beside_another_shape_is_refused(schema, where):
    with pytest.raises(GrammarError, match="cannot be combined") as refused:
        json_grammar(schema)
    assert refused.value.where == where
