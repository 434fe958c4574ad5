"""Guided decoding through the engine and the shipped model: outputs follow their grammars, and the exactness rules
hold for guided requests (drafted = undrafted, concurrent = solo, planned ahead = in turn)."""

from __future__ import annotations

import json
import re
import threading

import pytest
from transformers import AutoTokenizer

from model.shipped import SHIPPED_MODEL
from model.weights import load_model
from rankwire.header import DrawSpec
from server.engine import Engine, Request
from server.guide_spec import GuideSpec
from server.guides import Guides
from tests.server.engine_harness import Outcome, RecordingRunner

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "size": {"enum": ["S", "M", "L"]}},
    "required": ["name", "size"],
}
REGEX = "[a-z]{2,6}-[0-9]{2}"
CHOICES = ["stack", "queue", "heap"]
GRAMMAR = 'root ::= "[" item (", " item)* "]"\nitem ::= [a-z_]+ | [0-9]+ | root'  # recursive: lists nest
GUIDES = {
    "schema": GuideSpec("json", json.dumps(SCHEMA)),
    "object": GuideSpec("json", ""),
    "regex": GuideSpec("regex", REGEX),
    "choice": GuideSpec("choice", json.dumps(CHOICES)),
    "grammar": GuideSpec("grammar", GRAMMAR),
}
GREEDY = DrawSpec(0.0, 0, 1.0, 0.0, 1)
SAMPLED = DrawSpec(0.9, 40, 0.95, 0.0, 4321)
TOKENS = 32


@pytest.fixture(scope="module")
def model():
    return load_model(SHIPPED_MODEL, dtype="float32")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(SHIPPED_MODEL))


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    return tokenizer.encode("# the answer, as asked:\nanswer = ")


def serve(model, tokenizer, jobs, *, depth: int = 3, plan_ahead: bool = False) -> tuple[list[Outcome], RecordingRunner]:
    """Serve (prompt, draw, guide) jobs together, each ending at EOS or TOKENS tokens."""
    runner = RecordingRunner(model, len(jobs))
    guides = Guides(tokenizer, model.cfg.vocab_size)
    engine = Engine(runner, 4096, 64, draft_depth=depth, plan_ahead=plan_ahead, guides=guides)
    runner.engine = engine
    outcomes = runner.outcomes = [Outcome() for _ in jobs]
    end = frozenset({tokenizer.eos_token_id})
    engine.start()
    try:
        for i, ((prompt, draw, guide), outcome) in enumerate(zip(jobs, outcomes, strict=True)):
            engine.submit(Request(f"r{i}", prompt, TOKENS, draw, end, outcome.sink, draft=depth > 0, guide=guide))
        for outcome in outcomes:
            assert outcome.done.wait(300), "a request did not finish"
    finally:
        engine.stop()
    assert all(o.error is None for o in outcomes), [o.error for o in outcomes]
    return outcomes, runner


def output_bytes(guides: Guides, outcome: Outcome, end: int) -> bytes:
    """The output's bytes, less the end token that stopped it."""
    tokens = outcome.tokens[:-1] if outcome.finish == "stop" and outcome.tokens[-1] == end else outcome.tokens
    return b"".join(guides.vocabulary.token_bytes(token) for token in tokens)


def test_guided_outputs_follow_their_grammars(model, tokenizer, prompt):
    jobs = [(prompt, GREEDY, guide) for guide in GUIDES.values()]
    outcomes, runner = serve(model, tokenizer, jobs)
    guides = runner.engine.guides
    texts = {name: output_bytes(guides, o, tokenizer.eos_token_id) for name, o in zip(GUIDES, outcomes, strict=True)}
    for name, outcome in zip(GUIDES, outcomes, strict=True):
        grammar = GUIDES[name].grammar()
        state = grammar.feed(grammar.initial, texts[name])
        assert state is not None, (name, texts[name])  # every output is a prefix of a match, at least
        assert outcome.finish == "length" or grammar.accepts(state), (name, texts[name])
    for name in ("object", "regex", "choice"):  # these end well inside TOKENS tokens with this model
        assert outcomes[list(GUIDES).index(name)].finish == "stop"
    assert re.fullmatch(REGEX, texts["regex"].decode()) and texts["choice"].decode() in CHOICES
    assert isinstance(json.loads(texts["object"]), dict)
    unguided, _ = serve(model, tokenizer, [(prompt, GREEDY, None)])
    assert unguided[0].tokens not in [o.tokens for o in outcomes]  # the masks moved the output


