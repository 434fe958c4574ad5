"""Drafters: what a lane proposes for the next verify window (any proposal is safe: verification keeps only
tokens equal to the target's own draws)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

COPY_MATCH = 4  # how many last tokens must repeat earlier text for a copy draft


class History:
    """A request's tokens so far (prompt, then output), indexed by where each COPY_MATCH-gram last ended, so a copy
    lookup costs O(1) per round whatever the length."""

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            # index the gram ending at the current end before moving past it: the last gram stays unindexed, so a
            # lookup of it finds an earlier occurrence
            end = len(self.tokens)
            if end >= COPY_MATCH:
                self.ends[tuple(self.tokens[end - COPY_MATCH : end])] = end
            self.tokens.append(token)

    def copy_continuation(self, depth: int) -> tuple[int, ...]:
        """If the last COPY_MATCH tokens occurred before, what followed their latest earlier occurrence."""
        if len(self.tokens) < COPY_MATCH:
            return ()
        end = self.ends.get(tuple(self.tokens[-COPY_MATCH:]))
        return () if end is None else tuple(self.tokens[end : end + depth])


class Drafter(Protocol):
    """Proposes up to `depth` tokens to follow `history`, given the MTP layer's chain for this lane."""

    reads_history: bool  # whether it may propose without an MTP layer

    def propose(self, history: History, depth: int, mtp: tuple[int, ...]) -> tuple[int, ...]: ...


class MtpDrafter:
    """The MTP layer's greedy chain."""

    reads_history = False

    def propose(self, history: History, depth: int, mtp: tuple[int, ...]) -> tuple[int, ...]:
        return mtp[:depth]


class CopyDrafter:
    """Copies the continuation of repeated text (code, quotes, lists), else falls back to the MTP chain."""

    reads_history = True

    def propose(self, history: History, depth: int, mtp: tuple[int, ...]) -> tuple[int, ...]:
        return history.copy_continuation(depth) or mtp[:depth]


class ScriptedDrafter:
    """Proposes whatever a script returns for the tokens so far (tests use it to force every accept length)."""

    reads_history = True

    def __init__(self, script: Callable[[Sequence[int], int], tuple[int, ...]]) -> None:
        self.script = script

    def propose(self, history: History, depth: int, mtp: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(self.script(history.tokens, depth))[:depth]


DRAFTERS: dict[str, Callable[[], Drafter]] = {"mtp": MtpDrafter, "copy": CopyDrafter}
