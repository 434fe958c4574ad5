"""Prompt rounds at the real shapes on one GPU, as rank 0 of tp=2 alone (dummy weights, collectives skipped): each
case's prompt pass (asking for its last row's logits, as a served prompt round does) must replay the prompt graph
and give the eager forward's logits, lane states and kept states bit for bit; then a prompt round's wall time
(synchronised, median) replayed and eager, with and without kept rows, and through a trunk graph (the prompt-pass
GDN kernels left out). It reports the memory the capture took (the buckets the server captures at 64 lanes and 3
drafts, 1,024 prompt rows a round).

python3 scripts/gpu_prompt_graphs.py --out DIR [--rows 1024] [--model PATH]   # DIR/prompt_graphs.json; exit 1 on a
                                                                                # mismatch
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]

from gpu_step_profile import collectives_skipped  # noqa: E402

from kernels.gdn_chunk import CHUNK  # noqa: E402
from model import kernel_path  # noqa: E402
from model.flashnext import FlashNextModel, single_lane_batch  # noqa: E402
from model.parallel import TensorParallel  # noqa: E402
from model.state import LaneState  # noqa: E402
from model.weights import load_model  # noqa: E402

# rows, kept rows: chunk ends (GDN's chunked form keeps states only there) and rows after a prompt's last whole chunk
CASES = ((1024, (511, 959)), (1000, ()), (700, (63, 255, 511, 639, 698)))
VOCAB = 120_000  # prompt tokens are drawn below this
REPS = 5
WINDOWS = 64 * 4  # the server's listed logits at 64 lanes and 3 drafts (its verify graphs stop at 64 rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for prompt_graphs.json")
    ap.add_argument("--model", type=Path, default=ROOT / "configs/qwen3.8-flash-next", help="config folder")
    ap.add_argument("--rows", type=int, default=1024, help="rows of the timed prompt round (default 1024)")
    ap.add_argument("--round-rows", type=int, default=1280, help="the largest trunk and prompt bucket (default 1280)")
    args = ap.parse_args(argv)
    if not 4 <= args.rows <= args.round_rows:
        ap.error(f"--rows: {args.rows} is outside [4, --round-rows {args.round_rows}]")
    return args


def lane_bits(lane: LaneState) -> list[torch.Tensor]:
    """Copies of a lane's GDN recurrent states and conv tails."""
    return [t.clone() for group in (lane.gdn_recurrent, lane.gdn_conv) for t in group.values()]


def prompt_pass(model: FlashNextModel, prompt: torch.Tensor, keep: tuple[int, ...]) -> dict[str, object]:
    """One lane's prompt pass from position 0: its logits, lane states, kept states, and the graphs it replayed."""
    graphs = model.round_graphs
    before = {} if graphs is None else dict(graphs.replays)
    lane = model.new_lane()
    last = torch.tensor([prompt.shape[0] - 1], device=prompt.device)  # a prompt round's draw: its last row's logits
    out = model(single_lane_batch(lane, prompt, 0), logit_rows=last, snapshot_rows={0: keep} if keep else None)
    replays = {} if graphs is None else {k: n - before[k] for k, n in graphs.replays.items() if n != before[k]}
    kept = [lane_bits(out.snapshots[0][row]) for row in keep]
    return {"logits": out.logits.clone(), "lane": lane_bits(lane), "kept": kept, "replays": replays}


def all_equal(a: list, b: list) -> bool:
    """Whether two (nested) lists of tensors are equal bit for bit."""
    return len(a) == len(b) and all(
        all_equal(x, y) if isinstance(x, list) else torch.equal(x, y) for x, y in zip(a, b, strict=True)
    )


def memory_gib() -> dict[str, float]:
    """GiB the process's tensors hold, its allocator reserves, and the GPU has in use."""
    free, total = torch.cuda.mem_get_info()
    gib = 2**30
    return {
        "allocated": torch.cuda.memory_allocated() / gib,
        "reserved": torch.cuda.memory_reserved() / gib,
        "in_use": (total - free) / gib,
    }


