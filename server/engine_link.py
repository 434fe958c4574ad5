"""The local socket between rank 0's engine process and a front end in a process of its own (`--frontend process`):
requests (sent as themselves, their sink left behind) and aborts one way, each round's updates the other, and
/health and /metrics asked for and answered.

Frames are `length: u32 | pickle`, both ends being this program. The engine's end blocks (a reader thread, and the
engine thread sending a round's updates in one frame); the front end's end is asyncio streams on its event loop,
whose writes never block, so neither side can wait on the other while both wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import socket
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from server.engine import (
    ContextLengthError,
    Engine,
    EngineStopped,
    Outbox,
    Request,
    Update,
    check_context,
)
from server.guide_spec import GRAMMARS_KEPT, GuideSpec
from server.metrics import EngineMetrics

log = logging.getLogger(__name__)

_LENGTH = struct.Struct("<I")
SENT_FORMS = GRAMMARS_KEPT  # guide sources a front end remembers sending compiled (the engine keeps as many)
LOST = "the engine process went away"


@dataclass(frozen=True, slots=True)
class Abort:
    """End a request early, for `reason` ("abort" or "stop": `EngineHandle.abort`)."""

    request_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Ask:
    """A question for the engine process: "stats" (`Engine.stats`) or "metrics" (the Prometheus text)."""

    ask_id: int
    what: str


@dataclass(frozen=True, slots=True)
class Answer:
    """The reply to an Ask: its value, or why there is none."""

    ask_id: int
    value: Any
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Delivered:
    """One round's updates: (request id, cached prompt tokens, its Update) each."""

    updates: list[tuple[str, int, Update]]


@dataclass(frozen=True, slots=True)
class Refused:
    """The engine took no work for a request: it stopped taking any (`EngineStopped`), for `error`."""

    request_id: str
    error: str


def encode(message: object) -> bytes:
    """One frame."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(payload)) + payload


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    """Exactly `size` bytes; EOFError if the peer closes first."""
    buf = bytearray()
    while len(buf) < size:
        chunk = sock.recv(size - len(buf))
        if not chunk:
            raise EOFError("the front end closed its link")
        buf += chunk
    return bytes(buf)


def _ignore(_: Update) -> None:
    """A request's sink as sent to the engine process: its updates leave through the host's `deliver`, a round at a
    time."""


class EngineHost:
    """The engine process's end: runs the front end's submits, aborts and questions; sends each round's updates."""

    def __init__(self, engine: Engine, metrics: EngineMetrics, sock: socket.socket) -> None:
        self.engine, self.metrics, self.sock = engine, metrics, sock
        self.send_lock = threading.Lock()
        self.thread = threading.Thread(target=self._serve, name="engine-link", daemon=True)

    def start(self) -> None:
        """Start the engine, delivering over the link, and the thread that reads it."""
        self.engine.deliver = self._deliver
        self.engine.start()
        self.thread.start()

    def stop(self) -> None:
        """Stop the engine and close the link."""
        self.engine.stop()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def _send(self, message: object) -> None:
        frame = encode(message)
        with self.send_lock, contextlib.suppress(OSError):  # the front end is gone: its process's exit stops serving
            self.sock.sendall(frame)

    def _deliver(self, batch: Outbox) -> None:
        self._send(Delivered([(request.request_id, request.cached, update) for request, update in batch]))

    def _serve(self) -> None:
        """Run messages until the front end's end closes. One that fails is logged (a question that fails is answered
        with the error) and the link stays up; if reading itself fails the link is shut, so the front end knows."""
        try:
            while True:
                (length,) = _LENGTH.unpack(_recv_exact(self.sock, _LENGTH.size))
                message = pickle.loads(_recv_exact(self.sock, length))
                try:
                    self._handle(message)
                except Exception as exc:
                    log.exception("engine link: a %s failed", type(message).__name__)
                    if isinstance(message, Ask):
                        self._send(Answer(message.ask_id, None, f"{type(exc).__name__}: {exc}"))
        except (EOFError, OSError):
            pass
        finally:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)

    def _handle(self, message: object) -> None:
        if isinstance(message, Request):
            try:
                self.engine.submit(message)
            except ContextLengthError as exc:
                self._send(Delivered([(message.request_id, 0, (), "error", str(exc), None, ())]))
            except EngineStopped as exc:
                self._send(Refused(message.request_id, str(exc)))
        elif isinstance(message, Abort):
            self.engine.abort(message.request_id, message.reason)
        elif isinstance(message, Ask):
            value = self.engine.stats() if message.what == "stats" else self.metrics.render()
            self._send(Answer(message.ask_id, value))
        else:
            log.error("engine link: ignored a %s", type(message).__name__)


