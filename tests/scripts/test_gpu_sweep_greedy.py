"""scripts/gpu_sweep_greedy.py on the CPU under the Triton interpreter: every tile gives torch's argmax."""

from __future__ import annotations

import json
import os

os.environ["TRITON_INTERPRET"] = "1"

import gpu_sweep_greedy

from kernels.sample import greedy_tokens_reference


def test_smoke_run_reports_every_tile_equal(tmp_path) -> None:
    argv = ["--out", str(tmp_path), "--smoke", "--rows", "2", "--blocks", "64", "256", "--warps", "2"]
    assert gpu_sweep_greedy.main(argv) == 0
    rows = json.loads((tmp_path / "greedy.json").read_text())
    assert [(r["rows"], r["block"], r["warps"], r["same"]) for r in rows] == [(2, 64, 2, True), (2, 256, 2, True)]


def test_a_tile_that_gives_other_tokens_fails_the_run(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(gpu_sweep_greedy, "greedy_tokens", lambda x, b, w: greedy_tokens_reference(x) + (b > 64))
    argv = ["--out", str(tmp_path), "--smoke", "--rows", "1", "--blocks", "64", "128", "--warps", "2"]
    assert gpu_sweep_greedy.main(argv) == 1
    assert [r["same"] for r in json.loads((tmp_path / "greedy.json").read_text())] == [True, False]
