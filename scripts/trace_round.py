"""Where a replayed round's time goes, from the Chrome trace of `gpu_step_profile.py --chrome-trace`: each graph
replay's span and kernels; the kernels by the time they close (`closing`: each stretch between one kernel's end and
the next one's is given to the later, so a chain's kernel gets what it adds after the one before it under PDL's
overlap, and the stretches add up to the span; a side stream's kernel that ends inside a main-stream launch takes
that launch's stretch up to its end); the linear kernel's launches by grid (launches a round, median µs a launch);
and each QSA layer's join, from the end of the last linear launch before its attention (the fused projection, where
the index path forks) to the attention's start: the index path's stream (the one that runs the `_index_*` kernels)
against the other kernels of that window, and how long the attention waits for the index path after the others end.
The MoE: each grouped gate-up launch's duration by whether another stream's kernel that started before it was
still running at its start (`start_overlaps`), and each one-row layer's chain (`pair_chains`: the router's launch,
the gate-up pairs and the down pairs kernels, and when each of the two starts against the end of the one before).
With `--chain START NAME...` (repeatable): the medians over every START launch of when each NAME's first launch
after it ends, µs from START's end (`chain_ends`; a kernel as NAME or NAME[x,y,z], its grid).

python3 scripts/trace_round.py DIR/step_trace.json.gz   # or step_trace_N.json.gz (the most lanes'), step_trace_verify
    [--chain _up_mix_kernel '_linear_kernel[1,32,4]' _router_kernel _plan_kernel _gate_up_kernel]
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import statistics
from collections import Counter, defaultdict
from pathlib import Path

LINEAR, ATTENTION, INDEX = "_linear_kernel", "_attn_chunk_kernel", "_index_"
GATE_UP, UP_MIX = "_gate_up_kernel", "_up_mix_"
PAIRS_GATE_UP, PAIRS_DOWN = "_gate_up_pairs_kernel", "_down_pairs_kernel"


def replays(events: list[dict]) -> list[list[dict]]:
    """The kernels of each `cudaGraphLaunch` (matched by correlation id), in start order, replays in time order."""
    launches = sorted((e for e in events if e.get("name") == "cudaGraphLaunch"), key=lambda e: e["ts"])
    by_launch: dict[int, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "kernel":
            by_launch[e["args"]["correlation"]].append(e)
    return [sorted(by_launch[g["args"]["correlation"]], key=lambda e: e["ts"]) for g in launches]


def end(kernel: dict) -> float:
    """A kernel's end, µs."""
    return kernel["ts"] + kernel["dur"]


def closing(rounds: list[list[dict]], top: int) -> list[tuple[str, tuple[int, ...], float, float]]:
    """(kernel, grid, launches a round, median µs a round it closes) of the `top` that close the most, most first."""
    shares: dict[tuple[str, tuple[int, ...]], list[tuple[float, int]]] = defaultdict(list)
    for kernels in rounds:
        at, closed, launches = kernels[0]["ts"], Counter(), Counter()
        for k in sorted(kernels, key=end):
            key = k["name"], tuple(k["args"]["grid"])
            closed[key] += end(k) - at
            launches[key] += 1
            at = end(k)
        for key, us in closed.items():
            shares[key].append((us, launches[key]))
    rows = [(name, grid, statistics.median(n for _, n in v), statistics.median(t for t, _ in v))
            for (name, grid), v in shares.items()]  # fmt: skip
    return sorted(rows, key=lambda row: -row[3])[:top]


def linear_by_grid(rounds: list[list[dict]]) -> list[tuple[tuple[int, ...], float, float]]:
    """(grid, launches a round, median µs a launch) of the linear kernel, most time first."""
    durations: dict[tuple[int, ...], list[float]] = defaultdict(list)
    for kernels in rounds:
        for k in kernels:
            if k["name"] == LINEAR:
                durations[tuple(k["args"]["grid"])].append(k["dur"])
    rows = [(grid, len(d) / len(rounds), statistics.median(d)) for grid, d in durations.items()]
    return sorted(rows, key=lambda row: -row[1] * row[2])


