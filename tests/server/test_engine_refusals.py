"""Requests the engine's own interface (server/engine.py) cannot serve are refused at submit, and the others go on."""

from __future__ import annotations

import pytest

from model.weights import load_model
from rankwire.header import DrawSpec
from server.engine import Engine, Request
from tests.server.engine_harness import Outcome, RecordingRunner
from tests.tiny import checkpoint

GREEDY = DrawSpec(0.0, 0, 1.0, 0.0, 1)
PROMPT = [7, 19, 40, 33, 2, 91, 12, 44]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(checkpoint(tmp_path_factory.mktemp("review-engine") / "m"), dtype="float32")


def serve_alone(model, prompt: list[int], max_tokens: int) -> Outcome:
    """One request on a fresh one-lane engine."""
    engine = Engine(RecordingRunner(model, 1), context=64, prompt_budget=16)
    outcome = Outcome()
    engine.start()
    try:
        engine.submit(Request("alone", prompt, max_tokens, GREEDY, frozenset(), outcome.sink, draft=False))
        assert outcome.done.wait(60), "the request did not finish"
    finally:
        engine.stop()
    return outcome


def test_a_request_for_no_tokens_is_refused(model):
    """max_tokens below 1 is refused at submit, as vLLM refuses it (one token was drawn and given)."""
    engine = Engine(RecordingRunner(model, 1), context=64, prompt_budget=16)
    engine.start()
    try:
        for asked in (0, -2):
            with pytest.raises(ValueError, match="max_tokens"):
                engine.submit(Request("none", PROMPT, asked, GREEDY, frozenset(), Outcome().sink, draft=False))
    finally:
        engine.stop()


def test_an_empty_prompt_is_refused_at_submit_and_does_not_end_the_other_requests(model):
    """An empty prompt is refused at submit (it was queued, and its first plan raised in the engine's thread, which
    ended every request with an error and stopped the engine)."""
    reference = serve_alone(model, PROMPT, 3)
    engine = Engine(RecordingRunner(model, 2), context=64, prompt_budget=16)
    empty, other = Outcome(), Outcome()
    engine.start()
    try:
        refused = False
        try:
            engine.submit(Request("empty", [], 3, GREEDY, frozenset(), empty.sink, draft=False))
        except ValueError:
            refused = True
        engine.submit(Request("other", PROMPT, 3, GREEDY, frozenset(), other.sink, draft=False))
        assert other.done.wait(60), "the other request did not finish"
    finally:
        engine.stop()
    assert (other.tokens, other.finish, other.error) == (reference.tokens, "length", None)
    assert refused, f"an empty prompt was queued (it ended with {empty.finish!r}: {empty.error})"
