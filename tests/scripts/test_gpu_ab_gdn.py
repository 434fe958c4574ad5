"""scripts/gpu_ab_gdn.py on the CPU under the Triton interpreter (tiny shapes, untimed)."""

from __future__ import annotations

import os
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"

import gpu_ab_gdn

from kernels import gdn


def test_a_copy_of_the_kernel_gives_the_same_bits(tmp_path: Path) -> None:
    before = tmp_path / "gdn_before.py"
    before.write_text(Path(gdn.__file__).read_text())
    assert gpu_ab_gdn.main(["--before", str(before), "--smoke"]) == 0


def test_a_kernel_with_other_sums_is_reported(tmp_path: Path) -> None:
    before = tmp_path / "gdn_before.py"
    source = Path(gdn.__file__).read_text()
    assert "L2_EPS = 1e-6" in source
    before.write_text(source.replace("L2_EPS = 1e-6", "L2_EPS = 1e-3"))
    assert gpu_ab_gdn.main(["--before", str(before), "--smoke"]) == 1
