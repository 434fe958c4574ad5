"""scripts/gpu_split_sums.py on the CPU under the Triton interpreter (tiny shapes, untimed)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import gpu_split_sums

from kernels.linear import k_ranges


def test_the_smoke_shapes_cut_k_and_both_ways_agree(capsys) -> None:
    assert all(k_ranges(n, k)[0] > 1 for n, k in gpu_split_sums.SMOKE_SHAPES.values())
    assert gpu_split_sums.main(["--smoke"]) == 0
    assert capsys.readouterr().out.count("bits equal True") == len(gpu_split_sums.SMOKE_ROWS)


def test_real_shapes_cut_k() -> None:
    assert all(k_ranges(n, k)[0] > 1 for n, k in gpu_split_sums.SHAPES.values())
