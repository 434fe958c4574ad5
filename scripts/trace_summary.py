"""Summarise a FLASHNEXT_ROUND_TRACE file: per kind of round (lanes, rows, graphs replayed), the median of each phase.

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
        groups[round_kind(line)].append(line["phases"])
    out = []
    for kind, phases in sorted(groups.items(), key=lambda item: -len(item[1])):
        if len(phases) < min_rounds:
            continue
        names = sorted({name for p in phases for name in p})
        medians = {name: 1e3 * statistics.median(p.get(name, 0.0) for p in phases) for name in names}
        total = 1e3 * statistics.median(sum(p.values()) for p in phases)
        out.append({"kind": kind, "rounds": len(phases), "total_ms": total, "median_ms": medians})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("trace", type=Path, help="a rank's trace file (JSON lines)")
    parser.add_argument("--min-rounds", type=int, default=1, help="leave out kinds with fewer rounds")
    args = parser.parse_args()
    lines = [json.loads(text) for text in args.trace.read_text().splitlines() if text.strip()]
    for entry in summarise(lines, args.min_rounds):
        phases = " ".join(f"{name} {ms:.2f}" for name, ms in entry["median_ms"].items())
        print(f"{entry['kind']}: {entry['rounds']} rounds, median {entry['total_ms']:.2f} ms ({phases})")


if __name__ == "__main__":
    main()
