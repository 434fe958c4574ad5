"""scripts/gpu_gdn_step.py on the CPU under the Triton interpreter (tiny shapes, untimed)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import gpu_gdn_step
import pytest

from kernels import gdn_step


def test_the_one_launch_is_reported_equal_to_the_four_kernels() -> None:
    assert gpu_gdn_step.main(["--smoke"]) == 0


def test_a_launch_with_other_sums_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gdn_step, "L2_EPS", 1e-3)
    assert gpu_gdn_step.main(["--smoke"]) == 1
