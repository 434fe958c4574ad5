"""Tools on the chat route: offered to the template, and the answer's tool-call blocks given as OpenAI tool_calls,
streamed or not, through the shipped model's tokenizer and a scripted engine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from server.app import ServerState, build_app
from server.engine import Update
from tests.server.test_generation import RecordingEngine

SHIPPED = Path(__file__).resolve().parents[2] / "model" / "checkpoints" / "flashnext-small"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ASK = [{"role": "user", "content": "Weather in Paris and Oslo?"}]
ONE_CALL = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO_CALLS = ONE_CALL + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(SHIPPED)


class Answering(RecordingEngine):
    """An engine that answers every request with the tokens of one text, a few tokens an update, then stops."""

    def __init__(self, tokenizer: Any, answer: str, per_update: int = 2) -> None:
        super().__init__()
        self.ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
        self.per_update = per_update

    def submit(self, request) -> None:
        super().submit(request)
        cuts = list(range(0, len(self.ids), self.per_update))
        for k, at in enumerate(cuts):
            request.sink(Update(tuple(self.ids[at : at + self.per_update]), "stop" if k == len(cuts) - 1 else None))


def http(tokenizer: Any, answer: str, per_update: int = 2) -> tuple[TestClient, Answering]:
    engine = Answering(tokenizer, answer, per_update)
    return TestClient(build_app(ServerState(engine, tokenizer, "m", 4096, len(tokenizer), (0,)))), engine


def chat(client: TestClient, **fields: Any) -> dict:
    response = client.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER], **fields})
    assert response.status_code == 200, response.text
    return response.json()


def streamed(client: TestClient, **fields: Any) -> list[dict]:
    """The choice of every chunk of a streamed chat (one choice)."""
    body = {"messages": ASK, "tools": [WEATHER], "stream": True, **fields}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event)["choices"][0] for event in events[:-1]]


def calls_of(entries: list[dict]) -> list[tuple[str, dict]]:
    return [(entry["function"]["name"], json.loads(entry["function"]["arguments"])) for entry in entries]


def joined_calls(entries: list[dict]) -> list[dict]:
    """Streamed `tool_calls` deltas joined by their index, as OpenAI's clients join them: the first delta of a call
    brings its id, type and name; every delta adds to its arguments."""
    calls: dict[int, dict] = {}
    for entry in entries:
        call = calls.setdefault(entry["index"], {"function": {"arguments": ""}})
        call.update({key: value for key, value in entry.items() if key not in ("index", "function")})
        call["function"]["name"] = call["function"].get("name") or entry["function"].get("name")
        call["function"]["arguments"] += entry["function"].get("arguments", "")
    return [calls[index] for index in sorted(calls)]


def test_a_tool_call_block_becomes_tool_calls_with_finish_reason_tool_calls(tokenizer):
    client, _ = http(tokenizer, TWO_CALLS)
    choice = chat(client)["choices"][0]
    message = choice["message"]
    assert message["content"] == "Let me look.\n"
    assert calls_of(message["tool_calls"]) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
    ids = [call["id"] for call in message["tool_calls"]]
    assert all(i.startswith("chatcmpl-tool-") for i in ids) and len(set(ids)) == 2
    assert {call["type"] for call in message["tool_calls"]} == {"function"}
    assert choice["finish_reason"] == "tool_calls"


@pytest.mark.parametrize("per_update", [1, 2, 5])
def test_streamed_tool_calls_equal_the_non_streamed_answer(tokenizer, per_update):
    """The streamed deltas' content joined, and their tool_calls in index order, are the non-streamed message's."""
    client, _ = http(tokenizer, TWO_CALLS, per_update)
    whole = chat(client)["choices"][0]
    chunks = streamed(client)
    content = "".join(chunk["delta"].get("content") or "" for chunk in chunks)
    entries = [entry for chunk in chunks for entry in chunk["delta"].get("tool_calls", [])]
    assert content == whole["message"]["content"]
    assert [entry["index"] for entry in entries] == [0, 1]
    assert calls_of(entries) == calls_of(whole["message"]["tool_calls"])
    assert [chunk["finish_reason"] for chunk in chunks if chunk["finish_reason"]] == ["tool_calls"]


@pytest.mark.parametrize(
    "answer", ["Compare a <tool", 'Sure.\n<tool_call>\n{"name": "get_weather", "argum', ONE_CALL + "\n\nDone <"]
)
def test_a_streams_held_back_tail_comes_with_its_last_chunk(tokenizer, answer):
    """Text that might have begun a tag when the answer ended (a tag's start, an unclosed block, an answer cut
    short) is sent with the last chunk, so the stream's content equals the non-streamed content."""
    client, _ = http(tokenizer, answer, 3)
    whole = chat(client)["choices"][0]["message"]["content"]
    assert whole.endswith(answer[-4:])
    assert "".join(chunk["delta"].get("content") or "" for chunk in streamed(client)) == whole


