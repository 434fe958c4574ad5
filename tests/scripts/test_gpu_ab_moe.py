"""scripts/gpu_ab_moe.py on the CPU under the Triton interpreter (tiny shapes, untimed)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"

import gpu_ab_moe
import pytest

from kernels import moe

H = "gate * tl.sigmoid(gate) * up, True, INTERPRET)"  # the gate-up kernels' h, before its bf16 rounding
H_OFF = "gate * tl.sigmoid(gate) * up * 1.01, True, INTERPRET)"


def test_a_copy_of_the_kernel_gives_the_same_bits(tmp_path: Path, capsys) -> None:
    before = tmp_path / "moe_before.py"
    before.write_text(Path(moe.__file__).read_text())
    assert gpu_ab_moe.main(["--before", str(before), "--smoke"]) == 0
    assert "rel. difference 0.00e+00" in capsys.readouterr().out


def test_a_kernel_with_other_sums_is_reported(tmp_path: Path, capsys) -> None:
    before = tmp_path / "moe_before.py"
    source = Path(moe.__file__).read_text()
    assert H in source
    before.write_text(source.replace(H, H_OFF))
    assert gpu_ab_moe.main(["--before", str(before), "--smoke"]) == 1
    differences = [float(line.split("rel. difference ")[1].split()[0]) for line in capsys.readouterr().out.splitlines()]
    assert differences and all(d > 1e-3 for d in differences)  # h scaled by 1.01: about 1% of each output


def test_a_copy_before_the_word_layout_takes_the_checkpoint_bank(tmp_path: Path) -> None:
    root = Path(moe.__file__).resolve().parent.parent
    old = subprocess.run(["git", "show", "ed111fd:kernels/moe.py"], cwd=root, capture_output=True, text=True)
    if old.returncode:
        pytest.skip("a checkout without commit ed111fd")
    before = tmp_path / "moe_before.py"
    before.write_text(old.stdout)
    assert gpu_ab_moe.main(["--before", str(before), "--smoke"]) == 0


def test_after_replaces_the_current_kernels(tmp_path: Path) -> None:
    before, after = tmp_path / "moe_before.py", tmp_path / "moe_after.py"
    source = Path(moe.__file__).read_text()
    before.write_text(source)
    after.write_text(source.replace(H, H_OFF))
    assert gpu_ab_moe.main(["--before", str(before), "--after", str(after), "--smoke"]) == 1
