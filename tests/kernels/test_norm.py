"""The norm and small row-reduction kernels against their references, and their rows bit-identical by batch."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from kernels import norm
from kernels.norm import (
    MAX_BLOCK,
    NUM_WARPS,
    block_mean,
    block_mean_reference,
    block_r,
    gated_norm_tile,
    gated_rms_norm,
    gated_rms_norm_reference,
    group_dot,
    group_dot_reference,
    zc_rms_norm,
    zc_rms_norm_reference,
)
from model.ops import gated_rms_norm as model_gated_rms_norm
from model.ops import zc_rms_norm as model_zc_rms_norm
from tests.kernels.sentinels import outputs_with_slack, untouched

EPS = 1e-6


def rows(*shape: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    """Random rows with a different scale per row, so every row has its own RMS."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.linspace(0.5, 4.0, shape[0]).view(-1, *[1] * (len(shape) - 1))
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def weight(n: int, seed: int = 1) -> torch.Tensor:
    """A small zero-centred norm weight in bf16."""
    return (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.1).to(torch.bfloat16)


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of elements that differ (a sum order's last bit may flip one rounding)."""
    return (a != b).float().mean().item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("shape", "w"), [((7, 48), 48), ((5, 3, 16), 16), ((5, 4, 32), 128), ((3, 2500), 2500)])
def test_zc_rms_norm_matches_reference_and_model(shape, w: int, dtype: torch.dtype) -> None:
    x, wt = rows(*shape, dtype=dtype), weight(w)
    out = zc_rms_norm(x, wt, EPS)
    ref = zc_rms_norm_reference(x, wt, EPS)
    assert out.shape == x.shape and out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    else:
        assert ulps_apart(out, ref) <= 0.02
        torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
    group = shape[-1] if w != shape[-1] else None
    flat = x.flatten(1) if group else x
    model = model_zc_rms_norm(flat, wt, EPS, group).view(x.shape)
    torch.testing.assert_close(out.float(), model.float(), rtol=2e-2, atol=2e-2)


def test_zc_rms_norm_takes_strided_heads() -> None:
    proj = rows(6, 4, 32)
    q = proj[..., :16]
    assert not q.is_contiguous()
    assert torch.equal(zc_rms_norm(q, weight(16), EPS), zc_rms_norm(q.contiguous(), weight(16), EPS))


