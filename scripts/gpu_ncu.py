"""Launch the routed MoE, the dense linear kernel, the router's logits with their top-k and the hyper-connection read
once per case at tp=2's per-rank shapes, eagerly and without PDL, for Nsight Compute to profile (`scripts/gpu_ncu.sh`);
prints each case before its launches, so a report's kernels can be matched to cases in order.

FLASHNEXT_PDL=0 python3 scripts/gpu_ncu.py --moe-rows 1 64 1024 --linear 2560x3072:1 --router-rows 1 --hyper-rows 1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]

from gpu_check_hyper import REAL, call, make_rows, make_weights  # noqa: E402
from gpu_check_moe import Shape, make_bank, make_routing  # noqa: E402
from gpu_sweep_hyper import adjacent_inject  # noqa: E402

from kernels.linear import linear, linear_topk  # noqa: E402
from kernels.moe import moe_forward  # noqa: E402


def linear_case(spec: str) -> tuple[int, int, int]:
    """'NxK:M' -> (n, k, m)."""
    try:
        shape, m = spec.split(":")
        n, k = shape.split("x")
        return int(n), int(k), int(m)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--linear: expected NxK:M, got {spec!r}") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--moe-rows", type=int, nargs="*", default=[1, 64, 1024], help="rows of each MoE case")
    ap.add_argument("--linear", type=linear_case, nargs="*", default=[], help="linear cases as NxK:M")
    ap.add_argument("--router-rows", type=int, nargs="*", default=[], help="rows of each router logits + top-k case")
    ap.add_argument("--hyper-rows", type=int, nargs="*", default=[], help="rows of each hyper-connection read case")
    ap.add_argument("--repeats", type=int, default=1, help="launches of each case, one after the other")
    args = ap.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    shape = Shape()
    if args.moe_rows:
        bank = make_bank(shape, True, gen)
        for rows in args.moe_rows:
            x, ids, wts = make_routing(shape, rows, gen)
            print(f"case moe rows={rows}", flush=True)
            moe_forward(x, ids, wts, bank)
            torch.cuda.synchronize()
    for n, k, m in args.linear:
        w = (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).bfloat16()
        x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        print(f"case linear {n}x{k} rows={m}", flush=True)
        linear(x, w)
        torch.cuda.synchronize()
    for rows in args.router_rows:  # rank 0's router: 512 experts over d = 2,560, top-10 as the model picks
        w = (0.02 * torch.randn(shape.experts, shape.hidden, device="cuda", generator=gen)).bfloat16()
        x = torch.randn(rows, shape.hidden, device="cuda", generator=gen).bfloat16()
        for _ in range(args.repeats):
            print(f"case router rows={rows}", flush=True)
            linear_topk(x, w, shape.top_k)
            torch.cuda.synchronize()
    if args.hyper_rows:  # the model's layout: the inject rows stored right after the down rows
        weights = adjacent_inject(make_weights("read", REAL, torch.device("cuda"), gen))
        for rows in args.hyper_rows:
            wide = make_rows("read", rows, REAL, torch.device("cuda"), gen)
            for _ in range(args.repeats):
                print(f"case hyper read rows={rows}", flush=True)
                call("read", weights, wide, REAL)
                torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
