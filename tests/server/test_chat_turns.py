"""vLLM's chat turn switches: add_generation_prompt, continue_final_message and echo, through the shipped model's
tokenizer and a scripted engine."""

from __future__ import annotations

import json
from typing import Any

import pytest
from transformers import AutoTokenizer

from tests.server.test_tool_calls_api import SHIPPED, http

OPENED = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "The color is"}]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(SHIPPED)


def prompt_of(tokenizer: Any, **fields: Any) -> tuple[str, dict]:
    """The prompt text the engine got for a chat of OPENED with `fields`, and the response."""
    client, engine = http(tokenizer, " blue.")
    response = client.post("/v1/chat/completions", json={"messages": OPENED, **fields})
    assert response.status_code == 200, response.text
    return tokenizer.decode(engine.submitted[-1].prompt_ids), response.json()


def test_continue_final_message_leaves_the_last_message_open(tokenizer):
    prompt, _ = prompt_of(tokenizer, add_generation_prompt=False, continue_final_message=True)
    assert prompt == tokenizer.apply_chat_template(
        OPENED, add_generation_prompt=False, continue_final_message=True, tokenize=False
    )
    assert prompt.endswith("<|im_start|>assistant\nThe color is")


def test_add_generation_prompt_false_opens_no_turn(tokenizer):
    prompt, _ = prompt_of(tokenizer, add_generation_prompt=False)
    assert prompt.endswith("<|im_start|>assistant\nThe color is<|im_end|>\n")
    default, _ = prompt_of(tokenizer)
    assert default == prompt + "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_echo_opens_the_answer_with_the_message_it_continues_streamed_or_not(tokenizer):
    fields = {"add_generation_prompt": False, "continue_final_message": True, "echo": True}
    _, response = prompt_of(tokenizer, **fields)
    assert response["choices"][0]["message"]["content"] == "The color is blue."
    _, plain = prompt_of(tokenizer, add_generation_prompt=False, continue_final_message=True)
    assert plain["choices"][0]["message"]["content"] == " blue."
    client, _ = http(tokenizer, " blue.")
    text = client.post("/v1/chat/completions", json={"messages": OPENED, "stream": True, **fields}).text
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "The color is blue."


def test_tokenize_takes_the_turn_switches_as_the_chat_route_does(tokenizer):
    client, engine = http(tokenizer, "x")
    fields = {"add_generation_prompt": False, "continue_final_message": True}
    client.post("/v1/chat/completions", json={"messages": OPENED, **fields})
    assert (
        client.post("/tokenize", json={"messages": OPENED, **fields}).json()["tokens"]
        == engine.submitted[-1].prompt_ids
    )


@pytest.mark.parametrize(
    ("last", "opened"), [("Hello", False), ("<think>\nHmm", True), ("<think>a</think>\n\nOk", False)]
)
def test_a_continued_message_alone_says_whether_the_answer_is_inside_a_think_block(tokenizer, last, opened):
    """An earlier message that mentions <think> opens no think block for the answer; the continued message's own open
    block does (the answer is then reasoning; echo puts the message's text before the content)."""
    messages = [{"role": "user", "content": "What does the <think> tag do?"}, {"role": "assistant", "content": last}]
    client, _ = http(tokenizer, " world")
    fields = {"add_generation_prompt": False, "continue_final_message": True, "echo": True}
    message = client.post("/v1/chat/completions", json={"messages": messages, **fields}).json()["choices"][0]["message"]
    assert message["reasoning_content"] == (" world" if opened else None)
    assert message["content"] == (last if opened else last + " world")


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"add_generation_prompt": False, "continue_final_message": True}, "continue_final_message"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"chat_template_kwargs": {"loud": True}}, "chat_template_kwargs"),
        ({"messages": [{"role": "system", "content": "s"}]}, "messages"),
    ],
)
def test_a_template_refusal_names_the_field_whose_addition_makes_it_refuse(tokenizer, fields, param):
    """A template that shouts every message (so a continued message is not found in its render), refuses a system
    turn, a loud switch and a tool named f: each refusal's 400 names the field that brought it."""
    from fastapi.testclient import TestClient

    from server.app import ServerState, build_app
    from tests.server.test_tool_calls_api import Answering

    strict = AutoTokenizer.from_pretrained(SHIPPED)
    strict.chat_template = (
        "{% if loud %}{{ raise_exception('too loud') }}{% endif %}"
        "{% for t in tools or [] %}{% if t.function.name == 'f' %}{{ raise_exception('no f') }}{% endif %}{% endfor %}"
        "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system') }}{% endif %}"
        "{{ m.role }}: {{ m.content | upper }}\n{% endfor %}"
    )
    engine = Answering(tokenizer, "x")
    client = TestClient(build_app(ServerState(engine, strict, "m", 4096, len(tokenizer), (0,))))
    response = client.post("/v1/chat/completions", json={"messages": OPENED, **fields})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert engine.submitted == []


def test_documents_reach_a_template_that_renders_them_and_are_a_400_for_one_that_does_not(tokenizer):
    from fastapi.testclient import TestClient

    from server.app import ServerState, build_app
    from tests.server.test_tool_calls_api import Answering

    documents = [{"title": "A", "text": "alpha"}, {"text": "beta"}]
    reader = AutoTokenizer.from_pretrained(SHIPPED)
    reader.chat_template = (
        "{% for d in documents or [] %}<doc>{{ d.text }}</doc>{% endfor %}{% for m in messages %}{{ m.content }}"
        "{% endfor %}"
    )
    for template_tokenizer, status in ((reader, 200), (tokenizer, 400)):
        engine = Answering(tokenizer, "x")
        client = TestClient(build_app(ServerState(engine, template_tokenizer, "m", 4096, len(tokenizer), (0,))))
        response = client.post("/v1/chat/completions", json={"messages": OPENED, "documents": documents})
        assert response.status_code == status, response.text
        if status == 400:
            assert response.json()["error"]["param"] == "documents" and engine.submitted == []
        else:
            assert tokenizer.decode(engine.submitted[-1].prompt_ids).startswith("<doc>alpha</doc><doc>beta</doc>")
