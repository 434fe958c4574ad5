"""The dense BF16 linear kernel against its reference, and its rows bit-identical whatever the batch or tiles."""

from __future__ import annotations

import os
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from kernels.linear import (
    BLOCK_K,
    SUM_BLOCK,
    Gates,
    Tiles,
    arrival_counters,
    call_tiles,
    k_ranges,
    launch,
    linear,
    linear_range_sums,
    linear_reference,
    pick_tiles,
)

N = 48
SMALL = Tiles(16, 16, 2, 6)
WIDE = (Tiles(64, 64, 4, 4), Tiles(64, 128, 4, 3), Tiles(128, 128, 8, 3))


def inputs(m: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random bf16 activations [m, k] and weights [N, k]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(N, k, generator=g) / k**0.5).to(torch.bfloat16)
    return x, w


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error."""
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("m", "k"), [(1, 96), (3, 96), (7, 300)])
def test_matches_reference(m: int, k: int, out_dtype: torch.dtype) -> None:
    x, w = inputs(m, k)
    out = linear(x, w, out_dtype)
    ref = linear_reference(x, w, out_dtype)
    assert out.shape == (m, N) and out.dtype == out_dtype
    assert not out.isnan().any()
    assert rel_err(out, ref) <= (1e-2 if out_dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_rows_identical_across_batch_sizes(out_dtype: torch.dtype) -> None:
    x, w = inputs(40, 300, seed=1)
    alone = torch.cat([linear(x[i : i + 1], w, out_dtype) for i in range(7)])
    for batch in (2, 5, 7, 40):
        assert torch.equal(linear(x[:batch], w, out_dtype)[:7], alone[:batch])
    assert pick_tiles(40, N, 300) != pick_tiles(1, N, 300), "batch 40 should take the wide-tile path"


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("split", [1, 3])
def test_small_and_wide_tiles_agree(split: int, out_dtype: torch.dtype) -> None:
    x, w = inputs(5, 300, seed=2)
    k_split = 384 if split == 1 else BLOCK_K
    one = torch.cat([launch(x[i : i + 1], w, out_dtype, SMALL, split, k_split) for i in range(5)])
    assert torch.equal(launch(x, w, out_dtype, SMALL, split, k_split), one)
    for tiles in WIDE:
        assert torch.equal(launch(x, w, out_dtype, tiles, split, k_split), one), tiles


@pytest.mark.parametrize("m", [1, 40])
def test_calls_under_the_interpreter_take_wide_tiles_with_the_bits_of_the_gpus_tiles(m: int) -> None:
    """The interpreter runs programs one by one in Python, so there a call takes 64-column tiles (16 or 64 rows):
    fewer programs, and the bits of the tiles `pick_tiles` gives the GPU, whole K or split."""
    x, w = inputs(m, 300, seed=7)
    for split, k_split in ((1, 384), (3, BLOCK_K)):
        tiles = call_tiles(m, N, 300)
        assert tiles.block_n == 64 and tiles.block_m == (16 if m <= 16 else 64)
        assert tiles != pick_tiles(m, N, 300)
        assert torch.equal(
            launch(x, w, torch.bfloat16, tiles, split, k_split),
            launch(x, w, torch.bfloat16, pick_tiles(m, N, 300), split, k_split),
        )


@pytest.mark.parametrize("tiles", [SMALL, WIDE[0]], ids=["fused-sum", "sum-kernel"])
def test_split_adds_range_sums_in_order(tiles: Tiles) -> None:
    x, w = inputs(3, 300, seed=3)
    ranges = [(x[:, s : s + BLOCK_K], w[:, s : s + BLOCK_K]) for s in (0, BLOCK_K, 2 * BLOCK_K)]
    parts = [launch(xs, ws, torch.float32, SMALL, 1, BLOCK_K) for xs, ws in ranges]
    expect = (parts[0] + parts[1]) + parts[2]
    assert torch.equal(launch(x, w, torch.float32, tiles, 3, BLOCK_K), expect)
    assert torch.equal(launch(x, w, torch.bfloat16, tiles, 3, BLOCK_K), expect.to(torch.bfloat16))
    assert not arrival_counters(x.device, 1).any()


@pytest.mark.parametrize("tiles", [SMALL, WIDE[0]], ids=["16-row", "wide"])
def test_range_sums_are_the_k_ranges_sums_unadded(tiles: Tiles) -> None:
    """With `range_sums` a launch stores each K range's fp32 sum, [split, M, N], the sums the fused launch adds in
    range order, and no arrival counter is left set; `linear_range_sums` cuts K as `linear` does."""
    x, w = inputs(3, 300, seed=3)
    ranges = [(x[:, s : s + BLOCK_K], w[:, s : s + BLOCK_K]) for s in (0, BLOCK_K, 2 * BLOCK_K)]
    sums = launch(x, w, torch.float32, tiles, 3, BLOCK_K, range_sums=True)
    assert sums.shape == (3, 3, N) and sums.dtype == torch.float32
    for s, (xs, ws) in enumerate(ranges):
        assert torch.equal(sums[s], launch(xs, ws, torch.float32, SMALL, 1, BLOCK_K)), s
    assert torch.equal((sums[0] + sums[1]) + sums[2], launch(x, w, torch.float32, tiles, 3, BLOCK_K))
    assert not arrival_counters(x.device, 1).any()
    x, w = inputs(2, 2560, seed=6)
    split, k_split = k_ranges(N, 2560)
    assert split == 4
    sums = linear_range_sums(x, w)
    total = sums[0]
    for s in range(1, split):
        total = total + sums[s]
    assert sums.shape == (split, 2, N) and torch.equal(total, linear(x, w, torch.float32))
    with pytest.raises(ValueError, match="range sums"):
        launch(x, w, torch.float32, SMALL, split, k_split, round_bf16=True, range_sums=True)


@pytest.mark.parametrize("tiles", [SMALL, WIDE[0]], ids=["fused-sum", "sum-kernel"])
@pytest.mark.parametrize("split", [1, 3])
def test_round_bf16_stores_the_bf16_result_as_fp32(tiles: Tiles, split: int) -> None:
    """What a tensor-parallel partial is all-reduced from: the bf16 output's values, in an fp32 tensor."""
    x, w = inputs(5, 300, seed=4)
    k_split = 384 if split == 1 else BLOCK_K
    rounded = launch(x, w, torch.float32, tiles, split, k_split, round_bf16=True)
    assert rounded.dtype == torch.float32
    assert torch.equal(rounded, launch(x, w, torch.bfloat16, tiles, split, k_split).float())
    assert not torch.equal(rounded, launch(x, w, torch.float32, tiles, split, k_split))  # it does round
    assert torch.equal(linear(x, w, torch.float32, round_bf16=True), linear(x, w).float())
    with pytest.raises(TypeError, match="round_bf16"):
        linear(x, w, torch.bfloat16, round_bf16=True)


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("inject", [True, False])
def test_gates_store_silu_and_twice_sigmoid_of_the_sums_over_hc(split: int, inject: bool) -> None:
    """The hyper read's down projection with its gates stored in the same launch (fused range sums, the sum kernel,
    whole K): h = silu(a / hc) of the first r columns and inject = 2·sigmoid(a / hc) of the rest, from the sums the
    plain launch stores, each within one bf16 step of torch's; every tile gives the same bits, rows alone as batched."""
    hc, m = 4, 20
    x, w = inputs(m, 300, seed=5)
    w = w * 40  # sums of a few units, where silu and sigmoid are not flat
    r = N - hc if inject else N
    k_split = 384 if split == 1 else BLOCK_K

    def gates(tiles: Tiles, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = x[rows].shape[0]
        h = torch.empty(n, r, dtype=torch.bfloat16)
        inj = torch.empty(n, hc, dtype=torch.bfloat16) if inject else None
        assert launch(x[rows], w, torch.float32, tiles, split, k_split, gates=Gates(h, inj, hc)) is h
        return h, inj

    h, inj = gates(SMALL)
    v = launch(x, w, torch.float32, SMALL, split, k_split) / hc
    assert v.abs().max() > 2
    torch.testing.assert_close(
        h.float(), (v[:, :r] / (1 + torch.exp(-v[:, :r]))).bfloat16().float(), rtol=2**-7, atol=0
    )
    if inject:
        twice = 2 / (1 + torch.exp(-v[:, r:]))
        torch.testing.assert_close(inj.float(), twice.bfloat16().float(), rtol=2**-7, atol=0)
    for tiles in WIDE:
        other = gates(tiles)
        assert torch.equal(other[0], h) and (not inject or torch.equal(other[1], inj)), tiles
    alone = [gates(SMALL, slice(i, i + 1)) for i in range(m)]
    assert torch.equal(torch.cat([a[0] for a in alone]), h)
    with pytest.raises(ValueError, match="gates"):
        launch(x, w, torch.float32, SMALL, split, k_split, gates=Gates(torch.empty(m, r + 1).bfloat16(), inj, hc))
    if inject:
        with pytest.raises(ValueError, match="gates inject"):
            launch(x, w, torch.float32, SMALL, split, k_split, gates=Gates(h, torch.empty(m, hc + 1).bfloat16(), hc))
        with pytest.raises(ValueError, match="share a dtype"):
            launch(x, w, torch.float32, SMALL, split, k_split, gates=Gates(h, torch.empty(m, hc), hc))


@pytest.mark.parametrize(
    ("n", "k"), [(5120, 2560), (256, 2560), (2560, 3072), (124160, 2560), (320, 10240), (10240, 320), (48, 96)]
)
def test_k_ranges_tile_k(n: int, k: int) -> None:
    split, k_split = k_ranges(n, k)
    assert k_split % BLOCK_K == 0 and 1 <= split <= 16
    assert (split - 1) * k_split < k <= split * k_split


def test_k_ranges_split_few_columns() -> None:
    assert k_ranges(320, 10240)[0] > 1
    assert k_ranges(124160, 2560)[0] == 1


def test_empty_and_strided_inputs() -> None:
    x, w = inputs(4, 96, seed=4)
    assert linear(x[:0], w).shape == (0, N)
    wide = torch.cat([x, x], dim=1)[:, :96]
    assert torch.equal(linear(wide, w), linear(x, w))


def test_rejects_bad_inputs() -> None:
    x, w = inputs(2, 96)
    with pytest.raises(ValueError):
        linear(x, w[:, :64])
    with pytest.raises(TypeError):
        linear(x.float(), w)
    with pytest.raises(TypeError):
        linear(x, w, torch.float16)
    with pytest.raises(ValueError):
        launch(x, w, torch.bfloat16, SMALL, 2, 100)
    many, wide = torch.zeros(16 * 1400, 256, dtype=torch.bfloat16), torch.zeros(N, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        launch(many, wide, torch.bfloat16, SMALL, 2, BLOCK_K)


def test_gpu_script_cpu_parts(tmp_path: Path) -> None:
    import gpu_check_linear as script

    args = script.parse_args(["--out", str(tmp_path), "--only", "o_proj", "lm_head"])
    assert args.out == tmp_path and args.only == ["o_proj", "lm_head"]
    names = [(c[0], c[3]) for c in script.cases(args.only)]
    assert names == [("o_proj", torch.bfloat16), ("o_proj", torch.float32), ("lm_head", torch.bfloat16)]
    mem, flop = script.floor_us(1, 124160, 2560, torch.bfloat16)
    assert abs(mem - (124160 * 2560 * 2 + 2560 * 2 + 124160 * 2) / 4.27e6) < 1e-6 and flop < mem
    x, w = inputs(2, 96)
    assert script.rel_err(script.linear_reference(x, w, torch.float32), x.float() @ w.float().T) == 0.0
    row = {"out_dtype": "fp32", "nan": False, "row_invariant": True, "rel_err": 2e-5}
    assert not script.passed(row) and script.passed({**row, "rel_err": 1e-6})
    assert "ERROR" in script.line({"name": "q_proj", "m": 1, "n": 6144, "k": 2560, "out_dtype": "bf16", "error": "x"})


@pytest.mark.parametrize(
    ("n", "k"),
    [(8240, 2560), (7296, 2560), (5120, 2560), (2560, 3072), (512, 2560), (641, 2560), (2560, 320), (324, 10240),
     (124160, 2560), (4096, 1000), (6000, 1536)],
)  # fmt: skip
def test_picked_tiles_divide_their_k_ranges(n: int, k: int) -> None:
    """Every tile `pick_tiles` gives (the deeper K tiles of big weights among them) takes whole K tiles of each K
    range, so `launch` accepts it and every range ends where its sum must."""
    split, k_split = k_ranges(n, k)
    for m in (1, 4, 16, 17, 32, 33, 64, 300):
        tiles = pick_tiles(m, n, k)
        assert tiles.block_k % BLOCK_K == 0 and (split == 1 or k_split % tiles.block_k == 0), (m, tiles)


def test_sum_kernel_stores_nothing_past_the_last_partial_block() -> None:
    """The sum kernel's last block of M·N (not a multiple of SUM_BLOCK) stores gates into h and inject only: the rows
    after them in their buffers keep their sentinel, and h and inject equal the fused launch's."""
    hc, m = 4, 5
    r = N - hc
    assert (m * N) % SUM_BLOCK != 0
    x, w = inputs(m, 300, seed=11)
    w = w * 40
    h_buf = torch.full((m + 1, r), -7.0, dtype=torch.bfloat16)
    inj_buf = torch.full((m + 1, hc), -7.0, dtype=torch.bfloat16)
    h, inj = h_buf[:m], inj_buf[:m]
    launch(x, w, torch.float32, WIDE[0], 3, BLOCK_K, gates=Gates(h, inj, hc))  # 64-row tiles: the sum kernel adds
    assert (h_buf[m] == -7.0).all() and (inj_buf[m] == -7.0).all()
    fused_h, fused_inj = torch.empty(m, r, dtype=torch.bfloat16), torch.empty(m, hc, dtype=torch.bfloat16)
    launch(x, w, torch.float32, Tiles(16, 16, 2, 6), 3, BLOCK_K, gates=Gates(fused_h, fused_inj, hc))
    assert torch.equal(h, fused_h) and torch.equal(inj, fused_inj)
