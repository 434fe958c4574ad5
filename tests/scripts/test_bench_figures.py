"""The benchmark clients' figures: short runs fail, clients are made before the clock, the concurrency asked for is
kept in flight, and gaps are timed over token-bearing chunks.

Most tests run a client against an in-process fake OpenAI-style server (streamed and plain completions, /health,
/v1/models) whose timing and lengths are set per test, and states what should hold of the figure.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from tests.scripts.test_bench_clients import SCRIPTS, FakeHandler, load_script, serving, sha_of


class Fake(ThreadingHTTPServer):
    """A fake server. stop_after: tokens after which a completion stops ("stop"); first_delay: seconds between a
    stream's token-less opening chunk and its first token; gap: seconds between token chunks; hold: seconds a plain
    (non-streamed) completion takes. Counts the requests in flight at once."""

    daemon_threads = True
    request_queue_size = 512  # many clients connect at once

    def __init__(
        self, stop_after: int | None = None, first_delay: float = 0.0, gap: float = 0.002, hold: float = 0.0
    ) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.stop_after, self.first_delay, self.gap, self.hold = stop_after, first_delay, gap, hold
        self.lock = threading.Lock()
        self.requests: list[tuple[str, dict[str, Any]]] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.first_token_sent: list[float] = []

    @property
    def url(self) -> str:
        """The server's base URL."""
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(FakeHandler):
    """test_bench_clients' handler's replies and events, with timing, stops and in-flight counts set per server."""

    server: Fake

    def do_GET(self) -> None:
        if self.path.startswith("/health"):
            self.send_json(200, {"status": "ok", "draft_tokens": 0, "accepted_draft_tokens": 0})
        else:
            self.send_json(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        fake = self.server
        with fake.lock:
            fake.requests.append((self.path, body))
            fake.in_flight += 1
            fake.most_in_flight = max(fake.most_in_flight, fake.in_flight)
        try:
            if body.get("stream"):
                self.stream(body)
            else:
                self.plain(body)
        finally:
            with fake.lock:
                fake.in_flight -= 1

    def ids(self, body: dict[str, Any]) -> list[int]:
        return [(7 * i + 3) % 500 for i in range(int(body["max_tokens"]))][: self.server.stop_after]

    def usage(self, body: dict[str, Any], ids: list[int]) -> dict[str, Any]:
        prompt = len(body["prompt"]) if isinstance(body.get("prompt"), list) else 11
        return {"prompt_tokens": prompt, "completion_tokens": len(ids), "total_tokens": prompt + len(ids),
                "prompt_tokens_details": {"cached_tokens": 0}}  # fmt: skip

    def plain(self, body: dict[str, Any]) -> None:
        time.sleep(self.server.hold)
        ids = self.ids(body)
        choice: dict[str, Any] = {"index": 0, "text": "a" * len(ids), "token_ids": ids,
                                  "finish_reason": "length" if len(ids) == body["max_tokens"] else "stop"}  # fmt: skip
        if body.get("prompt_logprobs") is not None:
            choice["prompt_logprobs"] = [None] + [{} for _ in body["prompt"][1:]]
        self.send_json(200, {"id": "cmpl-1", "object": "text_completion", "model": "fake-model", "choices": [choice],
                             "usage": self.usage(body, ids), "token_sha": sha_of(ids)})  # fmt: skip

    def stream(self, body: dict[str, Any]) -> None:
        fake, ids = self.server, self.ids(body)
        chat = self.path == "/v1/chat/completions"
        head = {"id": "x-1", "object": "chat.completion.chunk" if chat else "text_completion", "model": "fake-model"}
        with_ids = bool(body.get("return_token_ids"))

        def choice(text: str, piece: list[int] | None = None, **extra: Any) -> dict[str, Any]:
            out = {"index": 0, **({"delta": {"content": text}} if chat else {"text": text}), **extra}
            if with_ids and piece is not None:
                out["token_ids"] = piece
            return out

        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        opening = {"index": 0, "delta": {"role": "assistant", "content": ""}} if chat else choice("")
        self.event({**head, "choices": [opening]})  # sent as the request is admitted, before any token
        time.sleep(fake.first_delay)
        for n, token in enumerate(ids):
            last = n == len(ids) - 1
            finish = ("length" if len(ids) == body["max_tokens"] else "stop") if last else None
            if n == 0:
                with fake.lock:
                    fake.first_token_sent.append(time.perf_counter())
            self.event({**head, "choices": [choice(f" t{token}", [token], finish_reason=finish)]})
            if not last:
                time.sleep(fake.gap)
        if (body.get("stream_options") or {}).get("include_usage"):
            self.event({**head, "choices": [], "usage": self.usage(body, ids), "token_sha": sha_of(ids)})
        self.event("[DONE]")
        self.close_connection = True


def running(**settings: Any) -> Iterator[Fake]:
    """A fake server with these settings, serving on a thread until the loop over it ends."""
    yield from serving(Fake(**settings))


@pytest.fixture
def plain() -> Iterator[Fake]:
    """Answers at once."""
    yield from running()


def run_script(name: str, url: str, *flags: str) -> subprocess.CompletedProcess[str]:
    """Run scripts/NAME.py against `url` with these flags."""
    command = [sys.executable, str(SCRIPTS / f"{name}.py"), "--base-url", url, *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


# --- bench_openai -------------------------------------------------------------------------------------------------


def test_bench_openai_fails_a_rep_that_stops_short() -> None:
    """A rep that ends before --tokens must fail the run (as bench_concurrent's SHORT does), not enter the medians:
    here the server stops every request at 2 tokens and bench_openai asks for 8."""
    for fake in running(stop_after=2):
        done = run_script("bench_openai", fake.url, "--tokens", "8", "--reps", "2", "--temperatures", "0",
                          "--prompt", "Hello", "--json")  # fmt: skip
    assert done.stdout, done.stderr
    reps = json.loads(done.stdout.splitlines()[-1])["cells"][0]["reps"]
    assert [r["tokens"] for r in reps] == [2, 2]  # every rep ran a quarter of the length asked
    assert done.returncode != 0, done.stdout


# --- bench_guided -------------------------------------------------------------------------------------------------


def test_bench_guided_latency_excludes_making_an_http_client(plain: Fake, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request's latency and the run's wall time must not count making an HTTP client (it loads TLS certificates,
    ~28 ms here): here making one moves the clock on by 1,000 s, so a latency that counts it shows it."""
    bench = load_script("bench_guided")
    offset, real_init, real_clock = [0.0], httpx.Client.__init__, time.perf_counter

    def init_that_takes_long(self: httpx.Client, *args: Any, **kwargs: Any) -> None:
        offset[0] += 1000.0
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(httpx.Client, "__init__", init_that_takes_long)
    monkeypatch.setattr(bench.time, "perf_counter", lambda: real_clock() + offset[0])
    args = bench.parse_args(["--base-url", plain.url, "--requests", "2", "--tokens", "4", "--concurrency", "1"])
    result = bench.run_mode(args, "fake-model", "plain", 1, 1)
    assert result.requests == 2 and result.tokens == 4
    assert result.mean_latency_s < 1000, result
    assert result.wall_s < 1000, result


# --- bench_scoring ------------------------------------------------------------------------------------------------


def test_bench_scoring_keeps_its_concurrency_in_flight() -> None:
    """--concurrency 128 must keep 128 requests in flight at once (the report says "128 at once")."""
    bench = load_script("bench_scoring")
    for fake in running(hold=1.0):
        args = bench.parse_args(["--base-url", fake.url, "--prompts", "128", "--length", "2", "--concurrency", "128"])
        prompts = [[i, i + 1] for i in range(128)]
        result = bench.run_mode(args, "fake-model", "plain", prompts)
        assert result.prompts == 128 and result.concurrency == 128
        assert fake.most_in_flight == 128, f"at most {fake.most_in_flight} requests were in flight"


# --- bench_guide_compile ------------------------------------------------------------------------------------------


def test_bench_guide_compile_times_gaps_between_tokens_not_before_the_first(capsys: pytest.CaptureFixture) -> None:
    """The longest gap between a stream's chunks must be measured over its token-bearing chunks: with tokens 5 ms
    apart it is not ~150 ms, the stream's wait for its first token after the token-less opening chunk."""
    bench = load_script("bench_guide_compile")
    for fake in running(first_delay=0.6, gap=0.005, hold=0.15):
        assert bench.main(["--base-url", fake.url, "--tokens", "100", "--reps", "1"]) == 0
        results = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert [r["mode"] for r in results] == ["beside a compile", "alone"]
        assert all(r["stream_outlasted"] for r in results)
        gaps = [r["longest_gap_ms"] for r in results]
        assert max(gaps) < 60, f"longest gaps {gaps} ms, tokens came 5 ms apart"


def _clock_that_counts_clients(bench, monkeypatch: pytest.MonkeyPatch) -> None:
    """Making an httpx client moves the script's clock on by 1,000 s; the script's sleeps past 100 s return at once."""
    offset, real_init, real_clock, real_sleep = [0.0], httpx.Client.__init__, time.perf_counter, time.sleep

    def init_that_takes_long(self: httpx.Client, *args: Any, **kwargs: Any) -> None:
        offset[0] += 1000.0
        real_init(self, *args, **kwargs)

    def sleep(seconds: float) -> None:
        if seconds < 100:
            real_sleep(seconds)

    monkeypatch.setattr(httpx.Client, "__init__", init_that_takes_long)
    clock = SimpleNamespace(perf_counter=lambda: real_clock() + offset[0], sleep=sleep, time_ns=time.time_ns)
    monkeypatch.setattr(bench, "time", clock)


def test_bench_guide_compile_span_excludes_making_an_http_client(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The compile's span (and the window the longest gap is looked for in) must not count making an HTTP client, as
    bench_guided's latencies no longer do: here making one moves the clock on by 1,000 s."""
    bench = load_script("bench_guide_compile")
    _clock_that_counts_clients(bench, monkeypatch)
    for fake in running(gap=0.002, hold=0.05):
        bench.main(["--base-url", fake.url, "--tokens", "400", "--reps", "1"])
        results = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert results[0]["mode"] == "beside a compile"
        assert results[0]["span_s"] < 1000, results[0]


def test_bench_guide_compile_longest_gap_is_never_negative() -> None:
    """The longest gap within [begin, end] is at least 0: a stream whose last chunk came before `begin` (it ended
    while the script slept its 0.2 s) gave -198 ms."""
    bench = load_script("bench_guide_compile")
    assert bench.longest_gap([1.0, 1.1, 1.2], begin=1.5, end=2.0) >= 0


def test_bench_guide_compile_fails_when_the_stream_ends_before_the_window() -> None:
    """A run whose measured stream ended before the compile's window closed (its figure looks at no tokens after
    that) must exit non-zero, as bench_openai now fails reps that end short: here the server stops it at 3 tokens."""
    bench = load_script("bench_guide_compile")
    for fake in running(stop_after=3, gap=0.001, hold=0.3):
        code = bench.main(["--base-url", fake.url, "--tokens", "50", "--reps", "1"])
        assert code != 0
