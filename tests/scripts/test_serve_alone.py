"""scripts/serve_alone.py: rank 0's half served alone over HTTP, collectives skipped; bad flags refused by name."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from serve_alone import main, split_world

from model.shipped import SHIPPED_MODEL
from server.ranks import free_port
from tests.server.live import tiny_chat_checkpoint
from tests.server.test_tp_server import QUIET, stop, wait_healthy

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "--alone-as: required first"),
        (["model", "--alone-as", "2"], "--alone-as: required first"),
        (["--alone-as", "two", "model"], "--alone-as: 'two' is not a world of two or more ranks"),
        (["--alone-as", "1", "model"], "--alone-as: '1' is not a world of two or more ranks"),
    ],
)
def test_the_world_is_required_first_and_of_two_or_more_ranks(argv, message) -> None:
    with pytest.raises(SystemExit, match=message):
        split_world(argv)


def test_a_tp_flag_is_refused_by_name(tmp_path) -> None:
    with pytest.raises(SystemExit, match="--tp: serve_alone runs one rank"):
        main(["--alone-as", "2", str(tmp_path), "--tp", "2"])


def test_a_malformed_environment_setting_is_refused_by_name(monkeypatch) -> None:
    """The serve command refuses it in one line; here it ended in read_environment's ValueError traceback."""
    monkeypatch.setenv("FLASHNEXT_PDL", "2")
    with pytest.raises(SystemExit, match="FLASHNEXT_PDL: malformed value '2'"):
        main(["--alone-as", "2", str(SHIPPED_MODEL), "--port", "0"])


def test_a_broken_tokenizer_is_refused_naming_it(tmp_path) -> None:
    """start_refusal raises it as a TokenizerError, which the serve command prints in one line; here it was a
    traceback."""
    import shutil

    for name in ("config.json", "tokenizer_config.json"):
        shutil.copy(SHIPPED_MODEL / name, tmp_path / name)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(SystemExit, match=f"{tmp_path}: its tokenizer does not load"):
        main(["--alone-as", "2", str(tmp_path), "--port", "0"])


def test_rank_0s_half_serves_completions_and_stops_cleanly(tmp_path) -> None:
    """The tiny checkpoint's rank 0 of 2 comes up (the log says tp 2), answers a completion with every token asked
    for, and exits 0 on SIGTERM."""
    ckpt = tiny_chat_checkpoint(tmp_path / "tiny")
    port = free_port()
    argv = [sys.executable, str(ROOT / "scripts/serve_alone.py"), "--alone-as", "2", str(ckpt)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--max-lanes", "2", "--frontend", "thread"]
    proc = subprocess.Popen(
        argv, cwd=ROOT, env={**os.environ, **QUIET}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, [proc])
        body = {"prompt": [5, 9, 14, 3], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 6
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-2000:]
        assert ", tp 2" in err
    finally:
        stop([proc])
