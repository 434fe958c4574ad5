"""The server at --tp 2 on CPU (gloo): launch paths, exact output, and what happens when a rank fails."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from model.config import load_config
from server.ranks import free_port, free_ports
from tests.server.live import oracle, oracle_greedy, tiny_chat_checkpoint
from tests.tiny import ties_to_lower_index

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [7, 19, 40, 33, 2, 91, 12, 44, 8, 13, 21, 60]
QUIET = {"TQDM_DISABLE": "1"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return tiny_chat_checkpoint(tmp_path_factory.mktemp("tp") / "tiny-chat")


def wait_healthy(url: str, procs: list[subprocess.Popen], seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for proc in procs:
            assert proc.poll() is None, f"a process exited with {proc.returncode}: {proc.stderr.read()[-3000:]}"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("the server did not come up")


def stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_rank(rank: int, rank_ports: tuple[int, int], http_port: int, ckpt: Path, *flags: str) -> subprocess.Popen:
    """One rank as torchrun would start it, on the master and control link ports `rank_ports`."""
    master_port, link_port = rank_ports
    env = {
        **os.environ,
        **QUIET,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(master_port),
        "FLASHNEXT_LINK_PORT": str(link_port),
    }
    argv = [sys.executable, "-m", "server", str(ckpt), "--host", "127.0.0.1", "--port", str(http_port), *flags]
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def greedy_ids(url: str, tokens: int = 16, **extra) -> list[int]:
    body = {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    return httpx.post(f"{url}/v1/completions", json={**body, **extra}, timeout=120).json()["choices"][0]["token_ids"]


def collectives(url: str) -> tuple[dict[str, float], dict[str, float]]:
    """Rank 0's collective calls and bytes sent, by op, from /metrics."""
    found: dict[str, dict[str, float]] = {"flashnext:collectives_total": {}, "flashnext:collective_bytes_total": {}}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name in found:
                found[sample.name][sample.labels["op"]] = sample.value
    return found["flashnext:collectives_total"], found["flashnext:collective_bytes_total"]


def expected_greedy(ckpt: Path, tokens: int = 16, prompt: list[int] = PROMPT, bias: dict | None = None) -> list[int]:
    """transformers' greedy tokens, with `bias` ({token id: bias}) added to the logits as its sequence_bias."""
    hf = oracle(ckpt)
    sequence_bias = {(token,): value for token, value in bias.items()} if bias else None
    with torch.no_grad(), ties_to_lower_index():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            sequence_bias=sequence_bias,
        )
    return out[0, len(prompt) :].tolist()


