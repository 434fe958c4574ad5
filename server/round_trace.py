"""Where a served round's host time goes: phase marks per round, one JSON line a round (FLASHNEXT_ROUND_TRACE)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


class RoundTrace:
    """Marks the end of each phase of a round and writes the phases' seconds; without a path it keeps nothing."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.phases: dict[str, float] = {}
        self.fields: dict[str, Any] = {}
        self.last = time.perf_counter()

    @property
    def enabled(self) -> bool:
        return self.path is not None

    def start(self) -> None:
        """Begin a round: phases count from now."""
        self.phases, self.fields, self.last = {}, {}, time.perf_counter()

    def mark(self, phase: str) -> None:
        """The phase named `phase` ends now (a phase marked twice adds up)."""
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self.last
        self.last = now

    def note(self, **fields: Any) -> None:
        """Facts about the round (rows, lanes, which graphs ran), written with its phases."""
        self.fields.update(fields)

    def write(self) -> None:
        """Append the round's line: its facts and each phase's seconds."""
        if self.path is None:
            return
        line = {**self.fields, "phases": {k: round(v, 6) for k, v in self.phases.items()}}
        with self.path.open("a") as out:
            out.write(json.dumps(line) + "\n")
