"""A draw that fails (a temperature that overflows the logits) ends its own request with the error; the requests
batched beside it go on as if alone."""

from __future__ import annotations

import os
from types import SimpleNamespace

os.environ["TRITON_INTERPRET"] = "1"

import pytest
from make_checkpoint import make_checkpoint

from model.weights import load_model
from rankwire.header import DrawSpec
from server.engine import Engine, Request
from server.prompt_cache import PromptCache
from tests.server.engine_harness import Outcome, RecordingRunner, run
from tests.tiny import KERNEL_TEXT, checkpoint, text_config

PROMPTS = [[7, 19, 40, 33, 2, 91, 12, 44, 8, 13], [5, 6, 7]]
GREEDY = DrawSpec(0.0, 0, 1.0, 0.0, 1)
OVERFLOWS = DrawSpec(1e-40, 0, 1.0, 0.0, 2)  # every logit over it is infinite


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(checkpoint(tmp_path_factory.mktemp("fails") / "m"), dtype="float32")


def serve_beside_an_overflow(model, plan_ahead: bool, draft: bool, depth: int = 2, tokens: int = 8) -> RecordingRunner:
    """A greedy request of `tokens` tokens served beside one whose every draw fails: only the second ends, with the
    error."""
    (alone,), _ = run(model, PROMPTS[:1], tokens, [GREEDY], draft=False)
    runner = RecordingRunner(model, 2)
    engine = Engine(runner, context=256, prompt_budget=64, draft_depth=depth, plan_ahead=plan_ahead)
    outcomes = [Outcome(), Outcome()]
    for i, (prompt, draw, outcome) in enumerate(zip(PROMPTS, (GREEDY, OVERFLOWS), outcomes, strict=True)):
        engine.submit(Request(f"r{i}", prompt, tokens, draw, frozenset(), outcome.sink, draft=draft))
    engine.start()
    try:
        assert all(outcome.done.wait(60) for outcome in outcomes)
    finally:
        engine.stop()
    assert [o.finish for o in outcomes] == ["length", "error"]
    assert outcomes[0].tokens == alone and outcomes[1].tokens == []
    assert "temperature 1e-40 overflows" in outcomes[1].error
    assert outcomes[1].error_param == "temperature"  # the request's own field: a bad request, not a server error
    return runner


@pytest.mark.parametrize("plan_ahead", [False, True], ids=["in-turn", "ahead"])
@pytest.mark.parametrize("draft", [False, True], ids=["undrafted", "drafted"])
def test_a_failed_draw_ends_only_its_own_request(model, plan_ahead: bool, draft: bool) -> None:
    serve_beside_an_overflow(model, plan_ahead, draft)


def test_a_failed_draw_in_a_round_planned_ahead_ends_only_its_own_request(model) -> None:
    """With drafts on, a prompt pass feeds the MTP layer, so the round of a first draw is never planned past; without
    them the next round is launched before the failed draw is read, its row for that lane taking the draw on the
    device (-1, for which 0 stands in): that row's results must be dropped with the request."""
    runner = serve_beside_an_overflow(model, plan_ahead=True, draft=False, depth=0)
    assert any(rows.prior_draw and rows.slot == 1 for plan in runner.plans for rows in plan.rows)


def test_a_draw_the_batched_kernel_refuses_ends_only_its_own_request(tmp_path) -> None:
    kernel_model = load_model(
        make_checkpoint(text_config("base", **KERNEL_TEXT), tmp_path, fmt="bf16"), "cpu", "bfloat16", kernels="on"
    )
    runner = serve_beside_an_overflow(kernel_model, plan_ahead=True, draft=False, depth=0, tokens=4)  # interpreted
    assert any(rows.prior_draw and rows.slot == 1 for plan in runner.plans for rows in plan.rows)


def first_drafts(model, first: DrawSpec | None, prompt: list[int]) -> tuple[int, ...]:
    """The drafts of `prompt`'s first drawing round, greedy and drafting, served after a request (drawn by `first`)
    for its first 20 tokens, whose prompt pass keeps the states it resumes from; None: served fresh."""
    runner = RecordingRunner(model, 1)
    cache = PromptCache(1 << 30 if first is not None else 0)
    engine = Engine(runner, 256, 64, draft_depth=3, prompt_cache=cache, cache_grid=8)
    engine.start()
    try:
        if first is not None:
            before = Outcome()
            engine.submit(Request("before", prompt[:20], 4, first, frozenset(), before.sink, draft=False))
            assert before.done.wait(60)
        outcome = Outcome()
        engine.submit(Request("after", prompt, 4, GREEDY, frozenset(), outcome.sink))
        assert outcome.done.wait(60) and outcome.finish == "length"
    finally:
        engine.stop()
    plan, results = next(
        (plan, results)
        for plan, results in zip(runner.plans[::-1], runner.rounds[::-1], strict=True)
        if plan.rows and plan.rows[0].draw is not None and plan.rows[0].start < 24
    )  # the last request's first drawing round (it resumes at 19 when the cache holds its prefix)
    assert plan.rows[0].start == (0 if first is None else 19)
    return results[0].drafts


