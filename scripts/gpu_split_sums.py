"""The linear kernel's K-range sums on one GPU: added by the last range's program (the arrival counters) against the
second kernel, at tp=2's per-rank shapes that cut K into ranges: bits of both, and µs a call (CUDA-graph replays
cycling through weight copies, so the weights come from HBM as in a step).

python3 scripts/gpu_split_sums.py [--rows 17 64 256 1024]
TRITON_INTERPRET=1 python3 scripts/gpu_split_sums.py --smoke   # tiny shapes on the CPU, untimed
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]

from gpu_timing import graph_median_us  # noqa: E402

from kernels.linear import k_ranges, launch, pick_tiles  # noqa: E402

SHAPES = {  # name: (N, K) per rank at tp=2
    "o_proj": (2560, 3072),
    "out_proj": (2560, 2048),
    "router": (512, 2560),
    "shared gate/up/gate": (641, 2560),
    "hyper down+inject": (324, 10240),
}
SMOKE_SHAPES = {"small": (48, 1280)}
ROWS = (17, 64, 256, 1024)
SMOKE_ROWS = (17, 40)
COPIES = 8  # weight copies a timed graph cycles through
REPLAYS = 25


def compare(shapes: dict[str, tuple[int, int]], rows, device: torch.device, timed: bool) -> bool:
    """Print, per shape and row count, whether both ways give the same bits and each one's µs; True if all equal."""
    gen = torch.Generator(device=device).manual_seed(0)
    all_equal = True
    for name, (n, k) in shapes.items():
        split, k_split = k_ranges(n, k)
        weights = [(torch.randn(n, k, device=device, generator=gen) / k**0.5).bfloat16() for _ in range(COPIES)]
        for m in rows:
            x = torch.randn(m, k, device=device, generator=gen).bfloat16()
            tiles = pick_tiles(m, n, split)
            ways = {"counters": False, "second kernel": True}
            call = functools.partial(launch, x, tiles=tiles, split=split, k_split=k_split, out_dtype=torch.float32)
            outs = {way: call(weights[0], sum_kernel=s) for way, s in ways.items()}
            equal = torch.equal(outs["counters"], outs["second kernel"])
            all_equal &= equal
            times = {}
            if timed:
                for way, s in ways.items():
                    calls = [functools.partial(call, w, sum_kernel=s) for w in weights]
                    times[way] = graph_median_us(calls, len(calls), REPLAYS)
            print(
                f"{name:20s} rows {m:5d} split {split:2d}  bits equal {equal}  "
                + "  ".join(f"{way} {us:7.1f} us" for way, us in times.items()),
                flush=True,
            )
    return all_equal


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", help=f"row counts (default {ROWS})")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under the Triton interpreter")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    shapes, rows = (SMOKE_SHAPES, SMOKE_ROWS) if args.smoke else (SHAPES, ROWS)
    return 0 if compare(shapes, args.rows or rows, device, timed=not args.smoke) else 1


if __name__ == "__main__":
    sys.exit(main())
