"""Request validation: every bad input is a 400 naming its field; good inputs give the expected SamplingParams."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import pytest

from server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingParams,
    parse_request,
    token_sha,
)

USER = [{"role": "user", "content": "hi"}]
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
TOOL = {"type": "function", "function": {"name": "f", "description": "Does f.", "parameters": {"type": "object"}}}


def chat_error(**fields: Any) -> dict[str, Any]:
    """The error object of a chat request with `messages` defaulted to one user turn."""
    body = {"messages": USER, **fields}
    with pytest.raises(ApiError) as caught:
        parse_request(ChatCompletionRequest, body)
    assert caught.value.status == 400
    return caught.value.body()["error"]


def completion_error(**fields: Any) -> dict[str, Any]:
    """The error object of a text completion request."""
    with pytest.raises(ApiError) as caught:
        parse_request(CompletionRequest, fields)
    assert caught.value.status == 400
    return caught.value.body()["error"]


def assert_names(error: dict[str, Any], param: str, *words: str) -> None:
    """The error is an invalid request naming `param` first in its message and containing `words`."""
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"].startswith(f"{param}: ")
    for word in words:
        assert word in error["message"]


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"temperature": -0.5}, "temperature", ("-0.5",)),
        ({"temperature": 2.5}, "temperature", ("2.5",)),
        ({"top_p": 0}, "top_p", ("greater than 0",)),
        ({"top_p": 1.5}, "top_p", ("1.5",)),
        ({"top_k": -2}, "top_k", ("-2",)),
        ({"min_p": 2}, "min_p", ("2",)),
        ({"seed": -(2**63) - 1}, "seed", ()),
        ({"seed": 2**63}, "seed", ()),
        ({"max_tokens": 0}, "max_tokens", ("0",)),
        ({"max_completion_tokens": 0}, "max_completion_tokens", ()),
        ({"stop": [f"s{i}" for i in range(9)]}, "stop", ("at most 8",)),
        ({"stop": ["ok", ""]}, "stop.1", ()),
        ({"stop_token_ids": [1, -3]}, "stop_token_ids.1", ("-3",)),
        ({"chat_template_kwargs": {"reasoning_effort": "max"}}, "chat_template_kwargs.reasoning_effort", ("max",)),
        ({"chat_template_kwargs": {"enable_thinking": "yes"}}, "chat_template_kwargs.enable_thinking", ()),
    ],
)
def test_out_of_range_values_name_the_field(fields: dict[str, Any], param: str, words: tuple[str, ...]) -> None:
    assert_names(chat_error(**fields), param, *words)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": "0.5"}, "temperature"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"stream": "true"}, "stream"),
        ({"top_k": True}, "top_k"),
        ({"messages": "hi"}, "messages"),
        ({"stop": 5}, "stop"),
    ],
)
def test_wrong_json_types_name_the_field(fields: dict[str, Any], param: str) -> None:
    assert_names(chat_error(**fields), param)


def test_wrong_type_in_raw_json_names_the_field() -> None:
    with pytest.raises(ApiError) as caught:
        parse_request(ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}')
    assert_names(caught.value.body()["error"], "temperature", '"hot"')


def test_body_that_is_not_a_json_object() -> None:
    for raw in (b'{"messages": ', b"[]"):
        with pytest.raises(ApiError) as caught:
            parse_request(ChatCompletionRequest, raw)
        error = caught.value.body()["error"]
        assert error["param"] is None
        assert error["message"].startswith("request body: ")


@pytest.mark.parametrize(
    ("messages", "param", "words"),
    [
        ([{"content": "hi"}], "messages.0.role", ("required",)),
        ([{"role": "robot", "content": "hi"}], "messages.0.role", ('"robot"',)),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "messages.0.content",
            ("image_url",),
        ),
        ([{"role": "user", "content": [{"type": "text"}]}], "messages.0.content", ("'text'",)),
        ([{"role": "user", "content": 7}], "messages.0.content", ()),
        ([{"role": "user"}], "messages.0.content", ("required",)),
        ([], "messages", ("at least 1",)),
    ],
)
def test_malformed_messages(messages: list[Any], param: str, words: tuple[str, ...]) -> None:
    assert_names(chat_error(messages=messages), param, *words)


def test_missing_messages() -> None:
    with pytest.raises(ApiError) as caught:
        parse_request(ChatCompletionRequest, {"model": "m"})
    assert_names(caught.value.body()["error"], "messages", "required")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
    ],
)
def test_unsupported_features_are_refused(fields: dict[str, Any], param: str) -> None:
    error = chat_error(**fields)
    assert_names(error, param, "not supported yet")
    assert error["code"] == "unsupported_parameter"


def test_logit_bias_reaches_sampling_params_by_token_id_in_id_order_without_zeros() -> None:
    body = {"messages": USER, "logit_bias": {"42": 5, "7": -100, "9": 0, "0012": 2.5}}
    params = parse_request(ChatCompletionRequest, body).sampling_params()
    assert params.logit_bias == ((7, -100.0), (12, 2.5), (42, 5.0))
    assert all(type(bias) is float for _, bias in params.logit_bias)


@pytest.mark.parametrize(
    ("bias", "param", "words"),
    [
        ({"a": 1}, "logit_bias", ("token ids written in decimal", "'a'")),
        ({"-5": 1}, "logit_bias", ("token ids written in decimal",)),
        ({"\u0663": 1}, "logit_bias", ("token ids written in decimal",)),  # an Arabic-Indic three
        ({"05": 1, "5": 2}, "logit_bias", ("given twice",)),
        ({"5": "3"}, "logit_bias.5", ("valid number",)),
        ({"5": True}, "logit_bias.5", ("valid number",)),
        ({str(i): 1 for i in range(1025)}, "logit_bias", ("1024",)),
    ],
)
def test_bad_logit_biases_are_refused_naming_the_field(
    bias: dict[str, Any], param: str, words: tuple[str, ...]
) -> None:
    assert_names(chat_error(logit_bias=bias), param, *words)


def test_a_top_logprobs_of_zero_changes_nothing_and_is_taken() -> None:
    """vLLM's default top_logprobs is 0, and clients that send their defaults send it: without logprobs it asks for
    nothing, and was refused as unsupported."""
    for fields in ({"top_logprobs": 0}, {"logprobs": False, "top_logprobs": 0}):
        assert parse_request(ChatCompletionRequest, {"messages": USER, **fields}).sampling_params() == SamplingParams()


def test_min_tokens_reach_sampling_params_and_may_not_pass_max_tokens() -> None:
    body = {"messages": USER, "min_tokens": 5, "max_tokens": 5}
    assert parse_request(ChatCompletionRequest, body).sampling_params().min_tokens == 5
    assert_names(chat_error(min_tokens=6, max_tokens=5), "min_tokens", "at most max_tokens (5)")
    assert_names(chat_error(min_tokens=6, max_completion_tokens=5), "min_tokens", "at most max_tokens (5)")
    assert_names(chat_error(min_tokens=-1), "min_tokens", "greater than or equal to 0")


def test_logprobs_reach_sampling_params_as_how_many_of_the_most_likely_to_give() -> None:
    """Chat's logprobs (with top_logprobs, 0 to 20) and a text completion's logprobs count (OpenAI's legacy field)
    become the draw's logprobs count; without them there is none."""
    chat = [({"logprobs": True}, 0), ({"logprobs": True, "top_logprobs": 20}, 20), ({"logprobs": False}, None)]
    for fields, count in chat:
        assert parse_request(ChatCompletionRequest, {"messages": USER, **fields}).sampling_params().logprobs == count
    for count in (None, 0, 5):
        body = {"prompt": "hi", "logprobs": count}
        assert parse_request(CompletionRequest, body).sampling_params().logprobs == count


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"top_logprobs": 2}, "top_logprobs", ("needs logprobs: true",)),
        ({"logprobs": False, "top_logprobs": 1}, "top_logprobs", ("needs logprobs: true",)),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", ("less than or equal to 20",)),
        ({"logprobs": 1}, "logprobs", ("boolean",)),
    ],
)
def test_bad_chat_logprobs_are_refused_naming_the_field(fields: dict[str, Any], param: str, words: tuple[str, ...]):
    assert_names(chat_error(**fields), param, *words)


