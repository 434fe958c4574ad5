"""Ranges of non-ASCII code points as UTF-8 byte ranges, for character classes that name such characters."""

from __future__ import annotations

FIRST_WIDE = 0x80  # the first code point past ASCII
LAST_CODE = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)  # code points that are not characters, so never encoded
LENGTH_ENDS = (0x7F, 0x7FF, 0xFFFF)  # the last code point of each UTF-8 length but the longest

CodeRanges = tuple[tuple[int, int], ...]
"""Sorted, disjoint, non-adjacent inclusive ranges of code points."""

ByteRanges = tuple[tuple[int, int], ...]
"""One UTF-8 sequence's inclusive byte range at each of its positions."""


def merged(ranges: list[tuple[int, int]] | CodeRanges) -> CodeRanges:
    """The ranges sorted, with overlapping or adjacent ones joined."""
    out: list[tuple[int, int]] = []
    for low, high in sorted(ranges):
        if out and low <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], high))
        else:
            out.append((low, high))
    return tuple(out)


def complement(ranges: CodeRanges, low: int = FIRST_WIDE, high: int = LAST_CODE) -> CodeRanges:
    """The code points from low to high that none of the (merged) ranges holds."""
    out, start = [], low
    for first, last in ranges:
        if first > high:
            break
        if first > start:
            out.append((start, min(first - 1, high)))
        start = max(start, last + 1)
    if start <= high:
        out.append((start, high))
    return tuple(out)


def utf8_sequences(low: int, high: int) -> list[ByteRanges]:
    """Byte-range sequences that together match exactly the UTF-8 encodings of the code points low to high
    (surrogates left out): each code point's bytes fall in one sequence's ranges, position by position."""
    out: list[ByteRanges] = []
    pending = [(low, high)]
    while pending:
        first, last = pending.pop()
        if first > last:
            continue
        if first <= SURROGATES[1] and last >= SURROGATES[0]:
            pending += [(first, SURROGATES[0] - 1), (SURROGATES[1] + 1, last)]
            continue
        end = next((end for end in LENGTH_ENDS if first <= end < last), None)
        if end is not None:  # every code point of a sequence has one encoded length
            pending += [(first, end), (end + 1, last)]
            continue
        pending_before = len(pending)
        for trailing in range(1, len(chr(first).encode())):
            low_bits = (1 << 6 * trailing) - 1  # the bits of the last `trailing` bytes
            if first & ~low_bits == last & ~low_bits:
                continue
            # where the leading bytes differ, the trailing ones must run over all their values
            if first & low_bits:
                pending += [(first, first | low_bits), ((first | low_bits) + 1, last)]
                break
            if last & low_bits != low_bits:
                pending += [(first, (last & ~low_bits) - 1), (last & ~low_bits, last)]
                break
        if len(pending) == pending_before:
            out.append(tuple(zip(chr(first).encode(), chr(last).encode(), strict=True)))
    return sorted(out)
