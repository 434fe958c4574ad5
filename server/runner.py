"""The model runner: owns the weights and the lane slots, executes round plans, draws the tokens."""

from __future__ import annotations

import torch

from model.flashnext import FlashNextModel
from model.layers import ForwardBatch, Segment
from model.state import LaneState
from rankwire.header import RoundPlan
from server.sampling import sample_token


class RoundRefused(RuntimeError):
    """A rank found a round plan it cannot run; every rank refuses it before any collective."""


class ModelRunner:
    """Executes a RoundPlan on this rank's model; every rank given the same plan draws the same tokens."""

    def __init__(self, model: FlashNextModel, max_lanes: int) -> None:
        self.model = model
        self.slots: list[LaneState | None] = [None] * max_lanes

    @property
    def max_lanes(self) -> int:
        return len(self.slots)

    def _problem(self, plan: RoundPlan) -> str | None:
        """Why this rank cannot run the plan (after its lane operations), or None."""
        for rows in plan.rows:
            if not 0 <= rows.slot < len(self.slots) or self.slots[rows.slot] is None:
                return f"round plan uses lane slot {rows.slot}, which is not allocated"
            if rows.start != self.slots[rows.slot].length:
                return f"lane {rows.slot} holds {self.slots[rows.slot].length} tokens, the plan writes at {rows.start}"
        return None

    def _agree(self, problem: str | None) -> None:
        """The agreement gate: all ranks learn whether any rank refuses the round, before its collectives."""
        tp = self.model.tp
        if tp.world == 1:
            if problem:
                raise RoundRefused(problem)
            return
        flags = tp.gather(torch.tensor([int(problem is not None)], device=self.model.device), dim=0)
        if problem or int(flags.sum()):
            raise RoundRefused(problem or f"rank {int(flags.argmax())} refused the round")

    def execute(self, plan: RoundPlan) -> list[int | None]:
        """Apply the lane operations, run the rows, and return one drawn token per LaneRows (None where no draw)."""
        for slot in plan.free:
            self.slots[slot] = None
        for slot in plan.allocate:
            self.slots[slot] = self.model.new_lane()
        self._agree(self._problem(plan))
        if not plan.rows:
            return []
        device = self.model.device
        tokens, positions, segments, logit_rows = [], [], [], []
        for rows in plan.rows:
            lane = self.slots[rows.slot]
            segments.append(Segment(lane, len(tokens), len(rows.token_ids)))
            tokens.extend(rows.token_ids)
            positions.extend(range(rows.start, rows.start + len(rows.token_ids)))
            if rows.draw is not None:
                logit_rows.append(len(tokens) - 1)
        batch = ForwardBatch(
            token_ids=torch.tensor(tokens, device=device),
            positions=torch.tensor(positions, device=device),
            segments=segments,
        )
        logits = self.model(batch, logit_rows=torch.tensor(logit_rows, dtype=torch.long, device=device)).logits
        drawn: list[int | None] = []
        next_logit = 0
        for rows in plan.rows:
            if rows.draw is None:
                drawn.append(None)
                continue
            spec, position = rows.draw, rows.start + len(rows.token_ids)
            row = logits[next_logit]
            next_logit += 1
            drawn.append(sample_token(row, spec.temperature, spec.top_k, spec.top_p, spec.min_p, spec.seed, position))
        return drawn
