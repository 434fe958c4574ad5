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
        model=live.model, instructions="Be brief.", input=ASK, max_output_tokens=max_output_tokens, temperature=0,
        reasoning={"effort": "none"},
    )  # fmt: skip
    chat = chat_answer(live, max_tokens=max_output_tokens, temperature=0, reasoning_effort="none")
    assert response.output_text == chat["choices"][0]["message"]["content"] and response.output_text
    assert response.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert response.usage.output_tokens == chat["usage"]["completion_tokens"]
    if chat["choices"][0]["finish_reason"] == "length":
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed"


@pytest.mark.parametrize("effort", ["none", "high"])
def test_a_streamed_response_equals_the_whole_one(live, effort):
    """Text (thinking off) or reasoning (on): the deltas joined, the final event's response and the whole response
    agree; another seed gives another answer."""
    fields = {"model": live.model, "instructions": "Be brief.", "input": ASK, "temperature": 0.9, "top_p": 0.95,
              "reasoning": {"effort": effort}}  # fmt: skip
    whole = client(live).responses.create(max_output_tokens=16, **fields, extra_body={"seed": 4})
    events = list(client(live).responses.create(max_output_tokens=16, stream=True, **fields, extra_body={"seed": 4}))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    final = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == whole.output_text == final.output_text
    assert thought == reasoning_of(whole) == reasoning_of(final) and (thought if effort == "high" else deltas)
    assert final.usage.output_tokens == whole.usage.output_tokens
    other_seed = client(live).responses.create(max_output_tokens=16, **fields, extra_body={"seed": 5})
    assert (other_seed.output_text, reasoning_of(other_seed)) != (whole.output_text, reasoning_of(whole))


def reasoning_of(response) -> str:
    """The reasoning items' text."""
    return "".join(part.text for item in response.output if item.type == "reasoning" for part in item.content or [])


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


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"max_output_tokens": 5000}, "max_output_tokens", ("max_output_tokens asks for 5000",)),
        ({"input": "word " * 300}, "input", ("input: the prompt has",)),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input", ("input:",)),
    ],
)
def test_errors_of_the_equivalent_chat_name_the_responses_field(tokenizer, fields, param, words):
    engine = Answering(tokenizer, "x")
    http = TestClient(build_app(ServerState(engine, tokenizer, "m", 256, len(tokenizer), (0,))))
    response = http.post("/v1/responses", json={"input": "hi", **fields})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param, error
    assert all(word in error["message"] for word in words) and "max_tokens" not in error["message"], error
    assert "messages" not in error["message"] and engine.submitted == []


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True}),
        ("/v1/completions", {"prompt": "hi", "stream": True}),
        ("/v1/responses", {"input": "hi", "stream": True}),
        ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}),
    ],
)
def test_a_stream_whose_client_leaves_before_its_first_byte_stops_the_engines_work(tokenizer, path, body):
    """The stream's generator has begun before the response is returned, so its end tells the engine to stop even
    when nothing of it was ever sent (before, such a request ran on to its last token)."""
    import asyncio
    import gc

    from tests.server.test_generation import RecordingEngine

    engine = RecordingEngine()  # takes the request and never answers, as a long prompt pass would not yet
    app = build_app(ServerState(engine, tokenizer, "m", 4096, len(tokenizer), (0,)))
    raw, received = json.dumps(body).encode(), []

    async def receive() -> dict:
        received.append(1)
        if len(received) == 1:
            return {"type": "http.request", "body": raw, "more_body": False}
        return {"type": "http.disconnect"}  # the client is gone before any byte of the response

    async def send(message: dict) -> None:
        await asyncio.sleep(0)

    async def main() -> None:
        scope = {"type": "http", "method": "POST", "path": path, "headers": [(b"content-type", b"application/json")],
                 "query_string": b"", "root_path": "", "scheme": "http", "server": ("t", 80), "client": ("c", 1),
                 "http_version": "1.1", "asgi": {"version": "3.0"}}  # fmt: skip
        await asyncio.wait_for(app(scope, receive, send), 10)
        for _ in range(5):  # the abandoned generator is closed by the loop once collected
            gc.collect()
            await asyncio.sleep(0.02)

    asyncio.run(main())
    assert len(engine.submitted) == 1 and [request_id for request_id, _ in engine.aborts] == [
        engine.submitted[0].request_id
    ]


def test_a_stored_response_is_never_found(tokenizer):
    """Nothing is stored: OpenAI's retrieve, delete and cancel of a response, and its input items, are 404s in
    OpenAI's error shape."""
    http, _ = scripted(tokenizer, "x")
    made = http.post("/v1/responses", json={"input": "hi"}).json()
    assert made["store"] is False
    for method, path in (("GET", ""), ("DELETE", ""), ("POST", "/cancel"), ("GET", "/input_items")):
        response = http.request(method, f"/v1/responses/{made['id']}{path}")
        assert response.status_code == 404 and response.json()["error"]["param"] == "response_id", response.text
        assert response.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize(
    ("effort", "answer", "thought"),
    [
        ("low", "hmm, blue\n</think>\n\nBlue.", "hmm, blue\n</think>"),  # the block and its end tag
        ("low", "hmm, still thinking", "hmm, still thinking"),  # a block cut by the token limit: all of it
        ("none", "Blue.", ""),  # no thinking
    ],
)
def test_a_responses_reasoning_tokens_are_the_think_blocks_streamed_or_not(tokenizer, effort, answer, thought):
    http, _ = scripted(tokenizer, answer)
    body = {"input": "Name a color.", "reasoning": {"effort": effort}}
    expected = len(tokenizer(thought, add_special_tokens=False)["input_ids"])
    whole = http.post("/v1/responses", json=body).json()
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] == expected
    assert whole["usage"]["output_tokens"] == len(tokenizer(answer, add_special_tokens=False)["input_ids"])
    lines = http.post("/v1/responses", json={**body, "stream": True}).text.splitlines()
    final = [json.loads(line[6:]) for line in lines if line.startswith("data: ")][-1]["response"]
    assert final["usage"] == whole["usage"]