def test_a_message_without_tool_calls_may_say_so() -> None:
    """None (null or an empty list, as clients send them) gives the template no tool_calls key."""
    for calls in (None, []):
        body = {"messages": [*USER, {"role": "assistant", "content": "ok", "tool_calls": calls}]}
        assert parse_request(ChatCompletionRequest, body).messages[1].for_template() == {
            "role": "assistant",
            "content": "ok",
        }


def test_tool_calls_and_tool_call_ids_reach_the_template_with_arguments_as_objects() -> None:
    """An earlier turn's calls reach the template as vLLM passes them: the arguments' JSON text parsed to an object
    (keys in their order), the id kept; a tool turn keeps its tool_call_id."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"b": 1, "a": [2]}'}}
    messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "42", "tool_call_id": "c1"}]  # fmt: skip
    rendered = [m.for_template() for m in parse_request(ChatCompletionRequest, {"messages": messages}).messages]
    assert rendered[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"b": 1, "a": [2]}}, "id": "c1"}],
    }
    assert list(rendered[1]["tool_calls"][0]["function"]["arguments"]) == ["b", "a"]
    assert rendered[2] == {"role": "tool", "content": "42", "tool_call_id": "c1"}


def test_documents_reach_the_template_as_given() -> None:
    documents = [{"title": "A", "text": "alpha"}, {"text": "beta"}]
    kwargs = parse_request(ChatCompletionRequest, {"messages": USER, "documents": documents}).template_kwargs()
    assert kwargs["documents"] == documents
    empty = parse_request(ChatCompletionRequest, {"messages": USER, "documents": []})
    assert "documents" not in empty.template_kwargs()
    assert_names(chat_error(documents=[{"text": 1}]), "documents.0.text", "string")
    assert_names(chat_error(documents=[{"text": "x"}] * 129), "documents", "at most 128")


def test_offered_tools_reach_the_template_and_turn_parsing_on_unless_tool_choice_is_none() -> None:
    body = {"messages": USER, "tools": [TOOL]}
    request = parse_request(ChatCompletionRequest, body)
    assert request.template_kwargs()["tools"] == [TOOL] and request.parses_tool_calls()
    assert parse_request(ChatCompletionRequest, {**body, "tool_choice": "auto"}).parses_tool_calls()
    shown_only = parse_request(ChatCompletionRequest, {**body, "tool_choice": "none"})
    assert shown_only.template_kwargs()["tools"] == [TOOL] and not shown_only.parses_tool_calls()
    assert "tools" not in parse_request(ChatCompletionRequest, {"messages": USER, "tools": []}).template_kwargs()


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"tool_choice": "auto"}, "tool_choice", ("needs tools",)),
        ({"tools": [TOOL, TOOL]}, "tools", ("two tools are named 'f'",)),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools.0.function.name", ("pattern",)),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools.0.type", ("function",)),
        ({"tools": [{"function": {"name": "f"}}, {"function": {"name": "f"}}]}, "tools", ("two tools",)),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
         "tools.0.function.parameters", ()),
        ({"tools": [TOOL] * 129}, "tools", ("at most 128",)),
        ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice", ()),
        ({"tools": [TOOL], "parallel_tool_calls": 1}, "parallel_tool_calls", ("boolean",)),
        ({"messages": [*USER, {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
         "messages.1.tool_calls.0.function.arguments", ("JSON object",)),
        ({"messages": [*USER, {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]},
         "messages.1.tool_calls.0.function.arguments", ("JSON object",)),
        ({"messages": [{"role": "user", "content": "hi", "tool_calls": [CALL]}]}, "messages.0", ("assistant",)),
        ({"messages": [*USER, {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "[" * 100_000}}]}]},
         "messages.1.tool_calls.0.function.arguments", ("less deeply",)),
        ({"messages": [*USER, {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": '{"c": "\\ud83d"}'}}]}]},
         "messages.1.tool_calls.0.function.arguments", ("UTF-8",)),
    ],
)  # fmt: skip
def test_bad_tools_and_tool_calls_are_refused_naming_the_field(fields: dict[str, Any], param: str, words) -> None:
    assert_names(chat_error(**fields), param, *words)


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_an_earlier_answers_reasoning_reaches_the_template_as_reasoning_content(field: str) -> None:
    """The responses give an answer's reasoning in both spellings, and clients send it back with the conversation;
    it was dropped before rendering, which Qwen's templates do with it as the request says."""
    body = {"messages": [*USER, {"role": "assistant", "content": "4", field: "2 + 2"}, *USER]}
    messages = parse_request(ChatCompletionRequest, body).messages
    assert messages[1].for_template() == {"role": "assistant", "content": "4", "reasoning_content": "2 + 2"}
    assert "reasoning_content" not in messages[0].for_template()


