"""The Responses API subset: requests become chat bodies (or 400s naming their field), and a generation's texts and
calls become a Response object, or stream events that agree with it, all as the openai package's types read them."""

from __future__ import annotations

from typing import Any

import pytest
from openai import omit
from openai.lib.streaming.responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import BaseModel, TypeAdapter

from server.generation import StreamEnd
from server.protocol import ApiError, ChatCompletionRequest, ChatMessage, parse_request
from server.responses import ResponsesRequest, ResponseStream, new_response_id, response_object
from server.tool_calls import ToolCall

EVENT = TypeAdapter(ResponseStreamEvent)
TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}  # fmt: skip
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}
CALL = ToolCall("chatcmpl-tool-1", "get_weather", '{"city": "Paris"}')
CALL2 = ToolCall("chatcmpl-tool-2", "get_weather", '{"city": "Rome"}')


def chat_call(call_id: str, arguments: str) -> dict[str, Any]:
    """An assistant chat message's call of get_weather."""
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


def request(**fields: Any) -> ResponsesRequest:
    """A parsed request, its input "hi" unless given."""
    return parse_request(ResponsesRequest, {"input": "hi", **fields})


def chat(**fields: Any) -> ChatCompletionRequest:
    """The chat request a Responses request's chat body parses as."""
    return parse_request(ChatCompletionRequest, request(**fields).chat_body())


def rendered(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the chat template takes them."""
    return [message.for_template() for message in body.messages]


def error(**fields: Any) -> dict[str, Any]:
    """The 400 error object of a Responses request, its input "hi" unless given."""
    with pytest.raises(ApiError) as caught:
        request(**fields)
    assert caught.value.status == 400
    return caught.value.body()["error"]


def assert_names(found: dict[str, Any], param: str, *words: str) -> None:
    """The error names `param` first in its message and contains `words`."""
    assert found["type"] == "invalid_request_error"
    assert found["param"] == param
    assert found["message"].startswith(f"{param}: ")
    for word in words:
        assert word in found["message"]


def assert_exact(model: Any, where: str = "") -> None:
    """A value read by the openai types has no field they lack (they keep unknown fields rather than refuse them), but
    a Response's `store`, which OpenAI's responses carry and the openai package's type lacks."""
    if isinstance(model, BaseModel):
        extra = set(model.model_extra) - ({"store"} if isinstance(model, Response) else set())
        assert not extra, f"{where}: fields the type lacks: {sorted(extra)}"
        for name in type(model).model_fields:
            assert_exact(getattr(model, name), f"{where}.{name}")
    elif isinstance(model, list):
        for index, value in enumerate(model):
            assert_exact(value, f"{where}.{index}")


def as_response(obj: dict[str, Any]) -> Response:
    """The object read as the openai package's Response, with nothing it lacks."""
    response = Response.model_validate(obj)
    assert_exact(response, "response")
    return response


# --- requests


def test_a_text_input_is_one_user_message_with_the_default_settings() -> None:
    body = chat()
    assert rendered(body) == [{"role": "user", "content": "hi"}]
    hand_written = parse_request(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]})
    assert body.sampling_params() == hand_written.sampling_params()
    assert (body.tools, body.tool_choice, body.reasoning_effort, body.user) == (None, None, None, None)
    assert body.parallel_tool_calls is True


def test_instructions_come_first_as_a_system_message_and_messages_join_their_text_parts() -> None:
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
        {"id": "msg_1", "status": "completed", "type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "c", "annotations": []}]},
        {"role": "user", "content": []},
    ]  # fmt: skip
    body = chat(input=items, instructions="You are terse.")
    hand_written = {"messages": [
        {"role": "system", "content": "You are terse."},
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "c"},
        {"role": "user", "content": ""},
    ]}  # fmt: skip
    assert rendered(body) == rendered(parse_request(ChatCompletionRequest, hand_written))
    assert body.messages[2].content == "a\nb"


