"""Tests for scripts/openai_stream.py and the bench scripts against an in-process fake SSE server and a tiny server."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx
import pytest

from tests.server.live import serve as serve_checkpoint
from tests.server.live import tiny_chat_checkpoint
from tests.tiny import checkpoint

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
TOKENS_PER_PIECE = 2


def load_script(name: str) -> ModuleType:
    """Import a script by path, registered under its own name (dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


openai_stream = load_script("openai_stream")


def sha_of(ids: list[int]) -> str:
    """SHA-256 of the ids joined by commas, written out here independently of the client."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()


def fake_ids(body: dict[str, Any], salt: int) -> list[int]:
    """The fake model's completion: a function of the seed, a token-id prompt and max_tokens (and of salt)."""
    base = int(body.get("seed") or 0) + sum(body.get("prompt") or []) + 7 * salt
    return [(base * 31 + 7 * i) % 500 for i in range(int(body["max_tokens"]))]


class FakeServer(ThreadingHTTPServer):
    """Streams fixed completions; with vary=True every request gets a different completion."""

    daemon_threads = True

    def __init__(self, vary: bool, stop_after: int | None = None) -> None:
        super().__init__(("127.0.0.1", 0), FakeHandler)
        self.vary = vary
        self.stop_after = stop_after  # tokens after which every completion stops early, with finish "stop"
        self.lock = threading.Lock()
        self.requests: list[tuple[str, dict[str, Any], str | None]] = []
        self.arrivals: list[float] = []  # perf_counter when each POST came in

    @property
    def url(self) -> str:
        """The server's base URL."""
        return f"http://127.0.0.1:{self.server_address[1]}"


class FakeHandler(BaseHTTPRequestHandler):
    """GET /v1/models and streaming POSTs to /v1/chat/completions and /v1/completions in the server's SSE format."""

    protocol_version = "HTTP/1.0"
    server: FakeServer

    def log_message(self, format: str, *args: Any) -> None:
        """Keep the test output quiet."""

    def send_json(self, status: int, payload: dict[str, Any]) -> None:
        """A plain JSON response."""
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def event(self, payload: dict[str, Any] | str) -> None:
        """Write one SSE data event and flush it."""
        data = payload if isinstance(payload, str) else json.dumps(payload)
        self.wfile.write(f"data: {data}\n\n".encode())
        self.wfile.flush()

    def do_GET(self) -> None:
        """The model list."""
        self.send_json(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    def do_POST(self) -> None:
        """Stream a completion: opening chunk, text chunks with token_ids, finish chunk, usage chunk, [DONE]."""
        arrived = time.perf_counter()
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.server.lock:
            self.server.requests.append((self.path, body, self.headers.get("Authorization")))
            self.server.arrivals.append(arrived)
            salt = len(self.server.requests) if self.server.vary else 0
        if body["max_tokens"] < 1:
            self.send_json(400, {"error": {"message": "max_tokens must be at least 1", "code": "bad_request"}})
            return
        ids = fake_ids(body, salt)[: self.server.stop_after]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        chat = self.path == "/v1/chat/completions"
        head = {"id": "cmpl-1", "object": "chat.completion.chunk" if chat else "text_completion", "model": "fake-model"}

        def choice(text: str, **extra: Any) -> dict[str, Any]:
            """One choice carrying text the way this endpoint does (a chat delta or a completion's text)."""
            return {"index": 0, **({"delta": {"content": text}} if chat else {"text": text}), **extra}

        self.event(
            {**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}} if chat else choice("")]}
        )
        self.wfile.write(b": keep-alive\n\n")
        for start in range(0, len(ids), TOKENS_PER_PIECE):
            piece = ids[start : start + TOKENS_PER_PIECE]
            self.event({**head, "choices": [choice("".join(f" t{t}" for t in piece), token_ids=piece)]})
            time.sleep(0.002)
        finish = "length" if len(ids) == body["max_tokens"] else "stop"
        self.event({**head, "choices": [choice("", finish_reason=finish)]})
        prompt_tokens = len(body["prompt"]) if "prompt" in body else 11
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(ids),
            "total_tokens": prompt_tokens + len(ids),
        } | ({} if chat else {"prompt_tokens_details": {"cached_tokens": 0}})
        self.event({**head, "choices": [], "usage": usage, "token_sha": sha_of(ids)})
        self.event("[DONE]")


