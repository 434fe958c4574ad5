"""Where the HTTP front end runs: uvicorn in rank 0's engine process (`--frontend thread`), or in a process of its own
that rank 0 spawns (`--frontend process`), which tokenizes, detokenizes and streams while the engine process only
plans and runs rounds."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import signal
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from server.app import ServerState, build_app
from server.engine import Engine
from server.engine_link import EngineClient, EngineHost
from server.http_options import DEFAULT_HTTP, HttpOptions
from server.metrics import EngineMetrics
from server.protocol import NO_DEFAULTS, SamplingDefaults
from server.tokenizer import import_transformers_without_torch, load_tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FrontSettings:
    """What the HTTP side knows of the served model and where it listens (sent to a front-end process)."""

    model_path: Path
    model_name: str
    model_aliases: tuple[str, ...]  # --served-model-name's other names, which requests may use too
    context: int
    vocab_size: int
    eos_ids: tuple[int, ...]
    api_key: tuple[str, ...] | None
    chat_template: str | None  # --chat-template's text, in place of the checkpoint's
    tokenizer_path: Path | None  # --tokenizer's folder, in place of the checkpoint's
    cache_enabled: bool
    priority_scheduling: bool  # --scheduling-policy priority: requests may carry a priority
    host: str
    port: int
    sampling_defaults: SamplingDefaults = NO_DEFAULTS  # --generation-config's, for a request's unset fields
    http: HttpOptions = DEFAULT_HTTP  # CORS, the root path, TLS, uvicorn's logs, the docs pages


GRACE_S = 30  # seconds open responses get to finish once a shutdown begins
FORCED_END_S = 5  # seconds the app gets to end responses whose connections a forced shutdown dropped
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def ignore_stop_signals() -> None:
    """Served: the process is on its way out, and a late SIGTERM or Ctrl-C must not kill it mid-teardown."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class HttpServer(uvicorn.Server):
    """uvicorn, whose SIGTERM/SIGINT begin a clean shutdown (exit 0) instead of being raised again after it; open
    responses get `grace_s` to finish, and a second SIGINT (Ctrl-C twice) ends them at once. Unlike uvicorn's own, a
    SIGTERM never counts as the first of two: a front-end process gets one from its engine process alongside the
    terminal's Ctrl-C, in either order."""

    def __init__(self, config: uvicorn.Config, grace_s: float = GRACE_S) -> None:
        super().__init__(config)
        self.grace_s = grace_s  # kept here: uvicorn's own timeout cancels the responses, logging each as an error

    @contextlib.contextmanager
    def capture_signals(self):
        interrupts = 0

        def shut_down(signum, _frame) -> None:
            nonlocal interrupts
            if signum == signal.SIGINT:
                interrupts += 1
                self.force_exit = self.force_exit or interrupts > 1
            self.should_exit = True

        for sig in STOP_SIGNALS:
            signal.signal(sig, shut_down)
        try:
            yield
        finally:
            ignore_stop_signals()

    async def shutdown(self, sockets=None) -> None:
        """uvicorn's shutdown, open responses given `grace_s`; past it, or once forced, their connections are dropped,
        so each ends as if its client had left (uvicorn would cancel them, logging each as an error, and from Python
        3.12 its wait for the listener to close waits on them), and the app's own shutdown still runs (it stops the
        engine, which stops rank 1 over the control link) where uvicorn skipped it, forced before it got there."""
        loop = asyncio.get_running_loop()
        grace = loop.call_later(self.grace_s, self._end_grace)
        dropping = loop.create_task(self._drop_connections_once_forced())
        try:
            await super().shutdown(sockets)
        finally:
            grace.cancel()
            dropping.cancel()
        if self.force_exit:
            await self._let_responses_end()
            if not self._app_shut_down():
                await self.lifespan.shutdown()

    def _app_shut_down(self) -> bool:
        """Whether uvicorn ran the app's shutdown: it does unless the shutdown was forced before it got there."""
        finished = getattr(self.lifespan, "shutdown_event", None)  # lifespan="off" has none, and nothing to run
        return finished is not None and finished.is_set()

    def _end_grace(self) -> None:
        """The grace period is over: responses still open are ended as a second Ctrl-C ends them."""
        if self.server_state.connections or self.server_state.tasks:  # else uvicorn is past waiting for them
            log.warning("responses still open after the %g s grace period: ending them", self.grace_s)
            self.force_exit = True

    async def _drop_connections_once_forced(self) -> None:
        """While uvicorn waits on open responses: drop their connections as soon as the shutdown is forced."""
        while not self.force_exit:
            await asyncio.sleep(0.05)
        self._drop_connections()

    def _drop_connections(self) -> None:
        """Abort every open connection: each response's app sees its client leave."""
        for connection in list(self.server_state.connections):
            connection.transport.abort()

    async def _let_responses_end(self, within_s: float = FORCED_END_S) -> None:
        """Drop any connection still open and give the apps `within_s` to end their responses."""
        self._drop_connections()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within_s):
                while self.server_state.tasks:
                    await asyncio.sleep(0.01)
        if self.server_state.tasks:
            running = len(self.server_state.tasks)
            log.warning("%d responses still running %g s after their connections were dropped", running, within_s)


