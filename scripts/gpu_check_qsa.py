"""GPU check of the QSA indexer + sparse attention at the per-rank shapes of tp=2: error against the torch
references, row invariance (batches of 1, 2, 7, 64), and CUDA-graph time against the bandwidth floor.

python3 scripts/gpu_check_qsa.py --out DIR        # writes DIR/qsa.json and prints one line per case
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from gpu_timing import graph_median_us

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kernels import qsa

BANDWIDTH = 4.27e12  # bytes/s, measured device-to-device copy on the project's H200s
BATCHES = (1, 2, 7, 64)
GRAPH_COPIES = 10
SWEEP_SHAPES = ((131072, 1, 1), (131072, 64, 4), (8192, 8, 1))  # (context, lanes, rows per lane)
SWEEP = (  # module constants tried by --sweep; the first is the default
    {"SCORE_TILE": 64, "SCORE_WARPS": 4, "SELECT_TILE": 1024, "SELECT_WARPS": 4, "ATTN_SPLIT": 256, "ATTN_TILE": 64},
    {"SCORE_TILE": 32, "SCORE_WARPS": 4, "SELECT_TILE": 2048, "SELECT_WARPS": 8, "ATTN_SPLIT": 128, "ATTN_TILE": 64},
    {"SCORE_TILE": 128, "SCORE_WARPS": 8, "SELECT_TILE": 4096, "SELECT_WARPS": 8, "ATTN_SPLIT": 256, "ATTN_TILE": 32},
    {"SCORE_TILE": 64, "SCORE_WARPS": 8, "SELECT_TILE": 1024, "SELECT_WARPS": 8, "ATTN_SPLIT": 128, "ATTN_TILE": 32},
    {"SCORE_TILE": 16, "SCORE_WARPS": 2, "SELECT_TILE": 4096, "SELECT_WARPS": 4, "ATTN_SPLIT": 64, "ATTN_TILE": 64},
)


@dataclass(frozen=True)
class Shape:
    """Per-rank QSA widths."""

    heads: int = 12
    kv_heads: int = 1
    dim: int = 256
    index_heads: int = 4
    index_dim: int = 128
    ratio: int = 4
    top_blocks: int = 512


@dataclass
class Case:
    """One batch of rows over per-lane caches, rows of a lane adjacent at consecutive positions."""

    q: torch.Tensor
    q_idx: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_keys: torch.Tensor
    lanes: torch.Tensor
    positions: torch.Tensor


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for qsa.json")
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768, 131072])
    ap.add_argument("--lanes", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4], help="rows per lane: 1 decode, 4 verify")
    ap.add_argument("--reps", type=int, default=30, help="timed graph replays (median reported)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sweep", action="store_true", help="first time the tile constants in SWEEP on SWEEP_SHAPES")
    ap.add_argument("--profile", action="store_true", help="first print per-kernel device times on SWEEP_SHAPES")
    return ap.parse_args(argv)


def make_case(shape: Shape, lanes: int, rows: int, context: int, device: torch.device, gen: torch.Generator) -> Case:
    """Random caches of `context` tokens per lane; each lane's last row sits at context-1 minus a small jitter."""

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device=device).bfloat16()

    last = context - 1 - torch.arange(lanes, device=device) % shape.ratio
    positions = (last[:, None] - torch.arange(rows - 1, -1, -1, device=device)[None, :]).flatten()
    return Case(
        q=randn(lanes * rows, shape.heads, shape.dim),
        q_idx=randn(lanes * rows, shape.index_heads, shape.index_dim),
        k_cache=randn(lanes, context, shape.kv_heads, shape.dim),
        v_cache=randn(lanes, context, shape.kv_heads, shape.dim),
        block_keys=randn(lanes, context // shape.ratio, shape.index_dim),
        lanes=torch.arange(lanes, device=device, dtype=torch.int32).repeat_interleave(rows),
        positions=positions.to(torch.int32),
    )


def run_kernels(shape: Shape, case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Indexer then attention: (indices, counts, out)."""
    idx, counts = qsa.qsa_index(case.q_idx, case.block_keys, case.lanes, case.positions, shape.ratio, shape.top_blocks)
    out = qsa.qsa_sparse_attention(case.q, case.k_cache, case.v_cache, case.lanes, idx, counts)
    return idx, counts, out


def floor_bytes(shape: Shape, case: Case, counts: torch.Tensor) -> int:
    """Selected K/V per row, block keys the indexer must score per lane (C > top_blocks only), q and index q."""
    rows = case.q.shape[0]
    kv = int(counts.sum()) * shape.kv_heads * shape.dim * 2 * 2
    visible = (case.positions.long() + 1) // shape.ratio
    per_lane = torch.zeros(case.k_cache.shape[0], dtype=torch.long, device=visible.device)
    per_lane.scatter_reduce_(0, case.lanes.long(), visible, reduce="amax")
    scored = int(per_lane[per_lane > shape.top_blocks].sum())
    queries = rows * (shape.heads * shape.dim + shape.index_heads * shape.index_dim) * 2
    return kv + scored * shape.index_dim * 2 + queries


def selection_gap(shape: Shape, case: Case, idx: torch.Tensor, rows: list[int]) -> float:
    """Worst (best rejected - worst chosen block score) / best score over `rows`, scores in fp64 (<= 0: exact)."""
    worst = float("-inf")
    for t in rows:
        visible = (int(case.positions[t]) + 1) // shape.ratio
        if visible <= shape.top_blocks:
            return float("inf")
        keys = case.block_keys[int(case.lanes[t]), :visible].double()
        scores = (case.q_idx[t].double() @ keys.T).relu().sum(0) / math.sqrt(shape.index_dim)
        chosen = torch.zeros(visible, dtype=torch.bool, device=scores.device)
        chosen[idx[t, : shape.top_blocks * shape.ratio : shape.ratio].long() // shape.ratio] = True
        worst = max(worst, ((scores[~chosen].max() - scores[chosen].min()) / scores.max()).item())
    return worst


def check_accuracy(shape: Shape, case: Case) -> dict[str, object]:
    """Kernel against the torch references: index rows that differ (and by how much), attention rel. error, NaN."""
    idx, counts, out = run_kernels(shape, case)
    ref_idx, ref_counts = qsa.qsa_index_reference(
        case.q_idx, case.block_keys, case.lanes, case.positions, shape.ratio, shape.top_blocks
    )
    ref = qsa.qsa_sparse_attention_reference(case.q, case.k_cache, case.v_cache, case.lanes, idx, counts)
    rel = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    differing = ((idx != ref_idx).any(1) | (counts != ref_counts)).nonzero().flatten().tolist()
    return {
        "index_rows_differing": len(differing),
        "index_worst_gap": selection_gap(shape, case, idx, differing) if differing else 0.0,
        "rel_err": rel,
        "nan": bool(out.isnan().any()),
        "counts": counts,
    }


def check_invariance(shape: Shape, case: Case, context: int, gen: torch.Generator) -> bool:
    """Rows of the case inside batches of 1, 2, 7 and 64 (filled up with rows at random positions, shuffled)."""
    idx, counts, out = run_kernels(shape, case)
    total, lanes = case.q.shape[0], case.k_cache.shape[0]
    device = case.q.device
    for batch in BATCHES:
        picked = torch.randperm(total, generator=gen, device=device)[: min(batch, total)]
        extra = batch - picked.numel()
        filler_lanes = torch.randint(0, lanes, (extra,), generator=gen, device=device, dtype=torch.int32)
        filler_pos = torch.randint(0, context, (extra,), generator=gen, device=device, dtype=torch.int32)
        order = torch.randperm(batch, generator=gen, device=device)
        sub = Case(
            q=torch.cat((case.q[picked], torch.randn_like(case.q[:1]).expand(extra, -1, -1)))[order],
            q_idx=torch.cat((case.q_idx[picked], torch.randn_like(case.q_idx[:1]).expand(extra, -1, -1)))[order],
            k_cache=case.k_cache,
            v_cache=case.v_cache,
            block_keys=case.block_keys,
            lanes=torch.cat((case.lanes[picked], filler_lanes))[order],
            positions=torch.cat((case.positions[picked], filler_pos))[order],
        )
        s_idx, s_counts, s_out = run_kernels(shape, sub)
        where = torch.argsort(order)[: picked.numel()]
        same = torch.equal(s_idx[where], idx[picked]) and torch.equal(s_counts[where], counts[picked])
        if not (same and torch.equal(s_out[where].view(torch.int16), out[picked].view(torch.int16))):
            return False
    return True


def time_graph(fn: Callable[[], object], reps: int) -> float:
    """Median µs per call of fn, from `reps` replays of a CUDA graph holding GRAPH_COPIES calls back to back
    (so the graph's own launch latency is spread over the copies, as inside a server's step graph)."""
    return graph_median_us([fn], GRAPH_COPIES, reps)


def profile_kernels(shape: Shape, args: argparse.Namespace) -> list[dict[str, object]]:
    """Per-kernel device time (torch profiler, eager calls) on SWEEP_SHAPES."""
    from torch.profiler import ProfilerActivity, profile

    rows_out = []
    device = torch.device("cuda")
    for context, lanes, rows in SWEEP_SHAPES:
        case = make_case(shape, lanes, rows, context, device, torch.Generator(device=device).manual_seed(args.seed))
        run_kernels(shape, case)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                run_kernels(shape, case)
            torch.cuda.synchronize()
        for evt in prof.key_averages():
            us = getattr(evt, "self_device_time_total", 0.0) / max(evt.count, 1)
            if us > 0:
                row = {"context": context, "lanes": lanes, "rows_per_lane": rows, "kernel": evt.key, "us": us}
                print("profile", json.dumps(row), flush=True)
                rows_out.append(row)
        torch.cuda.empty_cache()
    return rows_out


def time_parts(shape: Shape, case: Case, reps: int) -> tuple[float, float, float]:
    """Graph-replay µs of the indexer alone, the attention alone, and both."""
    idx, counts = qsa.qsa_index(case.q_idx, case.block_keys, case.lanes, case.positions, shape.ratio, shape.top_blocks)
    index_us = time_graph(
        lambda: qsa.qsa_index(case.q_idx, case.block_keys, case.lanes, case.positions, shape.ratio, shape.top_blocks),
        reps,
    )
    attention_us = time_graph(
        lambda: qsa.qsa_sparse_attention(case.q, case.k_cache, case.v_cache, case.lanes, idx, counts), reps
    )
    return index_us, attention_us, time_graph(lambda: run_kernels(shape, case), reps)


def run_case(shape: Shape, lanes: int, rows: int, context: int, args: argparse.Namespace) -> dict[str, object]:
    """Build, check and time one case; errors are reported, not raised."""
    result: dict[str, object] = {"lanes": lanes, "rows_per_lane": rows, "context": context}
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(args.seed + context + 1000 * lanes + rows)
    try:
        case = make_case(shape, lanes, rows, context, device, gen)
        acc = check_accuracy(shape, case)
        counts = acc.pop("counts")
        result.update(acc)
        result["row_invariant"] = check_invariance(shape, case, context, gen)
        result["index_us"], result["attention_us"], result["time_us"] = time_parts(shape, case, args.reps)
        result["floor_us"] = floor_bytes(shape, case, counts) / BANDWIDTH * 1e6
        result["ratio"] = result["time_us"] / result["floor_us"]
        result["ok"] = (
            not result["nan"]
            and result["rel_err"] <= 1e-2
            and result["row_invariant"]
            and result["index_worst_gap"] <= 1e-6
        )
    except Exception as exc:  # one failing case must not end the run
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
        result["ok"] = False
    finally:
        torch.cuda.empty_cache()
    return result


def describe(res: dict[str, object]) -> str:
    """One printed line per case."""
    shape = f"ctx={res['context']:>6} lanes={res['lanes']:>2} rows/lane={res['rows_per_lane']}"
    if "error" in res:
        return f"{shape}  ERROR {res['error']}"
    return (
        f"{shape}  time_us={res['time_us']:8.1f} (index {res['index_us']:.1f}, attn {res['attention_us']:.1f})"
        f"  floor_us={res['floor_us']:7.2f}  ratio={res['ratio']:6.1f}  rel_err={res['rel_err']:.2e}"
        f"  index_rows_differing={res['index_rows_differing']} (gap {res['index_worst_gap']:.1e})"
        f"  row_invariant={res['row_invariant']}"
    )


def sweep(shape: Shape, args: argparse.Namespace) -> list[dict[str, object]]:
    """Time indexer and attention for each constant set in SWEEP; the defaults are restored after."""
    defaults = {name: getattr(qsa, name) for name in SWEEP[0]}
    results = []
    device = torch.device("cuda")
    for context, lanes, rows in SWEEP_SHAPES:
        gen = torch.Generator(device=device).manual_seed(args.seed)
        case = make_case(shape, lanes, rows, context, device, gen)
        for consts in SWEEP:
            res: dict[str, object] = {"context": context, "lanes": lanes, "rows_per_lane": rows, **consts}
            try:
                for name, value in consts.items():
                    setattr(qsa, name, value)
                res["index_us"], res["attention_us"], res["time_us"] = time_parts(shape, case, args.reps)
            except Exception as exc:  # a bad constant set must not end the sweep
                res["error"] = f"{type(exc).__name__}: {exc}"
            finally:
                for name, value in defaults.items():
                    setattr(qsa, name, value)
            print("sweep", json.dumps(res), flush=True)
            results.append(res)
        torch.cuda.empty_cache()
    return results


def main(argv: list[str] | None = None) -> int:
    """Run every case; 0 when all pass."""
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, object] = {"kernel": "qsa", "bandwidth": BANDWIDTH, "cases": []}
    if not torch.cuda.is_available():
        report["error"] = "no CUDA device"
        (args.out / "qsa.json").write_text(json.dumps(report, indent=2))
        print("gpu_check_qsa: no CUDA device")
        return 2
    report["device"] = torch.cuda.get_device_name()
    shape = Shape()
    if args.profile:
        report["profile"] = profile_kernels(shape, args)
    if args.sweep:
        report["sweep"] = sweep(shape, args)
    for context in args.contexts:
        for lanes in args.lanes:
            for rows in args.rows:
                res = run_case(shape, lanes, rows, context, args)
                report["cases"].append(res)
                print(describe(res), flush=True)
                (args.out / "qsa.json").write_text(json.dumps(report, indent=2))
    bad = [c for c in report["cases"] if not c["ok"]]
    print(f"gpu_check_qsa: {len(report['cases']) - len(bad)}/{len(report['cases'])} cases ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
