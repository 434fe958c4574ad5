"""scripts/gpu_sweep_hyper.py on the CPU under the Triton interpreter, with fake timers (its timing needs CUDA)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
from gpu_check_hyper import make_rows, make_weights
from gpu_sweep_hyper import (
    KERNELS,
    SMOKE,
    ReadTiles,
    best,
    candidates,
    launch,
    main,
    read_tiles,
    recording,
    report,
    sweep,
)

CPU = torch.device("cpu")
KEYS = {"rows", "tiles", "default", "us", "kernel_us", "x_mismatches", "inject_mismatches", "error"}
OTHER = [ReadTiles(16, 64, 16, 128, True, 4, 1), ReadTiles(32, 16, 32, 32, False, 2, 1)]


def run(tiles: list[ReadTiles], timer=lambda calls: 7.0, read=launch, n: int = 3) -> list[dict]:
    """The sweep at the smoke shape for n rows, seeded."""
    return sweep(n, SMOKE, CPU, torch.Generator().manual_seed(0), tiles, timer, read=read)


def test_candidates_cover_every_setting_within_the_budget() -> None:
    tiles = candidates()
    assert 40 <= len(tiles) <= 60 and len(set(tiles)) == len(tiles)
    assert {t.down_r for t in tiles} == {16, 32, 64} and {t.up_d for t in tiles} == {16, 32, 64, 128}
    assert {(t.num_warps, t.num_stages) for t in tiles} == {(w, s) for w in (2, 4, 8) for s in (2, 3, 4, 5)}
    assert {t.in_program for t in tiles} == {False, True}
    smoke = candidates((4,), (1,))
    assert len(smoke) == 4 and {(t.num_warps, t.num_stages) for t in smoke} == {(4, 1)}


def test_identical_candidates_report_zero_mismatches() -> None:
    rows = run(candidates((4,), (1,)))
    assert rows[0]["tiles"] == asdict(read_tiles(3, SMOKE.r)) and rows[0]["default"]
    assert len(rows) == 5  # the interpreter's default tiles, then the four candidates
    for r in rows:
        assert set(r) == KEYS and r["error"] is None and r["rows"] == 3
        assert r["x_mismatches"] == 0 and r["inject_mismatches"] == 0
        assert r["us"] == 7.0 and r["kernel_us"] == dict.fromkeys(("rstd", "down", "mix"), 7.0)  # those launched


def test_each_kernel_is_timed_by_replaying_its_own_launch() -> None:
    gen = torch.Generator().manual_seed(0)
    w, rows = make_weights("read", SMOKE, CPU, gen), make_rows("read", 2, SMOKE, CPU, gen)
    with recording(KERNELS) as kept:
        x, _ = launch(w, rows, SMOKE, read_tiles(2, SMOKE.r))
    counts = {name: len(calls) for name, calls in kept.items()}
    assert counts == {"rstd": 1, "down": 1, "linear": 0, "split_sum": 0, "mix": 1, "up_mix": 0}
    want = x.clone()
    x.zero_()
    kept["mix"][0]()  # the mix launch alone writes x again from the recorded rstd and h
    assert torch.equal(x, want)

    timed: list[int] = []

    def timer(calls):
        """Run the calls; fake µs: how many timings came before."""
        for fn in calls:
            fn()
        timed.append(len(calls))
        return float(len(timed))

    row = run([], timer, n=2)[0]
    assert row["us"] == 1.0 and row["kernel_us"] == {"rstd": 2.0, "down": 3.0, "mix": 4.0} and timed == [1] * 4


def test_a_different_candidate_list() -> None:
    rows = run(OTHER, n=1)
    assert [r["tiles"] for r in rows] == [asdict(read_tiles(1, SMOKE.r))] + [asdict(t) for t in OTHER]
    assert [r["default"] for r in rows] == [True, False, False]
    assert all(r["error"] is None and r["x_mismatches"] == r["inject_mismatches"] == 0 for r in rows)


def test_best_is_sorted_and_bit_identical_even_when_a_mismatch_is_fastest() -> None:
    bad, broken = OTHER
    seen: list[ReadTiles] = []

    def read(w, rows, shape, tiles):
        """launch, but one candidate's x is off by one element and another fails."""
        seen.append(tiles)
        if tiles == broken:
            raise RuntimeError("no compile")
        x, inj = launch(w, rows, shape, tiles)
        if tiles == bad:
            x = x.clone()
            x[0, 0] += 1
        return x, inj

    order = [read_tiles(3, SMOKE.r), *candidates((4,), (1,)), bad, broken]
    speed = {t: 100.0 - i for i, t in enumerate(order)}  # later candidates faster, the mismatching one fastest

    def timer(calls):
        """Fake µs: the speed of the tiles the last read ran (kernel replays keep the recording read's tiles)."""
        return 1.0 if seen[-1] == bad else speed[seen[-1]]

    rows = run(order, timer, read)
    by_tiles = {ReadTiles(**r["tiles"]): r for r in rows}
    assert by_tiles[bad]["x_mismatches"] == 1 and by_tiles[bad]["inject_mismatches"] == 0
    assert by_tiles[bad]["us"] == 1.0 == min(r["us"] for r in rows if r["us"] is not None)
    assert by_tiles[broken]["error"] == "RuntimeError('no compile')" and by_tiles[broken]["us"] is None
    top = best(rows)
    assert [r["us"] for r in top] == sorted(speed[t] for t in order[:5])
    assert all(r["x_mismatches"] == r["inject_mismatches"] == 0 and r["error"] is None for r in top)
    lines = report(3, rows)
    assert lines[0] == "N=3: 7 tiles, 1 failed, 1 with other bits" and len(lines) == 2 + 5 + 2
    assert lines[2].startswith("  best 1      96.00 us")


