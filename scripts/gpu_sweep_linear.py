"""Sweep the dense linear kernel's K ranges and launch tiles (16-row ones by default) at the real per-rank shapes.

python3 scripts/gpu_sweep_linear.py --out DIR [--rows 1 4] [--only o_proj ...]   # DIR/linear_sweep.json, best per case
    [--block-k 128 256 512] [--warps 2 4] [--stages 4 6] [--block-m 16] [--widths 16 32]   # the tile grid
    [--same-split]                                                                           # the default K cut only
TRITON_INTERPRET=1 python3 scripts/gpu_sweep_linear.py --out DIR --smoke       # tiny shapes on the CPU, wall-clock µs

Each case (weight, rows) times the default (`k_ranges`, `pick_tiles`) first, then every candidate: K cut into SPLITS
ranges (those that tile K in BLOCK_K steps) and tiles (16 rows by default) of the grid's widths, warps, stages and K
tiles, timed as gpu_check_linear times a call (a CUDA graph of calls over rotating weight copies, so the weight
streams from HBM).
A candidate with the default's K ranges must give its bits (the tiles never change a sum); other K ranges add other
partial sums, so their elements may differ (counted, not a failure): `k_ranges` is a function of the weight's shape
alone, so adopting one keeps every row's bits independent of its batch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]

from gpu_check_linear import COLD_BYTES, WEIGHTS, floor_us  # noqa: E402
from gpu_timing import graph_median_us  # noqa: E402

from kernels.linear import BLOCK_K, Tiles, k_ranges, launch, pick_tiles  # noqa: E402

SHAPES = {  # the projections one decode row runs (the first two as the model fuses them), and issue 6's targets
    "gdn_in_proj": (8240, 2560),
    "qsa_fused": (7296, 2560),
    "o_proj": WEIGHTS["o_proj"],
    "in_proj_qkv": WEIGHTS["in_proj_qkv"],
    "q_proj": WEIGHTS["q_proj"],
    "router": WEIGHTS["router"],
    "lm_head": WEIGHTS["lm_head"],
    "hc_down": (324, 10240),  # the hyper read's down and inject rows, as the model stacks them
    "shared_gate_up": (641, 2560),  # the shared expert's gate, up and gate-logit rows
}
SMOKE_SHAPES = {"smoke": (48, 640)}
SPLITS = (1, 2, 3, 4, 6, 8)
WARPS, STAGES = (2, 4), (4, 6)


def tile_grid(
    block_ks: tuple[int, ...] = (BLOCK_K,), warps=WARPS, stages=STAGES, block_m: int = 16, widths=(16, 32)
) -> tuple[Tiles, ...]:
    """Tiles of block_m rows (16 by default), each of the widths, warps, stages and K tiles given."""
    return tuple(Tiles(block_m, n, w, s, bk) for bk in block_ks for n in widths for w in warps for s in stages)


TILES = tile_grid()
CALLS, REPLAYS, BEST = 20, 15, 5

Timer = Callable[[list[Callable[[], object]]], float]
Row = dict[str, object]


def splits_of(k: int) -> list[tuple[int, int]]:
    """(split, k_split) of each split in SPLITS that cuts K into ranges of whole BLOCK_K tiles, the last ending at K."""
    tiles_k = -(-k // BLOCK_K)
    out = []
    for split in SPLITS:
        k_split = -(-tiles_k // split) * BLOCK_K
        if -(-k // k_split) == split and (split, k_split) not in out:
            out.append((split, k_split))
    return out


def candidates(
    m: int, n: int, k: int, tiles: tuple[Tiles, ...] = TILES, same_split: bool = False
) -> list[tuple[Tiles, int, int]]:
    """The default (tiles, split, k_split) first, then every K cut (only the default's with `same_split`) with every
    tile whose K tile divides its ranges."""
    split, k_split = k_ranges(n, k)
    default = (pick_tiles(m, n, k), split, k_split)
    cuts = [(split, k_split)] if same_split else splits_of(k)
    rest = [(t, s, ks) for s, ks in cuts for t in tiles if (t, s, ks) != default and (s == 1 or ks % t.block_k == 0)]
    return [default, *rest]


def sweep_case(
    name: str,
    n: int,
    k: int,
    m: int,
    device: torch.device,
    gen: torch.Generator,
    timer: Timer,
    tiles: tuple[Tiles, ...] = TILES,
    same_split: bool = False,
) -> list[Row]:
    """Every candidate of one (weight, rows): µs a call, and elements whose bits differ from the default's."""
    copies = 1 if device.type == "cpu" else max(1, -(-COLD_BYTES // (n * k * 2)))
    weights = [(torch.randn(n, k, device=device, generator=gen) / k**0.5).bfloat16() for _ in range(copies)]
    x = torch.randn(m, k, device=device, generator=gen).bfloat16()
    rows: list[Row] = []
    want = None
    for i, (tile, split, k_split) in enumerate(candidates(m, n, k, tiles, same_split)):
        row: Row = {"name": name, "n": n, "k": k, "m": m, "default": i == 0, "split": split, "k_split": k_split,
                    "tiles": tile.__dict__}  # fmt: skip
        try:
            out = launch(x, weights[0], torch.bfloat16, tile, split, k_split)
            if want is None:
                want = out
            row["mismatches"] = int((out.view(torch.int16) != want.view(torch.int16)).sum())
            calls = [lambda w=w, t=tile, s=split, ks=k_split: launch(x, w, torch.bfloat16, t, s, ks) for w in weights]
            row["us"] = timer(calls)
        except Exception as exc:  # a candidate that fails (resources, a bad tile) is reported, the sweep goes on
            row["error"] = repr(exc)
        rows.append(row)
    return rows


def best(rows: list[Row], count: int = BEST) -> list[Row]:
    """The fastest timed candidates, fastest first."""
    return sorted((r for r in rows if "us" in r), key=lambda r: float(r["us"]))[:count]


def describe(row: Row) -> str:
    """One printed line per candidate."""
    t = row["tiles"]
    head = f"split {row['split']} x {row['k_split']}, {t['block_n']} wide, {t['num_warps']} warps"
    head += f", {t['num_stages']} stages, K tile {t['block_k']}"
    if "error" in row:
        return f"{head}: ERROR {row['error']}"
    return f"{head}: {float(row['us']):.2f} us, {row['mismatches']} elements differ from the default"


def wall_timer(calls: list[Callable[[], object]]) -> float:
    """Wall µs of one pass over the calls (CPU smoke runs), per call."""
    start = time.perf_counter()
    for fn in calls:
        fn()
    return (time.perf_counter() - start) * 1e6 / len(calls)


def main(argv: list[str] | None = None) -> int:
    """Sweep every case; 1 when a candidate with the default's K ranges changed a bit."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for linear_sweep.json")
    ap.add_argument("--rows", type=int, nargs="+", default=[1], help="rows of each case")
    ap.add_argument("--only", nargs="*", choices=sorted(SHAPES), help="weights to sweep (default: all)")
    ap.add_argument("--block-k", type=int, nargs="+", default=[BLOCK_K], help="K tiles (powers of two, 128 or more)")
    ap.add_argument("--warps", type=int, nargs="+", default=list(WARPS), help="warps of the tiles")
    ap.add_argument("--stages", type=int, nargs="+", default=list(STAGES), help="pipeline stages of the tiles")
    ap.add_argument("--block-m", type=int, default=16, help="rows of the tiles (16, 64 or 128)")
    ap.add_argument("--widths", type=int, nargs="+", default=[16, 32], help="columns of the tiles")
    ap.add_argument("--same-split", action="store_true", help="only the default's K ranges (so only its bits)")
    ap.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU (under TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    if any(bk < BLOCK_K or bk & (bk - 1) for bk in args.block_k):
        ap.error(f"--block-k: every K tile must be a power of two of at least {BLOCK_K}, as launch takes it")
    grid = tile_grid(tuple(args.block_k), tuple(args.warps), tuple(args.stages), args.block_m, tuple(args.widths))
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cpu" if args.smoke else "cuda")
    shapes = SMOKE_SHAPES if args.smoke else {k: v for k, v in SHAPES.items() if not args.only or k in args.only}
    timer = wall_timer if args.smoke else (lambda calls: graph_median_us(calls, CALLS, REPLAYS))
    report: list[Row] = []
    changed = False
    for name, (n, k) in shapes.items():
        for m in args.rows:
            gen = torch.Generator(device=device).manual_seed(n + m)
            rows = sweep_case(name, n, k, m, device, gen, timer, grid, args.same_split)
            report.extend(rows)
            default = rows[0]
            changed |= any(r.get("mismatches") for r in rows if r["split"] == default["split"])
            floor = floor_us(m, n, k, torch.bfloat16)[0]
            print(f"{name} M={m} N={n} K={k} floor {floor:.2f} us; default {describe(default)}", flush=True)
            for r in best(rows):
                print(f"  {describe(r)} (ratio {float(r['us']) / floor:.2f})", flush=True)
            (args.out / "linear_sweep.json").write_text(json.dumps(report, indent=1))
    if changed:
        print("a candidate with the default's K ranges gave other bits", flush=True)
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
