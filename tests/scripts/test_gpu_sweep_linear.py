"""scripts/gpu_sweep_linear.py on the CPU under the Triton interpreter, with a fake timer (its timing needs CUDA)."""

from __future__ import annotations

import json
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
from gpu_sweep_linear import BLOCK_K, TILES, best, candidates, main, splits_of, sweep_case, tile_grid

from kernels.linear import Tiles, k_ranges, launch, pick_tiles


def test_splits_tile_k_in_whole_steps_and_candidates_start_with_the_default() -> None:
    for k in (640, 2560, 3072):
        for split, k_split in splits_of(k):
            assert k_split % BLOCK_K == 0 and (split - 1) * k_split < k <= split * k_split
    assert splits_of(2560) == [(1, 2560), (2, 1280), (3, 896), (4, 640)]
    got = candidates(1, 2560, 3072)
    split, k_split = k_ranges(2560, 3072)
    assert got[0] == (pick_tiles(1, 2560, 3072), split, k_split)
    every = {(t, s, ks) for s, ks in splits_of(3072) for t in TILES} | {got[0]}
    assert len(got) == len(set(got)) == len(every) and set(got) == every


def test_a_case_times_every_k_cut_and_tiles_keep_the_bits() -> None:
    times = iter(range(100, 0, -1))
    rows = sweep_case("smoke", 48, 640, 3, torch.device("cpu"), torch.Generator().manual_seed(0), lambda c: next(times))
    default = rows[0]
    assert default["default"] and all(not r["default"] for r in rows[1:])
    assert all(r["mismatches"] == 0 for r in rows if r["split"] == default["split"])
    assert {r["split"] for r in rows} == {s for s, _ in splits_of(640)}
    assert [r["us"] for r in best(rows, 2)] == sorted(float(r["us"]) for r in rows)[:2]


def test_the_smoke_run_writes_every_candidate(tmp_path) -> None:
    assert main(["--out", str(tmp_path), "--smoke", "--rows", "2"]) == 0
    rows = json.loads((tmp_path / "linear_sweep.json").read_text())
    assert len(rows) == len(candidates(2, 48, 640)) and rows[0]["default"]


def test_k_tiles_are_offered_only_where_they_divide_the_k_ranges() -> None:
    grid = tile_grid((BLOCK_K, 2 * BLOCK_K, 5 * BLOCK_K), (2,), (4,))
    got = candidates(1, 324, 10240, grid)
    assert got[0][0].block_k == BLOCK_K
    for tiles, split, k_split in got[1:]:
        assert split == 1 or k_split % tiles.block_k == 0
    assert any(t.block_k == 5 * BLOCK_K and s > 1 for t, s, _ in got)  # 640-wide ranges take 640-wide tiles
    assert not any(t.block_k == 2 * BLOCK_K and ks % (2 * BLOCK_K) for t, s, ks in got if s > 1)
    same = candidates(1, 324, 10240, grid, same_split=True)
    assert {(s, ks) for _, s, ks in same} == {k_ranges(324, 10240)}


def test_a_k_tile_that_does_not_divide_the_ranges_is_refused_by_launch() -> None:
    x = torch.randn(1, 1280).bfloat16()
    w = torch.randn(32, 1280).bfloat16()
    with pytest.raises(ValueError, match="block_k = 256"):
        launch(x, w, torch.bfloat16, Tiles(16, 16, 2, 1, 256), 2, 640)
    for depth in (192, 384, 0, 64):  # not a multiple of 128, not a power of two, none, too shallow
        with pytest.raises(ValueError, match=f"block_k = {depth}"):
            launch(x, w, torch.bfloat16, Tiles(16, 16, 2, 1, depth), 1, 1280)


def test_a_wider_k_tile_adds_the_same_products() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 1024, generator=gen).bfloat16()
    w = torch.randn(48, 1024, generator=gen).bfloat16()
    want = (x.double() @ w.double().T).float()
    for block_k in (BLOCK_K, 4 * BLOCK_K):
        got = launch(x, w, torch.float32, Tiles(16, 16, 2, 1, block_k), 2, 512)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
