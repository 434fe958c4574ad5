"""POST /v1/responses: vLLM's further Responses fields are honoured, errors name the Responses fields and quote the
values as sent, and a function's output may come as text parts. Driven as tests/server/test_responses_api.py drives
it: the app over a scripted engine that answers every request with the tokens of one text."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from server.app import ServerState, build_app
from tests.server.test_tool_calls_api import SHIPPED, Answering


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(SHIPPED)


def scripted(tokenizer: Any, answer: str = "Hello there. Bye") -> tuple[TestClient, Answering]:
    engine = Answering(tokenizer, answer)
    return TestClient(build_app(ServerState(engine, tokenizer, "m", 4096, len(tokenizer), (0,)))), engine


def output_text(response: dict[str, Any]) -> str:
    return "".join(part["text"] for item in response["output"] if item["type"] == "message" for part in item["content"])


# vLLM's ResponsesRequest takes these fields beside OpenAI's, and the chat honours each: so does a Responses request

EXTENSIONS = {
    "cache_salt": ("s3cr3t", lambda request, body: request.cache_salt == "s3cr3t"),
    "stop": (["there"], lambda request, body: output_text(body) == "Hello "),
    "repetition_penalty": (1.5, lambda request, body: request.draw.repetition_penalty == 1.5),
    "logit_bias": ({"5": 100}, lambda request, body: dict(request.draw.logit_bias) == {5: 100.0}),
    "ignore_eos": (True, lambda request, body: not request.stop_ids),
    "structured_outputs": ({"choice": ["a", "b"]}, lambda request, body: request.guide is not None),
}


@pytest.mark.parametrize("field", EXTENSIONS)
def test_vllms_responses_fields_are_honoured(tokenizer, field):
    value, honoured = EXTENSIONS[field]
    http, engine = scripted(tokenizer)
    reply = http.post("/v1/responses", json={"input": "hi", field: value})
    assert reply.status_code == 200, reply.text
    assert honoured(engine.submitted[-1], reply.json()), f"{field} was taken and ignored"


# errors of the equivalent chat request name the Responses fields the client sent, and quote its values


@pytest.mark.parametrize(
    ("text_format", "words"),
    [
        ({"type": "json_schema", "schema": {"type": "object"}}, "required"),  # no name
        ({"type": "json_schema", "name": "a b", "schema": {"type": "object"}}, "pattern"),
    ],
)
def test_a_text_format_name_error_names_text_format_name(tokenizer, text_format, words):
    """OpenAI's text.format.name is required and patterned: its error names `text.format.name`, not the chat's
    `response_format.json_schema.name` nor the whole format."""
    http, _ = scripted(tokenizer)
    reply = http.post("/v1/responses", json={"input": "hi", "text": {"format": text_format}})
    error = reply.json()["error"]
    assert reply.status_code == 400 and words in error["message"], error
    assert error["param"] == "text.format.name", error
    assert error["message"].startswith("text.format.name: "), error


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "f"}])
def test_a_tools_parameters_error_names_the_flat_responses_field(tokenizer, tool_choice):
    """A Responses tool is flat ({"type", "name", "parameters"}): its error names `tools.0.parameters`, not the
    chat's `tools.0.function.parameters`."""
    tool = {"type": "function", "name": "f",
            "parameters": {"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}  # fmt: skip
    http, _ = scripted(tokenizer)
    reply = http.post("/v1/responses", json={"input": "hi", "tools": [tool], "tool_choice": tool_choice})
    error = reply.json()["error"]
    assert reply.status_code == 400, error
    assert error["param"] == "tools.0.parameters", error
    assert "function" not in error["message"].split(":", 1)[0], error


def test_a_guide_conflict_error_speaks_of_text_format_not_response_format(tokenizer):
    """text.format with a forced tool choice is refused naming tool_choice, and its message speaks of text.format,
    not of the chat's response_format."""
    http, _ = scripted(tokenizer)
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}}
    text = {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}
    reply = http.post("/v1/responses", json={"input": "hi", "tools": [tool], "tool_choice": "required", "text": text})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == "tool_choice", error
    assert "response_format" not in error["message"], error


def test_a_tool_choice_error_quotes_the_value_as_sent(tokenizer):
    """A choice of a function no tool offers is refused quoting the Responses tool_choice as sent, not the chat's
    nested form."""
    http, _ = scripted(tokenizer)
    reply = http.post("/v1/responses", json={"input": "hi", "tools": [{"type": "function", "name": "f"}],
                                             "tool_choice": {"type": "function", "name": "g"}})  # fmt: skip
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == "tool_choice", error
    assert '"function": {' not in error["message"], error


def test_a_function_call_output_given_as_text_parts_is_read_as_their_text(tokenizer):
    """OpenAI's function_call_output.output is a string or a list of parts: text parts are read as their text, as a
    message's are."""
    http, engine = scripted(tokenizer, "Sunny.")
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    given = [
        {"role": "user", "content": "Weather in Paris?"},
        call,
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "sunny"}]},
    ]
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
    reply = http.post("/v1/responses", json={"input": given, "tools": [tool]})
    assert reply.status_code == 200, reply.text
    assert "sunny" in tokenizer.decode(engine.submitted[-1].prompt_ids)
