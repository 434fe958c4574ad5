"""GDN's one launch (`kernels.gdn_step`) against the four kernels it stands for (conv, gates, recurrence, gated norm)
on one GPU: every output's bits, with and without kept states, and the µs per call of each (CUDA-graph replays, 20
calls a graph, 15 replays; without and with every row's state and conv tail kept) for one-row lanes and four-row
windows (the one launch reading a lane's rows one at a time, and a window at once). Inputs are
tests/kernels/test_gdn_step.py's.

python3 scripts/gpu_gdn_step.py                             # tp=2's per-rank widths, one H200
TRITON_INTERPRET=1 python3 scripts/gpu_gdn_step.py --smoke  # tiny shapes on the CPU, untimed
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys
from pathlib import Path

import torch
import triton

os.environ.setdefault("TRITON_INTERPRET", "0")  # before the test module, which would default to the interpreter
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]

from gpu_timing import graph_median_us  # noqa: E402

from tests.kernels.test_gdn_step import RANK, SMALL, Shape, fused, inputs, lanes_and_lens, unfused  # noqa: E402

CASES = [(lanes, 1) for lanes in (1, 2, 4, 8, 16, 32, 64)] + [(lanes, 4) for lanes in (1, 2, 4, 8, 16)]
SMOKE_CASES = [(3, 1), (2, 4)]


def compare(shape: Shape, cases: list[tuple[int, int]], device: str, timed: bool) -> list[dict[str, object]]:
    """Per (lanes, rows a lane): whether both paths' outputs have the same bits, and each path's µs per call."""
    report = []
    for count, rows in cases:
        data = inputs(*lanes_and_lens(count, rows, shape), seed=1, shape=shape, device=device)
        paths = {"one launch": fused, "four kernels": unfused}
        if rows > 1:  # a window's rows read at once
            paths[f"one launch, window {rows}"] = functools.partial(fused, window=triton.next_power_of_2(rows))
        equal = all(
            all((w is None and g is None) or torch.equal(w, g) for w, g in zip(want, got, strict=True))
            for keep in (False, True)
            for want in [unfused(data, keep, "silu", shape.key_heads)]
            for name, path in paths.items()
            if name != "four kernels"
            for got in [path(data, keep, "silu", shape.key_heads)]
        )
        times = {}
        if timed:
            for (name, path), keep in itertools.product(paths.items(), (False, True)):
                call = functools.partial(path, data, keep, "silu", shape.key_heads, copies=False)
                times[name + (", states kept" if keep else "")] = graph_median_us([call], 20, 15)
        report.append({"lanes": count, "rows": rows, "bits_equal": equal, "us": times})
        print(f"lanes {count} rows {rows}: bits equal {equal}  "
              + "  ".join(f"{k} {v:.2f} us" for k, v in times.items()), flush=True)  # fmt: skip
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under the Triton interpreter")
    args = ap.parse_args(argv)
    shape, cases, device = (SMALL, SMOKE_CASES, "cpu") if args.smoke else (RANK, CASES, "cuda")
    report = compare(shape, cases, device, timed=not args.smoke)
    return 0 if all(row["bits_equal"] for row in report) else 1


if __name__ == "__main__":
    sys.exit(main())
