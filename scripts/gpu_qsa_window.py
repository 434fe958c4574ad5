"""The main stream of a QSA layer's window at one row, rank 0's real shapes, in a captured graph over 12 layers'
weights and pools: the fused projection, then q's norm + RoPE, k's norm + RoPE into the layer's key pool and v's
copy into its value pool (`model.kernel_blocks.qsa`'s main-stream launches at 5d6b7a7; since 25ea571 the index
queries' norm + RoPE runs there too, left out here), against variants that move or drop k's launch, so that one
launch's cost in the round can be told from where it writes.

python3 scripts/gpu_qsa_window.py [--slots 65 --context 8192]   # one JSON line per variant: µs a window
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import torch
from gpu_timing import graph_median_us

from kernels.linear import linear
from kernels.rope import norm_rope, rope_inv_freq, scatter_rows

LAYERS, HIDDEN, HEADS, HEAD_DIM, INDEX_WIDTH = 12, 2560, 12, 256, 4 * 128 + 128
ROTARY_DIM, THETA, EPS = 64, 10_000_000.0, 1e-6
POSITION = 200  # the row's position, inside every slot
VARIANTS = ("model", "k_first", "k_fresh", "no_k", "no_pdl")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=65, help="pool slots (lanes) a layer's caches hold")
    ap.add_argument("--context", type=int, default=8192, help="positions a slot holds")
    ap.add_argument("--replays", type=int, default=20)
    args = ap.parse_args(argv)
    if args.context <= POSITION:
        ap.error(f"--context must exceed the row's position {POSITION}")
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    width = INDEX_WIDTH + 2 * HEADS * HEAD_DIM + 2 * HEAD_DIM

    def randn(*shape: int) -> torch.Tensor:
        return (0.02 * torch.randn(shape, device=dev, generator=gen)).bfloat16()

    weights = [randn(width, HIDDEN) for _ in range(LAYERS)]
    keys = [torch.zeros(args.slots, args.context, 1, HEAD_DIM, dtype=torch.bfloat16, device=dev) for _ in weights]
    values = [torch.zeros_like(k) for k in keys]
    q_norm, k_norm = randn(HEAD_DIM), randn(HEAD_DIM)
    x = randn(1, HIDDEN) * 50
    slot_of_row = torch.tensor([args.slots - 1], device=dev)
    positions = torch.tensor([POSITION], device=dev)
    freqs = rope_inv_freq(ROTARY_DIM, THETA, dev)

    def window(layer: int, variant: str) -> None:
        fused = linear(x, weights[layer])
        q_gate, k, v = fused[:, INDEX_WIDTH:].split([2 * HEADS * HEAD_DIM, HEAD_DIM, HEAD_DIM], dim=-1)
        q = q_gate.unflatten(-1, (HEADS, 2 * HEAD_DIM)).chunk(2, dim=-1)[0]
        k, v = k.unflatten(-1, (1, HEAD_DIM)), v.unflatten(-1, (1, HEAD_DIM))

        def k_launch() -> None:
            if variant == "k_fresh":
                norm_rope(k, k_norm, EPS, positions, freqs)
            elif variant != "no_k":
                norm_rope(k, k_norm, EPS, positions, freqs, dest=keys[layer], slot_of_row=slot_of_row)

        if variant == "k_first":
            k_launch()
        norm_rope(q, q_norm, EPS, positions, freqs)
        if variant != "k_first":
            k_launch()
        scatter_rows(values[layer], slot_of_row, positions, v)

    for variant in VARIANTS:
        os.environ["FLASHNEXT_PDL"] = "0" if variant == "no_pdl" else "1"
        calls = [functools.partial(window, layer, variant) for layer in range(LAYERS)]
        us = graph_median_us(calls, LAYERS, args.replays)
        print(json.dumps({"variant": variant, "us_a_window": round(us, 2)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
