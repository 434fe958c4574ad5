"""scripts/interp_profile.py on a short kernel test: it reports the kernels that test launched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEST = "tests/kernels/test_gates.py::test_gated_add_into_fp32_holds_the_act_values"


def run(env_interpret: str) -> subprocess.CompletedProcess:
    """The script on TEST, with TRITON_INTERPRET set as given."""
    env = {**os.environ, "TRITON_INTERPRET": env_interpret, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, str(ROOT / "scripts/interp_profile.py"), TEST, "--top", "3"]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)


def test_it_times_each_kernel_the_test_launched() -> None:
    done = run("1")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    total = next(line for line in lines if line.startswith("total "))
    assert float(total.split()[1]) > 0
    kernel = lines[lines.index(total) + 1].split()
    assert kernel[-1] == "_gated_add_kernel" and int(kernel[2]) >= 1 and int(kernel[4]) >= int(kernel[2])


def test_it_refuses_to_run_without_the_interpreter() -> None:
    done = run("0")
    assert done.returncode == 2 and "TRITON_INTERPRET=1" in done.stderr
