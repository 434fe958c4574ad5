"""The model runner: owns the weights and the lane slots, executes round plans: verify, keep, draft."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import lru_cache, partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kernels.host import HostCopy, to_device
from model.flashnext import FlashNextModel, ForwardOutput
from model.layers import Segment, batch_from_starts
from model.state import LaneState, copy_lane, lane_bytes
from rankwire.header import DrawSpec, LaneOp, LaneOpCode, LaneRows, RoundPlan
from server.engine import PromptLogprob, TokenLogprob
from server.penalties import DraftPenalties, LaneHistories, Penalties, PenaltyMarks
from server.prompt_logprobs import PromptLogprobs, PromptRound
from server.round_trace import RoundTrace
from server.sampling import SamplingParamError, sample_token

if TYPE_CHECKING:  # the graphs' module imports Triton, which the kernel path imports on first use
    from model.graphs import RoundGraphs


class RoundRefused(RuntimeError):
    """A rank found a round plan it cannot run; every rank refuses it before any collective."""


@dataclass(frozen=True, slots=True)
class LaneResult:
    """What a lane's rows gave: the tokens kept (each the target's own draw) and MTP drafts for the next round; `error`:
    why a draw after the kept tokens failed (its parameters overflow the logits, say), which ends this lane alone;
    `error_param`: the request field whose value made it fail, where one did; `logprobs`: one per kept token, where
    the lane's draw asked for them."""

    tokens: tuple[int, ...] = ()
    drafts: tuple[int, ...] = ()
    error: str | None = None
    error_param: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt: tuple[PromptLogprob, ...] = ()  # the prompt logprobs its pass took, where its request asked

    @property
    def accepted(self) -> int:
        """Drafts kept: every token after the first."""
        return max(len(self.tokens) - 1, 0)


@dataclass(slots=True)
class LaunchedRound:
    """A round on its way (`ModelRunner.launch`): what `ModelRunner.finish` completes it from."""

    plan: RoundPlan
    segments: list[Segment] = field(default_factory=list)  # its lanes' rows, unless it is `ahead_safe`
    out: ForwardOutput | None = None
    drawn: HostCopy | None = None  # every logit row's draw, on its way to the host
    penalties: Penalties | None = None  # the penalties its draws were made with
    logprobs: _Logprobs | None = None  # the log-probabilities of the rows whose draws asked for them
    draw_logits: torch.Tensor | None = None  # the draw rows' logits, where other rows have logits too
    prompt: PromptRound | None = None  # the prompt logprobs its passes asked for
    replays: dict[str, int] = field(default_factory=dict)  # the graphs' replay counts after its forward (traces)

    @property
    def ahead_safe(self) -> bool:
        """Whether the next round may be launched before this one is finished (`ahead_safe`)."""
        return ahead_safe(self.plan)


def ahead_safe(plan: RoundPlan) -> bool:
    """Whether a round's finish changes no lane (no drafts to verify or restore, no MTP rows, no state kept after its
    rows), so the next round may be launched before it is finished; such a round holds no lane meanwhile."""
    return not any(rows.drafts or rows.draft_depth for rows in plan.rows) and not any(op.after for op in plan.ops)


def most_likely(logprobs: torch.Tensor, most: int) -> torch.Tensor:
    """The ids [N, most] of each row's `most` largest fp32 values, largest first and equal values by ascending id,
    as a stable descending sort orders them: one top-k over keys that are unique per row, so no tie is left to the
    top-k's own rule."""
    bits = logprobs.contiguous().view(torch.int32)
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)  # ints in the floats' order
    ids = torch.arange(logprobs.shape[-1], device=logprobs.device, dtype=torch.int64)
    return torch.topk(ordered * 2**32 + (2**32 - 1 - ids), most, dim=-1).indices  # a lower id, a larger key


class _Logprobs:
    """Raw log-probabilities of the logit rows whose draws asked for them, on their way to the host: each row's drawn
    token's, and the `most` most likely ids with theirs."""

    def __init__(self, logits: torch.Tensor, drawn: torch.Tensor, asked: list[int], most: int) -> None:
        at = to_device(logits.device, asked, torch.long)
        logprobs = torch.log_softmax(logits.index_select(0, at).float(), dim=-1)
        self.place = {row: place for place, row in enumerate(asked)}
        self.chosen = HostCopy(logprobs.gather(1, drawn.index_select(0, at).clamp(min=0)[:, None])[:, 0])
        self.top: tuple[HostCopy, HostCopy] | None = None
        if most:
            ids = most_likely(logprobs, most)
            self.top = (HostCopy(ids), HostCopy(logprobs.gather(1, ids)))
        self.read: tuple[list, list, list] | None = None

    def tokens(self, first_row: int, count: int, most: int) -> tuple[TokenLogprob, ...]:
        """The TokenLogprobs of `count` logit rows from `first_row`, each with its `most` most likely ids."""
        if self.read is None:
            ids, values = (self.top[0].tolist(), self.top[1].tolist()) if self.top else ([], [])
            self.read = (self.chosen.tolist(), ids, values)
        chosen, ids, values = self.read
        places = [self.place[row] for row in range(first_row, first_row + count)]
        return tuple(
            TokenLogprob(chosen[at], tuple(zip(ids[at][:most], values[at][:most], strict=True)) if most else ())
            for at in places
        )


