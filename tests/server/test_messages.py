"""Anthropic's Messages API in server/messages.py: a request's equivalent chat body, the Message of a finished answer
and the events of a streamed one, without a server."""

from __future__ import annotations

import json

import pytest

from server.generation import StreamEnd
from server.messages import (
    CountTokensRequest,
    MessagesRequest,
    MessageStream,
    as_messages_error,
    error_body,
    message_object,
)
from server.protocol import ApiError, parse_request
from server.tool_calls import ToolCall

TOOL = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
CALL = ToolCall("chatcmpl-tool-abc123", "get_weather", '{"city": "Paris"}')


def body(**fields) -> dict:
    request = {"max_tokens": 9, "messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_request(MessagesRequest, json.dumps(request)).chat_body()


def test_the_chat_body_carries_system_sampling_stops_user_and_format():
    chat = body(system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
                temperature=0.5, top_k=4, stop_sequences=["\n\n"], metadata={"user_id": "u1"}, seed=3,
                output_config={"format": {"type": "json_schema", "schema": {"type": "object"}},
                               "effort": "max"})  # fmt: skip
    assert chat["messages"] == [{"role": "system", "content": "Be brief.\nBe kind."}, {"role": "user", "content": "hi"}]
    assert (chat["max_tokens"], chat["temperature"], chat["top_k"], chat["seed"]) == (9, 0.5, 4, 3)
    assert "top_p" not in chat  # left out: the server's default applies
    assert (chat["stop"], chat["user"], chat["reasoning_effort"]) == (["\n\n"], "u1", "xhigh")
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": {"type": "object"}},
    }


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, ("auto", True)),
        ({"type": "any", "disable_parallel_tool_use": True}, ("required", False)),
        ({"type": "tool", "name": "get_weather"}, ({"type": "function", "function": {"name": "get_weather"}}, True)),
        ({"type": "none"}, ("none", True)),
    ],
)
def test_tool_choices_become_the_chats(choice, expected):
    chat = body(tools=[TOOL], tool_choice=choice)
    assert (chat["tool_choice"], chat["parallel_tool_calls"]) == expected
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "get_weather", "parameters": TOOL["input_schema"]}}
    ]


@pytest.mark.parametrize(
    ("thinking", "enable", "include"),
    [({"type": "enabled", "budget_tokens": 2048}, True, True), ({"type": "adaptive"}, True, True),
     ({"type": "adaptive", "display": "omitted"}, True, False), ({"type": "disabled"}, False, True)],
)  # fmt: skip
def test_thinking_turns_the_templates_thinking_on_or_off(thinking, enable, include):
    chat = body(thinking=thinking)
    assert (chat["chat_template_kwargs"], chat["include_reasoning"]) == ({"enable_thinking": enable}, include)
    assert "chat_template_kwargs" not in body()  # absent: the template's own default


def test_turns_become_chat_messages_and_a_last_assistant_turn_is_continued():
    turns = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "look it up", "signature": "sig"},
            {"type": "redacted_thinking", "data": "xyz"},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "Sunny"}]}]},
        {"role": "assistant", "content": "It is"},
    ]  # fmt: skip
    chat = body(messages=turns)
    assert chat["messages"] == [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "look it up", "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"},  # no empty user turn after a tool result
        {"role": "assistant", "content": "It is"},
    ]  # fmt: skip
    assert (chat["add_generation_prompt"], chat["continue_final_message"]) == (False, True)
    assert "continue_final_message" not in body()


def test_chat_errors_name_the_messages_field_and_come_in_anthropics_shape():
    renamed = as_messages_error(ApiError("stop: List should have at most 8 items", param="stop"))
    assert (renamed.param, renamed.message) == ("stop_sequences", "stop_sequences: List should have at most 8 items")
    assert error_body(ApiError("nope", status=404, param="model")) == {
        "type": "error", "error": {"type": "not_found_error", "message": "nope"},
    }  # fmt: skip
    assert error_body(ApiError("busy", status=503))["error"]["type"] == "overloaded_error"
    assert error_body(ApiError("broke", status=500))["error"]["type"] == "api_error"


def end(finish: str = "stop", stop_reason: int | str | None = None) -> StreamEnd:
    return StreamEnd(finish, stop_reason, input_tokens=20, output_tokens=7, cached_tokens=16)


@pytest.mark.parametrize(
    ("finish", "stop_reason", "calls", "expected"),
    [
        ("stop", None, [], ("end_turn", None)),
        ("stop", 4093, [], ("end_turn", None)),  # a stop token id: the turn's end
        ("stop", "\n\n", [], ("stop_sequence", "\n\n")),
        ("length", None, [], ("max_tokens", None)),
        ("tool_calls", None, [CALL], ("tool_use", None)),
    ],
)
def test_a_message_says_why_it_stopped_and_counts_cached_tokens_apart(finish, stop_reason, calls, expected):
    message = message_object("msg_1", "m", "", "Hi", calls, end(finish, stop_reason))
    assert (message["stop_reason"], message["stop_sequence"]) == expected
    assert message["usage"] == {"input_tokens": 4, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 16,
                                "output_tokens": 7}  # fmt: skip


