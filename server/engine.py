"""The engine: admission, lanes and rounds, on a thread of its own so the HTTP side never blocks it."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from rankwire.header import DrawSpec, LaneOp, LaneOpCode, LaneRows, RoundPlan
from server.bad_words import BadWords, bad_word_masks, both
from server.drafters import Drafter, History, MtpDrafter
from server.guide_spec import GuideError, GuideSpec
from server.metrics import EngineMetrics
from server.prompt_cache import Kept, PromptCache, prefix_digests

if TYPE_CHECKING:  # the front-end process imports this module for Request and Update: it needs no torch
    from server.guides import GuideCursor, Guides
    from server.runner import LaneResult, LaunchedRound, ModelRunner

log = logging.getLogger(__name__)
# the most prompt rows of requests asking for the prompt's logprobs that one round takes: each row's log-softmax over
# the vocabulary is held on the device at once (a multiple of the GDN chunk)
PROMPT_LOGPROB_ROWS = 128
# the most bytes of guide masks a round header carries (each a bit a vocabulary id, a draw row): windows past it
# verify no drafts that round, so a header stays far inside the control link's frame limit
GUIDE_MASK_BYTES = 16 << 20
FRONT_END_FINISHES = ("abort", "stop")  # the reasons a request may be ended from outside the engine


class ContextLengthError(ValueError):
    """The prompt plus the tokens asked for can never fit the context."""


class EngineStopped(RuntimeError):
    """The engine takes no more work (shutting down, or a rank failed)."""


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A drawn token's raw log-probability (the log-softmax of its row's logits, before any bias or temperature) and
    the most likely ids with theirs, most likely first (ties to the lower id)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class PromptLogprob:
    """A prompt token's raw log-probability given the tokens before it, its rank among all ids (1: the likeliest;
    vLLM's), and the most likely ids with theirs (ties to the lower id)."""

    token: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Update:
    """New tokens for a request, and why it ended (stop, length, abort, error) when it did; `refused`: the engine
    took no work for it (it was shutting down); `error_param`: the request field whose value caused the error, where
    one did (a bad request, not the server's fault); `logprobs`: one per token, where the request asked for them."""

    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    error: str | None = None
    refused: bool = False
    error_param: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[PromptLogprob, ...] = ()  # with its first tokens: each prompt token's after the first


@dataclass(eq=False, slots=True)
class Request:
    """A generation request as the engine sees it; `sink` takes its updates, through the engine's `deliver`."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    draw: DrawSpec
    stop_ids: frozenset[int]
    sink: Callable[[Update], None]
    draft: bool = True
    keep_at: tuple[int, ...] = ()
    cache_salt: str | None = None  # its prompt states are kept and resumed apart from other salts' (vLLM's field)
    # its prompt passes take the prompt's logprobs with that many most likely ids (it resumes no kept state then)
    prompt_logprobs: int | None = None
    guide: GuideSpec | None = None  # the grammar its output follows (guided decoding)
    bad_words: BadWords = ()  # token sequences its output may not hold (vLLM's bad_words)
    priority: int = 0  # under priority scheduling, lower values are admitted first (vLLM's field)
    arrival: float = field(default_factory=time.monotonic)
    cached: int = 0
    keeps: list[int] = field(default_factory=list)
    slot: int | None = None
    prefilled: int = 0
    output: list[int] = field(default_factory=list)
    drafts: tuple[int, ...] = ()
    depth: int = 0  # drafts asked of this lane next round: it adapts to what the lane's windows keep
    history: History | None = None
    last_token_time: float = 0.0
    # tokens launched, unfinished rounds draw for it (up to 2: the round in flight and one planned after it); its
    # next row is planned past them
    drawing: int = 0
    admitted: bool = False  # counted in the metrics and the cache's figures (once, if a failed launch puts it back)
    prompt_taken: list[PromptLogprob] = field(default_factory=list)  # the prompt logprobs until its first update
    guided: GuideCursor | None = None  # its place in its guide's grammar, once admitted


Outbox = list[tuple[Request, Update]]


@dataclass(slots=True)
class Flight:
    """A planned round until it is finished: its plan, the request of each of its rows, the prompt states it keeps,
    and once launched the runner's handle."""

    plan: RoundPlan
    requests: list[Request]
    keeps: list[tuple[bytes, Kept]]
    launched: LaunchedRound | None = None


