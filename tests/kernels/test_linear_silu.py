"""The linear kernel's silu·up epilogue: the bits of `linear` over [gate; up; logit] followed by `silu_mul`."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from kernels.gates import silu_mul
from kernels.linear import BLOCK_K, SiluPairs, Tiles, launch, linear, linear_silu_mul, pair_rows

SMALL = Tiles(16, 16, 2, 6)
WIDE = Tiles(64, 64, 4, 4)


def weights(h: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gate, up [h, k] and logit [1, k] rows whose sums reach a few units, where silu is not flat."""
    g = torch.Generator().manual_seed(seed)
    gate, up, logit = (torch.randn(n, k, generator=g) * 3 / k**0.5 for n in (h, h, 1))
    return gate.bfloat16(), up.bfloat16(), logit.bfloat16()


def unfused(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, logit: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What the model ran before: one linear over the stacked rows, then `silu_mul` of its gate and up columns."""
    h = gate.shape[0]
    y = linear(x, torch.cat([gate, up, logit]))
    return silu_mul(y[:, :h], y[:, h : 2 * h]), y[:, 2 * h :]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (bf16 compared as integers, so -0.0 and +0.0 differ)."""
    return torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


@pytest.mark.parametrize(("m", "h", "k"), [(1, 24, 2560), (3, 8, 256), (17, 40, 1280), (40, 24, 2560), (5, 7, 96)])
def test_silu_pairs_have_the_bits_of_linear_then_silu_mul(m: int, h: int, k: int) -> None:
    """One row (16-row tiles, K cut into ranges added by the last arrival), wide tiles (ranges added by the sum
    kernel), whole K (96), and an odd H: h and logit equal the unfused path's bit for bit."""
    g = torch.Generator().manual_seed(m * 1000 + h)
    x = torch.randn(m, k, generator=g).bfloat16()
    gate, up, logit = weights(h, k, seed=h + k)
    h_out, logit_out = linear_silu_mul(x, pair_rows(gate, up, logit))
    h_ref, logit_ref = unfused(x, gate, up, logit)
    assert h_out.shape == (m, h) and logit_out.shape == (m, 1)
    assert h_ref.abs().max() > 1  # silu is not flat there
    assert same_bits(h_out, h_ref) and same_bits(logit_out, logit_ref)


@pytest.mark.parametrize("split", [1, 3])
def test_both_tile_heights_and_rows_alone_give_the_same_bits(split: int) -> None:
    """16-row and wide tiles, rows alone and batched: the same h and logit (the exactness contract's row invariance)."""
    m, h, k = 20, 12, 3 * BLOCK_K
    g = torch.Generator().manual_seed(7)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = pair_rows(*weights(h, k, seed=8))
    k_split = k if split == 1 else BLOCK_K

    def run(tiles: Tiles, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        n = x[rows].shape[0]
        pairs = SiluPairs(torch.empty(n, h, dtype=torch.bfloat16), torch.empty(n, 1, dtype=torch.bfloat16))
        assert launch(x[rows], w, torch.float32, tiles, split, k_split, pairs=pairs) is pairs.h
        return pairs.h, pairs.logit

    h_small, logit_small = run(SMALL)
    h_wide, logit_wide = run(WIDE)
    assert same_bits(h_small, h_wide) and same_bits(logit_small, logit_wide)
    alone = [run(SMALL, slice(i, i + 1)) for i in range(m)]
    assert same_bits(torch.cat([a[0] for a in alone]), h_small)
    assert same_bits(torch.cat([a[1] for a in alone]), logit_small)


def test_pair_rows_interleaves_gate_and_up_and_pads_after_the_logit() -> None:
    """Rows 2j and 2j+1 are gate and up row j, then the logit row and a zero row; mismatched shapes are refused."""
    gate, up, logit = weights(3, 32, seed=1)
    w = pair_rows(gate, up, logit)
    assert w.shape == (8, 32)
    assert torch.equal(w[0:6:2], gate) and torch.equal(w[1:6:2], up)
    assert torch.equal(w[6:7], logit) and not w[7].any()
    with pytest.raises(ValueError, match="pair_rows"):
        pair_rows(gate, up[:2], logit)


def test_rejects_outputs_it_cannot_store() -> None:
    """Each output, weight or tile the pair epilogue cannot take is refused, naming it."""
    x = torch.randn(2, 96).bfloat16()
    w = pair_rows(*weights(4, 96, seed=2))
    bf16 = torch.bfloat16

    def pairs(h: torch.Tensor | None = None, logit: torch.Tensor | None = None) -> SiluPairs:
        return SiluPairs(
            torch.empty(2, 4, dtype=bf16) if h is None else h, torch.empty(2, 1, dtype=bf16) if logit is None else logit
        )

    with pytest.raises(ValueError, match="2·H \\+ 2"):
        launch(x, w[:-1], torch.float32, SMALL, 1, 96, pairs=pairs())
    with pytest.raises(ValueError, match="pairs logit"):
        launch(x, w, torch.float32, SMALL, 1, 96, pairs=pairs(logit=torch.empty(2, 2, dtype=bf16)))
    with pytest.raises(ValueError, match="pairs h must be contiguous bf16"):
        launch(x, w, torch.float32, SMALL, 1, 96, pairs=pairs(h=torch.empty(2, 4)))
    with pytest.raises(ValueError, match="pairs h must be contiguous bf16"):
        launch(x, w, torch.float32, SMALL, 1, 96, pairs=pairs(h=torch.empty(2, 8, dtype=bf16)[:, ::2]))
    with pytest.raises(ValueError, match="even column tiles"):
        launch(x, w, torch.float32, Tiles(16, 24 - 1, 2, 1), 1, 96, pairs=pairs())
    with pytest.raises(ValueError, match="even column tiles"):
        launch(x, w, torch.float32, SMALL, 1, 96, round_bf16=True, pairs=pairs())
    with pytest.raises(ValueError, match="w_pairs"):
        linear_silu_mul(x, w[:2])
