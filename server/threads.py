"""Thread pools sized to a share of the cores: processes that run side by side (the CPU ranks of `--tp`, the workers
of a parallel test run) each take theirs, since pools sized for the whole machine in every process spin waiting on
each other's threads. Imports nothing heavy: it runs before torch is imported."""

from __future__ import annotations

import os

THREAD_POOLS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")  # torch's, MKL's and NumPy's BLAS


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS reports one, as a container's cpuset sets it)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def share_of_cores(parts: int, cores: int | None = None) -> int:
    """One of `parts` equal shares of `cores` (the usable ones unless given), at least one."""
    return max(1, (usable_cores() if cores is None else cores) // max(1, parts))


def give_thread_pools_a_share(environ: dict[str, str], parts: int) -> int:
    """Size each pool in `environ` to one of `parts` shares of the cores, keeping a size set by hand; the share."""
    share = share_of_cores(parts)
    for name in THREAD_POOLS:
        environ.setdefault(name, str(share))
    return share
