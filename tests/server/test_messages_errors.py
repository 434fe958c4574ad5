"""POST /v1/messages and /v1/messages/count_tokens: a forced call nested past Python's recursion limit is still a
Message, and errors name the Messages fields and quote the values as sent (the app over a scripted engine)."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from server.app import ServerState, build_app
from tests.server.test_tool_calls_api import SHIPPED, Answering

ASK = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(SHIPPED)


def scripted(tokenizer: Any, answer: str, per_update: int = 2, context: int = 4096) -> TestClient:
    engine = Answering(tokenizer, answer, per_update)
    app = build_app(ServerState(engine, tokenizer, "m", context, len(tokenizer), (0,)))
    return TestClient(app, raise_server_exceptions=False)  # a crash is the client's 500, as a real server's


def test_a_forced_calls_deeply_nested_input_is_a_message_not_a_500(tokenizer):
    """A forced (named) tool call whose arguments nest deeper than Python reads: a Message with its tool_use block,
    streamed or not, as the chat answers it."""
    arguments = '{"a": ' + "[" * 2000 + "]" * 2000 + "}"
    http = scripted(tokenizer, arguments, per_update=500, context=20000)
    tool = {"name": "f", "input_schema": {"type": "object"}}
    body = {"model": "m", "max_tokens": 4000, "messages": ASK, "tools": [tool],
            "tool_choice": {"type": "tool", "name": "f"}}  # fmt: skip
    streamed = http.post("/v1/messages", json={**body, "stream": True})
    assert streamed.status_code == 200 and "event: message_stop" in streamed.text  # the stream copes
    whole = http.post("/v1/messages", json=body)
    assert whole.status_code == 200, whole.text[:200]
    assert [block["type"] for block in whole.json()["content"]] == ["tool_use"]


@pytest.mark.parametrize(
    ("fields", "chat_words", "messages_words"),
    [
        # a forced call's schema error: the chat's tools.0.function.parameters is the Messages tools.0.input_schema
        ({"tools": [{"name": "t", "input_schema": {"type": "nonsense"}}], "tool_choice": {"type": "tool", "name": "t"}},
         "function.parameters", "tools.0.input_schema"),
        # tool_choice any without tools: the chat's value would be "required"
        ({"tool_choice": {"type": "any"}}, '"required"', "tool_choice"),
        # a named tool_choice that names no tool: the chat's would be {"type": "function", ...}
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, '"function"', "tool_choice"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_errors_name_the_messages_fields_and_values_not_the_chats(tokenizer, fields, chat_words, messages_words, path):
    """Refusals name the Messages fields and quote the values the client sent, not the translated chat request's."""
    http = scripted(tokenizer, "ok")
    response = http.post(path, json={"model": "m", "max_tokens": 4, "messages": ASK, **fields})
    error = response.json()
    assert response.status_code == 400 and error["type"] == "error", response.text
    message = error["error"]["message"]
    assert chat_words not in message and messages_words in message, message