def test_function_calls_and_their_outputs_round_trip_as_assistant_tool_calls_and_tool_messages() -> None:
    """An answer's output items sent back: its reasoning, its message and the calls after it one assistant turn (the
    reasoning as its reasoning_content); a call with no message before it opens its own turn."""
    items = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "Paris"}', "status": "completed"},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": "rainy"},
        {"type": "function_call", "call_id": "c3", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c3", "output": "?"},
    ]  # fmt: skip
    body = chat(input=items, tools=[TOOL])
    hand_written = {"tools": [CHAT_TOOL], "messages": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "hm",
         "tool_calls": [chat_call("c1", '{"city": "Paris"}'), chat_call("c2", '{"city": "Rome"}')]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "tool", "content": "rainy", "tool_call_id": "c2"},
        {"role": "assistant", "content": "", "tool_calls": [chat_call("c3", "{}")]},
        {"role": "tool", "content": "?", "tool_call_id": "c3"},
    ]}  # fmt: skip
    expected = parse_request(ChatCompletionRequest, hand_written)
    assert rendered(body) == rendered(expected)
    assert body.template_kwargs() == expected.template_kwargs()
    assert len(body.messages) == 6


def test_tools_and_settings_reach_the_chat_body_in_chat_form() -> None:
    bare = {"type": "function", "name": "ping", "description": None, "strict": True}
    body = chat(
        tools=[TOOL, bare],
        tool_choice="auto",
        parallel_tool_calls=False,
        max_output_tokens=50,
        temperature=0.3,
        top_p=0.9,
        user="u1",
    )
    assert [tool.model_dump(exclude_none=True) for tool in body.tools] == [
        CHAT_TOOL,
        {"type": "function", "function": {"name": "ping"}},
    ]
    assert request(tools=[bare]).chat_body()["tools"] == [{"type": "function", "function": {"name": "ping"}}]
    assert body.parses_tool_calls() and body.parallel_tool_calls is False
    params = body.sampling_params()
    assert (params.max_tokens, params.temperature, params.top_p, body.user) == (50, 0.3, 0.9, "u1")
    shown_only = chat(tools=[TOOL], tool_choice="none")
    assert shown_only.template_kwargs()["tools"] and not shown_only.parses_tool_calls()
    assert chat(tool_choice="none").tools is None and chat(tool_choice="auto").tool_choice is None


@pytest.mark.parametrize(
    ("effort", "chat_effort", "thinking"),
    [("none", "none", False), ("minimal", "low", True), ("low", "low", True), ("xhigh", "xhigh", True)],
)
def test_reasoning_effort_reaches_the_chat_body(effort: str, chat_effort: str, thinking: bool) -> None:
    body = chat(reasoning={"effort": effort, "summary": "auto"})
    assert body.reasoning_effort == chat_effort
    assert body.template_kwargs()["enable_thinking"] is thinking
    assert chat(reasoning={"summary": "detailed"}).reasoning_effort is None


