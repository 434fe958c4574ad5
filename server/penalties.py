"""Repetition, frequency and presence penalties: the ids each lane has folded, and the logit changes they make."""

from __future__ import annotations

from array import array
from collections import Counter
from dataclasses import dataclass, field

import torch

from kernels.host import to_device
from rankwire.header import DrawSpec, LaneRows


@dataclass(slots=True)
class _Seen:
    """A lane's ids before position `counted`: how often each occurs from `output_from` on, and those before it."""

    history: array
    output_from: int
    counted: int = 0
    output: Counter[int] = field(default_factory=Counter)
    prompt: set[int] = field(default_factory=set)

    def advance(self, position: int) -> None:
        """Count the ids up to `position` (a prefix no round cuts back: it ends before the round's first draw)."""
        cut = max(self.counted, min(self.output_from, position))
        self.prompt.update(self.history[self.counted : cut])
        self.output.update(self.history[cut:position])
        self.counted = position


@dataclass(frozen=True, slots=True)
class Penalties:
    """A round's penalty entries on the device: logit row, token id, how often the id occurs in the row's output so
    far; each row's (repetition, frequency, presence) penalties."""

    rows: torch.Tensor
    ids: torch.Tensor
    counts: torch.Tensor
    factors: torch.Tensor  # [logit rows, 3], fp32

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The fp32 logits with each entry penalized as vLLM does: a positive logit divided by the repetition
        penalty and a negative one multiplied by it, then the frequency penalty times the count taken away, then the
        presence penalty where the count is not 0 (a copy)."""
        at, logits = (self.rows, self.ids), logits.to(torch.float32)
        values = logits[at]
        repetition, frequency, presence = self.factors.index_select(0, self.rows).unbind(1)
        values = torch.where(values > 0, values / repetition, values * repetition)
        values = values - frequency * self.counts
        values = values - presence * (self.counts > 0).to(torch.float32)
        return logits.index_put(at, values)


class LaneHistories:
    """The ids every lane slot has folded, by absolute position, and those of each kept state: None once a round
    folded an id the host did not know (a draw taken on the device), which no penalized draw may then follow."""

    def __init__(self, lanes: int) -> None:
        self.slots: list[array | None] = [None] * lanes
        self.kept: dict[int, array | None] = {}
        self.seen: dict[int, _Seen] = {}  # by slot: the counts the last penalized draw left

    def allocate(self, slot: int) -> None:
        self.slots[slot] = array("i")

    def free(self, slot: int) -> None:
        self.slots[slot] = None

    def keep(self, slot: int, handle: int, length: int | None = None) -> None:
        """Keep the slot's ids (its first `length`) under a kept state's handle."""
        history = self.slots[slot]
        self.kept[handle] = None if history is None else history[:length]

    def restore(self, slot: int, handle: int) -> None:
        kept = self.kept[handle]
        self.slots[slot] = None if kept is None else array("i", kept)

    def drop(self, handle: int) -> None:
        self.kept.pop(handle, None)

    def fold(self, rows: LaneRows) -> None:
        """The ids a round writes into the lane: its window, drafts included (`cut` takes back the rejected)."""
        history = self.slots[rows.slot]
        if rows.prior_draw:
            self.slots[rows.slot] = None
        elif history is not None:
            history.extend(rows.token_ids)
            history.extend(rows.drafts)

    def cut(self, slot: int, length: int) -> None:
        """Keep the slot's first `length` ids (a verify round's rejected drafts were not folded)."""
        history = self.slots[slot]
        if history is not None:
            del history[length:]

    def problem(self, rows: LaneRows) -> str | None:
        """Why the lane's penalized draws cannot be run here, or None."""
        if rows.draw is None or not rows.draw.penalized:
            return None
        history = self.slots[rows.slot]
        if rows.prior_draw or history is None:
            return f"lane slot {rows.slot} draws with penalties after a token its host never saw (a draw planned ahead)"
        if len(history) != rows.start:
            return f"lane slot {rows.slot} has {len(history)} ids on the host, the plan writes at {rows.start}"
        return None

    def penalties(self, keys: list[tuple[int, DrawSpec, int]], device: torch.device) -> Penalties | None:
        """The entries of every logit row whose draw is penalized: `keys` holds each logit row's (slot, draw,
        absolute position); a row at position p counts the ids folded before p (its window's drafts included)."""
        rows, ids, counts, factors = [], [], [], []
        counted: set[int] = set()  # slots whose counts reach their first draw this round (a prefix no cut undoes)
        for row, (slot, spec, position) in enumerate(keys):
            factors.append(spec.penalties)
            if not spec.penalized:
                continue
            if slot not in counted:
                counted.add(slot)
                seen = self._seen(slot, spec, position)
            window = Counter(seen.history[seen.counted : position])  # the drafts this row follows
            output = seen.output + window if window else seen.output
            chosen = set(output)
            if spec.repetition_penalty != 1.0:
                chosen |= seen.prompt
            rows += [row] * len(chosen)
            ids += chosen
            counts += [output.get(token, 0) for token in chosen]
        if not rows:
            return None
        return Penalties(
            to_device(device, rows, torch.long),
            to_device(device, ids, torch.long),
            to_device(device, counts, torch.float32),
            to_device(device, factors, torch.float32),
        )

    def _seen(self, slot: int, spec: DrawSpec, position: int) -> _Seen:
        """The slot's counts brought up to `position` (begun again for a new history or request)."""
        history = self.slots[slot]
        seen = self.seen.get(slot)
        stale = seen is None or seen.history is not history or seen.output_from != spec.output_from
        if stale or position < seen.counted:
            seen = self.seen[slot] = _Seen(history, spec.output_from)
        seen.advance(position)
        return seen
