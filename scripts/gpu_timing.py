"""Timing for the GPU check scripts: the median per-call time of calls replayed from one CUDA graph, wall time for
CPU smoke runs, and the launches of chosen Triton kernels kept to be replayed one kernel at a time."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from types import ModuleType
from typing import Any
from unittest import mock

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


def wall_us(calls: Sequence[Callable[[], object]]) -> float:
    """Wall-clock µs of one call, each call run once (a CPU smoke run's stand-in for graph_median_us)."""
    start = time.perf_counter()
    for fn in calls:
        fn()
    return (time.perf_counter() - start) * 1e6 / len(calls)


class _Recorder:
    """Stands in for a Triton kernel: each launch runs and is also kept, to be replayed alone."""

    def __init__(self, kernel: Any, kept: list[Callable[[], object]]) -> None:
        self.kernel, self.kept = kernel, kept

    def __getattr__(self, name: str) -> object:
        """The kernel's own attributes (its argument names, for launch options)."""
        if name == "kernel":  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.kernel, name)

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., object]:
        def run(*args: object, **kwargs: object) -> object:
            self.kept.append(lambda: self.kernel[grid](*args, **kwargs))
            return self.kernel[grid](*args, **kwargs)

        return run


@contextmanager
def recording(kernels: Mapping[str, tuple[ModuleType, str]]) -> Iterator[dict[str, list[Callable[[], object]]]]:
    """Within: every launch of each kernel (name: its module and attribute) is kept, per name, as a call replaying
    it."""
    kept: dict[str, list[Callable[[], object]]] = {name: [] for name in kernels}
    with ExitStack() as stack:
        for name, (module, attr) in kernels.items():
            stack.enter_context(mock.patch.object(module, attr, _Recorder(getattr(module, attr), kept[name])))
        yield kept