def qsa_joins(kernels: list[dict]) -> list[dict[str, float]]:
    """One round's QSA windows: µs from the fork (the last linear launch's end before an attention) to the end of the
    index path's stream (`index`) and of the window's other kernels (`other`), and `wait` = index - other."""
    joins = []
    for i, k in enumerate(kernels):
        if k["name"] != ATTENTION:
            continue
        fork = max((j for j in range(i) if kernels[j]["name"] == LINEAR), default=None)
        window = kernels[fork + 1 : i] if fork is not None else []
        streams = {w["args"]["stream"] for w in window if w["name"].startswith(INDEX)}
        if len(streams) != 1:
            continue
        index = [w for w in window if w["args"]["stream"] in streams]
        other = [w for w in window if w["args"]["stream"] not in streams]
        if not other:
            continue
        at = end(kernels[fork])
        ends = {"index": max(map(end, index)) - at, "other": max(map(end, other)) - at}
        joins.append({**ends, "wait": ends["index"] - ends["other"]})
    return joins


def start_overlaps(kernels: list[dict], name: str) -> list[tuple[float, float]]:
    """(µs by which the kernels of other streams that started before it run past its start, negative when they all
    end before; its duration) of each `name` launch in one round."""
    pairs = []
    for i, k in enumerate(kernels):
        others = [end(j) for j in kernels[:i] if j["args"]["stream"] != k["args"]["stream"]]
        if k["name"] == name and others:
            pairs.append((max(others) - k["ts"], k["dur"]))
    return pairs


def pair_chains(kernels: list[dict]) -> list[dict[str, float]]:
    """One round's one-row MoE layers, µs: from the router's launch (the last linear launch before the gate-up pairs
    kernel on the stream of the up kernel before it: the gate-up may replay on the shared expert's stream, which it
    joins) to the gate-up's end (`gate_up`), from there to the down pairs kernel's end (`down`), and from the up
    kernel's end to that (`layer`); and when the gate-up and the down start after the end of the kernel before each
    (`gate_up_start`, `down_start`: negative where PDL let them start earlier)."""
    chains = []
    for i, k in enumerate(kernels):
        if k["name"] != PAIRS_GATE_UP:
            continue
        up_at = next((j for j in range(i - 1, -1, -1) if kernels[j]["name"].startswith(UP_MIX)), None)
        if up_at is None:
            continue
        up = kernels[up_at]
        same = [j for j in kernels[up_at + 1 : i] if j["args"]["stream"] == up["args"]["stream"]]
        router = next((j for j in reversed(same) if j["name"] == LINEAR), None)
        down = next((j for j in kernels[i + 1 :] if j["name"] == PAIRS_DOWN), None)
        if router is None or down is None:
            continue
        chains.append({
            "gate_up": end(k) - end(router), "down": end(down) - end(k), "layer": end(down) - end(up),
            "gate_up_start": k["ts"] - end(router), "down_start": down["ts"] - end(k),
        })  # fmt: skip
    return chains


def kernel_spec(spec: str) -> tuple[str, tuple[int, ...] | None]:
    """`NAME` or `NAME[x,y,z]` (a launch grid) -> (name, grid or None)."""
    name, _, grid = spec.partition("[")
    return name, tuple(int(g) for g in grid.rstrip("]").split(",")) if grid else None


def matches(kernel: dict, spec: tuple[str, tuple[int, ...] | None]) -> bool:
    """Whether a kernel has the spec's name and, when the spec gives one, its grid."""
    return kernel["name"] == spec[0] and (spec[1] is None or tuple(kernel["args"]["grid"]) == spec[1])


