"""Trees in turn through the step profile on one GPU: their round figures side by side, compared within one call.

python3 scripts/gpu_ab_round.py --out DIR --tree base=build/base --tree new=build/new [--turns 2] [--lanes 1 64]
    [--kernels _gated_norm_kernel _combine_kernel] [--timeout 200]

Each turn runs every tree's `scripts/gpu_step_profile.py` (rank 0's half of tp=2 alone, `PROFILE_ARGS`, the lanes
given) from the tree's root with its own code first on PYTHONPATH, trees in the order given, and reads the run's
step_profile.json. It prints a markdown table, a row a run: the replayed round's ms at each lane count, the busy ms of
a one-lane round and of a verify round with 3 drafts, their ratio (issue 7's figure), and the verify round's busy
share of each kernel named. DIR/ab_round.json keeps the rows, rewritten after each run; DIR/TREE_TURN/ each run's
profile files and log. A run that fails, times out or writes no report is a row with its error, and the exit status
is 1. Keep trees × turns × a run's time within the device's limit on one command.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

PROFILE_ARGS = ("--alone-as", "2", "--rounds", "20", "--random-tokens", "120000", "--context", "8192")
LOG_TAIL = 2000  # characters of a failed run's output kept in its row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line: trees as NAME=PATH."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for ab_round.json and each run's files")
    ap.add_argument("--tree", action="append", required=True, metavar="NAME=PATH", help="a tree to profile (repeat)")
    ap.add_argument("--turns", type=int, default=2, help="times each tree runs, in turn (default 2)")
    ap.add_argument("--lanes", type=int, nargs="+", default=[1, 64], help="decode lane counts (default 1 64)")
    ap.add_argument("--kernels", nargs="*", default=[], help="kernels whose verify-round share is listed")
    ap.add_argument("--timeout", type=int, default=200, help="seconds a run may take (default 200)")
    args = ap.parse_args(argv)
    trees = {}
    for spec in args.tree:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            ap.error(f"--tree: expected NAME=PATH, got {spec!r}")
        if name in trees:
            ap.error(f"--tree: the name {name!r} is given twice")
        if not (Path(path) / "scripts" / "gpu_step_profile.py").is_file():
            ap.error(f"--tree {spec}: no scripts/gpu_step_profile.py under {path}")
        trees[name] = Path(path).resolve()
    if args.turns < 1:
        ap.error(f"--turns: expected at least 1, got {args.turns}")
    args.trees = trees
    return args


def _text(output: str | bytes | None) -> str:
    """A run's captured output as text (a timed-out run's comes as bytes, or None)."""
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def profile_run(tree: Path, out: Path, lanes: list[int], timeout: int) -> dict[str, object]:
    """One step profile of `tree` into `out`: its step_profile.json, or {"error": why, "log_tail": its output's
    end}; the output goes to out/profile.log either way."""
    out.mkdir(parents=True, exist_ok=True)
    report_path = out / "step_profile.json"
    report_path.unlink(missing_ok=True)  # a report left by an earlier call is not this run's
    command = [sys.executable, "scripts/gpu_step_profile.py", "--out", str(out), *PROFILE_ARGS]
    command += ["--lanes", *map(str, lanes)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(tree), os.environ.get("PYTHONPATH"))))}
    try:
        done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
        log, error = done.stdout + done.stderr, f"exit status {done.returncode}" if done.returncode else ""
    except subprocess.TimeoutExpired as stopped:
        log, error = _text(stopped.stdout) + _text(stopped.stderr), f"timed out after {timeout} s"
    (out / "profile.log").write_text(log)
    if not error and not report_path.is_file():
        error = "no step_profile.json written"
    if error:
        return {"error": error, "log_tail": log[-LOG_TAIL:]}
    report = json.loads(report_path.read_text())
    if "busy" not in report:
        return {"error": "no busy times in step_profile.json (the tree's step profile predates 1dddce0)"}
    return report


def figures(report: dict[str, object], kernels: list[str]) -> dict[str, object]:
    """A run's row figures from its step_profile.json."""
    busy = report["busy"]
    plain, verify = busy["1 lane"]["ms"], busy["verify"]["ms"]
    return {
        "replay_ms": {str(row["lanes"]): row["replay_ms"] for row in report["rows"]},
        "one_lane_busy_ms": plain,
        "verify_busy_ms": verify,
        "ratio": verify / plain,
        "verify_shares_ms": {k: busy["verify"]["shares_ms"].get(k) for k in kernels},
    }


def table(rows: list[dict[str, object]], lanes: list[int], kernels: list[str]) -> str:
    """The runs as a markdown table, in the order they ran ("—": a kernel not among the verify round's largest
    shares, which step_profile.json keeps)."""
    head = ["tree", "turn", *(f"{n} lanes, replay ms" for n in lanes), "one lane, busy ms", "verify, busy ms", "ratio"]
    head += [f"{k} (verify), ms" for k in kernels]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        if "error" in row:
            last = row.get("log_tail", "").strip().splitlines()[-1:]  # the exception, where one was printed
            cells = [row["tree"], str(row["turn"]), ": ".join([row["error"], *last])] + [""] * (len(head) - 3)
        else:
            cells = [row["tree"], str(row["turn"]), *(f"{row['replay_ms'][str(n)]:.3f}" for n in lanes)]
            cells += [f"{row['one_lane_busy_ms']:.3f}", f"{row['verify_busy_ms']:.3f}", f"{row['ratio']:.3f}"]
            shares = row["verify_shares_ms"]
            cells += ["—" if shares[k] is None else f"{shares[k]:.3f}" for k in kernels]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """0 when every run gave its figures, 1 when one failed, timed out or wrote no report."""
    args = parse_args(argv)
    rows: list[dict[str, object]] = []
    args.out.mkdir(parents=True, exist_ok=True)
    for turn in range(1, args.turns + 1):
        for name, tree in args.trees.items():
            report = profile_run(tree, args.out / f"{name}_{turn}", args.lanes, args.timeout)
            row: dict[str, object] = {"tree": name, "turn": turn}
            row.update(report if "error" in report else figures(report, args.kernels))
            rows.append(row)
            print(json.dumps(row), flush=True)
            (args.out / "ab_round.json").write_text(json.dumps(rows, indent=1))  # kept if a later run is cut off
    print(table(rows, args.lanes, args.kernels), flush=True)
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
