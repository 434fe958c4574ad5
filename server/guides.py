"""Guided decoding on the engine's side: each grammar's masks over the vocabulary, and a guided request's place in
its grammar, from which each round's draw rows get their masks."""

from __future__ import annotations

import codecs
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from server.grammar import MAX_STACKS, WHITESPACE, Grammar, State, members
from server.guide_spec import GuideError, GuideSpec
from server.token_masks import GuideMasks, TokenVocabulary

MASK_SETS = 16  # grammars whose masks are kept for later requests (the least recently used one goes first)
KEPT_STATES = 1024  # states whose packed masks, and whose forced tokens, are kept
FORCED_BYTES = 64  # the most bytes of forced text a lane's drafts are made from

Key = TypeVar("Key")
Value = TypeVar("Value")


def kept(cache: OrderedDict[Key, Value], key: Key, make: Callable[[], Value]) -> Value:
    """A cached value, made where missing; the least recently used of KEPT_STATES goes when the cache is full."""
    value = cache.pop(key) if key in cache else make()
    cache[key] = value
    while len(cache) > KEPT_STATES:
        cache.popitem(last=False)
    return value


def packed(allowed: torch.Tensor) -> bytes:
    """A bool mask over the vocabulary as the round header carries it: bit i of byte i // 8, lowest bit first."""
    bits = torch.zeros(-(-allowed.numel() // 8) * 8, dtype=torch.uint8)
    bits[: allowed.numel()] = allowed
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)
    return bits.view(-1, 8).mul_(weights).sum(dim=1, dtype=torch.uint8).numpy().tobytes()


class Guides:
    """The vocabulary's token bytes and each grammar's masks over it, kept across requests (rank 0's engine only:
    the masks reach the other rank in the round header)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.vocabulary: TokenVocabulary | None = None  # made for the first guided request, not at start
        self._vocabulary_lock = threading.Lock()
        self.mask_sets: OrderedDict[tuple[str, str, tuple[int, ...]], GuideMasks] = OrderedDict()
        # by (mask set, state): the key holds its mask set, so a later grammar's set never takes a dropped one's place
        self.packs: OrderedDict[tuple[GuideMasks, Any], bytes] = OrderedDict()
        self.forced: OrderedDict[tuple[GuideMasks, State, bool], tuple[int, ...]] = OrderedDict()  # forced_tokens

    def prepare(self, spec: GuideSpec) -> TokenVocabulary:
        """A guide's grammar compiled (or unpickled from the compiled form a front end process sent) and the
        vocabulary made, where not done yet: the slow parts of a request's first cursor, which a submitting thread
        does rather than the engine's under its lock. Answers the vocabulary."""
        spec.grammar()
        with self._vocabulary_lock:
            if self.vocabulary is None:
                self.vocabulary = TokenVocabulary.from_tokenizer(self.tokenizer, self.vocab_size)
            return self.vocabulary

    def cursor(self, spec: GuideSpec, end_ids: tuple[int, ...]) -> GuideCursor:
        """A request's cursor at the start of its output; `end_ids` are the ids that may end it (its stop tokens)."""
        key = (spec.kind, spec.source, end_ids)
        masks = self.mask_sets.pop(key, None) or GuideMasks(spec.grammar(), self.prepare(spec), end_ids)
        self.mask_sets[key] = masks
        while len(self.mask_sets) > MASK_SETS:
            self.mask_sets.popitem(last=False)
        return GuideCursor(self, masks, spec.starts_after)

    def forced_tokens(self, masks: GuideMasks, state: State, before: bytes) -> tuple[int, ...]:
        """The tokenizer's tokens of the text the grammar forces from a state (`likely_text`, after `before`), made
        once while they are kept: states repeat from record to record and request to request. Bytes that end a
        character begun before, which no text can start with, and malformed ones the grammar lets pass are left out
        of the text (a token of it is then refused), as is a character that the limit cuts."""

        def spell() -> tuple[int, ...]:
            text = codecs.getincrementaldecoder("utf-8")(errors="ignore").decode(
                likely_text(masks.grammar, state, before, FORCED_BYTES)
            )
            encode = self.tokenizer.encode
            return tuple(encode(text, add_special_tokens=False, split_special_tokens=True)) if text else ()

        return kept(self.forced, (masks, state, before in (b":", b",")), spell)

    def packed_mask(self, masks: GuideMasks, state: Any) -> bytes:
        """A state's allowed ids, packed, made once while it is kept."""
        return kept(self.packs, (masks, state), lambda: packed(masks.allowed(state)))


class GuideCursor:
    """A guided request's place in its grammar, advanced by each token it keeps; before `starts_after` comes (a
    think block's end) nothing is guided."""

    def __init__(self, guides: Guides, masks: GuideMasks, starts_after: int | None) -> None:
        self.guides, self.masks, self.starts_after = guides, masks, starts_after
        self.state: Any = masks.grammar.initial if starts_after is None else None
        self.last_byte = b""  # the output's last byte (none yet)

    def take(self, token: int) -> None:
        """Advance past a kept token; a token the grammar does not allow is a broken contract, and one drawn under a
        cut mask (`GuideMasks.cut`: the grammar too ambiguous to follow there) ends the guide too (`GuideError`)."""
        state, self.state = self.state, self._after(self.state, token)
        if self.state is _REFUSED:
            raise GuideError(f"token {token} was kept, but the request's grammar does not allow it there")
        if state is not None and self.masks.cut(state):
            raise GuideError(
                f"the grammar has more than {MAX_STACKS} ways to read the output here: too ambiguous to guide further"
            )
        self.last_byte = self._last_byte(state, self.last_byte, token)

    def row_masks(self, drafts: tuple[int, ...]) -> tuple[bytes, ...]:
        """The packed masks of a window's draw rows: the row after each prefix of the drafts, in order; () where no
        row is guided. A row past a draft the grammar refuses is never kept, so it repeats the last mask."""
        masks, state = [], self.state
        for row in range(len(drafts) + 1):
            if state is _REFUSED:
                masks.append(masks[-1])
                continue
            masks.append(b"" if state is None else self.guides.packed_mask(self.masks, state))
            if row < len(drafts):
                state = self._after(state, drafts[row])
        if not any(masks):
            return ()
        every = b"\xff" * len(next(mask for mask in masks if mask))
        return tuple(mask or every for mask in masks)

    def drafts(self, proposed: tuple[int, ...], depth: int) -> tuple[int, ...]:
        """A guided lane's drafts, at most `depth`: the proposed ones (the MTP layer's, which no grammar guides) up to
        the first the grammar refuses, then the tokens of the text the grammar forces from there (`likely_text`: a
        schema's keys and punctuation). Drafts never change a token; these are only likelier to be kept."""
        kept, state, before = [], self.state, self.last_byte
        for token in proposed[:depth]:
            if state is not None and token in self.masks.end_ids:  # kept where the output is complete, then the last
                if self.masks.grammar.accepts(state):
                    return (*kept, token)
                break
            after = self._after(state, token)
            if after is _REFUSED:
                break
            kept.append(token)
            state, before = after, self._last_byte(state, before, token)
        if state is None or len(kept) >= depth:
            return tuple(kept)
        for token in self.guides.forced_tokens(self.masks, state, before)[: depth - len(kept)]:
            state = self._after(state, token)
            if state is _REFUSED:
                break
            kept.append(token)
        return tuple(kept)

    def _last_byte(self, state: Any, before: bytes, token: int) -> bytes:
        """The guided output's last byte after a token taken at `state` (`before` where the token adds none; none
        while the grammar has not started)."""
        return b"" if state is None else (self.masks.vocabulary.token_bytes(token) or before)[-1:]

    def _after(self, state: Any, token: int) -> Any:
        """The state after a token (None: still before the grammar starts; `_REFUSED`: the grammar refuses it)."""
        if state is None:
            return self.masks.grammar.initial if token == self.starts_after else None
        after = self.masks.advance(state, token)
        return _REFUSED if after is None else after


_REFUSED = object()  # the place after a token the grammar does not allow


def likely_text(grammar: Grammar, state: State, before: bytes, limit: int) -> bytes:
    """The text the grammar forces from `state` (the output so far ending with `before`), at most `limit` bytes, with
    a guess where JSON whitespace may come, as json.dumps writes it: while the output cannot end there, a space after
    ':' or ',' where one can come (a guess inside a string too), else the one byte other than whitespace that can come
    next, or the one whitespace byte where only it can (a grammar that allows control bytes may stop sooner)."""
    text = bytearray()
    while len(text) < limit and not grammar.accepts(state):
        spaces, others = {}, []
        for byte in members(grammar.candidates(state)):  # in byte order: JSON whitespace before printable bytes
            after = grammar.step(state, byte)
            if after is None:
                continue
            if WHITESPACE >> byte & 1:
                spaces[byte] = after
            else:
                others.append((byte, after))
                if len(others) == 2:
                    break
        if (before + text)[-1:] in (b":", b",") and ord(" ") in spaces:
            taken = ord(" "), spaces[ord(" ")]
        elif len(others) == 1:
            taken = others[0]
        elif not others and len(spaces) == 1:
            taken = next(iter(spaces.items()))
        else:
            break
        text.append(taken[0])
        state = taken[1]
    return bytes(text)
