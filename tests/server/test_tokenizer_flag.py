"""--tokenizer: a checkpoint without a tokenizer (a config with dummy weights, say) serves text with another folder's,
as vLLM's flag does; a folder with none, or one whose ids pass the model's vocabulary, is refused at start."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from model.shipped import SHIPPED_MODEL
from server.cli import main
from tests.server.live import serve, tiny_chat_checkpoint
from tests.server.test_frontend_process import served

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
ASK = {"messages": [{"role": "user", "content": "Sort a list."}], "max_tokens": 6, "temperature": 0,
       "ignore_eos": True}  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny checkpoint with its tokenizer, and the same weights and config without one."""
    root = tmp_path_factory.mktemp("tokenizer-flag")
    whole = tiny_chat_checkpoint(root / "whole")
    bare = root / "bare"
    shutil.copytree(whole, bare)
    for name in TOKENIZER_FILES:
        (bare / name).unlink()
    return whole, bare


def chat(url: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json=ASK, timeout=120)


def test_a_checkpoint_without_a_tokenizer_serves_text_with_the_one_given(folders):
    whole, bare = folders
    with serve(whole) as live:
        expected = chat(live.url).json()
    with serve(bare) as live:
        refused = chat(live.url)
    with serve(bare, "--tokenizer", str(whole)) as live:
        answer = chat(live.url).json()
    assert refused.status_code == 400, refused.text
    assert answer["choices"][0]["message"]["content"] == expected["choices"][0]["message"]["content"]
    assert (answer["token_sha"], answer["usage"]) == (expected["token_sha"], expected["usage"])


def test_generate_takes_the_tokenizer_given(folders, capsys):
    whole, bare = folders
    runs = []
    for argv in ([str(whole)], [str(bare), "--tokenizer", str(whole)]):
        flags = ["--prompt", "Sort a list.", "--max-tokens", "5", "--temperature", "0", "--ignore-eos"]
        assert main(["generate", *argv, *flags]) == 0
        runs.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))
    assert runs[0] == runs[1] and runs[0]["text"]


@pytest.mark.parametrize(
    ("tokenizer", "message"),
    [
        ("bare", "--tokenizer: {bare} holds no tokenizer"),
        ("shipped", "--tokenizer: its 4096 token ids exceed the model's vocab_size 320"),
    ],
)
def test_a_tokenizer_that_cannot_serve_the_model_is_refused_at_start(folders, capsys, monkeypatch, tokenizer, message):
    import server.serve

    _, bare = folders
    monkeypatch.setattr(server.serve, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    folder = {"bare": bare, "shipped": SHIPPED_MODEL}[tokenizer]
    assert main(["serve", str(bare), "--tokenizer", str(folder)]) == 2
    assert message.format(bare=bare) in capsys.readouterr().err


@pytest.fixture(scope="module")
def config_only(folders, tmp_path_factory) -> Path:
    """The tiny checkpoint's config alone, its end token moved to id 7 (not the tokenizer's)."""
    folder = tmp_path_factory.mktemp("config-only")
    config = json.loads((folders[0] / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": 7}))
    return folder


def test_a_config_alone_serves_text_with_dummy_weights_and_stops_at_its_own_end_token(folders, config_only):
    """The documented case, through a front-end process: the text is the tokenizer's, and the config's end token
    ends a request (vLLM makes a generation config from the model's config where the model has none) as the
    tokenizer's does."""
    whole, _ = folders
    tokenizer = AutoTokenizer.from_pretrained(whole)
    flags = ["--load-format", "dummy", "--tokenizer", str(whole)]
    asks = [{"logit_bias": {"7": 100}}, {"logit_bias": {str(tokenizer.eos_token_id): 100}}, {"ignore_eos": True}]
    with served(config_only, "process", *flags) as (_, url):
        answers = [
            httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "return_token_ids": True,
                       **ask}, timeout=60).json()["choices"][0]
            for ask in asks
        ]  # fmt: skip
    assert [(a["finish_reason"], a["token_ids"]) for a in answers[:2]] == [
        ("stop", [7]),
        ("stop", [tokenizer.eos_token_id]),
    ]
    assert answers[2]["text"] == tokenizer.decode(answers[2]["token_ids"], skip_special_tokens=True)
    assert len(answers[2]["token_ids"]) == 4
