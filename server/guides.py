"""Guided decoding on the engine's side: each grammar's masks over the vocabulary, and a guided request's place in
its grammar, from which each round's draw rows get their masks."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from server.guide_spec import GuideError, GuideSpec
from server.token_masks import GuideMasks, TokenVocabulary

MASK_SETS = 16  # grammars whose masks are kept for later requests (the least recently used one goes first)
PACKED_MASKS = 1024  # states whose packed masks are kept


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
        self.mask_sets: OrderedDict[tuple[str, str, tuple[int, ...]], GuideMasks] = OrderedDict()
        # by (mask set, state): the key holds its mask set, so a later grammar's set never takes a dropped one's place
        self.packs: OrderedDict[tuple[GuideMasks, Any], bytes] = OrderedDict()

    def cursor(self, spec: GuideSpec, end_ids: tuple[int, ...]) -> GuideCursor:
        """A request's cursor at the start of its output; `end_ids` are the ids that may end it (its stop tokens)."""
        if self.vocabulary is None:
            self.vocabulary = TokenVocabulary.from_tokenizer(self.tokenizer, self.vocab_size)
        key = (spec.kind, spec.source, end_ids)
        masks = self.mask_sets.pop(key, None) or GuideMasks(spec.grammar(), self.vocabulary, end_ids)
        self.mask_sets[key] = masks
        while len(self.mask_sets) > MASK_SETS:
            self.mask_sets.popitem(last=False)
        return GuideCursor(self, masks, spec.starts_after)

    def packed_mask(self, masks: GuideMasks, state: Any) -> bytes:
        """A state's allowed ids, packed, made once while it is kept."""
        key = (masks, state)
        bits = self.packs.pop(key, None) or packed(masks.allowed(state))
        self.packs[key] = bits
        while len(self.packs) > PACKED_MASKS:
            self.packs.popitem(last=False)
        return bits


class GuideCursor:
    """A guided request's place in its grammar, advanced by each token it keeps; before `starts_after` comes (a
    think block's end) nothing is guided."""

    def __init__(self, guides: Guides, masks: GuideMasks, starts_after: int | None) -> None:
        self.guides, self.masks, self.starts_after = guides, masks, starts_after
        self.state: Any = masks.grammar.initial if starts_after is None else None

    def take(self, token: int) -> None:
        """Advance past a kept token; a token the grammar does not allow is a broken contract (`GuideError`)."""
        self.state = self._after(self.state, token)
        if self.state is _REFUSED:
            raise GuideError(f"token {token} was kept, but the request's grammar does not allow it there")

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

    def _after(self, state: Any, token: int) -> Any:
        """The state after a token (None: still before the grammar starts; `_REFUSED`: the grammar refuses it)."""
        if state is None:
            return self.masks.grammar.initial if token == self.starts_after else None
        after = self.masks.advance(state, token)
        return _REFUSED if after is None else after


_REFUSED = object()  # the place after a token the grammar does not allow
