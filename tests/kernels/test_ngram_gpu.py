"""The n-gram hash kernel compiled on a GPU at the real model's constants: every head's rows equal the torch hash,
whole and each rank's half, on windows dense with eos."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kernels.ngram import ngram_rows, ngram_rows_reference
from model.config import load_config
from model.ple import hash_multipliers, head_moduli

REAL = Path(__file__).resolve().parents[2] / "configs" / "qwen3.8-flash-next"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels"),
]


@pytest.mark.parametrize("rows", [1, 7, 64, 1024, 8192])
def test_real_constants_rows_equal_the_torch_hash(rows: int) -> None:
    cfg = load_config(REAL)
    width, per = cfg.ngram_size, cfg.heads_per_ngram
    heads = (width - 1) * per
    gen = torch.Generator(device="cuda").manual_seed(rows)
    windows = torch.randint(0, cfg.vocab_size, (rows, width), device="cuda", generator=gen)
    eos = cfg.eos_token_id
    windows[torch.rand(rows, width, device="cuda", generator=gen) < 0.2] = eos
    windows[:, -1] = torch.where(torch.arange(rows, device="cuda") % 5 == 0, cfg.vocab_size - 1, windows[:, -1])
    multipliers = hash_multipliers(cfg.vocab_size, width, 0, cfg.ngram_seed)
    moduli = torch.tensor(head_moduli(cfg, 0), device="cuda")
    offsets = torch.cumsum(moduli, 0) - moduli
    want = ngram_rows_reference(windows, eos, multipliers, moduli, offsets, per)
    mults = torch.tensor(multipliers, device="cuda")
    assert torch.equal(ngram_rows(windows, eos, mults, moduli, offsets, per, (0, heads)), want)
    for lo, hi in ((0, heads // 2), (heads // 2, heads)):  # each rank's heads, rows counted from its first
        base = int(offsets[lo])
        got = ngram_rows(windows, eos, mults, moduli, offsets, per, (lo, hi), base)
        assert torch.equal(got, want[:, lo:hi] - base)
