"""scripts/gpu_sweep_gdn_chunk.py on the CPU under the Triton interpreter (tiny shapes, untimed)."""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"

import argparse

import gpu_sweep_gdn_chunk as sweep
import pytest

from kernels import gdn_chunk


def test_layouts_parse_as_lanes_of_rows() -> None:
    assert sweep.parse_layout("1024") == (1024,)
    assert sweep.parse_layout("4x64") == (64, 64, 64, 64)
    with pytest.raises(argparse.ArgumentTypeError, match="--layouts"):
        sweep.parse_layout("four")


def test_every_shape_keeps_the_bits_and_one_that_does_not_is_counted(tmp_path: Path, monkeypatch) -> None:
    default_bv = gdn_chunk.BLOCK_V
    real_prompt = sweep.gdn_prompt

    def prompt(*args, **kwargs):
        out, states = real_prompt(*args, **kwargs)
        if gdn_chunk.SCAN_WARPS == 2:  # a stand-in for a shape whose sums differ
            out[0, 0, 0] += 1.0
        return out, states

    assert sweep.main(["--out", str(tmp_path), "--smoke", "--layouts", "70"]) == 0
    rows = json.loads((tmp_path / "gdn_chunk_sweep.json").read_text())["1x70"]
    assert [row["mismatches"] for row in rows] == [0] * len(rows) and len(rows) == 4
    assert {row["shapes"]["BLOCK_V"] for row in rows} == {default_bv, 8, 16}
    monkeypatch.setattr(sweep, "gdn_prompt", prompt)
    assert sweep.main(["--out", str(tmp_path), "--smoke", "--layouts", "70"]) == 1
    rows = json.loads((tmp_path / "gdn_chunk_sweep.json").read_text())["1x70"]
    assert [row["mismatches"] > 0 for row in rows] == [row["shapes"]["SCAN_WARPS"] == 2 for row in rows]
    assert default_bv == gdn_chunk.BLOCK_V  # the shapes are put back
