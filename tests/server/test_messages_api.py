"""POST /v1/messages (Anthropic's Messages API, as vLLM serves it) through the official anthropic client: the same
answer as the equivalent chat, streamed or not; thinking, text and tool_use blocks; Anthropic's errors."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from server.app import ServerState, build_app
from tests.server.live import Live, serve, tiny_chat_checkpoint
from tests.server.test_responses_api import scripted
from tests.server.test_tool_calls_api import SHIPPED, TWO_CALLS, WEATHER, Answering

ASK = "Sort a list, please."
TOOL = {"name": "get_weather", "description": WEATHER["function"]["description"],
        "input_schema": WEATHER["function"]["parameters"]}  # fmt: skip


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Live:
    with serve(tiny_chat_checkpoint(tmp_path_factory.mktemp("messages") / "tiny-chat")) as running:
        yield running


def client(live: Live) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0, timeout=120)


def chat_answer(live: Live, messages: list[dict], **fields) -> dict:
    response = httpx.post(f"{live.v1}/chat/completions", json={"messages": messages, **fields}, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def prompt_tokens(message) -> int:
    """The prompt's tokens: Anthropic's input_tokens leave out those read from the cache."""
    return message.usage.input_tokens + message.usage.cache_read_input_tokens


def blocks(message, kind: str) -> str:
    """The text of a message's blocks of one type, joined."""
    field = {"text": "text", "thinking": "thinking"}[kind]
    return "".join(getattr(block, field) for block in message.content if block.type == kind)


@pytest.mark.parametrize(("thinking", "max_tokens"), [("disabled", 12), ("enabled", 12), ("disabled", 3)])
def test_a_message_is_the_equivalent_chats_answer(live, thinking, max_tokens):
    """system is the system turn: greedy thinking, text and usage equal the chat's; a message cut by max_tokens
    says so."""
    message = client(live).messages.create(
        model=live.model, system="Be brief.", messages=[{"role": "user", "content": ASK}], max_tokens=max_tokens,
        thinking={"type": thinking, "budget_tokens": 1024} if thinking == "enabled" else {"type": thinking},
        extra_body={"temperature": 0},
    )  # fmt: skip
    chat = chat_answer(
        live, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": ASK}], max_tokens=max_tokens,
        temperature=0, chat_template_kwargs={"enable_thinking": thinking == "enabled"},
    )  # fmt: skip
    answer = chat["choices"][0]["message"]
    assert blocks(message, "text") == answer["content"] and blocks(message, "thinking") == (
        answer.get("reasoning_content") or ""
    )
    assert blocks(message, "thinking") if thinking == "enabled" else blocks(message, "text")
    assert prompt_tokens(message) == chat["usage"]["prompt_tokens"]
    assert message.usage.output_tokens == chat["usage"]["completion_tokens"]
    finish = chat["choices"][0]["finish_reason"]
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[finish]
    assert message.id.startswith("msg_") and message.role == "assistant" and message.model == live.model


@pytest.mark.parametrize("thinking", ["disabled", "enabled"])
def test_a_streamed_message_equals_the_whole_one(live, thinking):
    fields = {"model": live.model, "messages": [{"role": "user", "content": ASK}], "max_tokens": 16,
              "thinking": {"type": thinking, "budget_tokens": 2048}}  # fmt: skip
    if thinking == "disabled":
        fields["thinking"] = {"type": "disabled"}
    sampled = {"temperature": 0.9, "top_k": 20}  # vLLM's extensions: today's Anthropic API has no sampling fields
    whole = client(live).messages.create(**fields, extra_body={**sampled, "seed": 4})
    with client(live).messages.stream(**fields, extra_body={**sampled, "seed": 4}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert events[0].type == "message_start" and events[-1].type == "message_stop"
    assert [block.model_dump() for block in final.content] == [block.model_dump() for block in whole.content]
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)
    starts = [e.index for e in events if e.type == "content_block_start"]
    assert starts == list(range(len(whole.content)))
    other_seed = client(live).messages.create(**fields, extra_body={**sampled, "seed": 5})
    assert [b.model_dump() for b in other_seed.content] != [b.model_dump() for b in whole.content]


def test_a_prefilled_assistant_turn_is_continued_as_the_chat_continues_it(live):
    turns = [{"role": "user", "content": ASK}, {"role": "assistant", "content": "Here"}]
    message = client(live).messages.create(
        model=live.model, messages=turns, max_tokens=8, thinking={"type": "disabled"}, extra_body={"temperature": 0}
    )
    chat = chat_answer(live, turns, max_tokens=8, temperature=0, add_generation_prompt=False,
                       continue_final_message=True, chat_template_kwargs={"enable_thinking": False})  # fmt: skip
    assert blocks(message, "text") == chat["choices"][0]["message"]["content"]
    assert prompt_tokens(message) == chat["usage"]["prompt_tokens"]


