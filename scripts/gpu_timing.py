"""Timing for the GPU check scripts: the median per-call time of calls replayed from one CUDA graph."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence

import torch

WARM_REPLAYS = 3


def graph_median_us(calls: Sequence[Callable[[], object]], captured: int, replays: int) -> float:
    """Median µs per call: each callable warmed once on a side stream, `captured` calls cycling through `calls` in
    one graph (a graph's own launch cost is spread over them, as in a server's step graph), `replays` timed replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(captured):
            calls[i % len(calls)]()
    for _ in range(WARM_REPLAYS):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / captured)
    return statistics.median(times)