def test_main_smoke_writes_the_json(tmp_path, capsys) -> None:
    assert main(["--out", str(tmp_path), "--smoke"]) == 0
    rows = json.loads((tmp_path / "hyper_sweep.json").read_text())
    assert [r["rows"] for r in rows] == [1] * 5 + [3] * 5
    assert all(set(r) == KEYS and r["error"] is None and r["us"] > 0 for r in rows)
    assert all(set(r["kernel_us"]) == {"rstd", "down", "mix"} for r in rows)
    out = capsys.readouterr().out
    assert out.count("  default ") == 2 and out.count("  best 1 ") == 2


@pytest.mark.parametrize(("argv", "interpret"), [(["--smoke"], False), ([], True)])
def test_main_refuses_smoke_without_the_interpreter_and_the_gpu_run_with_it(tmp_path, monkeypatch, argv, interpret):
    import gpu_sweep_hyper

    monkeypatch.setattr(gpu_sweep_hyper.hyper, "INTERPRET", interpret)
    assert main(["--out", str(tmp_path), *argv]) == 2
    assert not (tmp_path / "hyper_sweep.json").exists()


def test_via_linear_candidates_launch_the_paths_over_normed_rows_instead_of_the_fused_kernels() -> None:
    """--via-linear adds the down path by the linear kernel, the up path over stored normed rows and both; each is
    bit-compared and its linear and up-mix launches are timed on their own."""
    tiles = candidates((4,), (1,), via_linear=True)
    paths = {(t.via_linear, t.up_over_normed) for t in tiles}
    assert paths == {(False, False), (True, False), (False, True), (True, True)}
    down_only = next(t for t in tiles if t.via_linear and not t.up_over_normed)
    up_only = next(t for t in tiles if t.up_over_normed and not t.via_linear)
    rows = {(r["tiles"]["via_linear"], r["tiles"]["up_over_normed"]): r for r in run([down_only, up_only])}
    assert set(rows[True, False]["kernel_us"]) == {"rstd", "linear", "mix"}
    assert set(rows[False, True]["kernel_us"]) == {"rstd", "down", "up_mix"}
    for row in rows.values():
        assert row["error"] is None and row["x_mismatches"] is not None


@pytest.mark.parametrize("n", [1, 3])
def test_up_only_candidates_gate_rows_from_stored_h_and_from_the_range_sums_with_the_same_bits(n) -> None:
    """--up-only sweeps 16-row up tiles gated row by row both from stored h and from the down projection's K-range
    sums (the one-row read's default form), at every row count, each compared bit for bit with the default."""
    tiles = candidates((4,), (1,), up_only=True)
    rowwise = [t for t in tiles if t.up_by_row]
    assert {(t.up_d, t.up_adds_ranges) for t in rowwise} == {(d, a) for d in (8, 16, 32) for a in (False, True)}
    assert all(t.up_m == 16 and t.via_linear and t.up_over_normed for t in rowwise)
    rows = run([t for t in rowwise if t.up_d == 16], n=n)
    assert [r["tiles"]["up_adds_ranges"] for r in rows[1:]] == [False, True]
    for row in rows[1:]:
        assert row["error"] is None and row["x_mismatches"] == 0 and row["inject_mismatches"] == 0
        assert set(row["kernel_us"]) == {"rstd", "linear", "up_mix"}
