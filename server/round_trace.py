"""Where a served round's time goes: host phase marks and GPU stream points per round, one JSON line a round
(FLASHNEXT_ROUND_TRACE)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch


class RoundTrace:
    """Marks the end of each phase of a round and writes the phases' seconds; without a path it keeps nothing.

    On CUDA it also records events on the stream (`gpu_mark`): the GPU's milliseconds between consecutive points of a
    round are written as `gpu`, read once the round's work is done (its draw already waited for the GPU)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.phases: dict[str, float] = {}
        self.fields: dict[str, Any] = {}
        self.events: list[tuple[str, torch.cuda.Event]] = []
        self.last = time.perf_counter()

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def start(self) -> None:
        """Begin a round: phases count from now."""
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

    def gpu_spans(self) -> dict[str, float]:
        """Milliseconds of GPU stream time between consecutive points (waits for the last point)."""
        if len(self.events) < 2:
            return {}
        self.events[-1][1].synchronize()
        pairs = zip(self.events, self.events[1:], strict=False)
        return {point: round(begin.elapsed_time(end), 4) for (_, begin), (point, end) in pairs}

    def note(self, **fields: Any) -> None:
        """Facts about the round (rows, lanes, which graphs ran), written with its phases."""
        self.fields.update(fields)

    def write(self) -> None:
        """Append the round's line: its facts and each phase's seconds."""
        if self.path is None:
            return
        line = {**self.fields, "phases": {k: round(v, 6) for k, v in self.phases.items()}}
        if self.events:
            line["gpu"] = self.gpu_spans()
        with self.path.open("a") as out:
            out.write(json.dumps(line) + "\n")