def test_only_calls_give_null_content(tokenizer):
    client, _ = http(tokenizer, ONE_CALL.removeprefix("Let me look.\n"))
    message = chat(client)["choices"][0]["message"]
    assert message["content"] is None and calls_of(message["tool_calls"]) == [("get_weather", {"city": "Paris"})]


def test_parallel_tool_calls_false_keeps_the_first_call_streamed_or_not(tokenizer):
    client, _ = http(tokenizer, TWO_CALLS)
    message = chat(client, parallel_tool_calls=False)["choices"][0]["message"]
    assert calls_of(message["tool_calls"]) == [("get_weather", {"city": "Paris"})]
    entries = [e for chunk in streamed(client, parallel_tool_calls=False) for e in chunk["delta"].get("tool_calls", [])]
    assert calls_of(entries) == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("fields", [{"tool_choice": "none"}, {"tools": None}])
def test_without_parsing_the_blocks_stay_in_the_content(tokenizer, fields):
    """tool_choice 'none' (tools still shown to the template, as vLLM does) and no tools leave the text as it is."""
    client, _ = http(tokenizer, ONE_CALL)
    choice = chat(client, **fields)["choices"][0]
    assert choice["message"]["content"] == ONE_CALL and not choice["message"].get("tool_calls")
    assert choice["finish_reason"] == "stop"
    assert "".join(chunk["delta"].get("content") or "" for chunk in streamed(client, **fields)) == ONE_CALL


def test_a_block_that_is_not_a_call_stays_in_the_content(tokenizer):
    broken = 'Hm.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'
    client, _ = http(tokenizer, broken)
    choice = chat(client)["choices"][0]
    assert choice["message"]["content"] == broken and choice["message"]["tool_calls"] == []
    assert choice["finish_reason"] == "stop"


