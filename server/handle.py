"""How the HTTP side reaches the engine: the interface its routes use, and the engine in the same process."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import Any, Protocol

from server.engine import Engine, Outbox, Request, deliver_each
from server.metrics import EngineMetrics

# the engine thread and the event loop share the GIL: bound how long the engine waits for it while the loop streams a
# round's updates (Python's default lets one thread hold it for 5 ms)
ENGINE_SWITCH_INTERVAL_S = 0.0005


class EngineHandle(Protocol):
    """The engine as the routes see it; updates reach each request's sink on the event loop."""

    cache_enabled: bool
    priority_scheduling: bool  # whether requests are admitted by priority (--scheduling-policy priority)

    async def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start delivering updates on `loop` (the app's startup)."""

    def detach(self) -> None:
        """Stop delivering (the app's shutdown)."""

    def submit(self, request: Request) -> None:
        """Queue a request, or raise ContextLengthError / EngineStopped."""

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """End a request early: "abort" (its client left) or "stop" (a stop string matched), its finish reason."""

    async def stats(self) -> dict[str, Any]:
        """The engine's part of /health (`Engine.stats`)."""

    async def metrics(self) -> bytes:
        """The Prometheus exposition of the engine's metrics."""


def deliver_on(loop: asyncio.AbstractEventLoop) -> Callable[[Outbox], None]:
    """An engine `deliver` that hands each round's updates to `loop` in one wake-up; the sinks run there."""
    return lambda batch: loop.call_soon_threadsafe(deliver_each, batch)


class LocalEngine:
    """An engine on a thread of this process: started and stopped with the app, delivering through its loop."""

    def __init__(self, engine: Engine, metrics: EngineMetrics) -> None:
        self.engine, self.registry = engine, metrics
        self.cache_enabled = engine.cache.enabled
        self.priority_scheduling = engine.priority_scheduling
        self.previous_interval = sys.getswitchinterval()

    async def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self.previous_interval = sys.getswitchinterval()
        sys.setswitchinterval(ENGINE_SWITCH_INTERVAL_S)
        self.engine.deliver = deliver_on(loop)
        self.engine.start()

    def detach(self) -> None:
        self.engine.stop()
        sys.setswitchinterval(self.previous_interval)

    def submit(self, request: Request) -> None:
        self.engine.submit(request)

    def abort(self, request_id: str, reason: str = "abort") -> None:
        self.engine.abort(request_id, reason)

    async def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    async def metrics(self) -> bytes:
        return self.registry.render()
