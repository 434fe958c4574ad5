"""Where a test's time goes under the Triton interpreter: seconds, launches and programs of each kernel.

TRITON_INTERPRET=1 python scripts/interp_profile.py TEST_ID [TEST_ID ...] [--top N]
The interpreter runs a launch's programs one by one in Python, so programs, not data, set a test's time; this wraps
every interpreted launch of the pytest run it starts and prints the totals at its end.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import sys
import time
from collections.abc import Callable

import pytest

TOP = 14


class LaunchTimes:
    """Seconds, launches and programs by kernel name, gathered by wrapping the interpreter's launch."""

    def __init__(self) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()
        self.launches: collections.Counter[str] = collections.Counter()
        self.programs: collections.Counter[str] = collections.Counter()

    def wrap(self, run: Callable) -> Callable:
        """`run` (InterpretedFunction.run) that also records each launch."""

        def timed(fn, *args, grid, **kwargs):
            start = time.perf_counter()
            try:
                return run(fn, *args, grid=grid, **kwargs)
            finally:
                name = fn.fn.__name__
                self.seconds[name] += time.perf_counter() - start
                self.launches[name] += 1
                shape = grid(kwargs) if callable(grid) else grid
                self.programs[name] += math.prod(shape if isinstance(shape, (tuple, list)) else (shape,))

        return timed

    def lines(self, top: int) -> list[str]:
        """The total, then the `top` kernels by seconds."""
        out = [f"total {sum(self.seconds.values()):.1f} s in kernels"]
        for name, seconds in self.seconds.most_common(top):
            out.append(f"{seconds:8.2f} s {self.launches[name]:6d} launches {self.programs[name]:8d} programs  {name}")
        return out


def main(argv: list[str] | None = None) -> int:
    """Run the tests under the wrapped interpreter; pytest's exit status (2 without TRITON_INTERPRET=1)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tests", nargs="+", help="pytest test ids or files")
    parser.add_argument("--top", type=int, default=TOP, help=f"kernels listed (default {TOP})")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        print(
            "interp_profile: set TRITON_INTERPRET=1 (the interpreter must be chosen before triton loads)",
            file=sys.stderr,
        )
        return 2
    from triton.runtime import interpreter

    times = LaunchTimes()
    interpreter.InterpretedFunction.run = times.wrap(interpreter.InterpretedFunction.run)

    class Report:
        def pytest_sessionfinish(self) -> None:
            print("\n" + "\n".join(times.lines(args.top)), flush=True)

    return int(pytest.main([*args.tests, "-q", "-p", "no:cacheprovider"], plugins=[Report()]))


if __name__ == "__main__":
    raise SystemExit(main())
