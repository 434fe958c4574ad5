"""Two spawned ranks that may wait on each other for good: joined within a deadline, or killed and the test failed."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch.multiprocessing as mp


def run_two_ranks(fn: Callable[..., None], args: tuple, limit_s: float) -> None:
    """fn(rank, *args) in two spawned processes; a rank still running after limit_s (waiting for a flag its peer
    never raises spins for good) has both killed and the test fails."""
    ranks = mp.start_processes(fn, args=args, nprocs=2, start_method="spawn", join=False)
    deadline = time.monotonic() + limit_s
    while not ranks.join(timeout=5):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail(f"the ranks did not finish within {limit_s} s")