def test_nulls_and_values_that_change_nothing_are_taken() -> None:
    fields = ("model", "instructions", "max_output_tokens", "tools", "reasoning", "text", "metadata", "user",
              "previous_response_id", "conversation", "background", "include", "prompt", "top_logprobs",
              "max_tool_calls", "tool_choice")  # fmt: skip
    nulls = dict.fromkeys(fields)
    assert request(**nulls) == request()
    harmless = {
        "background": False,
        "include": [],
        "top_logprobs": 0,
        "store": False,
        "truncation": "disabled",
        "text": {"format": {"type": "text"}, "verbosity": "low"},
        "metadata": {"k": "v"},
        "stream": True,
        "service_tier": "auto",
    }
    taken = request(**harmless)
    assert taken.chat_body() == request().chat_body()
    assert request(input=[{"role": "user", "content": "hi", "type": None}]).chat_body() == request().chat_body()


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"conversation": {"id": "conv_1"}}, "conversation"),
        ({"background": True}, "background"),
        ({"background": 0}, "background"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"top_logprobs": False}, "top_logprobs"),
        ({"max_tool_calls": 3}, "max_tool_calls"),
        ({"truncation": "auto"}, "truncation"),
        ({"tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}}, "tool_choice"),
        ({"tools": [TOOL, {"type": "web_search"}]}, "tools.1.type"),
        ({"text": {"format": {"type": "grammar", "syntax": "lark", "definition": "start: 'a'"}}}, "text.format.type"),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "see"},
                                                 {"type": "input_image", "image_url": "https://x/y.png"}]}]},
         "input.0.content.1.type"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input.0.content.0.type"),
        ({"input": [{"role": "user", "content": "hi"}, {"type": "item_reference", "id": "msg_1"}]}, "input.1"),
        ({"input": [{"type": "web_search_call", "id": "ws_1", "status": "completed"}]}, "input.0"),
    ],
)  # fmt: skip
def test_what_cannot_be_honoured_is_refused_naming_the_field(fields: dict[str, Any], param: str) -> None:
    found = error(**fields)
    assert_names(found, param, "not supported yet")
    assert found["code"] == "unsupported_parameter"


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"input": None}, "input", ("required",)),
        ({"input": ""}, "input", ("empty",)),
        ({"input": []}, "input", ("at least 1",)),
        ({"input": 5}, "input", ("string or a list",)),
        ({"input": [5]}, "input.0", ("object",)),
        ({"input": [{"content": "hi"}]}, "input.0.role", ("required",)),
        ({"input": [{"role": "tool", "content": "hi"}]}, "input.0.role", ('"tool"',)),
        ({"input": [{"role": "user", "content": 7}]}, "input.0.content", ()),
        ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input.0.content.0.text", ("required",)),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id", ("required",)),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
         "input.0.arguments", ("JSON object",)),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]},
         "input.0.arguments", ("JSON object",)),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "input.0.output", ()),
        ({"instructions": 5}, "instructions", ()),
        ({"temperature": 2.5}, "temperature", ("2.5",)),
        ({"temperature": "0.5"}, "temperature", ()),
        ({"top_p": 0}, "top_p", ("greater than 0",)),
        ({"max_output_tokens": 0}, "max_output_tokens", ()),
        ({"stream": "yes"}, "stream", ()),
        ({"store": 1}, "store", ()),
        ({"parallel_tool_calls": 1}, "parallel_tool_calls", ("boolean",)),
        ({"tools": [{"type": "function", "name": "a b"}]}, "tools.0.name", ("pattern",)),
        ({"tools": [{"name": "f"}]}, "tools.0.type", ("required",)),
        ({"tools": [{"type": "function", "name": "f", "parameters": "x"}]}, "tools.0.parameters", ()),
        ({"tools": [TOOL, TOOL]}, "tools", ("two tools are named 'get_weather'",)),
        ({"tool_choice": "sometimes"}, "tool_choice", ()),
        ({"truncation": "never"}, "truncation", ()),
        ({"reasoning": {"effort": "max"}}, "reasoning.effort", ()),
        ({"reasoning": "high"}, "reasoning", ()),
        ({"metadata": {"k": 1}}, "metadata.k", ()),
        ({"user": 5}, "user", ()),
    ],
)  # fmt: skip
def test_bad_values_are_refused_naming_the_field(fields: dict[str, Any], param: str, words: tuple[str, ...]) -> None:
    found = error(**fields)
    assert_names(found, param, *words)
    assert found["code"] is None


def test_raw_json_bodies_parse_as_dicts_do() -> None:
    raw = '{"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}], "temperature": 1}'
    assert parse_request(ResponsesRequest, raw).chat_body() == request(temperature=1.0).chat_body()
    with pytest.raises(ApiError) as caught:
        parse_request(ResponsesRequest, '{"input": [{"role": "user", "content": [{"type": "input_audio"}]}]}')
    assert caught.value.param == "input.0.content.0.type"


# --- response objects


def finished(req: ResponsesRequest | None = None, **fields: Any) -> dict[str, Any]:
    """A response object of these texts and calls (none unless given), finished by a stop."""
    args = {"reasoning": "", "content": "", "calls": [], "finish_reason": "stop", **fields}
    return response_object(
        response_id=new_response_id(),
        created=1_700_000_000,
        model="flash",
        request=req or request(),
        input_tokens=12,
        output_tokens=7,
        cached_tokens=4,
        **args,
    )


