"""Sweep the routed-MoE kernels' launch tiles on one GPU at the real per-rank shapes: bits against the default tiles,
time per call and per kernel.

python3 scripts/gpu_sweep_moe.py --out DIR [--rows N ...] [--bf16]   # writes DIR/moe_sweep_nvfp4.json (or _bf16)
TRITON_INTERPRET=1 python3 scripts/gpu_sweep_moe.py --out DIR --smoke   # tiny shapes on the CPU, wall-clock µs

The shape is gpu_check_moe's (E=512 experts, d=2560, I=320 per rank, top-k 10) with its random NVFP4 bank (or BF16
with --bf16) and its routing: distinct random experts per row. For each N the default tiles (`moe_tiles`) come
first, then the candidates. Every candidate must give the default tiles' bits: the mismatching elements of the fp32
output (before the final bf16 rounding) are counted. A call is timed as the server runs it, with the bf16 output: a
CUDA graph of at least CALLS calls cycling through routing sets, enough of them that the experts' weights stream
from HBM, not L2 (at least COLD_BYTES of down weights between two uses of a set); then each of the four kernels
(plan, gate_up, down, combine; the GEMMs Gluon's where they run, whose launches no tile set changes) alone the same
way, by replaying the launches `moe_forward` made. Both GEMM kernels
take one block_m, num_warps and num_stages, so the candidates pair one gate_up setting with one down setting at
every (num_warps, num_stages): every setting of each kernel is timed there, and the per-kernel times tell the two
sides apart. Last, the fastest gate_up and down settings at a shared (block_m, num_warps, num_stages) are joined
into one candidate and run too, unless already run. block_m is 16 unless --block-m adds others: taller tiles only pay
once an expert sees more than 16 rows (N·k/E > 16); 64 and 128 stay on mma.sync, which the bits rely on, only with
fewer than four warps (the sweep counts the other bits of any that do not).
The JSON is rewritten after each candidate; Triton compiles two kernels per candidate on the first N, and `--rows`,
`--warps` and `--stages` split a run.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import statistics
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from gpu_check_moe import Shape, floor_us, make_bank, make_routing
from gpu_timing import graph_median_us, recording, wall_us
from torch.overrides import TorchFunctionMode

from kernels import moe, moe_gluon  # importable: gpu_check_moe puts the repository root on sys.path
from kernels.moe import MoeTiles, moe_tiles

ROWS = (1, 8, 64)
SMOKE_ROWS = (1, 3)
SMOKE = Shape(experts=4, hidden=32, inter=16, top_k=2)
BEST = 5
CALLS = 20  # calls per timed graph at least, as gpu_check_hyper
REPLAYS = 25
COLD_BYTES = 300_000_000  # down weights read between two uses of one routing set: several times the L2
MAX_SETS = 64
KERNELS = {  # name: (module, kernel attribute) of each launch a call makes (grouped path, then the pairs path)
    "plan": (moe, "_plan_kernel"),
    "gate_up": (moe, "_gate_up_kernel"),
    "down": (moe, "_down_kernel"),
    "combine": (moe, "_combine_kernel"),
    "gate_up_pairs": (moe, "_gate_up_pairs_kernel"),
    "down_pairs": (moe, "_down_pairs_kernel"),
    "gate_up_gluon": (moe_gluon, "_gate_up_kernel"),
    "down_gluon": (moe_gluon, "_down_kernel"),
}
ROLES = {  # the GEMM kernels of each path
    "gate_up": ("gate_up", "gate_up_pairs", "gate_up_gluon"),
    "down": ("down", "down_pairs", "down_gluon"),
}
# (gate_up_n, gate_up_k) and (down_n, down_k). Left out: gate/up 16x128 (2 KB of weights a step per program, too
# little in flight) and 64x512 (ptxas for sm_90 at block_m 16: 255 registers and spills at every num_warps, 1.5 KB
# of stack at 2)
GATE_UP = tuple(t for t in itertools.product((16, 32, 64), (128, 256, 512)) if t not in ((16, 128), (64, 512)))
DOWN = tuple(itertools.product((16, 32, 64, 128), (64, 128)))
# the interpreter's fp32 dot sums a K tile in its own order: K tiles at or past d and I keep the smoke run's bits
SMOKE_GATE_UP = ((16, 32), (32, 64))
SMOKE_DOWN = ((16, 32), (32, 64))
BLOCK_M = (16,)
WARPS = (2, 4, 8)
STAGES = (2, 3, 4)

Bank = dict[str, torch.Tensor]
Routing = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Timer = Callable[[list[Callable[[], object]]], float]
Forward = Callable[[Bank, Routing, MoeTiles | None, torch.dtype], torch.Tensor]
Row = dict[str, Any]


def candidates(
    warps: tuple[int, ...] = WARPS,
    stages: tuple[int, ...] = STAGES,
    block_m: tuple[int, ...] = BLOCK_M,
    gate_up: tuple[tuple[int, int], ...] = GATE_UP,
    down: tuple[tuple[int, int], ...] = DOWN,
) -> list[MoeTiles]:
    """Each gate_up setting paired with a down setting (the shorter list cycled) at every (block_m, warps, stages)."""
    pairs = [(gate_up[i % len(gate_up)], down[i % len(down)]) for i in range(max(len(gate_up), len(down)))]
    grid = itertools.product(block_m, warps, stages)
    return [MoeTiles(m, *gu, *dn, w, s) for m, w, s in grid for gu, dn in pairs]


def role_us(row: Row, role: str) -> float | None:
    """µs of the kernel that played `role` (gate_up or down) in a measured row, whichever path ran; None if none."""
    return next((row["kernel_us"][k] for k in ROLES[role] if k in (row["kernel_us"] or {})), None)


def launch(bank: Bank, routing: Routing, tiles: MoeTiles | None, out_dtype: torch.dtype) -> torch.Tensor:
    """moe_forward of one routing set with explicit tiles (None: the default ones)."""
    return moe.moe_forward(*routing, bank, out_dtype, tiles=tiles)


def graph_us(calls: list[Callable[[], object]]) -> float:
    """Median µs of one call from a CUDA graph of at least CALLS calls cycling through all of `calls`."""
    return graph_median_us(calls, max(CALLS, len(calls)), REPLAYS)


class _OnDevice(TorchFunctionMode):
    """Within: tensors that torch functions are asked to make on "cuda" are made on `device` instead."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if kwargs.get("device") == "cuda":
            kwargs["device"] = self.device
        return func(*args, **kwargs)


