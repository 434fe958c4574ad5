"""scripts/gpu_sweep_conv.py on the CPU under the Triton interpreter: every head-rows value gives one row a program's
bits, and one that does not fails the run."""

from __future__ import annotations

import json
import os

os.environ["TRITON_INTERPRET"] = "1"

import gpu_sweep_conv
import pytest

from kernels.conv import causal_conv_update


def test_smoke_run_reports_every_head_rows_value_equal(tmp_path) -> None:
    assert gpu_sweep_conv.main(["--out", str(tmp_path), "--smoke", "--head-rows", "1", "2", "16"]) == 0
    rows = json.loads((tmp_path / "conv_sweep.json").read_text())
    assert [(r["case"], r["head_rows"], r["same"]) for r in rows] == [
        (case, h, True) for case in ("prompt", "mixed") for h in (1, 2, 16)
    ]


def test_a_head_rows_value_with_other_bits_fails_the_run(tmp_path, monkeypatch) -> None:
    def skewed(x, tail, weight, lanes, dilation, activation, row_tails, head_rows):
        out = causal_conv_update(x, tail, weight, lanes, dilation, activation, row_tails, head_rows)
        return out + (head_rows > 1)

    monkeypatch.setattr(gpu_sweep_conv, "causal_conv_update", skewed)
    argv = ["--out", str(tmp_path), "--smoke", "--head-rows", "1", "4", "--cases", "mixed"]
    assert gpu_sweep_conv.main(argv) == 1
    assert [r["same"] for r in json.loads((tmp_path / "conv_sweep.json").read_text())] == [True, False]


@pytest.mark.parametrize("argv", [["--head-rows", "3"], ["--cases", "nope"]])
def test_bad_arguments_are_refused_by_name(tmp_path, argv, capsys) -> None:
    with pytest.raises(SystemExit):
        gpu_sweep_conv.main(["--out", str(tmp_path), "--smoke", *argv])
    assert argv[0] in capsys.readouterr().err
