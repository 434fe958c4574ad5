"""Sweep hc_read's launch tiles on one GPU at the real shapes: bits against the default tiles, time per call and kernel.

python3 scripts/gpu_sweep_hyper.py --out DIR [--rows N ...]   # writes DIR/hyper_sweep.json, prints per N the best
TRITON_INTERPRET=1 python3 scripts/gpu_sweep_hyper.py --out DIR --smoke   # tiny shapes on the CPU, wall-clock µs

For each N the default tiles (`read_tiles`) come first, then the candidates. Every candidate runs through `launch_read`
and must give hc_read's bits (mismatching elements of x and inject are counted); it is timed as gpu_check_hyper times
a read (a CUDA graph of CALLS calls over rotating input copies, so weights stream from HBM), and each of its three
kernels alone the same way, by replaying the launches `launch_read` made. launch_read gives both GEMM kernels one
num_warps and num_stages, so the candidates pair one down-side and one up-side setting at every (num_warps,
num_stages): every setting of each kernel is timed once, and the per-kernel times tell the two apart.
The JSON is rewritten after each N; the first N compiles about a hundred kernel variants, `--rows` splits a run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

import torch
from gpu_check_hyper import CALLS, COLD_BYTES, REAL, REPLAYS, Rows, Shape, Weights, call, make_rows, make_weights
from gpu_timing import graph_median_us, recording, wall_us

from kernels import hyper  # importable: gpu_check_hyper puts the repository root on sys.path
from kernels import linear as linear_module
from kernels.hyper import ReadTiles, launch_read, read_tiles

ROWS = (1, 4, 16, 64)
SMOKE_ROWS = (1, 3)
SMOKE = Shape(hc=2, d=64, r=32)  # a shape whose K the linear kernel cuts as the fused kernel does
BEST = 5
KERNELS = {  # name: (module, kernel attribute) of every launch a read can make
    "rstd": (hyper, "_rstd_kernel"),
    "down": (hyper, "_down_kernel"),
    "linear": (linear_module, "_linear_kernel"),
    "split_sum": (linear_module, "_split_sum_kernel"),
    "mix": (hyper, "_mix_kernel"),
    "up_mix": (hyper, "_up_mix_kernel"),
}
# (down_r, in_program, up_d): one down-side and one up-side setting per candidate
PAIRS = ((16, False, 16), (32, False, 32), (64, False, 64), (32, True, 128))
UP_TILES = ((16, 8), (16, 16), (32, 16), (64, 16), (64, 32), (128, 32))  # (up_m, up_d) of `_up_mix_kernel`
ROW_UP_D = (8, 16, 32)  # up_d of the 16-row tiles gated row by row
WARPS = (2, 4, 8)
STAGES = (2, 3, 4, 5)

Timer = Callable[[list[Callable[[], object]]], float]
Read = Callable[[Weights, Rows, Shape, ReadTiles], tuple[torch.Tensor, torch.Tensor | None]]
Row = dict[str, Any]


def candidates(
    warps: tuple[int, ...] = WARPS, stages: tuple[int, ...] = STAGES, via_linear: bool = False, up_only: bool = False
) -> list[ReadTiles]:
    """Every PAIRS setting at every (num_warps, num_stages), with 16-row tiles; with via_linear also the down
    projection by the linear kernel under each up-side setting, the up projection over stored normed rows under each
    down-side setting, and both under each UP_TILES tile; with up_only just those last (16-row ones also row by row,
    gating h from stored h or from the down projection's K-range sums: `ReadTiles.up_adds_ranges`)."""
    grid = list(itertools.product(warps, stages))
    if up_only:  # each up tile gated over its whole row tile; 16-row tiles also row by row, with or without the sums
        forms = [(um, ud, False, False) for um, ud in UP_TILES]
        forms += [(16, ud, True, adds) for ud in ROW_UP_D for adds in (False, True)]
        return [
            ReadTiles(16, 32, um, ud, False, w, s, True, True, by, adds) for w, s in grid for um, ud, by, adds in forms
        ]
    tiles = [ReadTiles(16, dr, 16, ud, ip, w, s) for w, s in grid for dr, ip, ud in PAIRS]
    if via_linear:
        tiles += [ReadTiles(16, 32, 16, ud, False, w, s, True) for w, s in grid for ud in (16, 32)]
        tiles += [
            ReadTiles(16, dr, 16, 16, ip, w, s, False, True) for w, s in grid for dr, ip in ((16, False), (32, False))
        ]
        tiles += [ReadTiles(16, 32, um, ud, False, w, s, True, True) for w, s in grid for um, ud in UP_TILES]
    return tiles


def adjacent_inject(w: Weights) -> Weights:
    """The weights with w_inject's rows stored right after w_down's, as the model stacks them (a read by the
    linear kernel then takes both in one launch)."""
    if w.get("w_inject") is None:
        return w
    stacked = torch.cat((w["w_down"], w["w_inject"]))
    r = w["w_down"].shape[0]
    return {**w, "w_down": stacked[:r], "w_inject": stacked[r:]}


def launch(w: Weights, rows: Rows, shape: Shape, tiles: ReadTiles) -> tuple[torch.Tensor, torch.Tensor | None]:
    """launch_read of one input set with explicit tiles."""
    return launch_read(rows["wide"], *w.values(), shape.eps, shape.hc, tiles)


def graph_us(calls: list[Callable[[], object]]) -> float:
    """Median µs of one call from a CUDA graph of CALLS calls cycling through `calls`."""
    return graph_median_us(calls, CALLS, REPLAYS)


def measure(
    n: int, tiles: ReadTiles, sets: list[tuple[Weights, Rows]], ref: list[torch.Tensor], shape: Shape,
    timer: Timer, read: Read,
) -> Row:  # fmt: skip
    """One candidate: elements of x and inject differing from `ref`, µs per call and per kernel; errors recorded."""
    row: Row = {"rows": n, "tiles": asdict(tiles), "default": tiles == read_tiles(n, shape.r), "us": None,
                "kernel_us": None, "x_mismatches": None, "inject_mismatches": None, "error": None}  # fmt: skip
    try:
        x, inj = read(*sets[0], shape, tiles)
        row["x_mismatches"] = int((x != ref[0]).sum())
        row["inject_mismatches"] = int((inj != ref[1]).sum())
        calls = [partial(read, w, rows, shape, tiles) for w, rows in sets]
        row["us"] = timer(calls)
        with recording(KERNELS) as kept:
            for fn in calls:
                fn()
        row["kernel_us"] = {name: timer(launches) for name, launches in kept.items() if launches}
    except Exception as exc:  # a candidate that fails to compile or launch is reported, the sweep goes on
        row["error"] = repr(exc)
    return row


def sweep(
    n: int, shape: Shape, device: torch.device, gen: torch.Generator, tiles: list[ReadTiles], timer: Timer,
    copies: int = 1, read: Read = launch,
) -> list[Row]:  # fmt: skip
    """One batch size over `copies` fresh input sets: the default tiles first, then each of `tiles` not yet run."""
    sets = [
        (adjacent_inject(make_weights("read", shape, device, gen)), make_rows("read", n, shape, device, gen))
        for _ in range(copies)
    ]
    ref = call("read", *sets[0], shape)  # hc_read with the default tiles: the bits every candidate must give
    return [measure(n, t, sets, ref, shape, timer, read) for t in dict.fromkeys([read_tiles(n, shape.r), *tiles])]


def cold_copies(n: int, shape: Shape) -> int:
    """Input sets to rotate through so the graph's calls read their weights from HBM, as gpu_check_hyper does."""
    k = shape.hc * shape.d
    per_call = (2 * shape.r * k + shape.hc * k + n * (k + shape.d + shape.hc)) * 2
    return max(1, min(CALLS, math.ceil(COLD_BYTES / per_call)))


def identical(row: Row) -> bool:
    """Whether a candidate ran and gave the default tiles' bits."""
    return row["error"] is None and row["x_mismatches"] == 0 and row["inject_mismatches"] == 0


def best(rows: list[Row], key: Callable[[Row], float] = lambda r: r["us"], count: int = BEST) -> list[Row]:
    """The `count` fastest bit-identical rows by `key`, fastest first."""
    return sorted(filter(identical, rows), key=key)[:count]


def describe(row: Row) -> str:
    """One row: µs per call, per kernel, and its tiles."""
    t = row["tiles"]
    tiles = (
        f"down {t['down_m']}x{t['down_r']}{' in_program' if t['in_program'] else ''} up {t['up_m']}x{t['up_d']} "
        f"warps {t['num_warps']} stages {t['num_stages']}{' down via linear' if t.get('via_linear') else ''}"
        f"{' up over normed' if t.get('up_over_normed') else ''}{' by row' if t.get('up_by_row') else ''}"
        f"{' adding range sums' if t.get('up_adds_ranges') else ''}"
    )
    if row["error"] is not None:
        return f"ERROR {tiles}: {row['error']}"
    kernels = " ".join(f"{name} {us:7.2f}" for name, us in row["kernel_us"].items())
    return f"{row['us']:8.2f} us ({kernels})  {tiles}"


def report(n: int, rows: list[Row]) -> list[str]:
    """Printed lines of one batch size: the default, the best bit-identical candidates, the fastest of each kernel."""
    default = next(r for r in rows if r["default"])
    failed = sum(r["error"] is not None for r in rows)
    differ = sum(r["error"] is None and not identical(r) for r in rows)
    lines = [f"N={n}: {len(rows)} tiles, {failed} failed, {differ} with other bits", f"  default  {describe(default)}"]
    lines += [f"  best {i}   {describe(r)}" for i, r in enumerate(best(rows), 1)]
    for name in ("down", "linear", "mix", "up_mix"):
        timed = [r for r in rows if name in (r["kernel_us"] or {})]
        lines += [f"  {name:<8} {describe(r)}" for r in best(timed, lambda r, name=name: r["kernel_us"][name], 1)]
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command line: --out DIR, optional --rows N ... (a subset of ROWS), --smoke for tiny shapes on the CPU."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for hyper_sweep.json")
    parser.add_argument("--rows", nargs="+", type=int, help=f"batch sizes (default: {list(ROWS)})")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU, under TRITON_INTERPRET=1")
    parser.add_argument("--warps", nargs="+", type=int, default=list(WARPS), help="num_warps values to try")
    parser.add_argument("--stages", nargs="+", type=int, default=list(STAGES), help="num_stages values to try")
    parser.add_argument("--via-linear", action="store_true", help="also try the paths over stored normed rows")
    parser.add_argument("--up-only", action="store_true", help="only the up kernel's tiles, over stored normed rows")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Sweep every N; 0 unless the default tiles fail (1), or no GPU / no interpreter for --smoke (2)."""
    args = parse_args(argv)
    if args.smoke != hyper.INTERPRET or not (args.smoke or torch.cuda.is_available()):
        print("gpu_sweep_hyper: needs a CUDA device, or --smoke with TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    if args.smoke:
        shape, batches, device, timer, tiles = SMOKE, SMOKE_ROWS, torch.device("cpu"), wall_us, candidates((4,), (1,))
    else:
        shape, batches, device, timer, tiles = (
            REAL,
            ROWS,
            torch.device("cuda"),
            graph_us,
            candidates(tuple(args.warps), tuple(args.stages), args.via_linear, args.up_only),
        )
    batches = args.rows or batches
    args.out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(0)
    rows: list[Row] = []
    for n in batches:
        copies = 1 if args.smoke else cold_copies(n, shape)
        found = sweep(n, shape, device, gen, tiles, timer, copies)
        rows += found
        (args.out / "hyper_sweep.json").write_text(json.dumps(rows, indent=1))
        print("\n".join(report(n, found)), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 1 if any(r["default"] and r["error"] is not None for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
