"""Check the hyper-connection read and write-back kernels on one GPU at the real per-rank shapes: error, rows, speed.

python3 scripts/gpu_check_hyper.py --out DIR      # writes DIR/hyper.json and prints one line per case

Ops: `read` (hc_read with inject), `read_mixer` (the final mixer: no inject), `write` (hc_write of a bf16 y) and
`write_tp2` (hc_write of two fp32 rank partials). Each case times one call as the server runs it: a CUDA graph of
CALLS calls over rotating copies of the inputs and weights (so they stream from HBM, not L2, where they are big
enough), replayed REPLAYS times; time_us is the median replay over CALLS. The hyper-connection weights are the same
on both ranks (replicated), so the per-rank shapes are the model's.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from gpu_timing import graph_median_us

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kernels.hyper import (  # noqa: E402
    ReadTiles,
    hc_read,
    hc_read_reference,
    hc_write,
    hc_write_reference,
    launch_read,
    read_tiles,
)

HBM_BYTES_PER_S = 4.27e12
BF16_FLOPS_PER_S = 790e12
COLD_BYTES = 300_000_000
MAX_COPIES = 32
CALLS = 20
REPLAYS = 25
BATCHES = (1, 8, 64, 256, 8192)
INVARIANCE_BATCHES = (1, 2, 7, 64, 256)
SAMPLE_ROWS = (0, 1, 5, 6, 63, 200, 255)
OPS = ("read", "read_mixer", "write", "write_tp2")
PREFILL_TILES = ReadTiles(64, 64, 64, 64, True, 4, 3)


@dataclass(frozen=True, slots=True)
class Shape:
    """Hyper-connection sizes: hc streams of d, low rank r."""

    hc: int
    d: int
    r: int
    eps: float = 1e-6


REAL = Shape(hc=4, d=2560, r=320)
Weights = dict[str, torch.Tensor | None]
Rows = dict[str, torch.Tensor]


def floor_us(op: str, n: int, shape: Shape) -> tuple[float, float]:
    """(memory floor, compute floor) in µs: weights + rows moved over HBM bandwidth; GEMM FLOPs over 790 T."""
    k = shape.hc * shape.d
    inject = op == "read"
    if op.startswith("read"):
        weights = (2 * shape.r * k + (shape.hc * k if inject else 0)) * 2
        rows = n * k * 2 + n * shape.d * 2 + (n * shape.hc * 2 if inject else 0)
        flops = 2 * n * (2 * shape.r * k + (shape.hc * k if inject else 0))
        return (weights + rows) / HBM_BYTES_PER_S * 1e6, flops / BF16_FLOPS_PER_S * 1e6
    y = n * shape.d * (2 * 4 if op == "write_tp2" else 2)
    return (2 * n * k * 2 + y + n * shape.hc * 2) / HBM_BYTES_PER_S * 1e6, 0.0


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ||out - ref|| / ||ref||."""
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def make_weights(op: str, shape: Shape, device: torch.device, gen: torch.Generator) -> Weights:
    """Fresh bf16 weights of a read (none for a write): zero-centred norm weight, projections scaled to O(1) outputs."""
    if not op.startswith("read"):
        return {}
    k = shape.hc * shape.d

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, device=device, generator=gen)

    return {
        "hc_norm_weight": (randn(k) * 0.1 - 0.06).to(torch.bfloat16),
        "w_down": (randn(shape.r, k) / k**0.5).to(torch.bfloat16),
        "w_up": (randn(k, shape.r) * 2 / shape.r**0.5).to(torch.bfloat16),
        "w_inject": (randn(shape.hc, k) * 4 / k**0.5).to(torch.bfloat16) if op == "read" else None,
    }


def make_rows(op: str, n: int, shape: Shape, device: torch.device, gen: torch.Generator) -> Rows:
    """Fresh per-row inputs of one op: the wide rows, and for a write the sub-block output and inject weights."""
    k = shape.hc * shape.d
    rows = {"wide": torch.randn(n, k, device=device, generator=gen).to(torch.bfloat16)}
    if op.startswith("write"):
        ranks = (2,) if op == "write_tp2" else ()
        y = torch.randn(*ranks, n, shape.d, device=device, generator=gen)
        rows["y"] = y if ranks else y.to(torch.bfloat16)
        rows["inject"] = (torch.rand(n, shape.hc, device=device, generator=gen) * 2).to(torch.bfloat16)
        rows["out"] = torch.empty_like(rows["wide"])
    return rows


def call(op: str, w: Weights, rows: Rows, shape: Shape) -> list[torch.Tensor]:
    """Run the kernels of one op; its outputs as a list."""
    if op.startswith("read"):
        x, inj = hc_read(rows["wide"], *w.values(), shape.eps, shape.hc)
        return [x] if inj is None else [x, inj]
    return [hc_write(rows["wide"], rows["y"], rows["inject"], out=rows["out"])]


def reference(op: str, w: Weights, rows: Rows, shape: Shape) -> list[torch.Tensor]:
    """Run the plain-PyTorch reference of one op; its outputs as a list."""
    if op.startswith("read"):
        x, inj = hc_read_reference(rows["wide"], *w.values(), shape.eps, shape.hc)
        return [x] if inj is None else [x, inj]
    return [hc_write_reference(rows["wide"], rows["y"], rows["inject"])]


def row_slice(op: str, rows: Rows, start: int, stop: int) -> Rows:
    """Rows [start, stop) of every per-row input (partials are sliced along their row axis)."""
    out = {key: t[..., start:stop, :] if key == "y" else t[start:stop] for key, t in rows.items() if key != "out"}
    if op.startswith("write"):
        out["out"] = torch.empty_like(out["wide"])
    return out


