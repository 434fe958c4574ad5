"""A guide's grammar made once per source: compiled, or unpickled from the compiled form a front end sends."""

from __future__ import annotations

import pickle

import pytest

import server.guide_spec
from server.grammar import Grammar
from server.guide_spec import GuideSpec


def accepts(grammar: Grammar, text: bytes) -> bool:
    """Whether the grammar takes the whole text."""
    state = grammar.feed(grammar.initial, text)
    return state is not None and grammar.accepts(state)


def test_a_pickled_grammar_takes_the_same_texts_with_a_step_cache_of_its_own():
    grammar = GuideSpec("json", '{"type": "object", "properties": {"n": {"type": "integer"}}}').grammar()
    copy = pickle.loads(pickle.dumps(grammar))
    assert copy.initial == grammar.initial and copy._steps is not grammar._steps
    for text in (b'{"n": 12}', b'{"n": 1.5}', b"{}", b'{"m": 1}'):
        assert accepts(copy, text) == accepts(grammar, text)


def test_a_guide_with_a_compiled_form_is_unpickled_not_compiled(monkeypatch: pytest.MonkeyPatch):
    """The engine's process takes the front end's compiled form where it has no grammar for the source yet, then
    keeps it for every later request with the same source; the form is no part of the guide's identity."""
    spec = GuideSpec("grammar", 'root ::= "a" [0-9]{2}')
    sent = spec.with_compiled_form()
    monkeypatch.setattr(server.guide_spec, "_grammars", type(server.guide_spec._grammars)())

    def no_compile(kind: str, source: str) -> Grammar:
        raise AssertionError("compiled where a compiled form was given")

    monkeypatch.setattr(server.guide_spec, "_compile", no_compile)
    assert sent == spec and sent.compiled_form is not None and sent.without_compiled_form().compiled_form is None
    grammar = sent.grammar()
    assert accepts(grammar, b"a12") and not accepts(grammar, b"a1")
    assert spec.grammar() is grammar  # kept: a later request without the form gets it
    with pytest.raises(AssertionError, match="compiled where"):
        GuideSpec("regex", "b+").grammar()


def test_grammars_kept_are_bounded_and_the_least_recently_used_goes(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(server.guide_spec, "_grammars", type(server.guide_spec._grammars)())
    monkeypatch.setattr(server.guide_spec, "GRAMMARS_KEPT", 2)
    first = GuideSpec("regex", "a").grammar()
    GuideSpec("regex", "b").grammar()
    assert GuideSpec("regex", "a").grammar() is first  # used again: now the most recent
    GuideSpec("regex", "c").grammar()
    assert list(server.guide_spec._grammars) == [("regex", "a"), ("regex", "c")]