@dataclass(slots=True)
class _MtpRows:
    """One lane's rows for the MTP layer: (hidden [n, wide], next tokens, first position)."""

    slot: int
    hidden: torch.Tensor
    tokens: list[int]
    start: int


class ModelRunner:
    """Executes a RoundPlan on this rank's model; every rank given the same plan draws the same tokens and drafts."""

    def __init__(
        self, model: FlashNextModel, max_lanes: int, digests: Path | None = None, trace: RoundTrace | None = None
    ) -> None:
        self.model = model
        self.slots: list[LaneState | None] = [None] * max_lanes
        self.kept: dict[int, LaneState] = {}
        self.histories = LaneHistories(max_lanes)  # the ids each lane and kept state holds, for penalized draws
        self.marks = PenaltyMarks(max_lanes)  # the penalized lanes' ids on the device
        self.prompt_logprobs = PromptLogprobs()  # a prompt pass's last row, until the next pass of its lane
        self.digests = digests  # a file that gets a line per round: a digest of its logits and tokens
        self.trace = trace or RoundTrace(None)  # its round begins and ends with the caller (engine or follower)
        # with several ranks: sends this rank's verdict on a round (None: it runs it) and returns the other rank's
        self.agreement: Callable[[str | None], str | None] | None = None
        self.unfinished: LaunchedRound | None = None  # the last launched round, until it is finished
        # the last launched round's draws on the device, and the lanes that drew one token: their places among them
        self.prior_draws: tuple[torch.Tensor, dict[int, int]] = (torch.empty(0, dtype=torch.long), {})
        self.rounds = 0
        self.takes_logprobs = True  # off on a rank that delivers no tokens (rank 1): it would never read them

    def kept_bytes(self, handle: int) -> int:
        """Bytes a kept state takes on this rank."""
        return lane_bytes(self.kept[handle])

    @property
    def max_lanes(self) -> int:
        return len(self.slots)

    @property
    def vocab_size(self) -> int:
        """The logits' width: the ids a draw row's mask has a bit for."""
        return self.model.cfg.vocab_size

    @property
    def linked(self) -> bool:
        """Whether another rank runs this runner's rounds too (`LinkedRunner`): a failed round then leaves that
        rank's state unknown. One rank's half served alone has none."""
        return False

    @property
    def can_draft(self) -> bool:
        return self.model.mtp is not None

    @property
    def prompt_align(self) -> int:
        """Where a prompt pass may stop short of its end or keep a state: the kernels' GDN chunk (a pass's rows in
        whole chunks take the chunked form, so its chunks must not depend on how it was cut), else anywhere."""
        if not self.model.kernels:
            return 1
        from kernels.gdn_chunk import CHUNK  # the kernels are loaded once the model runs on them

        return CHUNK

    def _apply(self, op: LaneOp) -> str | None:
        """Keep, restore or drop a prompt state; a reason when this rank cannot."""
        if op.code is LaneOpCode.DROP:
            self.kept.pop(op.arg, None)
            self.histories.drop(op.arg)
            return None
        if not 0 <= op.slot < len(self.slots):
            return f"lane op on slot {op.slot}, outside the {len(self.slots)} lanes"
        if op.code is LaneOpCode.KEEP:
            if self.slots[op.slot] is None:
                return f"keep asked of lane slot {op.slot}, which is not allocated"
            self.kept[op.arg] = copy_lane(self.slots[op.slot], share_caches=True)
            self.histories.keep(op.slot, op.arg)
        elif op.code is LaneOpCode.RESTORE:
            if op.arg not in self.kept:
                return f"restore of kept state {op.arg}, which this rank does not hold"
            self.slots[op.slot] = copy_lane(self.kept[op.arg])
            self.histories.restore(op.slot, op.arg)
            self.marks.drop(op.slot)
            self.prompt_logprobs.drop(op.slot)
        return None

    def _prepare(self, plan: RoundPlan) -> str | None:
        """Apply the plan's lane operations that come before the rows; then why this rank cannot run the round (its
        rows, or a keep after rows it does not have), or None."""
        for op in plan.ops:
            problem = self._apply(op) if not op.after else None
            if problem:
                return problem
        counts = {rows.slot: len(rows.token_ids) for rows in plan.rows}
        for op in plan.ops:
            rows_here = counts.get(op.slot, 0)
            if op.after and (op.code is not LaneOpCode.KEEP or op.after > rows_here):
                return f"lane op {op.code.name} after {op.after} rows of lane slot {op.slot}, which has {rows_here}"
        for rows in plan.rows:
            if not 0 <= rows.slot < len(self.slots) or self.slots[rows.slot] is None:
                return f"round plan uses lane slot {rows.slot}, which is not allocated"
            if rows.start != self.slots[rows.slot].length:
                return f"lane {rows.slot} holds {self.slots[rows.slot].length} tokens, the plan writes at {rows.start}"
            if rows.draft_depth and not self.can_draft:
                return "the plan asks for MTP drafts but this checkpoint has no MTP layer"
            if rows.prior_draw and rows.slot not in self.prior_draws[1]:
                return f"lane slot {rows.slot} takes the round before's draw, but that round drew no one token for it"
            problem = None if self._marked(rows, rows.start) else self.histories.problem(rows)
            if problem:
                return problem
        return None

    def _agree(self, problem: str | None) -> None:
        """The agreement gate: all ranks learn whether any rank refuses the round, before its collectives: each
        rank sends its verdict over the control link and waits for the other's (`agreement`, which several ranks
        need)."""
        if self.agreement is not None:
            theirs = self.agreement(problem)
            if not problem and theirs:
                problem = f"rank {1 - self.model.tp.rank} refused the round: {theirs}"
        elif self.model.tp.world > 1:
            raise RuntimeError("a runner of several ranks needs the control link's agreement to run a round")
        if problem:
            raise RoundRefused(problem)

    def execute(self, plan: RoundPlan, launched: Callable[[], None] | None = None) -> list[LaneResult]:
        """Run a round to its end: `launch`, then `finish`."""
        return self.finish(self.launch(plan, launched))

    def launch(self, plan: RoundPlan, launched: Callable[[], None] | None = None) -> LaunchedRound:
        """Apply the lane operations and launch every lane's rows and drafts as one verify forward and its draws,
        without waiting for the GPU (a prior-draw row's token is taken from the last launched round's draws on the
        device); `finish` completes the round. `launched` is called once the forward is on its way (while the GPU
        runs it), or after the operations when the round has no rows. A round may be launched before the one before
        it is finished only if that one is `ahead_safe`."""
        if self.unfinished is not None and not self.unfinished.ahead_safe:
            raise RuntimeError("a round was launched before the one before it, which keeps or drafts, was finished")
        for slot in plan.free:
            self.slots[slot] = None
            self.histories.free(slot)
            self.marks.drop(slot)
            self.prompt_logprobs.drop(slot)
        for slot in plan.allocate:
            self.slots[slot] = self.model.new_lane()
            self.histories.allocate(slot)
            self.marks.drop(slot)
            self.prompt_logprobs.drop(slot)
        problem = self._prepare(plan)
        trace = self.trace
        trace.mark("prepare")
        self._agree(problem)
        trace.mark("agree")
        if not plan.rows:
            self.prior_draws = (self.prior_draws[0], {})
            if launched is not None:
                launched()
            return LaunchedRound(plan)
        device = self.model.device
        tokens, segments, logit_rows, follows = [], [], [], []
        # the draw rows' places among the logit rows; (row index, first logit row) of each lane whose every token row
        # gives logits (the prompt's logprobs)
        draw_at, asked = [], []
        snapshot_rows: dict[int, set[int]] = {}
        keeps_after = {(op.slot, op.after) for op in plan.ops if op.after}
        for index, rows in enumerate(plan.rows):
            window = (*rows.token_ids, *rows.drafts)
            self.histories.fold(rows)
            if rows.prior_draw:
                follows.append((len(tokens), self.prior_draws[1][rows.slot]))
            segments.append(Segment(self.slots[rows.slot], len(tokens), len(window)))
            tokens.extend(window)
            if rows.prompt_logprobs is not None:
                asked.append((index, len(logit_rows)))
                logit_rows.extend(range(len(tokens) - len(window), len(tokens)))
                draw_at += [len(logit_rows) - 1] if rows.draw is not None else []
            elif rows.draw is not None:
                draw_at.extend(range(len(logit_rows), len(logit_rows) + len(rows.drafts) + 1))
                logit_rows.extend(range(len(tokens) - len(rows.drafts) - 1, len(tokens)))
            wanted = {after - 1 for slot, after in keeps_after if slot == rows.slot}
            if rows.drafts:  # what a rejection restores: the state after the last token row or after a kept draft
                wanted |= set(range(len(rows.token_ids) - 1, len(window) - 1))
            if wanted:
                snapshot_rows[index] = wanted
        token_ids = to_device(device, tokens, torch.long)
        if follows:  # a draw that needs the host (-1) fails its own round's finish: 0 stands in for it here
            rows_at, draws_at = (to_device(device, list(column), torch.long) for column in zip(*follows, strict=True))
            token_ids.index_copy_(0, rows_at, self.prior_draws[0].index_select(0, draws_at).clamp(min=0))
        graphs = self.model.round_graphs
        before = _replays(graphs) if trace.enabled else {}
        trace.gpu_mark("start", device)
        # decode and verify rounds: no list to copy or index by (a prompt round's few rows fail at the lengths)
        every_row = len(logit_rows) == len(tokens) and logit_rows == list(range(len(tokens)))
        out = self.model(  # its inputs reach the device without waiting for the GPU
            batch_from_starts(token_ids, segments, [rows.start for rows in plan.rows]),
            logit_rows=None if every_row else to_device(device, logit_rows, torch.long),
            snapshot_rows=snapshot_rows,
        )
        trace.gpu_mark("forward", device)
        trace.mark("forward")
        replays = _replays(graphs) if trace.enabled else {}
        if trace.enabled:
            trace.note(lanes=len(plan.rows), rows=len(tokens), replays=_ran(before, replays))
        if launched is not None:
            launched()
        draw_logits = out.logits.index_select(0, to_device(device, draw_at, torch.long)) if asked else out.logits
        penalties = self._launch_penalties(plan.rows, segments, token_ids, out.logits.shape[-1])
        drawn = self._launch_draws(plan.rows, draw_logits, penalties)
        logprobs = self._launch_logprobs(plan.rows, draw_logits, drawn)
        prompt = self.prompt_logprobs.launch(plan.rows, asked, out.logits) if asked and self.takes_logprobs else None
        at, singles = 0, {}  # each lane that drew one token: its place among the draws
        for rows in plan.rows:
            if rows.draw is not None:
                if not rows.drafts:
                    singles[rows.slot] = at
                at += len(rows.drafts) + 1
        self.prior_draws = (drawn, singles)
        # a round finished later holds no lane: a freed lane's pool slot is free at once for the next request
        held = [] if ahead_safe(plan) else segments
        self.unfinished = LaunchedRound(
            plan, held, out, HostCopy(drawn), penalties, logprobs, draw_logits if asked else None, prompt, replays
        )
        return self.unfinished

    def finish(
        self, launched: LaunchedRound, tokens_known: Callable[[list[LaneResult]], None] | None = None
    ) -> list[LaneResult]:
        """Complete a launched round: read its draws, keep each lane's accepted prefix, restore the lanes whose
        drafts were rejected, then absorb the kept rows into the MTP layer and chain new drafts. `tokens_known`, if
        given, gets the lanes' results without drafts while the MTP chain runs, before the wait for its drafts (so
        the tokens can be delivered meanwhile); it is not called in a round that waits for no drafts."""
        if self.unfinished is launched:
            self.unfinished = None
        plan, segments, out, trace = launched.plan, launched.segments, launched.out, self.trace
        if out is None:
            return []
        results, mtp_rows, restores, next_logit, accepted = [], [], [], 0, []
        draw_logits = out.logits if launched.draw_logits is None else launched.draw_logits
        draws, refusals = self._draw(plan.rows, draw_logits, launched.drawn, launched.penalties)
        prompt = {} if launched.prompt is None else launched.prompt.by_row()
        trace.mark("draw")
        for index, rows in enumerate(plan.rows):
            kept, failed = self._verify(rows, draws[next_logit : next_logit + len(rows.drafts) + 1])
            error, error_param = refusals[next_logit + len(kept)] if failed else (None, None)
            logprobs = ()
            if rows.draw is not None and rows.draw.logprobs is not None and launched.logprobs is not None:
                logprobs = launched.logprobs.tokens(next_logit, len(kept), rows.draw.logprobs)
            if rows.draw is not None:
                next_logit += len(rows.drafts) + 1
            # a lane whose draw failed ends with its request (its rejected rows need no restore), but its rows still
            # reach the MTP layer: a state this round keeps after them (the prompt cache's) must hold them there
            if error is None and rows.drafts and len(kept) - 1 < len(rows.drafts):
                restores.append((segments[index].lane, out.snapshots[index][len(rows.token_ids) + len(kept) - 2]))
            folded = len(rows.token_ids) + max(len(kept) - 1, 0)
            if rows.drafts:  # only a verify round folds ids it may take back (and it is never planned ahead of)
                self.histories.cut(rows.slot, rows.start + folded)
                if self._marked(rows, rows.start + len(rows.token_ids)):  # counted up to its first draw at launch
                    accepted += [(rows.slot, token) for token in rows.drafts[: max(len(kept) - 1, 0)]]
            if rows.draft_depth:
                seg = segments[index]
                mtp_rows.append(self._mtp_rows(rows, seg.lane, out.hidden[seg.start : seg.start + folded], kept))
            taken = prompt.get(index, ())
            results.append(LaneResult(tuple(kept), (), error, error_param, logprobs, taken))
        self.model.restore_lanes(restores)  # every lane with a rejected draft, together (one launch on the kernel path)
        if accepted:  # a penalized lane's kept drafts, which no later window holds
            slots, tokens = zip(*accepted, strict=True)
            self.marks.fold(list(slots), to_device(self.model.device, list(tokens), torch.long))
        trace.mark("verify")
        if mtp_rows:
            drafts = self._draft(plan.rows, mtp_rows, None if tokens_known is None else partial(tokens_known, results))
            results = [replace(r, drafts=drafts.get(rows.slot, ())) for r, rows in zip(results, plan.rows, strict=True)]
            trace.mark("mtp")
            if trace.enabled:  # a round with MTP rows is finished in the trace line that launched it
                trace.add_counts("replays", _ran(launched.replays, _replays(self.model.round_graphs)))
        if self.digests is not None:
            self._write_digest(out.logits, results)
        by_slot = {rows.slot: index for index, rows in enumerate(plan.rows)}
        for op in plan.ops:
            if op.after:
                index = by_slot[op.slot]
                self.kept[op.arg] = self._kept_after(plan.rows[index], segments[index], out, index, op.after)
                self.histories.keep(op.slot, op.arg, plan.rows[index].start + op.after)
        return results

    def _write_digest(self, logits: torch.Tensor, results: list[LaneResult]) -> None:
        """Append this round's digest: two ranks that computed the same bits write the same lines."""
        digest = hashlib.sha256(logits.float().cpu().numpy().tobytes())
        digest.update(repr([(r.tokens, r.drafts) for r in results]).encode())
        with self.digests.open("a") as out:
            out.write(f"{self.rounds} {digest.hexdigest()}\n")
        self.rounds += 1

    def _kept_after(self, rows: LaneRows, seg: Segment, out: ForwardOutput, index: int, after: int) -> LaneState:
        """The lane's state after its first `after` rows of this round, as a keep before the next row would hold
        it: the forward's snapshot of that row, the QSA caches' prefix, and the MTP layer's prefix and pending row."""
        lane, position = seg.lane, rows.start + after
        kept = copy_lane(lane, share_caches=True, at=out.snapshots[index][after - 1])
        if kept.mtp_attention is not None:
            kept.mtp_attention.length = min(kept.mtp_attention.length, position - 1)
        kept.mtp_length = min(lane.mtp_length, position - 1)
        if rows.draft_depth:  # the MTP layer absorbs rows one behind: this one still waits for its next token
            kept.mtp_pending = out.hidden[seg.start + after - 1].clone()
        return kept

    def _draw_keys(self, plan_rows: tuple[LaneRows, ...]) -> list[tuple[DrawSpec, int]]:
        """Each logit row's draw parameters and absolute position, the key of its draw."""
        return [
            (rows.draw, rows.start + len(rows.token_ids) + i)
            for rows in plan_rows
            if rows.draw is not None
            for i in range(len(rows.drafts) + 1)
        ]

    def _guide_masks(self, plan_rows: tuple[LaneRows, ...]) -> list[bytes]:
        """Each logit row's guide mask, in `_draw_keys`'s order (b"": the row is not guided)."""
        return [
            rows.guide_masks[i] if rows.guide_masks else b""
            for rows in plan_rows
            if rows.draw is not None
            for i in range(len(rows.drafts) + 1)
        ]

    def _marked(self, rows: LaneRows, position: int) -> bool:
        """Whether the device holds marks of the lane's request that have counted every id before `position`."""
        return rows.draw is not None and self.marks.holds(rows.slot, rows.draw, position)

    def _launch_penalties(
        self, plan_rows: tuple[LaneRows, ...], segments: list[Segment], token_ids: torch.Tensor, vocab: int
    ) -> Penalties | None:
        """Bring each penalized lane's marks up to its first draw of the round (from the host's ids at its first
        penalized draw, else from its window's ids on the device, a prior draw's included), then the round's
        penalized rows; None where no row is penalized."""
        if not any(rows.draw is not None and rows.draw.penalized for rows in plan_rows):
            return None
        device, slots, places = token_ids.device, [], []
        for rows, seg in zip(plan_rows, segments, strict=True):
            if rows.draw is None or not rows.draw.penalized:
                continue
            if self._marked(rows, rows.start):
                slots += [rows.slot] * len(rows.token_ids)
                places += range(seg.start, seg.start + len(rows.token_ids))
            else:
                ids = self.histories.slots[rows.slot][: rows.start + len(rows.token_ids)]
                self.marks.start(rows.slot, ids, rows.draw.output_from, vocab, device)
        self.marks.fold(slots, token_ids.index_select(0, to_device(device, places, torch.long)))
        keys = [
            (rows.slot, rows.draw, rows.drafts[:i])
            for rows in plan_rows
            if rows.draw is not None
            for i in range(len(rows.drafts) + 1)
        ]
        return self.marks.penalties(keys, device)

    def _launch_draws(
        self, plan_rows: tuple[LaneRows, ...], logits: torch.Tensor, penalties: Penalties | None
    ) -> torch.Tensor:
        """The target's draw at every logit row, keyed by (seed, absolute position), as a tensor on the logits'
        device: on the kernel path one batched draw launched for the round (`sample_rows`, which gives each row
        `sample_token`'s token, or -1 where that raises), else drawn row by row on the host, -1 likewise."""
        keys = self._draw_keys(plan_rows)
        logits = _adjusted(logits, keys, penalties, self._guide_masks(plan_rows))
        if not self.model.kernels:
            tokens = [_draw_row(logits[i], spec, position)[0] for i, (spec, position) in enumerate(keys)]
            return torch.tensor(tokens, dtype=torch.long, device=logits.device)
        if not keys:
            return torch.empty(0, dtype=torch.long, device=logits.device)
        from kernels.sample import sample_rows

        temperature = torch.tensor([s.temperature for s, _ in keys], dtype=torch.float64)  # on the host: greedy
        # rows skip the sort, and a greedy round (its parameters on the host too) is one launch
        device = logits.device if temperature.any() else torch.device("cpu")
        floats = to_device(device, [[s.top_p, s.min_p] for s, _ in keys], torch.float64)
        ints = to_device(device, [[s.top_k, s.seed, p] for s, p in keys], torch.int64)
        tokens = sample_rows(logits, temperature, ints[:, 0], floats[:, 0], floats[:, 1], ints[:, 1], ints[:, 2])
        self.trace.gpu_mark("draw", logits.device)
        return tokens

    def _launch_logprobs(
        self, plan_rows: tuple[LaneRows, ...], logits: torch.Tensor, drawn: torch.Tensor
    ) -> _Logprobs | None:
        """The raw log-probabilities of the logit rows whose draws asked for them, launched before the next round
        can overwrite the logits; None where none asked (or this rank delivers no tokens)."""
        if not self.takes_logprobs or all(r.draw is None or r.draw.logprobs is None for r in plan_rows):
            return None
        specs = [spec for spec, _ in self._draw_keys(plan_rows)]
        asked = [row for row, spec in enumerate(specs) if spec.logprobs is not None]
        if not asked:
            return None
        return _Logprobs(logits, drawn, asked, max(specs[row].logprobs or 0 for row in asked))

    def _draw(
        self, plan_rows: tuple[LaneRows, ...], logits: torch.Tensor, drawn: HostCopy, penalties: Penalties | None
    ) -> tuple[list[int], dict[int, tuple[str, str | None]]]:
        """The launched draws on the host (waiting only for their own copy, not for a round launched since), and why
        each failed draw (-1) failed, as `sample_token` names it, with the request field at fault where one is. A
        refused row stays refused even where the host would draw it: a round planned ahead has already taken 0 for it
        on the device, and the two disagreeing is a broken contract to report, not to paper over."""
        tokens = drawn.tolist()
        if -1 not in tokens:
            return tokens, {}
        refusals = {}
        keys = self._draw_keys(plan_rows)
        logits = _adjusted(logits, keys, penalties, self._guide_masks(plan_rows))  # the bits `_launch_draws` drew
        for i, (spec, position) in enumerate(keys):
            if tokens[i] == -1:
                token, refusal = _draw_row(logits[i], spec, position)
                refusals[i] = refusal or (
                    f"the device refused the draw at position {position}, which the host draws ({token}): the batched "
                    "draw and sample_token disagree",
                    None,
                )
        return tokens, refusals

    def _verify(self, rows: LaneRows, draws: list[int]) -> tuple[list[int], bool]:
        """The target's draws after the window, up to the first draft that differs from the draw at its position
        (that draw is kept instead), and whether a failed draw (-1) cut them short before that."""
        if rows.draw is None:
            return [], False
        kept = []
        for i, token in enumerate(draws):
            if token == -1:
                return kept, True
            kept.append(token)
            if i == len(rows.drafts) or rows.drafts[i] != token:
                break
        return kept, False

    def _mtp_rows(self, rows: LaneRows, lane: LaneState, hidden: torch.Tensor, kept: list[int]) -> _MtpRows:
        """The MTP layer's rows for what this lane folded: each row pairs a position's wide state with the next
        token; a row whose next token is not known yet waits in the lane (mid-prompt chunks)."""
        folded = [*rows.token_ids, *kept[:-1]] if kept else list(rows.token_ids)
        start = rows.start
        if lane.mtp_pending is not None:
            hidden = torch.cat((lane.mtp_pending[None], hidden))
            start -= 1
        next_tokens = folded[1:] + kept[-1:] if lane.mtp_pending is None else folded + kept[-1:]
        lane.mtp_pending = None
        if not kept:
            lane.mtp_pending = hidden[-1].clone()
            hidden = hidden[:-1]
        return _MtpRows(rows.slot, hidden, next_tokens, start)

    def _draft(
        self, plan_rows: tuple[LaneRows, ...], mtp_rows: list[_MtpRows], before_wait: Callable[[], None] | None
    ) -> dict[int, tuple[int, ...]]:
        """Absorb every lane's rows into the MTP layer, then chain greedy drafts to each lane's depth. The chain's
        tokens stay on the device, so each step is launched while the one before runs; they reach the host in one
        copy at the end, which `before_wait` (if given) runs just before."""
        device = self.model.device
        depth = {rows.slot: rows.draft_depth if rows.draw is not None else 0 for rows in plan_rows}
        draws = {rows.slot: rows.draw for rows in plan_rows if rows.draw is not None}  # drafts follow the logit bias
        live = [m for m in mtp_rows if m.tokens]
        if not live:
            return {}
        tokens, segments, hidden = [], [], []
        for m in live:
            segments.append(Segment(self.slots[m.slot], len(tokens), len(m.tokens)))
            tokens.extend(m.tokens)
            hidden.append(m.hidden)
        batch = batch_from_starts(to_device(device, tokens, torch.long), segments, [m.start for m in live])
        drafting = [(m.slot, seg.start + seg.length - 1, m.start + seg.length - 1)
                    for m, seg in zip(live, segments, strict=True) if depth[m.slot]]  # fmt: skip
        lasts = to_device(device, [last for _, last, _ in drafting], torch.long)
        logits, wide = self.model.mtp_forward(batch, torch.cat(hidden), logit_rows=lasts)  # drafting lanes' last rows
        if not drafting:
            return {}
        lanes = [slot for slot, _, _ in drafting]  # the lanes of the last step's rows, in order
        position = {slot: at for slot, _, at in drafting}  # each lane's position of its last step's row
        # a step's row at position q pairs q's wide state with the token at q + 1: it drafts the token at q + 2
        last_draws = {m.slot: (m.tokens[-1], position[m.slot] + 1) for m in live if m.slot in position}
        chain = DraftPenalties(self.marks, lanes, [draws[s] for s in lanes], [last_draws[s] for s in lanes])
        keys = [(draws[s], position[s] + 2) for s in lanes]
        drawn = _argmaxes(_adjusted(logits, keys, chain.penalties()), self.model.kernels)
        wide = wide.index_select(0, lasts)
        steps = [(lanes, drawn)]
        for step in range(1, max(depth.values())):
            kept = [i for i, slot in enumerate(lanes) if depth[slot] > step]
            if not kept:
                break
            chain.count(drawn)  # the step before's drafts, which the next one follows
            if len(kept) < len(lanes):
                pick = to_device(device, kept, torch.long)
                drawn, wide, lanes = drawn.index_select(0, pick), wide.index_select(0, pick), [lanes[i] for i in kept]
                chain.keep(kept)
            batch = batch_from_starts(
                drawn, [Segment(self.slots[s], i, 1) for i, s in enumerate(lanes)], [position[s] + step for s in lanes]
            )
            logits, wide = self.model.mtp_forward(batch, wide)
            keys = [(draws[s], position[s] + step + 2) for s in lanes]
            drawn = _argmaxes(_adjusted(logits, keys, chain.penalties()), self.model.kernels)
            steps.append((lanes, drawn))
        drafts: dict[int, list[int]] = {}
        if before_wait is not None:
            before_wait()
        chained = torch.cat([tokens for _, tokens in steps]).tolist()  # the round's one copy of its drafts
        for slot, token in zip((s for lanes, _ in steps for s in lanes), chained, strict=True):
            drafts.setdefault(slot, []).append(token)
        return {s: tuple(d) for s, d in drafts.items()}