def inputs(
    shape: Shape, fp4: bool, counts: dict[int, int], device: torch.device
) -> tuple[Bank, dict[int, list[Routing]]]:
    """The bank and `counts[n]` routing sets per batch size n, seeded: gpu_check_moe's makers, moved to `device`."""
    gen = torch.Generator(device=device).manual_seed(0)
    with _OnDevice(device):
        bank = make_bank(shape, fp4, gen)
        return bank, {n: [make_routing(shape, n, gen) for _ in range(c)] for n, c in counts.items()}


def new_row(n: int, tiles: MoeTiles, default: MoeTiles, joined: bool = False) -> Row:
    """The row of one candidate, nothing measured yet."""
    return {"rows": n, "tiles": dataclasses.asdict(tiles), "default": tiles == default, "joined": joined, "us": None,
            "kernel_us": None, "mismatches": None, "error": None}  # fmt: skip


def measure(
    n: int, tiles: MoeTiles, default: MoeTiles, bank: Bank, sets: list[Routing], ref: torch.Tensor, timer: Timer,
    forward: Forward, joined: bool = False,
) -> Row:  # fmt: skip
    """One candidate: elements of the fp32 output differing from `ref`, µs per call and per kernel; errors recorded."""
    row = new_row(n, tiles, default, joined)
    try:
        out = forward(bank, sets[0], tiles, torch.float32)
        row["mismatches"] = int((out.view(torch.int32) != ref.view(torch.int32)).sum())
        calls = [partial(forward, bank, routing, tiles, torch.bfloat16) for routing in sets]
        row["us"] = timer(calls)
        with recording(KERNELS) as kept:
            for fn in calls:
                fn()
        row["kernel_us"] = {name: timer(launches) for name, launches in kept.items() if launches}
    except Exception as exc:  # a candidate that fails to compile or launch is reported, the sweep goes on
        row["error"] = repr(exc)
    return row


