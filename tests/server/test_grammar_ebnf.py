"""EBNF grammars (vLLM's guided_grammar): the texts they match against independent checks, and refusals that name
where the grammar went wrong."""

from __future__ import annotations

import itertools
import json
import re

import pytest

from server.grammar import MAX_DEPTH, Grammar, GrammarError
from server.grammar_ebnf import ebnf_grammar, on_a_cycle


def matches(grammar: Grammar, text: str | bytes) -> bool:
    """Whether the whole text is a complete match."""
    state = grammar.feed(grammar.initial, text.encode() if isinstance(text, str) else text)
    return state is not None and grammar.accepts(state)


def texts(alphabet: str, longest: int) -> list[str]:
    """Every text over the alphabet up to `longest` characters."""
    return ["".join(chars) for length in range(longest + 1) for chars in itertools.product(alphabet, repeat=length)]


# grammars without recursion, each beside a regex of the same texts (re.fullmatch is the check)
REGULAR_CASES = [
    ('root ::= "ab" | "a" [0-9]+', r"ab|a[0-9]+", "ab1"),
    ('root ::= word ("," word)*\nword ::= [a-c]{1,2}', r"[a-c]{1,2}(,[a-c]{1,2})*", "ab,d"),
    ('root ::= [^a,] "x"? | "\\x41\\u00e9\\U0001F642"', "[^a,]x?|Aé🙂", "ab,xAé🙂"),
    ('root ::= ("a" | "b"){2,} "c"{0,1}', "[ab]{2,}c?", "abc"),
    ("root ::= [\\-\\]a-] . [é-ÿ]", r"[-\]a].[é-ÿ]", "-]a\néÿā"),
    ('root ::= "" | "a" ( ) b{3}\nb ::= "b"', r"|ab{3}", "ab"),
    ('root ::= [\\x00-\\x1f"\\\\] "\\t\\"\\/"', '[\\x00-\\x1f"\\\\]\\t"/', '\t"\\/'),
    ('# a comment\nroot ::= a # another\n  | b\na ::= "x"\nb ::=\n  "y" "z"', r"x|yz", "xyz"),
    ("root::=[^]", r"(?s:.)", "a\n日"),
    ('root ::= x{0} "q"\nx ::= "z"', "q", "qz"),
]


@pytest.mark.parametrize(("text", "pattern", "alphabet"), REGULAR_CASES)
def test_a_grammar_without_recursion_matches_what_its_regex_matches(text, pattern, alphabet):
    """Strings, escapes, classes (negated, ranged, non-ASCII, '[^]'), '.', groups, repetitions, comments and rules
    spread over lines, on every short text over the alphabet; such a grammar's rules are inlined (no call is made)."""
    grammar = ebnf_grammar(text)
    outcomes = set()
    for candidate in texts(alphabet, 4)[:4000]:
        expected = re.fullmatch(pattern, candidate, re.DOTALL) is not None
        assert matches(grammar, candidate) == expected, (text, candidate)
        outcomes.add(expected)
    assert outcomes == {True, False}
    assert all(len(stack) == 1 for stack in grammar.initial)


def atom_ends(text: str, start: int) -> frozenset[int]:
    """Where one atom of `NESTED` read from `start` may end: a run of x, or '(' then atoms then ')'."""
    ends = set()
    run = start
    while run < len(text) and text[run] == "x":
        run += 1
        ends.add(run)
    if text[start : start + 1] == "(":
        inside, frontier = set(), set(atom_ends(text, start + 1))
        while frontier:
            inside |= frontier
            frontier = {end for place in frontier for end in atom_ends(text, place)} - inside
        ends |= {place + 1 for place in inside if text[place : place + 1] == ")"}
    return frozenset(ends)


NESTED = """
root ::= atom
atom ::= "x"+ | "(" atom+ ")"
"""