def test_a_message_of_nothing_has_one_empty_text_block_and_calls_have_tool_use_ids():
    assert message_object("msg_1", "m", "", "", [], end())["content"] == [{"type": "text", "text": ""}]
    content = message_object("msg_1", "m", "hmm", "", [CALL], end())["content"]
    assert content == [{"type": "thinking", "thinking": "hmm", "signature": ""},
                       {"type": "tool_use", "id": "toolu_abc123", "name": "get_weather",
                        "input": {"city": "Paris"}}]  # fmt: skip


def test_a_stream_opens_blocks_in_order_and_ends_as_the_whole_message():
    stream = MessageStream("msg_1", "m", 20)
    events = (
        stream.opening() + stream.feed("hm", "", []) + stream.feed("m", "Hi", []) + stream.feed("", " there", [CALL])
    )
    events += stream.closing(end("tool_calls"))
    kinds = [(e["type"], e.get("index")) for e in events]
    assert kinds == [
        ("message_start", None),
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0), ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_delta", 1), ("content_block_stop", 1),
        ("content_block_start", 2), ("content_block_delta", 2), ("content_block_stop", 2),
        ("message_delta", None), ("message_stop", None),
    ]  # fmt: skip
    assert events[9]["content_block"] == {"type": "tool_use", "id": "toolu_abc123", "name": "get_weather", "input": {}}
    assert events[10]["delta"] == {"type": "input_json_delta", "partial_json": '{"city": "Paris"}'}
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[0]["message"]["usage"] == {"input_tokens": 20, "output_tokens": 0}
    empty = MessageStream("msg_2", "m", 5)
    events = empty.opening() + empty.closing(end())
    assert [e["type"] for e in events] == ["message_start", "content_block_start", "content_block_stop",
                                           "message_delta", "message_stop"]  # fmt: skip
    assert events[1]["content_block"] == {"type": "text", "text": ""}


def test_turns_of_one_role_in_a_row_are_one_turn_and_a_last_one_continues():
    turns = [{"role": "user", "content": "Say it."}, {"role": "user", "content": [{"type": "text", "text": "Now."}]},
             {"role": "assistant", "content": "The answer"}, {"role": "assistant", "content": " is"}]  # fmt: skip
    assert body(messages=turns)["messages"] == [
        {"role": "user", "content": "Say it.\nNow."},
        {"role": "assistant", "content": "The answer\n is"},
    ]


@pytest.mark.parametrize(
    "last",
    [
        [{"type": "text", "text": "Calling"}, {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}],
        [{"type": "thinking", "thinking": "hmm", "signature": ""}],
    ],
)
def test_a_last_assistant_turn_with_more_than_text_is_refused(last):
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": last}]
    with pytest.raises(ApiError, match="messages: a last assistant turn is continued as a prefill: it may hold text"):
        body(messages=turns)


def test_a_failed_calls_result_says_so_and_a_clients_billing_block_is_left_out():
    turns = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "denied",
                                      "is_error": True}]},
    ]  # fmt: skip
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.0.1; cch=ab12;"},
              {"type": "text", "text": "You help."}]  # fmt: skip
    chat = body(messages=turns, system=system)
    assert chat["messages"][0] == {"role": "system", "content": "You help."}
    assert chat["messages"][-1] == {"role": "tool", "tool_call_id": "t1", "content": "Error: denied"}
    image = [{"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "image", "source": {}}]}]
    with pytest.raises(ApiError, match="content blocks of type 'image' are not taken in a tool result"):
        body(messages=[*turns[:2], {"role": "user", "content": image}])


def test_an_effort_shapes_the_counted_prompt_too():
    count = parse_request(CountTokensRequest, json.dumps({"messages": [{"role": "user", "content": "hi"}],
                                                         "output_config": {"effort": "low"}}))  # fmt: skip
    assert count.chat_body()["reasoning_effort"] == "low"


def test_a_call_cut_by_max_tokens_stops_for_max_tokens_with_no_input_parsed():
    cut = ToolCall("chatcmpl-tool-abc123", "get_weather", '{"city": "Par')
    message = message_object("msg_1", "m", "", "", [cut], end("length"))
    assert (message["stop_reason"], message["content"][0]["input"]) == ("max_tokens", {})
    stream = MessageStream("msg_1", "m", 20)
    events = stream.opening() + stream.feed("", "", [cut]) + stream.closing(end("length"))
    assert [e["delta"] for e in events if e["type"] == "content_block_delta"] == [
        {"type": "input_json_delta", "partial_json": '{"city": "Par'}
    ]
    assert events[-2]["delta"]["stop_reason"] == "max_tokens"