def test_two_reasonings_that_differ_are_refused() -> None:
    both = {"role": "assistant", "content": "4", "reasoning": "a", "reasoning_content": "b"}
    assert_names(chat_error(messages=[*USER, both]), "messages.1", "differ")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("spaces_between_special_tokens", False),
        ("use_beam_search", True),
        ("structural_tag", {"type": "structural_tag"}),
        ("logits_processors", ["my.module.Processor"]),
    ],
)
def test_vllms_sampling_fields_are_refused_by_both_routes_unless_they_change_nothing(field: str, value: Any) -> None:
    """vLLM's extensions we do not honour are refused, naming the field, rather than silently ignored."""
    for error in (chat_error(**{field: value}), completion_error(prompt="hi", **{field: value})):
        assert_names(error, field, "not supported yet")
        assert error["code"] == "unsupported_parameter"


@pytest.mark.parametrize(
    ("field", "value"),
    [("chat_template", "{{ x }}")],
)
def test_chat_rendering_fields_are_refused_unless_they_change_nothing(field: str, value: Any) -> None:
    assert_names(chat_error(**{field: value}), field, "not supported yet")


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"continue_final_message": True}, "continue_final_message", ("needs add_generation_prompt false",)),
        ({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message", ("new turn",)),
        ({"add_generation_prompt": "no"}, "add_generation_prompt", ("boolean",)),
        ({"echo": 1}, "echo", ("boolean",)),
    ],
)
def test_bad_turn_switches_are_refused_naming_them(fields: dict[str, Any], param: str, words: tuple[str, ...]) -> None:
    assert_names(chat_error(**fields), param, *words)