def serve(vary: bool, stop_after: int | None = None) -> Iterator[FakeServer]:
    """Run a fake server in a thread for one test."""
    yield from serving(FakeServer(vary, stop_after))


def serving(server: ThreadingHTTPServer) -> Iterator[ThreadingHTTPServer]:
    """Serve `server` on a thread until the loop over it ends."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.fixture
def fake() -> Iterator[FakeServer]:
    """A fake server that answers the same request with the same completion."""
    yield from serve(vary=False)


@pytest.fixture
def drifting() -> Iterator[FakeServer]:
    """A fake server whose completion changes with every request."""
    yield from serve(vary=True)


@pytest.fixture
def stopping() -> Iterator[FakeServer]:
    """A fake server whose completions stop after 2 tokens, whatever max_tokens asks."""
    yield from serve(vary=False, stop_after=2)


def run_script(name: str, url: str, *flags: str) -> subprocess.CompletedProcess[str]:
    """Run a bench script against the server at url as a subprocess."""
    command = [sys.executable, str(SCRIPTS / f"{name}.py"), "--base-url", url, *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def test_token_sha_matches_the_server_rule() -> None:
    """token_sha hashes the ids joined by commas."""
    assert openai_stream.token_sha([1, 22, 333]) == sha_of([1, 22, 333])
    assert openai_stream.token_sha([]) == hashlib.sha256(b"").hexdigest()


def test_stream_chat_parses_the_stream(fake: FakeServer) -> None:
    """stream_chat collects token ids, text, token_sha, usage, finish_reason and piece times."""
    body = openai_stream.chat_body("fake-model", "Hello", 5, 1.0, seed=77, top_k=20, top_p=0.95)
    result = openai_stream.stream_chat(fake.url, body, api_key="secret")
    ids = fake_ids(body, 0)
    assert result.token_ids == ids
    assert result.text == "".join(f" t{t}" for t in ids)
    assert result.token_sha == sha_of(ids)
    assert result.usage == {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16}
    assert result.finish_reason == "length"
    assert result.tokens == 5
    assert len(result.piece_times) == 3
    assert result.ttft is not None and result.ttft > 0
    assert result.decode_tok_s is not None and result.decode_tok_s > 0
    path, sent, authorization = fake.requests[0]
    assert path == "/v1/chat/completions"
    assert authorization == "Bearer secret"
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert sent["ignore_eos"] is True and sent["return_token_ids"] is True
    assert (sent["seed"], sent["top_k"], sent["top_p"]) == (77, 20, 0.95)


def test_greedy_body_has_no_seed(fake: FakeServer) -> None:
    """A temperature-0 request sends no seed, top_k or top_p; the model name comes from /v1/models."""
    model = openai_stream.resolve_model(fake.url)
    assert model == "fake-model"
    body = openai_stream.chat_body(model, "Hello", 3, 0.0, seed=5, top_k=20, top_p=0.95)
    assert not {"seed", "top_k", "top_p"} & body.keys()
    assert openai_stream.stream_chat(fake.url, body).token_ids == fake_ids(body, 0)


def test_stream_chat_raises_on_http_error(fake: FakeServer) -> None:
    """A refused request raises StreamError with the server's message."""
    body = openai_stream.chat_body("fake-model", "Hello", 0, 0.0)
    with pytest.raises(openai_stream.StreamError, match=r"HTTP 400.*max_tokens"):
        openai_stream.stream_chat(fake.url, body)


def test_stream_completion_reads_token_id_prompts(fake: FakeServer) -> None:
    """stream_completion posts a token-id prompt to /v1/completions and reads text, ids and per-piece token counts."""
    body = openai_stream.completion_body("fake-model", [5, 6, 7], 5, 0.0, seed=9, top_k=20, top_p=0.95)
    result = openai_stream.stream_completion(fake.url, body)
    ids = fake_ids(body, 0)
    assert result.token_ids == ids
    assert result.text == "".join(f" t{t}" for t in ids)
    assert result.token_sha == sha_of(ids)
    assert result.usage is not None and result.usage["prompt_tokens"] == 3
    assert result.piece_tokens == [2, 2, 1]
    assert len(result.token_gaps) == 3 and all(gap > 0 for gap in result.token_gaps)
    path, sent, _ = fake.requests[0]
    assert path == "/v1/completions" and "messages" not in sent
    assert sent["prompt"] == [5, 6, 7] and sent["ignore_eos"] is True and sent["return_token_ids"] is True
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert not {"seed", "top_k", "top_p"} & sent.keys()