def row_invariant(
    op: str, w: Weights, shape: Shape, device: torch.device, gen: torch.Generator,
    batches: tuple[int, ...],
) -> bool:  # fmt: skip
    """Each sampled row bit-identical alone, inside batches of `batches` and, for reads, with the prefill tiles."""
    big = max(batches)
    rows = make_rows(op, big, shape, device, gen)
    sample = [r for r in SAMPLE_ROWS if r < big]
    alone = {r: call(op, w, row_slice(op, rows, r, r + 1), shape) for r in sample}
    for batch in batches:
        for start in (0, big - batch):
            outs = call(op, w, row_slice(op, rows, start, start + batch), shape)
            for r in sample:
                if start <= r < start + batch and not all(
                    torch.equal(o[r - start], a[0]) for o, a in zip(outs, alone[r], strict=True)
                ):
                    return False
    if op.startswith("read"):
        x, inj = launch_read(rows["wide"], *w.values(), shape.eps, shape.hc, PREFILL_TILES)
        outs = [x] if inj is None else [x, inj]
        return all(torch.equal(o[r], a[0]) for r in sample for o, a in zip(outs, alone[r], strict=True))
    return True


def time_us(calls: list[Callable[[], object]]) -> float:
    """Median µs of one call: a graph of CALLS calls cycling through `calls`, REPLAYS timed replays."""
    return graph_median_us(calls, CALLS, REPLAYS)


def run_case(
    op: str, n: int, shape: Shape, gen: torch.Generator, device: torch.device, timed: bool = True,
    invariance_batches: tuple[int, ...] = INVARIANCE_BATCHES,
) -> dict[str, object]:  # fmt: skip
    """One op at one batch size; an error is reported in the row, never raised."""
    row: dict[str, object] = {"op": op, "n": n, "hc": shape.hc, "d": shape.d, "r": shape.r}
    try:
        w = make_weights(op, shape, device, gen)
        if op.startswith("read"):
            row["tiles"] = asdict(read_tiles(n, shape.r))
        rows = make_rows(op, n, shape, device, gen)
        outs, refs = call(op, w, rows, shape), reference(op, w, rows, shape)
        errs = [rel_err(o, r) for o, r in zip(outs, refs, strict=True)]
        mem, flop = floor_us(op, n, shape)
        row.update(
            rel_err=max(errs),
            rel_errs=errs,
            nan=any(bool(o.isnan().any()) for o in outs),
            row_invariant=row_invariant(op, w, shape, device, gen, invariance_batches),
            floor_us=max(mem, flop),
            mem_floor_us=mem,
            flop_floor_us=flop,
        )
        if timed:
            per_call = mem * 1e-6 * HBM_BYTES_PER_S
            copies = max(1, min(MAX_COPIES, math.ceil(COLD_BYTES / per_call)))
            sets = [(w, rows)] + [
                (make_weights(op, shape, device, gen), make_rows(op, n, shape, device, gen)) for _ in range(copies - 1)
            ]
            t = time_us([lambda w=w, rows=rows: call(op, w, rows, shape) for w, rows in sets])
            row.update(time_us=t, ratio=t / max(mem, flop), copies=copies)
            del sets
    except Exception as exc:  # a failing case is reported, the run goes on
        row["error"] = repr(exc)
    return row


def passed(row: dict[str, object]) -> bool:
    """A case passes when it ran, gave no NaN, kept its rows invariant and stayed within the bf16 tolerance."""
    if "error" in row:
        return False
    return not row["nan"] and bool(row["row_invariant"]) and float(row["rel_err"]) <= 1e-2


def line(row: dict[str, object]) -> str:
    """One printed line per case."""
    shape = f"{row['op']:<10} N={row['n']:<5} hc={row.get('hc')} d={row.get('d')} r={row.get('r')}"
    if "error" in row:
        return f"{shape} ERROR {row['error']}"
    timing = f"time_us={row['time_us']:8.2f} " if "time_us" in row else ""
    ratio = f" ratio={row['ratio']:5.2f}" if "ratio" in row else ""
    return (
        f"{shape} {timing}floor_us={row['floor_us']:8.2f}{ratio} rel_err={row['rel_err']:.2e} "
        f"row_invariant={row['row_invariant']}"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command line: --out DIR, optional --only OP ... and --batches N ... to run a subset."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for hyper.json")
    parser.add_argument("--only", nargs="*", choices=OPS, help="ops to check (default: all)")
    parser.add_argument("--batches", nargs="*", type=int, help=f"batch sizes (default: {list(BATCHES)})")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run every case; 0 when every case passes (see `passed`), 1 when one does not, 2 without a GPU."""
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check_hyper: no CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for op in args.only or OPS:
        for n in args.batches or BATCHES:
            row = run_case(op, n, REAL, gen, device)
            print(line(row), flush=True)
            rows.append(row)
            torch.cuda.empty_cache()
    report = {
        "device": torch.cuda.get_device_name(),
        "timing": f"CUDA graph of {CALLS} calls over rotating input copies (cold L2); median of {REPLAYS} replays",
        "floor": "max(bytes of W_down + W_up (+ W_inject) + rows read and written / 4.27 TB/s, GEMM FLOPs / 790 T)",
        "row_invariance": f"sampled rows alone vs batches {list(INVARIANCE_BATCHES)} (and the prefill tiles)",
        "cases": rows,
    }
    (args.out / "hyper.json").write_text(json.dumps(report, indent=1))
    return 0 if all(passed(r) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