def test_chat_echo_repeats_the_last_message_only_where_it_is_the_assistants() -> None:
    """vLLM's chat echo: the answer continues the last message when that is the assistant's, and opens with it."""
    opened = [*USER, {"role": "assistant", "content": "The answer is"}]
    assert parse_request(ChatCompletionRequest, {"messages": opened, "echo": True}).echoed() == "The answer is"
    assert parse_request(ChatCompletionRequest, {"messages": opened}).echoed() == ""
    assert parse_request(ChatCompletionRequest, {"messages": USER, "echo": True}).echoed() == ""


@pytest.mark.parametrize(
    ("field", "value"),
    [("use_beam_search", 0), ("spaces_between_special_tokens", 1)],
)  # fmt: skip
def test_a_harmless_value_must_also_have_the_harmless_json_type(field: str, value: Any) -> None:
    """Strict as every other field: true is not 1 and 0 is not false, though 1 is 1.0."""
    assert_names(chat_error(**{field: value}), field, "not supported yet")


@pytest.mark.parametrize(
    "key", ["add_generation_prompt", "tokenize", "conversation", "tools", "messages", "sanitize_control_tokens"]
)
def test_chat_template_kwargs_that_are_arguments_of_the_template_call_are_refused(key: str) -> None:
    """The server sets these itself: passing them on would fail inside the template call with a Python error."""
    assert_names(chat_error(chat_template_kwargs={key: False}), "chat_template_kwargs", repr(key), "server sets")


