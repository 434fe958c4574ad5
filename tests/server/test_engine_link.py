"""The engine link: a front end in another process reaches the engine over a socket pair and sees what the engine's
own sinks would see (here both ends in one process: the host's threads, and the client on a test event loop)."""

from __future__ import annotations

import asyncio
import contextlib
import pickle
import socket
import threading
from collections.abc import AsyncIterator

import pytest

from model.weights import load_model
from rankwire.header import DrawSpec
from server.engine import ContextLengthError, Engine, EngineStopped, Request, Update
from server.engine_link import LOST, EngineClient, EngineHost
from server.guide_spec import GuideSpec
from server.metrics import EngineMetrics
from server.prompt_cache import PromptCache
from server.runner import ModelRunner
from tests.server.engine_harness import Outcome
from tests.tiny import checkpoint

GREEDY = DrawSpec(0.0, 0, 1.0, 0.0, 1)
SAMPLED = DrawSpec(1.0, 0, 1.0, 0.0, 1234)
OVERFLOWS = DrawSpec(1e-40, 0, 1.0, 0.0, 2)  # every logit over it is infinite: each draw fails
PROMPTS = ([5, 9, 14, 3, 7, 8, 2, 11], [6, 6, 6, 6], [40, 41, 42])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(checkpoint(tmp_path_factory.mktemp("link") / "m"), dtype="float32")


def engine_for(model, cache_bytes: int = 0) -> Engine:
    return Engine(ModelRunner(model, 3), context=256, prompt_budget=64, metrics=EngineMetrics("m"),
                  prompt_cache=PromptCache(cache_bytes), cache_grid=4)  # fmt: skip


def finished(engine: Engine, reason: str) -> float:
    """Requests the engine ended for `reason`."""
    labels = {"model_name": "m", "finished_reason": reason}
    value = engine.metrics.registry.get_sample_value("flashnext:request_success_total", labels)
    return value or 0.0


def direct(model, draws: list[DrawSpec], tokens: int) -> list[list[int]]:
    """Each prompt's tokens from the engine's own sinks, all served together."""
    engine = engine_for(model)
    outcomes = [Outcome() for _ in PROMPTS]
    engine.start()
    try:
        for i, (prompt, draw) in enumerate(zip(PROMPTS, draws, strict=True)):
            engine.submit(Request(f"r{i}", prompt, tokens, draw, frozenset(), outcomes[i].sink))
        assert all(o.done.wait(120) for o in outcomes)
    finally:
        engine.stop()
    return [o.tokens for o in outcomes]


class Collected:
    """A request's updates on the event loop, and a future set when it ends."""

    def __init__(self) -> None:
        self.updates: list[Update] = []
        self.ended = asyncio.get_running_loop().create_future()

    def sink(self, update: Update) -> None:
        self.updates.append(update)
        if update.finish_reason is not None and not self.ended.done():
            self.ended.set_result(update)

    @property
    def tokens(self) -> list[int]:
        return [t for u in self.updates for t in u.token_ids]


async def first_update(seen: Collected) -> None:
    """Return once `seen` has an update (callers bound it with a deadline)."""
    while not seen.updates:
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def linked(engine: Engine, lost: list[str] | None = None) -> AsyncIterator[tuple[EngineHost, EngineClient]]:
    """A started host of `engine` and a client attached to the running loop, both stopped at the end."""
    ours, theirs = socket.socketpair()
    host = EngineHost(engine, engine.metrics, ours)
    host.start()
    client = EngineClient(theirs, engine.context, engine.cache.enabled, lost.append if lost is not None else None)
    await client.attach(asyncio.get_running_loop())
    try:
        yield host, client
    finally:
        client.detach()
        host.stop()


def test_requests_over_the_link_get_the_tokens_the_engine_gives_its_own_sinks(model) -> None:
    draws = [GREEDY, SAMPLED, GREEDY]
    expected = direct(model, draws, 6)

    async def main() -> list[list[int]]:
        async with linked(engine_for(model)) as (_, client):
            seen = [Collected() for _ in PROMPTS]
            for i, (prompt, draw) in enumerate(zip(PROMPTS, draws, strict=True)):
                client.submit(Request(f"r{i}", prompt, 6, draw, frozenset(), seen[i].sink))
            ends = await asyncio.wait_for(asyncio.gather(*(s.ended for s in seen)), 120)
            assert [u.finish_reason for u in ends] == ["length"] * 3
            assert client.requests == {}  # finished requests are forgotten
            return [s.tokens for s in seen]

    assert asyncio.run(main()) == expected


