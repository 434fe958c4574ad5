"""What a K-split of the routed MoE's gate-up could gain: the gate-up launch at d / S with S times the pairs.

A gate-up whose sum over d were cut into S ranges (each range's partial its own chain of MMA steps, the partials added
in order) would run S times the programs, each over d / S. This times that main phase without building it: the
gate-up launch `moe_forward` makes (the pairs path's at one row, the grouped Triton kernel's above: main sets
FLASHNEXT_GLUON=0, so the Triton kernel runs at every split) for a bank of d = 2,560 / S, top-k 10·S and 512·S
experts, each row's experts distinct and the weights cold (SETS routing sets cycled in a CUDA graph). The
partials' sum, which a split adds, is not timed; nor do the bits matter here.

python3 scripts/gpu_moe_k_split.py [--rows 1 4] [--splits 1 2 5 10]
TRITON_INTERPRET=1 python3 scripts/gpu_moe_k_split.py --smoke   # tiny shapes on the CPU, wall-clock µs
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parent.parent)]

from gpu_check_moe import Shape  # noqa: E402
from gpu_sweep_moe import inputs  # noqa: E402
from gpu_timing import graph_median_us, recording, wall_us  # noqa: E402

from kernels import moe, moe_gluon  # noqa: E402

REAL = Shape()
SMOKE = Shape(experts=4, hidden=64, inter=16, top_k=2)
SETS = 64  # routing sets cycled: 640 expert loads a cycle at one row (about 560 MB of gate-up weights at S = 1)
REPLAYS = 15
KERNELS = {"gate_up_pairs": (moe, "_gate_up_pairs_kernel"), "gate_up": (moe, "_gate_up_kernel")}


def split_shape(base: Shape, split: int) -> Shape:
    """The bank of a split by `split`: d / split, top-k and experts times split (the expert's I unchanged)."""
    if base.hidden % split:
        raise ValueError(f"--splits: {split} does not divide d = {base.hidden}")
    return Shape(experts=base.experts * split, hidden=base.hidden // split, inter=base.inter, top_k=base.top_k * split)


def gate_up_us(shape: Shape, rows: int, sets: int, device: torch.device, smoke: bool) -> tuple[str, float]:
    """(the gate-up kernel's name, µs a call) over `sets` routing sets of `rows` rows."""
    bank, routings = inputs(shape, True, {rows: sets}, device)
    with recording(KERNELS) as kept:
        for x, ids, w in routings[rows]:
            moe.moe_forward(x, ids, w, bank)
    name, calls = next((name, calls) for name, calls in kept.items() if calls)
    return name, wall_us(calls) if smoke else graph_median_us(calls, len(calls), REPLAYS)


def main(argv: list[str] | None = None) -> int:
    """Print µs a call of the gate-up for each (rows, split); 2 without a GPU (or the interpreter for --smoke)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4], help="rows a call (default 1 4)")
    ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 5, 10], help="S values (default 1 2 5 10)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, CPU, under TRITON_INTERPRET=1")
    args = ap.parse_args(argv)
    if args.smoke != moe._interpreting() or not (args.smoke or torch.cuda.is_available()):
        print("gpu_moe_k_split: needs a CUDA device, or --smoke with TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    os.environ[moe_gluon.ENV] = "0"  # the Triton gate-up at every split
    base, device = (SMOKE, torch.device("cpu")) if args.smoke else (REAL, torch.device("cuda"))
    for rows in args.rows:
        for split in args.splits:
            shape = split_shape(base, split)
            name, us = gate_up_us(shape, rows, 1 if args.smoke else SETS, device, args.smoke)
            print(f"rows {rows} split {split}: d {shape.hidden}, top-k {shape.top_k}, {shape.experts} experts: {name}"
                  f" {us:.2f} us", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
