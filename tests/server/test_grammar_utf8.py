"""Non-ASCII code point ranges as UTF-8 byte ranges, against Python's own encoder."""

from __future__ import annotations

import random

import pytest

from server.grammar_utf8 import complement, merged, utf8_sequences


def taken(sequences: list[tuple[tuple[int, int], ...]], data: bytes) -> bool:
    """Whether some sequence's ranges hold the bytes, position by position."""
    return any(
        len(sequence) == len(data)
        and all(low <= byte <= high for byte, (low, high) in zip(data, sequence, strict=True))
        for sequence in sequences
    )


RANGES = [(0x80, 0x10FFFF), (0x80, 0x7FF), (0xE9, 0xE9), (0x4E00, 0x9FFF), (0xD700, 0xE100), (0x10000, 0x10FFFF),
          (0x7FF, 0x800), (0xFFFF, 0x10000), (0x1F600, 0x1F64F)]  # fmt: skip


@pytest.mark.parametrize("seed", range(4))
def test_sequences_take_exactly_the_encodings_of_the_range(seed):
    """Code points near the range's ends, the length boundaries and at random are taken exactly when in range, and
    every byte string the sequences take decodes to a code point in range."""
    rng = random.Random(seed)
    ranges = [*RANGES]
    for _ in range(8):
        low = rng.randrange(0x80, 0x110000)
        ranges.append((low, min(0x10FFFF, low + rng.choice([3, 700, 90_000, 0x110000]))))
    for low, high in ranges:
        sequences = utf8_sequences(low, high)
        points = {low - 1, low, high, high + 1, 0x7FF, 0x800, 0xD7FF, 0xE000, 0xFFFF, 0x10000}
        points |= {rng.randrange(0x80, 0x110000) for _ in range(500)}
        points |= {rng.randrange(max(0x80, low - 40), min(0x10FFFF, high + 40) + 1) for _ in range(500)}
        for point in points:
            if 0x80 <= point <= 0x10FFFF and not 0xD800 <= point <= 0xDFFF:
                assert taken(sequences, chr(point).encode()) == (low <= point <= high), (low, high, point)
        for sequence in sequences:
            data = bytes(rng.randint(first, last) for first, last in sequence)
            assert low <= ord(data.decode()) <= high


def test_merged_and_complement():
    """Overlapping and adjacent ranges join; the complement runs over the non-ASCII code points."""
    assert merged([(0x100, 0x200), (0x80, 0x90), (0x91, 0x95), (0x150, 0x300)]) == ((0x80, 0x95), (0x100, 0x300))
    assert complement(((0x80, 0x95), (0x100, 0x10FFFF))) == ((0x96, 0xFF),)
    assert complement(()) == ((0x80, 0x10FFFF),) and complement(((0x80, 0x10FFFF),)) == ()
    assert complement(((0x300, 0x310), (0x400, 0x410)), 0x80, 0x200) == ((0x80, 0x200),)
