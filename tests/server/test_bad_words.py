"""vLLM's bad_words: words spelled in tokens as vLLM spells them, the ids each draw row may not take, and through the
engine and the shipped model: the output never holds a bad word, drafted = undrafted, planned ahead = in turn."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from model.shipped import SHIPPED_MODEL
from model.weights import load_model
from rankwire.header import DrawSpec
from server.bad_words import bad_word_ids, bad_word_masks, banned, both
from server.engine import Engine, Request
from tests.server.engine_harness import Outcome, RecordingRunner
from tests.server.test_tool_calls_api import http

GREEDY = DrawSpec(0.0, 0, 1.0, 0.0, 1)
SAMPLED = DrawSpec(0.9, 40, 0.95, 0.0, 4321)
TOKENS = 40


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(SHIPPED_MODEL))


@pytest.fixture(scope="module")
def model():
    return load_model(SHIPPED_MODEL, dtype="float32")


def allowed(bits: bytes, vocab: int) -> set[int]:
    return {i for i in range(vocab) if bits[i // 8] >> (i % 8) & 1}


def test_a_word_is_spelled_as_written_and_with_a_leading_space_where_that_is_a_word_of_its_own(tokenizer):
    alone, spaced = tokenizer.encode("return", add_special_tokens=False), tokenizer.encode(" return")
    assert len(alone) == len(spaced) and alone[0] != spaced[0]  # the shipped tokenizer has both
    assert bad_word_ids(tokenizer, ["  return"]) == (tuple(alone), tuple(spaced))
    word = "xyzzy"  # spaced, it takes another number of tokens: only as written
    assert len(tokenizer.encode(" " + word)) != len(tokenizer.encode(word))
    assert bad_word_ids(tokenizer, [word]) == (tuple(tokenizer.encode(word)),)


def test_a_words_last_id_is_banned_where_the_output_ends_with_the_rest():
    words = ((5,), (1, 2, 3), (7, 8))
    assert banned(words, []) == {5}  # the prompt never counts: only a one-token word at the first position
    assert banned(words, [9, 1, 2]) == {5, 3}
    assert banned(words, [1, 7]) == {5, 8}
    assert banned(words, [2]) == {5}


def test_each_draw_row_is_masked_as_if_the_output_went_on_with_the_drafts_before_it():
    words = ((1, 2, 3), (4,))
    masks = bad_word_masks(words, [1], (2, 3), vocab=10)
    assert [set(range(10)) - allowed(mask, 10) for mask in masks] == [{4}, {4, 3}, {4}]
    assert both(masks, ()) == masks and both((), masks) == masks
    guided = (bytes([0b0000_1110, 0]),) * 3
    assert [allowed(mask, 10) for mask in both(masks, guided)] == [{1, 2, 3}, {1, 2}, {1, 2, 3}]


def serve(model, jobs, *, depth: int = 3, plan_ahead: bool = False) -> tuple[list[list[int]], RecordingRunner]:
    """(prompt, draw, bad words) jobs served together for TOKENS tokens each."""
    runner = RecordingRunner(model, len(jobs))
    engine = Engine(runner, 4096, 64, draft_depth=depth, plan_ahead=plan_ahead)
    runner.engine = engine
    outcomes = [Outcome() for _ in jobs]
    engine.start()
    try:
        for i, ((prompt, draw, words), outcome) in enumerate(zip(jobs, outcomes, strict=True)):
            request = Request(f"r{i}", prompt, TOKENS, draw, frozenset(), outcome.sink, draft=depth > 0)
            request.bad_words = words
            engine.submit(request)
        for outcome in outcomes:
            assert outcome.done.wait(300)
    finally:
        engine.stop()
    assert all(o.finish == "length" for o in outcomes), [o.error for o in outcomes]
    return [o.tokens for o in outcomes], runner


def holds(tokens: list[int], word: tuple[int, ...]) -> bool:
    return any(tuple(tokens[i : i + len(word)]) == word for i in range(len(tokens)))


@pytest.mark.parametrize("draw", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_the_output_holds_no_bad_word_drafted_or_not_alone_or_among_others(model, tokenizer, draw):
    prompt = tokenizer.encode("def merge_sorted(left, right):\n    ")
    (plain,), _ = serve(model, [(prompt, draw, ())])
    words = (tuple(plain[3:5]), (plain[10],))  # a pair it drew, and a token it drew
    (drafted,), runner = serve(model, [(prompt, draw, words)])
    assert drafted != plain and not any(holds(drafted, word) for word in words)
    (undrafted,), _ = serve(model, [(prompt, draw, words)], depth=0)
    assert drafted == undrafted
    assert any(row.drafts and row.guide_masks for plan in runner.plans for row in plan.rows)
    together, _ = serve(model, [(prompt, draw, words), (prompt[:-1], GREEDY, ())])
    assert together[0] == drafted


def test_a_lane_with_bad_words_is_never_planned_ahead_and_gives_the_tokens_of_rounds_in_turn(model, tokenizer):
    prompt = tokenizer.encode("import os\n\n")
    (plain,), _ = serve(model, [(prompt, GREEDY, ())], depth=0)
    jobs = [(prompt, GREEDY, (tuple(plain[2:4]),)), (prompt[:-1], SAMPLED, ())]
    ahead, runner = serve(model, jobs, depth=0, plan_ahead=True)
    assert ahead == serve(model, jobs, depth=0)[0]
    slot = runner.plans[0].rows[0].slot
    assert not any(row.prior_draw and row.slot == slot for plan in runner.plans for row in plan.rows)


def test_bad_words_reach_the_engine_in_tokens_and_bad_ones_are_a_400(tokenizer):
    client, engine = http(tokenizer, "ok")
    reply = client.post("/v1/completions", json={"prompt": "A:", "max_tokens": 4, "bad_words": ["return", "xyzzy"]})
    assert reply.status_code == 200, reply.text
    spelled = [tuple(tokenizer.encode(text, add_special_tokens=False)) for text in ("return", " return", "xyzzy")]
    assert engine.submitted[-1].bad_words == tuple(spelled)
    for fields, says in (
        ({"bad_words": ["ok", " "]}, "word 1 is empty"),
        ({"bad_words": ["\x1c"]}, "word 0 is empty"),  # str.lstrip strips it, as vLLM's does
        ({"bad_words": ["w"] * 129}, "at most 128"),
        ({"bad_words": ["ok"], "allowed_token_ids": [5, 7]}, "not with allowed_token_ids"),
    ):
        error = client.post("/v1/completions", json={"prompt": "A:", **fields}).json()["error"]
        assert error["param"] == "bad_words" and says in error["message"], error
    assert len(engine.submitted) == 1


def test_a_bad_word_past_the_models_vocabulary_is_a_400(tokenizer):
    """vLLM refuses them too: a model narrower than its tokenizer could never draw such an id anyway."""
    from fastapi.testclient import TestClient

    from server.app import ServerState, build_app
    from tests.server.test_tool_calls_api import Answering

    engine = Answering(tokenizer, "ok")
    client = TestClient(build_app(ServerState(engine, tokenizer, "m", 4096, 100, (0,))))  # 100 ids wide
    error = client.post("/v1/completions", json={"prompt": "A:", "bad_words": ["return"]}).json()["error"]
    assert error["param"] == "bad_words" and "outside the vocabulary (size 100)" in error["message"], error
