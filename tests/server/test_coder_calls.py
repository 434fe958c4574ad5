"""Qwen3-Coder's XML tool calls (`--tool-call-parser qwen3_coder`, the real Flash Next model's form): each value read
by its parameter's schema, blocks that are no call kept as content, streamed pieces joined = the whole text parsed,
and the parser picked from the chat template where none is named."""

from __future__ import annotations

import itertools
import json
import random
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from server.app import ServerState, build_app
from server.cli import build_parser
from server.http_options import http_options
from server.tool_calls import ToolCallStream, coder_calls, parse_tool_calls, tool_call_parser
from tests.server.test_tool_calls import counter_ids, expected_calls
from tests.server.test_tool_calls_api import SHIPPED, Answering

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "scale": {"type": "number"},
        "metric": {"type": "boolean"},
        "tags": {"type": "array"},
        "where": {"type": "object"},
        "note": {"type": ["string", "null"]},
        "plain": {},
        "count": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        "odd": {"type": {"not": "a type"}},
    },
}
READ = coder_calls({"weather": SCHEMA, "bare": None})


def call(name: str, **params: str) -> str:
    """A Qwen3-Coder call block with each value on lines of its own, as the templates write them."""
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def parsed(text: str):
    return parse_tool_calls(text, make_id=counter_ids(), read=READ)


@pytest.mark.parametrize(
    ("value", "param", "read"),
    [
        ("Paris", "city", "Paris"), ("5", "city", "5"), (" two words ", "city", " two words "),
        ("3", "days", 3), ("-12", "days", -12), ("3.5", "days", "3.5"), ("three", "days", "three"),
        ("2.5", "scale", 2.5), ("-1e3", "scale", -1000), ("7", "scale", 7), ("NaN", "scale", "NaN"),
        ("7.0", "scale", 7), (".5", "scale", 0.5), ("5.", "scale", 5), ("+5", "days", 5), ("+2.5", "scale", 2.5),
        ("1e999", "scale", "1e999"), ("1_000", "scale", "1_000"), ("1_000", "days", "1_000"),
        ("True", "metric", True), ("false", "metric", False), ("yes", "metric", "yes"),
        ('["a", 1]', "tags", ["a", 1]), ('{"a": 1}', "tags", '{"a": 1}'), ("[1,", "tags", "[1,"),
        ('{"lat": 1.5}', "where", {"lat": 1.5}), ("[1]", "where", "[1]"), ('{"x": NaN}', "where", '{"x": NaN}'),
        ("null", "note", None), ("NULL", "days", None), ("hi", "note", "hi"), ("None", "days", None),
        ("None", "note", None), ("null", "city", "null"), ("None", "city", "None"), ("null", "unlisted", "null"),
        ("5", "count", 5), ("None", "count", None), ("x", "count", "x"), ("5", "odd", "5"),
        ("5", "plain", "5"), ("5", "unlisted", "5"), ("\nkept\n", "city", "\nkept\n"),
    ],
)  # fmt: skip
def test_each_value_is_read_by_its_parameters_schema(value, param, read):
    content, calls = parsed(call("weather", **{param: value}))
    assert content == "" and json.loads(calls[0].arguments) == {param: read}


@pytest.mark.parametrize(
    "value",
    ["x = '</parameter>'", "see <parameter=foo> here", "a\n</parameter> not the end\nb", "</parameter>x"],
)
def test_tag_text_inside_a_value_is_the_values_own(value):
    content, calls = parsed(call("weather", city=value, days="2"))
    assert content == "" and json.loads(calls[0].arguments) == {"city": value, "days": 2}


def test_text_around_the_calls_stays_and_a_function_of_no_schema_takes_text():
    text = "Checking.\n" + call("weather", city="Oslo", days="2") + "\n" + call("bare", n="1") + "\nDone."
    assert parsed(text) == (
        "Checking.\n\nDone.",
        expected_calls([("weather", '{"city": "Oslo", "days": 2}'), ("bare", '{"n": "1"}')]),
    )


@pytest.mark.parametrize(
    "inner",
    [
        "\n<function=weather>\n<parameter=city>\nA\n<parameter=days>\n4\n</function>\n",  # end tags left out
        "\n<function=weather>\n<parameter=city>\nA\n</parameter>\n<parameter=days>\n4\n",  # the function's too
        "<function=weather><parameter=city>A</parameter><parameter=days>4</parameter></function>",  # on one line
    ],
)
def test_end_tags_may_be_left_out_before_the_next_parameter_or_the_functions_end(inner):
    assert parsed(f"<tool_call>{inner}</tool_call>") == ("", expected_calls([("weather", '{"city": "A", "days": 4}')]))


@pytest.mark.parametrize(
    "inner",
    [
        "\n<function=>\n</function>\n",  # no name
        "\n<function=weather>\nstray text\n<parameter=city>\nA\n</parameter>\n</function>\n",
        "\n<function=weather>\n</function>\ntrailing\n",
        "\n<function=weather>\n<parameter=>\nA\n</parameter>\n</function>\n",  # no key
        '\n{"name": "weather", "arguments": {}}\n',  # Hermes' form
        "\nweather\n",
    ],
)
def test_a_block_that_is_no_call_stays_content_verbatim(inner):
    text = f"Before <tool_call>{inner}</tool_call> after"
    assert parsed(text) == (text, [])


