"""Host and GPU time of a verify round's lane restores: one lane at a time (`model.state.restore` over snapshots of
per-layer views, as the runner did) against the pool's one launch (`LanePool.restore` over `KeptRow`s), at N lanes.

The lane states are rank 0's of a --world-rank model of the config (a meta-device model gives their shapes and
dtypes); the kept stacks hold the states after every row of every window (lanes × drafts rows, random bits), and each
lane goes back to one of its rows. Per N: the host's time to make every kept row's snapshot (views, or `KeptRow`s),
the host's time to issue the restores and the time until the GPU has done them; the two ways must leave the pool with
the same bits.

python3 scripts/bench_restore.py [--lanes 1 8 64] [--drafts 3] [--reps 5] [--json FILE]   # CUDA; exit 1: bits differ
python3 scripts/bench_restore.py --host-only [--lanes 1 8 64] [--reps 7]   # the snapshots' host time, on any machine
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

from model.config import load_config  # noqa: E402
from model.flashnext import FlashNextModel  # noqa: E402
from model.lane_pool import LanePool  # noqa: E402
from model.parallel import TensorParallel  # noqa: E402
from model.state import KeptRow, LaneSnapshot, LaneState, copy_lane, restore  # noqa: E402

STATES = ("gdn_conv", "gdn_recurrent", "ple_conv")
CONTEXT = 16  # positions a pool slot holds: the QSA caches play no part in a restore


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "configs/qwen3.8-flash-next", help="config folder")
    ap.add_argument("--world", type=int, default=2, help="tensor-parallel ranks whose rank 0's states are timed")
    ap.add_argument("--lanes", type=int, nargs="+", default=[1, 8, 64], help="lanes restored together")
    ap.add_argument("--drafts", type=int, default=3, help="kept rows a lane (its window's drafts)")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions of each way (medians reported)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--host-only", action="store_true", help="only the snapshots' host time (no device needed)")
    args = ap.parse_args(argv)
    for flag, value, least in (("--world", args.world, 1), ("--drafts", args.drafts, 1), ("--reps", args.reps, 1)):
        if value < least:
            ap.error(f"{flag}: {value} is below {least}")
    if min(args.lanes) < 1:
        ap.error(f"--lanes: {min(args.lanes)} is not a lane count")
    return args


def template_lane(model_dir: Path, world: int, device: torch.device) -> LaneState:
    """A fresh lane of rank 0 of `world` ranks on `device`, in bf16 (the served dtype) with fp32 recurrent states,
    shaped by a model made on the meta device (no weights)."""
    with torch.device("meta"):
        lane = FlashNextModel(load_config(model_dir), tp=TensorParallel(0, world)).to(torch.bfloat16).new_lane()
    real = lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device)  # noqa: E731
    for name in STATES:
        setattr(lane, name, {i: real(t) for i, t in getattr(lane, name).items()})
    lane.ngram_history = real(lane.ngram_history)
    for cache in (*lane.attention.values(), lane.mtp_attention):
        if cache is not None:
            cache.keys, cache.values, cache.index_keys = (real(t) for t in (cache.keys, cache.values, cache.index_keys))
    return lane


def restore_each(restores: list[tuple[LaneState, LaneSnapshot]]) -> None:
    """The runner's restores before the pool's: `restore` of one lane at a time."""
    for lane, snap in restores:
        restore(lane, snap)


def random_stacks(template: LaneState, rows: int, gen: torch.Generator) -> dict[str, dict[int, torch.Tensor]]:
    """Kept states of `rows` rows, random bits, by state and layer."""

    def bits(t: torch.Tensor) -> torch.Tensor:
        raw = torch.randint(-(2**31), 2**31 - 1, (rows, t.numel() * t.element_size() // 4), dtype=torch.int32,
                            device=t.device, generator=gen)  # fmt: skip
        return raw.view(t.dtype).reshape(rows, *t.shape)

    return {name: {i: bits(t) for i, t in getattr(template, name).items()} for name in STATES}


def view_snapshot(stacks: dict[str, dict[int, torch.Tensor]], row: int, length: int, history) -> LaneSnapshot:
    """A kept row's snapshot as the forward made it before `KeptRow`: a view of every layer's state."""
    return LaneSnapshot(*({i: t[row] for i, t in stacks[name].items()} for name in STATES), history, length)


def kept_snapshot(stacks: dict[str, dict[int, torch.Tensor]], row: int, length: int, history) -> LaneSnapshot:
    """The same row's snapshot as the forward makes it now: `KeptRow`s of the stacks."""
    return LaneSnapshot(*(KeptRow(stacks[name], row) for name in STATES), history, length)


