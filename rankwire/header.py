"""The round header: what rank 0 tells every rank to do in one round, as plain dataclasses (codec in codec.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum


class RoundKind(IntEnum):
    """What a header asks for."""

    ROUND = 1  # run the lane operations and the rows
    STOP = 2  # shut down cleanly


class LaneOpCode(IntEnum):
    """Lane operations beyond allocate and free: the prompt cache keeps a lane's state under a handle, restores a
    kept state into a lane, and drops a kept state (the slot is unused)."""

    KEEP = 1
    RESTORE = 2
    DROP = 3


@dataclass(frozen=True, slots=True)
class DrawSpec:
    """How a lane's next token is drawn (temperature 0 is greedy), after its logit bias is added to the logits."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs, each id once
    logprobs: int | None = None  # with each drawn token, its raw log-probability and that many of the most likely
    suppress_ids: tuple[int, ...] = ()  # ids a draw at an absolute position before `suppress_before` cannot take
    suppress_before: int = 0  # (a request's min_tokens: its stop tokens wait until it has that many)
    repetition_penalty: float = 1.0  # divides a positive logit, multiplies a negative one, of every id folded before
    frequency_penalty: float = 0.0  # times how often an id occurs from `output_from` on, taken from its logit
    presence_penalty: float = 0.0  # taken from the logit of each id that occurs from `output_from` on
    output_from: int = 0  # the absolute position of the request's first output token
    allowed_ids: tuple[int, ...] = ()  # the only ids it may draw, each once (none: any)

    @property
    def penalties(self) -> tuple[float, float, float]:
        """(repetition, frequency, presence) penalties."""
        return self.repetition_penalty, self.frequency_penalty, self.presence_penalty

    @property
    def penalized(self) -> bool:
        """Whether its draws depend on the ids the lane folded before them (the penalties)."""
        return self.penalties != (1.0, 0.0, 0.0)


@dataclass(frozen=True, slots=True)
class LaneRows:
    """A lane's rows this round: tokens from absolute position `start`, then the drafts to verify; draw after them
    if `draw` is set, and chain `draft_depth` new MTP drafts for the next round. With `prior_draw` the one row's
    token is the lane's draw of the round before, which this plan was made without: each rank takes it from its own
    draws (`token_ids` holds a 0 in its place). With `prompt_logprobs` (how many most likely ids to take with each
    prompt token's logprob) every token row gives its logits (a prompt
    pass whose request asked for the prompt's logprobs). With `guide_masks` (a guided request's rows) each draw row
    may take only the ids its mask allows: one bitmask a draw row, bit i of byte i // 8 (lowest bit first) set for
    an allowed id i."""

    slot: int
    token_ids: tuple[int, ...]
    start: int
    draw: DrawSpec | None
    drafts: tuple[int, ...] = ()
    draft_depth: int = 0
    prior_draw: bool = False
    prompt_logprobs: int | None = None
    guide_masks: tuple[bytes, ...] = ()


@dataclass(frozen=True, slots=True)
class LaneOp:
    """A lane operation with one integer argument (e.g. keep the state of `slot` under handle `arg`), applied before
    the round's rows, or for a KEEP `after` that many of the slot's rows this round (a prompt pass need not stop
    where a state is kept)."""

    code: LaneOpCode
    slot: int
    arg: int
    after: int = 0


@dataclass(frozen=True, slots=True)
class RoundPlan:
    """Reset (`allocate`) or release (`free`) lane slots, apply `ops`, then run the rows as one forward."""

    kind: RoundKind = RoundKind.ROUND
    allocate: tuple[int, ...] = ()
    free: tuple[int, ...] = ()
    rows: tuple[LaneRows, ...] = field(default_factory=tuple)
    ops: tuple[LaneOp, ...] = ()
