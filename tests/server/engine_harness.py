"""Drive the engine directly (no HTTP): submit requests, wait for them, read their tokens and round results."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from model.flashnext import FlashNextModel
from rankwire.header import DrawSpec
from server.drafters import Drafter
from server.engine import Engine, PromptLogprob, Request, TokenLogprob, Update
from server.prompt_cache import PromptCache
from server.runner import LaneResult, ModelRunner


@dataclass(slots=True)
class Outcome:
    """One request's tokens and how it ended (with the error and the request field at fault, if that is how)."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)
    finish: str | None = None
    error: str | None = None
    error_param: str | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def sink(self, update: Update) -> None:
        self.tokens.extend(update.token_ids)
        self.logprobs.extend(update.logprobs)
        self.prompt_logprobs.extend(update.prompt_logprobs)
        if update.finish_reason is not None:
            self.finish, self.error, self.error_param = update.finish_reason, update.error, update.error_param
            self.done.set()


class RecordingRunner(ModelRunner):
    """A runner that keeps every round's plan and results (windows, accept lengths, drafts)."""

    def __init__(self, model: FlashNextModel, max_lanes: int) -> None:
        super().__init__(model, max_lanes)
        self.rounds: list[list[LaneResult]] = []
        self.plans = []
        self.ahead = 0
        self.engine: Engine | None = None
        self.outcomes: list[Outcome] = []  # each request's, in the order given

    def launch(self, plan, launched=None):
        self.ahead += self.unfinished is not None  # launched before the round before it was finished
        return super().launch(plan, launched)

    def finish(self, launched, tokens_known=None):
        results = super().finish(launched, tokens_known)
        self.plans.append(launched.plan)
        self.rounds.append(results)
        return results


def run(
    model: FlashNextModel,
    prompts: list[list[int]],
    tokens: int,
    draws: list[DrawSpec],
    depth: int = 3,
    drafter: Drafter | None = None,
    draft: bool = True,
    budget: int = 64,
    cache_grid: int | None = None,
    plan_ahead: bool = False,
    lanes: int | None = None,
    prompt_logprobs: int | None = None,
) -> tuple[list[list[int]], RecordingRunner]:
    """Serve the prompts together (ignoring EOS) and return each one's tokens; with `cache_grid` a prompt cache keeps
    lane states on that grid and before each prompt's last token; `lanes` (default: one per prompt) lane slots."""
    runner = RecordingRunner(model, lanes or max(len(prompts), 1))
    cache = None if cache_grid is None else PromptCache(1 << 30)
    engine = Engine(
        runner, context=4096, prompt_budget=budget, draft_depth=depth, drafter=drafter, prompt_cache=cache,
        cache_grid=cache_grid or 512, plan_ahead=plan_ahead,
    )  # fmt: skip
    runner.engine = engine
    outcomes = runner.outcomes = [Outcome() for _ in prompts]
    engine.start()
    try:
        for i, (prompt, draw, outcome) in enumerate(zip(prompts, draws, outcomes, strict=True)):
            request = Request(f"r{i}", prompt, tokens, draw, frozenset(), outcome.sink, draft=draft)
            request.prompt_logprobs = prompt_logprobs
            engine.submit(request)
        for outcome in outcomes:
            assert outcome.done.wait(300), "a request did not finish"
    finally:
        engine.stop()
    assert all(o.finish == "length" for o in outcomes), [o.finish for o in outcomes]
    return [o.tokens for o in outcomes], runner