@pytest.mark.parametrize(
    ("fields", "kinds"),
    [
        ({"content": "Hello."}, ["message"]),
        ({"reasoning": "Think.", "content": "Hello."}, ["reasoning", "message"]),
        ({"calls": [CALL, CALL2]}, ["function_call", "function_call"]),
        ({"content": "Checking.", "calls": [CALL]}, ["message", "function_call"]),
        ({"reasoning": "Think.", "calls": [CALL]}, ["reasoning", "function_call"]),
        ({"reasoning": "Think."}, ["reasoning", "message"]),
        ({}, ["message"]),
    ],
)
def test_response_objects_read_as_openais_with_their_items_in_order(fields: dict[str, Any], kinds: list[str]) -> None:
    obj = finished(**fields)
    response = as_response(obj)
    assert [item.type for item in response.output] == kinds
    prefixes = {"reasoning": "rs_", "message": "msg_", "function_call": "fc_"}
    assert all(item.id.startswith(prefixes[item.type]) for item in response.output)
    assert len({item.id for item in response.output}) == len(kinds)
    assert response.id.startswith("resp_") and response.status == "completed" and response.incomplete_details is None
    assert response.output_text == fields.get("content", "")
    reasoning = [item.content[0].text for item in response.output if item.type == "reasoning"]
    assert reasoning == ([fields["reasoning"]] if "reasoning" in fields else [])
    calls = [(item.call_id, item.name, item.arguments) for item in response.output if item.type == "function_call"]
    assert calls == [(call.id, call.name, call.arguments) for call in fields.get("calls", [])]
    assert response.usage.model_dump(exclude_none=True) == {
        "input_tokens": 12,
        "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
        "output_tokens": 7,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 19,
    }


def test_a_response_cut_by_the_token_limit_is_incomplete_with_the_reason() -> None:
    response = as_response(finished(content="Hel", finish_reason="length"))
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert as_response(finished(calls=[CALL], finish_reason="tool_calls")).status == "completed"


def test_a_response_echoes_the_requests_settings() -> None:
    req = request(instructions="Be brief.", max_output_tokens=64, temperature=0.2, top_p=0.5, tools=[TOOL],
                  tool_choice="none", parallel_tool_calls=False, reasoning={"effort": "low", "summary": "auto"},
                  metadata={"k": "v"}, user="u1", store=True)  # fmt: skip
    response = as_response(finished(req, content="ok"))
    assert (response.instructions, response.max_output_tokens, response.temperature, response.top_p) == (
        "Be brief.", 64, 0.2, 0.5)  # fmt: skip
    assert [tool.model_dump(exclude_none=True) for tool in response.tools] == [TOOL]
    assert (response.tool_choice, response.parallel_tool_calls, response.metadata, response.user) == (
        "none", False, {"k": "v"}, "u1")  # fmt: skip
    assert response.reasoning.effort == "low" and response.reasoning.summary == "auto"
    assert response.model_extra == {"store": False}  # nothing is stored, whatever was asked
    assert (response.text.format.type, response.truncation, response.model, response.error) == (
        "text", "disabled", "flash", None)  # fmt: skip
    plain = as_response(finished(content="ok"))
    assert (plain.tools, plain.tool_choice, plain.metadata, plain.reasoning) == ([], "auto", {}, None)


def test_given_item_ids_are_used_in_order() -> None:
    obj = finished(reasoning="r", content="c", calls=[CALL], item_ids=["rs_a", "msg_b", "fc_c"])
    assert [item["id"] for item in obj["output"]] == ["rs_a", "msg_b", "fc_c"]
    with pytest.raises(ValueError):
        finished(content="c", item_ids=["msg_a", "msg_b"])


# --- streams

PIECES = {
    "reasoning then text": [("Let me ", "", []), ("think.", "", []), ("", "Hi ", []), ("", "there.", [])],
    "reasoning and text in one piece": [("Hmm.", "Hi.", [])],
    "text in many pieces": [("", char, []) for char in "Hello, wörld! 🙂\n"],
    "text then calls": [("", "Checking ", []), ("", "both.\n", [CALL]), ("", "", [CALL2])],
    "reasoning then a call": [("Need weather.", "", []), ("", "", [CALL])],
    "calls only": [("", "", [CALL, CALL2])],
    "reasoning only": [("All thought, no answer.", "", [])],
    "nothing at all": [],
    "empty pieces": [("", "", []), ("", "", [])],
    "text around a call": [("", "Before ", []), ("", "", [CALL]), ("", "after.", [])],
    "text only after a call": [("Plan.", "", []), ("", "", [CALL]), ("", "Done.", [])],
}


def streamed(pieces: list[tuple[str, str, list[ToolCall]]], finish_reason: str = "stop", req=None) -> list[dict]:
    """Every event of a stream of these (reasoning, content, calls) pieces."""
    stream = ResponseStream("resp_stream", 1_700_000_000, "flash", req or request())
    events = stream.opening()
    for reasoning, content, calls in pieces:
        events += stream.feed(reasoning, content, calls)
    return events + stream.closing(StreamEnd(finish_reason, None, 12, 7, 4))


