"""Check the elementwise kernels (GDN gates, shared-expert silu·up and gated add, the sigmoid gate of QSA's output
and PLE's values, RoPE and its cache writes) on one GPU at tp=2's per-rank shapes: every output bit-identical to its
plain-PyTorch reference on the same GPU (which is the torch code the kernel path ran before), each row bit-identical
alone, and time against the torch ops.

python3 scripts/gpu_check_elementwise.py --out DIR      # writes DIR/elementwise.json, one line per case

`mismatches` counts output elements whose bits differ from the reference; `alone_mismatches` the rows whose bits
differ when computed alone. Times: the median per call over graph replays (scripts/gpu_timing.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]

from gpu_timing import graph_median_us  # noqa: E402

from kernels.gates import (  # noqa: E402
    gated_add,
    gated_add_reference,
    gdn_gates,
    gdn_gates_reference,
    sigmoid_mul,
    sigmoid_mul_reference,
    silu_mul,
    silu_mul_reference,
)
from kernels.rope import rope, rope_inv_freq, rope_reference, scatter_rows  # noqa: E402

ROWS = (1, 64, 8192)
VALUE_HEADS, SHARED, HIDDEN = 24, 320, 2560  # per rank at tp=2
HEADS, KV_HEADS, HEAD_DIM, INDEX_DIM, ROTARY, THETA = 12, 1, 256, 128, 64, 1e7
CONTEXT, SLOTS = 4096, 65


def mismatches(got: torch.Tensor, ref: torch.Tensor) -> int:
    """Elements whose bits differ (NaNs compare by bits too)."""
    a, b = got.contiguous().view(-1), ref.contiguous().view(-1)
    if a.dtype == torch.bfloat16:
        a, b = a.view(torch.int16), b.view(torch.int16)
    else:
        a, b = a.view(torch.int32), b.view(torch.int32)
    return int((a != b).sum())


def alone(fn: Callable[..., torch.Tensor | tuple], args: tuple[torch.Tensor, ...], rows: int) -> int:
    """Rows (of the first few) whose bits differ computed alone rather than in the batch."""
    batch = fn(*args)
    batch = batch if isinstance(batch, tuple) else (batch,)
    bad = 0
    for r in range(min(rows, 7)):
        one = fn(*(a[r : r + 1] if a.dim() and a.shape[0] == rows else a for a in args))
        one = one if isinstance(one, tuple) else (one,)
        bad += any(mismatches(o, b[r : r + 1]) for o, b in zip(one, batch, strict=True))
    return bad


def case(name: str, n: int, fn, ref, args: tuple[torch.Tensor, ...]) -> dict:
    """One case's bits and times."""
    got, want = fn(*args), ref(*args)
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    return {
        "case": name,
        "rows": n,
        "mismatches": sum(mismatches(g, w) for g, w in zip(got, want, strict=True)),
        "elements": sum(g.numel() for g in got),
        "alone_mismatches": alone(fn, args, n),
        "kernel_us": graph_median_us([lambda: fn(*args)], 20, 20),
        "torch_us": graph_median_us([lambda: ref(*args)], 20, 20),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape: int, scale: float = 1.0, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=dev) * scale).to(dtype)

    freqs = rope_inv_freq(ROTARY, THETA, dev)
    results = []
    for n in ROWS:
        first = len(results)
        positions = torch.randint(0, 262_144, (n,), generator=gen, device=dev)
        b, a = randn(n, VALUE_HEADS, scale=8), randn(n, VALUE_HEADS, scale=12)
        a_log, dt_bias = randn(VALUE_HEADS, dtype=torch.float32), randn(VALUE_HEADS, dtype=torch.float32)
        results.append(case("gdn_gates", n, gdn_gates, gdn_gates_reference, (b, a, a_log, dt_bias)))
        gate, up = randn(n, SHARED, scale=4), randn(n, SHARED, scale=4)
        results.append(case("silu_mul", n, silu_mul, silu_mul_reference, (gate, up)))
        routed, logit, shared = randn(n, HIDDEN), randn(n, 1, scale=4), randn(n, HIDDEN)
        results.append(case("gated_add", n, gated_add, gated_add_reference, (routed, logit, shared)))
        out, fused = randn(n, HEADS, HEAD_DIM), randn(n, HEADS, 2 * HEAD_DIM, scale=4)
        results.append(case("sigmoid_mul", n, sigmoid_mul, sigmoid_mul_reference, (out, fused.chunk(2, dim=-1)[1])))
        q = randn(n, HEADS, 2 * HEAD_DIM).chunk(2, dim=-1)[0]  # a strided view, as the model's q is
        results.append(
            case("rope_q", n, lambda x, p: rope(x, p, freqs), lambda x, p: rope_reference(x, p, freqs), (q, positions))
        )
        index_q = randn(n, 16, INDEX_DIM)
        results.append(
            case(
                "rope_index_q",
                n,
                lambda x, p: rope(x, p, freqs),
                lambda x, p: rope_reference(x, p, freqs),
                (index_q, positions),
            )
        )
        if n <= SLOTS:  # the cache forms: distinct (slot, position) pairs
            k = randn(n, KV_HEADS, HEAD_DIM)
            slots = torch.randperm(SLOTS, generator=gen, device=dev)[:n]
            keys = torch.zeros(SLOTS + 1, CONTEXT, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev)
            want = keys.clone()
            want[slots, positions % CONTEXT] = rope_reference(k, positions % CONTEXT, freqs)
            rope(k, positions % CONTEXT, freqs, dest=keys, slot_of_row=slots)
            values = torch.zeros_like(keys)
            scatter_rows(values, slots, positions % CONTEXT, k)
            put = torch.zeros_like(keys)
            put[slots, positions % CONTEXT] = k
            results.append(
                {
                    "case": "rope_into_cache+scatter_rows",
                    "rows": n,
                    "mismatches": mismatches(keys, want) + mismatches(values, put),
                }
            )
        for line in results[first:]:
            print(json.dumps(line), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "elementwise.json").write_text("\n".join(json.dumps(r) for r in results) + "\n")
    return int(any(r["mismatches"] or r.get("alone_mismatches") for r in results))


if __name__ == "__main__":
    sys.exit(main())
