"""Check the dense BF16 linear kernel on one GPU at the real per-rank shapes of tp=2: error, row invariance, speed.

python3 scripts/gpu_check_linear.py --out DIR      # writes DIR/linear.json and prints one line per case

Each case times one call as the server runs it: a CUDA graph of CALLS calls over rotating copies of the weight (so
the weight streams from HBM, not L2), replayed REPLAYS times; time_us is the median replay over CALLS.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kernels.linear import k_ranges, linear, linear_reference, pick_tiles  # noqa: E402

HBM_BYTES_PER_S = 4.27e12
BF16_FLOPS_PER_S = 790e12
COLD_BYTES = 300_000_000
CALLS = 20
REPLAYS = 25
BATCHES = (1, 4, 16, 64, 256)
INVARIANCE_BATCHES = (1, 2, 7, 64, 256)
TARGETS = ("in_proj_qkv", "q_proj", "o_proj", "out_proj", "lm_head")
WEIGHTS = {
    "in_proj_qkv": (5120, 2560),
    "in_proj_z": (3072, 2560),
    "q_proj": (6144, 2560),
    "k_proj": (256, 2560),
    "v_proj": (256, 2560),
    "index_qk_proj": (640, 2560),
    "o_proj": (2560, 3072),
    "out_proj": (2560, 3072),
    "lm_head": (124160, 2560),
    "hc_down": (320, 10240),
    "hc_up": (10240, 320),
    "router": (512, 2560),
}
FP32_OUT = ("o_proj", "out_proj")


def cases(names: list[str] | None = None) -> list[tuple[str, int, int, torch.dtype]]:
    """(weight name, N, K, out dtype) for every case: bf16 for all, fp32 too for the row-parallel projections."""
    out = []
    for name, (n, k) in WEIGHTS.items():
        if names and name not in names:
            continue
        out.append((name, n, k, torch.bfloat16))
        if name in FP32_OUT:
            out.append((name, n, k, torch.float32))
    return out


def floor_us(m: int, n: int, k: int, out_dtype: torch.dtype) -> tuple[float, float]:
    """(memory floor, compute floor) in µs: bytes of w, x and y over HBM bandwidth; 2·M·N·K over the bf16 rate."""
    out_size = torch.empty((), dtype=out_dtype).element_size()
    bytes_moved = n * k * 2 + m * k * 2 + m * n * out_size
    return bytes_moved / HBM_BYTES_PER_S * 1e6, 2 * m * n * k / BF16_FLOPS_PER_S * 1e6


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ||out - ref|| / ||ref||."""
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def time_us(x: torch.Tensor, weights: list[torch.Tensor], out_dtype: torch.dtype) -> float:
    """Median µs of one call: a graph of CALLS calls over rotating weight copies, REPLAYS timed replays."""
    for w in weights[:2]:
        linear(x, w, out_dtype)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            linear(x, weights[i % len(weights)], out_dtype)
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / CALLS)
    return sorted(times)[len(times) // 2]


def row_invariant(w: torch.Tensor, out_dtype: torch.dtype, gen: torch.Generator) -> bool:
    """Each sampled row bit-identical alone and inside batches of INVARIANCE_BATCHES (all tile paths)."""
    big = max(INVARIANCE_BATCHES)
    x = torch.randn(big, w.shape[1], device=w.device, generator=gen).to(torch.bfloat16)
    rows = (0, 1, 5, 6, 63, 200, 255)
    alone = {r: linear(x[r : r + 1], w, out_dtype)[0] for r in rows}
    for batch in INVARIANCE_BATCHES:
        for start in (0, big - batch):
            out = linear(x[start : start + batch], w, out_dtype)
            for r in rows:
                if start <= r < start + batch and not torch.equal(out[r - start], alone[r]):
                    return False
    return True


def run_case(name: str, n: int, k: int, out_dtype: torch.dtype, gen: torch.Generator) -> list[dict[str, object]]:
    """All batch sizes of one weight; an error is reported in the rows, never raised."""
    dtype = "bf16" if out_dtype == torch.bfloat16 else "fp32"
    split, k_split = k_ranges(n, k)
    base = {"name": name, "n": n, "k": k, "out_dtype": dtype, "split": split, "k_split": k_split}
    try:
        copies = max(1, -(-COLD_BYTES // (n * k * 2)))
        weights = [(torch.randn(n, k, device="cuda", generator=gen) / k**0.5).to(torch.bfloat16) for _ in range(copies)]
        invariant = row_invariant(weights[0], out_dtype, gen)
    except Exception as exc:  # a failing weight is reported, the run goes on
        return [{**base, "m": m, "error": repr(exc)} for m in BATCHES]
    rows = []
    for m in BATCHES:
        row: dict[str, object] = {**base, "m": m, "row_invariant": invariant, "tiles": pick_tiles(m, n, k).__dict__}
        try:
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            out = linear(x, weights[0], out_dtype)
            ref = linear_reference(x, weights[0], out_dtype)
            mem, flop = floor_us(m, n, k, out_dtype)
            t = time_us(x, weights, out_dtype)
            row.update(
                time_us=t,
                floor_us=max(mem, flop),
                mem_floor_us=mem,
                flop_floor_us=flop,
                ratio=t / max(mem, flop),
                rel_err=rel_err(out, ref),
                nan=bool(out.isnan().any()),
            )
            if name in TARGETS and m == 1:
                row["within_1p4x_floor"] = t <= 1.4 * max(mem, flop)
        except Exception as exc:  # a failing case is reported, the run goes on
            row["error"] = repr(exc)
        rows.append(row)
    del weights
    torch.cuda.empty_cache()
    return rows


def passed(row: dict[str, object]) -> bool:
    """A case passes when it ran, gave no NaN, kept its rows invariant and stayed within its dtype's tolerance."""
    if "error" in row:
        return False
    tol = 1e-2 if row["out_dtype"] == "bf16" else 1e-5
    return not row["nan"] and bool(row["row_invariant"]) and float(row["rel_err"]) <= tol


def line(row: dict[str, object]) -> str:
    """One printed line per case."""
    shape = f"{row['name']:<14} M={row['m']:<4} N={row['n']:<6} K={row['k']:<6} {row['out_dtype']}"
    if "error" in row:
        return f"{shape} ERROR {row['error']}"
    return (
        f"{shape} time_us={row['time_us']:8.2f} floor_us={row['floor_us']:8.2f} ratio={row['ratio']:5.2f} "
        f"rel_err={row['rel_err']:.2e} row_invariant={row['row_invariant']}"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command line: --out DIR, optional --only NAME ... to run a subset of the weights."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for linear.json")
    parser.add_argument("--only", nargs="*", choices=sorted(WEIGHTS), help="weights to check (default: all)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run every case; 0 when every case passes (see `passed`), 1 when one does not, 2 without a GPU."""
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check_linear: no CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    args.out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, n, k, out_dtype in cases(args.only):
        for row in run_case(name, n, k, out_dtype, gen):
            print(line(row), flush=True)
            rows.append(row)
    report = {
        "device": torch.cuda.get_device_name(),
        "timing": f"CUDA graph of {CALLS} calls over rotating weight copies (cold L2); median of {REPLAYS} replays",
        "floor": "max(bytes of w + x + y / 4.27 TB/s, 2·M·N·K / 790 TFLOP/s)",
        "cases": rows,
    }
    (args.out / "linear.json").write_text(json.dumps(report, indent=1))
    for r in rows:
        if "within_1p4x_floor" in r:
            verdict = "within" if r["within_1p4x_floor"] else "NOT within"
            print(f"target {r['name']} M=1 {r['out_dtype']}: {r['ratio']:.2f}x the floor, {verdict} 1.4x")
    return 0 if all(passed(r) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
