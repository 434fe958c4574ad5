"""Rounds planned ahead (`--plan-ahead on`): while the GPU runs a round that drafts nothing, the engine plans and
launches the next one, whose rows take their tokens from the round before's draws on the device. The tokens are
the same as with each round finished before the next is planned, whatever ends a request (its length, a stop
token, an abort), alone or among others, greedy or sampled, on the reference path and the kernel path."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import dataclasses
import json
import threading

import pytest
from make_checkpoint import make_checkpoint

from model import kernel_path
from model.weights import load_model
from rankwire.header import DrawSpec, LaneRows, RoundPlan
from server.drafters import MtpDrafter, ScriptedDrafter
from server.engine import Engine, Request, Update
from server.metrics import EngineMetrics
from server.round_trace import RoundTrace
from server.runner import ModelRunner
from tests.server.engine_harness import Outcome, RecordingRunner, run
from tests.tiny import KERNEL_TEXT, checkpoint, text_config

PROMPTS = [[7, 19, 40, 33, 2, 91, 12, 44, 8, 13], [5, 6, 7], [60, 61, 62, 63, 64, 65, 66]]
DRAWS = [DrawSpec(0.0, 0, 1.0, 0.0, 1), DrawSpec(0.9, 20, 0.95, 0.0, 77), DrawSpec(0.0, 0, 1.0, 0.0, 3)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(checkpoint(tmp_path_factory.mktemp("ahead") / "m"), dtype="float32")


@pytest.mark.parametrize("budget", [4, 64], ids=["prompts-in-chunks", "whole-prompts"])
def test_rounds_planned_ahead_give_the_tokens_of_rounds_in_turn(model, budget: int) -> None:
    apart, _ = run(model, PROMPTS, 12, DRAWS, draft=False, budget=budget)
    ahead, runner = run(model, PROMPTS, 12, DRAWS, draft=False, budget=budget, plan_ahead=True)
    assert ahead == apart
    assert runner.ahead >= 10  # most rounds were launched before the one before them was finished
    assert any(row.prior_draw for plan in runner.plans for row in plan.rows)


def test_each_request_planned_ahead_equals_itself_alone(model) -> None:
    together, _ = run(model, PROMPTS, 10, DRAWS, draft=False, budget=8, plan_ahead=True)
    for prompt, draw, tokens in zip(PROMPTS, DRAWS, together, strict=True):
        (alone,), _ = run(model, [prompt], 10, [draw], draft=False)
        assert tokens == alone


def test_logprobs_planned_ahead_or_drafted_equal_those_of_rounds_in_turn(model) -> None:
    """A round planned ahead takes its logprobs before the next round is launched, and a verify window's kept rows
    give theirs: each request's logprobs equal those of rounds run in turn, undrafted."""
    draws = [dataclasses.replace(draw, logprobs=k) for draw, k in zip(DRAWS, (0, 3, None), strict=True)]
    apart, in_turn = run(model, PROMPTS, 12, draws, draft=False, budget=8)
    ahead, planned = run(model, PROMPTS, 12, draws, draft=False, budget=8, plan_ahead=True)

    calls = []

    def drafts(history, wanted: int) -> tuple[int, ...]:
        """The tokens the request will draw, every other time with the second one wrong: verify windows kept whole
        and cut short both give the logprobs of their kept rows."""
        calls.append(wanted)
        for prompt, tokens in zip(PROMPTS, apart, strict=True):
            if history[: len(prompt)] == prompt:
                done = len(history) - len(prompt)
                proposal = list(tokens[done : done + wanted])
                if len(calls) % 2 and len(proposal) > 1:
                    proposal[1] = (proposal[1] + 1) % model.cfg.vocab_size
                return tuple(proposal)
        raise AssertionError("not a prompt of this test")

    drafted, verified = run(model, PROMPTS, 12, draws, budget=8, drafter=ScriptedDrafter(drafts))
    assert ahead == apart == drafted and planned.ahead > 0
    windows = [(len(rows.drafts), r.accepted) for plan, results in zip(verified.plans, verified.rounds, strict=True)
               for rows, r in zip(plan.rows, results, strict=True) if rows.drafts and r.tokens]  # fmt: skip
    assert any(a == n for n, a in windows) and any(a == 1 < n for n, a in windows)  # kept whole, and cut short
    logprobs = [[outcome.logprobs for outcome in r.outcomes] for r in (in_turn, planned, verified)]
    assert logprobs[1] == logprobs[0] == logprobs[2]
    assert [len(each) for each in logprobs[0]] == [12, 12, 0]
    assert [len(lp.top) for lp in logprobs[0][0] + logprobs[0][1]] == [0] * 12 + [3] * 12
    assert all(lp.top[0][1] >= lp.logprob for lp in logprobs[0][1])  # the likeliest first, the drawn among them