@pytest.mark.parametrize("act", ["sigmoid", "silu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gated_rms_norm_matches_reference_and_model(act: str, dtype: torch.dtype) -> None:
    x, z = rows(7, 3, 16, dtype=torch.float32), rows(7, 3, 16, dtype=dtype, seed=2)
    wt = (1.0 + weight(16).float()).to(dtype)
    out = gated_rms_norm(x, z, wt, EPS, act)
    ref = gated_rms_norm_reference(x, z, wt, EPS, act)
    assert out.dtype == dtype and out.shape == z.shape
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    else:
        assert ulps_apart(out, ref) <= 0.02
    model = model_gated_rms_norm(x.to(dtype), z, wt, EPS, act)
    torch.testing.assert_close(out.float(), model.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("tile", [(1, 1), (2, 2), (4, 4), (8, 1), (32, 4)])
def test_gated_norm_tiles_mask_a_last_part_full_program(tile: tuple[int, int]) -> None:
    """7 rows of 3 groups (21 pairs: a last program part full at every tile) equal the whole tile's output. Only the
    masking shows here (the interpreter has no layouts); tests/kernels/test_norm_gpu.py compares compiled tiles."""
    x, z = rows(7, 3, 40, dtype=torch.float32), rows(7, 3, 40, seed=5)
    wt = (1.0 + weight(40).float()).to(torch.bfloat16)
    whole = gated_rms_norm(x, z, wt, EPS, "silu", tile=(block_r(40), NUM_WARPS))
    assert torch.equal(gated_rms_norm(x, z, wt, EPS, "silu", tile=tile), whole)


def test_decode_and_verify_rounds_gated_norm_spreads_its_pairs_over_more_programs() -> None:
    """A verify round's 4 rows and a 64-lane decode round's 64 (24 heads each) take GATED_FEW_TILE's programs; calls
    of more than 85 rows (prompts) whole tiles."""
    assert gated_norm_tile(4 * 24, 128) == gated_norm_tile(64 * 24, 128) == norm.GATED_FEW_TILE
    assert norm.GATED_FEW_TILE[0] < block_r(128)
    assert gated_norm_tile(86 * 24, 128) == gated_norm_tile(8192 * 24, 128) == (block_r(128), NUM_WARPS)


def test_group_dot_and_block_mean_match_references() -> None:
    a, b = rows(5, 4, 40), rows(5, 4, 40, seed=3)
    torch.testing.assert_close(group_dot(a, b), group_dot_reference(a, b), rtol=1e-6, atol=1e-5)
    x = rows(12, 40)
    assert torch.equal(block_mean(x.float(), 4), block_mean_reference(x.float(), 4))
    assert ulps_apart(block_mean(x, 4), block_mean_reference(x, 4)) <= 0.02


def test_rows_identical_across_batch_sizes() -> None:
    x, z, wt = rows(9, 4, 32), rows(9, 4, 32, seed=4), weight(128)
    gdn_weight = (1 + wt[:32].float()).to(torch.bfloat16)
    for fn in (
        lambda a, b: zc_rms_norm(a, wt, EPS),
        lambda a, b: gated_rms_norm(a.float(), b, gdn_weight, EPS, "sigmoid"),
        group_dot,
        lambda a, b: block_mean(a.flatten(0, 1), 4),
    ):
        alone = torch.cat([fn(x[i : i + 1], z[i : i + 1]) for i in range(9)])
        assert torch.equal(fn(x, z), alone)
        assert torch.equal(fn(x[2:7], z[2:7]), alone[2:7])


def test_rejects_bad_inputs() -> None:
    x = rows(3, 32)
    with pytest.raises(ValueError, match="weight"):
        zc_rms_norm(x, weight(31), EPS)
    with pytest.raises(ValueError, match="contiguous"):
        zc_rms_norm(x.t(), weight(3), EPS)
    with pytest.raises(ValueError, match="act"):
        gated_rms_norm(x, x, weight(32), EPS, "relu")
    with pytest.raises(ValueError, match="gate"):
        gated_rms_norm(x, x[:2], weight(32), EPS, "silu")
    with pytest.raises(ValueError, match="x"):
        block_mean(x, 2)


def test_block_means_store_nothing_past_their_rows() -> None:
    """No program stores a feature past C (here 100, inside one 128-lane column program): with the means made inside a
    longer buffer, the elements after them keep their bits. (A store past a row lands in the next block's first
    feature, which on the CPU the next block's program overwrites, and on a GPU races it; past the last block it shows
    here.)"""
    x = rows(3 * 4, 100, dtype=torch.float32, seed=9)
    with outputs_with_slack(((3, 100),), 64) as slack:
        got = block_mean(x, 4)
    assert len(slack) == 1 and untouched(slack)
    assert torch.equal(got, block_mean_reference(x, 4))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_block_means_read_in_a_pool_equal_those_of_the_rows_gathered(dtype: torch.dtype) -> None:
    """The QSA indexer's completed blocks, read where the pool holds them: each block's rows from its first position
    in its slot, the same sums as `block_mean` over the rows gathered."""
    pool = rows(3, 12, 40).to(dtype)  # [slots, positions, features]
    slots, firsts = torch.tensor([2, 0, 2, 1]), torch.tensor([8, 4, 0, 8])
    gathered = pool[slots[:, None], firsts[:, None] + torch.arange(4)].flatten(0, 1)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    got = block_mean(pool, 4, slots=slots, firsts=firsts)
    assert torch.equal(got.view(bits), block_mean(gathered, 4).view(bits))
    with pytest.raises(ValueError, match="slots, firsts"):
        block_mean(pool, 4, slots=slots)
    with pytest.raises(ValueError, match="x: expected a pool"):
        block_mean(gathered, 4, slots=slots, firsts=firsts)
    with pytest.raises(ValueError, match="slots, firsts: expected contiguous"):
        block_mean(pool, 4, slots=torch.stack([slots, slots], 1)[:, 0], firsts=firsts)
    with pytest.raises(ValueError, match="slots, firsts: expected int32 or int64"):
        block_mean(pool, 4, slots=slots.bool(), firsts=firsts)
    with pytest.raises(ValueError, match="ratio"):
        block_mean(pool, 0, slots=slots, firsts=firsts)


WIDE = 2500  # three chunks of MAX_BLOCK lanes, the last partial


def test_wide_rows_take_every_chunk_and_column_tile() -> None:
    """C = 2,500 (three chunks of 1,024 lanes; three programs of block_r(C) pairs): the fp32 gated norm and group dot
    match their references, and the block mean (three column tiles) equals its reference's bits."""
    m, groups = 5, 2
    assert WIDE > 2 * MAX_BLOCK and m * groups > 2 * block_r(WIDE)
    x, z = rows(m, groups, WIDE, dtype=torch.float32), rows(m, groups, WIDE, dtype=torch.float32, seed=1)
    w = 1.0 + 0.1 * torch.randn(WIDE, generator=torch.Generator().manual_seed(2))
    for act in ("sigmoid", "silu"):
        out, ref = gated_rms_norm(x, z, w, EPS, act), gated_rms_norm_reference(x, z, w, EPS, act)
        torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(group_dot(x, z), group_dot_reference(x, z), rtol=1e-5, atol=1e-4)
    pooled = rows(6, WIDE, dtype=torch.float32, seed=3)
    assert torch.equal(block_mean(pooled, 2), block_mean_reference(pooled, 2))