def _biased(
    logits: torch.Tensor, keys: list[tuple[DrawSpec, int]], guide_masks: list[bytes] | None = None
) -> torch.Tensor:
    """The logit rows in fp32 with each row's logit bias added, -inf added for the ids its draw (at the key's
    position) may not take yet, -inf for every id outside its allowed ids where it has some, and -inf for every id
    its guide mask (b"": none) does not allow (the same tensor where no row has any of these)."""
    entries, allowed = [], {}
    vocab, device = logits.shape[-1], logits.device
    for row, (spec, position) in enumerate(keys):
        if spec.allowed_ids:
            allowed[row] = _allowed_mask(spec.allowed_ids, vocab, device)
        if guide_masks and guide_masks[row]:  # ruled out by either: by the allowed ids or by the guide
            ruled_out = _guide_mask(guide_masks[row], vocab, device)
            allowed[row] = ruled_out | allowed[row] if row in allowed else ruled_out
        suppressed = spec.suppress_ids if position < spec.suppress_before else ()
        if not spec.logit_bias and not suppressed:
            continue  # most rows of a round: nothing to add
        biases = dict(spec.logit_bias) | dict.fromkeys(suppressed, -math.inf)  # -inf wins over a bias on its id
        entries += [(row, token, bias) for token, bias in biases.items()]
    if not entries and not allowed:
        return logits
    out = logits.to(torch.float32, copy=True)
    if entries:
        rows, tokens, biases = zip(*entries, strict=True)
        at = (to_device(logits.device, rows, torch.long), to_device(logits.device, tokens, torch.long))
        out.index_put_(at, out[at] + to_device(logits.device, biases, torch.float32))
    if allowed:  # every id outside a row's allowed ones -inf, from each set's mask, made once
        rows = to_device(device, list(allowed), torch.long)
        masks = torch.stack(list(allowed.values()))
        out.index_copy_(0, rows, out.index_select(0, rows).masked_fill_(masks, -math.inf))
    return out