def test_a_stop_sequence_ends_the_text_and_is_named(live):
    fields = {"model": live.model, "messages": [{"role": "user", "content": ASK}], "thinking": {"type": "disabled"},
              "extra_body": {"temperature": 0}}  # fmt: skip
    plain = blocks(client(live).messages.create(**fields, max_tokens=24), "text")
    stop = next(plain[at : at + 2] for at in range(len(plain) // 2, len(plain) - 1) if plain[at : at + 2].strip())
    message = client(live).messages.create(**fields, max_tokens=24, stop_sequences=[stop])
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert blocks(message, "text") == plain[: plain.index(stop)]


def test_a_repeated_prompt_reads_its_tokens_from_the_cache(live):
    fields = {"model": live.model, "messages": [{"role": "user", "content": ASK * 30}], "max_tokens": 2}
    first = client(live).messages.create(**fields)
    again = client(live).messages.create(**fields)
    assert first.usage.cache_read_input_tokens == 0 and again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == first.usage.input_tokens


def test_count_tokens_counts_the_prompt_a_message_would_have(live):
    turns = [{"role": "user", "content": ASK}]
    counted = client(live).messages.count_tokens(model=live.model, system="Be brief.", messages=turns)
    made = client(live).messages.create(model=live.model, system="Be brief.", messages=turns, max_tokens=1)
    assert counted.input_tokens == prompt_tokens(made) > 0


@pytest.mark.parametrize(
    ("fields", "status", "kind", "words"),
    [
        ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens: Field required"),
        ({"model": "another"}, 404, "not_found_error", "model"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
         "invalid_request_error", "messages.0.content.0: content blocks of type 'image' are not taken"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, 400, "invalid_request_error",
         "tools.0.type"),
        ({"tools": [TOOL], "tool_choice": {"type": "tool", "name": "nope"}}, 400, "invalid_request_error",
         "tool_choice: names no offered tool"),
        ({"stop_sequences": ["a"] * 9}, 400, "invalid_request_error", "stop_sequences: List should have at most 8"),
        ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]}, 400,
         "invalid_request_error", "a tool_result block belongs to no assistant turn"),
        ({"output_config": {"effort": "most"}}, 400, "invalid_request_error", "output_config.effort"),
        ({"thinking": {"type": "between_tools"}}, 400, "invalid_request_error", "thinking.type"),
        ({"temperature": 3}, 400, "invalid_request_error", "temperature"),
    ],
)  # fmt: skip
def test_bad_requests_get_anthropics_errors_naming_the_field(live, fields, status, kind, words):
    body = {"model": live.model, "max_tokens": 4, "messages": [{"role": "user", "content": ASK}], **fields}
    response = httpx.post(f"{live.v1}/messages", json={k: v for k, v in body.items() if v is not None}, timeout=60)
    error = response.json()
    assert response.status_code == status and error["type"] == "error", response.text
    assert error["error"]["type"] == kind and words in error["error"]["message"], response.text


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(SHIPPED)


def sse_events(text: str) -> list[dict]:
    lines = text.splitlines()
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert [line[7:] for line in lines if line.startswith("event: ")] == [e["type"] for e in events]
    return events


def test_tool_calls_come_as_tool_use_blocks_streamed_or_not(tokenizer):
    http, engine = scripted(tokenizer, TWO_CALLS)
    body = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "Weather in Paris and Oslo?"}],
            "tools": [TOOL]}  # fmt: skip
    whole = http.post("/v1/messages", json=body).json()
    assert [block["type"] for block in whole["content"]] == ["text", "tool_use", "tool_use"]
    assert whole["content"][0]["text"] == "Let me look.\n" and whole["stop_reason"] == "tool_use"
    uses = whole["content"][1:]
    assert [(u["name"], u["input"]) for u in uses] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Oslo"}),
    ]
    assert all(u["id"].startswith("toolu_") for u in uses) and uses[0]["id"] != uses[1]["id"]
    assert json.dumps(WEATHER) in tokenizer.decode(engine.submitted[-1].prompt_ids)  # offered as the chat offers them
    events = sse_events(http.post("/v1/messages", json={**body, "stream": True}).text)
    started = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert started == ["text", "tool_use", "tool_use"]
    inputs = {}
    for event in events:
        if event["type"] == "content_block_delta" and event["delta"]["type"] == "input_json_delta":
            inputs[event["index"]] = inputs.get(event["index"], "") + event["delta"]["partial_json"]
    assert [json.loads(inputs[i]) for i in (1, 2)] == [u["input"] for u in uses]
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    single = http.post(
        "/v1/messages", json={**body, "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}
    )
    assert [block["type"] for block in single.json()["content"]] == ["text", "tool_use"]


def test_a_tool_use_and_its_result_are_rendered_as_the_chat_renders_them(tokenizer):
    http, engine = scripted(tokenizer, "Sunny.")
    arguments = {"city": "Paris"}
    turns = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "I should look.", "signature": "s"},
                                          {"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": arguments}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny, 21 C"},
                                     {"type": "text", "text": "And tomorrow?"}]},
    ]  # fmt: skip
    message = http.post("/v1/messages", json={"model": "m", "max_tokens": 8, "messages": turns, "tools": [TOOL]})
    assert message.status_code == 200, message.text
    chat_turns = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "I should look.", "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}
        ]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny, 21 C"},
        {"role": "user", "content": "And tomorrow?"},
    ]  # fmt: skip
    chat = http.post("/v1/chat/completions", json={"messages": chat_turns, "tools": [WEATHER], "max_tokens": 8})
    assert chat.status_code == 200, chat.text
    assert engine.submitted[-1].prompt_ids == engine.submitted[-2].prompt_ids
    assert "Sunny, 21 C" in tokenizer.decode(engine.submitted[-1].prompt_ids)