def test_offered_tools_and_earlier_calls_are_rendered_into_the_prompt(tokenizer):
    """The prompt the engine gets is the template's render with the tools, the earlier call as a block and the
    tool's answer as a tool response."""
    client, engine = http(tokenizer, "Sunny.")
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "c1"}]  # fmt: skip
    chat(client, messages=messages)
    prompt = tokenizer.decode(engine.submitted[-1].prompt_ids)
    expected = tokenizer.apply_chat_template(
        [*ASK, {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "id": "c1", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
         {"role": "tool", "content": "sunny, 21 C", "tool_call_id": "c1"}],
        tools=[WEATHER], add_generation_prompt=True, tokenize=False,
    )  # fmt: skip
    assert prompt == expected
    assert json.dumps(WEATHER) in prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt


def test_tools_for_a_template_that_does_not_render_them_are_a_400(tokenizer):
    """A template without `tools` would drop them and the model would answer as if none were offered."""
    plain = AutoTokenizer.from_pretrained(SHIPPED)
    plain.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    engine = Answering(tokenizer, "x")
    client = TestClient(build_app(ServerState(engine, plain, "m", 4096, len(tokenizer), (0,))))
    response = client.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools"
    assert engine.submitted == []
    assert client.post("/v1/chat/completions", json={"messages": ASK}).status_code == 200


def test_tokenize_renders_offered_tools_as_the_chat_route_does(tokenizer):
    client, engine = http(tokenizer, "ok")
    chat(client)
    tokens = client.post("/tokenize", json={"messages": ASK, "tools": [WEATHER]}).json()["tokens"]
    assert tokens == engine.submitted[-1].prompt_ids
    assert len(tokens) > len(client.post("/tokenize", json={"messages": ASK}).json()["tokens"])


NAMED = {"type": "function", "function": {"name": "get_weather"}}
CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'


def guided_to(guide, text: str) -> bool:
    """Whether a guide's grammar takes the text whole."""
    grammar = guide.grammar()
    state = grammar.feed(grammar.initial, text.encode())
    return state is not None and grammar.accepts(state)


@pytest.mark.parametrize(
    ("fields", "answer", "finish", "refused"),
    [
        ({"tool_choice": NAMED}, '{"city": "Paris"}', "stop", ['{"town": "Paris"}', CALL]),
        ({"tool_choice": "required"}, f"[{CALL}]", "tool_calls", ["[]", '{"city": "Paris"}', '[{"name": "x", '
                                                                   '"parameters": {"city": "Paris"}}]']),
        ({"tool_choice": "required", "parallel_tool_calls": False}, f"[{CALL}]", "tool_calls", [f"[{CALL}, {CALL}]"]),
    ],
)  # fmt: skip
def test_a_forced_tool_choice_guides_the_answer_and_gives_its_calls(tokenizer, fields, answer, finish, refused):
    """vLLM's forms: a named choice's answer is the arguments (finish_reason "stop", as OpenAI's), 'required''s a
    list of calls ("tool_calls"); the guide takes the answer and refuses other shapes."""
    client, engine = http(tokenizer, answer)
    body = chat(client, chat_template_kwargs={"enable_thinking": False}, **fields)
    guide = engine.submitted[-1].guide
    assert guided_to(guide, answer) and not any(guided_to(guide, text) for text in refused)
    (choice,) = body["choices"]
    assert choice["finish_reason"] == finish and choice["message"]["content"] is None
    assert calls_of(choice["message"]["tool_calls"]) == [("get_weather", {"city": "Paris"})]
    chunks = streamed(client, chat_template_kwargs={"enable_thinking": False}, **fields)
    deltas = [c["delta"] for c in chunks]
    assert not "".join(d.get("content") or "" for d in deltas)  # the JSON is the calls, not content
    entries = [call for d in deltas for call in d.get("tool_calls", [])]
    assert calls_of(joined_calls(entries)) == [("get_weather", {"city": "Paris"})]
    assert len(entries) > 1 if "tool_choice" in fields and fields["tool_choice"] == NAMED else len(entries) == 1
    whole = choice["message"]["tool_calls"]
    assert [call["function"] for call in joined_calls(entries)] == [call["function"] for call in whole]
    assert chunks[-1]["finish_reason"] == finish


def test_required_keeps_each_tools_own_references(tokenizer):
    """A tool's '#' and its $defs still name its own schema and definitions inside the list of calls."""
    tree = {"type": "object", "properties": {"name": {"type": "string"},
                                             "children": {"type": "array", "items": {"$ref": "#"}}},
            "required": ["name"]}  # fmt: skip
    place = {
        "type": "object",
        "properties": {"where": {"$ref": "#/$defs/Place"}},
        "required": ["where"],
        "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}},
    }
    tools = [{"type": "function", "function": {"name": "tree", "parameters": tree}},
             {"type": "function", "function": {"name": "go", "parameters": place}}]  # fmt: skip
    client, engine = http(tokenizer, "[]")
    reply = client.post("/v1/chat/completions", json={"messages": ASK, "tools": tools, "tool_choice": "required"})
    assert reply.status_code == 200, reply.text
    guide = engine.submitted[-1].guide
    good = ('[{"name": "tree", "parameters": {"name": "a", "children": [{"name": "b", "children": []}]}}, '
            '{"name": "go", "parameters": {"where": {"city": "Oslo"}}}]')  # fmt: skip
    assert guided_to(guide, good)
    assert not guided_to(guide, '[{"name": "tree", "parameters": {"name": "a", "children": [[' + CALL + "]]}}]")
    assert not guided_to(guide, '[{"name": "go", "parameters": {"where": {"town": "Oslo"}}}]')


def test_a_forced_call_after_thinking_keeps_the_reasoning(tokenizer):
    """The guide starts after the think block's end: the answer's JSON follows </think> at once."""
    from server.guide_spec import GuideSpec

    client, engine = http(tokenizer, 'Paris, then.\n</think>{"city": "Paris"}')
    body = chat(client, tool_choice=NAMED, chat_template_kwargs={"enable_thinking": True})
    guide = engine.submitted[-1].guide
    assert guide == GuideSpec("json", json.dumps(WEATHER["function"]["parameters"]), 4095)
    assert guided_to(guide, '{"city": "Paris"}')
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == "Paris, then.\n"
    assert calls_of(message["tool_calls"]) == [("get_weather", {"city": "Paris"})]


def test_a_named_forced_answer_cut_by_its_length_gives_the_arguments_written(tokenizer):
    """As vLLM's: the call carries what was written, streamed or not (finish_reason, "length" there, tells it was cut:
    test_tool_calls.py)."""
    client, _ = http(tokenizer, '{"city": "Pa')
    body = chat(client, tool_choice=NAMED, chat_template_kwargs={"enable_thinking": False})
    (choice,) = body["choices"]
    assert choice["message"]["content"] is None
    assert [call["function"] for call in choice["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Pa'}
    ]
    chunks = streamed(client, tool_choice=NAMED, chat_template_kwargs={"enable_thinking": False})
    entries = [call for chunk in chunks for call in chunk["delta"].get("tool_calls", [])]
    assert [call["function"] for call in joined_calls(entries)] == [
        {"name": "get_weather", "arguments": '{"city": "Pa'}
    ]


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice", "'get_weather'"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "one way to guide"),
        ({"tool_choice": NAMED, "tools": [{**WEATHER, "function": {**WEATHER["function"], "parameters": {
            "type": "object", "properties": {"n": {"type": "integer", "multipleOf": 0.1234}}}}}]},
         "tools.0.function.parameters", "/properties/n/multipleOf"),
    ],
)  # fmt: skip
def test_a_forced_tool_choice_that_cannot_be_guided_is_a_400(tokenizer, fields, param, says):
    client, engine = http(tokenizer, "{}")
    reply = client.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER], **fields})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param and says in reply.json()["error"]["message"], reply.json()
    assert not engine.submitted


