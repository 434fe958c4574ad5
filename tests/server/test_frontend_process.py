"""`--frontend process`: the HTTP front end in a process of its own serves what the in-process one serves, and the
two processes end together."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from server.frontend import HttpServer, listen_socket
from server.ranks import free_port
from tests.server.live import tiny_chat_checkpoint
from tests.server.test_tp_server import QUIET, stop, wait_healthy

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return tiny_chat_checkpoint(tmp_path_factory.mktemp("frontend") / "tiny")


@contextlib.contextmanager
def served(ckpt: Path, frontend: str, *flags: str) -> Iterator[tuple[subprocess.Popen, str]]:
    """`python -m server` with `--frontend frontend` and `flags`, once /health answers: the process and its URL;
    stopped at the end if it still runs."""
    port = free_port()
    argv = [sys.executable, "-m", "server", str(ckpt), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--frontend", frontend, "--max-lanes", "4", *flags]
    env = {**os.environ, **QUIET}
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, [proc])
        yield proc, url
    finally:
        stop([proc])


def children(pid: int) -> list[int]:
    """The pids of a process's spawned children (Linux; not multiprocessing's resource tracker)."""
    pids = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return [c for c in pids if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie is not)."""
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def maps_torch(pid: int) -> bool:
    """Whether a live process has torch's library mapped (Linux), that is, has imported torch."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def wait_until(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


BODIES = (
    {"prompt": [5, 9, 14, 3], "max_tokens": 12, "temperature": 0, "ignore_eos": True},
    {"prompt": [7, 7, 8], "max_tokens": 10, "temperature": 1.0, "seed": 11, "ignore_eos": True, "stream": True},
    {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8, "temperature": 0.7, "seed": 3},
    {"prompt": "some text", "max_tokens": 9, "temperature": 0, "stop": ["e"], "stream": True},
    {"prompt": [3, 1, 4], "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 3, "stream": True},
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "seed": 9, "logprobs": True, "top_logprobs": 2},
    {"prompt": [5, 9, 14, 3], "max_tokens": 4, "temperature": 1e-40, "seed": 2},  # drawn at vLLM's floor, 0.01
    {"messages": [{"role": "user", "content": "yo"}], "max_tokens": 4, "temperature": 1e-40, "seed": 4, "stream": True},
)


def answer(url: str, body: dict) -> tuple[str, str]:
    """(token_sha, text and logprobs) of one request, streamed or not; for an error, (its status or "error event",
    "type: param")."""
    path = "chat/completions" if "messages" in body else "completions"
    if not body.get("stream"):
        response = httpx.post(f"{url}/v1/{path}", json=body, timeout=120)
        reply = response.json()
        if "error" in reply:
            return str(response.status_code), f"{reply['error']['type']}: {reply['error']['param']}"
        choice = reply["choices"][0]
        return reply["token_sha"], (choice.get("text") or choice["message"]["content"]) + json.dumps(choice["logprobs"])
    sha, text = "", ""
    with httpx.stream("POST", f"{url}/v1/{path}", json=body, timeout=120) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                event = httpx.Response(200, content=line[6:]).json()
                if "error" in event:
                    return "error event", f"{event['error']['type']}: {event['error']['param']}"
                sha = event.get("token_sha", sha)
                text += "".join(c.get("text", "") + json.dumps(c.get("logprobs")) for c in event["choices"])
    return sha, text


def answers(url: str) -> list[tuple[str, str]]:
    """Every body's answer, sent all at once."""
    with concurrent.futures.ThreadPoolExecutor(len(BODIES)) as pool:
        return list(pool.map(lambda body: answer(url, body), BODIES))


def test_a_front_end_process_serves_what_the_in_process_one_serves_without_torch_and_sigterm_stops_both(ckpt) -> None:
    """Every body's answer is the in-process front end's; the front-end process tokenized, rendered and streamed them
    with transformers but never imported torch."""
    got = {}
    for frontend in ("process", "thread"):
        with served(ckpt, frontend) as (proc, url):
            fronts = children(proc.pid)
            assert len(fronts) == (frontend == "process")
            got[frontend] = answers(url)
            assert not any(maps_torch(front) for front in fronts)
            metrics = httpx.get(f"{url}/metrics").text
            assert "flashnext:generation_tokens_total" in metrics
            assert "flashnext:num_requests_running{model_name=" in metrics
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
            assert wait_until(lambda: not any(running(f) for f in fronts), 10)  # noqa: B023
    assert all(sha for sha, _ in got["process"])
    asked = [i for i, body in enumerate(BODIES) if "logprobs" in body]
    assert all('"logprob":' in got["process"][i][1] or '"token_logprobs":' in got["process"][i][1] for i in asked)
    assert got["process"] == got["thread"]


