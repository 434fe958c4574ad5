"""What OpenAI's spec and vLLM take in a chat's messages and read from an answer's think block, through the shipped
model's tokenizer and a scripted engine (no model runs)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from server.app import ServerState, build_app
from server.http_options import HttpOptions
from tests.server.test_tool_calls_api import ASK, SHIPPED, WEATHER, Answering, http

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
PARAMETERS = WEATHER["function"]["parameters"]
CODER_CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(SHIPPED)


def prompt_of(tokenizer: Any, body: dict) -> str:
    """The prompt text the engine got for a chat request (which must be answered 200)."""
    client, engine = http(tokenizer, "Sunny.")
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return tokenizer.decode(engine.submitted[-1].prompt_ids)


def test_an_assistant_turn_with_tool_calls_may_leave_content_out(tokenizer):
    """OpenAI: an assistant message's content is optional where it has tool_calls (vLLM reads a missing content as
    none); leaving it out renders as content null does, not a 400 'Field required'."""
    tool = {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    with_null = prompt_of(tokenizer, {"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [CALL]},
                                                   tool], "tools": [WEATHER]})  # fmt: skip
    left_out = prompt_of(tokenizer, {"messages": [*ASK, {"role": "assistant", "tool_calls": [CALL]}, tool],
                                     "tools": [WEATHER]})  # fmt: skip
    assert left_out == with_null


def test_a_refusal_part_of_an_assistant_turn_is_read_as_its_text(tokenizer):
    """OpenAI's assistant content parts are 'text' and 'refusal'; vLLM reads a refusal part's `refusal` as text
    (chat_utils: "refusal" among the text part types), so a replayed refusal is rendered, not a 400."""
    turns = [{"role": "user", "content": "Do it."},
             {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't help with that."}]},
             {"role": "user", "content": "Why not?"}]  # fmt: skip
    assert "<|im_start|>assistant\nI can't help with that.<|im_end|>" in prompt_of(tokenizer, {"messages": turns})


def test_a_think_tag_repeated_inside_an_opened_think_block_is_not_reasoning_text(tokenizer):
    """vLLM's qwen3 parser strips a <think> the model writes itself even where the prompt opened the block; the
    answer's reasoning_content never holds the tag (streamed or not)."""
    answer = "<think>\nLet me see.\n</think>\n\nHello."
    client, _ = http(tokenizer, answer)
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": True}}
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message["content"] == "Hello."
    assert "<think>" not in message["reasoning_content"], message["reasoning_content"]


def test_a_coder_tool_call_inside_an_unclosed_think_block_ends_the_reasoning(tokenizer):
    """vLLM's qwen3 parser (Qwen3.5-family templates) takes a `<tool_call>` followed by `<function=` inside a think
    block that never closed as the reasoning's end: the call comes back in tool_calls with finish_reason
    'tool_calls', not as reasoning text."""
    engine = Answering(tokenizer, "I should check.\n" + CODER_CALL)
    options = HttpOptions(tool_call_parser="qwen3_coder")
    state = ServerState(engine, tokenizer, "m", 4096, len(tokenizer), (0,), http=options)
    client = TestClient(build_app(state))
    body = {"messages": ASK, "tools": [WEATHER], "chat_template_kwargs": {"enable_thinking": True}}
    choice = client.post("/v1/chat/completions", json=body).json()["choices"][0]
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in choice["message"]["tool_calls"]]
    assert calls == [("get_weather", {"city": "Paris"})], choice
    assert choice["finish_reason"] == "tool_calls"
    assert "<tool_call>" not in (choice["message"]["reasoning_content"] or "")


def test_reasoning_tokens_count_a_tool_call_tag_that_opens_no_call(tokenizer):
    """With qwen3_coder calls and a one-token <tool_call>, a reasoning that mentions <tool_call> without a function
    after it stays reasoning text to </think>, and its tokens (end tag included) are all counted as reasoning."""
    tok = AutoTokenizer.from_pretrained(SHIPPED)
    tok.add_tokens(["<tool_call>", "</tool_call>"])  # one token each, not special, as in Qwen's vocabulary
    reasoning = "Use <tool_call> maybe. Hmm.\n"
    answer = reasoning + "</think>\n\nSunny."
    engine = Answering(tok, answer)
    state = ServerState(engine, tok, "m", 4096, len(tok), (0,), http=HttpOptions(tool_call_parser="qwen3_coder"))
    client = TestClient(build_app(state))
    tool = {"type": "function", "name": "get_weather", "description": "w", "parameters": PARAMETERS}
    body = {"input": "Weather in Paris?", "tools": [tool], "reasoning": {"effort": "medium"}}
    response = client.post("/v1/responses", json=body).json()
    said = [part["text"] for item in response["output"] if item["type"] == "reasoning" for part in item["content"]]
    assert said == [reasoning], response["output"]
    expected = len(tok(reasoning + "</think>", add_special_tokens=False)["input_ids"])
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == expected, response["usage"]