def test_a_tuple_schema_is_followed_item_by_item_and_drafted_equals_undrafted(model, tokenizer):
    """prefixItems (pydantic's tuples): the output follows the tuple's items in turn, and drafts change no token."""
    schema = {
        "type": "array",
        "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 99}, {"enum": ["a", "b"]}, {"type": "boolean"}],
        "items": False,
        "minItems": 3,
    }
    guide = GuideSpec("json", json.dumps(schema))
    prompt = tokenizer.encode('x = [3, "b", False]\ny = [7, "a", True]\nz = ')
    jobs = [(prompt, draw, guide) for draw in (GREEDY, SAMPLED)]
    drafted, runner = serve(model, tokenizer, jobs, depth=3)
    undrafted, _ = serve(model, tokenizer, jobs, depth=0)
    assert [o.tokens for o in drafted] == [o.tokens for o in undrafted]
    grammar = guide.grammar()
    for outcome in drafted:
        text = output_bytes(runner.engine.guides, outcome, tokenizer.eos_token_id)
        state = grammar.feed(grammar.initial, text)
        assert state is not None and (outcome.finish == "length" or grammar.accepts(state)), text
        assert re.match(rb'\[\s*[0-9]{1,2}\s*,\s*"[ab]"', text), text  # this model writes the first two items


def test_objects_of_listed_keys_and_of_other_keys_are_followed_and_drafted_equals_undrafted(model, tokenizer):
    """A dict keyed by an enum with a count (each key once) and properties beside additionalProperties (other keys
    after them): the outputs follow their grammars, and drafts change no token."""
    keyed = {
        "type": "object",
        "propertyNames": {"enum": ["x", "y", "z"]},
        "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9},
        "minProperties": 2,
    }
    extra = {
        "type": "object",
        "properties": {"x": {"type": "integer"}},
        "required": ["x"],
        "additionalProperties": True,
    }
    guides = [GuideSpec("json", json.dumps(schema)) for schema in (keyed, extra)]
    prompt = tokenizer.encode('p = {"x": 1, "z": 3}\nq = {"y": 2, "x": 5}\nr = ')
    jobs = [(prompt, draw, guide) for draw in (GREEDY, SAMPLED) for guide in guides]
    drafted, runner = serve(model, tokenizer, jobs, depth=3)
    undrafted, _ = serve(model, tokenizer, jobs, depth=0)
    assert [o.tokens for o in drafted] == [o.tokens for o in undrafted]
    for (_, _, guide), outcome in zip(jobs, drafted, strict=True):
        text = output_bytes(runner.engine.guides, outcome, tokenizer.eos_token_id)
        grammar = guide.grammar()
        state = grammar.feed(grammar.initial, text)
        assert state is not None and (outcome.finish == "length" or grammar.accepts(state)), text
        if outcome.finish == "stop":
            value = json.loads(text)
            assert len(value) >= 2 if guide is guides[0] else "x" in value, text


