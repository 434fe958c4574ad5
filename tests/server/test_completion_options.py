"""Output options as vLLM takes them (helper-133's review): a stop string that begins in min_tokens' text, best_of
below n, truncate_prompt_tokens -1; through the shipped model's tokenizer and a scripted engine."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from server.app import ServerState, build_app
from server.engine import Update
from tests.server.test_generation import RecordingEngine
from tests.server.test_tool_calls_api import SHIPPED

EOS = (4093, 4091)  # the shipped model's generation_config.json end tokens


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(SHIPPED)


class Scripted(RecordingEngine):
    """An engine that answers every request with the tokens of one text, one token an update, cut at the request's
    max_tokens ("length") or at the text's end ("stop")."""

    def __init__(self, ids: list[int]) -> None:
        super().__init__()
        self.ids = ids

    def submit(self, request) -> None:
        super().submit(request)
        out = self.ids[: request.max_tokens]
        finish = "length" if len(out) == request.max_tokens else "stop"
        for at, token in enumerate(out):
            request.sink(Update((token,), finish if at == len(out) - 1 else None))


def http(tokenizer: Any, answer: str) -> tuple[TestClient, Scripted]:
    engine = Scripted(tokenizer(answer, add_special_tokens=False)["input_ids"])
    return TestClient(build_app(ServerState(engine, tokenizer, "m", 4096, len(tokenizer), EOS))), engine


def streamed_text(client: TestClient, body: dict) -> tuple[str, str | None]:
    """A streamed text completion's text joined, and its finish_reason."""
    response = client.post("/v1/completions", json={**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    choices = [choice for chunk in chunks for choice in chunk["choices"]]
    return "".join(c["text"] for c in choices), next((c["finish_reason"] for c in choices if c["finish_reason"]), None)


def test_a_stop_string_that_begins_inside_the_min_tokens_ends_the_output_as_vllm_does(tokenizer):
    """vLLM's min_tokens only keeps a stop string from ending the output inside that many tokens: its search reaches
    back `len(stop) - 1` characters before the new text (vllm/v1/engine/detokenizer.py), so a stop string that
    begins in token 1 and is completed by token 2 ends it. The answer's tokens are 'ab', ' c', 'd', ...: with
    min_tokens 1 the stop 'b c' gives 'a', streamed or not."""
    client, _ = http(tokenizer, "ab cd ef gh ij kl")
    body = {"prompt": "x", "max_tokens": 10, "min_tokens": 1, "stop": ["b c"]}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == ("a", "stop", "b c")
    assert streamed_text(client, body) == ("a", "stop")
    # without min_tokens the same stop string ends it there (what min_tokens 1 must not change past token 1)
    plain = client.post("/v1/completions", json={**body, "min_tokens": 0}).json()["choices"][0]
    assert (plain["text"], plain["finish_reason"]) == ("a", "stop")


def test_best_of_below_n_is_refused_as_openai_and_vllm_refuse_it(tokenizer):
    """OpenAI's 'best_of must be greater than n', vLLM's 'best_of must be greater than or equal to n': a 400, with
    nothing submitted."""
    client, engine = http(tokenizer, "Hello world")
    response = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 2, "best_of": 1})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] in ("best_of", "n")
    assert engine.submitted == []


def test_truncate_prompt_tokens_minus_one_is_taken_as_vllm_takes_it(tokenizer):
    """vLLM's truncate_prompt_tokens -1 is the model's own length (vllm/entrypoints/utils.py
    `_validate_truncation_size`), so a short prompt runs whole."""
    client, engine = http(tokenizer, "Hello world")
    prompt = list(range(100, 112))
    for route, body in (
        ("/v1/completions", {"prompt": prompt}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name a color."}]}),
    ):
        response = client.post(route, json={**body, "max_tokens": 2, "truncate_prompt_tokens": -1})
        assert response.status_code == 200, response.text
    assert engine.submitted[0].prompt_ids == prompt
