"""scripts/gpu_moe_k_split.py on the CPU under the Triton interpreter (its timing there is wall-clock)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
from gpu_check_moe import Shape
from gpu_moe_k_split import SMOKE, main, split_shape


def test_a_split_cuts_d_and_multiplies_the_pairs_and_experts() -> None:
    assert split_shape(Shape(), 5) == Shape(experts=2560, hidden=512, inter=320, top_k=50)
    with pytest.raises(ValueError, match="--splits: 3"):
        split_shape(Shape(), 3)


def test_the_smoke_run_times_the_gate_up_each_path_launches(capsys, monkeypatch) -> None:
    monkeypatch.delenv("FLASHNEXT_GLUON", raising=False)  # main sets it; monkeypatch puts it back
    assert main(["--smoke", "--rows", "1", "2", "--splits", "1", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == [f"rows {r} split {s}" for r in (1, 2) for s in (1, 2)]
    assert f"d {SMOKE.hidden // 2}, top-k {SMOKE.top_k * 2}, {SMOKE.experts * 2} experts: gate_up_pairs" in lines[1]
    assert all(" gate_up " in line for line in lines[2:])


def test_without_the_interpreter_the_smoke_run_is_refused(monkeypatch, capsys) -> None:
    monkeypatch.setattr("kernels.moe._interpreting", lambda: False)
    assert main(["--smoke"]) == 2
    assert "--smoke with TRITON_INTERPRET=1" in capsys.readouterr().err