def median_ms(step: Callable[[], object]) -> float:
    """Median wall ms of REPS synchronised calls after two warm-up calls."""
    times = []
    for i in range(REPS + 2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        if i >= 2:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rng = random.Random(0)
    with collectives_skipped():
        model = load_model(
            args.model, device=torch.device("cuda", 0), dtype="bfloat16", tp=TensorParallel(0, 2),
            load_format="dummy", kernels="on",
        )  # fmt: skip
        kernel_path.lane_pool(model, slots=2 * len(CASES), context=args.round_rows)
        started, before = time.monotonic(), memory_gib()
        rows = {"trunk": args.round_rows, "verify": 64, "prompt": args.round_rows, "mtp": args.round_rows}
        graphs = kernel_path.enable_graphs(model, rows, WINDOWS)  # as the server captures them for 64 lanes, 3 drafts
        took, after = time.monotonic() - started, memory_gib()
        memory = {k: round(after[k] - before[k], 3) for k in before} | {
            "shared_outputs": graphs.shared.nbytes() / 2**30
        }
        print(f"capture {took:.1f} s, GiB taken: {memory}", flush=True)
        report: dict[str, object] = {
            "buckets": dict(graphs.buckets),
            "capture_s": took,
            "capture_gib": memory,
            "cases": [],
        }
        failures = 0
        for rows_, keep in CASES:
            prompt = torch.tensor([rng.randrange(VOCAB) for _ in range(rows_)], device="cuda")
            replayed = prompt_pass(model, prompt, keep)
            model.round_graphs = None
            eager = prompt_pass(model, prompt, keep)
            model.round_graphs = graphs
            same = {part: all_equal([replayed[part]], [eager[part]]) for part in ("logits", "lane", "kept")}
            failures += not all(same.values()) or replayed["replays"] != {"prompt": 1}
            case = {"rows": rows_, "keep": keep, "replays": replayed["replays"], "equal": same}
            report["cases"].append(case)
            print(json.dumps(case), flush=True)
        lane = model.new_lane()
        prompt = torch.tensor([rng.randrange(VOCAB) for _ in range(args.rows)], device="cuda")
        keep = (args.rows // 2 - 1, (args.rows - 1) // CHUNK * CHUNK - 1)  # the server's: its grid's, before the end
        last = torch.tensor([args.rows - 1], device="cuda")

        def round_of(kept: tuple[int, ...]) -> Callable[[], object]:
            def step() -> None:
                lane.length = 0  # the pass starts again at position 0 (states carry on: timing only)
                for cache in lane.attention.values():
                    cache.length = 0
                model(single_lane_batch(lane, prompt, 0), logit_rows=last, snapshot_rows={0: kept} if kept else None)

            return step

        timings, unreplayed = {}, []
        for label, kind, kept in (
            ("prompt graph, 2 kept", "prompt", keep),
            ("eager, 2 kept", None, keep),
            ("prompt graph", "prompt", ()),
            ("eager", None, ()),
            ("trunk graph", "trunk", ()),
        ):
            model.round_graphs = None if kind is None else graphs
            if kind == "trunk":
                graphs.buckets["prompt"] = ()  # a trunk graph only: GDN's decode kernels over the prompt's rows
            before = dict(graphs.replays)
            timings[label] = median_ms(round_of(kept))
            if kind is not None and graphs.replays[kind] == before[kind]:
                unreplayed.append(label)  # timed something other than what it says
        model.round_graphs = graphs
        for label, ms in timings.items():
            print(f"{args.rows} rows, {label:22s} {ms:8.2f} ms", flush=True)
        report |= {"rows": args.rows, "wall_ms": timings, "failures": failures, "not_replayed": unreplayed}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prompt_graphs.json").write_text(json.dumps(report, indent=2))
    print(f"{failures} of {len(CASES)} cases differ; timings that replayed no graph of their kind: {unreplayed}")
    return 1 if failures or unreplayed else 0


if __name__ == "__main__":
    sys.exit(main())
