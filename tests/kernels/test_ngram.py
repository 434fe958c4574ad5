"""The n-gram hash kernel against its torch form, on windows dense with eos and the real multipliers' magnitudes."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from kernels.ngram import ngram_rows, ngram_rows_reference
from model.ple import hash_multipliers
from tests.kernels.sentinels import outputs_with_slack, untouched

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


def test_rows_store_nothing_past_the_output() -> None:
    """No program stores past the last row or past head hi: with the rows [33, 3] (a partial second program of
    32 rows, 3 heads in 4 lanes) made inside a longer buffer, the elements after them keep their bits, and the rows
    equal the torch hash."""
    width, per, n, (lo, hi) = 4, 3, 33, (1, 4)
    g = torch.Generator().manual_seed(11)
    windows = torch.randint(0, 248_320, (64, width), generator=g)[:n]  # rows past n are in the allocation
    windows[torch.rand(n, width, generator=g) < 0.3] = EOS
    multipliers = hash_multipliers(248_320, width, 1, 42)
    moduli = torch.tensor([1_000_003 + 2 * h for h in range((width - 1) * per)])
    offsets = torch.cumsum(moduli, 0) - moduli
    with outputs_with_slack(((n, hi - lo),), 32 * 4) as slack:  # every lane of the last program past the output
        got = ngram_rows(windows, EOS, torch.tensor(multipliers), moduli, offsets, per, (lo, hi))
    assert len(slack) == 1 and untouched(slack)
    assert torch.equal(got, ngram_rows_reference(windows, EOS, multipliers, moduli, offsets, per)[:, lo:hi])
