"""GPU check of the captured decode rounds (model/graphs.py) on one GPU: for each lane count, the same prompts and
tokens through the kernel path eagerly and through replayed CUDA graphs must give bit-identical logits and lane
states; then one decode round's time (CUDA events, median of warmed-up rounds) eagerly and replayed.

python3 scripts/gpu_graph_check.py --out DIR [--model PATH]   # DIR/graph_check.json; exit 1 on a mismatch
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_forward_check import fold, prompts, state_diff  # noqa: E402

from model import kernel_path  # noqa: E402
from model.flashnext import FlashNextModel  # noqa: E402
from model.shipped import SHIPPED_MODEL  # noqa: E402
from model.weights import load_model  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for graph_check.json")
    ap.add_argument("--model", type=Path, default=SHIPPED_MODEL, help="checkpoint (default: the shipped model)")
    ap.add_argument("--lanes", default="1,3,8,64", help="lane counts, comma-separated")
    ap.add_argument("--steps", type=int, default=8, help="decode rounds compared per lane count")
    ap.add_argument("--reps", type=int, default=30, help="timed decode rounds (median reported)")
    ap.add_argument("--context", type=int, default=512, help="positions per lane-pool slot")
    return ap.parse_args(argv)


def model_with(path: Path, lanes: int, context: int, graphs: bool) -> FlashNextModel:
    """The kernel path on cuda with a lane pool for `lanes` lanes, and its decode graphs if asked."""
    model = load_model(path, device="cuda", dtype="bfloat16", kernels="on")
    kernel_path.lane_pool(model, slots=lanes, context=context)
    if graphs:
        kernel_path.enable_graphs(model, {"trunk": lanes})
    return model


def round_ms(model: FlashNextModel, lanes: list, reps: int) -> float:
    """Median time of one decode round of every lane (token 3 each), CUDA events."""
    times = []
    for i in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fold(model, [(lane, [3]) for lane in lanes])
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def check(args: argparse.Namespace, count: int) -> dict:
    """Bits and times of `count` lanes, eager against replayed."""
    eager = model_with(args.model, count, args.context, graphs=False)
    graphed = model_with(args.model, count, args.context, graphs=True)
    texts = prompts(count, eager.cfg.vocab_size, seed=count)
    lanes = {name: [m.new_lane() for _ in texts] for name, m in (("eager", eager), ("graphs", graphed))}
    for name, model in (("eager", eager), ("graphs", graphed)):
        for lane, text in zip(lanes[name], texts, strict=True):
            fold(model, [(lane, text)])
    failures, tokens = [], [[1] for _ in texts]
    for step in range(args.steps):
        outs = {
            name: fold(model, [(lane, t[-1:]) for lane, t in zip(lanes[name], tokens, strict=True)])
            for name, model in (("eager", eager), ("graphs", graphed))
        }
        if not torch.equal(outs["eager"].logits, outs["graphs"].logits):
            failures.append(f"{count} lanes, step {step}: logits differ")
        for t, row in zip(tokens, outs["eager"].logits, strict=True):
            t.append(int(row.float().argmax()))
    for i, (a, b) in enumerate(zip(lanes["eager"], lanes["graphs"], strict=True)):
        diff = state_diff(a, b)
        if diff:
            failures.append(f"{count} lanes: lane {i}'s {diff} differs")
    replays = graphed.round_graphs.replays["trunk"]
    if replays < args.steps:  # every decode round replays (and prompts that fit a bucket do too)
        failures.append(f"{count} lanes: {replays} replays for {args.steps} decode rounds")
    return {
        "lanes": count,
        "replays": replays,
        "eager_round_ms": round_ms(eager, lanes["eager"], args.reps),
        "graph_round_ms": round_ms(graphed, lanes["graphs"], args.reps),
        "failures": failures,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for count in (int(x) for x in args.lanes.split(",")):
        row = check(args, count)
        report["rows"].append(row)
        print(json.dumps(row), flush=True)
        (args.out / "graph_check.json").write_text(json.dumps(report, indent=2))
    failures = [f for row in report["rows"] for f in row["failures"]]
    print(f"{len(failures)} failure(s)", *failures, sep="\n  ")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