def test_a_null_stream_option_is_off_and_one_left_out_includes_usage() -> None:
    """As vLLM reads them (include_usage defaults to true, and null is false); a null was once a 400 naming
    stream_options.include_usage."""
    body = {"messages": USER, "stream": True, "stream_options": {"include_usage": None}}
    request = parse_request(ChatCompletionRequest, body)
    assert request.stream_options is not None and not request.stream_options.include_usage
    request = parse_request(ChatCompletionRequest, {"messages": USER, "stream": True, "stream_options": {}})
    assert request.stream_options is not None and request.stream_options.include_usage


def test_stream_options_need_stream() -> None:
    assert_names(chat_error(stream_options={"include_usage": True}), "stream_options", "stream is true")
    assert_names(chat_error(stream=False, stream_options={"include_usage": True}), "stream_options")


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    """As vLLM's chat route takes them: max_completion_tokens where given, else max_tokens (a difference was a 400)."""
    request = parse_request(ChatCompletionRequest, {"messages": USER, "max_tokens": 10, "max_completion_tokens": 20})
    assert request.sampling_params().max_tokens == 20
    request = parse_request(ChatCompletionRequest, {"messages": USER, "max_completion_tokens": 7})
    assert request.sampling_params().max_tokens == 7


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"prompt": ""}, "prompt", ("empty",)),
        ({"prompt": []}, "prompt", ("empty",)),
        ({"prompt": [""]}, "prompt", ("empty",)),
        ({"prompt": [[]]}, "prompt", ("empty",)),
        ({"prompt": ["a", [3]]}, "prompt", ("all be texts or all be lists of token ids",)),
        ({"prompt": ["a", ""]}, "prompt", ("prompt 1 must not be empty",)),
        ({"prompt": [[1, 2], [3, -4]]}, "prompt", ("prompt 1 token ids", "item 1 is -4")),
        ({"prompt": ["a"] * 257}, "prompt", ("at most 256 prompts, got 257",)),
        ({"prompt": [5, -1]}, "prompt", ("item 1 is -1",)),
        ({"prompt": [5, "x"]}, "prompt", ('item 1 is "x"',)),
        ({"prompt": [5, True]}, "prompt", ("item 1 is true",)),
        ({"prompt": 5}, "prompt", ()),
        ({"prompt": "hi", "echo": 1}, "echo", ("boolean",)),
        ({"prompt": "hi", "suffix": "end"}, "suffix", ("not supported yet",)),
        ({"prompt": "hi", "best_of": 2}, "best_of", ("not supported yet",)),
        ({"prompt": "hi", "logprobs": 21}, "logprobs", ("less than or equal to 20",)),
        ({"prompt": "hi", "logprobs": -1}, "logprobs", ("greater than or equal to 0",)),
        ({"prompt": "hi", "logprobs": True}, "logprobs", ("integer",)),
        ({"prompt": "hi", "n": 129}, "n", ("less than or equal to 128",)),
        ({"prompt": "hi", "n": 0}, "n", ("greater than or equal to 1",)),
        ({"prompt": "hi", "top_p": 0}, "top_p", ()),
    ],
)
def test_bad_completion_requests(fields: dict[str, Any], param: str, words: tuple[str, ...]) -> None:
    assert_names(completion_error(**fields), param, *words)


def test_missing_prompt() -> None:
    assert_names(completion_error(max_tokens=3), "prompt", "required")


def test_chat_defaults() -> None:
    request = parse_request(ChatCompletionRequest, {"model": "flash-next", "messages": USER})
    assert request.sampling_params() == SamplingParams(
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        seed=None,
        max_tokens=None,
        stop=(),
        stop_token_ids=(),
        ignore_eos=False,
        draft=True,
    )
    assert not request.stream and not request.return_token_ids
    assert request.template_kwargs() == {}


