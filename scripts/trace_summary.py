"""Summarise a FLASHNEXT_ROUND_TRACE file: per kind of round (lanes, rows, graphs replayed), the median of each phase
and of each GPU span on CUDA (forward: from the forward's first input copy to its last kernel; draw: the draw's
kernels; each includes any time the GPU waited for the host to launch them).

python scripts/trace_summary.py TRACE_DIR/rank0.trace [--min-rounds 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path


def round_kind(line: dict) -> str:
    """How a round is grouped: its lanes and rows, and the graphs it replayed (eager when none)."""
    replays = ",".join(f"{k}{'' if n == 1 else f'x{n}'}" for k, n in sorted(line.get("replays", {}).items()))
    return f"lanes={line.get('lanes', 0)} rows={line.get('rows', 0)} {replays or 'eager'}"


def summarise(lines: list[dict], min_rounds: int = 1) -> list[dict]:
    """One entry per kind of round with at least `min_rounds` rounds: its count and each phase's median (ms)."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for line in lines:
        groups[round_kind(line)].append(line)
    out = []
    for kind, group in sorted(groups.items(), key=lambda item: -len(item[1])):
        if len(group) < min_rounds:
            continue
        phases = [line["phases"] for line in group]
        names = sorted({name for p in phases for name in p})
        medians = {name: 1e3 * statistics.median(p.get(name, 0.0) for p in phases) for name in names}
        total = 1e3 * statistics.median(sum(p.values()) for p in phases)
        entry = {"kind": kind, "rounds": len(group), "total_ms": total, "median_ms": medians}
        entry["pinned_blocks_made"] = sum(line.get("pinned_blocks_made", 0) for line in group)
        spans = [line["gpu"] for line in group if line.get("gpu")]
        if spans:  # GPU stream milliseconds between the round's points (already ms)
            points = sorted({name for s in spans for name in s})
            entry["gpu_ms"] = {name: statistics.median(s.get(name, 0.0) for s in spans) for name in points}
        out.append(entry)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("trace", type=Path, help="a rank's trace file (JSON lines)")
    parser.add_argument("--min-rounds", type=int, default=1, help="leave out kinds with fewer rounds")
    args = parser.parse_args()
    lines = [json.loads(text) for text in args.trace.read_text().splitlines() if text.strip()]
    for entry in summarise(lines, args.min_rounds):
        phases = " ".join(f"{name} {ms:.2f}" for name, ms in entry["median_ms"].items())
        gpu = " ".join(f"{name} {ms:.2f}" for name, ms in entry.get("gpu_ms", {}).items())
        print(f"{entry['kind']}: {entry['rounds']} rounds, median {entry['total_ms']:.2f} ms ({phases})")
        if gpu:
            print(f"  GPU stream, median ms: {gpu}")
        if entry["pinned_blocks_made"]:
            print(f"  pinned host blocks made: {entry['pinned_blocks_made']} in {entry['rounds']} rounds")


if __name__ == "__main__":
    main()