def test_a_drafting_round_is_finished_before_the_next_is_planned(model) -> None:
    drafted, runner = run(model, PROMPTS[:1], 16, DRAWS[:1], budget=64, plan_ahead=True)
    (plain,), _ = run(model, PROMPTS[:1], 16, DRAWS[:1], draft=False)
    assert drafted == [plain]
    assert runner.ahead == 0 and not any(row.prior_draw for plan in runner.plans for row in plan.rows)


def serve_with_stops(model, plan_ahead: bool, stops: list[frozenset[int]], abort_after: int | None = None):
    """The prompts served together with stop tokens, the second aborted once `abort_after` of its tokens arrived."""
    runner = RecordingRunner(model, len(PROMPTS))
    engine = Engine(runner, context=256, prompt_budget=64, plan_ahead=plan_ahead)
    outcomes = [Outcome() for _ in PROMPTS]
    engine.start()
    try:
        for i, (prompt, draw, stop) in enumerate(zip(PROMPTS, DRAWS, stops, strict=True)):
            sink = outcomes[i].sink
            if i == 1 and abort_after is not None:

                def sink(update, _sink=sink, _outcome=outcomes[i]):
                    _sink(update)
                    if len(_outcome.tokens) >= abort_after and update.finish_reason is None:
                        threading.Thread(target=engine.abort, args=("r1",)).start()

            engine.submit(Request(f"r{i}", prompt, 20, draw, stop, sink, draft=False))
        for outcome in outcomes:
            assert outcome.done.wait(120)
    finally:
        engine.stop()
    return [(o.tokens, o.finish) for o in outcomes], runner


def test_a_stop_token_ends_a_request_planned_ahead_and_its_lane_goes_to_the_next(model) -> None:
    (reference,), _ = run(model, PROMPTS[:1], 20, DRAWS[:1], draft=False)
    stops = [frozenset({reference[4]}), frozenset(), frozenset()]
    apart, _ = serve_with_stops(model, False, stops)
    ahead, runner = serve_with_stops(model, True, stops)
    assert ahead == apart and runner.ahead > 0
    assert ahead[0] == (reference[: reference.index(reference[4]) + 1], "stop")
    assert [finish for _, finish in ahead[1:]] == ["length", "length"]


def test_an_abort_while_a_round_is_planned_ahead_ends_only_its_request(model) -> None:
    stops = [frozenset()] * 3
    apart, _ = serve_with_stops(model, False, stops)
    ahead, _ = serve_with_stops(model, True, stops, abort_after=3)
    assert ahead[1][1] == "abort" and ahead[1][0] == apart[1][0][: len(ahead[1][0])]
    assert ahead[0] == apart[0] and ahead[2] == apart[2]


def test_the_kernel_path_takes_the_prior_draws_on_the_device(tmp_path) -> None:
    kernel_model = load_model(
        make_checkpoint(text_config("base", **KERNEL_TEXT), tmp_path, fmt="bf16"), "cpu", "bfloat16", kernels="on"
    )
    apart, _ = run(kernel_model, PROMPTS[:2], 4, DRAWS[:2], draft=False, budget=16)  # interpreted: a few rounds
    ahead, runner = run(kernel_model, PROMPTS[:2], 4, DRAWS[:2], draft=False, budget=16, plan_ahead=True)
    assert ahead == apart and runner.ahead > 0


def test_a_prior_draw_row_needs_a_round_before_that_drew_one_token_for_its_lane(model) -> None:
    runner = ModelRunner(model, 2)
    greedy = DRAWS[0]
    first = runner.launch(RoundPlan(allocate=(0, 1), rows=(LaneRows(0, (5, 6), 0, greedy), LaneRows(1, (7,), 0, None))))
    with pytest.raises(RuntimeError, match="lane slot 1 takes the round before's draw"):
        runner.launch(RoundPlan(rows=(LaneRows(1, (0,), 1, greedy, prior_draw=True),)))
    (token,) = runner.finish(first)[0].tokens
    ahead = runner.finish(runner.launch(RoundPlan(rows=(LaneRows(0, (0,), 2, greedy, prior_draw=True),))))
    stepped = ModelRunner(model, 1)
    stepped.execute(RoundPlan(allocate=(0,), rows=(LaneRows(0, (5, 6), 0, greedy),)))
    assert ahead == stepped.execute(RoundPlan(rows=(LaneRows(0, (token,), 2, greedy),)))