def test_the_front_end_imports_no_torch() -> None:
    """A front-end process starts without torch (seconds of import and hundreds of MB it never uses)."""
    code = "import sys, server.frontend; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0


def test_the_front_end_exits_when_the_engine_process_is_killed(ckpt) -> None:
    with served(ckpt, "process") as (proc, _):
        (front,) = children(proc.pid)
        proc.send_signal(signal.SIGKILL)
        assert wait_until(lambda: not running(front), 20), "the front end outlived its engine"


def test_the_engine_process_exits_1_when_its_front_end_dies(ckpt) -> None:
    with served(ckpt, "process") as (proc, _):
        (front,) = children(proc.pid)
        os.kill(front, signal.SIGKILL)
        assert proc.wait(timeout=60) == 1


def test_a_second_server_cannot_take_an_address_one_has_bound() -> None:
    from server.frontend import listen_socket

    first = listen_socket("127.0.0.1", 0)
    port = first.getsockname()[1]
    try:
        with pytest.raises(SystemExit, match=f"--host 127.0.0.1 --port {port}: cannot listen there"):
            listen_socket("127.0.0.1", port)
    finally:
        first.close()


@pytest.mark.parametrize("frontend", ["thread", "process"])
def test_a_second_ctrl_c_ends_open_responses_at_once(ckpt, frontend) -> None:
    """The first SIGINT waits for open responses (up to the grace period); a second one, as uvicorn's own, ends
    them now, whichever process the front end runs in (a terminal's Ctrl-C reaches both), and logs no error."""
    with served(ckpt, frontend) as (proc, url):
        body = {"prompt": [5, 9, 14, 3], "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
            lines = response.iter_lines()
            assert next(lines)
            group = [proc.pid, *children(proc.pid)]
            for pid in group:
                os.kill(pid, signal.SIGINT)
            time.sleep(1.0)
            assert proc.poll() is None and next(filter(None, lines))  # still flowing: the first Ctrl-C waits for it
            for pid in group:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGINT)
            code = proc.wait(timeout=15)
        err = proc.stderr.read()
        assert code == 0 and "Traceback" not in err and "ERROR" not in err, err[-3000:]


@pytest.mark.parametrize("frontend", ["thread", "process"])
def test_a_second_ctrl_c_ends_an_open_non_streamed_request_as_its_clients_leaving(ckpt, frontend) -> None:
    """A request waiting for its whole answer is dropped by the second Ctrl-C as its client leaving would end it:
    the client gets no answer, the server exits 0 and logs no error (it was cancelled and logged as one)."""
    with served(ckpt, frontend) as (proc, url), concurrent.futures.ThreadPoolExecutor(1) as pool:
        body = {"prompt": [5, 9, 14, 3], "max_tokens": 3000, "ignore_eos": True}
        answer = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=120)
        running = lambda: httpx.get(f"{url}/health", timeout=5).json()["requests_running"] == 1  # noqa: E731
        assert wait_until(running, 30)
        group = [proc.pid, *children(proc.pid)]
        for pid in group:
            os.kill(pid, signal.SIGINT)
        time.sleep(1.0)
        assert proc.poll() is None and not answer.done()  # the first Ctrl-C waits for it
        for pid in group:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGINT)
        code = proc.wait(timeout=15)
        with pytest.raises(httpx.TransportError):
            answer.result(timeout=15)
    err = proc.stderr.read()
    assert code == 0 and "Traceback" not in err and "ERROR" not in err, err[-3000:]


def test_only_a_second_sigint_forces_the_http_shutdown() -> None:
    """A front-end process gets its engine's SIGTERM and the terminal's SIGINT for one Ctrl-C, in either order: the
    SIGTERM never counts as the first of two, so open responses keep their grace period until a second Ctrl-C."""
    server = HttpServer(uvicorn.Config(app=None))
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        with server.capture_signals():
            signal.raise_signal(signal.SIGTERM)
            signal.raise_signal(signal.SIGINT)
            assert server.should_exit and not server.force_exit
            signal.raise_signal(signal.SIGTERM)
            assert not server.force_exit
            signal.raise_signal(signal.SIGINT)
            assert server.force_exit
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@pytest.fixture
def uvicorn_logs(caplog, monkeypatch):
    """caplog with uvicorn's records in it: a uvicorn.Config made with its default log_config (as an earlier test may
    have made) stops them from reaching the root logger."""
    monkeypatch.setattr(logging.getLogger("uvicorn"), "propagate", True)
    return caplog