def joined(pieces: list[tuple[str, str, list[ToolCall]]]) -> tuple[str, str, list[ToolCall]]:
    """The pieces' whole reasoning, content and calls."""
    return "".join(p[0] for p in pieces), "".join(p[1] for p in pieces), [c for p in pieces for c in p[2]]


@pytest.mark.parametrize("name", PIECES)
def test_stream_events_read_as_openais_and_agree_with_the_final_response(name: str) -> None:
    pieces = PIECES[name]
    events = streamed(pieces)
    parsed = [EVENT.validate_python(event) for event in events]
    for event in parsed:
        assert_exact(event, event.type)
    assert [event["sequence_number"] for event in events] == list(range(len(events)))
    assert [event["type"] for event in events[:2]] == ["response.created", "response.in_progress"]
    for event in parsed[:2]:
        assert (event.response.status, event.response.output, event.response.usage) == ("in_progress", [], None)
    assert events[-1]["type"] == "response.completed"
    final = events[-1]["response"]
    reasoning, content, calls = joined(pieces)
    response = as_response(final)
    assert response.output_text == content
    assert [item.content[0].text for item in response.output if item.type == "reasoning"] == [reasoning] * bool(
        reasoning
    )
    assert [(item.call_id, item.arguments) for item in response.output if item.type == "function_call"] == [
        (call.id, call.arguments) for call in calls
    ]
    # each item: added once, then its deltas, then done once, all at its place in the final output
    for index, item in enumerate(final["output"]):
        mine = [
            event for event in events[2:-1] if item["id"] in (event.get("item_id"), event.get("item", {}).get("id"))
        ]
        assert {event["output_index"] for event in mine} == {index}
        assert mine[0]["type"] == "response.output_item.added" and mine[-1]["type"] == "response.output_item.done"
        assert mine[-1]["item"] == item
        deltas = "".join(event["delta"] for event in mine if event["type"].endswith(".delta"))
        whole = item["arguments"] if item["type"] == "function_call" else item["content"][0]["text"]
        assert deltas == whole
        assert all(event["type"] != "response.output_item.added" for event in mine[1:])
    added = [event["output_index"] for event in events if event["type"] == "response.output_item.added"]
    assert added == list(range(len(final["output"])))
    assert not [event for event in events if event.get("delta") == ""]


@pytest.mark.parametrize("name", [name for name in PIECES if "after a call" not in name and "around" not in name])
def test_a_streams_final_response_is_the_response_object_of_its_texts_and_ids(name: str) -> None:
    """Where no text follows a call, the items come in response_object's order and the final response is exactly it."""
    events = streamed(PIECES[name])
    final = events[-1]["response"]
    reasoning, content, calls = joined(PIECES[name])
    expected = response_object(response_id="resp_stream", created=1_700_000_000, model="flash", request=request(),
                               reasoning=reasoning, content=content, calls=calls, finish_reason="stop",
                               input_tokens=12, output_tokens=7, cached_tokens=4,
                               item_ids=[item["id"] for item in final["output"]])  # fmt: skip
    assert final == expected


@pytest.mark.parametrize("name", PIECES)
def test_openais_stream_reader_takes_the_events(name: str) -> None:
    """The openai package's own accumulator, which checks item identities, order and completion, reads the stream to
    the same texts."""
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    texts: dict[str, str] = {}
    for event in streamed(PIECES[name]):
        for seen in state.handle_event(EVENT.validate_python(event)):
            if seen.type in ("response.output_text.delta", "response.function_call_arguments.delta"):
                texts[seen.item_id] = seen.snapshot
            if seen.type == "response.completed":
                final = seen.response
    reasoning, content, calls = joined(PIECES[name])
    assert final.output_text == content
    assert [item.content[0].text for item in final.output if item.type == "reasoning"] == [reasoning] * bool(reasoning)
    assert [item.call_id for item in final.output if item.type == "function_call"] == [call.id for call in calls]
    assert {item.id: item.arguments for item in final.output if item.type == "function_call"} == {
        item_id: text for item_id, text in texts.items() if item_id.startswith("fc_")
    }
    assert "".join(text for item_id, text in texts.items() if item_id.startswith("msg_")) == content


