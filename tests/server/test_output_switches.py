"""vLLM's output switches: include_reasoning, skip_special_tokens and truncate_prompt_tokens, through the shipped
model's tokenizer and a scripted engine."""

from __future__ import annotations

import json
from typing import Any

import pytest
from transformers import AutoTokenizer

from tests.server.test_tool_calls_api import SHIPPED, http

ASK = [{"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(SHIPPED)


def chunks(client, route: str, body: dict) -> list[dict]:
    text = client.post(route, json={**body, "stream": True}).text
    return [json.loads(line[6:])["choices"][0] for line in text.splitlines() if line.startswith("data: {")]


@pytest.mark.parametrize("include", [True, False])
def test_include_reasoning_false_leaves_the_thinking_out_streamed_or_not(tokenizer, include):
    client, _ = http(tokenizer, "hmm, blue\n</think>\n\nBlue.")
    body = {"messages": ASK, "chat_template_kwargs": {"enable_thinking": True}, "include_reasoning": include}
    message = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert message["content"] == "Blue."
    assert message["reasoning_content"] == ("hmm, blue\n" if include else None)
    deltas = [c["delta"] for c in chunks(client, "/v1/chat/completions", body)]
    assert "".join(d.get("content") or "" for d in deltas) == "Blue."
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == ("hmm, blue\n" if include else "")


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens_false_gives_special_tokens_text(tokenizer, skip):
    client, _ = http(tokenizer, "red<|im_start|>green")
    body = {"prompt": "Colors:", "max_tokens": 8, "skip_special_tokens": skip}
    text = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert text == ("redgreen" if skip else "red<|im_start|>green")
    assert "".join(c["text"] for c in chunks(client, "/v1/completions", body)) == text


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(tokenizer):
    client, engine = http(tokenizer, "x")
    ids = list(range(100, 112))
    reply = client.post("/v1/completions", json={"prompt": [ids, ids[:3]], "truncate_prompt_tokens": 5, "echo": True})
    assert [r.prompt_ids for r in engine.submitted] == [ids[-5:], ids[:3]]
    assert reply.json()["usage"]["prompt_tokens"] == 8
    assert reply.json()["choices"][0]["text"] == tokenizer.decode(ids[-5:]) + "x"
    text = "The quick brown fox jumps over the lazy dog."
    client.post("/v1/completions", json={"prompt": text, "truncate_prompt_tokens": 4, "echo": True})
    full = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert engine.submitted[-1].prompt_ids == full[-4:]
    client.post("/v1/chat/completions", json={"messages": ASK, "truncate_prompt_tokens": 6})
    rendered = tokenizer(tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False))
    assert engine.submitted[-1].prompt_ids == rendered["input_ids"][-6:]
