"""The n-gram hash kernel against its torch form, on windows dense with eos and the real multipliers' magnitudes."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from kernels.ngram import ngram_rows, ngram_rows_reference
from model.ple import hash_multipliers

EOS = 7


@pytest.mark.parametrize("width", [2, 3, 4])
def test_rows_equal_the_torch_hash(width: int) -> None:
    g = torch.Generator().manual_seed(width)
    per = 3
    heads = (width - 1) * per
    windows = torch.randint(0, 248_320, (45, width), generator=g)
    windows[torch.rand(45, width, generator=g) < 0.3] = EOS  # eos anywhere, also several in one window
    multipliers = hash_multipliers(248_320, width, 1, 42)
    moduli = torch.tensor([1_000_003 + 2 * h for h in range(heads)])
    offsets = torch.cumsum(moduli, 0) - moduli
    want = ngram_rows_reference(windows, EOS, multipliers, moduli, offsets, per)
    got = ngram_rows(windows, EOS, torch.tensor(multipliers), moduli, offsets, per, (0, heads))
    assert torch.equal(got, want)
    lo = heads // 2
    base = int(offsets[lo])
    assert torch.equal(ngram_rows(windows, EOS, torch.tensor(multipliers), moduli, offsets, per, (lo, heads), base),
                       want[:, lo:] - base)  # fmt: skip


def test_rejects_bad_inputs() -> None:
    windows, moduli = torch.zeros(4, 3, dtype=torch.int64), torch.ones(4, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"^windows:"):
        ngram_rows(windows.int(), EOS, torch.ones(3, dtype=torch.int64), moduli, moduli, 2, (0, 4))
    with pytest.raises(ValueError, match=r"^multipliers:"):
        ngram_rows(windows, EOS, torch.ones(2, dtype=torch.int64), moduli, moduli, 2, (0, 4))
    with pytest.raises(ValueError, match=r"^heads:"):
        ngram_rows(windows, EOS, torch.ones(3, dtype=torch.int64), moduli, moduli, 2, (0, 5))