def check_context(request: Request, context: int, asked_by: str = "max_tokens") -> None:
    """Refuse a request with no prompt, or none to generate, or whose prompt plus max_tokens (the request field
    `asked_by`) can never fit `context` tokens."""
    if not request.prompt_ids:
        raise ValueError("the prompt is empty: a request needs at least one prompt token")
    if request.max_tokens < 1:
        raise ValueError(f"{asked_by}: a request generates at least 1 token, got {request.max_tokens}")
    need = len(request.prompt_ids) + request.max_tokens
    if need > context:
        raise ContextLengthError(
            f"this model's context is {context} tokens; the prompt has {len(request.prompt_ids)} and "
            f"{asked_by} asks for {request.max_tokens} more ({need} in all)"
        )


def deliver_each(batch: Outbox) -> None:
    """Hand each update to its request's sink, in order, on the calling thread."""
    for request, update in batch:
        request.sink(update)


class Engine:
    """Rounds over lanes: each round decodes every live lane and fills prompts within a per-round token budget."""

    def __init__(
        self,
        runner: ModelRunner,
        context: int,
        prompt_budget: int,
        metrics: EngineMetrics | None = None,
        on_fatal: Callable[[str], None] | None = None,
        draft_depth: int = 0,
        drafter: Drafter | None = None,
        prompt_cache: PromptCache | None = None,
        cache_grid: int = 512,
        plan_ahead: bool = False,
        guides: Guides | None = None,
        priority_scheduling: bool = False,
    ) -> None:
        self.runner, self.context, self.prompt_budget = runner, context, prompt_budget
        self.priority_scheduling = priority_scheduling  # admit by each request's priority, else first come first
        self.guides = guides  # the grammars' masks over the vocabulary (None: no tokenizer, nothing is guided)
        self.plan_ahead = plan_ahead  # plan and launch the next round while the GPU runs one that drafts nothing
        self.metrics = metrics
        self.on_fatal = on_fatal  # called once the engine has stopped on a failure (the server then exits)
        self.max_lanes = runner.max_lanes
        self.draft_depth = draft_depth
        self.mtp_depth = draft_depth if runner.can_draft else 0
        self.drafter = drafter or MtpDrafter()
        # whether a request that wants drafts can get any: the MTP drafter proposes nothing without an MTP layer
        self.proposes = bool(draft_depth) and (runner.can_draft or self.drafter.reads_history)
        self.drafted = self.accepted = 0
        self.drafted_at = [0] * draft_depth
        self.accepted_at = [0] * draft_depth
        self.cache = prompt_cache or PromptCache(0)
        self.cache_grid = cache_grid
        # a budget under the runner's alignment never fills a whole chunk, so passes may stop anywhere
        self.align = runner.prompt_align if prompt_budget >= runner.prompt_align else 1
        self.ops: list[LaneOp] = []
        self.new_keeps: list[tuple[bytes, Kept]] = []
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.aborted: dict[str, str] = {}  # request id -> finish reason
        self.to_free: list[int] = []
        self.outbox: Outbox = []
        # how a round's updates reach the sinks: all of them in one call (the HTTP side hops to its event loop once)
        self.deliver: Callable[[Outbox], None] = deliver_each
        self.cond = threading.Condition()
        self.flushing = threading.Lock()
        self.stopped = False
        self.thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        with self.cond:
            self.stopped = True
            self.cond.notify()
        self.thread.join(timeout=10)
        if hasattr(self.runner, "close"):
            self.runner.close()

    def fail(self, message: str) -> None:
        """A failure the ranks cannot recover from: end every request with the error and stop taking work."""
        with self.cond:
            if self.stopped:
                return
            for request in list(self.running):
                self._finish(request, Update((), "error", message))
            while self.waiting:
                self._end(self.waiting.popleft(), Update((), "error", message))
            self.stopped = True
            self.cond.notify()
        try:
            self._flush()
        finally:  # a delivery that fails again (the front end gone) still ends the server
            log.error("stopping: %s", message)
            if self.on_fatal is not None:
                self.on_fatal(message)

    def submit(self, request: Request) -> None:
        """Queue a request; one that can never fit the context is refused at once. A guided one's grammar is
        compiled here, on the submitting thread (Guides.prepare)."""
        check_context(request, self.context)
        if request.guide is not None and self.guides is not None:
            self.guides.prepare(request.guide)
            request.guide = request.guide.without_compiled_form()
        with self.cond:
            if self.stopped:
                raise EngineStopped("the server is shutting down")
            self.waiting.append(request)
            self.cond.notify()

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """End a request for `reason`: "abort" (its client went away) or "stop" (a stop string matched, which the
        front end finds); its lane is freed next round, and `reason` is its finish reason."""
        if reason not in FRONT_END_FINISHES:
            raise ValueError(f"abort: reason {reason!r} is not one of {FRONT_END_FINISHES}")
        with self.cond:
            self.aborted[request_id] = reason
            self.cond.notify()

    def counts(self) -> tuple[int, int]:
        """(requests running, requests waiting)."""
        with self.cond:
            return len(self.running), len(self.waiting)

    def stats(self) -> dict[str, object]:
        """The engine's part of /health: requests, lanes, drafts and the prompt cache (read under the lock: the
        engine thread changes them)."""
        with self.cond:
            return {
                "requests_running": len(self.running),
                "requests_waiting": len(self.waiting),
                "lanes": self.max_lanes,
                "draft_depth": self.draft_depth,
                "draft_tokens": self.drafted,
                "accepted_draft_tokens": self.accepted,
                "draft_acceptance": self.accepted / self.drafted if self.drafted else None,
                "draft_acceptance_per_position": [
                    accepted / drafted if drafted else None
                    for drafted, accepted in zip(self.drafted_at, self.accepted_at, strict=True)
                ],
                "prompt_cache": {
                    "budget_bytes": self.cache.budget,
                    "bytes": self.cache.nbytes,
                    "entries": len(self.cache.entries),
                    "queries": self.cache.queries,
                    "hits": self.cache.hits,
                    "cached_tokens": self.cache.cached_tokens,
                },
            }

    def _idle(self) -> bool:
        """Whether no round is due (lock held)."""
        return not self.stopped and not self.running and not self.waiting and not self.to_free

    def _loop(self) -> None:
        """Run rounds until stopped; a failure outside a round's own launch and finish (the engine's bookkeeping, a
        sink, the trace) leaves the engine's state unknown, so it ends every request and stops, as a peer's does."""
        try:
            self._rounds()
        except Exception as exc:
            log.error("the engine failed", exc_info=exc)
            self.fail(f"the engine failed: {type(exc).__name__}: {exc}")

    def _rounds(self) -> None:
        flight: Flight | None = None  # a launched round not finished yet: the next one is planned and launched first
        while True:
            with self.cond:
                idle = self._idle() and flight is None
            if idle:  # no round follows to carry them: deliver the last round's updates now
                self._flush()
            with self.cond:
                while self._idle() and flight is None:
                    self.cond.wait()
                stopped = self.stopped
                if not stopped:
                    start = time.perf_counter()
                    trace = self.runner.trace
                    trace.start()
                    plan, requests = self._plan()
                    keeps, self.new_keeps = self.new_keeps, []
                    trace.mark("plan")
            if stopped:  # the round in flight, and the last one finished, still hand their tokens over
                if flight is not None:
                    self._complete(flight)
                self._flush()
                return
            plan = self._with_row_masks(plan, requests)
            launched = None
            if flight is None or plan.rows or plan.ops or plan.allocate or plan.free:
                launched = self._launch(Flight(plan, requests, keeps))
            if flight is not None:
                self._complete(flight)
                if launched is not None:  # the next round runs meanwhile: hand the finished one's tokens over now
                    self._flush()
            flight = None
            if launched is not None:
                if self.plan_ahead and launched.plan.rows and self._ahead(launched):
                    flight = launched
                else:
                    self._complete(launched)
            trace.mark("post")
            trace.write()
            if self.metrics is not None:
                self.metrics.round_seconds.observe(time.perf_counter() - start)

    def _plan(self) -> tuple[RoundPlan, list[Request]]:
        """Drop aborted requests, admit waiting ones to free lanes, and lay out this round's rows (lock held); the
        plan, and the request of each of its rows. A request whose token a launched round still draws gets a
        prior-draw row after it."""
        for request in [r for r in self.running if r.request_id in self.aborted]:
            self._finish(request, Update((), self.aborted[request.request_id]))
        for request in [r for r in self.waiting if r.request_id in self.aborted]:  # no lane yet: only its finish
            self.waiting.remove(request)
            self._end(request, Update((), self.aborted[request.request_id]))
        self.aborted.clear()
        used = {r.slot for r in self.running}
        free_slots = [s for s in range(self.max_lanes) if s not in used]
        allocate, ops = [], self.ops
        self.ops = []
        while self.waiting and free_slots:
            request = self._next_waiting()
            if not self._guide(request):
                continue
            request.slot = free_slots.pop(0)
            allocate.append(request.slot)
            self.running.append(request)
            self._admit(request, ops)
            if self.metrics is not None and not request.admitted:
                self.metrics.prompt_tokens.inc(len(request.prompt_ids))
            request.admitted = True
        rows, budget = [], self.prompt_budget
        logprob_rows = PROMPT_LOGPROB_ROWS  # rows whose every logit row's log-softmax this round holds at once
        for request in self.running:
            prompt = request.prompt_ids
            depth = min(request.depth, self.mtp_depth)
            if request.drawing:  # its token is being drawn: the next row takes it on the device, if one follows
                if len(request.output) + request.drawing < request.max_tokens:
                    start = len(prompt) + len(request.output) + request.drawing - 1
                    rows.append(LaneRows(request.slot, (0,), start, request.draw, prior_draw=True))
                    request.drawing += 1
            elif request.prefilled == len(prompt):
                start = len(prompt) + len(request.output) - 1
                room = min(request.max_tokens - len(request.output), self.context - start) - 1
                drafts = request.drafts[: max(room, 0)]
                depth = self._chain_depth(depth, start + len(drafts))
                rows.append(LaneRows(request.slot, (request.output[-1],), start, request.draw, drafts, depth))
                request.drawing += 1
            elif budget > 0:
                asked = request.prompt_logprobs is not None
                take = self._pass_length(request, min(budget, logprob_rows) if asked else budget)
                if take == 0:
                    continue
                logprob_rows -= take if asked else 0
                while request.keeps and request.keeps[0] <= request.prefilled + take:  # kept inside this round
                    self._keep_state(request, ops, request.keeps[0] - request.prefilled)
                chunk = tuple(prompt[request.prefilled : request.prefilled + take])
                done = request.prefilled + take == len(prompt)
                draw = request.draw if done else None
                # every prompt pass feeds the MTP layer, drafting or not: its kept states may resume a drafting lane
                depth = self._chain_depth(self.mtp_depth, request.prefilled + take - 1)
                rows.append(
                    LaneRows(request.slot, chunk, request.prefilled, draw, draft_depth=depth,
                             prompt_logprobs=request.prompt_logprobs)
                )  # fmt: skip
                request.prefilled += take  # the next plan goes on from there, whether or not this round finished
                request.drawing += done
                budget -= take
        free, self.to_free = tuple(self.to_free), []
        owners = {request.slot: request for request in self.running}
        plan = RoundPlan(allocate=tuple(allocate), free=free, rows=tuple(rows), ops=tuple(ops))
        return plan, [owners[row.slot] for row in rows]

    def _with_row_masks(self, plan: RoundPlan, requests: list[Request]) -> RoundPlan:
        """The plan with each masked draw row's mask (a guide's and the bad words', both), made outside the lock (a
        grammar state's first mask walks the vocabulary): each row's after the drafts before it. A window whose masks
        would take the round's past GUIDE_MASK_BYTES verifies no drafts this round (drafts never change a token)."""
        if not any(request.guided or request.bad_words for request in requests):
            return plan
        rows, room = [], GUIDE_MASK_BYTES
        for row, request in zip(plan.rows, requests, strict=True):
            if row.draw is not None and (request.guided or request.bad_words):
                masks = self._row_masks(request, row.drafts)
                if row.drafts and sum(map(len, masks)) > room:
                    row, masks = replace(row, drafts=()), self._row_masks(request, ())
                room -= sum(map(len, masks))
                row = replace(row, guide_masks=masks)
            rows.append(row)
        return replace(plan, rows=tuple(rows))

    def _row_masks(self, request: Request, drafts: tuple[int, ...]) -> tuple[bytes, ...]:
        """A window's draw rows' masks: its guide's and its bad words', an id allowed where both allow it."""
        guided = request.guided.row_masks(drafts) if request.guided else ()
        if not request.bad_words:
            return guided
        return both(guided, bad_word_masks(request.bad_words, request.output, drafts, self.runner.vocab_size))

    def _guide(self, request: Request) -> bool:
        """Place a guided request at the start of its grammar (lock held); False, ending it, where it cannot be."""
        if request.guide is None:
            return True
        if self.guides is None:
            self._end(
                request, Update((), "error", "guided decoding needs the model's tokenizer, which this server lacks")
            )
            return False
        request.guided = self.guides.cursor(request.guide, tuple(sorted(request.stop_ids)))
        return True

    def _chain_depth(self, depth: int, last: int) -> int:
        """The MTP chain's depth after a window whose last row is at position `last`: the chain's last row lies
        `depth - 2` past the lane's next pending token, itself at most one past `last`, so this keeps it inside the
        context (the lane pool is sized for it); at least 1 while `depth` is, as a prompt pass feeds the MTP layer."""
        return min(depth, self.context - last)

    def _pass_length(self, request: Request, budget: int) -> int:
        """Rows of this round's prompt pass: the rest of the prompt if the budget holds it, else as many as the
        budget holds up to a multiple of the alignment (0: none this round)."""
        rest = len(request.prompt_ids) - request.prefilled
        if rest <= budget:
            return rest
        return max((request.prefilled + budget) // self.align * self.align - request.prefilled, 0)

    def _next_waiting(self) -> Request:
        """The waiting request a free lane takes (lock held): the first in line, or under priority scheduling the
        first of those with the lowest priority value, as vLLM's scheduler picks them (a running one is never put
        back for it)."""
        if not self.priority_scheduling:
            return self.waiting.popleft()
        chosen = min(self.waiting, key=lambda request: request.priority)  # the first of equals
        self.waiting.remove(chosen)
        return chosen

    def _admit(self, request: Request, ops: list[LaneOp]) -> None:
        """Resume the longest kept prefix of the prompt, and plan where its prompt pass keeps states: a grid of
        positions, the given message boundaries, and one token before the end, each rounded down to the alignment."""
        prompt = request.prompt_ids
        request.depth = self.draft_depth if request.draft else 0
        hit = None
        if request.prompt_logprobs is None:  # a resumed prefix would have no logits for its prompt logprobs
            hit = self.cache.lookup(prompt, counted=not request.admitted, salt=request.cache_salt)
        if hit is not None:
            ops.append(LaneOp(LaneOpCode.RESTORE, request.slot, hit.handle))
            request.prefilled = request.cached = hit.length
        if self.cache.enabled:
            grid = range(self.cache_grid, len(prompt) - 1, self.cache_grid)
            marks = {k // self.align * self.align for k in (*grid, *request.keep_at, len(prompt) - 1)}
            request.keeps = sorted(k for k in marks if request.prefilled < k < len(prompt))

    def _keep_state(self, request: Request, ops: list[LaneOp], after: int) -> None:
        """Keep the lane's state at its next boundary, `after` rows into this round (a prompt pass runs through its
        boundaries: the forward snapshots each row), unless that prefix is kept already."""
        position = request.keeps.pop(0)
        digest = prefix_digests(request.prompt_ids, [position], request.cache_salt)[position]
        if self.cache.wants(digest) and all(d != digest for d, _ in self.new_keeps):
            handle = self.cache.new_handle()
            ops.append(LaneOp(LaneOpCode.KEEP, request.slot, handle, after))
            self.new_keeps.append((digest, Kept(handle, position, 0)))

    def _launch(self, planned: Flight) -> Flight | None:
        """Launch a planned round (the updates gathered so far are delivered once its forward is on its way); None
        if that failed (a round in flight before it is still finished)."""
        try:
            # the updates gathered so far reach the HTTP side while the GPU runs this round, so its streaming
            # work overlaps the forward instead of holding the GIL between rounds
            planned.launched = self.runner.launch(planned.plan, launched=self._flush)
        except Exception as exc:
            self._failed(planned, exc)
            return None
        return planned

    def _ahead(self, flight: Flight) -> bool:
        """Whether the next round may be planned before this launched one is finished: its finish changes no lane
        (`LaunchedRound.ahead_safe`), none of its requests wants drafts that can be proposed (from its tokens), and
        none is guided or has bad words."""
        wants_drafts = self.proposes and any(request.draft for request in flight.requests)
        # a masked lane's next masks follow this round's tokens
        masked = any(request.guided or request.bad_words for request in flight.requests)
        return flight.launched.ahead_safe and not wants_drafts and not masked

    def _complete(self, flight: Flight) -> None:
        """Finish a launched round and hand each lane's kept tokens to its request: while the MTP chain runs, if the
        round drafts (delivered then, not after its drafts are read back), else once it is finished."""
        taken: dict[int, tuple[int, ...]] = {}  # by id(request): the tokens a request kept and goes on after
        told: list[bool] = []
        own: list[Exception] = []  # a failure of the engine's own work inside the runner's call

        def tokens_known(results: list[LaneResult]) -> None:
            told.append(True)
            try:
                self._take_tokens(flight, results, taken)
                self._flush()
            except Exception as exc:
                own.append(exc)
                raise

        try:
            results = self.runner.finish(flight.launched, tokens_known=tokens_known)
        except Exception as exc:
            if own:  # the engine's bookkeeping or a sink failed, not the round: it stops the engine as elsewhere
                raise own[0] from None
            self._failed(flight, exc)
            return
        if not told:
            self._take_tokens(flight, results, taken)
        with self.cond:
            for digest, kept in flight.keeps:
                kept.nbytes = self.runner.kept_bytes(kept.handle)
                self.ops += [LaneOp(LaneOpCode.DROP, 0, h) for h in self.cache.add(digest, kept)]
            for request, result in zip(flight.requests, results, strict=True):
                if id(request) in taken and request in self.running:
                    self._propose(request, taken[id(request)], result.drafts)

    def _take_tokens(self, flight: Flight, results: list[LaneResult], taken: dict[int, tuple[int, ...]]) -> None:
        """Each lane's kept tokens to its request (ending it at a stop or its length), or its draw's error; `taken`
        gets the tokens of each request that goes on."""
        now = time.monotonic()
        with self.cond:
            for rows, request, result in zip(flight.plan.rows, flight.requests, results, strict=True):
                if request not in self.running:
                    continue  # it ended after this round was planned (a stop token the round before, an abort)
                request.drawing -= rows.draw is not None
                request.prompt_taken += result.prompt
                if result.tokens:
                    self._count_drafts(len(rows.drafts), result.accepted)
                    self._adapt_depth(request, len(rows.drafts), result.accepted)
                    if self._keep(request, result.tokens, now, result.logprobs):
                        taken[id(request)] = result.tokens
                if result.error is not None and request in self.running:  # a draw of its own failed
                    self._finish(request, Update((), "error", result.error, error_param=result.error_param))

    def _failed(self, flight: Flight, exc: Exception) -> None:
        """A round failed: with several ranks the ranks' states are unknown, so the engine stops; else each request
        with rows in it ends with the error, and the prompt states its plan would have kept are dropped."""
        log.error("round failed", exc_info=exc)
        if self.runner.linked:  # a failed round leaves the other rank's state unknown
            self.fail(f"the round failed: {exc}")
            return
        with self.cond:
            # the round's keeps were never made (or not all): drop their handles wherever they exist
            self.ops += [LaneOp(LaneOpCode.DROP, 0, kept.handle) for _, kept in flight.keeps]
            if flight.launched is None:  # its launch failed, perhaps part way through its lane operations
                self._unapply(flight)
            for request in flight.requests:
                if request in self.running:
                    self._finish(request, Update((), "error", f"the round failed: {exc}"))

    def _unapply(self, flight: Flight) -> None:
        """After a failed launch (lock held): its drops are asked again (a drop is idempotent), and the requests it
        admitted without rows, whose lanes may not exist, go back to the front of the queue to be admitted afresh."""
        plan, ran = flight.plan, {id(request) for request in flight.requests}
        self.ops += [op for op in plan.ops if op.code is LaneOpCode.DROP]
        back = [r for r in self.running if r.slot in plan.allocate and id(r) not in ran]
        for request in reversed(back):
            self.running.remove(request)
            self.to_free.append(request.slot)
            request.slot, request.prefilled, request.cached, request.keeps = None, 0, 0, []
            self.waiting.appendleft(request)

    def _keep(
        self, request: Request, tokens: tuple[int, ...], now: float, logprobs: tuple[TokenLogprob, ...] = ()
    ) -> bool:
        """Append a round's tokens (with their logprobs, if any), stopping at a stop token or max_tokens; whether the
        request goes on."""
        taken: list[int] = []
        prompt, request.prompt_taken = tuple(request.prompt_taken), []  # with the first tokens, once
        for token in tokens:
            self._record_token(request, now)
            request.output.append(token)
            taken.append(token)
            if request.guided is not None:
                try:
                    request.guided.take(token)
                except GuideError as exc:  # a broken contract: this request ends with it, the others go on
                    log.error("guided request %s: %s", request.request_id, exc)
                    self._finish(request, Update(tuple(taken), "error", str(exc)))
                    return False
            if token in request.stop_ids or len(request.output) >= request.max_tokens:
                finish = "stop" if token in request.stop_ids else "length"
                self._finish(
                    request, Update(tuple(taken), finish, logprobs=logprobs[: len(taken)], prompt_logprobs=prompt)
                )
                return False
        self.outbox.append((request, Update(tuple(taken), logprobs=logprobs, prompt_logprobs=prompt)))
        return True

    def _propose(self, request: Request, tokens: tuple[int, ...], mtp: tuple[int, ...]) -> None:
        """Plan the lane's next drafts from its text with the round's new tokens and the MTP layer's drafts, a guided
        lane's fitted to its grammar (lock held)."""
        if request.draft and self.draft_depth:
            if request.history is None:
                request.history = History(request.prompt_ids)
            request.history.extend(tokens)
            request.drafts = self.drafter.propose(request.history, request.depth, mtp)
            if request.guided is not None:
                request.drafts = request.guided.drafts(request.drafts, request.depth)

    def _adapt_depth(self, request: Request, drafted: int, accepted: int) -> None:
        """One more draft after a window kept whole, one fewer after a window that kept none (at least one, at most
        --drafts): verification costs rows, and a lane that never keeps drafts should not pay for many. Output is
        the same whatever the depth."""
        if drafted and accepted == drafted:
            request.depth = min(request.depth + 1, self.draft_depth)
        elif drafted and not accepted:
            request.depth = max(request.depth - 1, 1)

    def _count_drafts(self, drafted: int, accepted: int) -> None:
        """Totals and per draft position: position i was verified if the window had more than i drafts, kept if more
        than i were accepted."""
        self.drafted += drafted
        self.accepted += accepted
        for position in range(drafted):
            self.drafted_at[position] += 1
            self.accepted_at[position] += position < accepted
        if self.metrics is not None and drafted:
            self.metrics.count_drafts(drafted, accepted)

    def _record_token(self, request: Request, now: float) -> None:
        if self.metrics is None:
            return
        if request.output:
            self.metrics.inter_token_latency.observe(now - request.last_token_time)
        else:
            self.metrics.time_to_first_token.observe(now - request.arrival)
        self.metrics.generation_tokens.inc()
        request.last_token_time = now

    def _finish(self, request: Request, update: Update) -> None:
        """Send the last update, release the lane (next round's plan frees the slot on every rank)."""
        self.running.remove(request)
        self.to_free.append(request.slot)
        self._end(request, update)

    def _end(self, request: Request, update: Update) -> None:
        """Count a request's end in the metrics and queue its last update."""
        if self.metrics is not None:
            seconds = time.monotonic() - request.arrival
            self.metrics.count_end(update.finish_reason, seconds, len(request.prompt_ids), len(request.output))
        self.outbox.append((request, update))

    def _flush(self) -> None:
        """Deliver the updates gathered so far in one call, outside the engine's lock; one flush at a time, so they
        reach the sinks in the order they were gathered whichever thread flushes (a failure comes from a watcher)."""
        with self.flushing:
            with self.cond:
                batch, self.outbox = self.outbox, []
            if batch:
                self.deliver(batch)