def test_a_resumed_prompt_reports_its_cached_tokens_and_the_health_and_metrics_answer(model) -> None:
    async def main() -> None:
        engine = engine_for(model, cache_bytes=1 << 30)
        async with linked(engine) as (_, client):
            seen = [Collected(), Collected()]
            requests = [Request(f"r{i}", PROMPTS[0], 3, GREEDY, frozenset(), s.sink) for i, s in enumerate(seen)]
            for request, collected in zip(requests, seen, strict=True):  # one after the other: the second resumes
                client.submit(request)
                await asyncio.wait_for(collected.ended, 120)
            assert requests[0].cached == 0 and requests[1].cached == engine.cache.cached_tokens > 0
            assert seen[0].tokens == seen[1].tokens
            stats = await asyncio.wait_for(client.stats(), 10)
            assert stats == engine.stats() and stats["prompt_cache"]["hits"] == 1
            text = (await asyncio.wait_for(client.metrics(), 10)).decode()
            assert "flashnext:round_seconds_count" in text

    asyncio.run(main())


@pytest.mark.parametrize("reason", ["abort", "stop"])
def test_an_abort_frees_the_lane_and_nothing_more_reaches_the_request(model, reason) -> None:
    """The client left ("abort") or the front end matched a stop string ("stop"): the engine ends it for that reason."""

    async def main() -> None:
        engine = engine_for(model)
        async with linked(engine) as (_, client):
            seen = Collected()
            client.submit(Request("long", PROMPTS[0], 240, GREEDY, frozenset(), seen.sink))
            await asyncio.wait_for(first_update(seen), 60)
            client.abort("long", reason)
            count = len(seen.updates)
            for _ in range(500):
                if (await client.stats())["requests_running"] == 0:
                    break
                await asyncio.sleep(0.02)
            assert (await client.stats())["requests_running"] == 0
            assert len(seen.updates) == count and not seen.ended.done()
            ended = (finished(engine, "abort"), finished(engine, "stop"), finished(engine, "length"))
            assert ended == ((1, 0, 0) if reason == "abort" else (0, 1, 0))  # ended by the abort, for its reason

    asyncio.run(main())


def test_a_draw_its_parameters_make_fail_arrives_naming_the_field(model) -> None:
    """The front end answers it 400 naming the field, as the in-process one does; the request beside it goes on."""

    async def main() -> None:
        async with linked(engine_for(model)) as (_, client):
            seen = [Collected(), Collected()]
            for i, draw in enumerate((GREEDY, OVERFLOWS)):
                client.submit(Request(f"r{i}", PROMPTS[i], 6, draw, frozenset(), seen[i].sink))
            ends = await asyncio.wait_for(asyncio.gather(*(s.ended for s in seen)), 120)
            assert [(u.finish_reason, u.error_param) for u in ends] == [("length", None), ("error", "temperature")]
            assert "temperature 1e-40 overflows" in ends[1].error and len(seen[0].tokens) == 6

    asyncio.run(main())


def test_a_request_that_cannot_fit_is_refused_before_it_is_sent(model) -> None:
    async def main() -> None:
        engine = engine_for(model)
        async with linked(engine) as (_, client):
            with pytest.raises(ContextLengthError, match="context is 256 tokens"):
                client.submit(Request("big", PROMPTS[0], 250, GREEDY, frozenset(), Collected().sink))
            assert client.requests == {}

    asyncio.run(main())


def test_when_the_engine_side_goes_every_open_request_and_question_ends_with_an_error(model) -> None:
    async def main() -> None:
        lost: list[str] = []
        async with linked(engine_for(model), lost) as (host, client):
            seen = Collected()
            client.submit(Request("long", PROMPTS[1], 240, GREEDY, frozenset(), seen.sink))
            await asyncio.wait_for(first_update(seen), 60)
            host.stop()  # the engine process's end closes, as when that process dies
            end = await asyncio.wait_for(seen.ended, 10)
            assert (end.finish_reason, end.error) == ("error", LOST) and lost == [LOST]
            with pytest.raises(EngineStopped):
                client.submit(Request("late", PROMPTS[1], 3, GREEDY, frozenset(), Collected().sink))
            with pytest.raises(EngineStopped):
                await client.stats()

    asyncio.run(main())


