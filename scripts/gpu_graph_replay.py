"""Host time of one CUDA-graph launch (`CUDAGraph.replay()`) of the shipped model's one-row trunk graph, by what
the GPU is doing when it is called: idle, running that same graph, still queued behind a sleep kernel with that same
graph, running another graph, or running a sleep kernel. Tests whether launching an exec still in flight blocks the
host (the suspect for rounds planned ahead being slower, docs/performance.md).

python3 scripts/gpu_graph_replay.py [--reps 50] [--sleep-cycles 2000000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent.parent)]

from model import kernel_path  # noqa: E402
from model.shipped import SHIPPED_MODEL  # noqa: E402
from model.weights import load_model  # noqa: E402


def launch_us(before: Callable[[], None], launch: Callable[[], None], reps: int) -> tuple[float, float]:
    """Median and 90th-percentile µs of `launch()` on the host, each time after `before()` on an idle GPU."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        before()
        start = time.perf_counter()
        launch()
        times.append((time.perf_counter() - start) * 1e6)
        torch.cuda.synchronize()
    times.sort()
    return statistics.median(times), times[int(0.9 * (len(times) - 1))]


def gpu_ms(launch: Callable[[], None], reps: int) -> float:
    """Median GPU ms of `launch()` alone, by CUDA events."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=SHIPPED_MODEL)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--sleep-cycles", type=int, default=2_000_000, help="torch.cuda._sleep's length (about 1 ms)")
    args = ap.parse_args()
    model = load_model(args.model, device="cuda", dtype="bfloat16", kernels="on")
    graphs = kernel_path.enable_graphs(model, {"trunk": 4})
    one, two = graphs.graphs["trunk", 1], graphs.graphs["trunk", 2]
    for _ in range(5):  # warm
        one.replay()
        two.replay()
    torch.cuda.synchronize()

    def sleep() -> None:
        torch.cuda._sleep(args.sleep_cycles)

    def nothing() -> None:
        pass

    def sleep_then_one() -> None:
        sleep()
        one.replay()

    print(f"trunk 1 replay: {gpu_ms(one.replay, args.reps):.3f} ms GPU; sleep: {gpu_ms(sleep, args.reps):.3f} ms GPU")
    cases = {
        "GPU idle": nothing,
        "same exec running": one.replay,
        "same exec queued behind a sleep": sleep_then_one,
        "other exec (trunk 2) running": two.replay,
        "sleep kernel running": sleep,
    }
    for label, before in cases.items():
        median, p90 = launch_us(before, one.replay, args.reps)
        print(f"launch of trunk 1, {label:34s} median {median:8.1f} us  p90 {p90:8.1f} us", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
