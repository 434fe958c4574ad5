"""--served-model-name with several names, as vLLM's: requests may name any, /v1/models lists each, answers carry
the first."""

from __future__ import annotations

import httpx
import pytest

from server.cli import main
from tests.server.live import serve, tiny_chat_checkpoint
from tests.server.test_frontend_process import served


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_chat_checkpoint(tmp_path_factory.mktemp("names") / "tiny")


def names_served(url: str) -> dict:
    """What a server with the names "main" and "alias/two" answers."""
    ask = {"prompt": "Hi", "max_tokens": 2}
    return {
        "listed": [card["id"] for card in httpx.get(f"{url}/v1/models").json()["data"]],
        "retrieved": httpx.get(f"{url}/v1/models/alias/two").json()["id"],
        "answered": httpx.post(f"{url}/v1/completions", json={**ask, "model": "alias/two"}, timeout=60).json()["model"],
        "refused": httpx.post(f"{url}/v1/completions", json={**ask, "model": "other"}, timeout=60),
    }


@pytest.mark.parametrize("frontend", ["thread", "process"])
def test_every_name_is_served_and_answers_carry_the_first(ckpt, frontend):
    flags = ("--served-model-name", "main", "alias/two")
    if frontend == "process":
        with served(ckpt, "process", *flags) as (_, url):
            got = names_served(url)
    else:
        with serve(ckpt, *flags) as live:
            got = names_served(live.url)
    assert (got["listed"], got["retrieved"], got["answered"]) == (["main", "alias/two"], "alias/two", "main")
    refused = got["refused"]
    assert refused.status_code == 404 and "'main', 'alias/two'" in refused.json()["error"]["message"]


def test_an_empty_name_among_several_is_refused_by_flag(capsys):
    assert main(["serve", "--served-model-name", "main", " "]) == 2
    assert "--served-model-name: must not be empty" in capsys.readouterr().err
