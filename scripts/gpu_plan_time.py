"""The MoE routing plan alone on one GPU: the plan kernel against the torch-ops reference, equal arrays and µs a call
(CUDA-graph replays of eight routings of distinct random experts) at decode, verify and prompt pair counts; the
kernel in one launch that scans every earlier pair and after a launch that counts each PLAN_COUNT pairs' experts.

python3 scripts/gpu_plan_time.py [--rows 1 8 64 128 256 1024] [--max-pairs 81920]   # kernels up to that many pairs
TRITON_INTERPRET=1 python3 scripts/gpu_plan_time.py --smoke   # tiny shapes on the CPU, untimed
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

from kernels import moe  # noqa: E402
from kernels.moe import moe_plan, moe_plan_reference, moe_tiles  # noqa: E402

REAL = (512, 10)  # experts, top-k
SMOKE = (8, 2)
ROWS = (1, 8, 64, 128, 256, 1024)
SMOKE_ROWS = (1, 40)
SETS = 8
REPLAYS = 25


def compare(shape: tuple[int, int], rows, device: torch.device, timed: bool) -> bool:
    """Print, per row count, whether the kernel's plan equals the reference's and each one's µs; True if all equal."""
    experts, top_k = shape
    gen = torch.Generator(device=device).manual_seed(0)
    all_equal = True
    counted_pairs = moe.PLAN_COUNTED_PAIRS
    for n in rows:
        block_m = moe_tiles(n, top_k, experts).block_m
        sets = [
            torch.rand(n, experts, device=device, generator=gen).argsort(dim=1)[:, :top_k].to(torch.int32)
            for _ in range(SETS if timed else 1)
        ]
        past = n * top_k > getattr(moe, "PLAN_MAX_PAIRS", n * top_k)  # an older kernel handed these to torch ops
        ref = moe_plan_reference(sets[0], experts, block_m)
        fields = ("pairs", "bounds", "tile_experts", "tile_starts")
        times, equal = {}, True
        for label, counted_from in (("one launch", 1 << 30), ("counted", 0)):
            moe.PLAN_COUNTED_PAIRS = counted_from
            plan = moe_plan(sets[0], experts, block_m)
            equal &= all(torch.equal(getattr(plan, f), getattr(ref, f)) for f in fields)
            if timed:
                calls = [functools.partial(moe_plan, ids, experts, block_m) for ids in sets]
                times[label] = graph_median_us(calls, len(calls), REPLAYS)
        moe.PLAN_COUNTED_PAIRS = counted_pairs
        all_equal &= equal
        if timed:
            calls = [functools.partial(moe_plan_reference, ids, experts, block_m) for ids in sets]
            times["torch ops"] = graph_median_us(calls, len(calls), REPLAYS)
        print(
            f"rows {n:5d} pairs {n * top_k:6d}  equal {equal}  "
            + "  ".join(f"{k} {v:7.1f} us" for k, v in times.items())
            + ("  (the kernel path is torch ops here)" if past else ""),
            flush=True,
        )
    return all_equal


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", help=f"row counts (default {ROWS})")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under the Triton interpreter")
    ap.add_argument("--max-pairs", type=int, help="the kernels plan up to this many pairs (default PLAN_MAX_PAIRS)")
    args = ap.parse_args(argv)
    moe.PLAN_MAX_PAIRS = args.max_pairs or moe.PLAN_MAX_PAIRS
    device = torch.device("cpu" if args.smoke else "cuda")
    shape, rows = (SMOKE, SMOKE_ROWS) if args.smoke else (REAL, ROWS)
    return 0 if compare(shape, args.rows or rows, device, timed=not args.smoke) else 1


if __name__ == "__main__":
    sys.exit(main())
