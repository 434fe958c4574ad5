"""Summarise `scripts/gpu_ncu.sh`'s exports: per kernel launch, its time, occupancy, issue rate and DRAM share (the
details CSV), and its warp stall reasons and instruction mix, each a share of the launch's samples or instructions
(the SASS CSV).

python3 scripts/ncu_summary.py DIR/moe_linear.csv DIR/moe_linear_sass.csv [--top 6]
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from collections import Counter
from pathlib import Path

DETAILS = (  # (section, metric, label) of the details page, in print order
    ("GPU Speed Of Light Throughput", "Duration", "time"),
    ("GPU Speed Of Light Throughput", "DRAM Throughput", "DRAM"),
    ("Launch Statistics", "Grid Size", "grid"),
    ("Launch Statistics", "Registers Per Thread", "regs"),
    ("Occupancy", "Achieved Occupancy", "occupancy"),
    ("Scheduler Statistics", "Active Warps Per Scheduler", "warps/scheduler"),
    ("Scheduler Statistics", "Issued Warp Per Scheduler", "issued/cycle"),
    ("Warp State Statistics", "Warp Cycles Per Issued Instruction", "cycles/instruction"),
    ("Instruction Statistics", "Executed Instructions", "instructions"),
)


def details(text: str) -> list[tuple[str, dict[str, str]]]:
    """(kernel, {label: value with unit}) per launch of the details CSV, in launch order."""
    launches: dict[str, tuple[str, dict[str, str]]] = {}
    wanted = {(s, m): label for s, m, label in DETAILS}
    for row in csv.DictReader(io.StringIO(text)):
        launch = launches.setdefault(row["ID"], (row["Kernel Name"], {}))
        label = wanted.get((row["Section Name"], row["Metric Name"]))
        if label:
            unit = row["Metric Unit"]
            launch[1][label] = row["Metric Value"] + ("" if unit in ("", "inst") else f" {unit}")
    return list(launches.values())


def sass_blocks(text: str) -> list[tuple[str, list[dict[str, str]]]]:
    """(kernel, its SASS rows) per launch of the SASS CSV, whose launches each open with a "Kernel Name" line."""
    blocks: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith('"Kernel Name"'):
            blocks.append((next(csv.reader([line]))[1], []))
        elif blocks:
            blocks[-1][1].append(line)
    return [(name, list(csv.DictReader(lines))) for name, lines in blocks]


def stalls_and_ops(rows: list[dict[str, str]]) -> tuple[Counter, Counter]:
    """Stall samples by reason (issued or not) and executed instructions by opcode, over one launch's SASS rows."""
    stalls, ops = Counter(), Counter()
    for row in rows:
        for key, value in row.items():
            if key and key.startswith("stall_") and not key.endswith("(Not Issued)") and value.isdigit():
                stalls[key[len("stall_") :]] += int(value)
        words = row.get("Source", "").split()
        executed = row.get("Instructions Executed", "")
        if words and executed.isdigit():
            ops[words[1] if words[0].startswith("@") and len(words) > 1 else words[0]] += int(executed)
    return stalls, ops


def shares(counts: Counter, top: int) -> str:
    """The `top` largest nonzero entries as 'name NN%' of the total."""
    total = sum(counts.values()) or 1
    return ", ".join(f"{name} {100 * n / total:.0f}%" for name, n in counts.most_common(top) if n)


def main(argv: list[str] | None = None) -> int:
    """Print each launch's figures, stalls and instruction mix; 1 when the two exports list other launches."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("details", type=Path, help="gpu_ncu.sh's NAME.csv (the details page)")
    ap.add_argument("sass", type=Path, help="gpu_ncu.sh's NAME_sass.csv (the source page)")
    ap.add_argument("--top", type=int, default=6, help="stall reasons and opcodes to show (default 6)")
    args = ap.parse_args(argv)
    launches, blocks = details(args.details.read_text()), sass_blocks(args.sass.read_text())
    if [name for name, _ in launches] != [name for name, _ in blocks]:
        print("ncu_summary: the two exports list other launches", file=sys.stderr)
        return 1
    for (name, figures), (_, rows) in zip(launches, blocks, strict=True):
        stalls, ops = stalls_and_ops(rows)
        print(f"{name}: " + ", ".join(f"{label} {figures[label]}" for _, _, label in DETAILS if label in figures))
        print(f"  stalls: {shares(stalls, args.top)}")
        print(f"  instructions: {shares(ops, args.top)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