@lru_cache(maxsize=256)
def _allowed_mask(allowed: tuple[int, ...], vocab: int, device: torch.device) -> torch.Tensor:
    """True for every id outside `allowed` (a request's allowed ids: its rows share one mask, kept for later rounds)."""
    return torch.ones(vocab, dtype=torch.bool, device=device).index_fill_(0, to_device(device, allowed, torch.long), 0)


@lru_cache(maxsize=256)
def _guide_mask(bits: bytes, vocab: int, device: torch.device) -> torch.Tensor:
    """True for every id a guide mask does not allow (bit i of byte i // 8, lowest bit first: a guided state's mask
    comes again and again, so each is unpacked once)."""
    if len(bits) != (vocab + 7) // 8:
        raise ValueError(f"a guide mask of {len(bits)} bytes for a vocabulary of {vocab} ids")
    packed = torch.frombuffer(bytearray(bits), dtype=torch.uint8)
    unpacked = packed[:, None].bitwise_right_shift(torch.arange(8, dtype=torch.uint8)).bitwise_and_(1)
    return unpacked.flatten()[:vocab].eq(0).to(device)


def _adjusted(
    logits: torch.Tensor,
    keys: list[tuple[DrawSpec, int]],
    penalties: Penalties | None,
    guide_masks: list[bytes] | None = None,
) -> torch.Tensor:
    """The logits a round's target draws are made from: each row's logit bias, suppressed ids, allowed ids and guide
    mask, then its penalties (vLLM's order); the MTP chain's drafts follow no guide masks (`guide_masks` None)."""
    logits = _biased(logits, keys, guide_masks)
    return logits if penalties is None else penalties.apply(logits)


