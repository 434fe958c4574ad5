"""The grouped gate-up and down projections alone on one GPU at tp=2's per-rank widths: kernels/moe_gluon.py's
kernels at every row count (the gate-up in (warps)x(128-k spans a step) shapes, the down one in (warps)x(column
groups) shapes, each program taking 8 or 16 rows of a 16-row plan tile, 16 or 32 of a prompt's 32-row tile, as
--program-rows lists) against kernels/moe.py's Triton kernels, bits of every h and y and µs per call (CUDA-graph
replays cycling through routings enough to keep the weights cold in L2): the figures moe_gluon's row ranges and
DOWN_SHAPES come from.

python3 scripts/gpu_gluon_sweep.py [--rows 2 8 64 256 512] [--gate-up-shapes 2x2 4x2] [--down-shapes 2x2 4x8]
    [--program-rows 8 16 32]
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]

from gpu_check_moe import Shape, packed_bank  # noqa: E402
from gpu_timing import graph_median_us  # noqa: E402

from kernels import moe, moe_gluon  # noqa: E402
from kernels.fp4_words import kernel_bank  # noqa: E402

ROWS = (2, 4, 8, 16, 32, 64, 128, 256, 384, 512, 640, 819)
GATE_UP_SHAPES = ("2x2",)  # warps x spans a K step
DOWN_SHAPES = ("2x1", "2x2", "2x4", "4x2", "4x4", "2x8", "4x8")  # warps x column groups
SETS = 32
REPLAYS = 25


def outputs(sets: list, calls: list, index: int) -> list[torch.Tensor]:
    """Each set's output `index` after `calls`, from a NaN-filled start."""
    for s, call in zip(sets, calls, strict=True):
        s[index].fill_(float("nan"))
        call()
    return [s[index].clone() for s in sets]


def differ(got: list[torch.Tensor], want: list[torch.Tensor]) -> int:
    """Elements whose bits differ."""
    ints = torch.int16 if want[0].dtype == torch.bfloat16 else torch.int32
    return sum(int((a.view(ints) != b.view(ints)).sum()) for a, b in zip(got, want, strict=True))


def sets_for(rows: int) -> int:
    """Routings cycled through at this many rows: SETS up to 1,024 rows, fewer beyond (each reads every expert)."""
    return max(4, min(SETS, SETS * 1024 // rows))


def program_rows(rows: int, block_m: int) -> bool:
    """Set the rows of a `block_m`-row plan tile a Gluon program takes; False where no program takes so many."""
    if rows not in (block_m // 2, block_m):
        return False
    moe_gluon.GATE_UP_ROWS = moe_gluon.DOWN_ROWS = moe_gluon.PROMPT_ROWS = rows
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    ap.add_argument("--gate-up-shapes", nargs="+", default=list(GATE_UP_SHAPES))
    ap.add_argument("--down-shapes", nargs="+", default=list(DOWN_SHAPES))
    ap.add_argument("--program-rows", type=int, nargs="+", default=[8, 16], help="rows of a plan tile a program takes")
    args = ap.parse_args(argv)
    shape = Shape()
    bank = kernel_bank(packed_bank(shape, torch.Generator(device="cuda").manual_seed(0)), in_place=True)
    weights = moe._weights(bank)
    gluon_down, gluon_gate_up = moe_gluon.down, moe_gluon.gate_up
    moe_gluon.GATE_UP_MIN_PAIRS, moe_gluon.MAX_PAIRS_PER_EXPERT = 0, shape.top_k * max(args.rows)  # every row count
    differing = 0
    for n in args.rows:
        tiles = moe.moe_tiles(n, shape.top_k, shape.experts)
        gen = torch.Generator(device="cuda").manual_seed(n)
        sets = []
        for _ in range(sets_for(n)):
            ids = torch.rand(n, shape.experts, device="cuda", generator=gen).argsort(dim=1)[:, : shape.top_k]
            plan = moe.moe_plan(ids.to(torch.int32), shape.experts, tiles.block_m)
            x = torch.randn(n, shape.hidden, device="cuda", generator=gen).bfloat16()
            h = torch.empty(n * shape.top_k, shape.inter, device="cuda", dtype=torch.bfloat16)
            sets.append((x, plan, h, torch.empty(n * shape.top_k, shape.hidden, device="cuda")))
        ups = [
            lambda s=s, t=tiles: moe._gate_up_grouped(s[0], s[1], weights, s[2], shape.top_k, t, False) for s in sets
        ]
        downs = [lambda s=s, t=tiles: moe._down_grouped(s[2], s[1], weights, s[3], t, False) for s in sets]

        moe_gluon.down = moe_gluon.gate_up = lambda *a: False
        want_h = outputs(sets, ups, 2)
        want_y = outputs(sets, downs, 3)
        line = [f"rows {n:4d}  gate-up triton {graph_median_us(ups, len(sets), REPLAYS):7.1f}"]
        moe_gluon.gate_up = gluon_gate_up
        for gate_up_shape, rows in itertools.product(args.gate_up_shapes, args.program_rows):
            moe_gluon.GATE_UP_WARPS, moe_gluon.GATE_UP_SPANS = map(int, gate_up_shape.split("x"))
            if not program_rows(rows, tiles.block_m) or not moe_gluon.gate_up_usable(weights, sets[0][1]):
                continue
            bad = differ(outputs(sets, ups, 2), want_h)
            differing += bad
            us = graph_median_us(ups, len(sets), REPLAYS)
            label = f"{gate_up_shape}r{rows}"
            line.append(f"{label} {us:7.1f}" + (f" ({bad} differ)" if bad else ""))
        line.append(f"| down triton {graph_median_us(downs, len(sets), REPLAYS):7.1f}")
        moe_gluon.down = gluon_down
        for down_shape, rows in itertools.product(args.down_shapes, args.program_rows):
            warps, group = map(int, down_shape.split("x"))
            moe_gluon.DOWN_SHAPES = ((None, warps, group),)
            if not program_rows(rows, tiles.block_m) or not moe_gluon.down_usable(weights, sets[0][1]):
                continue
            bad = differ(outputs(sets, downs, 3), want_y)
            differing += bad
            line.append(
                f"{down_shape}r{rows} {graph_median_us(downs, len(sets), REPLAYS):7.1f}"
                + (f" ({bad} differ)" if bad else "")
            )
        print("  ".join(line), flush=True)
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
