"""Where a served round's time goes: host phase marks and GPU stream points per round, one JSON line a round
(FLASHNEXT_ROUND_TRACE); with FLASHNEXT_ROUND_PROFILE=LANES also torch.profiler's kernel and host-call tables of the
five rounds after the first of at least LANES lanes; with FLASHNEXT_ROUND_PYPROFILE=LANES Python's own profile (which
functions the round's thread spends its time in) of twenty such rounds, after the torch profile's when both are set."""

from __future__ import annotations

import cProfile
import itertools
import json
import pstats
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def pinned_allocations() -> tuple[int, float]:
    """Blocks the caching host (pinned) allocator has made so far, and the µs it spent making them (0 without CUDA);
    read from the nested statistics: the flat form walks every statistic in Python, between two rounds."""
    stats = getattr(torch.cuda, "host_memory_stats_as_nested_dict", dict)()
    return int(stats.get("num_host_alloc", 0)), float(stats.get("host_alloc_time", {}).get("total", 0.0))


class RoundTrace:
    """Marks the end of each phase of a round and writes the phases' seconds; without a path it keeps nothing.

    On CUDA it also records events on the stream (`gpu_mark`): the GPU's milliseconds between consecutive points of a
    round are written as `gpu`, once the GPU has passed the round's last point: a round's line waits, in order, for a
    later write rather than the host for the GPU (a round launched ahead is still running when its line is made)."""

    PROFILED_ROUNDS = 5
    PY_PROFILED_ROUNDS = 20
    PY_LINES = 40  # functions listed in each of the Python profile's two tables

    def __init__(self, path: Path | None, profile_lanes: int | None = None, pyprofile_lanes: int | None = None) -> None:
        self.path = path
        self.profile_lanes = profile_lanes if path is not None else None  # profile rounds of this many lanes or more
        self.profiler: torch.profiler.profile | None = None
        self.profiled = 0
        self.armed = False  # the last round had enough lanes: profile from the next one
        self.pyprofile_lanes = pyprofile_lanes if path is not None else None  # the same, for Python's profile
        self.pyprofiler: cProfile.Profile | None = None
        self.pyprofiled = 0
        self.py_armed = False
        self.phases: dict[str, float] = {}
        self.fields: dict[str, Any] = {}
        self.events: list[tuple[str, torch.cuda.Event]] = []
        self.unwritten: list[tuple[dict[str, Any], list[tuple[str, torch.cuda.Event]]]] = []  # lines, oldest first
        self.last = time.perf_counter()
        # at the last line's writing (or the first round's start: the server's start-up work is no round's own)
        self.pinned_before: tuple[int, float] | None = None if path is not None else (0, 0.0)

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def start(self) -> None:
        """Begin a round: phases count from now (and, once armed, torch's profiler runs for PROFILED_ROUNDS rounds,
        then Python's for PY_PROFILED_ROUNDS)."""
        if self.armed and self.profiler is None and self.profiled < self.PROFILED_ROUNDS:
            activities = [torch.profiler.ProfilerActivity.CPU]  # the host's calls, the CUDA API's among them
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=activities)
            self.profiler.__enter__()
        elif self._py_due():
            self.pyprofiler = cProfile.Profile()
            self.pyprofiler.enable()
        if self.pinned_before is None:
            self.pinned_before = pinned_allocations()
        self.phases, self.fields, self.events, self.last = {}, {}, [], time.perf_counter()

    def mark(self, phase: str) -> None:
        """The phase named `phase` ends now (a phase marked twice adds up)."""
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self.last
        self.last = now

    def gpu_mark(self, point: str, device: torch.device) -> None:
        """The GPU stream reaches `point` here: the span since the previous point is named after this one."""
        if self.path is None or device.type != "cuda":
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.events.append((point, event))

    @staticmethod
    def gpu_spans(events: list[tuple[str, torch.cuda.Event]]) -> dict[str, float]:
        """Milliseconds of GPU stream time between consecutive points, all passed."""
        return {point: round(begin.elapsed_time(end), 4) for (_, begin), (point, end) in itertools.pairwise(events)}

    def note(self, **fields: Any) -> None:
        """Facts about the round (rows, lanes, which graphs ran), written with its phases."""
        self.fields.update(fields)

    def add_counts(self, name: str, counts: dict[str, int]) -> None:
        """Add counts by key to the round's fact `name` (a dict of counts)."""
        total = self.fields.setdefault(name, {})
        for key, n in counts.items():
            total[key] = total.get(key, 0) + n

    def write(self) -> None:
        """Append the round's line: its facts and each phase's seconds."""
        if self.path is None:
            return
        (blocks, spent), (blocks_before, spent_before) = pinned_allocations(), self.pinned_before
        self.pinned_before = (blocks, spent)  # one read a round: what the next line counts from
        pinned = {
            "pinned_blocks_made": blocks - blocks_before,
            "pinned_alloc_ms": round((spent - spent_before) / 1e3, 4),
        }
        line = {**self.fields, **pinned, "phases": {k: round(v, 6) for k, v in self.phases.items()}}
        self.unwritten.append((line, self.events))
        ready = 0
        for _, events in self.unwritten:
            if events and not events[-1][1].query():  # the GPU has not passed this round's last point yet
                break
            ready += 1
        with self.path.open("a") as out:
            for line, events in self.unwritten[:ready]:
                if len(events) > 1:
                    line["gpu"] = self.gpu_spans(events)
                out.write(json.dumps(line) + "\n")
        del self.unwritten[:ready]
        if self.profile_lanes is not None:
            self._profile_step(self.fields.get("lanes", 0))
        if self.pyprofile_lanes is not None:
            self._pyprofile_step(self.fields.get("lanes", 0))

    def _py_due(self) -> bool:
        """Whether Python's profile starts with this round: armed, not done, the torch profile not running or due."""
        torch_due = self.profile_lanes is not None and self.profiled < self.PROFILED_ROUNDS
        return self.py_armed and self.pyprofiler is None and self.pyprofiled < self.PY_PROFILED_ROUNDS and not torch_due

    def _pyprofile_step(self, lanes: int) -> None:
        """Arm Python's profile on the first round of enough lanes; after PY_PROFILED_ROUNDS rounds write its tables."""
        self.py_armed = self.py_armed or lanes >= self.pyprofile_lanes
        if self.pyprofiler is None:
            return
        self.pyprofiled += 1
        if self.pyprofiled < self.PY_PROFILED_ROUNDS:
            return
        self.pyprofiler.disable()
        stats = pstats.Stats(self.pyprofiler).stats  # (file, line, name) -> (primitive calls, calls, own s, cum s, _)
        rounds = self.PY_PROFILED_ROUNDS

        def busiest(column: int, title: str) -> list[str]:
            """The functions with the most seconds in `column` (2: own, 3: cumulative), per round."""
            top = sorted(stats.items(), key=lambda item: item[1][column], reverse=True)[: self.PY_LINES]
            rows = [
                f"{times[column] * 1e3 / rounds:8.3f} ms {times[1] / rounds:8.1f} calls  {function_name(key)}"
                for key, times in top
            ]
            return [f"{title} per round over {rounds} rounds from the first of {self.pyprofile_lanes}+ lanes:", *rows]

        lines = [*busiest(2, "Python functions by own time"), *busiest(3, "Python functions by cumulative time")]
        self.path.with_suffix(".pyprofile.txt").write_text("\n".join(lines) + "\n")
        self.pyprofiler = None

    def _profile_step(self, lanes: int) -> None:
        """Arm on the first round of enough lanes; after PROFILED_ROUNDS profiled rounds write the kernel table."""
        self.armed = self.armed or lanes >= self.profile_lanes
        if self.profiler is None:
            return
        self.profiled += 1
        if self.profiled < self.PROFILED_ROUNDS:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.profiler.__exit__(None, None, None)
        averages, rounds = self.profiler.key_averages(), self.PROFILED_ROUNDS

        def busiest(time_of: Callable[[Any], float], top: int) -> list[str]:
            """The `top` entries with the most time by `time_of` (µs over the rounds), each per round."""
            busy = sorted((e for e in averages if time_of(e) > 0), key=time_of, reverse=True)[:top]
            return [f"{time_of(e) / 1e3 / rounds:8.3f} ms {e.count / rounds:7.1f} calls  {e.key[:100]}" for e in busy]

        lines = [
            f"kernels per round over {rounds} rounds from the first of {self.profile_lanes}+ lanes:",
            *busiest(lambda e: getattr(e, "self_device_time_total", 0), 40),
            f"host calls per round by self time (CUDA API calls among them), over the same {rounds} rounds:",
            *busiest(lambda e: e.self_cpu_time_total, 30),
        ]
        self.path.with_suffix(".profile.txt").write_text("\n".join(lines) + "\n")
        self.profiler = None


def function_name(key: tuple[str, int, str]) -> str:
    """A profiled function as `dir/file.py:line(name)` (built-ins as cProfile names them)."""
    path, line, name = key
    if path == "~":
        return name
    return f"{'/'.join(Path(path).parts[-2:])}:{line}({name})"
