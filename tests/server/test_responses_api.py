"""POST /v1/responses (OpenAI's Responses API, a text subset) through the official openai client: the same answer
as the equivalent chat, streamed or not; tool calls as function_call items."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from server.app import ServerState, build_app
from tests.server.live import Live, serve, tiny_chat_checkpoint
from tests.server.test_tool_calls_api import SHIPPED, TWO_CALLS, WEATHER, Answering

ASK = "Sort a list, please."


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Live:
    with serve(tiny_chat_checkpoint(tmp_path_factory.mktemp("responses") / "tiny-chat")) as running:
        yield running


def client(live: Live) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.v1, api_key="unused", max_retries=0, timeout=120)


def chat_answer(live: Live, **fields) -> dict:
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}], **fields}
    return httpx.post(f"{live.v1}/chat/completions", json=body, timeout=120).json()


@pytest.mark.parametrize("max_output_tokens", [12, 3])
def test_a_response_is_the_equivalent_chats_answer(live, max_output_tokens):
    """instructions are the system turn and input the user's: greedy text and usage equal the chat's; a response
    cut by max_output_tokens is incomplete, saying why."""
    response = client(live).responses.create(
        model=live.model, instructions="Be brief.", input=ASK, max_output_tokens=max_output_tokens, temperature=0
    )
    chat = chat_answer(live, max_tokens=max_output_tokens, temperature=0)
    assert response.output_text == chat["choices"][0]["message"]["content"]
    assert response.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert response.usage.output_tokens == chat["usage"]["completion_tokens"]
    if chat["choices"][0]["finish_reason"] == "length":
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed"


def test_a_streamed_response_equals_the_whole_one(live):
    fields = {"model": live.model, "instructions": "Be brief.", "input": ASK, "temperature": 0.9, "top_p": 0.95}
    whole = client(live).responses.create(max_output_tokens=16, **fields, extra_body={"seed": 4})
    events = list(client(live).responses.create(max_output_tokens=16, stream=True, **fields, extra_body={"seed": 4}))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.parametrize(
    ("fields", "status", "param"),
    [
        ({"previous_response_id": "resp_1"}, 400, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, 400, "tools.0.type"),
        ({"model": "another"}, 404, "model"),
        ({"input": ""}, 400, "input"),
    ],
)
def test_bad_responses_requests_name_the_field(live, fields, status, param):
    response = httpx.post(f"{live.v1}/responses", json={"input": ASK, **fields}, timeout=60)
    assert response.status_code == status and response.json()["error"]["param"] == param, response.text


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(SHIPPED)


def scripted(tokenizer, answer: str) -> tuple[TestClient, Answering]:
    engine = Answering(tokenizer, answer)
    return TestClient(build_app(ServerState(engine, tokenizer, "m", 4096, len(tokenizer), (0,)))), engine


FLAT_WEATHER = {"type": "function", **WEATHER["function"]}


def test_tool_calls_come_as_function_call_items_streamed_or_not(tokenizer):
    http, engine = scripted(tokenizer, TWO_CALLS)
    body = {"input": "Weather in Paris and Oslo?", "tools": [FLAT_WEATHER]}
    whole = http.post("/v1/responses", json=body).json()
    calls = [item for item in whole["output"] if item["type"] == "function_call"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Oslo"}),
    ]
    assert [item["type"] for item in whole["output"]] == ["message", "function_call", "function_call"]
    assert whole["output"][0]["content"][0]["text"] == "Let me look.\n"
    assert json.dumps(WEATHER) in tokenizer.decode(engine.submitted[-1].prompt_ids)  # offered as the chat offers them
    lines = http.post("/v1/responses", json={**body, "stream": True}).text.splitlines()
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert [line[7:] for line in lines if line.startswith("event: ")] == [e["type"] for e in events]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done" and e["item"]["type"] != "message"]
    assert [(c["name"], c["arguments"]) for c in done] == [(c["name"], c["arguments"]) for c in calls]
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["message", "function_call", "function_call"]
    single = http.post("/v1/responses", json={**body, "parallel_tool_calls": False}).json()
    assert [item["type"] for item in single["output"]] == ["message", "function_call"]


def test_a_function_call_and_its_output_are_rendered_as_the_chat_renders_them(tokenizer):
    http, engine = scripted(tokenizer, "Sunny.")
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    given = [{"role": "user", "content": "Weather in Paris?"}, call,
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]  # fmt: skip
    reply = http.post("/v1/responses", json={"input": given, "tools": [FLAT_WEATHER]})
    assert reply.status_code == 200, reply.text
    chat = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]  # fmt: skip
    expected = tokenizer.apply_chat_template(chat, tools=[WEATHER], add_generation_prompt=True, tokenize=False)
    assert tokenizer.decode(engine.submitted[-1].prompt_ids) == expected
    assert reply.json()["output"][-1]["content"][0]["text"] == "Sunny."
