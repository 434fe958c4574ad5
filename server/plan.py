"""One round's plan: the lane operations and rows every rank executes, in one plain dataclass."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class DrawSpec:
    """How a lane's next token is drawn (temperature 0 is greedy)."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int


@dataclass(frozen=True, slots=True)
class LaneRows:
    """A lane's rows this round: tokens from absolute position `start`; draw after the last row if `draw` is set."""

    slot: int
    token_ids: tuple[int, ...]
    start: int
    draw: DrawSpec | None


@dataclass(frozen=True, slots=True)
class RoundPlan:
    """Reset (`allocate`) or release (`free`) lane slots, then run the rows as one forward."""

    allocate: tuple[int, ...] = ()
    free: tuple[int, ...] = ()
    rows: tuple[LaneRows, ...] = field(default_factory=tuple)
