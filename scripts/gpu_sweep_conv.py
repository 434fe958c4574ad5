"""Sweep the causal conv's head rows (rows a head program looks through for lane starts) on one GPU: bits against one
row a program, µs per call, at the per-rank widths of tp=2.

python3 scripts/gpu_sweep_conv.py --out DIR [--head-rows 1 8 16 32 64] [--cases gdn8192 mixed1024 ...]
TRITON_INTERPRET=1 python3 scripts/gpu_sweep_conv.py --out DIR --smoke   # tiny shapes on the CPU, wall-clock µs

Each case is a round's lanes (a prompt pass alone, or 64 one-row lanes before a prompt run) at GDN's 5,120 channels
or PLE's 10,240 (dilation 3), bf16, no per-row tails (as prompt passes run). Each head-rows value runs
`causal_conv_update` on the same inputs: its output and the lanes' new tails must have the bits of one row a head
program (HR 1), or the run fails. Timed as `gpu_check_gdn.py` times the conv (a CUDA graph of CALLS calls, median of
REPLAYS replays, the tails updated in place). DIR/conv_sweep.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from gpu_timing import graph_median_us, wall_us

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kernels.conv import FEW_ROWS, HEAD_ROWS, causal_conv_update  # noqa: E402
from kernels.pdl import INTERPRET  # noqa: E402

TAPS = 4
CALLS, REPLAYS = 10, 25


@dataclass(frozen=True)
class Case:
    """A round's rows per lane (lane i owns slot i), its channels and dilation."""

    name: str
    lens: tuple[int, ...]
    channels: int
    dilation: int


REAL = (
    Case("gdn8192", (8192,), 5120, 1),
    Case("ple8192", (8192,), 10240, 3),
    Case("gdn1024", (1024,), 5120, 1),
    Case("mixed1024", (1,) * 64 + (960,), 5120, 1),
    Case("ple_mixed1024", (1,) * 64 + (960,), 10240, 3),
    Case("mixed8192", (1,) * 64 + (8128,), 5120, 1),
)
SMOKE = (Case("prompt", (70,), 40, 1), Case("mixed", (1,) * 9 + (3, 30), 40, 3))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for conv_sweep.json")
    ap.add_argument("--head-rows", type=int, nargs="+", default=[1, 8, 16, 32, 64], help="powers of two")
    ap.add_argument("--cases", nargs="*", help="only these cases (default all)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    odd = [h for h in args.head_rows if h < 1 or h & (h - 1)]
    if odd:
        ap.error(f"--head-rows: {odd} are not powers of two")
    known = {case.name for case in (SMOKE if args.smoke else REAL)}
    unknown = sorted(set(args.cases or ()) - known)
    if unknown:
        ap.error(f"--cases: {unknown} are not among {sorted(known)}")
    return args


def inputs_for(case: Case, gen: torch.Generator, device: str) -> dict[str, torch.Tensor]:
    """x [T, C], a tail per lane and the taps, bf16; lane_of_row."""
    kept = (TAPS - 1) * case.dilation
    lens = torch.tensor(case.lens, device=device)
    return {
        "x": torch.randn(int(lens.sum()), case.channels, generator=gen, device=device).bfloat16(),
        "tail": torch.randn(len(case.lens), kept, case.channels, generator=gen, device=device).bfloat16(),
        "weight": (0.5 * torch.randn(case.channels, TAPS, generator=gen, device=device)).bfloat16(),
        "lanes": torch.repeat_interleave(torch.arange(len(case.lens), device=device), lens).int(),
    }


def convolve(case: Case, data: dict[str, torch.Tensor], tail: torch.Tensor, head_rows: int) -> torch.Tensor:
    """One call with `head_rows`, updating `tail` in place."""
    return causal_conv_update(data["x"], tail, data["weight"], data["lanes"], case.dilation, "silu", None, head_rows)


def main(argv: list[str] | None = None) -> int:
    """0 when every head-rows value gives one row a program's bits, 1 when one does not, 2 without a GPU (or --smoke
    without the interpreter)."""
    args = parse_args(argv)
    if args.smoke != INTERPRET or not (args.smoke or torch.cuda.is_available()):
        print("gpu_sweep_conv: needs a CUDA device, or --smoke with TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    device = "cpu" if args.smoke else "cuda"
    gen = torch.Generator(device=device).manual_seed(0)
    results, failures = [], 0
    for case in SMOKE if args.smoke else REAL:
        if args.cases and case.name not in args.cases:
            continue
        data = inputs_for(case, gen, device)
        base_tail = data["tail"].clone()
        base = convolve(case, data, base_tail, 1)
        default = 1 if sum(case.lens) <= FEW_ROWS else HEAD_ROWS
        for head_rows in args.head_rows:
            tail = data["tail"].clone()
            same = torch.equal(convolve(case, data, tail, head_rows), base) and torch.equal(tail, base_tail)
            calls = [partial(convolve, case, data, tail, head_rows)]
            us = wall_us(calls) if args.smoke else graph_median_us(calls, CALLS, REPLAYS)
            failures += not same
            row = {"case": case.name, "rows": sum(case.lens), "lanes": len(case.lens), "channels": case.channels,
                   "dilation": case.dilation, "head_rows": head_rows, "us": us, "same": same,
                   "default": head_rows == default}  # fmt: skip
            results.append(row)
            print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "conv_sweep.json").write_text(json.dumps(results, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
