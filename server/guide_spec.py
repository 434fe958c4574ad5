"""What a guided request's output must match (vLLM's structured outputs), as the HTTP side hands it to the engine."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Literal

from server.grammar import Grammar, GrammarError, choice_grammar, json_grammar, regex_grammar
from server.grammar_ebnf import ebnf_grammar

GuideKind = Literal["json", "regex", "choice", "grammar"]


class GuideError(RuntimeError):
    """A kept token the request's grammar does not allow: its draw broke the mask it was drawn under."""


@dataclass(frozen=True, slots=True)
class GuideSpec:
    """A request's grammar: `kind` "json" (`source`: a JSON Schema's text, or "" for any JSON object), "regex" (the
    pattern the whole output matches), "choice" (a JSON list of the strings it may be) or "grammar" (an EBNF grammar's
    text, grammar_ebnf.py); with `starts_after`, only
    the output after that token id (a think block's end) is guided."""

    kind: GuideKind
    source: str
    starts_after: int | None = None

    def grammar(self) -> Grammar:
        """The compiled grammar (compiled once for every request that brings the same one)."""
        return compiled(self.kind, self.source)

    def after(self, token_id: int | None) -> GuideSpec:
        """The same grammar, guiding only the output after `token_id` (None: all of it)."""
        return replace(self, starts_after=token_id)


@lru_cache(maxsize=64)
def compiled(kind: GuideKind, source: str) -> Grammar:
    """A guide's grammar; raises `GrammarError` naming the part at fault (one nested too deeply to parse too)."""
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