def test_a_request_sent_after_the_engine_stopped_is_refused_as_no_work_taken(model) -> None:
    """The front end answers it 503, as the in-process front end does when its submit raises EngineStopped."""

    async def main() -> None:
        engine = engine_for(model)
        async with linked(engine) as (_, client):
            engine.stop()  # shutting down, the link still up
            seen = Collected()
            client.submit(Request("late", PROMPTS[0], 3, GREEDY, frozenset(), seen.sink))
            end = await asyncio.wait_for(seen.ended, 10)
            assert (end.finish_reason, end.refused) == ("error", True) and "shutting down" in end.error
            assert client.requests == {}

    asyncio.run(main())


def test_a_question_that_fails_is_answered_with_the_error_and_the_link_stays_up(model) -> None:
    async def main() -> None:
        engine = engine_for(model)
        real_stats = engine.stats
        engine.stats = lambda: (_ for _ in ()).throw(RuntimeError("mid-change"))  # the next question fails
        async with linked(engine) as (_, client):
            with pytest.raises(RuntimeError, match="the engine could not answer: RuntimeError: mid-change"):
                await asyncio.wait_for(client.stats(), 10)
            engine.stats = real_stats
            seen = Collected()
            client.submit(Request("after", PROMPTS[2], 3, GREEDY, frozenset(), seen.sink))
            assert (await asyncio.wait_for(seen.ended, 60)).finish_reason == "length"
            assert (await asyncio.wait_for(client.stats(), 10))["requests_running"] == 0

    asyncio.run(main())


class RecordingEngine:
    """Just enough of an Engine for the host: it records what it is given."""

    def __init__(self) -> None:
        self.submitted: list[Request] = []
        self.got = threading.Event()
        self.context = 1 << 22
        self.deliver = None
        self.metrics = EngineMetrics("m")
        self.cache = PromptCache(0)

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def submit(self, request: Request) -> None:
        self.submitted.append(request)
        self.got.set()


def test_a_prompt_larger_than_the_socket_buffers_arrives_whole() -> None:
    prompt = list(range(600_000))  # a few MB pickled: many socket buffers

    async def main() -> None:
        engine = RecordingEngine()
        async with linked(engine) as (_, client):
            client.submit(Request("big", prompt, 8, SAMPLED, frozenset({2}), Collected().sink, keep_at=(64,)))
            assert await asyncio.to_thread(engine.got.wait, 30)
            (got,) = engine.submitted
            assert (got.request_id, got.prompt_ids, got.max_tokens, got.draw) == ("big", prompt, 8, SAMPLED)
            assert (got.stop_ids, got.keep_at) == (frozenset({2}), (64,))

    asyncio.run(main())


def test_a_guided_request_carries_its_compiled_grammar_to_the_engines_process_once() -> None:
    """The front end compiled the grammar when it checked the request: the engine's end gets it pickled with the
    guide the first time that source goes over the link (its process keeps it), so it need not compile it again; the
    guide still equals the one sent."""
    guide, other = GuideSpec("regex", "[a-z]{3}-[0-9]{1,4}"), GuideSpec("choice", '["x"]')

    async def main() -> list[Request]:
        engine = RecordingEngine()
        async with linked(engine) as (_, client):
            for i, sent in enumerate((guide, guide, other)):
                engine.got.clear()
                client.submit(Request(f"g{i}", [5, 6], 8, GREEDY, frozenset({2}), Collected().sink, guide=sent))
                assert await asyncio.to_thread(engine.got.wait, 30)
        return engine.submitted

    first, again, third = (request.guide for request in asyncio.run(main()))
    assert first == again == guide and guide.compiled_form is None
    assert first.compiled_form is not None and again.compiled_form is None and third.compiled_form is not None
    grammar = pickle.loads(first.compiled_form)
    assert grammar.accepts(grammar.feed(grammar.initial, b"abc-123")) and grammar.feed(grammar.initial, b"ab1") is None


def test_an_abort_for_a_reason_no_front_end_gives_is_refused(model) -> None:
    """Only "abort" and "stop" end a request from outside the engine; another reason is a bug, named at once."""
    with pytest.raises(ValueError, match="reason 'length'"):
        engine_for(model).abort("any", "length")
