"""The MoE kernels' layout of NVFP4 codes: int32 words of eight codes with each code's bits moved, once at load, to
where kernels/moe.py's four extractions find them (torch only, so the reference model can decode it without Triton).

In the checkpoint's layout, element i of a word (the low nibble of byte i // 2 for even i) has its mantissa, two
exponent bits and sign at bits 4i to 4i + 3. `WORD_BITS[i]` gives where they go instead.

Spans. In a matrix whose reduced width K is a multiple of a span width (`span_k`: 128 k, else 64), the words and
block scales of each row are also moved within each span: with B = span / 32 blocks of 32 k a span, word position
4Bs + Bt + b holds natural word 4Bs + 4b + t, and scale position 2Bs + Bh + b holds group 2Bs + 2b + h. The tensor
cores take k in blocks of 32 (eight k a thread, as Triton's dot operands have them), so thread t of a quad needs words
t, 4 + t, ... of a span and the scale of each of its blocks: moved, each thread's words of a span are one load (16
bytes in a 128-k span, 8 in a 64-k one) and its scales another.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

PACKED_KEYS = ("gate_up_packed", "down_packed")
SCALE_KEYS = ("gate_up_scale", "down_scale")
CHUNK_WORDS = 1 << 22  # words moved at a time
SPAN_WIDTHS = (128, 64)  # k whose words and scales move together, widest first (16 words and 8 scales, or 8 and 4)
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
    """Inverse of `kernel_bank` on words: int32 words [..., K/8] -> checkpoint codes uint8 [..., K/2] (a new
    tensor)."""
    back = {dst: src for src, dst in _checkpoint_to_word_moves().items()}
    words = words.clone(memory_format=torch.contiguous_format)
    span = span_k(8 * words.shape[-1])
    if span:
        _move_in_spans(words, 4, span // 32)
    return _move_bits(words, back, CHUNK_WORDS).view(torch.uint8)


def span_k(k: int) -> int:
    """The span width of a matrix reducing over k (module docstring): the widest of SPAN_WIDTHS dividing k, or 0
    where its words and scales stay in k order."""
    return next((width for width in SPAN_WIDTHS if k % width == 0), 0)


def _move_in_spans(values: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Each run of rows·cols values along the last axis, read as [rows, cols], transposed, in place, `CHUNK_WORDS`
    at a time along the leading axes."""
    flat = values.view(-1, values.shape[-1])
    step = max(1, CHUNK_WORDS // values.shape[-1])
    for start in range(0, flat.shape[0], step):
        part = flat[start : start + step]
        part.copy_(part.reshape(part.shape[0], -1, rows, cols).transpose(-1, -2).reshape(part.shape))
    return values


def natural_scales(scale: torch.Tensor) -> torch.Tensor:
    """Block scales [..., K/16] as `kernel_bank` leaves them -> in k order (a new tensor when they were moved)."""
    span = span_k(16 * scale.shape[-1])
    if not span:
        return scale
    return _move_in_spans(scale.clone(memory_format=torch.contiguous_format), 2, span // 32)


def kernel_bank(bank: Mapping[str, torch.Tensor], in_place: bool = False) -> dict[str, torch.Tensor]:
    """A checkpoint-layout NVFP4 bank (`*_packed` uint8) as the kernels take it (`*_words` int32, and the words and
    scales of a matrix whose K is a multiple of a span width moved within spans); other tensors shared. In place, the
    packed tensors' memory is rewritten and must not be read as codes again, and moved scales are moved in their own
    memory; every tensor is checked before any is touched."""
    for key in PACKED_KEYS:
        _check_packed(bank[key])
    for key in SCALE_KEYS:
        if key in bank and (
            not bank[key].is_contiguous() or 8 * bank[key].shape[-1] != bank[key.replace("_scale", "_packed")].shape[-1]
        ):
            raise ValueError(f"{key}: expected contiguous [..., K/16] beside the packed codes' [..., K/2]")
    out = {key: value for key, value in bank.items() if key not in PACKED_KEYS}
    for key in PACKED_KEYS:
        words = to_words(bank[key], in_place)
        scale_key = key.replace("_packed", "_scale")
        span = span_k(8 * words.shape[-1])
        if span:
            _move_in_spans(words, span // 32, 4)
            if scale_key in bank:  # a bank of codes alone (tests of the word layout) has none
                scale = bank[scale_key] if in_place else bank[scale_key].clone()
                out[scale_key] = _move_in_spans(scale.view(torch.uint8), span // 32, 2).view(scale.dtype)
        out[key.replace("_packed", "_words")] = words
    return out
