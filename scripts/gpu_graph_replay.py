"""Host time of one CUDA-graph launch (`CUDAGraph.replay()`) of a model's one-row trunk graph, by what the GPU is
doing when it is called: idle, running that same graph, still queued behind a sleep kernel with that same graph,
running another graph, or running a sleep kernel. Tests whether launching an exec still in flight blocks the host
(the suspect for rounds planned ahead being slower, docs/performance.md). Then the GPU's span from an event recorded
just before the launch to one after it, launched on an idle GPU against queued behind a sleep: how long the launch
keeps the GPU from starting the graph.

python3 scripts/gpu_graph_replay.py [--reps 50] [--sleep-cycles 2000000]            # the shipped model
python3 scripts/gpu_graph_replay.py --model configs/qwen3.8-flash-next --alone-as 2  # rank 0's half, dummy weights
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "scripts"), str(ROOT)]

from gpu_step_profile import collectives_skipped  # noqa: E402

from model import kernel_path  # noqa: E402
from model.graphs import RoundGraphs  # noqa: E402
from model.parallel import TensorParallel  # noqa: E402
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


def span_ms(before: Callable[[], None], launch: Callable[[], None], reps: int) -> float:
    """Median GPU ms from an event recorded after `before()` and just before `launch()` to one just after it."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        before()
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
    ap.add_argument("--alone-as", type=int, default=1, help="load rank 0's share of this world, collectives skipped")
    args = ap.parse_args()
    with collectives_skipped():
        model = load_model(
            args.model, device="cuda", dtype="bfloat16", kernels="on", tp=TensorParallel(0, args.alone_as),
            load_format="dummy" if args.alone_as > 1 else "auto",
        )  # fmt: skip
        graphs = kernel_path.enable_graphs(model, {"trunk": 4})
        measure(graphs, args)
    return 0


def measure(graphs: RoundGraphs, args: argparse.Namespace) -> None:
    """Print the launch's host µs by case, then the GPU spans."""
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

    replay_ms, sleep_ms = span_ms(nothing, one.replay, args.reps), span_ms(nothing, sleep, args.reps)
    print(f"trunk 1 replay: {replay_ms:.3f} ms GPU; sleep: {sleep_ms:.3f} ms GPU")
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
    idle, queued = span_ms(nothing, one.replay, args.reps), span_ms(sleep, one.replay, args.reps)
    print(f"GPU span of trunk 1's launch: on an idle GPU {idle:.3f} ms, queued behind a sleep {queued:.3f} ms")


if __name__ == "__main__":
    raise SystemExit(main())
