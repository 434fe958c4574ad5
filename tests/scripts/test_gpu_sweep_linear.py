"""scripts/gpu_sweep_linear.py on the CPU under the Triton interpreter, with a fake timer (its timing needs CUDA)."""

from __future__ import annotations

import json
import os

os.environ["TRITON_INTERPRET"] = "1"

import torch
from gpu_sweep_linear import BLOCK_K, TILES, best, candidates, main, splits_of, sweep_case

from kernels.linear import k_ranges, pick_tiles


def test_splits_tile_k_in_whole_steps_and_candidates_start_with_the_default() -> None:
    for k in (640, 2560, 3072):
        for split, k_split in splits_of(k):
            assert k_split % BLOCK_K == 0 and (split - 1) * k_split < k <= split * k_split
    assert splits_of(2560) == [(1, 2560), (2, 1280), (3, 896), (4, 640)]
    got = candidates(1, 2560, 3072)
    split, k_split = k_ranges(2560, 3072)
    assert got[0] == (pick_tiles(1, 2560, split), split, k_split)
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