def test_bench_concurrent_alone_matches(fake: FakeServer) -> None:
    """--alone against a deterministic server: two concurrent streams, one alone run of the shared body, exit 0."""
    done = run_script(
        "bench_concurrent", fake.url, "--levels", "2", "--tokens", "4", "--reps", "1", "--temperatures", "0", "--alone"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "MISMATCH" not in done.stdout
    assert "comparisons: 2, mismatches: 0" in done.stdout
    assert len(fake.requests) == 4  # warm-up, two concurrent, one alone


def test_bench_concurrent_alone_mismatch_exits_1(drifting: FakeServer) -> None:
    """--alone against a server whose output drifts prints MISMATCH lines and exits 1."""
    done = run_script(
        "bench_concurrent",
        drifting.url,
        "--levels",
        "2",
        "--tokens",
        "4",
        "--reps",
        "1",
        "--temperatures",
        "0",
        "--alone",
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.count("MISMATCH") == 2


def test_bench_concurrent_serial_sampled(fake: FakeServer) -> None:
    """--serial with sampling: stream i gets seed + i, and the alone runs are repeated with draft off."""
    done = run_script(
        "bench_concurrent",
        fake.url,
        "--levels",
        "2",
        "--tokens",
        "4",
        "--reps",
        "1",
        "--temperatures",
        "1.0",
        "--serial",
        "--json",
    )
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(done.stdout.splitlines()[-1])
    assert summary["comparisons"] == 4 and summary["mismatches"] == 0
    streams = summary["runs"][0]["streams"]
    assert [s["seed"] for s in streams] == [1234, 1235]
    assert [s["token_sha"] for s in streams] == [
        sha_of(fake_ids({"seed": seed, "max_tokens": 4}, 0)) for seed in (1234, 1235)
    ]
    assert sum(body.get("draft") is False for _, body, _ in fake.requests) == 2


def test_bench_concurrent_extra_fields_reach_every_request_and_a_non_object_is_refused(fake: FakeServer) -> None:
    flags = ("--levels", "2", "--tokens", "4", "--reps", "1", "--temperatures", "0", "--drafts", "both")
    done = run_script("bench_concurrent", fake.url, *flags, "--extra", '{"logprobs": 5, "presence_penalty": 0.5}')
    assert done.returncode == 0, done.stdout + done.stderr
    timed = [body for _, body, _ in fake.requests if "cache_salt" in body]
    assert len(timed) == 4 and all(b["logprobs"] == 5 and b["presence_penalty"] == 0.5 for b in timed)
    refused = run_script("bench_concurrent", fake.url, *flags, "--extra", "[1]")
    assert refused.returncode == 2 and "--extra: must be a JSON object" in refused.stderr


def test_bench_concurrent_flags_streams_that_stop_short_and_exits_1(stopping: FakeServer) -> None:
    """A stream that ends before --tokens ran a lighter load than the level says: it is named, and the run fails."""
    flags = ("--levels", "2", "--tokens", "4", "--reps", "1", "--temperatures", "0", "--json")
    done = run_script("bench_concurrent", stopping.url, *flags)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.count("SHORT") == 2
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert [s["finish_reason"] for s in record["runs"][0]["streams"]] == ["stop", "stop"]
    assert record["short_streams"] == 2


def test_bench_concurrent_sends_every_stream_at_once(fake: FakeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The streams' clients are made before the barrier: making one (it loads TLS certificates) after the barrier sent
    the N requests a client's making apart, so the N streams were not all in flight from the start."""
    bench = load_script("bench_concurrent")
    made, real = threading.Lock(), httpx.Client

    def slow_client(*args: Any, **kwargs: Any) -> httpx.Client:
        """A client that takes 50 ms to make, one at a time."""
        with made:
            time.sleep(0.05)
            return real(*args, **kwargs)

    monkeypatch.setattr(httpx, "Client", slow_client)
    args = bench.parse_args(["--base-url", fake.url, "--tokens", "2"])
    results = bench.run_together(args, [bench.stream_body(args, "fake-model", 0.0, "on", i) for i in range(4)])
    assert len(results) == 4
    assert max(fake.arrivals) - min(fake.arrivals) < 0.1  # made after the barrier: at least 3 x 50 ms apart


def resumable(requests: list[tuple[str, dict[str, Any], str | None]], since: int = 0) -> list[int]:
    """Indices from since on of the requests whose prompt and cache_salt an earlier request sent: a server's prompt
    cache resumes those from the earlier one's kept state, so their time to first token is not a prompt pass."""
    seen: set[str] = set()
    repeats = []
    for index, (_, body, _) in enumerate(requests):
        key = json.dumps([body.get("prompt"), body.get("messages"), body.get("cache_salt")])
        if key in seen and index >= since:
            repeats.append(index)
        seen.add(key)
    return repeats


def test_bench_openai_reps_do_not_resume_cached_prompts(fake: FakeServer) -> None:
    """Every rep sends the cell's prompt: without a salt of its own each rep after the warm-up resumed it from the
    prompt cache, and the reported TTFT was a resume's, not a prompt's."""
    done = run_script("bench_openai", fake.url, "--tokens", "2", "--reps", "3", "--temperatures", "0", "--prompt", "x")
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(fake.requests) == 4 and resumable(fake.requests, since=1) == []


def test_bench_concurrent_runs_do_not_resume_cached_prompts(fake: FakeServer) -> None:
    """The timed streams send the same prompts at every level, rep and setting (stream i its own ids): without a salt
    of their own they resumed the warm-up's and earlier runs' prompts; the alone checks still run each request once."""
    flags = ("--random-prompt", "8", "--tokens", "2", "--levels", "1,2", "--reps", "2", "--temperatures", "0")
    done = run_script("bench_concurrent", fake.url, *flags, "--drafts", "both", "--serial", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    timed = 2 + 2 * 2 * (1 + 2)  # two warm-ups, then each setting's two reps at 1 and 2 streams
    assert resumable(fake.requests[:timed], since=2) == []
    assert len(fake.requests) == timed + 4  # alone: two streams' bodies, with and without "draft": false
    assert json.loads(done.stdout.splitlines()[-1])["mismatches"] == 0


def test_bench_concurrent_output_throughput_counts_from_the_first_request_sent() -> None:
    """Besides aggregate_tok_s (tokens after each stream's first, from the first token of any stream), each run reports
    vLLM's and SGLang's output throughput: every token over the span from the first request sent to the last token."""
    bench = load_script("bench_concurrent")
    first = openai_stream.StreamResult(token_ids=[1, 2], started=0.0, piece_times=[1.0, 2.0], piece_tokens=[1, 1])
    second = openai_stream.StreamResult(token_ids=[3, 4], started=0.0, piece_times=[1.5, 3.0], piece_tokens=[1, 1])
    assert bench.aggregate_tok_s([first, second]) == pytest.approx(2 / 2.0)
    assert bench.output_tok_s([first, second]) == pytest.approx(4 / 3.0)


def test_bench_openai_json(fake: FakeServer) -> None:
    """bench_openai runs a warm-up and the reps per cell and ends with a JSON summary."""
    done = run_script("bench_openai", fake.url, "--tokens", "4", "--reps", "2", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(done.stdout.splitlines()[-1])
    assert [(c["prompt"], c["temperature"]) for c in summary["cells"]] == [
        ("code", 1.0),
        ("code", 0.0),
        ("chat", 1.0),
        ("chat", 0.0),
    ]
    sampled, greedy = summary["cells"][0], summary["cells"][1]
    assert [r["seed"] for r in sampled["reps"]] == [1234, 1235]
    assert all(r["tokens"] == 4 and r["token_sha"] for r in sampled["reps"])
    assert len({r["token_sha"] for r in greedy["reps"]}) == 1
    assert sampled["decode_tok_s_median"] > 0
    assert len(fake.requests) == 12  # 4 cells x (1 warm-up + 2 reps)


RANDOM_PROMPT_FLAGS = ("--random-prompt", "8", "--tokens", "4", "--levels", "1,2", "--reps", "1", "--drafts", "both")


def cells(summary: dict[str, Any]) -> set[tuple[float, str, int]]:
    """The (temperature, drafts, level) cells a JSON summary reports."""
    return {(c["temperature"], c["drafts"], c["level"]) for c in summary["summary"]}


def test_bench_concurrent_random_prompt_drafts_both(fake: FakeServer) -> None:
    """--random-prompt sends each stream its own seeded ids to /v1/completions; --drafts both reports both settings."""
    done = run_script("bench_concurrent", fake.url, *RANDOM_PROMPT_FLAGS, "--vocab", "50", "--serial", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(done.stdout.splitlines()[-1])
    assert summary["random_prompt"] == 8
    assert cells(summary) == {(t, d, n) for t in (1.0, 0.0) for d in ("on", "off") for n in (1, 2)}
    for cell in summary["summary"]:
        figures = (
            "aggregate_tok_s",
            "output_tok_s",
            "stream_tok_s_median",
            "ttft_s_median",
            "ttft_s_p90",
            "itl_s_median",
        )
        assert all(cell[name] is not None and cell[name] > 0 for name in figures), cell
        assert cell["ttft_s_p90"] >= cell["ttft_s_median"]
    streams = [s for run in summary["runs"] for s in run["streams"]]
    assert len(streams) == 12 and all(s["tokens"] == 4 and s["prompt_tokens"] == 8 for s in streams)
    assert {run["drafts"] for run in summary["runs"]} == {"on", "off"}
    # 4 warm-ups, 12 concurrent streams, 8 distinct bodies alone; the serial runs are the alone draft-off bodies
    assert len(fake.requests) == 24
    assert summary["comparisons"] == 16 and summary["mismatches"] == 0
    prompts = {json.dumps(body["prompt"]) for _, body, _ in fake.requests}
    assert len(prompts) == 2  # stream 0 and stream 1, each its own ids at every level, temperature and setting
    for path, body, _ in fake.requests:
        assert path == "/v1/completions" and "messages" not in body
        assert len(body["prompt"]) == 8 and all(0 <= t < 50 for t in body["prompt"])
        assert body["ignore_eos"] is True and body["max_tokens"] == 4
        assert body.get("draft") in (None, False)
    assert sum(body.get("draft") is False for _, body, _ in fake.requests) == 12
    sampled = [body for _, body, _ in fake.requests if body["temperature"] > 0]
    assert {(body["seed"], body["top_k"], body["top_p"]) for body in sampled} == {(1234, 20, 0.95), (1235, 20, 0.95)}


def metric(url: str, name: str) -> float:
    """One counter read from the server's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30, trust_env=False).text
    found = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)  # its model_name label
    assert found is not None, f"{name} missing from /metrics"
    return float(found.group(1))


def test_bench_concurrent_random_prompt_on_a_server_without_tokenizer(tmp_path: Path) -> None:
    """On a tiny server with no tokenizer every stream runs exactly 4 tokens from an 8-id prompt, drafted or not."""
    with serve_checkpoint(checkpoint(tmp_path / "no-tokenizer")) as live:
        done = run_script("bench_concurrent", live.url, *RANDOM_PROMPT_FLAGS, "--vocab", "320", "--alone", "--json")
        assert done.returncode == 0, done.stdout + done.stderr
        summary = json.loads(done.stdout.splitlines()[-1])
        assert cells(summary) == {(t, d, n) for t in (1.0, 0.0) for d in ("on", "off") for n in (1, 2)}
        streams = [s for run in summary["runs"] for s in run["streams"]]
        assert len(streams) == 12 and all(s["tokens"] == 4 and s["prompt_tokens"] == 8 for s in streams)
        assert summary["comparisons"] == 12 and summary["mismatches"] == 0
        requests = 4 + 12 + 8  # warm-ups, concurrent streams, distinct bodies alone
        assert metric(live.url, "flashnext:prompt_tokens_total") == 8 * requests
        assert metric(live.url, "flashnext:generation_tokens_total") == 4 * requests


def test_bench_cache_starts_each_clock_after_its_client_is_made(fake: FakeServer, monkeypatch, capsys) -> None:
    """Making an HTTP client loads TLS certificates; made inside a request's clock it was counted in every time to
    first token. Here making one moves bench_cache's clock on by 1,000 s, so a TTFT that counts it shows it."""
    bench = load_script("bench_cache")
    offset, real_init, real_clock = [0.0], httpx.Client.__init__, time.monotonic

    def init_that_takes_long(self: httpx.Client, *args: Any, **kwargs: Any) -> None:
        offset[0] += 1000.0
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(httpx.Client, "__init__", init_that_takes_long)  # however the client is made
    monkeypatch.setattr(bench.time, "monotonic", lambda: real_clock() + offset[0])
    argv = ["--base-url", fake.url, "--prompt-ids", "1,2,3", "--tokens", "2", "--repeats", "1", "--streams", "2"]
    assert bench.main(argv) == 0
    ttfts = [float(t) for t in re.findall(r"TTFT ([0-9.]+) ms", capsys.readouterr().out)]
    assert len(ttfts) == 4 and max(ttfts) < 1000.0 * 1000


def test_bench_scoring_sends_each_prompt_whole_and_checks_its_entries(tmp_path: Path) -> None:
    """Each mode takes every prompt once (plus one to warm), for one token; the scored mode's answers carry one
    prompt logprob entry per token, which the script checks."""
    with serve_checkpoint(checkpoint(tmp_path / "no-tokenizer")) as live:
        flags = ("--prompts", "3", "--length", "20", "--vocab", "320", "--concurrency", "2", "--json")
        done = run_script("bench_scoring", live.url, *flags)
        assert done.returncode == 0, done.stdout + done.stderr
        results = json.loads(done.stdout.splitlines()[-1])
        assert [r["mode"] for r in results] == ["plain", "scored", "plain", "scored"]
        assert all(r["prompts"] == 3 and r["length"] == 20 and r["prompt_tok_s"] > 0 for r in results)
        requests = 2 + 4 * 3  # warm-ups, then each mode's prompts twice
        assert metric(live.url, "flashnext:prompt_tokens_total") == 20 * requests
        assert metric(live.url, "flashnext:generation_tokens_total") == requests


def test_bench_guided_counts_each_runs_drafts_from_the_servers_health(tmp_path: Path) -> None:
    """With drafts, each run's verified and kept drafts are /health's counts after it less before: they add up to
    the server's totals less the warm-up pass's."""
    with serve_checkpoint(tiny_chat_checkpoint(tmp_path / "chat")) as live:
        done = run_script("bench_guided", live.url, "--requests", "2", "--tokens", "8", "--concurrency", "1",
                          "--passes", "1", "--json")  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        results = json.loads(done.stdout.splitlines()[-1])
        health = httpx.get(f"{live.url}/health").json()
        timed = sum(r["draft_tokens"] for r in results)
        assert 0 < timed < health["draft_tokens"]  # the untimed warm-up pass drafted too
        assert all(0 <= r["accepted_draft_tokens"] <= r["draft_tokens"] for r in results)


def test_bench_guided_runs_each_mode_to_its_length_and_checks_the_guided_text(tmp_path: Path) -> None:
    """Each mode at each concurrency sends every request once a pass (the first pass warms up, untimed) for exactly
    --tokens tokens; a guided text that left the grammar (here the EBNF one) would fail the script."""
    with serve_checkpoint(tiny_chat_checkpoint(tmp_path / "chat")) as live:
        done = run_script("bench_guided", live.url, "--requests", "2", "--tokens", "6", "--concurrency", "1", "2",
                          "--passes", "1", "--no-drafts", "--guide", "grammar", "--json")  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        results = json.loads(done.stdout.splitlines()[-1])
        assert [(r["run"], r["mode"], r["concurrency"]) for r in results] == [
            (1, "plain", 1), (1, "guided", 1), (1, "plain", 2), (1, "guided", 2)]  # fmt: skip
        assert all(r["requests"] == 2 and r["tokens"] == 6 and r["output_tok_s"] > 0 for r in results)
        assert metric(live.url, "flashnext:generation_tokens_total") == 6 * 2 * 4 * 2
        assert httpx.get(f"{live.url}/health").json()["draft_tokens"] == 0  # every request sent "draft": false


def test_bench_draft_penalties_reports_the_servers_draft_counts_and_each_outputs_sha(tmp_path: Path) -> None:
    with serve_checkpoint(tiny_chat_checkpoint(tmp_path / "chat")) as live:
        done = run_script("bench_draft_penalties", live.url, "--json")
        assert done.returncode == 0, done.stdout + done.stderr
        report = json.loads(done.stdout.splitlines()[-1])
        health = httpx.get(f"{live.url}/health").json()
        assert report["draft_tokens"] == health["draft_tokens"] > 0
        assert report["accepted_draft_tokens"] == health["accepted_draft_tokens"]
        assert len(report["token_sha"]) == 6 and len(report["draft_acceptance_per_position"]) == 3
        assert metric(live.url, "flashnext:generation_tokens_total") == 6 * 64
