"""The router at one row, rank 0's real shape (512 experts × 2,560), in a captured graph over 48 layers' weights:
the logits with their top-k in one launch (`linear_topk`, what the round runs), against the logits alone and the
logits followed by the router kernel, so that the top-k's share of the launch can be read off; the top-k's picks
taken 1 and 2 keys a reduction (`kernels.router.PICKS`).

python3 scripts/gpu_router_tail.py   # one JSON line per variant: µs a layer
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
from gpu_timing import graph_median_us

from kernels.linear import linear, linear_topk
from kernels.router import router_topk

LAYERS, HIDDEN, EXPERTS, TOP_K = 48, 2560, 512, 10
VARIANTS = ("topk_in_launch", "logits_only", "logits_then_router")
PICKS = (1, 2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replays", type=int, default=20)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    weights = [(0.02 * torch.randn(EXPERTS, HIDDEN, device=dev, generator=gen)).bfloat16() for _ in range(LAYERS)]
    x = torch.randn(1, HIDDEN, device=dev, generator=gen).bfloat16()

    def layer(w: torch.Tensor, variant: str, picks: int) -> None:
        if variant == "topk_in_launch":
            linear_topk(x, w, TOP_K, picks=picks)
        elif variant == "logits_only":
            linear(x, w, torch.float32)
        else:
            router_topk(linear(x, w, torch.float32), TOP_K, picks=picks)

    for variant in VARIANTS:
        for picks in PICKS if variant != "logits_only" else (0,):
            calls = [functools.partial(layer, w, variant, picks) for w in weights]
            us = graph_median_us(calls, LAYERS, args.replays)
            print(json.dumps({"variant": variant, "picks": picks, "us_a_layer": round(us, 2)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
