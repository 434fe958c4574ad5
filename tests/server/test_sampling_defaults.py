"""vLLM's `--generation-config` and `--override-generation-config`: the sampling values a request's unset fields
take, read from generation_config.json, refused at start where out of the API's bounds, and served by both front
ends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from server.cli import main
from server.protocol import NO_DEFAULTS, ChatCompletionRequest, CompletionRequest, SamplingDefaults, parse_request
from server.ranks import free_port
from server.sampling_defaults import defaults_from_flags, read_sampling_defaults
from tests.server.live import serve, tiny_chat_checkpoint
from tests.server.test_tp_server import QUIET, stop, wait_healthy

ROOT = Path(__file__).resolve().parents[2]
QWEN_LIKE = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05}
ASK = [{"role": "user", "content": "Name a color."}]


def folder_with(path: Path, config: object) -> Path:
    """A folder holding only a generation_config.json of `config` (a JSON value, or raw text)."""
    path.mkdir(parents=True, exist_ok=True)
    text = config if isinstance(config, str) else json.dumps(config)
    (path / "generation_config.json").write_text(text)
    return path


def test_the_models_file_gives_each_sampling_value_it_sets(tmp_path):
    model = folder_with(tmp_path, {**QWEN_LIKE, "max_new_tokens": 300, "do_sample": True, "eos_token_id": [3, 4]})
    assert read_sampling_defaults(model) == SamplingDefaults(0.6, 0.95, 20, 0.05, 1.05, max_tokens=300)
    # as vLLM on transformers 5 reads it: a value at transformers 4's own default (top_k 50) is the file's too
    folder_with(tmp_path, {"temperature": 1.0, "top_k": 50})
    assert read_sampling_defaults(model) == SamplingDefaults(temperature=1.0, top_k=50)
    assert read_sampling_defaults(tmp_path / "no-such-model") == NO_DEFAULTS


def test_vllm_reads_no_file_and_overrides_go_on_top_an_overrides_max_new_tokens_capping(tmp_path):
    model = folder_with(tmp_path / "model", {**QWEN_LIKE, "max_new_tokens": 300})
    assert defaults_from_flags(model, "vllm", None) == NO_DEFAULTS
    assert defaults_from_flags(model, "vllm", '{"top_k": 50}') == SamplingDefaults(top_k=50)
    over = defaults_from_flags(model, "auto", '{"temperature": 0, "max_new_tokens": 40}')
    assert over == SamplingDefaults(0, 0.95, 20, 0.05, 1.05, max_tokens=40, max_tokens_cap=40)


def test_a_named_folders_file_is_read_and_its_max_new_tokens_caps_every_request(tmp_path):
    model = folder_with(tmp_path / "model", QWEN_LIKE)
    other = folder_with(tmp_path / "other", {"top_p": 0.5, "max_new_tokens": 64})
    assert defaults_from_flags(model, str(other), None) == SamplingDefaults(top_p=0.5, max_tokens=64, max_tokens_cap=64)
    with pytest.raises(ValueError, match=r"--generation-config: no generation_config\.json in"):
        defaults_from_flags(model, str(tmp_path / "empty"), None)


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"temperature": 2.5}, ("temperature must be a number in [0, 2], got 2.5",)),
        ({"top_p": 0}, ("top_p must be a number in (0, 1]",)),
        ({"top_k": 2.5}, ("top_k must be an integer",)),
        ({"top_k": True}, ("top_k must be an integer",)),
        ({"min_p": "0.1"}, ("min_p must be a number in [0, 1], got '0.1'",)),
        ('{"repetition_penalty": NaN}', ("repetition_penalty must be a number",)),
        ({"max_new_tokens": 0}, ("max_new_tokens must be an integer of at least 1",)),
        ("{not json", ("not valid JSON",)),
        ([1, 2], ("expected a JSON object, got list",)),
    ],
)
def test_a_generation_config_out_of_bounds_is_refused_naming_the_file_and_key(tmp_path, config, words):
    model = folder_with(tmp_path, config)
    with pytest.raises(ValueError, match=r"generation_config\.json") as caught:
        read_sampling_defaults(model)
    assert all(word in str(caught.value) for word in words), str(caught.value)
    assert read_sampling_defaults(model, "vllm") == NO_DEFAULTS  # the way out the message names


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ('{"temprature": 0.5}', "'temprature' is not one of temperature, top_p"),
        ('{"top_p": 1.5}', "top_p must be a number in (0, 1], got 1.5"),
        ("[0.5]", "expected a JSON object, got list"),
        ("{", "not valid JSON"),
    ],
)
def test_bad_overrides_are_refused_naming_the_flag(tmp_path, text, words):
    with pytest.raises(ValueError, match="--override-generation-config") as caught:
        defaults_from_flags(tmp_path, "auto", text)
    assert words in str(caught.value)


def test_serve_refuses_a_bad_generation_config_before_the_model_loads(tmp_path, capsys):
    model = tiny_chat_checkpoint(tmp_path / "tiny")
    assert main(["serve", str(model), "--override-generation-config", '{"top_k": -2}']) == 2
    assert "--override-generation-config: top_k must be an integer of at least -1" in capsys.readouterr().err
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "temperature": 3}))
    assert main(["serve", str(model)]) == 2
    assert "generation_config.json (--generation-config vllm leaves it unread): temperature" in capsys.readouterr().err


QWEN = SamplingDefaults(0.6, 0.95, 20, 0.05, 1.05)


@pytest.mark.parametrize("kind", [ChatCompletionRequest, CompletionRequest])
def test_a_requests_unset_fields_take_the_defaults_and_its_own_values_win_even_at_the_apis_defaults(kind):
    base = {"messages": ASK} if kind is ChatCompletionRequest else {"prompt": "hi"}
    unset = parse_request(kind, json.dumps(base)).sampling_params(QWEN)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.min_p, unset.repetition_penalty) == (
        0.6, 0.95, 20, 0.05, 1.05,
    )  # fmt: skip
    nulls = {"temperature": None, "top_p": None, "top_k": None, "min_p": None, "repetition_penalty": None}
    assert parse_request(kind, json.dumps({**base, **nulls})).sampling_params(QWEN) == unset  # null: not given
    own = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
    given = parse_request(kind, json.dumps({**base, **own})).sampling_params(QWEN)
    assert (given.temperature, given.top_p, given.top_k, given.min_p, given.repetition_penalty) == (1, 1, 0, 0, 1)
    without = parse_request(kind, json.dumps(base)).sampling_params()  # no defaults: the API's own
    assert without == parse_request(kind, json.dumps({**base, **own})).sampling_params()


def chat(live_url: str, **fields) -> dict:
    body = {"messages": ASK, "ignore_eos": True, **fields}
    response = httpx.post(f"{live_url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def asking(length: int) -> list[dict[str, str]]:
    """A chat of one user message of `length` letters."""
    return [{"role": "user", "content": "x" * length}]


def prompt_tokens(live_url: str, messages: list[dict[str, str]]) -> int:
    """The tokens of a chat's prompt, as /tokenize counts them."""
    return httpx.post(f"{live_url}/tokenize", json={"messages": messages}, timeout=60).json()["count"]


