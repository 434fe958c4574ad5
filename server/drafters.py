"""Drafters: what a lane proposes for the next verify window (any proposal is safe: verification keeps only
tokens equal to the target's own draws)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol


class Drafter(Protocol):
    """Proposes up to `depth` tokens to follow `history`, given the MTP layer's chain for this lane."""

    def propose(self, history: Sequence[int], depth: int, mtp: tuple[int, ...]) -> tuple[int, ...]: ...


class MtpDrafter:
    """The MTP layer's greedy chain."""

    def propose(self, history: Sequence[int], depth: int, mtp: tuple[int, ...]) -> tuple[int, ...]:
        return mtp[:depth]


def copy_continuation(history: Sequence[int], depth: int, longest: int = 8, shortest: int = 3) -> tuple[int, ...]:
    """If the last tokens repeat earlier text, what followed that text (the longest, then latest, match wins)."""
    size = len(history)
    for n in range(min(longest, size - 1), shortest - 1, -1):
        suffix = list(history[size - n :])
        for start in range(size - n - 1, -1, -1):
            if list(history[start : start + n]) == suffix:
                return tuple(history[start + n : start + n + depth])
    return ()


class CopyDrafter:
    """Copies the continuation of repeated text (code, quotes, lists), else falls back to the MTP chain."""

    def propose(self, history: Sequence[int], depth: int, mtp: tuple[int, ...]) -> tuple[int, ...]:
        return copy_continuation(history, depth) or mtp[:depth]


class ScriptedDrafter:
    """Proposes whatever a script returns for the history (tests use it to force every accept length)."""

    def __init__(self, script: Callable[[Sequence[int], int], tuple[int, ...]]) -> None:
        self.script = script

    def propose(self, history: Sequence[int], depth: int, mtp: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(self.script(history, depth))[:depth]


DRAFTERS: dict[str, Callable[[], Drafter]] = {"mtp": MtpDrafter, "copy": CopyDrafter}
