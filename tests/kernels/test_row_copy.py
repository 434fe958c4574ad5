"""Rows of many tensors in one launch (`copy_rows`): every bit of every row pair copied, whatever the dtypes, row
sizes and strides, and bad pairs or rows refused by name."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from kernels.row_copy import CHUNK, RowCopier, copy_rows, copy_rows_reference, word_bytes
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
        ([(torch.zeros(2, 4), torch.zeros(3, 4))], [(2, 0)], r"a source row of \[2\] is outside a source stack"),
        ([(torch.zeros(2, 4), torch.zeros(3, 4))], [(0, 3)], r"a destination row of \[3\] is outside a destination"),
        ([(torch.zeros(2, 4), torch.zeros(3, 4))], [(-1, 0)], r"a source row of \[-1\] is outside"),
        (
            [(torch.zeros(3, 4), torch.zeros(3, 4)), (torch.zeros(2, 4), torch.zeros(3, 4))],
            [(2, 0)],
            r"a source row of \[2\] is outside a source stack",
        ),
        (
            [(torch.zeros(2, 4), torch.zeros(4, 4).as_strided((3, 4), (2, 1)))],
            [(0, 0)],
            "pair 0's destination rows overlap",
        ),
        ([(torch.zeros(2, 4), torch.zeros(3, 4))], [(0, 1), (1, 1)], "a destination row appears twice"),
        ([(torch.zeros(0, 4), torch.zeros(3, 4))], [(0, 1)], "pair 0 is not two stacks of rows"),
    ],
)
def test_bad_pairs_or_rows_are_refused_by_name(pairs, rows, message) -> None:
    for copy in (copy_rows, copy_rows_reference):
        with pytest.raises(ValueError, match=message):
            copy(pairs, rows)


def test_copies_that_could_touch_one_byte_twice_are_refused() -> None:
    """A source in a destination's storage (its own pair's or another's) and one destination in two pairs race in
    one launch, where torch's copies would go one after another."""
    t, u = torch.zeros(4, 8), torch.zeros(4, 8)
    with pytest.raises(ValueError, match="pair 0's source shares a storage with a destination"):
        copy_rows([(t[:2], t[2:])], [(0, 1)])
    with pytest.raises(ValueError, match="pair 1's source shares a storage with a destination"):
        copy_rows([(torch.ones(2, 8), t), (t, u)], [(0, 1)])
    with pytest.raises(ValueError, match="two pairs share a destination storage"):
        copy_rows([(torch.ones(2, 8), t), (torch.ones(2, 8), t)], [(0, 1)])


def test_rows_with_other_strides_in_source_and_destination_over_more_than_one_chunk() -> None:
    """Source rows of a stack sliced from a wider one and destination rows packed: each side by its own stride, and
    a row longer than a program's chunk."""
    gen = torch.Generator().manual_seed(3)
    wide = random_bits((3, 2, CHUNK + 40), torch.float32, gen)
    src = wide[:, 1]  # rows of CHUNK + 40 words, 2 * (CHUNK + 40) apart
    dst = torch.zeros(4, CHUNK + 40)
    copy_rows([(src, dst)], [(2, 3), (0, 1)])
    assert torch.equal(dst[3].view(torch.int32), src[2].view(torch.int32))
    assert torch.equal(dst[1].view(torch.int32), src[0].view(torch.int32))
    assert not dst[0].any() and not dst[2].any()


@pytest.mark.parametrize(("offset", "width"), [(0, 4), (1, 2), (2, 4), (3, 2)])
def test_the_word_follows_the_rows_addresses(offset, width) -> None:
    """bf16 rows of 4 values starting 1 to 3 elements into a buffer: a row at an odd element is 2-byte aligned only."""
    buf = torch.zeros(40, dtype=torch.bfloat16)
    src = buf[offset : offset + 12].view(3, 4)
    dst = torch.zeros(3, 4, dtype=torch.bfloat16)
    assert word_bytes([(src, dst)]) == width
    src.copy_(torch.arange(12, dtype=torch.bfloat16).view(3, 4))
    copy_rows([(src, dst)], [(1, 0)])
    assert torch.equal(dst[0], src[1]) and not dst[1:].any()


def test_a_copier_made_once_copies_each_call_s_rows_and_serves_only_its_own_tensors() -> None:
    gen = torch.Generator().manual_seed(3)
    pairs = stacks(gen)
    want = [(src, dst.clone()) for src, dst in pairs]
    copier = RowCopier(pairs)
    for rows in ([(4, 0)], [(0, 5), (2, 2)]):
        copy_rows_reference(want, rows)
        with recording_launches() as launched:
            copier(rows)
        assert launched == ["_copy_rows_kernel"]
        for (_, got), (_, ref) in zip(pairs, want, strict=True):
            assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
    assert copier.serves(pairs)
    assert not copier.serves([(src.clone(), dst) for src, dst in pairs])  # equal values, another tensor
    assert not copier.serves(pairs[:2])
    with pytest.raises(ValueError, match="outside a destination stack"):
        copier([(0, 8)])
    del pairs, want
    assert not copier.serves(stacks(torch.Generator().manual_seed(3)))  # its own tensors are gone