def test_chat_fields_reach_sampling_params() -> None:
    body = {
        "messages": USER,
        "temperature": 0,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "seed": 2**63 - 1,
        "max_tokens": 32,
        "stop": "\n\n",
        "stop_token_ids": [7, 0],
        "ignore_eos": True,
        "draft": False,
    }
    params = parse_request(ChatCompletionRequest, body).sampling_params()
    assert params == SamplingParams(0.0, 0.9, 40, 0.05, 2**63 - 1, 32, ("\n\n",), (7, 0), True, False)
    with pytest.raises(AttributeError):
        params.temperature = 1.0  # type: ignore[misc]


def test_penalties_reach_the_sampling_params_on_both_routes() -> None:
    fields = {"repetition_penalty": 1.15, "frequency_penalty": -0.5, "presence_penalty": 2}
    chat = parse_request(ChatCompletionRequest, {"messages": USER, **fields}).sampling_params()
    text = parse_request(CompletionRequest, {"prompt": "hi", **fields}).sampling_params()
    assert dataclasses.replace(chat, max_tokens=None) == dataclasses.replace(text, max_tokens=None)
    assert (chat.repetition_penalty, chat.frequency_penalty, chat.presence_penalty) == (1.15, -0.5, 2.0)


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [("presence_penalty", 2.5, ("less than or equal to 2",)), ("frequency_penalty", -2.01, ("greater than",)),
     ("repetition_penalty", 0, ("greater than or equal to 0.01",)), ("repetition_penalty", 1e-39, ("0.01",)),
     ("repetition_penalty", 100.5, ("less than or equal to 100",)), ("repetition_penalty", -1.2, ("0.01",)),
     ("repetition_penalty", float("inf"), ("finite",)), ("repetition_penalty", True, ("number",)),
     ("presence_penalty", float("nan"), ("finite",))],
)  # fmt: skip
def test_penalties_out_of_range_are_refused_naming_the_field(field: str, value: Any, words: tuple[str, ...]) -> None:
    """OpenAI's range for frequency and presence ([-2, 2]); [0.01, 100] for the repetition penalty (vLLM takes any
    value > 0, and 1e-39 overflows the logits into a failed draw)."""
    for error in (chat_error(**{field: value}), completion_error(prompt="hi", **{field: value})):
        assert_names(error, field, *words)


@pytest.mark.parametrize(
    ("fields", "words"),
    [({"prompt_logprobs": 21}, ("less than or equal to 20",)), ({"prompt_logprobs": -1}, ("greater than",)),
     ({"prompt_logprobs": 2, "stream": True}, ("in a stream", "not supported yet"))],
)  # fmt: skip
def test_bad_prompt_logprobs_are_refused_on_both_routes(fields: dict[str, Any], words: tuple[str, ...]) -> None:
    for error in (chat_error(**fields), completion_error(prompt="hi", **fields)):
        assert_names(error, "prompt_logprobs", *words)
    assert (
        parse_request(CompletionRequest, {"prompt": "hi", "prompt_logprobs": 3}).sampling_params().prompt_logprobs == 3
    )


def test_top_k_minus_one_means_off() -> None:
    assert parse_request(ChatCompletionRequest, {"messages": USER, "top_k": -1}).sampling_params().top_k == 0


def test_nulls_and_harmless_values_read_as_not_given() -> None:
    body = {
        "messages": USER,
        "temperature": None,
        "seed": None,
        "stop": None,
        "n": 1,
        "logprobs": False,
        "presence_penalty": 0,
        "frequency_penalty": 0.0,
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "logit_bias": {},
        "user": "u-1",
        "some_client_extra": {"x": 1},
        "repetition_penalty": 1,
        "min_tokens": 0,
        "bad_words": [],
        "skip_special_tokens": True,
        "spaces_between_special_tokens": True,
        "use_beam_search": False,
        "guided_json": None,
        "echo": False,
        "add_generation_prompt": True,
        "continue_final_message": False,
        "functions": [],
        "function_call": "none",
        "include_reasoning": True,
        "logits_processors": [],
        "stream": True,
        "stream_options": {"include_usage": False, "continuous_usage_stats": None},
    }
    request = parse_request(ChatCompletionRequest, body)
    assert request.sampling_params() == SamplingParams()
    assert request.user == "u-1"