async def wait_closed_as_python_3_12_has_it(self) -> None:
    """asyncio.Server.wait_closed from Python 3.12.1 on: it waits for every connection to close (3.11 returns once the
    listener is closed). The GPU machines run 3.12, this one 3.11."""
    if self._waiters is None:
        return
    waiter = self._loop.create_future()
    self._waiters.append(waiter)
    await waiter


@pytest.mark.parametrize("ending", ["grace_period_over", "second_ctrl_c"])
def test_responses_open_at_the_end_of_the_shutdowns_wait_end_as_their_clients_leaving(
    uvicorn_logs, monkeypatch, ending
):
    """A response still open when the grace period ends, or at the second Ctrl-C, is dropped at once, while uvicorn
    still waits on it: its app sees the client leave, and the server ends, logging no error (uvicorn's own timeout
    used to cancel it and log the cancellation; dropped after uvicorn's wait, it hung on Python 3.12)."""
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    monkeypatch.setattr(asyncio.base_events.Server, "wait_closed", wait_closed_as_python_3_12_has_it)

    async def endless():
        while True:
            yield b"tick\n"
            await asyncio.sleep(0.01)

    app = Starlette(routes=[Route("/", lambda _: StreamingResponse(endless()))])
    listener = listen_socket("127.0.0.1", 0)
    grace_s = 0.5 if ending == "grace_period_over" else 60.0
    server = HttpServer(uvicorn.Config(app, lifespan="off", log_config=None), grace_s=grace_s)
    read: list[object] = []

    def client() -> None:
        url = f"http://127.0.0.1:{listener.getsockname()[1]}/"
        try:
            assert wait_until(lambda: server.started, 30)
            with httpx.stream("GET", url, timeout=30) as response:
                lines = response.iter_lines()
                read.append(next(lines))
                server.should_exit = True  # as SIGTERM or a first Ctrl-C: the grace period begins
                if ending == "second_ctrl_c":
                    read.append(next(lines))  # still flowing
                    server.force_exit = True
                read.extend(lines)
        except httpx.TransportError as exc:
            read.append(exc)
        finally:
            server.should_exit = True  # a client that failed still ends the server

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    uvicorn_logs.set_level(logging.WARNING)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            reading = pool.submit(client)
            asyncio.run(asyncio.wait_for(server.serve(sockets=[listener]), 20))  # a hang fails, not blocks, the run
            reading.result(timeout=30)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        listener.close()
    assert read[0] == "tick" and isinstance(read[-1], httpx.TransportError)  # cut, not ended by the server
    assert [r.getMessage() for r in uvicorn_logs.records if r.levelno >= logging.ERROR] == []  # uvicorn's logs included
    warned = any("grace period" in r.getMessage() for r in uvicorn_logs.records)
    assert warned == (ending == "grace_period_over")


def test_a_ctrl_c_after_the_shutdown_began_does_not_kill_the_engine_process(ckpt) -> None:
    """Ctrl-C pressed again while the engine process tears down (its front end already gone) changes nothing: it
    exits 0, with no KeyboardInterrupt and no death by SIGINT."""
    with served(ckpt, "process") as (proc, _):
        (front,) = children(proc.pid)
        for pid in (proc.pid, front):
            os.kill(pid, signal.SIGINT)
        assert wait_until(lambda: not running(front), 20)
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGINT)
            time.sleep(0.02)
        assert proc.wait(timeout=5) == 0, proc.stderr.read()[-3000:]


def test_a_second_ctrl_c_during_the_apps_own_shutdown_runs_that_shutdown_once(uvicorn_logs) -> None:
    """uvicorn runs the app's shutdown when the shutdown was not forced; a second Ctrl-C while it runs must not start
    it again (the lifespan's second shutdown would log and wait anew)."""
    from starlette.applications import Starlette

    shutdowns: list[float] = []

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        shutdowns.append(time.monotonic())
        server.force_exit = True  # a second Ctrl-C, pressed while the app shuts down
        await asyncio.sleep(0.05)

    listener = listen_socket("127.0.0.1", 0)
    server = HttpServer(uvicorn.Config(Starlette(lifespan=lifespan), log_config=None))
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    uvicorn_logs.set_level(logging.INFO)

    async def serve_then_stop() -> None:
        serving = asyncio.create_task(server.serve(sockets=[listener]))
        while not server.started:
            await asyncio.sleep(0.01)
        server.should_exit = True  # a first Ctrl-C
        await serving

    try:
        asyncio.run(asyncio.wait_for(serve_then_stop(), 20))
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        listener.close()
    assert len(shutdowns) == 1
    waits = [r for r in uvicorn_logs.records if r.getMessage() == "Waiting for application shutdown."]
    assert len(waits) == 1