def test_a_recursive_grammar_matches_nested_texts_as_a_recursive_check_does():
    """Every text over '(', ')' and 'x' up to 9 characters matches exactly where a recursive descent takes it."""
    grammar = ebnf_grammar(NESTED)
    outcomes = set()
    for candidate in texts("()x", 9):
        expected = len(candidate) in atom_ends(candidate, 0)
        assert matches(grammar, candidate) == expected, candidate
        outcomes.add(expected)
    assert outcomes == {True, False}


def test_recursion_nests_up_to_the_depth_limit():
    """Recursive rules are called, so their nesting is capped as a JSON document's is."""
    grammar = ebnf_grammar('root ::= "(" root ")" | "x"')
    deep = MAX_DEPTH - 1
    assert matches(grammar, "(" * deep + "x" + ")" * deep)
    assert not matches(grammar, "(" * (MAX_DEPTH + 1) + "x" + ")" * (MAX_DEPTH + 1))


JSON_STRING = r"""
root   ::= "\"" char* "\""
char   ::= [^"\\\x00-\x1f] | "\\" escape
escape ::= ["\\/bfnrt] | "u" [0-9A-Fa-f]{4}
"""


@pytest.mark.parametrize(
    "candidate",
    ['"hello"', '"line1\\nline2"', '"\\u00e9"', '"日本 🙂"', '""', '"a\\"b"', '"bad\\q"', '"open', '"\x01"', "'a'"],
)
def test_a_json_string_grammar_takes_what_json_loads_takes_as_a_string(candidate):
    """xgrammar's example grammar of JSON strings, against json.loads."""
    try:
        expected = isinstance(json.loads(candidate), str)
    except ValueError:
        expected = False
    assert matches(ebnf_grammar(JSON_STRING), candidate) == expected


@pytest.mark.parametrize(
    ("text", "where", "says"),
    [
        ('root ::= root "a" | "a"', "line 1, column 1", "left-recursive"),
        ('root ::= a\na ::= b? root "x"\nb ::= "y"', "line 1, column 1", "left-recursive"),
        ('root ::= "a"\nroot ::= "b"', "line 2, column 1", "defined twice (first at line 1, column 1)"),
        ("root ::= item", "line 1, column 10", "'item' is not defined"),
        ('rot ::= "a"', "grammar", "no rule named 'root'"),
        ('root ::= "a', "line 1, column 12", "string is not closed"),
        ("root ::= [a", "line 1, column 12", "class is not closed"),
        ("root ::= []", "line 1, column 10", "empty class"),
        ("root ::= [\\d]", "line 1, column 11", "'\\d' is not supported"),
        ('root ::= "a"++', "line 1, column 14", "two repetitions"),
        ('root ::= "a"{,2}', "line 1, column 13", "{m}, {m,} or {m,n}"),
        ('root ::= "a"{3,2}', "line 1, column 13", "minimum is above"),
        ('root ::= "a"{1001}', "line 1, column 13", "above 1000"),
        pytest.param('root ::= "a"{0,' + "1" * 4301 + "}", "line 1, column 13", "above 1000", id="a huge count"),
        ("root ::= 'a'", "line 1, column 10", 'unexpected "\'"'),
        ('root ::= ("a"', "line 1, column 14", "missing ')'"),
        ('root ::= "a")', "line 1, column 13", "unbalanced ')'"),
        ('root ::= "\\q"', "line 1, column 11", "not an escape"),
        ('root ::= "\\uD800"', "line 1, column 11", "not a character"),
        ('root ::= "\\u12"', "line 1, column 11", "4 hex digits"),
        ('root ::= "a\nb"', "line 1, column 12", "line break"),
        ("root ::= [z-a]", "line 1, column 11", "ends below"),
        ('root ::= "\ud800"', "line 1, column 11", "lone surrogate"),
        ("root ::= [\ud800]", "line 1, column 11", "lone surrogate"),
        ('root[temperature=0.5] ::= "a"', "line 1, column 1", "rule options"),
        ('root ::= TagDispatch(("<a>", b))', "line 1, column 21", "macros"),
        ('"a"', "line 1, column 1", "expected a rule"),
        ('root ::= "x" root', "grammar", "no complete output"),
    ],
)
def test_a_grammar_outside_the_notation_is_refused_naming_where(text, where, says):
    with pytest.raises(GrammarError) as caught:
        ebnf_grammar(text)
    assert caught.value.where == where and says in str(caught.value), (caught.value.where, str(caught.value))