def test_content_parts_are_joined() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]},
        {"role": "assistant", "content": None},
        {"role": "developer", "content": [], "name": "dev"},
        {"role": "tool", "content": "42"},
    ]
    request = parse_request(ChatCompletionRequest, {"messages": messages})
    assert [(m.role, m.content) for m in request.messages] == [
        ("system", "be brief"),
        ("user", "first\nsecond"),
        ("assistant", ""),
        ("developer", ""),
        ("tool", "42"),
    ]


def test_chat_template_kwargs_pass_through() -> None:
    kwargs = {"enable_thinking": False, "reasoning_effort": "xhigh", "custom_flag": [1, 2]}
    request = parse_request(ChatCompletionRequest, {"messages": USER, "chat_template_kwargs": kwargs})
    assert request.template_kwargs() == kwargs


def test_openais_reasoning_effort_turns_thinking_on_at_that_effort() -> None:
    """The top-level field (OpenAI's) sets the template's reasoning_effort and turns thinking on, "none" off; keys
    given in chat_template_kwargs win."""

    def kwargs(**fields: Any) -> dict[str, Any]:
        return parse_request(ChatCompletionRequest, {"messages": USER, **fields}).template_kwargs()

    assert kwargs(reasoning_effort="high") == {"enable_thinking": True, "reasoning_effort": "high"}
    assert kwargs(reasoning_effort="none") == {"enable_thinking": False}
    given = {"enable_thinking": False, "reasoning_effort": "low"}
    assert kwargs(reasoning_effort="high", chat_template_kwargs=given) == given
    assert_names(chat_error(reasoning_effort="minimal"), "reasoning_effort", "minimal")


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("hello", ["hello"]), (["hello"], ["hello"]), ([1, 2, 3], [[1, 2, 3]]), ([[0, 9]], [[0, 9]]),
     (["a", "b"], ["a", "b"]), ([[1], [2, 3]], [[1], [2, 3]])],
)  # fmt: skip
def test_completion_prompts_are_read_as_a_batch_of_one_or_more(prompt: Any, expected: list) -> None:
    request = parse_request(CompletionRequest, {"prompt": prompt})
    assert request.prompt == expected
    assert request.sampling_params().max_tokens == 16


def test_completion_sampling_fields() -> None:
    body = {"prompt": "x", "max_tokens": 5, "temperature": 0.7, "top_k": 0, "stop": ["a", "b"], "seed": 3}
    params = parse_request(CompletionRequest, body).sampling_params()
    assert (params.max_tokens, params.temperature, params.top_k, params.stop, params.seed) == (5, 0.7, 0, ("a", "b"), 3)
    assert not params.include_stop_str_in_output
    body = {"prompt": "x", "stop": "a", "include_stop_str_in_output": True, "response_format": {"type": "text"}}
    assert parse_request(CompletionRequest, body).sampling_params().include_stop_str_in_output


def test_parse_raw_json_bytes() -> None:
    request = parse_request(CompletionRequest, b'{"prompt": [4, 5], "stream": true, "unknown": 1}')
    assert request.prompt == [[4, 5]] and request.stream


def test_api_error_body() -> None:
    error = ApiError("no", status=503, type="server_error", param="x", code="busy")
    assert error.body() == {"error": {"message": "no", "type": "server_error", "param": "x", "code": "busy"}}
    assert str(error) == "no"


def test_token_sha() -> None:
    assert token_sha([17, 4, 99]) == hashlib.sha256(b"17,4,99").hexdigest()
    assert token_sha([]) == hashlib.sha256(b"").hexdigest()


