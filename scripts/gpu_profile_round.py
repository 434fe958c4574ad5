"""Where one decode round's host time goes on the kernel path: cProfile and torch.profiler over warmed-up rounds.

python3 scripts/gpu_profile_round.py --out DIR [--model PATH] [--lanes 1] [--window 1]   # DIR/profile_round.txt
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import time
from pathlib import Path

import torch

from kernels.host import to_device
from model.layers import ForwardBatch, Segment, batch_from_starts
from model.shipped import SHIPPED_MODEL
from model.weights import load_model


def decode_batch(lanes: list, window: int, vocab: int, rng: random.Random | None = None) -> ForwardBatch:
    """One round: `window` rows for each lane at its next positions; fixed tokens, or `rng`'s draws below vocab; its
    inputs made as the runner makes them (`batch_from_starts`: no wait for the GPU)."""
    device = lanes[0].ngram_history.device
    tokens, segments = [], []
    for i, lane in enumerate(lanes):
        tokens += [rng.randrange(vocab) if rng is not None else (7 * i + 11 * k) % vocab for k in range(window)]
        segments.append(Segment(lane, i * window, window))
    return batch_from_starts(to_device(device, tokens, torch.long), segments, [lane.length for lane in lanes])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", type=Path, default=SHIPPED_MODEL)
    ap.add_argument("--lanes", type=int, default=1)
    ap.add_argument("--window", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    model = load_model(args.model, device="cuda", dtype="bfloat16", kernels="on")
    vocab = model.cfg.vocab_size
    lanes = [model.new_lane() for _ in range(args.lanes)]
    model(decode_batch(lanes, 40, vocab))  # a prompt, so the QSA caches hold blocks

    def rounds(count: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(count):
            model(decode_batch(lanes, args.window, vocab))
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / count

    rounds(5)
    report = io.StringIO()
    report.write(f"round: {rounds(args.rounds) * 1e3:.2f} ms wall ({args.lanes} lanes x {args.window} rows)\n\n")
    prof = cProfile.Profile()
    prof.enable()
    rounds(args.rounds)
    prof.disable()
    pstats.Stats(prof, stream=report).sort_stats("tottime").print_stats(45)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as tp:
        rounds(3)
    report.write(tp.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    report.write("\n")
    report.write(tp.key_averages().table(sort_by="self_cuda_time_total", row_limit=25))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile_round.txt").write_text(report.getvalue())
    print(report.getvalue()[:6000])


if __name__ == "__main__":
    main()