def identical(row: Row) -> bool:
    """Whether a candidate ran and gave the default tiles' bits."""
    return row["error"] is None and row["mismatches"] == 0


def joined(rows: list[Row]) -> MoeTiles | None:
    """The fastest bit-identical gate_up and down settings, joined at the (block_m, warps, stages) adding up least."""
    groups: dict[tuple[int, int, int], list[Row]] = {}
    for row in filter(identical, rows):
        t = row["tiles"]
        groups.setdefault((t["block_m"], t["num_warps"], t["num_stages"]), []).append(row)
    options = []
    for group in groups.values():
        gate_up = min(group, key=lambda r: role_us(r, "gate_up"))
        down = min(group, key=lambda r: role_us(r, "down"))
        tiles = MoeTiles(**{**gate_up["tiles"], "down_n": down["tiles"]["down_n"], "down_k": down["tiles"]["down_k"]})
        options.append((role_us(gate_up, "gate_up") + role_us(down, "down"), tiles))
    return min(options, key=lambda o: o[0])[1] if options else None


def sweep(
    n: int, shape: Shape, bank: Bank, sets: list[Routing], tiles: list[MoeTiles], timer: Timer,
    forward: Forward = launch, keep: Callable[[Row], object] = lambda row: None,
) -> list[Row]:  # fmt: skip
    """One batch size: the default tiles, each new one of `tiles`, the joined best (marked; run if new); `keep` each."""
    default = moe_tiles(n, shape.top_k, shape.experts)
    try:
        ref = forward(bank, sets[0], None, torch.float32)  # the default tiles' bits, which every candidate must give
    except Exception as exc:  # nothing to compare with: the default row alone, with the error
        row = {**new_row(n, default, default), "error": repr(exc)}
        keep(row)
        return [row]
    rows: list[Row] = []
    for t in dict.fromkeys([default, *tiles]):
        rows.append(measure(n, t, default, bank, sets, ref, timer, forward))
        keep(rows[-1])
    best_joined = joined(rows)
    if best_joined is not None:
        ran = [r for r in rows if r["tiles"] == dataclasses.asdict(best_joined)]
        if ran:
            ran[0]["joined"] = True
        else:
            rows.append(measure(n, best_joined, default, bank, sets, ref, timer, forward, joined=True))
            keep(rows[-1])
    return rows


def cold_sets(n: int, shape: Shape, fp4: bool) -> int:
    """Routing sets to cycle so that COLD_BYTES of down weights (an expert's bytes / 3) pass between uses of one."""
    touched = shape.experts * (1 - (1 - shape.top_k / shape.experts) ** n)
    return max(2, min(MAX_SETS, 1 + math.ceil(COLD_BYTES / (touched * shape.expert_bytes(fp4) / 3))))


def best(rows: list[Row], key: Callable[[Row], float] = lambda r: r["us"], count: int = BEST) -> list[Row]:
    """The `count` fastest bit-identical rows by `key`, fastest first."""
    return sorted(filter(identical, rows), key=key)[:count]


def describe(row: Row) -> str:
    """One row: µs per call, per kernel, and its tiles."""
    t = row["tiles"]
    tiles = (
        f"m {t['block_m']} gate_up {t['gate_up_n']}x{t['gate_up_k']} down {t['down_n']}x{t['down_k']} "
        f"warps {t['num_warps']} stages {t['num_stages']}"
    )
    if row["error"] is not None:
        return f"ERROR {tiles}: {row['error']}"
    kernels = " ".join(f"{name} {us:7.2f}" for name, us in row["kernel_us"].items())
    return f"{row['us']:8.2f} us ({kernels})  {tiles}"


