"""Sweep the greedy draw's tile on one GPU at the real vocabulary: tokens against torch's argmax, µs per call.

python3 scripts/gpu_sweep_greedy.py --out DIR [--rows 1 64] [--blocks 2048 8192] [--warps 4 8]   # DIR/greedy.json
TRITON_INTERPRET=1 python3 scripts/gpu_sweep_greedy.py --out DIR --smoke   # tiny shapes on the CPU, wall-clock µs

Each (block, warps) runs `greedy_tokens` on bf16 logits (as served) over rotating cold copies, timed as the other GPU
checks time a kernel (a CUDA graph of CALLS calls, median of REPLAYS replays); a candidate whose tokens differ from
torch's argmax fails the run.
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

from kernels.sample import greedy_tokens, greedy_tokens_reference  # noqa: E402

VOCAB = 248_320
COLD_BYTES = 300_000_000
CALLS, REPLAYS = 20, 25


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for greedy.json")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64], help="rows a call (default 1 64)")
    ap.add_argument("--blocks", type=int, nargs="+", default=[2048, 4096, 8192, 16384], help="logits a step")
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8, 16], help="warps a program")
    ap.add_argument("--smoke", action="store_true", help="a small vocabulary on the CPU (TRITON_INTERPRET=1)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = "cpu" if args.smoke else "cuda"
    vocab = 300 if args.smoke else VOCAB
    gen = torch.Generator(device=device).manual_seed(0)
    results, failures = [], 0
    for rows in args.rows:
        logits = (torch.randn(rows, vocab, generator=gen, device=device) * 4).bfloat16()
        expected = greedy_tokens_reference(logits)
        copies = [logits] + [logits.clone() for _ in range(min(CALLS, COLD_BYTES // logits.nbytes) - 1)]
        for block in args.blocks:
            for warps in args.warps:
                same = torch.equal(greedy_tokens(logits, block, warps), expected)
                calls = [lambda x=x, b=block, w=warps: greedy_tokens(x, b, w) for x in copies]
                us = wall_us(calls[:1]) if args.smoke else graph_median_us(calls, CALLS, REPLAYS)
                failures += not same
                results.append({"rows": rows, "block": block, "warps": warps, "us": us, "same": same})
                print(json.dumps(results[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "greedy.json").write_text(json.dumps(results, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
