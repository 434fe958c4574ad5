"""Guided decoding's request fields (OpenAI's response_format, vLLM's guided_* and structured_outputs): what guide
each gives the engine, where it starts, and the 400s naming the field, through the shipped tokenizer and a scripted
engine."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from server import guide_spec
from server.guide_spec import GuideSpec
from tests.server.test_tool_calls_api import http

THINK_END = 4095  # the shipped tokenizer's one token for "</think>"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["age"]}
ASK = [{"role": "user", "content": "Give me a person."}]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from tests.server.test_tool_calls_api import SHIPPED

    return AutoTokenizer.from_pretrained(SHIPPED)


GRAMMAR = 'root ::= "{" pair "}"\npair ::= "\\"age\\": " [0-9]+'
BOUNDED = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "exclusiveMaximum": 150}}}


@pytest.mark.parametrize(
    ("fields", "guide"),
    [
        ({"response_format": {"type": "json_object"}}, GuideSpec("json", "")),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}},
            GuideSpec("json", json.dumps(SCHEMA)),
        ),
        ({"guided_json": SCHEMA}, GuideSpec("json", json.dumps(SCHEMA))),
        ({"guided_json": json.dumps(SCHEMA)}, GuideSpec("json", json.dumps(SCHEMA))),
        ({"guided_json": BOUNDED}, GuideSpec("json", json.dumps(BOUNDED))),  # a number's bounds are honoured
        ({"guided_regex": "[a-z]+ [0-9]{2}"}, GuideSpec("regex", "[a-z]+ [0-9]{2}")),
        ({"guided_choice": ["yes", "no"]}, GuideSpec("choice", '["yes", "no"]')),
        ({"structured_outputs": {"json": SCHEMA}}, GuideSpec("json", json.dumps(SCHEMA))),
        ({"structured_outputs": {"json_object": True}}, GuideSpec("json", "")),
        ({"structured_outputs": {"regex": "a|b"}}, GuideSpec("regex", "a|b")),
        ({"structured_outputs": {"choice": ["x"]}}, GuideSpec("choice", '["x"]')),
        ({"guided_grammar": GRAMMAR}, GuideSpec("grammar", GRAMMAR)),
        ({"structured_outputs": {"grammar": GRAMMAR}}, GuideSpec("grammar", GRAMMAR)),
        (
            {
                "structured_outputs": {
                    "regex": "a|b",
                    "disable_fallback": True,
                    "disable_additional_properties": False,
                    "disable_any_whitespace": False,
                    "whitespace_pattern": None,
                },
                "guided_decoding_backend": "xgrammar",
            },
            GuideSpec("regex", "a|b"),
        ),  # vLLM's switches that change nothing here
        ({"response_format": {"type": "text"}}, None),
    ],
)
def test_each_guiding_field_gives_the_engine_its_guide(tokenizer, fields, guide):
    client, engine = http(tokenizer, '{"age": 3}')
    reply = client.post("/v1/completions", json={"prompt": "A person:", "max_tokens": 8, **fields})
    assert reply.status_code == 200, reply.text
    assert engine.submitted[-1].guide == guide


@pytest.mark.parametrize(("thinking", "starts_after"), [(True, THINK_END), (False, None)])
def test_a_chat_that_opens_in_a_think_block_is_guided_after_it(tokenizer, thinking, starts_after):
    client, engine = http(tokenizer, 'hmm\n</think>\n\n{"age": 3}' if thinking else '{"age": 3}')
    body = {"messages": ASK, "response_format": {"type": "json_object"}}
    reply = client.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"enable_thinking": thinking}})
    assert reply.status_code == 200, reply.text
    assert engine.submitted[-1].guide == GuideSpec("json", "", starts_after)
    assert json.loads(reply.json()["choices"][0]["message"]["content"]) == {"age": 3}


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "not guided_regex and guided_choice"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "one way to guide"),
        ({"guided_json": {"type": "integer", "multipleOf": 0.1234}}, "guided_json", "/multipleOf"),
        ({"guided_json": "{not json"}, "guided_json", "must be JSON"),
        ({"guided_json": "[1]"}, "guided_json", "a schema must be a JSON object"),
        ({"guided_regex": "(a"}, "guided_regex", "pattern"),
        ({"guided_choice": []}, "guided_choice", "at least 1"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema is given exactly when"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "json_schema"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one of"),
        ({"structured_outputs": {"grammar": "root ::= 'a'"}}, "structured_outputs", "line 1, column 10: unexpected"),
        ({"structured_outputs": {"grammar": 3}}, "structured_outputs.grammar", "string"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern", "not supported"),
        ({"structured_outputs": {"regex": "a", "backend": "x"}}, "structured_outputs.backend", "not permitted"),
        ({"guided_grammar": "root ::= item"}, "guided_grammar", "line 1, column 10: rule 'item' is not defined"),
        ({"guided_grammar": 'root ::= root "a" | "a"'}, "guided_grammar", "left-recursive"),
        ({"guided_grammar": 'root ::= "a"', "guided_regex": "a"}, "guided_grammar", "one way to guide"),
        ({"guided_regex": "a", "min_tokens": 2}, "min_tokens", "not with guided decoding"),
        ({"guided_regex": "a", "allowed_token_ids": [5]}, "allowed_token_ids", "not with guided decoding"),
        ({"guided_regex": "a", "bad_words": ["a"]}, "bad_words", "not with guided decoding"),
        ({"guided_regex": "(" * 400 + "a" + ")" * 400}, "guided_regex", "pattern: nested too deeply"),
        (
            {"guided_json": {"properties": {"{param}": {"multipleOf": 0.1234}}}},
            "guided_json",
            "/properties/{param}/multipleOf",
        ),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "not supported"),
        (
            {"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
            "structured_outputs.disable_any_whitespace",
            "not supported",
        ),
        ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos", "give stop_token_ids"),
    ],
)
def test_a_guide_that_cannot_be_honoured_is_a_400_naming_its_field(tokenizer, fields, param, says):
    client, engine = http(tokenizer, "a")
    reply = client.post("/v1/completions", json={"prompt": "A:", "max_tokens": 8, **fields})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and says in error["message"], error
    assert not engine.submitted


def test_ignore_eos_with_stop_token_ids_is_guided_and_the_ids_end_it(tokenizer):
    client, engine = http(tokenizer, "a")
    body = {"prompt": "A:", "max_tokens": 8, "guided_regex": "a", "ignore_eos": True, "stop_token_ids": [5]}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert engine.submitted[-1].stop_ids == frozenset({5})


def test_the_responses_text_format_guides_as_the_chats_response_format(tokenizer):
    client, engine = http(tokenizer, '{"age": 3}')
    form = {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}
    body = {"input": "Give me a person.", "text": {"format": form}, "reasoning": {"effort": "none"}}
    reply = client.post("/v1/responses", json=body)
    assert reply.status_code == 200, reply.text
    assert engine.submitted[-1].guide == GuideSpec("json", json.dumps(SCHEMA))
    assert reply.json()["text"]["format"] == form
    assert reply.json()["output"][-1]["content"][0]["text"] == '{"age": 3}'
    assert client.post("/v1/responses", json={**body, "text": {"format": {"type": "json_object"}}}).status_code == 200
    assert engine.submitted[-1].guide == GuideSpec("json", "")
    bad = {**form, "schema": {"type": "integer", "multipleOf": 0.1234}}
    error = client.post("/v1/responses", json={**body, "text": {"format": bad}}).json()["error"]
    assert error["param"] == "text.format" and "/multipleOf" in error["message"], error


def test_a_guides_grammar_compiles_off_the_event_loop(tokenizer, monkeypatch):
    """A large schema takes about a second to compile: never on the event loop, which every stream shares (the
    chat, completion and Responses routes' checks compile it)."""
    on_loop = []
    compile_once = guide_spec.compiled

    def compiled(kind: str, source: str, form: bytes | None = None):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:
            on_loop.append(False)
        return compile_once(kind, source, form)

    monkeypatch.setattr(guide_spec, "compiled", compiled)
    client, _ = http(tokenizer, '{"age": 3}')
    form = {"type": "json_schema", "name": "person", "schema": SCHEMA}
    for path, body in (
        ("/v1/chat/completions", {"messages": ASK, "response_format": {"type": "json_schema", "json_schema": form}}),
        ("/v1/completions", {"prompt": "A person:", "max_tokens": 8, "guided_json": SCHEMA}),
        ("/v1/responses", {"input": "A person.", "text": {"format": form}, "reasoning": {"effort": "none"}}),
    ):
        assert client.post(path, json=body).status_code == 200, path
    assert len(on_loop) >= 3 and not any(on_loop), on_loop