def report(n: int, rows: list[Row], floor: float) -> list[str]:
    """One batch size's lines: the default and byte floor, the best bit-identical, fastest per GEMM kernel, joined."""
    default = next(r for r in rows if r["default"])
    failed = sum(r["error"] is not None for r in rows)
    differ = sum(r["error"] is None and not identical(r) for r in rows)
    lines = [f"N={n}: {len(rows)} tiles, {failed} failed, {differ} with other bits", f"  default  {describe(default)}"]
    lines.append(f"  floor    {floor:8.2f} us (bytes of the touched experts and the activations at HBM bandwidth)")
    lines += [f"  best {i}   {describe(r)}" for i, r in enumerate(best(rows), 1)]
    for name in ROLES:
        timed = [r for r in rows if role_us(r, name) is not None]
        lines += [f"  {name:<8} {describe(r)}" for r in best(timed, lambda r, name=name: role_us(r, name), 1)]
    lines += [f"  joined   {describe(r)}" for r in rows if r["joined"]]
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command line: --out DIR, optional --rows N ..., --bf16, --block-m/--warps/--stages values, --smoke."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for moe_sweep_nvfp4.json (or _bf16)")
    parser.add_argument("--rows", nargs="+", type=int, help=f"batch sizes (default: {list(ROWS)})")
    parser.add_argument("--bf16", action="store_true", help="the BF16 bank instead of NVFP4")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, CPU, under TRITON_INTERPRET=1")
    parser.add_argument(
        "--block-m", nargs="+", type=int, choices=(16, 32, 64, 128), default=list(BLOCK_M), help="row tiles"
    )
    parser.add_argument("--warps", nargs="+", type=int, default=list(WARPS), help="num_warps values to try")
    parser.add_argument("--stages", nargs="+", type=int, default=list(STAGES), help="num_stages values to try")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Sweep every N; 0 unless the default tiles fail (1), or no GPU / no interpreter for --smoke (2)."""
    args = parse_args(argv)
    if args.smoke != moe._interpreting() or not (args.smoke or torch.cuda.is_available()):
        print("gpu_sweep_moe: needs a CUDA device, or --smoke with TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    fp4 = not args.bf16
    if args.smoke:
        shape, batches, device, timer = SMOKE, SMOKE_ROWS, torch.device("cpu"), wall_us
        tiles = candidates((4,), (1,), (16,), SMOKE_GATE_UP, SMOKE_DOWN)
    else:
        shape, batches, device, timer = Shape(), ROWS, torch.device("cuda"), graph_us
        tiles = candidates(tuple(args.warps), tuple(args.stages), tuple(args.block_m))
    batches = tuple(args.rows or batches)
    counts = {n: 1 if args.smoke else cold_sets(n, shape, fp4) for n in batches}
    bank, routings = inputs(shape, fp4, counts, device)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "nvfp4" if fp4 else "bf16"
    result: dict[str, Any] = {"shape": dataclasses.asdict(shape), "bank": name, "byte_floor_us": {}, "rows": []}
    path = args.out / f"moe_sweep_{name}.json"

    def keep(row: Row | None = None) -> None:
        """Add a measured row, if any, to the result and rewrite the JSON."""
        result["rows"] += [row] if row is not None else []
        path.write_text(json.dumps(result, indent=1))

    for n in batches:
        sets = routings[n]
        floor = statistics.mean(floor_us(shape, ids, fp4)[0] for _, ids, _ in sets)
        result["byte_floor_us"][str(n)] = floor
        rows = sweep(n, shape, bank, sets, tiles, timer, keep=keep)
        keep()  # the joined mark may have gone on a row already written
        print("\n".join(report(n, rows, floor)), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 1 if any(r["default"] and r["error"] is not None for r in result["rows"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
