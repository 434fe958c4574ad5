"""A draw that fails (a temperature that overflows the logits) ends its own request with the error; the requests
batched beside it go on as if alone."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
from make_checkpoint import make_checkpoint

from model.weights import load_model
from rankwire.header import DrawSpec
from server.engine import Engine, Request
from tests.server.engine_harness import Outcome, RecordingRunner, run
from tests.tiny import KERNEL_TEXT, checkpoint, text_config

PROMPTS = [[7, 19, 40, 33, 2, 91, 12, 44, 8, 13], [5, 6, 7]]
GREEDY = DrawSpec(0.0, 0, 1.0, 0.0, 1)
OVERFLOWS = DrawSpec(1e-40, 0, 1.0, 0.0, 2)  # every logit over it is infinite


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(checkpoint(tmp_path_factory.mktemp("fails") / "m"), dtype="float32")


def serve_beside_an_overflow(model, plan_ahead: bool, draft: bool) -> None:
    """A greedy request served beside one whose every draw fails: only the second ends, with the error."""
    (alone,), _ = run(model, PROMPTS[:1], 8, [GREEDY], draft=False)
    engine = Engine(RecordingRunner(model, 2), context=256, prompt_budget=64, draft_depth=2, plan_ahead=plan_ahead)
    outcomes = [Outcome(), Outcome()]
    for i, (prompt, draw, outcome) in enumerate(zip(PROMPTS, (GREEDY, OVERFLOWS), outcomes, strict=True)):
        engine.submit(Request(f"r{i}", prompt, 8, draw, frozenset(), outcome.sink, draft=draft))
    engine.start()
    try:
        assert all(outcome.done.wait(60) for outcome in outcomes)
    finally:
        engine.stop()
    assert [o.finish for o in outcomes] == ["length", "error"]
    assert outcomes[0].tokens == alone and outcomes[1].tokens == []
    assert "temperature 1e-40 overflows" in outcomes[1].error


@pytest.mark.parametrize("plan_ahead", [False, True], ids=["in-turn", "ahead"])
@pytest.mark.parametrize("draft", [False, True], ids=["undrafted", "drafted"])
def test_a_failed_draw_ends_only_its_own_request(model, plan_ahead: bool, draft: bool) -> None:
    serve_beside_an_overflow(model, plan_ahead, draft)


def test_a_draw_the_batched_kernel_refuses_ends_only_its_own_request(tmp_path) -> None:
    kernel_model = load_model(
        make_checkpoint(text_config("base", **KERNEL_TEXT), tmp_path, fmt="bf16"), "cpu", "bfloat16", kernels="on"
    )
    serve_beside_an_overflow(kernel_model, plan_ahead=True, draft=False)
