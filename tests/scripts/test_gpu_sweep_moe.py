"""scripts/gpu_sweep_moe.py on the CPU under the Triton interpreter, with fake timers (its timing needs CUDA)."""

from __future__ import annotations

import itertools
import json
import os
from dataclasses import asdict
from functools import partial

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
from gpu_check_moe import Shape
from gpu_sweep_moe import (
    DOWN,
    GATE_UP,
    KERNELS,
    SMOKE,
    MoeTiles,
    best,
    candidates,
    cold_sets,
    inputs,
    joined,
    launch,
    main,
    moe_tiles,
    new_row,
    recording,
    report,
    role_us,
    sweep,
)

from kernels import moe, moe_gluon

CPU = torch.device("cpu")
KEYS = {"rows", "tiles", "default", "joined", "us", "kernel_us", "mismatches", "error"}
SAME = MoeTiles(16, 16, 32, 16, 32, 4, 1)  # the interpreter gives the default tiles' bits with these
BAD = MoeTiles(16, 32, 64, 32, 64, 4, 1)  # made to differ below
BROKEN = MoeTiles(32, 32, 32, 32, 32, 2, 1)  # made to raise below


def test_candidates_pair_every_setting_of_both_kernels_at_every_warps_and_stages() -> None:
    tiles = candidates()
    assert len(tiles) == 72 == len(set(tiles)) and {t.block_m for t in tiles} == {16}
    for w, s in itertools.product((2, 4, 8), (2, 3, 4)):
        here = [t for t in tiles if (t.num_warps, t.num_stages) == (w, s)]
        assert len(here) == 8 and {(t.gate_up_n, t.gate_up_k) for t in here} == set(GATE_UP)
        assert {(t.down_n, t.down_k) for t in here} == set(DOWN) == set(itertools.product((16, 32, 64, 128), (64, 128)))
    both = candidates((4,), (3,), (16, 32))
    assert len(both) == 16 and {t.block_m for t in both} == {16, 32}


def test_cold_sets_read_enough_weights_between_two_uses_of_a_set() -> None:
    real = Shape()
    assert [cold_sets(n, real, True) for n in (1, 8, 64)] == [64, 10, 3]  # 10, ~75, ~367 experts touched a call
    assert [cold_sets(n, real, False) for n in (1, 8, 64)] == [20, 4, 2]  # BF16 experts are 3.5 times the bytes


@pytest.mark.parametrize(("n", "last"), [(1, "down_pairs"), (moe.PAIR_ROWS, "combine")])
def test_each_kernel_is_timed_by_replaying_its_own_launch(n: int, last: str) -> None:
    bank, routings = inputs(SMOKE, True, {n: 1}, CPU)
    with recording(KERNELS) as kept:
        out = launch(bank, routings[n][0], None, torch.bfloat16)
    path = ("gate_up_pairs", "down_pairs") if n < moe.PAIR_ROWS else ("plan", "gate_up", "down", "combine")
    assert {name: len(calls) for name, calls in kept.items()} == {name: int(name in path) for name in KERNELS}
    want = out.clone()
    out.zero_()
    kept[last][0]()  # the last launch alone writes the output again from what the launches before it stored
    assert torch.equal(out, want)


def test_sweep_counts_other_bits_records_errors_and_runs_the_joined_best() -> None:
    bank, routings = inputs(SMOKE, True, {2: 1}, CPU)
    default, new = moe_tiles(2, SMOKE.top_k, SMOKE.experts), MoeTiles(16, 32, 32, 16, 32, 4, 1)
    seen: list[MoeTiles | None] = []

    def forward(bank, routing, tiles, out_dtype):
        """launch, but one candidate's output is off in one element and another fails."""
        seen.append(tiles)
        if tiles == BROKEN:
            raise RuntimeError("no compile")
        out = launch(bank, routing, tiles, out_dtype)
        if tiles == BAD:
            out = out.clone()
            out[0, 0] += 1
        return out

    whole = {default: 30.0, SAME: 20.0, BAD: 1.0}  # the differing candidate is the fastest
    kernels = {default: {"gate_up": 1.0, "down": 9.0}, SAME: {"gate_up": 9.0, "down": 1.0}}
    pending: list[str] = []

    def timer(calls):
        """Fake µs of the tiles last run: the whole call, then each of its kernels in KERNELS order."""
        if isinstance(calls[0], partial):
            pending[:] = KERNELS
            return whole.get(seen[-1], 10.0)
        return kernels.get(seen[-1], {}).get(pending.pop(0), 5.0)

    kept: list[dict] = []
    rows = sweep(2, SMOKE, bank, routings[2], [SAME, BAD, BROKEN, SAME], timer, forward, kept.append)
    assert kept == rows and all(set(r) == KEYS and r["rows"] == 2 for r in rows)
    assert [MoeTiles(**r["tiles"]) for r in rows] == [default, SAME, BAD, BROKEN, new]
    assert [(r["default"], r["joined"]) for r in rows] == [(True, False)] + [(False, False)] * 3 + [(False, True)]
    assert [r["mismatches"] for r in rows] == [0, 0, 1, None, 0]  # the joined tiles really ran: same bits
    assert rows[3]["error"] == "RuntimeError('no compile')" and rows[3]["us"] is rows[3]["kernel_us"] is None
    assert rows[0]["kernel_us"] == {"plan": 5.0, "gate_up": 1.0, "down": 9.0, "combine": 5.0}
    assert [r["us"] for r in best(rows)] == [10.0, 20.0, 30.0]  # the faster differing one is left out
    lines = report(2, rows, 0.25)
    assert lines[0] == "N=2: 5 tiles, 1 failed, 1 with other bits"
    assert [line[:21] for line in lines[1:]] == [
        "  default     30.00 u",
        "  floor        0.25 u",
        "  best 1      10.00 u",
        "  best 2      20.00 u",
        "  best 3      30.00 u",
        "  gate_up     30.00 u",
        "  down        20.00 u",
        "  joined      10.00 u",
    ]