def listen_socket(host: str, port: int) -> socket.socket:
    """The HTTP address, bound before the model loads so that one in use is refused at once, naming the flags."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # only a listening socket holds the port against another bound with SO_REUSEADDR
    except OSError as exc:
        sock.close()
        raise SystemExit(f"--host {host} --port {port}: cannot listen there: {exc.strerror or exc}") from exc
    return sock


def http_server(state: ServerState, settings: FrontSettings) -> HttpServer:
    """The server of `state`'s app (it listens on the socket given to `run`)."""
    return HttpServer(uvicorn_config(build_app(state), settings))


def uvicorn_config(app, settings: FrontSettings) -> uvicorn.Config:
    """uvicorn's settings for serving `app` where and as `settings` say."""
    return uvicorn.Config(app, host=settings.host, port=settings.port, **settings.http.uvicorn_settings())


def run_frontend(settings: FrontSettings, sock: socket.socket, listener: socket.socket) -> None:
    """A front-end process: the tokenizer and the app over the engine link, until told to stop or the engine goes."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server: HttpServer | None = None

    def engine_lost(message: str) -> None:
        log.error("stopping the front end: %s", message)
        if server is not None:
            server.should_exit = True

    if not import_transformers_without_torch():
        log.info("transformers imported with torch (it needs torch, or torch was imported already)")
    client = EngineClient(sock, settings.context, settings.cache_enabled, engine_lost, settings.priority_scheduling)
    state = ServerState(
        client,
        load_tokenizer(settings.model_path, settings.chat_template, settings.tokenizer_path),
        settings.model_name,
        settings.context,
        settings.vocab_size,
        settings.eos_ids,
        settings.api_key,
        settings.sampling_defaults,
        settings.http,
        settings.model_aliases,
    )
    server = http_server(state, settings)
    server.run(sockets=[listener])


class FrontendProcess:
    """Rank 0's front end in a process of its own, over a socket pair to an EngineHost of this process's engine."""

    def __init__(
        self, settings: FrontSettings, listener: socket.socket, engine: Engine, metrics: EngineMetrics
    ) -> None:
        ours, theirs = socket.socketpair()
        self.host = EngineHost(engine, metrics, ours)
        spawn = multiprocessing.get_context("spawn")  # the engine process holds CUDA: never fork it
        self.process = spawn.Process(
            target=run_frontend, args=(settings, theirs, listener), name="flashnext-http", daemon=True
        )
        self.handed = (theirs, listener)  # closed here once the child has them
        self.stopping = threading.Event()  # set by `request_stop`
        self.signalled = False  # set by SIGTERM/SIGINT: a handler must not take the Event's lock, which `run` may hold

    def request_stop(self) -> None:
        """End `run` (any thread)."""
        self.stopping.set()

    def _on_signal(self, _signum, _frame) -> None:
        self.signalled = True

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT or `request_stop` (0), or until the front end exits by itself (1); then stop
        it, letting open responses finish, and the engine. Signals during the shutdown or after it change nothing
        here (the front-end process, which a terminal's Ctrl-C reaches too, takes a second one as forcing)."""
        self.host.start()
        self.process.start()
        for sock in self.handed:
            sock.close()
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._on_signal)
        try:
            while not self.stopping.wait(0.1) and not self.signalled:
                if not self.process.is_alive():
                    log.error("the front-end process exited with %s", self.process.exitcode)
                    break
            asked = self.stopping.is_set() or self.signalled
            self._stop_process()
            self.host.stop()
        finally:
            ignore_stop_signals()
        return 0 if asked else 1

    def _stop_process(self, grace_s: float = GRACE_S + FORCED_END_S + 5) -> None:
        """SIGTERM (its server gives open responses GRACE_S to finish, then FORCED_END_S to end), then SIGKILL after
        `grace_s`."""
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(grace_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
