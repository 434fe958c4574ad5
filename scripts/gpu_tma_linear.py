"""Tried on a GPU: the few-row linear kernel with its weight tiles loaded by TMA (a host tensor descriptor) instead of
per-thread loads, against kernels/linear.py's kernel, at issue 6's GEMV shapes.

python3 scripts/gpu_tma_linear.py --out DIR [--only o_proj ...]     # DIR/tma_linear.json, best per case
TRITON_INTERPRET=1 python3 scripts/gpu_tma_linear.py --out DIR --smoke

The TMA kernel forms each sum as `_linear_kernel` does (the same K ranges, fp32 sums over K tiles in increasing k, the
ranges added in order by the tile's last arrival), so every candidate must give the default's bits; each is timed as
gpu_sweep_linear times a call (a CUDA graph of calls over rotating weight copies, so the weight streams from HBM).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]

from gpu_check_linear import COLD_BYTES, floor_us  # noqa: E402
from gpu_sweep_linear import SHAPES, wall_timer  # noqa: E402
from gpu_timing import graph_median_us  # noqa: E402

from kernels.linear import arrival_counters, call_tiles, k_ranges, launch  # noqa: E402
from kernels.pdl import enter, launch_options, prefetch_enabled, prefetch_l2  # noqa: E402

CASES = ("o_proj", "in_proj_qkv", "q_proj", "gdn_in_proj", "qsa_fused")
WIDTHS, DEPTHS, WARPS, STAGES = (16, 32), (128, 256), (1, 2, 4), (4, 8)
CALLS, REPLAYS = 20, 15


@triton.jit(do_not_specialize=["M"])
def _tma_linear_kernel(
    x_ptr, w_desc, w_ptr, out_ptr, part_ptr, count_ptr, M, N, K, K_SPLIT, stride_xm, stride_wn,
    FUSED_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    """`_linear_kernel`'s 16-row tile of one K range, bf16 out, its weight tiles read through the descriptor."""
    pid_m, pid_n, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < M, cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    k_start = pid_s * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, K)
    if PREFETCH:
        lines = w_ptr + tl.minimum(cols, N - 1).to(tl.int64)[None, :] * stride_wn
        for k0 in range(k_start, k_end, BLOCK_K):
            prefetch_l2(lines + tl.minimum(k0 + tl.arange(0, BLOCK_K // 64) * 64, K - 1)[:, None])
    enter(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        a = tl.load(x_rows + (k0 + ks)[None, :], mask=row_ok[:, None], other=0.0)
        b = w_desc.load([pid_n * BLOCK_N, k0])
        acc = tl.dot(a, tl.trans(b), acc)
    ok = row_ok[:, None] & col_ok[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    if FUSED_SPLIT == 0:
        tl.store(out_ptr + offs, acc.to(tl.bfloat16), mask=ok)
    else:
        mn = M.to(tl.int64) * N
        tl.store(part_ptr + pid_s * mn + offs, acc, mask=ok)
        tl.debug_barrier()
        counter = count_ptr + pid_m * tl.num_programs(1) + pid_n
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == FUSED_SPLIT - 1:
            total = tl.load(part_ptr + offs, mask=ok, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, FUSED_SPLIT):
                total += tl.load(part_ptr + s * mn + offs, mask=ok, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + offs, total.to(tl.bfloat16), mask=ok)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


def tma_linear(
    x: torch.Tensor, w: torch.Tensor, desc: TensorDescriptor, width: int, depth: int, warps: int, stages: int
) -> torch.Tensor:
    """x · wᵀ in bf16 with `linear`'s K ranges, 16-row tiles `width` columns wide, weight tiles `depth` deep by TMA."""
    m, k = x.shape
    n = w.shape[0]
    split, k_split = k_ranges(n, k)
    grid = (triton.cdiv(m, 16), triton.cdiv(n, width), split)
    out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else out
    counters = arrival_counters(x.device, grid[0] * grid[1]) if split > 1 else out
    _tma_linear_kernel[grid](
        x, desc, w, out, part, counters, m, n, k, k_split, x.stride(0), w.stride(0),
        FUSED_SPLIT=split if split > 1 else 0, BLOCK_M=16, BLOCK_N=width, BLOCK_K=depth,
        PREFETCH=prefetch_enabled(x.device), num_warps=warps,
        num_stages=stages, **launch_options(_tma_linear_kernel, x.device),
    )  # fmt: skip
    return out


def run_case(name: str, n: int, k: int, m: int, device: torch.device, timer, smoke: bool) -> list[dict]:
    """The default kernel's time, then each TMA candidate's time and elements whose bits differ from the default's."""
    gen = torch.Generator(device=device).manual_seed(0)
    copies = 1 if smoke else max(1, -(-COLD_BYTES // (n * k * 2)))
    weights = [(torch.randn(n, k, device=device, generator=gen) / k**0.5).bfloat16() for _ in range(copies)]
    x = torch.randn(m, k, device=device, generator=gen).bfloat16()
    split, k_split = k_ranges(n, k)
    tiles = call_tiles(m, n, k)
    want = launch(x, weights[0], torch.bfloat16, tiles, split, k_split)
    floor = floor_us(m, n, k, torch.bfloat16)[0]
    calls = [lambda w=w: launch(x, w, torch.bfloat16, tiles, split, k_split) for w in weights]
    rows = [{"name": name, "m": m, "n": n, "k": k, "kernel": "linear", "tiles": tiles.__dict__, "us": timer(calls),
             "floor_us": floor}]  # fmt: skip
    for width in WIDTHS:
        for depth in DEPTHS:
            if split > 1 and k_split % depth:
                continue
            descs = [TensorDescriptor.from_tensor(w, [width, depth]) for w in weights]
            for warps in WARPS:
                for stages in STAGES:
                    tile = {"block_n": width, "block_k": depth, "num_warps": warps, "num_stages": stages}
                    row = {"name": name, "m": m, "n": n, "k": k, "kernel": "tma", "floor_us": floor, "tiles": tile}
                    try:
                        out = tma_linear(x, weights[0], descs[0], width, depth, warps, stages)
                        row["mismatches"] = int((out.view(torch.int16) != want.view(torch.int16)).sum())
                        calls = [
                            lambda w=w, d=d, t=(width, depth, warps, stages): tma_linear(x, w, d, *t)
                            for w, d in zip(weights, descs, strict=True)
                        ]
                        row["us"] = timer(calls)
                    except Exception as exc:  # a candidate that fails to compile or launch is reported
                        row["error"] = repr(exc)[:300]
                    rows.append(row)
                    if smoke:
                        return rows
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the cases, print the default and the five fastest TMA candidates of each, write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", nargs="*", default=list(CASES))
    parser.add_argument("--rows", type=int, nargs="*", default=[1])
    parser.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU under the interpreter")
    args = parser.parse_args(argv)
    smoke = args.smoke
    device = torch.device("cpu" if smoke else "cuda")
    timer = wall_timer if smoke else (lambda calls: graph_median_us(calls, CALLS, REPLAYS))
    shapes = {"smoke": (48, 640)} if smoke else {name: SHAPES[name] for name in args.only}
    results, failures = [], 0
    for name, (n, k) in shapes.items():
        for m in args.rows:
            rows = run_case(name, n, k, m, device, timer, smoke)
            results += rows
            default = rows[0]
            print(f"{name} m={m}: linear {default['us']:.2f} us (floor {default['floor_us']:.2f})", flush=True)
            timed = sorted((r for r in rows[1:] if "us" in r), key=lambda r: r["us"])
            for row in timed[:5]:
                print(f"  tma {row['tiles']}: {row['us']:.2f} us, {row['mismatches']} elements differ", flush=True)
            failures += 0 if smoke else sum(1 for r in rows[1:] if r.get("mismatches"))  # the interpreter's dots differ
            errors = [r for r in rows[1:] if "error" in r]
            if errors:
                print(f"  {len(errors)} candidates failed, first: {errors[0]['error']}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tma_linear.json").write_text(json.dumps(results, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
