"""Importing `kernels` pins Triton's FP-fusion default on where the environment leaves it unset, and keeps a value
that is set (the server refuses one that turns fusion off: tests/server/test_serve_cli.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = ("TRITON_DEFAULT_FP_FUSION", "TRITON_FORCE_DISABLE_FP_FUSION")
PROBE = """
import os, warnings
import kernels
from triton import knobs
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    fused = knobs.language.fp_fusion_enabled(None)
print(os.environ["TRITON_DEFAULT_FP_FUSION"], fused, sum("FP fusion" in str(w.message) for w in caught))
"""


def probe(**env: str) -> str:
    """The probe's line in a fresh process whose environment has no Triton fusion setting but `env`."""
    base = {k: v for k, v in os.environ.items() if k not in SETTINGS}
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env={**base, **env}, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.split("\n")[-2]


def test_an_unset_default_is_pinned_on_with_no_warning_and_a_set_one_is_kept() -> None:
    assert probe() == "1 True 0"
    assert probe(TRITON_DEFAULT_FP_FUSION="0").split()[:2] == ["0", "False"]
    assert probe(TRITON_DEFAULT_FP_FUSION="true").split()[:2] == ["true", "True"]