def test_a_call_cut_before_its_end_tag_is_a_call_where_it_reads_as_one():
    cut = "Sure.\n<tool_call>\n<function=weather>\n<parameter=city>\nRome\n</parameter>\n"
    assert parsed(cut) == ("Sure.\n", expected_calls([("weather", '{"city": "Rome"}')]))


TWO_IN_ONE = (  # vLLM's qwen3_coder parser reads every function of a block as a call of its own
    "<tool_call>\n<function=weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n"
    "<function=bare>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
TWO_CALLS = [("weather", '{"city": "Oslo"}'), ("bare", '{"days": "3"}')]


@pytest.mark.parametrize(
    "text",
    [
        TWO_IN_ONE,
        TWO_IN_ONE.replace("</function>\n<function=", "</function>\n<tool_call>\n<function="),  # first left open
        TWO_IN_ONE.replace("\n</function>\n</tool_call>", ""),  # the second cut before its ends
    ],
)
def test_each_function_of_a_block_is_a_call_whole_and_streamed(text):
    assert parsed(text) == stream(list(text)) == ("", expected_calls(TWO_CALLS))
    assert parse_tool_calls(text, make_id=counter_ids(), parallel=False, read=READ) == (
        "",
        expected_calls(TWO_CALLS[:1]),
    )


@pytest.mark.parametrize("end", ["\n</tool_call>", ""])
def test_text_after_a_functions_end_keeps_the_block_as_content(end):
    text = f"<tool_call>\n<function=weather>\n<parameter=days>\n3\n</parameter>\n</function>\nI will wait.{end}"
    assert parsed(text) == stream(list(text)) == (text, [])


def stream(pieces: list[str]):
    parser = ToolCallStream(make_id=counter_ids(), read=READ)
    content, calls = "", []
    for piece in [*pieces, None]:
        delta, done = parser.feed(piece) if piece is not None else parser.flush()
        content, calls = content + delta, calls + done
    return content, calls


def test_streamed_pieces_joined_are_the_whole_text_parsed():
    rng = random.Random(11)
    parts = [call("weather", city="Oslo", days="x"), call("bare"), TWO_IN_ONE, "<tool_call>", "</tool_call>",
             "<function=", "<parameter=city>", "</parameter>", "</function>", "\n", "text", "é"]  # fmt: skip
    for _ in range(400):
        text = "".join(rng.choices(parts, k=rng.randint(0, 6)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 5))))
        pieces = [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]
        assert stream(pieces) == parsed(text), pieces


@pytest.mark.parametrize(
    ("choice", "template", "parser"),
    [
        ("auto", "{{ '<tool_call>\\n<function=' ~ name ~ '>' }}", "qwen3_coder"),
        ("auto", "{{ '<tool_call>\\n{\"name\": ' }}", "hermes"),
        ("auto", None, "hermes"),
        ("auto", {"default": "{{ x }}", "tool_use": "{{ '<function=' ~ name }}"}, "qwen3_coder"),
        ("hermes", "{{ '<function=' }}", "hermes"),
        ("qwen3_coder", None, "qwen3_coder"),
    ],
)
def test_the_parser_is_the_one_named_or_the_one_the_template_writes(choice, template, parser):
    assert tool_call_parser(choice, SimpleNamespace(chat_template=template)) == parser


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(SHIPPED)


@pytest.mark.parametrize("two_in_one", [False, True])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_the_api_answers_coder_calls_as_tool_calls_streamed_or_not(tokenizer, path, two_in_one):
    """Each call, and each function of one block, as an entry of its own (streamed or not)."""
    answer = "Let me look.\n" + call("weather", city="Oslo", days="3", metric="true")
    if two_in_one:
        answer = answer.replace(
            "</function>\n", "</function>\n" + answer[answer.index("<function=") : answer.index("</tool_call>")], 1
        )
    options = http_options(build_parser().parse_args(["serve", "--tool-call-parser", "qwen3_coder"]))
    engine = Answering(tokenizer, answer, per_update=3)
    http = TestClient(build_app(ServerState(engine, tokenizer, "m", 4096, len(tokenizer), (0,), http=options)))
    tools = [{"type": "function", "function": {"name": "weather", "parameters": SCHEMA}}]
    arguments = {"city": "Oslo", "days": 3, "metric": True}
    calls = [arguments] * (1 + two_in_one)
    body = {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "max_tokens": 64}
    if path == "/v1/messages":
        body["tools"] = [{"name": "weather", "input_schema": SCHEMA}]
        message = http.post(path, json=body).json()
        assert [b["input"] for b in message["content"] if b["type"] == "tool_use"] == calls
        assert message["stop_reason"] == "tool_use"
        return
    whole = http.post(path, json={**body, "tools": tools}).json()["choices"][0]
    assert [json.loads(c["function"]["arguments"]) for c in whole["message"]["tool_calls"]] == calls
    assert whole["message"]["content"] == "Let me look.\n" and whole["finish_reason"] == "tool_calls"
    lines = http.post(path, json={**body, "tools": tools, "stream": True}).text.splitlines()
    chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    streamed = [json.loads(t["function"]["arguments"]) for d in deltas for t in d.get("tool_calls") or []]
    assert streamed == calls and "".join(d.get("content") or "" for d in deltas) == "Let me look.\n"