@pytest.mark.parametrize("top_k", [2**31 - 1, 2**31, 2**70])
def test_every_top_k_a_request_may_carry_crosses_the_control_link(top_k: int) -> None:
    """At --tp 2 each draw goes to rank 1 in the round header, whose top_k column is 32 bits: a larger top_k (any
    top_k of the vocabulary's size or more keeps every token) failed the round's encoding, which stops the server."""
    from rankwire.codec import decode_header, encode_header
    from rankwire.header import DrawSpec, LaneRows, RoundPlan

    params = parse_request(CompletionRequest, {"prompt": "x", "top_k": top_k}).sampling_params()
    draw = DrawSpec(params.temperature, params.top_k, params.top_p, params.min_p, 7)
    plan = RoundPlan(rows=(LaneRows(0, (1,), 0, draw),))
    assert decode_header(encode_header(plan)) == plan
    assert params.top_k >= 2**31 - 1


def test_seed_minus_one_is_no_seed_as_in_vllm() -> None:
    """vLLM reads seed -1 as none (a fresh draw each time), not as a fixed seed."""
    assert parse_request(CompletionRequest, {"prompt": "x", "seed": -1}).sampling_params().seed is None


@pytest.mark.parametrize("seed", [-2, -(2**63)])
def test_a_negative_seed_is_taken_as_openai_and_vllm_take_it_and_crosses_the_control_link(seed: int) -> None:
    """OpenAI's seed is any signed 64-bit integer, and vLLM takes the same range: a negative seed was a 400."""
    from rankwire.codec import decode_header, encode_header
    from rankwire.header import DrawSpec, LaneRows, RoundPlan

    params = parse_request(CompletionRequest, {"prompt": "x", "seed": seed}).sampling_params()
    assert params.seed == seed
    draw = DrawSpec(params.temperature, params.top_k, params.top_p, params.min_p, params.seed)
    plan = RoundPlan(rows=(LaneRows(0, (1,), 0, draw),))
    assert decode_header(encode_header(plan)) == plan


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"max_tokens": 0}, "max_tokens", ("only with echo",)),
        ({"max_tokens": 0, "echo": True, "stream": True}, "max_tokens", ("not streamed",)),
        ({"max_tokens": 0, "echo": True, "min_tokens": 1}, "min_tokens", ("at most max_tokens (0)",)),
        ({"max_tokens": -1, "echo": True}, "max_tokens", ("greater than or equal to 0",)),
    ],
)
def test_max_tokens_0_is_an_echo_of_the_prompt_alone(fields: dict[str, Any], param: str, words) -> None:
    assert_names(completion_error(prompt="x", **fields), param, *words)
    assert "got" not in completion_error(prompt="x", max_tokens=0)["message"]  # a whole-body check quotes no body back


def test_an_echo_of_the_prompt_alone_draws_one_token_for_its_prompt_pass() -> None:
    request = parse_request(CompletionRequest, {"prompt": [1, 2], "max_tokens": 0, "echo": True, "logprobs": 1})
    assert request.echoes_only() and request.sampling_params().max_tokens == 1
    assert request.sampling_params().prompt_logprobs == 1


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"skip_special_tokens": 0}, "skip_special_tokens", ("boolean",)),
        ({"include_reasoning": "no"}, "include_reasoning", ("boolean",)),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", ("must be -1", ">= 1")),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens", ("must be -1", ">= 1")),
    ],
)
def test_vllms_output_switches_take_only_their_own_types(fields: dict[str, Any], param: str, words) -> None:
    assert_names(chat_error(**fields), param, *words)


def test_skip_special_tokens_reaches_the_sampling_params() -> None:
    assert parse_request(ChatCompletionRequest, {"messages": USER}).sampling_params().skip_special_tokens
    kept = parse_request(CompletionRequest, {"prompt": "x", "skip_special_tokens": False}).sampling_params()
    assert not kept.skip_special_tokens
