"""Thread pools' share of the cores: the cores a process may run on, and a pool size set by hand kept."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from server import threads


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS")
def test_usable_cores_are_those_the_process_may_run_on():
    """A process pinned to one core (as a container's cpuset pins it) counts one, not the machine's."""
    pinned = "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); from server import threads; "
    probe = [sys.executable, "-c", pinned + "print(threads.usable_cores())"]
    out = subprocess.run(probe, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "1", out.stderr[-2000:]


def test_a_share_is_set_only_where_no_size_was_given(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 16)
    environ = {"MKL_NUM_THREADS": "3"}
    assert threads.give_thread_pools_a_share(environ, 4) == 4
    assert environ == {"OMP_NUM_THREADS": "4", "MKL_NUM_THREADS": "3", "OPENBLAS_NUM_THREADS": "4"}