def test_serve_tp2_reproduces_transformers_greedy(ckpt, tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "server",
            str(ckpt),
            "--prompt-cache-grid",
            "4",
            "--plan-ahead",  # the default, said here so that rounds planned ahead are surely served at tp=2
            "on",
            "--tp",
            "2",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        cwd=ROOT,
        env={**os.environ, **QUIET, "FLASHNEXT_ROUND_DIGESTS": str(tmp_path)},  # each rank's rounds, digested
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, [proc])
        plain = greedy_ids(url)
        assert plain == greedy_ids(url, draft=False) == expected_greedy(ckpt)
        bias = {plain[0]: -100.0, plain[2]: -3.0, 11: 2.25}  # rank 1 draws with the bias its round header carries
        biased = greedy_ids(url, logit_bias={str(token): value for token, value in bias.items()})
        assert biased == expected_greedy(ckpt, bias=bias) != plain
        penalties = {"repetition_penalty": 1.6, "frequency_penalty": 0.5, "presence_penalty": 0.25}
        penalized = greedy_ids(url, 24, **penalties)  # rank 1 keeps the ids its lanes fold, and counts them alike
        assert penalized == greedy_ids(url, 24, draft=False, **penalties)
        assert penalized == oracle_greedy(ckpt, PROMPT, 24, **penalties)
        long = [(5 * i * i + i) % 290 + 7 for i in range(200)]  # two passes, every row's logits on both ranks
        body = {"prompt": long, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1}
        entries = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]["prompt_logprobs"]
        with torch.no_grad(), ties_to_lower_index():
            expected = torch.log_softmax(oracle(ckpt)(torch.tensor([long])).logits[0].float(), dim=-1)
        got = torch.tensor([entry[str(token)]["logprob"] for entry, token in zip(entries[1:], long[1:], strict=True)])
        assert torch.allclose(got, expected[torch.arange(199), long[1:]], atol=1e-4, rtol=0)
        allowed = sorted({plain[1], plain[4], 30, 77})  # rank 1 rules out every other id too
        assert greedy_ids(url, allowed_token_ids=allowed) == oracle_greedy(ckpt, PROMPT, 16, allowed_token_ids=allowed)
        guided = {"prompt": "Name:", "max_tokens": 12, "guided_regex": "[a-z]{2,5}[0-9]", "temperature": 1.0, "seed": 3}
        texts = [  # rank 1 draws under the guide masks its round headers carry
            httpx.post(f"{url}/v1/completions", json={**guided, **extra}, timeout=120).json()["choices"][0]["text"]
            for extra in ({}, {"draft": False})
        ]
        assert texts[0] == texts[1] and re.fullmatch("[a-z]{2,5}[0-9]", texts[0]), texts
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 2}
        logprobs = [
            httpx.post(f"{url}/v1/completions", json={**body, **extra}, timeout=120).json()["choices"][0]["logprobs"]
            for extra in ({}, {"draft": False})
        ]
        assert logprobs[0] == logprobs[1] and len(logprobs[0]["token_logprobs"]) == 8
        sampled = {"temperature": 1.0, "seed": 5}
        assert greedy_ids(url, 24, **sampled) == greedy_ids(url, 24, draft=False, **sampled)
        assert httpx.get(f"{url}/health").json()["draft_tokens"] > 0
        calls, sent = collectives(url)
        assert calls["combine"] > 0 and calls["gather"] > 0
        row_bytes = load_config(ckpt).hidden_size * 4
        assert sent["combine"] == calls["combine"] * row_bytes  # each combine sends the peer one fp32 row of partials
        # the prompt cache at tp=2: rank 0 decides, both ranks keep and restore; a resumed prompt equals fresh
        branch = [*PROMPT[:9], 250, 251, 252]
        body = {"prompt": branch, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
        out = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 8
        assert out["choices"][0]["token_ids"] == expected_greedy(ckpt, prompt=branch)
    finally:
        stop([proc])
    assert proc.returncode == 0  # SIGTERM shuts both ranks down cleanly
    # every round's logits, tokens kept and drafts, bit for bit the same on both ranks (penalties and biases included)
    digests = [(tmp_path / f"rank{rank}.digests").read_text().splitlines() for rank in (0, 1)]
    assert len(digests[0]) > 20 and digests[0] == digests[1]


def test_torchrun_launch_serves_the_same_tokens(ckpt):
    master, link, port = free_ports(3)
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(master),
        "-m",
        "server",
        str(ckpt),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    env = {**os.environ, **QUIET, "FLASHNEXT_LINK_PORT": str(link)}  # not the port after the master's
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", [proc])
        assert greedy_ids(f"http://127.0.0.1:{port}") == expected_greedy(ckpt)
    finally:
        stop([proc])


def test_killing_rank_1_ends_the_request_with_an_error_and_rank_0_exits(ckpt):
    master, link, port = free_ports(3)
    ranks = [start_rank(r, (master, link), port, ckpt) for r in (0, 1)]
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, ranks)
        body = {"prompt": PROMPT, "max_tokens": 3000, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert any('"text"' in next(lines) for _ in range(6))
            ranks[1].send_signal(signal.SIGKILL)
            rest = list(lines)
        assert any('"error"' in line for line in rest)
        assert rest[-1] == "data: [DONE]" or rest[-2] == "data: [DONE]"
        ranks[0].wait(timeout=20)
        assert ranks[0].returncode != 0
    finally:
        stop(ranks)


def test_killing_rank_0_makes_rank_1_exit(ckpt):
    master, link, port = free_ports(3)
    ranks = [start_rank(r, (master, link), port, ckpt) for r in (0, 1)]
    try:
        wait_healthy(f"http://127.0.0.1:{port}", ranks)
        ranks[0].send_signal(signal.SIGKILL)
        ranks[1].wait(timeout=20)
        assert ranks[1].returncode == 1
    finally:
        stop(ranks)


def test_a_settings_mismatch_stops_both_ranks_naming_the_setting(ckpt):
    master, link, port = free_ports(3)
    ranks = [start_rank(0, (master, link), port, ckpt, "--context", "2048"), start_rank(1, (master, link), port, ckpt)]
    try:
        for proc in ranks:
            proc.wait(timeout=60)
            assert proc.returncode == 1
            assert "'context' differs" in proc.stderr.read()
    finally:
        stop(ranks)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("FLASHNEXT_TP_TIMEOUT_S", "soon"),
        ("FLASHNEXT_TP_TIMEOUT_S", "inf"),
        ("FLASHNEXT_LINK_PORT", "99999"),
        ("FLASHNEXT_TYPO", "1"),
    ],
)
def test_flashnext_settings_are_refused_by_name_before_any_device_work(ckpt, name, value):
    proc = subprocess.run(
        [sys.executable, "-m", "server", str(ckpt), "--tp", "2"],
        cwd=ROOT,
        env={**os.environ, name: value},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert name in proc.stderr
    assert "loading weights" not in proc.stderr


def test_rank_0_exits_when_an_idle_rank_1_dies(ckpt):
    master, link, port = free_ports(3)
    ranks = [start_rank(r, (master, link), port, ckpt) for r in (0, 1)]
    try:
        wait_healthy(f"http://127.0.0.1:{port}", ranks)
        ranks[1].send_signal(signal.SIGKILL)
        ranks[0].wait(timeout=20)  # the link watcher notices between rounds, with no request to fail
        assert ranks[0].returncode == 1
    finally:
        stop(ranks)


@contextlib.contextmanager
def launched(ckpt: Path, *flags: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """`--tp 2` as a shell's foreground job (the launcher leads a process group), once /health answers: the launcher
    and the URL."""
    port = free_port()
    argv = [sys.executable, "-m", "server", str(ckpt), "--tp", "2", "--host", "127.0.0.1", "--port", str(port), *flags]
    launcher = subprocess.Popen(
        argv, cwd=ROOT, env={**os.environ, **QUIET}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        wait_healthy(f"http://127.0.0.1:{port}", [launcher])
        yield launcher, f"http://127.0.0.1:{port}"
    finally:
        stop([launcher])  # the ranks get a SIGTERM when their launcher dies


def assert_stopped_cleanly(launcher: subprocess.Popen, url: str, seconds: float) -> None:
    """The launcher exits 0 within `seconds`, no rank logged a failure, and nothing answers at `url` any more."""
    assert launcher.wait(timeout=seconds) == 0
    err = launcher.stderr.read()
    assert "Traceback" not in err and "failed" not in err and "exited with" not in err, err[-3000:]
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=2)


@pytest.mark.parametrize("hangup", [False, True])
def test_ctrl_c_or_a_hangup_stops_both_ranks_cleanly(ckpt, hangup):
    """A terminal's Ctrl-C (SIGINT) or a closed terminal (SIGHUP) reaches its whole foreground process group: both
    ranks stop through rank 0, exit 0."""
    with launched(ckpt) as (launcher, url):
        os.killpg(launcher.pid, signal.SIGHUP if hangup else signal.SIGINT)
        assert_stopped_cleanly(launcher, url, 60)


def test_a_second_ctrl_c_at_tp2_ends_an_open_response_and_stops_rank_1_cleanly(ckpt):
    """The second Ctrl-C cuts the open stream at once, and rank 1 still gets its stop over the control link (the
    thread front end: there the forced shutdown skipped the app's own, which stops the engine and so rank 1)."""
    with launched(ckpt, "--frontend", "thread") as (launcher, url):
        body = {"prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            lines = response.iter_lines()  # kept: a dropped iterator closes the connection, ending the response
            assert next(lines)
            os.killpg(launcher.pid, signal.SIGINT)
            time.sleep(1.0)
            assert launcher.poll() is None and next(filter(None, lines))  # the first Ctrl-C waits for the open stream
            os.killpg(launcher.pid, signal.SIGINT)
            code = launcher.wait(timeout=20)
        err = launcher.stderr.read()
        assert code == 0 and "Traceback" not in err, err[-3000:]


def test_sigterm_to_both_ranks_as_torchrun_sends_it_stops_them_cleanly(ckpt):
    """torchrun passes a SIGTERM to every rank: rank 1 leaves the stop to rank 0, and both exit 0."""
    rank_ports, http_port = tuple(free_ports(2)), free_port()
    ranks = [start_rank(rank, rank_ports, http_port, ckpt) for rank in (0, 1)]
    try:
        wait_healthy(f"http://127.0.0.1:{http_port}", ranks)
        for proc in ranks:
            proc.send_signal(signal.SIGTERM)
        assert [proc.wait(timeout=60) for proc in ranks] == [0, 0]
        err = ranks[0].stderr.read()
        assert "hung up or failed" not in err, err[-3000:]
    finally:
        stop(ranks)