class EngineClient:
    """The front end's end: an EngineHandle whose engine runs in rank 0's process. When the link ends, every open
    request ends with an error and `on_lost` is called."""

    def __init__(
        self,
        sock: socket.socket,
        context: int,
        cache_enabled: bool,
        on_lost: Callable[[str], None] | None = None,
        priority_scheduling: bool = False,
    ) -> None:
        self.sock, self.context, self.cache_enabled, self.on_lost = sock, context, cache_enabled, on_lost
        self.priority_scheduling = priority_scheduling
        self.requests: dict[str, Request] = {}
        self.sent_forms: OrderedDict[tuple[str, str], None] = OrderedDict()  # guide sources sent with their grammar
        self.asks: dict[int, asyncio.Future] = {}
        self.next_ask = 0
        self.lost: str | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.reading: asyncio.Task | None = None

    async def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        reader, self.writer = await asyncio.open_connection(sock=self.sock)
        self.reading = loop.create_task(self._read(reader))

    def detach(self) -> None:
        if self.reading is not None:
            self.reading.cancel()
        if self.writer is not None:
            self.writer.close()

    def submit(self, request: Request) -> None:
        check_context(request, self.context)
        if self.lost is not None:
            raise EngineStopped(self.lost)
        self.requests[request.request_id] = request
        self._send(replace(request, sink=_ignore, guide=self._guide_to_send(request.guide)))

    def _guide_to_send(self, guide: GuideSpec | None) -> GuideSpec | None:
        """A guide with its grammar (compiled here to check the request) pickled the first time its source goes to
        the engine's process, which keeps it (`SENT_FORMS` sources are remembered; one sent again past that only
        costs the bytes)."""
        if guide is None:
            return None
        key = (guide.kind, guide.source)
        sent = key in self.sent_forms
        self.sent_forms[key] = None
        self.sent_forms.move_to_end(key)
        while len(self.sent_forms) > SENT_FORMS:
            self.sent_forms.popitem(last=False)
        return guide if sent else guide.with_compiled_form()

    def abort(self, request_id: str, reason: str = "abort") -> None:
        if self.requests.pop(request_id, None) is not None:
            self._send(Abort(request_id, reason))

    async def stats(self) -> dict[str, Any]:
        return await self._ask("stats")

    async def metrics(self) -> bytes:
        return await self._ask("metrics")

    async def _ask(self, what: str) -> Any:
        if self.lost is not None:
            raise EngineStopped(self.lost)
        self.next_ask += 1
        future = asyncio.get_running_loop().create_future()
        self.asks[self.next_ask] = future
        self._send(Ask(self.next_ask, what))
        return await future

    def _send(self, message: object) -> None:
        """Queue a frame on the stream (never blocks)."""
        assert self.writer is not None, "the engine link is used before the app started"
        self.writer.write(encode(message))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
                self._handle(pickle.loads(await reader.readexactly(length)))
        except (asyncio.IncompleteReadError, OSError):
            self._lose(LOST)

    def _handle(self, message: object) -> None:
        if isinstance(message, Delivered):
            for request_id, cached, update in message.updates:
                finished = update.finish_reason is not None
                request = self.requests.pop(request_id, None) if finished else self.requests.get(request_id)
                if request is not None:  # an aborted request's last updates are dropped
                    request.cached = cached
                    request.sink(update)
        elif isinstance(message, Refused):
            request = self.requests.pop(message.request_id, None)
            if request is not None:
                request.sink(Update((), "error", message.error, refused=True))
        elif isinstance(message, Answer):
            future = self.asks.pop(message.ask_id, None)
            if future is None or future.done():
                return
            if message.error is None:
                future.set_result(message.value)
            else:
                future.set_exception(RuntimeError(f"the engine could not answer: {message.error}"))

    def _lose(self, message: str) -> None:
        """The engine is gone: end every open request and question with `message`."""
        self.lost = message
        requests, self.requests = self.requests, {}
        for request in requests.values():
            request.sink(Update((), "error", message))
        asks, self.asks = self.asks, {}
        for future in asks.values():
            if not future.done():
                future.set_exception(EngineStopped(message))
        if self.on_lost is not None:
            self.on_lost(message)
