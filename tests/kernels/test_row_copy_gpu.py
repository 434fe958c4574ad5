"""`copy_rows` compiled on a GPU: the lane pool's restore at the real model's per-rank state shapes, 1 to 64 lanes,
every bit equal to torch's copies."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kernels.row_copy import RowCopier, copy_rows, copy_rows_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels"),
]
# one rank's GDN state and conv tail rows at tp=2 (24 value heads of 128 x 128, 5,120 conv channels), a PLE tail
ROWS = (((24, 128, 128), torch.float32), ((5120, 3), torch.bfloat16), ((2560, 3), torch.bfloat16))


def state_pairs(lanes: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two layers of each state row: a source stack of three rows a lane, a destination of a slot a lane and a
    scratch slot."""
    gen = torch.Generator(device="cuda").manual_seed(lanes)
    pairs = []
    for shape, dtype in ROWS * 2:
        src = torch.randint(-(2**15), 2**15, (lanes * 3, *shape), dtype=torch.int32, device="cuda", generator=gen)
        pairs.append((src.view(dtype) if dtype == torch.float32 else src.to(torch.int16).view(dtype),
                      torch.zeros((lanes + 1, *shape), dtype=dtype, device="cuda")))  # fmt: skip
    return pairs


def assert_same_bits(pairs, want) -> None:
    torch.cuda.synchronize()
    for (_, got), (_, ref) in zip(pairs, want, strict=True):
        assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.parametrize("lanes", [1, 3, 64])
def test_rows_equal_torch_copies_at_the_real_state_shapes(lanes: int) -> None:
    pairs = state_pairs(lanes)
    rows = [(3 * i + i % 3, lanes - 1 - i) for i in range(lanes)]
    want = [(src, dst.clone()) for src, dst in pairs]
    copy_rows_reference(want, rows)
    copy_rows(pairs, rows)
    assert_same_bits(pairs, want)


def test_a_copier_reused_across_restores_copies_each_ones_rows() -> None:
    """The lane pool's copier of a graph's stacks serves restore after restore from one table."""
    pairs = state_pairs(3)
    want = [(src, dst.clone()) for src, dst in pairs]
    copier = RowCopier(pairs)
    for rows in ([(0, 1), (4, 0)], [(8, 2)], [(1, 0), (5, 1), (6, 2)]):
        copy_rows_reference(want, rows)
        copier(rows)
        assert_same_bits(pairs, want)