def _draw_row(logits: torch.Tensor, spec: DrawSpec, position: int) -> tuple[int, tuple[str, str | None] | None]:
    """`sample_token`'s draw of one row, or -1 and why where it refuses the row (with the request field at fault,
    where the request's own parameters are)."""
    try:
        return sample_token(logits, spec.temperature, spec.top_k, spec.top_p, spec.min_p, spec.seed, position), None
    except ValueError as exc:
        return -1, (f"the token draw failed: {exc}", exc.param if isinstance(exc, SamplingParamError) else None)


def _replays(graphs: RoundGraphs | None) -> dict[str, int]:
    """The graphs' replay counts by kind so far (none without graphs)."""
    return {} if graphs is None else dict(graphs.replays)


def _ran(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """The replays by kind between two counts, the kinds that ran."""
    return {kind: n - before.get(kind, 0) for kind, n in after.items() if n != before.get(kind, 0)}


def _argmaxes(logits: torch.Tensor, kernels: bool) -> torch.Tensor:
    """Each row's most likely token as torch.argmax gives it (ties to the lower id; the first NaN in a row that
    holds one), left on the logits' device: on the kernel path one launch of `argmax_tokens`."""
    if kernels:
        from kernels.sample import argmax_tokens

        return argmax_tokens(logits.contiguous())
    return torch.argmax(logits.float(), dim=-1)
