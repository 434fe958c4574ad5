"""scripts/gpu_sweep_gated_norm.py on the CPU under the Triton interpreter: every tile gives the whole tile's bits."""

from __future__ import annotations

import json
import os

os.environ["TRITON_INTERPRET"] = "1"

import gpu_sweep_gated_norm
import pytest
import torch


def test_smoke_run_reports_every_tile_equal_and_marks_the_default(tmp_path) -> None:
    argv = ["--out", str(tmp_path), "--smoke", "--rows", "4", "--pairs-a-program", "1", "4", "--warps", "2", "4"]
    assert gpu_sweep_gated_norm.main(argv) == 0
    rows = json.loads((tmp_path / "gated_norm.json").read_text())
    assert [(r["rows"], r["pairs"], r["warps"], r["same"]) for r in rows] == [
        (4, 1, 2, True), (4, 1, 4, True), (4, 4, 2, True), (4, 4, 4, True),
    ]  # fmt: skip
    assert [r["default"] for r in rows] == [(r["pairs"], r["warps"]) == (4, 4) for r in rows]


def test_a_tile_that_gives_other_bits_fails_the_run(tmp_path, monkeypatch) -> None:
    real = gpu_sweep_gated_norm.gated_rms_norm

    def off_by_a_bit(x, z, w, eps, act, tile):
        out = real(x, z, w, eps, act, tile=tile)
        return out if tile[0] != 2 else torch.nextafter(out, torch.full_like(out, float("inf")))

    monkeypatch.setattr(gpu_sweep_gated_norm, "gated_rms_norm", off_by_a_bit)
    argv = ["--out", str(tmp_path), "--smoke", "--rows", "1", "--pairs-a-program", "1", "2", "--warps", "1"]
    assert gpu_sweep_gated_norm.main(argv) == 1
    assert [r["same"] for r in json.loads((tmp_path / "gated_norm.json").read_text())] == [True, False]


def test_a_pair_count_that_is_not_a_power_of_two_is_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        gpu_sweep_gated_norm.parse_args(["--out", "o", "--pairs-a-program", "4", "3"])
    assert "--pairs-a-program: [3]" in capsys.readouterr().err


def test_a_run_on_the_gpu_without_one_is_refused(tmp_path, capsys) -> None:
    assert gpu_sweep_gated_norm.main(["--out", str(tmp_path)]) == 2  # the interpreter is on here: no --smoke
    assert "needs a CUDA device" in capsys.readouterr().err
