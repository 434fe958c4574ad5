"""Rows of many tensors in one launch (`copy_rows`): every bit of every row pair copied, whatever the dtypes, row
sizes and strides, and bad pairs or rows refused by name."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from kernels.row_copy import CHUNK, copy_rows, copy_rows_reference, word_bytes
from tests.kernels.launches import recording_launches


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A tensor of random bit patterns (NaN payloads and negative zeros among them) of `dtype`."""
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), dtype=torch.uint8, generator=gen)
    return raw.view(dtype)


def stacks(gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pairs shaped as the lane pool's: fp32 recurrent states over more than one chunk, bf16 conv tails, a
    destination with a scratch row."""
    shapes = [((5, 3, 40, 40), torch.float32), ((5, 96, 3), torch.bfloat16), ((5, 7), torch.float32)]
    return [(random_bits(s, dt, gen), torch.zeros((s[0] + 3, *s[1:]), dtype=dt)) for s, dt in shapes]


def test_every_row_pair_of_every_tensor_pair_gets_the_source_bits_in_one_launch() -> None:
    gen = torch.Generator().manual_seed(0)
    pairs = stacks(gen)
    assert pairs[0][0][0].numel() > CHUNK  # a row of more than one program
    want = [(src, dst.clone()) for src, dst in pairs]
    rows = [(4, 0), (0, 5), (2, 2)]
    copy_rows_reference(want, rows)
    with recording_launches() as launched:
        copy_rows(pairs, rows)
    assert launched == ["_copy_rows_kernel"]
    for (_, got), (_, ref) in zip(pairs, want, strict=True):
        assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
    untouched = [1, 3, 4, 6, 7]
    assert all(not dst[untouched].view(torch.uint8).any() for _, dst in pairs)


@pytest.mark.parametrize(("shape", "dtype", "width"), [((4, 6), torch.bfloat16, 4), ((4, 3), torch.bfloat16, 2),
                                                        ((4, 5), torch.uint8, 1)])  # fmt: skip
def test_rows_whose_bytes_are_not_whole_words_copy_in_narrower_words(shape, dtype, width) -> None:
    gen = torch.Generator().manual_seed(1)
    src = random_bits(shape, dtype, gen)
    dst = torch.zeros((6, *shape[1:]), dtype=dtype)
    assert word_bytes([(src, dst)]) == width
    copy_rows([(src, dst)], [(3, 5), (1, 0)])
    assert torch.equal(dst[5].view(torch.uint8), src[3].view(torch.uint8))
    assert torch.equal(dst[0].view(torch.uint8), src[1].view(torch.uint8))
    assert not dst[1:5].view(torch.uint8).any()


def test_strided_stacks_copy_their_own_rows() -> None:
    """Rows of a stack sliced from a wider one (a row stride past the row's size) are found by the stride."""
    gen = torch.Generator().manual_seed(2)
    wide = random_bits((4, 2, 16), torch.float32, gen)
    src = wide[:, 0]  # rows of 16 floats, 32 apart
    dst = torch.zeros(3, 2, 16)[:, 1]
    copy_rows([(src, dst)], [(3, 1), (0, 2)])
    assert torch.equal(dst[1].view(torch.int32), src[3].view(torch.int32))
    assert torch.equal(dst[2].view(torch.int32), src[0].view(torch.int32))


def test_no_pairs_or_no_rows_launch_nothing() -> None:
    src, dst = torch.ones(2, 4), torch.zeros(2, 4)
    with recording_launches() as launched:
        copy_rows([], [(0, 0)])
        copy_rows([(src, dst)], [])
    assert launched == [] and not dst.any()


@pytest.mark.parametrize(
    ("pairs", "rows", "message"),
    [
        ([(torch.zeros(2, 4), torch.zeros(2, 5))], [(0, 0)], r"pair 0 has rows \(4,\) torch.float32 and \(5,\)"),
        ([(torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.bfloat16))], [(0, 0)], "pair 0 has rows"),
        ([(torch.zeros(2, 4, 2)[:, :, 0], torch.zeros(2, 4))], [(0, 0)], "pair 0 has rows that are not contiguous"),
        ([(torch.zeros(2, 4), torch.zeros(3, 4))], [(2, 0)], r"row pair \(2, 0\) is outside pair 0's 2 and 3 rows"),
        ([(torch.zeros(2, 4), torch.zeros(3, 4))], [(0, 3)], r"row pair \(0, 3\) is outside"),
        ([(torch.zeros(2, 4), torch.zeros(3, 4))], [(0, 1), (1, 1)], "a destination row appears twice"),
        ([(torch.zeros(0, 4), torch.zeros(3, 4))], [(0, 1)], "pair 0 is not two stacks of rows"),
    ],
)
def test_bad_pairs_or_rows_are_refused_by_name(pairs, rows, message) -> None:
    for copy in (copy_rows, copy_rows_reference):
        with pytest.raises(ValueError, match=message):
            copy(pairs, rows)


def test_a_copy_within_one_storage_is_refused() -> None:
    t = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="pair 0 copies within one storage"):
        copy_rows([(t[:2], t[2:])], [(0, 1)])