def snapshot_ms(template: LaneState, rows: int, reps: int) -> dict[str, float]:
    """Host ms (median of `reps`) to make `rows` kept rows' snapshots as views and as `KeptRow`s, over stacks of the
    template's layers with one element a row (a view's cost does not depend on its size)."""
    stacks = {name: {i: torch.zeros(rows, 1) for i in getattr(template, name)} for name in STATES}
    history = torch.zeros(2)
    times: dict[str, list[float]] = {"views_ms": [], "kept_rows_ms": []}
    for _ in range(reps):
        for key, make in (("views_ms", view_snapshot), ("kept_rows_ms", kept_snapshot)):
            start = time.perf_counter()
            for r in range(rows):
                make(stacks, r, 1, history)
            times[key].append((time.perf_counter() - start) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def timed(fn: Callable[[], object], device: torch.device) -> tuple[float, float]:
    """(host ms to issue `fn`, ms until the device has done it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    issued = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (issued - start) * 1e3, (time.perf_counter() - start) * 1e3


def pool_bits(pool: LanePool) -> list[torch.Tensor]:
    """Copies of the pool's state tensors."""
    return [t.clone() for name in STATES for t in getattr(pool, name).values()]


def measure(template: LaneState, lanes: int, drafts: int, reps: int, gen: torch.Generator) -> dict:
    """Both ways at `lanes` lanes: medians of `reps`, and whether the bits agree."""
    device = template.gdn_recurrent[next(iter(template.gdn_recurrent))].device
    pool = LanePool(template, lanes, CONTEXT, 4, {})
    members = [copy_lane(template) for _ in range(lanes)]  # the template's states are zeros
    pool.place(members, 1)
    stacks = random_stacks(template, lanes * drafts, gen)
    rows = [lane * drafts + lane % drafts for lane in range(lanes)]  # each lane's row: its first, second, ...
    history = template.ngram_history
    views = [view_snapshot(stacks, r, 1, history) for r in range(lanes * drafts)]
    kept = [kept_snapshot(stacks, r, 1, history) for r in range(lanes * drafts)]
    out: dict[str, list[float]] = {k: [] for k in ("one_by_one_host_ms", "one_by_one_ms", "together_host_ms",
                                                   "together_ms")}  # fmt: skip
    same = True
    for _ in range(reps):
        host, total = timed(partial(restore_each, [(lane, views[r]) for lane, r in zip(members, rows, strict=True)]),
                            device)  # fmt: skip
        out["one_by_one_host_ms"].append(host)
        out["one_by_one_ms"].append(total)
        want = pool_bits(pool)
        for name in STATES:
            for t in getattr(pool, name).values():
                t.zero_()
        host, total = timed(partial(pool.restore, [(lane, kept[r]) for lane, r in zip(members, rows, strict=True)]),
                            device)  # fmt: skip
        out["together_host_ms"].append(host)
        out["together_ms"].append(total)
        same = same and all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                            for a, b in zip(pool_bits(pool), want, strict=True))  # fmt: skip
    report = {k: statistics.median(v) for k, v in out.items()}
    return {"lanes": lanes, "kept_rows": lanes * drafts, **snapshot_ms(template, lanes * drafts, reps), **report,
            "same_bits": same}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Measure every lane count; 2 without CUDA (unless --host-only), 1 if the two ways left other bits."""
    args = parse_args(argv)
    if args.host_only:
        template = template_lane(args.model, args.world, torch.device("meta"))  # its layers, no memory
        results = [{"lanes": n, "kept_rows": n * args.drafts, **snapshot_ms(template, n * args.drafts, args.reps)}
                   for n in args.lanes]  # fmt: skip
        print("\n".join(json.dumps(r) for r in results))
        if args.json is not None:
            args.json.write_text(json.dumps(results, indent=1))
        return 0
    if not torch.cuda.is_available():
        print("bench_restore: needs a CUDA device (the pool's restore is a Triton launch)", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    template = template_lane(args.model, args.world, device)
    gen = torch.Generator(device=device).manual_seed(0)
    results = []
    for lanes in args.lanes:
        results.append(measure(template, lanes, args.drafts, args.reps, gen))
        print(json.dumps(results[-1]), flush=True)
        torch.cuda.empty_cache()
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0 if all(r["same_bits"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