@pytest.mark.parametrize("name", ["text only after a call", "text around a call"])
def test_the_message_comes_before_the_calls_however_the_pieces_fall(name: str) -> None:
    """The calls' items are sent at the end, so the stream's order is response_object's: the message first, whether
    its text came before a call, after it, or both, and whatever piece a call closed in."""
    pieces = PIECES[name]
    merged = [("".join(p[0] for p in pieces), "".join(p[1] for p in pieces), [c for p in pieces for c in p[2]])]
    for given in (pieces, merged):
        events = streamed(given)
        types = [item["type"] for item in events[-1]["response"]["output"]]
        assert types == [t for t in ("reasoning", "message") if t in types] + ["function_call"] * types.count(
            "function_call"
        )
        added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
        assert added == types


def test_a_stream_cut_by_the_token_limit_ends_incomplete() -> None:
    events = streamed([("", "Hel", [])], finish_reason="length")
    last = EVENT.validate_python(events[-1])
    assert last.type == "response.incomplete"
    assert last.response.status == "incomplete" and last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.output_text == "Hel"
    assert streamed([("", "", [CALL])], finish_reason="tool_calls")[-1]["type"] == "response.completed"


@pytest.mark.parametrize("pieces", [[], [("", "", [])] * 3])
def test_a_stream_with_nothing_still_adds_and_finishes_its_empty_message(pieces: list) -> None:
    """Empty pieces send nothing; the closing adds and finishes the empty message the final response holds."""
    types = [event["type"] for event in streamed(pieces)]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]


def test_a_stream_of_reasoning_then_text_sends_the_events_in_openais_order() -> None:
    types = [event["type"] for event in streamed([("a", "", []), ("", "b", [CALL])])]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]


def test_a_stream_echoes_the_requests_settings_from_its_first_event() -> None:
    req = request(tools=[TOOL], instructions="Be brief.", metadata={"k": "v"})
    events = streamed([("", "ok", [])], req=req)
    for event in (events[0], events[-1]):
        response = as_response(event["response"])
        assert (response.instructions, response.metadata, response.id) == ("Be brief.", {"k": "v"}, "resp_stream")
        assert [tool.name for tool in response.tools] == ["get_weather"]


@pytest.mark.parametrize(("status", "code"), [(500, "server_error"), (400, "invalid_prompt")])
def test_a_failed_stream_ends_with_the_error_then_response_failed(status: int, code: str) -> None:
    stream = ResponseStream("resp_f", 1, "m", request())
    events = [*stream.opening(), *stream.feed("", "Hel", [])]
    events += stream.failure(ApiError("the token draw failed", status=status, param="temperature"))
    for event in events:
        EVENT.validate_python(event)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"] == {"code": code, "message": "the token draw failed"}
    assert events[-2]["param"] == "temperature"


@pytest.mark.parametrize(
    ("items", "expected"),
    [
        ([{"type": "reasoning", "summary": [{"type": "summary_text", "text": "plan"}]},
          {"type": "function_call", "call_id": "c", "name": "get_weather", "arguments": "{}"}],
         [{"role": "assistant", "content": "", "reasoning_content": "plan", "tool_calls": [chat_call("c", "{}")]}]),
        ([{"type": "reasoning", "content": [{"type": "reasoning_text", "text": "a"}]},
          {"role": "assistant", "content": "b"}],
         [{"role": "assistant", "content": "b", "reasoning_content": "a"}]),
        ([{"type": "reasoning", "content": [{"type": "reasoning_text", "text": "a"}]}], []),
    ],
)  # fmt: skip
def test_reasoning_items_go_with_the_assistant_turn_that_follows_them(items: list, expected: list) -> None:
    """As the chat takes an assistant message's reasoning_content (Qwen's templates render the reasoning of turns
    after the last user message, the tool-call loop); reasoning that nothing follows is dropped."""
    body = chat(input=[{"role": "user", "content": "q"}, *items], tools=[TOOL])
    assert [m.for_template() for m in body.messages[1:]] == [
        ChatMessage.model_validate(m).for_template() for m in expected
    ]


def test_encrypted_reasoning_is_refused_by_name() -> None:
    item = {"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}
    with pytest.raises(ApiError) as caught:
        parse_request(ResponsesRequest, {"input": [{"role": "user", "content": "q"}, item]})
    assert caught.value.param == "input.1.encrypted_content" and caught.value.code == "unsupported_parameter"