def test_a_lane_freed_while_a_round_is_in_flight_gives_its_pool_slot_to_the_next_request(tmp_path) -> None:
    """Every lane in use and a request waiting: the first request's stop token frees its lane while the round after
    it (its row computed past the stop) is in flight; the waiting request takes the same pool slot, so the pool
    neither grows nor leaves its graphs."""
    kernel_model = load_model(
        make_checkpoint(text_config("base", **KERNEL_TEXT), tmp_path, fmt="bf16"), "cpu", "bfloat16", kernels="on"
    )
    pool = kernel_path.lane_pool(kernel_model, slots=2, context=64)
    (reference,), _ = run(kernel_model, PROMPTS[:1], 6, DRAWS[:1], draft=False)
    runner = RecordingRunner(kernel_model, 2)
    engine = Engine(runner, context=64, prompt_budget=64, plan_ahead=True)
    outcomes = [Outcome() for _ in PROMPTS]
    engine.start()
    try:
        for i, (prompt, draw, outcome) in enumerate(zip(PROMPTS, DRAWS, outcomes, strict=True)):
            stops = frozenset({reference[2]}) if i == 0 else frozenset()
            engine.submit(Request(f"r{i}", prompt, 6, draw, stops, outcome.sink, draft=False))
        assert all(outcome.done.wait(120) for outcome in outcomes)
    finally:
        engine.stop()
    assert outcomes[0].finish == "stop" and [o.finish for o in outcomes[1:]] == ["length", "length"]
    assert runner.ahead > 0 and (pool.slots, pool.generation) == (2, 0)


def test_copy_drafts_are_still_proposed_and_verified_when_rounds_may_be_planned_ahead(tmp_path) -> None:
    """A checkpoint without an MTP layer: its rounds never pass rows to it, so only a request's wish for drafts
    (proposed from its tokens, on the host) keeps its rounds from being planned ahead."""
    plain = load_model(checkpoint(tmp_path / "m"), dtype="float32")
    plain.mtp = None
    (reference,), _ = run(plain, PROMPTS[:1], 16, DRAWS[:1], draft=False)

    def script(history, wanted):
        done = len(history) - len(PROMPTS[0])
        return tuple(reference[done : done + wanted])

    (drafted,), runner = run(plain, PROMPTS[:1], 16, DRAWS[:1], drafter=ScriptedDrafter(script), plan_ahead=True)
    assert drafted == reference
    assert any(rows.drafts for plan in runner.plans for rows in plan.rows) and runner.ahead == 0


def test_mtp_drafts_on_a_checkpoint_without_an_mtp_layer_let_rounds_be_planned_ahead(tmp_path) -> None:
    """The MTP drafter proposes only what the MTP layer chained, so without that layer a request's wish for drafts
    proposes nothing and must not keep its rounds in turn."""
    plain = load_model(checkpoint(tmp_path / "m"), dtype="float32")
    plain.mtp = None
    (reference,), _ = run(plain, PROMPTS[:1], 16, DRAWS[:1], draft=False)
    (drafted,), runner = run(plain, PROMPTS[:1], 16, DRAWS[:1], drafter=MtpDrafter(), plan_ahead=True)
    assert drafted == reference
    assert runner.ahead >= 10 and not any(rows.drafts for plan in runner.plans for rows in plan.rows)


class LaunchCounting(RecordingRunner):
    """Counts the rounds launched, so a test can tell which launch a token was delivered in."""

    launches = 0

    def launch(self, plan, launched=None):
        self.launches += 1
        return super().launch(plan, launched)


@pytest.mark.parametrize("plan_ahead", [False, True], ids=["in-turn", "ahead"])
def test_a_rounds_tokens_are_delivered_before_the_round_after_next_is_launched(model, plan_ahead: bool) -> None:
    """Token k is drawn by round k (a prompt round, then one decode round a token) and reaches its sink by the
    launch of round k + 1, planned ahead or not: a token held back until the launch after would arrive a round
    late."""
    runner = LaunchCounting(model, 1)
    engine = Engine(runner, context=256, prompt_budget=64, plan_ahead=plan_ahead)
    outcome, seen = Outcome(), []

    def sink(update: Update) -> None:
        seen.extend(runner.launches - (len(outcome.tokens) + i) for i in range(1, len(update.token_ids) + 1))
        outcome.sink(update)

    engine.submit(Request("r0", PROMPTS[0], 8, DRAWS[0], frozenset(), sink, draft=False))
    engine.start()
    try:
        assert outcome.done.wait(60)
    finally:
        engine.stop()
    assert len(seen) == 8 and max(seen) <= 1, seen


