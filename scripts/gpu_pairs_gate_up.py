"""The one-row MoE with kernels/moe_gluon.py's pairs gate-up at each warp count against kernels/moe.py's Triton
pairs gate-up, on one GPU at tp=2's per-rank widths: the outputs' bits (fp32 and bf16) and the µs a call
(CUDA-graph replays over routing sets that overflow L2, so the weights start cold), with its byte floor.

python3 scripts/gpu_pairs_gate_up.py --out DIR [--forms a2 b2r4]   # a: weights the MMA's first operand; b: second
(b2r4: 2 warps, 4 K steps of weights loaded ahead)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]

from gpu_ab_moe import REAL, REPLAYS, SETS, routings  # noqa: E402
from gpu_check_moe import Shape, packed_bank  # noqa: E402
from gpu_timing import graph_median_us  # noqa: E402

from kernels import moe, moe_gluon  # noqa: E402
from kernels.fp4_words import kernel_bank  # noqa: E402

HBM_BYTES_PER_S = 4.27e12  # design.md's measured copy rate on an H200


def bits(t: torch.Tensor) -> torch.Tensor:
    """A bf16 or fp32 tensor's bit patterns as integers."""
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def set_form(form: str) -> None:
    """Set kernels/moe_gluon.py's pairs gate-up to `form`: a or b, the warps, then "r" and its ring depth."""
    kind, _, ring = form.removesuffix("p").partition("r")
    moe_gluon.PAIRS_B, moe_gluon.PAIRS_WARPS, moe_gluon.PAIRS_RING = kind[0] == "b", int(kind[1:]), int(ring or 1)
    moe_gluon.PAIRS_AHEAD = form.endswith("p")


def run_variant(form: str | None, bank: dict[str, torch.Tensor], sets: list) -> tuple[list, float]:
    """Outputs of every routing set (fp32, bf16) and µs a call: the Triton gate-up (form None) or Gluon's in `form`
    (a or b, then the warp count)."""
    gluon_pairs = moe_gluon.__dict__["gate_up_pairs"]
    if form is None:
        moe_gluon.gate_up_pairs = lambda *args: False
    else:
        set_form(form)
    try:
        outs = [(moe.moe_forward(*r, bank, torch.float32), moe.moe_forward(*r, bank)) for r in sets]
        calls = [lambda r=r: moe.moe_forward(*r, bank) for r in sets]
        return outs, graph_median_us(calls, len(calls), REPLAYS)
    finally:
        moe_gluon.gate_up_pairs = gluon_pairs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for pairs_gate_up.json")
    ap.add_argument("--forms", nargs="+", default=["a2", "a4", "b2", "b4"], help="the Gluon kernel's forms and warps")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    shape = Shape(*REAL)
    bank = kernel_bank(packed_bank(shape, torch.Generator(device="cuda").manual_seed(0), "cuda"))
    sets = routings(REAL, 1, SETS, torch.device("cuda"))
    floor_us = shape.top_k * shape.expert_bytes(True) / HBM_BYTES_PER_S * 1e6
    base, base_us = run_variant(None, bank, sets)
    rows = [{"gate_up": "triton", "us": base_us, "floor_us": floor_us, "elements_differing": 0}]
    print(f"one row: floor {floor_us:.2f} us; Triton pairs gate-up {base_us:.2f} us", flush=True)
    for form in args.forms:
        outs, us = run_variant(form, bank, sets)
        differ = sum(
            int((bits(a) != bits(b)).sum())
            for got, want in zip(outs, base, strict=True)
            for a, b in zip(got, want, strict=True)
        )
        rows.append({"gate_up": f"gluon {form}", "us": us, "floor_us": floor_us, "elements_differing": differ})
        print(
            f"Gluon pairs gate-up {form}: {us:.2f} us ({us / floor_us:.2f}x), other bits {differ}",
            flush=True,
        )
    (args.out / "pairs_gate_up.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
