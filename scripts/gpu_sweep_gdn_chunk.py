"""Sweep the launch shapes of GDN's chunked form (`kernels/gdn_chunk.py`) on one GPU at the real shapes: bits against
the default shapes, time per prompt pass.

python3 scripts/gpu_sweep_gdn_chunk.py --out DIR [--layouts 1024 8192 4x1024]   # writes DIR/gdn_chunk_sweep.json
TRITON_INTERPRET=1 python3 scripts/gpu_sweep_gdn_chunk.py --out DIR --smoke    # tiny shapes on the CPU, untimed

A layout is one lane's prompt of N rows from position 0, or L lanes of N rows each ("LxN"). Each candidate sets the
scan's Dv columns a program carries (BLOCK_V), the scan's warps and pipeline stages and the prepare kernel's warps;
it runs `gdn_prompt` as the model calls it, and must give the default's bits in the output and the lanes' states
(mismatching elements are counted). Times are medians of CUDA-graph replays, as gpu_check_gdn times a prompt pass.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from gpu_check_gdn import REAL, SMOKE, chunk_layout, gdn_inputs, lane_of_row
from gpu_timing import graph_median_us

from kernels import gdn_chunk  # importable: gpu_check_gdn puts the repository root on sys.path
from kernels.gdn_chunk import gdn_prompt

SHAPES = ("BLOCK_V", "SCAN_WARPS", "SCAN_STAGES", "PREPARE_WARPS")
SCANS = tuple(itertools.product((16, 32, 64), (2, 4, 8), (1, 2, 3)))  # (BLOCK_V, SCAN_WARPS, SCAN_STAGES)
PREPARES = (2, 4, 8)  # PREPARE_WARPS, each with the default scan
SMOKE_SCANS = ((8, 4, 1), (16, 2, 1))
CALLS, REPLAYS = 4, 10


def parse_layout(text: str) -> tuple[int, ...]:
    """'N' -> (N,); 'LxN' -> L lanes of N rows."""
    lanes, _, rows = text.rpartition("x")
    try:
        return (int(rows),) * (int(lanes) if lanes else 1)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layouts: expected N or LxN, got {text!r}") from None


@contextmanager
def shapes(values: dict[str, int]) -> Iterator[None]:
    """gdn_chunk's launch shapes set to `values` for the block."""
    saved = {name: getattr(gdn_chunk, name) for name in values}
    for name, value in values.items():
        setattr(gdn_chunk, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(gdn_chunk, name, value)


def candidates(smoke: bool) -> list[dict[str, int]]:
    """The default shapes first, then every scan setting, then every prepare setting with the default scan."""
    default = {name: getattr(gdn_chunk, name) for name in SHAPES}
    scans = [dict(default, BLOCK_V=bv, SCAN_WARPS=w, SCAN_STAGES=s) for bv, w, s in (SMOKE_SCANS if smoke else SCANS)]
    prepares = [dict(default, PREPARE_WARPS=w) for w in ((2,) if smoke else PREPARES)]
    return [default] + [c for c in scans + prepares if c != default]


def sweep(lens: tuple[int, ...], smoke: bool, device: torch.device) -> list[dict[str, Any]]:
    """Each candidate's mismatching elements against the default and µs per pass, on one layout."""
    cfg = SMOKE if smoke else REAL
    inputs = gdn_inputs(cfg, lens, torch.Generator(device=device).manual_seed(0), device)
    lanes = lane_of_row(lens, device)
    layout = chunk_layout(lanes)
    args = (inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"])
    rows, want = [], None
    for values in candidates(smoke):
        row: dict[str, Any] = {"shapes": values}
        try:
            with shapes(values):
                state = inputs["state"].clone()
                out, _ = gdn_prompt(*args, state, *layout[:2], firsts=layout[2])
                got = (out.view(torch.int32), state.view(torch.int32))
                want = want or got
                row["mismatches"] = sum(int((a != b).sum()) for a, b in zip(got, want, strict=True))
                if device.type == "cuda":
                    timed = inputs["state"].clone()
                    call = lambda t=timed: gdn_prompt(*args, t, *layout[:2], firsts=layout[2])  # noqa: E731
                    row["us"] = graph_median_us([call], CALLS, REPLAYS)
        except Exception as exc:  # a shape the compiler refuses is reported, not fatal
            row["error"] = f"{type(exc).__name__}: {exc}"
        rows.append(row)
        print(f"  {values}  " + "  ".join(f"{k} {v}" for k, v in row.items() if k != "shapes"), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for gdn_chunk_sweep.json")
    ap.add_argument("--layouts", type=parse_layout, nargs="+", help="N or LxN (default 1024 8192 4x1024)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under the Triton interpreter")
    args = ap.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    layouts = args.layouts or ([(64, 70)] if args.smoke else [(1024,), (8192,), (1024,) * 4])
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for lens in layouts:
        print(f"lanes {len(lens)} x {lens[0]} rows", flush=True)
        results["x".join(map(str, (len(lens), lens[0])))] = sweep(lens, args.smoke, device)
        (args.out / "gdn_chunk_sweep.json").write_text(json.dumps(results, indent=1))
    bad = [r for rows in results.values() for r in rows if r.get("mismatches") or "error" in r]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
