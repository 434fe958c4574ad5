"""vLLM's bad_words: the token sequences a request's output may not hold, and the masks that keep out each one's last
token wherever the output so far ends with the rest of it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

BadWords = tuple[tuple[int, ...], ...]


def bad_word_ids(tokenizer: Any, words: Sequence[str]) -> BadWords:
    """Each word's token ids, as vLLM takes them: the word as written (its leading spaces dropped), and with one
    leading space where that spells it with a first token of its own in as many tokens (a word inside the text)."""
    sequences: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        sequences.append(alone)
        if spaced[0] != alone[0] and len(spaced) == len(alone):
            sequences.append(spaced)
    return tuple(sequences)


def banned(words: BadWords, output: Sequence[int]) -> set[int]:
    """The ids that may not come next: each sequence's last id where the output ends with the ids before it (only
    the output counts, not the prompt, as vLLM's)."""
    found = set()
    for sequence in words:
        *head, last = sequence
        if len(head) <= len(output) and (not head or list(output[len(output) - len(head) :]) == head):
            found.add(last)
    return found


def bad_word_masks(words: BadWords, output: Sequence[int], drafts: Sequence[int], vocab: int) -> tuple[bytes, ...]:
    """The packed masks of a window's draw rows (bit i of byte i // 8 set where id i may come): the row after each
    prefix of the drafts, as if the output had gone on with them."""
    masks = []
    for row in range(len(drafts) + 1):
        bits = bytearray(b"\xff" * ((vocab + 7) // 8))
        for token in banned(words, [*output, *drafts[:row]]):
            if 0 <= token < vocab:
                bits[token // 8] &= ~(1 << token % 8) & 0xFF
        masks.append(bytes(bits))
    return tuple(masks)


def both(first: tuple[bytes, ...], second: tuple[bytes, ...]) -> tuple[bytes, ...]:
    """Two sets of a window's masks as one: an id may come where both allow it (either set may be empty: none)."""
    if not first or not second:
        return first or second
    return tuple(
        (int.from_bytes(a, "little") & int.from_bytes(b, "little")).to_bytes(len(a), "little")
        for a, b in zip(first, second, strict=True)
    )
