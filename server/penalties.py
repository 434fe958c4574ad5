"""Repetition, frequency and presence penalties: the ids each lane has folded, and the logit changes they make."""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from kernels.host import to_device
from rankwire.header import DrawSpec, LaneRows


@dataclass(frozen=True, slots=True)
class Penalties:
    """A round's penalized logit rows on the device: their indices, each id's mark as `PenaltyMarks` keeps it (the
    row's own drafts before it included), and each row's (repetition, frequency, presence) penalties."""

    rows: torch.Tensor
    marks: torch.Tensor  # [rows, vocab], int32
    factors: torch.Tensor  # [rows, 3], fp32

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The fp32 logits with the rows penalized as vLLM does (a copy): a positive logit divided by the repetition
        penalty and any other multiplied by it, for each id seen before; then the frequency penalty times the id's
        count in the output taken away, then the presence penalty where that count is not 0."""
        out = logits.to(torch.float32, copy=True)
        values = out.index_select(0, self.rows)  # rows x vocabulary: each step below reuses its buffers where it can
        repetition, frequency, presence = self.factors[:, :, None].unbind(1)
        seen = self.marks > 0
        scaled = torch.where(values > 0, values / repetition, values.mul(repetition))
        values = torch.where(seen, scaled, values, out=scaled)
        counts = (self.marks >> 1).to(torch.float32)
        values.sub_(counts.mul(frequency))
        values.sub_(counts.gt_(0).mul_(presence))  # the count's buffer, now 1 where it was above 0
        return out.index_copy_(0, self.rows, values)


class PenaltyMarks:
    """Each penalized lane's marks on the device, one int32 per vocabulary id: twice how often the id occurs from the
    request's first output position on, plus 1 if it occurs before it (in the prompt). Built from the host's ids at
    the lane's first penalized draw, then kept up with the ids its rounds fold, a draw taken on the device included,
    so a penalized lane may be planned ahead."""

    def __init__(self, lanes: int) -> None:
        self.lanes = lanes
        self.marks: torch.Tensor | None = None  # [lanes, vocab], made at the first penalized draw
        # slot -> the output start of the request whose marks it holds, and the position its marks have counted up to
        self.live: dict[int, tuple[int, int]] = {}

    def drop(self, slot: int) -> None:
        """Forget a slot's marks (its lane was freed, allocated again or restored)."""
        self.live.pop(slot, None)

    def holds(self, slot: int, spec: DrawSpec, position: int) -> bool:
        """Whether the slot's marks are its request's and have counted every id before `position`."""
        return self.live.get(slot) == (spec.output_from, position)

    def start(self, slot: int, ids: array, output_from: int, vocab: int, device: torch.device) -> None:
        """Mark the ids a lane folded before its first penalized draw (all known on the host)."""
        if self.marks is None:
            self.marks = torch.zeros(self.lanes, vocab, dtype=torch.int32, device=device)
        lane = self.marks[slot]
        lane.zero_()
        prompt, output = ids[:output_from], ids[output_from:]
        if prompt:
            lane.index_fill_(0, to_device(device, sorted(set(prompt)), torch.long), 1)
        if output:
            twice = lane.new_full((), 2)
            lane.index_put_((to_device(device, output.tolist(), torch.long),), twice, accumulate=True)
        self.live[slot] = (output_from, len(ids))

    def fold(self, slots: list[int], ids: torch.Tensor) -> None:
        """Count output ids, the next ones of their lanes, into their marks (`ids` on the device, one per slot)."""
        if slots:
            at = (to_device(ids.device, slots, torch.long), ids)
            self.marks.index_put_(at, self.marks.new_full((), 2), accumulate=True)  # a fill, not a copy from the host
        for slot in slots:
            output_from, counted = self.live[slot]
            self.live[slot] = (output_from, counted + 1)

    def penalties(self, keys: list[tuple[int, DrawSpec, tuple[int, ...]]], device: torch.device) -> Penalties | None:
        """The penalized rows of a round whose logit rows have these keys: (slot, draw, the drafts before the row in
        its window, counted for that row alone)."""
        chosen = [(row, slot, spec, drafts) for row, (slot, spec, drafts) in enumerate(keys) if spec.penalized]
        if not chosen:
            return None
        rows, slots, specs, drafts = zip(*chosen, strict=True)
        marks = self.marks.index_select(0, to_device(device, slots, torch.long))
        window = [(place, token) for place, before in enumerate(drafts) for token in before]
        if window:
            at = tuple(to_device(device, list(column), torch.long) for column in zip(*window, strict=True))
            marks.index_put_(at, marks.new_full((), 2), accumulate=True)
        factors = to_device(device, [spec.penalties for spec in specs], torch.float32)
        return Penalties(to_device(device, rows, torch.long), marks, factors)