def chain_ends(kernels: list[dict], start: str, names: list[str]) -> list[dict[str, float]]:
    """One round's chains from each `start` launch: µs from its end to the end of the first launch of each of `names`
    (specs as `kernel_spec` reads them) that starts after it; only chains with every name before `start`'s next
    launch."""
    first = kernel_spec(start)
    specs = [kernel_spec(n) for n in names]
    at = [i for i, k in enumerate(kernels) if matches(k, first)] + [len(kernels)]
    chains = []
    for i, stop in itertools.pairwise(at):
        window = kernels[i + 1 : stop]
        ends = [next((end(k) - end(kernels[i]) for k in window if matches(k, spec)), None) for spec in specs]
        if None not in ends:
            chains.append(dict(zip(names, ends, strict=True)))
    return chains


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=Path, help="step_trace.json.gz (or an uncompressed .json)")
    ap.add_argument("--top", type=int, default=20, help="kernels listed by the time they close (default 20)")
    ap.add_argument("--chain", nargs="+", action="append", default=[], metavar="KERNEL",
                    help="START NAME...: medians of when each NAME ends after START's end (KERNEL: name or "
                         "name[x,y,z]); repeatable")  # fmt: skip
    args = ap.parse_args(argv)
    raw = args.trace.read_bytes()
    events = json.loads(gzip.decompress(raw) if args.trace.suffix == ".gz" else raw)["traceEvents"]
    rounds = [r for r in replays(events) if r]
    if not rounds:
        raise SystemExit(f"{args.trace}: no graph replay with kernels")
    spans = [end(r[-1]) - r[0]["ts"] for r in rounds]
    print(f"{len(rounds)} replays: span {statistics.median(spans):.1f} µs (median), "
          f"{statistics.median(len(r) for r in rounds):.0f} kernels each")  # fmt: skip
    print(f"kernels by the time they close, the {args.top} most: launches a round, median µs a round")
    for name, grid, launches, us in closing(rounds, args.top):
        print(f"  {us:8.1f} {launches:6.0f}  {name[:48]} {list(grid)}")
    print("linear kernel by grid: launches a round, median µs a launch")
    for grid, launches, median in linear_by_grid(rounds):
        print(f"  {list(grid)!s:16s} {launches:6.1f} {median:8.2f}")
    joins = [j for r in rounds for j in qsa_joins(r)]
    if joins:
        med = {key: statistics.median(j[key] for j in joins) for key in ("index", "other", "wait")}
        waited, per_round = sum(j["wait"] > 0 for j in joins), med["wait"] * len(joins) / len(rounds)
        print(f"QSA joins: {len(joins) / len(rounds):.0f} a round; from the fork, medians: index path "
              f"{med['index']:.2f} µs, the rest {med['other']:.2f} µs; the attention waits {med['wait']:.2f} µs "
              f"({waited} of {len(joins)} windows wait), {per_round:.1f} µs a round")  # fmt: skip
    overlaps = [o for r in rounds for o in start_overlaps(r, GATE_UP)]
    if overlaps:
        after = [dur for past, dur in overlaps if past > 0]
        before = [dur for past, dur in overlaps if past <= 0]
        print(f"grouped gate-up: {len(overlaps)} launches; other streams' earlier kernels end "
              f"{statistics.median(p for p, _ in overlaps):.2f} µs after its start (median; "
              f"{min(p for p, _ in overlaps):.2f} to {max(p for p, _ in overlaps):.2f}); its median µs when they "
              f"end before it starts: {statistics.median(before) if before else float('nan'):.2f} ({len(before)}), "
              f"after: {statistics.median(after) if after else float('nan'):.2f} ({len(after)})")  # fmt: skip
    chains = [c for r in rounds for c in pair_chains(r)]
    if chains:
        med = {key: statistics.median(c[key] for c in chains) for key in chains[0]}
        print(f"one-row MoE: {len(chains)} layers; medians: the gate-up pairs kernel ends {med['gate_up']:.2f} µs "
              f"after the router's launch, the down pairs kernel {med['down']:.2f} µs after it; "
              f"{med['layer']:.2f} µs from the up kernel's end; the gate-up starts {med['gate_up_start']:.2f} µs "
              f"after the router's end, the down {med['down_start']:.2f} µs after the gate-up's")  # fmt: skip
    for start, *names in args.chain:
        found = [c for r in rounds for c in chain_ends(r, start, names)]
        medians = ", ".join(f"{n} {statistics.median(c[n] for c in found):.2f}" for n in names) if found else "none"
        print(f"chain from {start}'s end, {len(found)} launches, medians µs: {medians}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