@pytest.mark.parametrize(
    ("thinking", "answer", "kinds", "thought", "text"),
    [
        ("enabled", "hmm, blue\n</think>\n\nBlue.", ["thinking", "text"], "hmm, blue\n", "Blue."),
        ("adaptive", "hmm, still thinking", ["thinking"], "hmm, still thinking", ""),
        ("disabled", "Blue.", ["text"], "", "Blue."),
    ],
)
def test_thinking_and_text_come_as_their_blocks_streamed_or_not(tokenizer, thinking, answer, kinds, thought, text):
    http, _ = scripted(tokenizer, answer)
    body = {"model": "m", "max_tokens": 32, "messages": [{"role": "user", "content": "Name a color."}],
            "thinking": {"type": thinking}}  # fmt: skip
    whole = http.post("/v1/messages", json=body).json()
    assert [block["type"] for block in whole["content"]] == kinds
    assert "".join(b.get("thinking", "") for b in whole["content"]) == thought
    assert "".join(b.get("text", "") for b in whole["content"]) == text
    events = sse_events(http.post("/v1/messages", json={**body, "stream": True}).text)
    assert [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"] == kinds
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert (
        "".join(d.get("thinking", "") for d in deltas) == thought and "".join(d.get("text", "") for d in deltas) == text
    )
    stops = [e["index"] for e in events if e["type"] == "content_block_stop"]
    assert stops == list(range(len(kinds)))
    assert events[-2]["usage"]["output_tokens"] == whole["usage"]["output_tokens"]


def test_omitted_thinking_is_left_out_streamed_or_not(tokenizer):
    http, _ = scripted(tokenizer, "secret plan\n</think>\n\nBlue.")
    body = {"model": "m", "max_tokens": 32, "messages": [{"role": "user", "content": "Name a color."}],
            "thinking": {"type": "enabled", "budget_tokens": 1024, "display": "omitted"}}  # fmt: skip
    assert http.post("/v1/messages", json=body).json()["content"] == [{"type": "text", "text": "Blue."}]
    events = sse_events(http.post("/v1/messages", json={**body, "stream": True}).text)
    assert [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"] == ["text"]
    assert "secret" not in json.dumps(events)


def test_an_api_key_is_taken_as_anthropics_clients_send_it_and_refused_in_anthropics_shape(tokenizer):
    app = build_app(ServerState(Answering(tokenizer, "Blue."), tokenizer, "m", 4096, len(tokenizer), (0,), "sekrit"))
    http = TestClient(app)
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "Name a color."}]}
    assert http.post("/v1/messages", json=body, headers={"x-api-key": "sekrit"}).status_code == 200
    assert http.post("/v1/messages", json=body, headers={"Authorization": "Bearer sekrit"}).status_code == 200
    refused = http.post("/v1/messages", json=body, headers={"x-api-key": "wrong"})
    assert refused.status_code == 401
    assert refused.json() == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "missing or wrong API key"},
    }
    chat = {"messages": body["messages"], "max_tokens": 4}
    assert http.post("/v1/chat/completions", json=chat, headers={"x-api-key": "wrong"}).json()["error"]["code"] == (
        "invalid_api_key"
    )  # OpenAI's shape on OpenAI's routes
    assert http.post("/v1/chat/completions", json=chat, headers={"x-api-key": "sekrit"}).status_code == 200


def test_a_forced_call_cut_by_max_tokens_is_a_message_that_says_so(live):
    tool = {
        **TOOL,
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
    body = {"model": live.model, "max_tokens": 3, "messages": [{"role": "user", "content": ASK}], "tools": [tool],
            "tool_choice": {"type": "tool", "name": "get_weather"}, "thinking": {"type": "disabled"}}  # fmt: skip
    response = httpx.post(f"{live.v1}/messages", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["stop_reason"] == "max_tokens"
