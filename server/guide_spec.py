"""What a guided request's output must match (vLLM's structured outputs), as the HTTP side hands it to the engine."""

from __future__ import annotations

import json
import pickle
import threading
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Literal

from server.grammar import Grammar, GrammarError
from server.grammar_ebnf import ebnf_grammar
from server.grammar_regex import choice_grammar, regex_grammar
from server.grammar_schema import json_grammar

GuideKind = Literal["json", "regex", "choice", "grammar"]
GRAMMARS_KEPT = 64  # compiled grammars kept for later requests (the least recently used one goes first)


class GuideError(RuntimeError):
    """A kept token the request's grammar does not allow: its draw broke the mask it was drawn under."""


@dataclass(frozen=True, slots=True)
class GuideSpec:
    """A request's grammar: `kind` "json" (`source`: a JSON Schema's text, or "" for any JSON object), "regex" (the
    pattern the whole output matches), "choice" (a JSON list of the strings it may be) or "grammar" (an EBNF grammar's
    text, grammar_ebnf.py); with `starts_after`, only the output after that token id (a think block's end) is guided.
    `compiled_form` is the grammar compiled and pickled by a front end in a process of its own, which the engine's
    process unpickles where it has not compiled the grammar yet, rather than compiling it again: a large schema's
    compile holds the GIL, and the engine's rounds wait for it at every torch op meanwhile."""

    kind: GuideKind
    source: str
    starts_after: int | None = None
    compiled_form: bytes | None = field(default=None, compare=False, repr=False)

    def grammar(self) -> Grammar:
        """The compiled grammar (compiled, or unpickled, once for every request that brings the same one)."""
        return compiled(self.kind, self.source, self.compiled_form)

    def after(self, token_id: int | None) -> GuideSpec:
        """The same grammar, guiding only the output after `token_id` (None: all of it)."""
        return replace(self, starts_after=token_id)

    def with_compiled_form(self) -> GuideSpec:
        """The same guide carrying its compiled grammar, pickled (for the engine's process)."""
        return replace(self, compiled_form=pickle.dumps(self.grammar(), protocol=pickle.HIGHEST_PROTOCOL))

    def without_compiled_form(self) -> GuideSpec:
        """The same guide without the compiled form it carried (once the grammar is kept, the bytes only weigh)."""
        return replace(self, compiled_form=None) if self.compiled_form is not None else self


_grammars: OrderedDict[tuple[str, str], Grammar] = OrderedDict()
_grammars_lock = threading.Lock()


def compiled(kind: GuideKind, source: str, form: bytes | None = None) -> Grammar:
    """A guide's grammar, made once while kept: unpickled from `form` where given, else compiled; raises
    `GrammarError` naming the part at fault (one nested too deeply to parse too)."""
    key = (kind, source)
    with _grammars_lock:
        grammar = _grammars.get(key)
        if grammar is not None:
            _grammars.move_to_end(key)
            return grammar
    grammar = pickle.loads(form) if form is not None else _compile(kind, source)
    with _grammars_lock:
        grammar = _grammars.setdefault(key, grammar)
        _grammars.move_to_end(key)
        while len(_grammars) > GRAMMARS_KEPT:
            _grammars.popitem(last=False)
    return grammar


def _compile(kind: GuideKind, source: str) -> Grammar:
    """A guide's grammar compiled from its source."""
    try:
        if kind == "json":
            return json_grammar(json.loads(source) if source else None)
        if kind == "regex":
            return regex_grammar(source)
        if kind == "grammar":
            return ebnf_grammar(source)
        return choice_grammar(json.loads(source))
    except RecursionError:
        raise GrammarError(
            "nested too deeply to compile", {"json": "", "regex": "pattern", "grammar": "grammar"}.get(kind, "choice")
        ) from None
