"""The prompt cache's index on rank 0: which token prefixes have a kept lane state, LRU within a byte budget."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


def prefix_digests(tokens: Sequence[int], lengths: Sequence[int], salt: str | None = None) -> dict[int, bytes]:
    """SHA-256 of tokens[:n] for each n in `lengths`, in one pass; a salt's digest goes first, so salted prefixes
    never share an entry with unsalted ones or with another salt's."""
    data = array("q", tokens).tobytes()
    digests, hasher, done = {}, hashlib.sha256(), 0
    if salt is not None:
        hasher.update(hashlib.sha256(salt.encode()).digest())
    for n in sorted(set(lengths)):
        hasher.update(data[done * 8 : n * 8])
        done = n
        digests[n] = hasher.copy().digest()
    return digests


@dataclass(slots=True)
class Kept:
    """One kept state: its handle on every rank, how many tokens it holds, and its bytes on this rank."""

    handle: int
    length: int
    nbytes: int


class PromptCache:
    """Maps token-prefix digests to kept states; the longest kept prefix wins; least recently used goes first."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self.entries: OrderedDict[bytes, Kept] = OrderedDict()
        self.next_handle = 1
        self.queries = self.hits = self.cached_tokens = self.queried_tokens = 0
        self.nbytes = 0  # of the entries: kept as a total, so other threads can read it while entries change

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def lookup(self, prompt: Sequence[int], counted: bool = True, salt: str | None = None) -> Kept | None:
        """The longest prefix of `prompt` kept under `salt` that leaves at least one token to run (in the figures if
        `counted`)."""
        if not self.enabled:
            return None
        self.queries += counted
        self.queried_tokens += len(prompt) * counted
        lengths = sorted({e.length for e in self.entries.values() if e.length < len(prompt)})
        digests = prefix_digests(prompt, lengths, salt)
        for n in reversed(lengths):
            entry = self.entries.get(digests[n])
            if entry is not None and entry.length == n:
                self.entries.move_to_end(digests[n])
                self.hits += counted
                self.cached_tokens += n * counted
                return entry
        return None

    def wants(self, digest: bytes) -> bool:
        """Whether a state for this prefix is worth keeping (the cache is on and lacks it)."""
        return self.enabled and digest not in self.entries

    def new_handle(self) -> int:
        handle, self.next_handle = self.next_handle, self.next_handle + 1
        return handle

    def add(self, digest: bytes, kept: Kept) -> list[int]:
        """Index a kept state; returns the handles evicted to stay within the budget (the new one too if it alone
        does not fit)."""
        replaced = self.entries.pop(digest, None)
        self.nbytes += kept.nbytes - (replaced.nbytes if replaced is not None else 0)
        self.entries[digest] = kept
        evicted = []
        while self.entries and self.nbytes > self.budget:
            _, old = self.entries.popitem(last=False)
            self.nbytes -= old.nbytes
            evicted.append(old.handle)
        return evicted
