"""scripts/gpu_pack.sh: a GPU call's logs packed into one tarball, earlier packs left beside it."""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def pack(out: Path, name: str) -> subprocess.CompletedProcess:
    """Run `pack_out NAME` with OUT = out."""
    return subprocess.run(
        ["bash", "-c", f"source {ROOT / 'scripts/gpu_pack.sh'} && pack_out {name}"],
        env={**os.environ, "OUT": str(out)},
        capture_output=True,
        text=True,
        check=False,
    )


def test_the_logs_become_one_tarball_and_earlier_packs_stay(tmp_path: Path) -> None:
    (tmp_path / "step.out").write_text("round\n")
    (tmp_path / "step" / "deep").mkdir(parents=True)
    (tmp_path / "step" / "deep" / "trace.json.gz").write_bytes(b"\x1f\x8b")
    (tmp_path / "earlier.tgz").write_bytes(b"kept")
    assert pack(tmp_path, "call_1").returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["call_1.tgz", "earlier.tgz"]
    with tarfile.open(tmp_path / "call_1.tgz") as tar:
        names = set(tar.getnames())
        assert {"step.out", "step/deep/trace.json.gz"} <= names
        assert tar.extractfile("step.out").read() == b"round\n"


def test_without_out_it_refuses_and_names_it(tmp_path: Path) -> None:
    run = subprocess.run(
        ["bash", "-c", f"unset OUT; source {ROOT / 'scripts/gpu_pack.sh'} && pack_out x"],
        capture_output=True,
        text=True,
        check=False,
        cwd=tmp_path,
    )
    assert run.returncode != 0 and "OUT" in run.stderr
    assert not (tmp_path / "x.tgz").exists()