def test_the_joined_best_takes_the_gluon_kernels_times_where_they_ran() -> None:
    """On the GPU the grouped path's down (from 80 pairs its gate-up too) is Gluon's kernel: its launches are recorded
    under their own names, and the joined best reads them as that role's times."""
    assert KERNELS["gate_up_gluon"] == (moe_gluon, "_gate_up_kernel") and KERNELS["down_gluon"][0] is moe_gluon
    fast, slow = MoeTiles(16, 32, 256, 64, 64, 4, 3), MoeTiles(16, 64, 256, 64, 64, 4, 3)
    rows = [
        {**new_row(4, t, fast), "mismatches": 0, "kernel_us": {"gate_up": us, "down_gluon": 9.0, "combine": 2.0}}
        for t, us in ((slow, 20.0), (fast, 19.0))
    ]
    assert [role_us(r, "down") for r in rows] == [9.0, 9.0]
    assert joined(rows) == fast


def test_a_joined_best_already_run_is_marked_and_kernels_not_launched_are_not_timed() -> None:
    bank, routings = inputs(SMOKE, True, {1: 1}, CPU)
    rows = sweep(1, SMOKE, bank, routings[1], [SAME], lambda calls: 7.0)
    assert [(r["default"], r["joined"]) for r in rows] == [(True, True), (False, False)]  # ties: the default's
    assert all(
        r["mismatches"] == 0 and r["kernel_us"] == dict.fromkeys(("gate_up_pairs", "down_pairs"), 7.0) for r in rows
    )  # one row: the pairs path's two kernels, the grouped path's never launched


def test_joined_adds_the_fastest_gate_up_and_down_at_shared_warps_and_stages() -> None:
    def row(tiles: MoeTiles, gate_up: float, down: float, mismatches: int = 0) -> dict:
        """An identical (unless mismatches) row with these kernel times."""
        us = {"gate_up": gate_up, "down": down}
        return {"tiles": asdict(tiles), "kernel_us": us, "mismatches": mismatches, "error": None}

    rows = [
        row(MoeTiles(16, 16, 256, 32, 64, 4, 3), 5.0, 9.0),
        row(MoeTiles(16, 64, 128, 128, 64, 4, 3), 6.0, 2.0),
        row(MoeTiles(16, 32, 512, 64, 128, 8, 2), 1.0, 1.0, mismatches=3),
        row(MoeTiles(16, 32, 128, 64, 64, 2, 2), 4.0, 4.5),
    ]
    assert joined(rows) == MoeTiles(16, 16, 256, 128, 64, 4, 3)  # 5 + 2 beats 4 + 4.5; 1 + 1 has other bits
    assert joined(rows[2:3]) is None


def test_main_smoke_writes_the_json(tmp_path, capsys) -> None:
    assert main(["--out", str(tmp_path), "--smoke", "--rows", "1"]) == 0
    result = json.loads((tmp_path / "moe_sweep_nvfp4.json").read_text())
    assert result["bank"] == "nvfp4" and result["shape"] == asdict(SMOKE) and list(result["byte_floor_us"]) == ["1"]
    rows = result["rows"]
    assert rows[0]["default"] and len(rows) >= 3 and sum(r["joined"] for r in rows) == 1
    assert all(set(r) == KEYS and r["error"] is None and r["mismatches"] == 0 and r["us"] > 0 for r in rows)
    assert all(list(r["kernel_us"]) == ["gate_up_pairs", "down_pairs"] for r in rows)
    out = capsys.readouterr().out
    assert out.startswith("N=1: ") and out.count("  default ") == 1 and out.count("  joined ") == 1


def test_main_fails_when_the_default_tiles_do(tmp_path, monkeypatch) -> None:
    import gpu_sweep_moe

    def fail(*args, **kwargs):
        raise RuntimeError("out of resources")

    monkeypatch.setattr(gpu_sweep_moe.moe, "moe_forward", fail)
    assert main(["--out", str(tmp_path), "--smoke", "--rows", "1"]) == 1
    [row] = json.loads((tmp_path / "moe_sweep_nvfp4.json").read_text())["rows"]
    assert row["default"] and row["error"] == "RuntimeError('out of resources')"


@pytest.mark.parametrize(("argv", "interpret"), [(["--smoke"], False), ([], True)])
def test_main_refuses_smoke_without_the_interpreter_and_the_gpu_run_with_it(tmp_path, monkeypatch, argv, interpret):
    import gpu_sweep_moe

    monkeypatch.setattr(gpu_sweep_moe.moe, "_interpreting", lambda: interpret)
    assert main(["--out", str(tmp_path), *argv]) == 2
    assert not list(tmp_path.iterdir())