@pytest.mark.parametrize(
    ("text", "inside", "around"),
    [
        ('root ::= expr\nexpr ::= term | term "+" expr\nterm ::= "(" expr ")" | [0-9]+', "1+2", ("(", ")")),
        ('root ::= "(" root ")" | "(" root "]" | "x"', "x", ("(", "]")),
        ('root ::= "[" (item | item "," root) "]"\nitem ::= "a" | "a" "b"', "[ab]", ("[a,", "]")),
        ('root ::= "x" (t | t "+" root) | "y"\nt ::= "(" root ")" | "a"', "xa", ("x(", ")")),
        ('root ::= "n" ("(" root ")" | ("(" root "]")) | "x"', "x", ("n(", "]")),
    ],
)
def test_options_that_begin_alike_nest_to_the_depth_limit(text, inside, around):
    """Options that begin with the same rule or text are joined, so a recursive rule used after a shared beginning
    holds one place a level, not twice as many at each: 30 levels deep is matched (unjoined, the places passed the
    cap on a state's stacks from about 10 levels and the text was refused)."""
    grammar = ebnf_grammar(text)
    opening, closing = around
    assert matches(grammar, opening * 30 + inside + closing * 30)
    assert not matches(grammar, opening * 30 + inside + closing * 29)


def test_options_sharing_a_long_beginning_are_joined_in_one_step():
    """Two strings that share 2,000 characters compile (joined part by part, the tree was 2,000 levels deep)."""
    shared = "a" * 2000
    grammar = ebnf_grammar(f'root ::= "{shared}x" | "{shared}y" | "b"')
    assert matches(grammar, shared + "x") and matches(grammar, shared + "y") and matches(grammar, "b")
    assert not matches(grammar, shared) and not matches(grammar, shared + "b")


def test_a_long_chain_of_rules_compiles_and_an_absurd_one_is_refused():
    """Rules used inside one another are laid out from a queue, not by recursion: a chain of 400 recursive rules
    compiles; 3,000 inlined ones nested in each other are refused by name, not with a crash."""
    chain = "\n".join(f'r{i} ::= "a" r{i + 1} | "b"' for i in range(400))
    grammar = ebnf_grammar(f'root ::= r0\n{chain}\nr400 ::= "c" r0 | "d"')
    assert matches(grammar, "a" * 50 + "b") and not matches(grammar, "a" * 50)
    inlined = "\n".join(f'r{i} ::= "a" r{i + 1}' for i in range(3000))
    with pytest.raises(GrammarError, match="too deeply") as caught:
        ebnf_grammar(f'root ::= r0\n{inlined}\nr3000 ::= "z"')
    assert caught.value.where == "grammar"


def test_names_escapes_and_positions_as_the_notation_has_them():
    """'.' before a name is any character; '\\x' takes any number of hex digits; a rule used far into a long
    grammar is named at its line."""
    assert matches(ebnf_grammar('root ::= .x\nx ::= "y"'), "ay")
    assert matches(ebnf_grammar('root ::= "\\x000001F642"'), "🙂")
    long = "\n".join(f'r{i} ::= "a"' for i in range(2000))
    with pytest.raises(GrammarError) as caught:
        ebnf_grammar(f"root ::= r0\n{long}\nr1999x ::= missing")
    assert caught.value.where == "line 2002, column 12"


def test_rules_on_a_cycle_are_the_recursive_ones():
    """Self-loops and longer cycles count; rules that only lead into a cycle do not."""
    edges = {"root": {"a"}, "a": {"b"}, "b": {"a", "c"}, "c": set(), "d": {"d"}, "e": {"root"}}
    assert on_a_cycle(edges) == ["a", "b", "d"]