@pytest.mark.parametrize("draw", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_guided_requests_drafted_equal_undrafted(model, tokenizer, prompt, draw):
    jobs = [(prompt, draw, guide) for guide in GUIDES.values()]
    drafted, runner = serve(model, tokenizer, jobs, depth=3)
    undrafted, _ = serve(model, tokenizer, jobs, depth=0)
    assert [o.tokens for o in drafted] == [o.tokens for o in undrafted]
    verified = [row for plan in runner.plans for row in plan.rows if row.drafts and row.guide_masks]
    assert verified, "no guided window verified drafts"
    assert all(len(row.guide_masks) == len(row.drafts) + 1 for row in verified)


@pytest.mark.parametrize("draw", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_guided_window_verifies_only_drafts_its_grammar_allows(model, tokenizer, prompt, draw):
    """The MTP layer's drafts are cut at the first one the grammar refuses (and filled with the text it forces):
    every draft a guided window verifies is allowed by the mask of the row before it."""
    jobs = [(prompt, draw, guide) for guide in GUIDES.values()]
    _, runner = serve(model, tokenizer, jobs, depth=3)
    windows = [row for plan in runner.plans for row in plan.rows if row.drafts and row.guide_masks]
    assert windows, "no guided window verified drafts"
    for row in windows:
        for draft, mask in zip(row.drafts, row.guide_masks, strict=False):
            assert mask[draft // 8] >> (draft % 8) & 1, (row.drafts, draft)


def test_guided_requests_among_others_equal_each_alone(model, tokenizer, prompt):
    jobs = [(prompt, SAMPLED, GUIDES["schema"]), (prompt, GREEDY, None), (prompt[:-1], GREEDY, GUIDES["regex"])]
    together, _ = serve(model, tokenizer, jobs)
    for job, outcome in zip(jobs, together, strict=True):
        (alone,), _ = serve(model, tokenizer, [job])
        assert outcome.tokens == alone.tokens


def test_a_guided_lane_is_never_planned_ahead_and_gives_the_tokens_of_rounds_in_turn(model, tokenizer, prompt):
    jobs = [(prompt, GREEDY, GUIDES["object"]), (prompt[:-1], SAMPLED, None)]
    ahead, runner = serve(model, tokenizer, jobs, depth=0, plan_ahead=True)
    in_turn, _ = serve(model, tokenizer, jobs, depth=0)
    assert [o.tokens for o in ahead] == [o.tokens for o in in_turn]
    guided_slot = runner.plans[0].rows[0].slot
    assert not any(row.prior_draw and row.slot == guided_slot for plan in runner.plans for row in plan.rows)


def test_the_first_draw_of_a_prompt_pass_is_guided(model, tokenizer, prompt):
    """A prompt cut into passes: only its last pass draws, under the grammar's first mask."""
    (outcome,), runner = serve(model, tokenizer, [(prompt * 20, GREEDY, GUIDES["choice"])], depth=0)
    passes = [row for plan in runner.plans for row in plan.rows if len(row.token_ids) > 1]
    assert len(passes) > 1 and not any(row.guide_masks for row in passes[:-1]) and len(passes[-1].guide_masks) == 1
    text = output_bytes(runner.engine.guides, outcome, tokenizer.eos_token_id).decode()
    assert text in CHOICES


def test_an_abort_ends_a_guided_request_and_frees_its_lane(model, tokenizer, prompt):
    runner = RecordingRunner(model, 1)
    engine = Engine(runner, 4096, 64, guides=Guides(tokenizer, model.cfg.vocab_size))
    first, second = Outcome(), Outcome()
    started = threading.Event()

    def sink(update):
        first.sink(update)
        started.set()

    engine.start()
    try:
        end = frozenset({tokenizer.eos_token_id})
        long = GuideSpec("regex", "[a-z]{1000}")  # hundreds of tokens: the abort comes first
        engine.submit(Request("a", prompt, 4000, GREEDY, end, sink, guide=long))
        assert started.wait(60)
        engine.abort("a")
        engine.submit(Request("b", prompt, 8, GREEDY, end, second.sink, guide=GUIDES["choice"]))
        assert first.done.wait(60) and second.done.wait(120)
    finally:
        engine.stop()
    assert first.finish == "abort" and second.finish in ("stop", "length") and second.error is None


def test_windows_past_a_rounds_mask_budget_verify_no_drafts_and_keep_their_tokens(
    model, tokenizer, prompt, monkeypatch
):
    """A round header carries at most GUIDE_MASK_BYTES of masks where drafts would take it past them: the windows
    that would verify no drafts that round, with the same tokens."""
    import server.engine

    jobs = [(prompt, GREEDY, guide) for guide in GUIDES.values()]
    free, free_runner = serve(model, tokenizer, jobs)
    budget = 5 * ((model.cfg.vocab_size + 7) // 8)  # five rows' masks
    monkeypatch.setattr(server.engine, "GUIDE_MASK_BYTES", budget)
    held, runner = serve(model, tokenizer, jobs)
    assert [o.tokens for o in held] == [o.tokens for o in free]

    def drafted_masks(plan) -> list[int]:
        return [sum(map(len, row.guide_masks)) for row in plan.rows if row.guide_masks and row.drafts]

    assert all(sum(drafted_masks(plan)) <= budget for plan in runner.plans)
    assert max(sum(drafted_masks(plan)) for plan in free_runner.plans) > budget  # unbounded, rounds pass it


def test_a_slow_mask_does_not_hold_the_engines_lock(model, tokenizer, prompt, monkeypatch):
    """A grammar state's first mask may walk a large vocabulary: meanwhile /health's stats, submits and aborts go on."""
    import server.guides

    entered, release = threading.Event(), threading.Event()
    packed_mask = server.guides.Guides.packed_mask

    def slow(self, masks, state):
        entered.set()
        assert release.wait(60)
        return packed_mask(self, masks, state)

    monkeypatch.setattr(server.guides.Guides, "packed_mask", slow)
    runner = RecordingRunner(model, 2)
    engine = Engine(runner, 4096, 64, guides=Guides(tokenizer, model.cfg.vocab_size))
    outcome, other = Outcome(), Outcome()
    engine.start()
    try:
        end = frozenset({tokenizer.eos_token_id})
        engine.submit(Request("g", prompt, 4, GREEDY, end, outcome.sink, guide=GUIDES["choice"]))
        assert entered.wait(60)
        answered = threading.Thread(target=engine.stats)
        answered.start()
        answered.join(10)
        assert not answered.is_alive(), "stats waited for the mask"
        engine.submit(Request("p", prompt, 4, GREEDY, end, other.sink))
        engine.abort("p")
        release.set()
        assert outcome.done.wait(120) and other.done.wait(120)
    finally:
        release.set()
        engine.stop()
    assert outcome.error is None and other.finish == "abort"


def test_a_forced_tool_call_served_by_the_shipped_model_follows_the_tools_schema():
    """Through the HTTP API and the engine: a named tool_choice's answer is the function's arguments, drafted or not."""
    import httpx

    from tests.server.live import serve as serve_checkpoint

    parameters = {"type": "object", "properties": {"path": {"type": "string", "maxLength": 24}}, "required": ["path"]}
    tool = {"type": "function", "function": {"name": "read_file", "parameters": parameters}}
    body = {"messages": [{"role": "user", "content": "Read the config."}], "tools": [tool], "max_tokens": 48,
            "tool_choice": {"type": "function", "function": {"name": "read_file"}}, "temperature": 0,
            "chat_template_kwargs": {"enable_thinking": False}}  # fmt: skip
    with serve_checkpoint(SHIPPED_MODEL) as live:
        replies = [
            httpx.post(f"{live.v1}/chat/completions", json={**body, **extra}, timeout=300).json()
            for extra in ({}, {"draft": False})
        ]
    assert replies[0]["token_sha"] == replies[1]["token_sha"]
    (choice,) = replies[0]["choices"]
    assert choice["finish_reason"] == "stop", choice  # a named choice's, as OpenAI's and vLLM's
    (call,) = choice["message"]["tool_calls"]
    arguments = json.loads(call["function"]["arguments"])
    assert call["function"]["name"] == "read_file" and list(arguments) == ["path"]
    assert isinstance(arguments["path"], str) and len(arguments["path"]) <= 24


def test_a_guides_grammar_and_the_vocabulary_are_made_on_the_submitting_thread(model, tokenizer, prompt, monkeypatch):
    """A large schema's compile (about a second) and the vocabulary's tries are made by submit's caller, never on
    the engine's thread, which holds every lane's next round meanwhile."""
    import server.guide_spec
    from server.token_masks import TokenVocabulary

    made_on = []
    compile_regex, make_vocabulary = server.guide_spec.regex_grammar, TokenVocabulary.from_tokenizer.__func__

    def regex_grammar(pattern: str):
        made_on.append(threading.current_thread())
        return compile_regex(pattern)

    def from_tokenizer(cls, tokenizer, vocab_size):
        made_on.append(threading.current_thread())
        return make_vocabulary(cls, tokenizer, vocab_size)

    monkeypatch.setattr(server.guide_spec, "regex_grammar", regex_grammar)
    monkeypatch.setattr(TokenVocabulary, "from_tokenizer", classmethod(from_tokenizer))
    (outcome,), _ = serve(model, tokenizer, [(prompt, GREEDY, GuideSpec("regex", "[a-z]{2,7}_[0-9]{2}"))])
    assert outcome.finish in ("stop", "length")
    assert made_on == [threading.main_thread()] * 2, made_on


def test_the_engine_keeps_no_compiled_form_once_it_has_the_grammar(model, tokenizer, prompt):
    """A front end process's compiled form (megabytes for a large schema) is dropped once the engine's process has
    the grammar: a queued or running request does not hold it."""
    guide = GuideSpec("regex", "[a-z]{2}_[0-9]").with_compiled_form()
    engine = Engine(RecordingRunner(model, 1), 4096, 64, guides=Guides(tokenizer, model.cfg.vocab_size))
    request = Request("r", prompt, TOKENS, GREEDY, frozenset({tokenizer.eos_token_id}), Outcome().sink, guide=guide)
    engine.submit(request)
    assert request.guide == guide and guide.compiled_form is not None and request.guide.compiled_form is None