def test_the_responses_api_forces_a_named_call(tokenizer):
    client, engine = http(tokenizer, '{"city": "Oslo"}')
    tool = {"type": "function", **{k: WEATHER["function"][k] for k in ("name", "description", "parameters")}}
    body = {"input": "Weather?", "tools": [tool], "tool_choice": {"type": "function", "name": "get_weather"},
            "reasoning": {"effort": "none"}}  # fmt: skip
    reply = client.post("/v1/responses", json=body)
    assert reply.status_code == 200, reply.text
    (item,) = [item for item in reply.json()["output"] if item["type"] == "function_call"]
    assert (item["name"], json.loads(item["arguments"])) == ("get_weather", {"city": "Oslo"})
    assert reply.json()["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert engine.submitted[-1].guide is not None


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"tool_choice": "required"}, "needs tools"),
        ({"tool_choice": {"type": "function", "name": "get_weather"}}, "needs tools"),
        ({"tools": [{"type": "function", "name": "get_weather"}], "tool_choice": {"type": "function"}}, "name"),
    ],
)
def test_the_responses_api_refuses_a_forced_choice_it_cannot_honour(tokenizer, fields, says):
    client, engine = http(tokenizer, "{}")
    reply = client.post("/v1/responses", json={"input": "Weather?", **fields})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "tool_choice" and says in reply.json()["error"]["message"]
    assert not engine.submitted


def test_a_required_answer_cut_before_its_first_call_closes_gives_the_same_content_streamed_or_not(tokenizer):
    """The open item is content, the list's bracket is not, in both forms (the whole answer used to keep the raw
    text, bracket and all, when no call had closed)."""
    client, _ = http(tokenizer, '[{"name": "get_weather", "parameters": {"city": "Pa')
    fields = {"tool_choice": "required", "chat_template_kwargs": {"enable_thinking": False}}
    message = chat(client, **fields)["choices"][0]["message"]
    deltas = [chunk["delta"] for chunk in streamed(client, **fields)]
    assert not message["tool_calls"] and not any(delta.get("tool_calls") for delta in deltas)
    assert (
        message["content"]
        == "".join(d.get("content") or "" for d in deltas)
        == ('{"name": "get_weather", "parameters": {"city": "Pa')
    )