def test_reasoning_tokens_end_before_the_tag_of_a_call_that_ends_the_think_block(tokenizer):
    """With qwen3_coder calls and a one-token <tool_call>, a call opened inside the think block ends it: the tokens
    before its tag are the reasoning tokens, the call's are not."""
    tok = AutoTokenizer.from_pretrained(SHIPPED)
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    reasoning = "I should look it up.\n"
    call = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    engine = Answering(tok, reasoning + call)
    state = ServerState(engine, tok, "m", 4096, len(tok), (0,), http=HttpOptions(tool_call_parser="qwen3_coder"))
    client = TestClient(build_app(state))
    tool = {"type": "function", "name": "get_weather", "description": "w", "parameters": PARAMETERS}
    body = {"input": "Weather in Paris?", "tools": [tool], "reasoning": {"effort": "medium"}}
    response = client.post("/v1/responses", json=body).json()
    assert [item["type"] for item in response["output"]] == ["reasoning", "function_call"], response["output"]
    expected = len(tok(reasoning, add_special_tokens=False)["input_ids"])
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] == expected, response["usage"]


CODER_CALL_OF = "<tool_call>\n<function=get_weather>\n<parameter=city>\n{city}\n</parameter>\n</function>\n</tool_call>"
REASONING = "I should look it up.\n"


def coder_response(tok: Any, engine: Any) -> dict[str, Any]:
    """A /v1/responses answer, thinking on and get_weather offered, with calls read as qwen3_coder's."""
    state = ServerState(engine, tok, "m", 4096, len(tok), (0,), http=HttpOptions(tool_call_parser="qwen3_coder"))
    tool = {"type": "function", "name": "get_weather", "description": "w", "parameters": PARAMETERS}
    body = {"input": "Weather in Paris?", "tools": [tool], "reasoning": {"effort": "medium"}}
    return TestClient(build_app(state)).post("/v1/responses", json=body).json()


def reasoning_tokens(tok: Any, answer: str, per_update: int) -> int:
    """usage.output_tokens_details.reasoning_tokens of a /v1/responses answer, `per_update` tokens an update."""
    response = coder_response(tok, Answering(tok, answer, per_update))
    assert response["output"][0]["type"] == "reasoning", response["output"]
    return response["usage"]["output_tokens_details"]["reasoning_tokens"]


@pytest.fixture(scope="module")
def call_tok() -> Any:
    tok = AutoTokenizer.from_pretrained(SHIPPED)
    tok.add_tokens(["<tool_call>", "</tool_call>"])  # one token each, as in Qwen's vocabulary
    return tok


@pytest.mark.parametrize("per_update", [1, 500])
def test_reasoning_tokens_of_two_calls_end_at_the_first_calls_tag_however_updates_group_them(call_tok, per_update):
    """Two parallel calls end the think block: the reasoning tokens are those before the first call's tag, whether
    the tokens come one an update (undrafted) or many (drafts accepted, the last update)."""
    answer = REASONING + CODER_CALL_OF.format(city="Paris") + "\n" + CODER_CALL_OF.format(city="Rome")
    expected = len(call_tok(REASONING, add_special_tokens=False)["input_ids"])
    assert reasoning_tokens(call_tok, answer, per_update) == expected


@pytest.mark.parametrize("per_update", [1, 500])
def test_reasoning_tokens_end_at_the_call_even_where_think_closes_in_the_same_update(call_tok, per_update):
    """A call ends the think block before a later </think>: the reasoning tokens are those before the call's tag,
    whether the </think> comes in a later update or in the same one."""
    answer = REASONING + CODER_CALL_OF.format(city="Paris") + "\n</think>\n\n"
    expected = len(call_tok(REASONING, add_special_tokens=False)["input_ids"])
    assert reasoning_tokens(call_tok, answer, per_update) == expected
