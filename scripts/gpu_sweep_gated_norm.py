"""Sweep the GDN gated norm's launch tile on one GPU at the per-rank width: bits against the whole tile, µs per call.

python3 scripts/gpu_sweep_gated_norm.py --out DIR [--rows 1 4 8 64] [--pairs-a-program 1 2 4 8 32] [--warps 1 2 4]
TRITON_INTERPRET=1 python3 scripts/gpu_sweep_gated_norm.py --out DIR --smoke   # tiny shapes on the CPU, wall-clock µs

Each (pairs a program, warps) runs `gated_rms_norm` on fp32 x and bf16 gates of ROWS rows of the 24 value heads a
rank holds (128 features each, sigmoid gate, as served) over rotating cold copies, timed as the other GPU checks time
a kernel (a CUDA graph of CALLS calls, median of REPLAYS replays). Every tile's output must have the bits of the whole
tile (`block_r`'s pairs on NUM_WARPS): a tile that differs fails the run. DIR/gated_norm.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from gpu_timing import graph_median_us, wall_us

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kernels.norm import INTERPRET, NUM_WARPS, block_r, gated_norm_tile, gated_rms_norm  # noqa: E402

HEADS, WIDTH = 24, 128  # value heads a rank holds at tp=2, and their width
EPS = 1e-6
COLD_COPIES, CALLS, REPLAYS = 20, 20, 25


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for gated_norm.json")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 64], help="rows a call (default 1 4 8 64)")
    ap.add_argument("--pairs-a-program", type=int, nargs="+", default=[1, 2, 4, 8, 32], help="powers of two")
    ap.add_argument("--warps", type=int, nargs="+", default=[1, 2, 4], help="warps a program")
    ap.add_argument("--smoke", action="store_true", help="two heads of 16 on the CPU (TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    odd = [p for p in args.pairs_a_program if p < 1 or p & (p - 1)]
    if odd:
        ap.error(f"--pairs-a-program: {odd} are not powers of two")
    return args


def main(argv: list[str] | None = None) -> int:
    """0 when every tile gives the whole tile's bits, 1 when one does not, 2 without a GPU (or --smoke without the
    interpreter)."""
    args = parse_args(argv)
    if args.smoke != INTERPRET or not (args.smoke or torch.cuda.is_available()):
        print("gpu_sweep_gated_norm: needs a CUDA device, or --smoke with TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    device = "cpu" if args.smoke else "cuda"
    heads, width = (2, 16) if args.smoke else (HEADS, WIDTH)
    gen = torch.Generator(device=device).manual_seed(0)
    weight = (1.0 + 0.1 * torch.randn(width, generator=gen, device=device)).bfloat16()
    results, failures = [], 0
    for rows in args.rows:
        copies = [
            (torch.randn(rows, heads, width, generator=gen, device=device),
             torch.randn(rows, heads, width, generator=gen, device=device).bfloat16())
            for _ in range(1 if args.smoke else COLD_COPIES)
        ]  # fmt: skip
        whole = gated_rms_norm(*copies[0], weight, EPS, "sigmoid", tile=(block_r(width), NUM_WARPS))
        default = gated_norm_tile(rows * heads, width)
        for pairs in args.pairs_a_program:
            for warps in args.warps:
                tile = (pairs, warps)
                same = torch.equal(gated_rms_norm(*copies[0], weight, EPS, "sigmoid", tile=tile), whole)
                calls = [lambda c=c, t=tile: gated_rms_norm(*c, weight, EPS, "sigmoid", tile=t) for c in copies]
                us = wall_us(calls[:1]) if args.smoke else graph_median_us(calls, CALLS, REPLAYS)
                failures += not same
                row = {"rows": rows, "pairs": pairs, "warps": warps, "us": us, "same": same, "default": tile == default}
                results.append(row)
                print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gated_norm.json").write_text(json.dumps(results, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
