"""The MoE kernels' layout of NVFP4 codes: int32 words of eight codes with each code's bits moved, once at load, to
where kernels/moe.py's four extractions find them (torch only, so the reference model can decode it without Triton).

In the checkpoint's layout, element i of a word (the low nibble of byte i // 2 for even i) has its mantissa, two
exponent bits and sign at bits 4i to 4i + 3. `WORD_BITS[i]` gives where they go instead.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

PACKED_KEYS = ("gate_up_packed", "down_packed")
CHUNK_WORDS = 1 << 22  # words moved at a time
# where bit b (0 mantissa, 1-2 exponent, 3 sign) of element i of a word goes in the kernels' layout: element 2j's
# magnitude bits end at bf16 bits 6-8 and its sign at 15 of register j, element 2j+1's at 22-24 and 31
WORD_BITS = (
    (6, 7, 8, 15),  # register 0: the word & 0x81C081C0
    (22, 23, 24, 31),
    (25, 26, 27, 2),  # register 1: rotated left by 13
    (9, 10, 11, 18),
    (3, 4, 5, 0),  # register 2: magnitudes shifted left by 3 and signs by 15, in one multiply
    (19, 20, 21, 16),
    (28, 29, 30, 1),  # register 3: magnitudes rotated left by 10, signs by 14
    (12, 13, 14, 17),
)


def _move_bits(words: torch.Tensor, moves: dict[int, int], chunk_words: int) -> torch.Tensor:
    """int32 words with bit p moved to bit moves[p], in place, `chunk_words` at a time (int64 while moving: a few
    times the chunk's bytes of scratch)."""
    by_shift: dict[int, int] = {}
    for src, dst in moves.items():
        by_shift[dst - src] = by_shift.get(dst - src, 0) | 1 << src
    flat = words.view(-1)
    for start in range(0, flat.numel(), chunk_words):
        part = flat[start : start + chunk_words]
        old = part.to(torch.int64) & 0xFFFFFFFF
        new = torch.zeros_like(old)
        for shift, mask in by_shift.items():
            moved = old & mask
            new |= moved << shift if shift >= 0 else moved >> -shift
        part.copy_((new ^ 0x80000000) - 0x80000000)
    return words


def _checkpoint_to_word_moves() -> dict[int, int]:
    """Bit moves from the checkpoint's word (element i's bit b at 4i + b) to the kernels' layout."""
    return {4 * i + b: dst for i, bits in enumerate(WORD_BITS) for b, dst in enumerate(bits)}


def _check_packed(packed: torch.Tensor) -> None:
    """Refuse codes that cannot be read as int32 words."""
    if packed.dtype != torch.uint8 or packed.shape[-1] % 4 or not packed.is_contiguous():
        raise ValueError(f"packed codes: expected contiguous uint8 [..., 4n], got {tuple(packed.shape)} {packed.dtype}")


def to_words(packed: torch.Tensor, in_place: bool = False, chunk_words: int = CHUNK_WORDS) -> torch.Tensor:
    """Checkpoint NVFP4 codes uint8 [..., K/2] -> int32 words [..., K/8] in the kernels' layout (in place: a view of
    the same memory)."""
    _check_packed(packed)
    words = (packed if in_place else packed.clone()).view(torch.int32)
    return _move_bits(words, _checkpoint_to_word_moves(), chunk_words)


def from_words(words: torch.Tensor) -> torch.Tensor:
    """Inverse of `to_words`: int32 words [..., K/8] -> checkpoint codes uint8 [..., K/2] (a new tensor)."""
    back = {dst: src for src, dst in _checkpoint_to_word_moves().items()}
    return _move_bits(words.clone(memory_format=torch.contiguous_format), back, CHUNK_WORDS).view(torch.uint8)


def kernel_bank(bank: Mapping[str, torch.Tensor], in_place: bool = False) -> dict[str, torch.Tensor]:
    """A checkpoint-layout NVFP4 bank (`*_packed` uint8) as the kernels take it (`*_words` int32); other tensors
    shared. In place, the packed tensors' memory is rewritten and must not be read as codes again; both are checked
    before either is touched."""
    for key in PACKED_KEYS:
        _check_packed(bank[key])
    out = {key: value for key, value in bank.items() if key not in PACKED_KEYS}
    for key in PACKED_KEYS:
        out[key.replace("_packed", "_words")] = to_words(bank[key], in_place)
    return out