@pytest.mark.parametrize("plan_ahead", [False, True], ids=["in-turn", "ahead"])
def test_requests_admitted_without_rows_in_a_launch_that_failed_are_admitted_again(model, monkeypatch, plan_ahead):
    """Three requests admitted in one round whose prompt budget gives rows to the first only; its launch fails while
    allocating the lanes (as an out-of-memory error would). The first ends with the error; the other two, whose
    lanes may not exist, are admitted afresh and served as if alone, their prompts counted once."""
    alone = [run(model, [prompt], 4, [DRAWS[0]], draft=False)[0][0] for prompt in PROMPTS[1:]]
    new_lane, calls = model.new_lane, []

    def fails_first(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("out of memory (injected)")
        return new_lane(*args)

    monkeypatch.setattr(model, "new_lane", fails_first)
    metrics = EngineMetrics("m")
    engine = Engine(RecordingRunner(model, 3), context=256, prompt_budget=4, metrics=metrics, plan_ahead=plan_ahead)
    outcomes = [Outcome() for _ in PROMPTS]
    for i, (prompt, outcome) in enumerate(zip(PROMPTS, outcomes, strict=True)):
        engine.submit(Request(f"r{i}", prompt, 4, DRAWS[0], frozenset(), outcome.sink, draft=False))
    engine.start()
    try:
        assert all(outcome.done.wait(60) for outcome in outcomes)
    finally:
        engine.stop()
    assert [o.finish for o in outcomes] == ["error", "length", "length"]
    assert [o.tokens for o in outcomes[1:]] == alone
    admitted = metrics.registry.get_sample_value("flashnext:prompt_tokens_total", {"model_name": "m"})
    assert admitted == sum(map(len, PROMPTS))


def test_a_failed_launch_fails_its_own_round_and_the_round_in_flight_still_finishes(model) -> None:
    """Two lanes, three requests: the second ends after two tokens and the third takes its lane in a round whose
    launch fails, while the round drawing the first request's last token is in flight (the first has no row in the
    failed round): the first still ends on its length, with all its tokens, and only the third fails."""
    (reference,), _ = run(model, PROMPTS[:1], 3, DRAWS[:1], draft=False)

    class FailsTheSecondUseOfSlot1(RecordingRunner):
        uses = 0

        def launch(self, plan, launched=None):
            self.uses += 1 in plan.allocate
            if self.uses == 2 and 1 in plan.allocate:
                raise RuntimeError("injected")
            return super().launch(plan, launched)

    runner = FailsTheSecondUseOfSlot1(model, 2)
    engine = Engine(runner, context=256, prompt_budget=64, plan_ahead=True)
    outcomes = [Outcome() for _ in PROMPTS]
    for i, (prompt, draw, tokens) in enumerate(zip(PROMPTS, DRAWS, (3, 2, 4), strict=True)):
        engine.submit(Request(f"r{i}", prompt, tokens, draw, frozenset(), outcomes[i].sink, draft=False))
    engine.start()
    try:
        assert all(outcome.done.wait(60) for outcome in outcomes)
    finally:
        engine.stop()
    assert [o.finish for o in outcomes] == ["length", "length", "error"] and runner.uses == 2
    assert outcomes[0].tokens == reference


def test_a_traced_round_planned_ahead_notes_its_own_lanes_rows_and_replays(tmp_path) -> None:
    """A round finished a trace line later than it was launched: its facts are noted where it is launched."""
    kernel_model = load_model(
        make_checkpoint(text_config("base", **KERNEL_TEXT), tmp_path, fmt="bf16"), "cpu", "bfloat16", kernels="on"
    )
    kernel_path.lane_pool(kernel_model, slots=2, context=64)
    kernel_path.enable_graphs(kernel_model, {"trunk": 4})
    launched = {}
    for plan_ahead in (False, True):
        path = tmp_path / f"rank0-{plan_ahead}.trace"
        engine = Engine(ModelRunner(kernel_model, 2, trace=RoundTrace(path)), 64, 64, plan_ahead=plan_ahead)
        outcomes = [Outcome(), Outcome()]
        for i, (tokens, outcome) in enumerate(zip((6, 3), outcomes, strict=True)):
            engine.submit(Request(f"r{i}", PROMPTS[i], tokens, DRAWS[i], frozenset(), outcome.sink, draft=False))
        engine.start()
        try:
            assert all(outcome.done.wait(120) for outcome in outcomes)
        finally:
            engine.stop()
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        launched[plan_ahead] = [
            (line["lanes"], line["rows"], line["replays"]) for line in lines if "forward" in line["phases"]
        ]
    assert launched[True] == launched[False]
    assert [replays for _, _, replays in launched[True]] == [{}] + [{"trunk": 1}] * 5  # the prompts' round is eager