class LaneHistories:
    """The ids every lane slot has folded, by absolute position, and those of each kept state: None once a round
    folded an id the host did not know (a draw taken on the device), which no penalized draw may then follow."""

    def __init__(self, lanes: int) -> None:
        self.slots: list[array | None] = [None] * lanes
        self.kept: dict[int, array | None] = {}

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


class DraftPenalties:
    """The penalties of a round's MTP draft chain: a copy of each penalized lane's marks, the round's last draw and
    each draft so far counted in, so a draft follows the penalties the target's draw at its place takes (drafts
    that match it more often are accepted more often; the target's draws never read them)."""

    def __init__(
        self, marks: PenaltyMarks, lanes: list[int], specs: list[DrawSpec], last_draws: list[tuple[int, int]]
    ) -> None:
        """`lanes` the chain's first rows, each drawn with `specs[i]` after the token and position `last_draws[i]`: a
        lane whose marks have counted every id before that position takes part (all but a lane whose draw failed)."""
        self.places = [i for i, (slot, spec, (_, at)) in enumerate(zip(lanes, specs, last_draws, strict=True))
                       if spec.penalized and marks.holds(slot, spec, at)]  # fmt: skip
        self.marks: torch.Tensor | None = None
        self.factors: torch.Tensor | None = None
        if not self.places:
            return
        device = marks.marks.device
        chosen = [lanes[i] for i in self.places]
        self.rows = to_device(device, self.places, torch.long)
        self.marks = marks.marks.index_select(0, to_device(device, chosen, torch.long))
        self._count(to_device(device, [last_draws[i][0] for i in self.places], torch.long))
        self.factors = to_device(device, [specs[i].penalties for i in self.places], torch.float32)

    def penalties(self) -> Penalties | None:
        """The chain's next step's penalized rows, or None where no lane takes part."""
        return None if self.marks is None else Penalties(self.rows, self.marks, self.factors)

    def count(self, drawn: torch.Tensor) -> None:
        """Count a step's drafts (one per row, on the device) into the penalized rows' marks."""
        if self.marks is not None:
            self._count(drawn.index_select(0, self.rows))

    def keep(self, rows: list[int]) -> None:
        """Follow the chain as it keeps only these of its rows (a lane whose depth is reached leaves it)."""
        if self.marks is None:
            return
        place_of = {row: at for at, row in enumerate(self.places)}
        kept = [(new, place_of[old]) for new, old in enumerate(rows) if old in place_of]
        if not kept:
            self.marks = self.factors = None
            self.places = []
            return
        self.places = [new for new, _ in kept]
        self.rows = to_device(self.marks.device, self.places, torch.long)
        pick = to_device(self.marks.device, [at for _, at in kept], torch.long)
        self.marks, self.factors = self.marks.index_select(0, pick), self.factors.index_select(0, pick)

    def _count(self, ids: torch.Tensor) -> None:
        """Add one occurrence of each row's id (2 in the marks' terms)."""
        at = (torch.arange(len(ids), device=ids.device), ids)
        self.marks.index_put_(at, self.marks.new_full((), 2), accumulate=True)