@pytest.mark.parametrize("first", [GREEDY, OVERFLOWS], ids=["drawn", "failed"])
def test_the_states_kept_by_a_prompt_pass_whose_draw_failed_resume_as_fresh(model, first: DrawSpec) -> None:
    """Its prompt pass's keeps go into the prompt cache: the MTP layer's part of them must hold the pass's rows, as a
    pass whose draw succeeded gives them, so a request resumed from them drafts as if served fresh."""
    prompt = [(13 * i) % 300 + 6 for i in range(24)]
    fresh = first_drafts(model, None, prompt)
    assert fresh and first_drafts(model, first, prompt) == fresh


def test_a_row_the_device_refused_stays_refused_though_the_host_would_draw_it(model) -> None:
    """A round planned ahead has already taken 0 for a refused row on the device; taking the host's token instead
    would give that lane two different histories, so the lane ends with an error that names the disagreement."""
    import torch

    from rankwire.header import LaneRows
    from server.runner import ModelRunner

    runner = ModelRunner(model, 2)
    rows = (LaneRows(0, (5,), 3, GREEDY), LaneRows(1, (6,), 7, GREEDY))
    logits = torch.zeros(2, model.cfg.vocab_size)
    drawn = SimpleNamespace(tolist=lambda: [-1, 4])  # the device refused row 0, which greedy draws as token 0
    tokens, refusals = runner._draw(rows, logits, drawn, None)
    assert tokens == [-1, 4]
    assert set(refusals) == {0} and "the batched draw and sample_token disagree" in refusals[0][0]
    assert refusals[0][1] is None  # the server's fault, not a parameter's


def test_the_host_redraws_a_refused_row_with_its_logit_bias(model) -> None:
    """A temperature that overflows only the biased logits (105 / t, not 5 / t): the device refused the row, and the
    host's draw, from the same biased logits, names the temperature; without the bias the host would draw a token and
    report a disagreement, the server's fault."""
    import torch

    from rankwire.header import LaneRows
    from server.runner import ModelRunner

    runner = ModelRunner(model, 1)
    logits = torch.full((1, model.cfg.vocab_size), 5.0)
    t = 1e-37  # 5 / t is finite, 105 / t is not
    rows = (LaneRows(0, (5,), 3, DrawSpec(t, 0, 1.0, 0.0, 1, logit_bias=((9, 100.0),))),)
    drawn = SimpleNamespace(tolist=lambda: [-1])
    tokens, refusals = runner._draw(rows, logits, drawn, None)
    assert tokens == [-1] and refusals[0][1] == "temperature" and "overflows" in refusals[0][0]


def test_the_host_redraws_a_refused_row_with_its_penalties(model) -> None:
    """As with the bias: a repetition penalty of 0.5 doubles the seen id's logit, which then overflows at this
    temperature; the host redraws from the round's penalized logits and names the temperature."""
    from array import array

    import torch

    from rankwire.header import LaneRows
    from server.penalties import PenaltyMarks
    from server.runner import ModelRunner

    runner = ModelRunner(model, 1)
    logits = torch.full((1, model.cfg.vocab_size), 5.0)
    spec = DrawSpec(2e-38, 0, 1.0, 0.0, 1, repetition_penalty=0.5, output_from=1)  # 5 / t is finite, 10 / t is not
    marks = PenaltyMarks(1)
    marks.start(0, array("i", [9]), 1, model.cfg.vocab_size, torch.device("cpu"))
    penalties = marks.penalties([(0, spec, ())], torch.device("cpu"))
    drawn = SimpleNamespace(tolist=lambda: [-1])
    tokens, refusals = runner._draw((LaneRows(0, (5,), 1, spec),), logits, drawn, penalties)
    assert tokens == [-1] and refusals[0][1] == "temperature" and "overflows" in refusals[0][0]