def test_served_requests_take_the_models_defaults_and_max_new_tokens_within_the_room(tmp_path):
    model = tiny_chat_checkpoint(tmp_path / "tiny")
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "temperature": 0, "max_new_tokens": 5}))
    with serve(model, "--context", "64") as live:
        unset = chat(live.url)
        greedy = chat(live.url, temperature=0, max_tokens=5)
        assert unset["usage"]["completion_tokens"] == 5 and unset["token_sha"] == greedy["token_sha"]
        assert chat(live.url, max_tokens=9)["usage"]["completion_tokens"] == 9  # the model's file sets no cap
        sampled = chat(live.url, temperature=1.0, seed=5, max_tokens=5)
        assert sampled["token_sha"] != greedy["token_sha"]
        long_ask = next(ask for ask in map(asking, range(30, 60)) if prompt_tokens(live.url, ask) == 61)
        assert chat(live.url, messages=long_ask)["usage"]["completion_tokens"] == 3  # the room, not the default 5
        answer = httpx.post(f"{live.url}/v1/responses", json={"input": "Name a color.", "max_output_tokens": 4})
        assert answer.status_code == 200, answer.text
        assert (answer.json()["temperature"], answer.json()["top_p"]) == (0, 1)  # the values drawn with


def test_an_overrides_max_new_tokens_caps_a_request_that_asks_for_more(tmp_path):
    model = tiny_chat_checkpoint(tmp_path / "tiny")
    with serve(model, "--override-generation-config", '{"max_new_tokens": 3}') as live:
        assert chat(live.url, temperature=0, max_tokens=9)["usage"]["completion_tokens"] == 3
        assert chat(live.url, temperature=0)["usage"]["completion_tokens"] == 3
        answer = httpx.post(f"{live.url}/v1/responses", json={"input": "Hi", "max_output_tokens": 9}, timeout=60)
        assert answer.json()["max_output_tokens"] == 3  # the limit it ran under, as vLLM echoes it
        refused = httpx.post(f"{live.url}/v1/chat/completions", json={"messages": ASK, "min_tokens": 5}, timeout=60)
        assert "the server's default or cap" in refused.json()["error"]["message"]


def test_the_front_end_process_takes_a_named_folders_defaults(tmp_path):
    model = tiny_chat_checkpoint(tmp_path / "tiny")
    defaults = folder_with(tmp_path / "defaults", {"temperature": 0, "max_new_tokens": 4})
    port = free_port()
    argv = [sys.executable, "-m", "server", str(model), "--host", "127.0.0.1", "--port", str(port), "--max-lanes", "2"]
    argv += ["--frontend", "process", "--generation-config", str(defaults)]
    proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **QUIET}, stdout=subprocess.DEVNULL, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, [proc])
        unset = chat(url)
        assert unset["usage"]["completion_tokens"] == 4
        assert unset["token_sha"] == chat(url, temperature=0, max_tokens=4)["token_sha"]
        assert chat(url, temperature=0, max_tokens=9)["usage"]["completion_tokens"] == 4  # a named folder caps
    finally:
        stop([proc])
