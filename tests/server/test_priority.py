"""--scheduling-policy priority: a free lane takes the waiting request of the lowest priority value, first come
among equals, as vLLM's scheduler does; under fcfs a request's priority must be 0."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from model.weights import load_model
from rankwire.header import DrawSpec
from server.app import ServerState, build_app
from server.engine import Engine, Request, Update
from tests.server.engine_harness import Outcome, RecordingRunner
from tests.server.test_frontend_process import served
from tests.server.test_generation import RecordingEngine
from tests.server.test_tool_calls_api import SHIPPED
from tests.tiny import checkpoint

GREEDY = DrawSpec(0.0, 0, 1.0, 0.0, 1)
PRIORITIES = [0, 5, -1, 5, -1, 0]  # requests r0..r5, queued in this order


def admission_order(tmp_path, priority_scheduling: bool) -> list[str]:
    """The order in which one lane serves r0..r5, all queued before the engine starts."""
    model = load_model(checkpoint(tmp_path / "m"), dtype="float32")
    engine = Engine(RecordingRunner(model, 1), context=256, prompt_budget=64, priority_scheduling=priority_scheduling)
    finished: list[str] = []
    outcomes = [Outcome() for _ in PRIORITIES]
    for i, (priority, outcome) in enumerate(zip(PRIORITIES, outcomes, strict=True)):

        def sink(update: Update, name: str = f"r{i}", outcome: Outcome = outcome) -> None:
            if update.finish_reason is not None:
                finished.append(name)
            outcome.sink(update)

        engine.submit(Request(f"r{i}", [3, 5, 7 + i], 2, GREEDY, frozenset(), sink, priority=priority))
    engine.start()
    try:
        assert all(outcome.done.wait(120) for outcome in outcomes), "a request did not finish"
    finally:
        engine.stop()
    return finished


def test_a_free_lane_takes_the_lowest_priority_value_first_and_first_come_among_equals(tmp_path):
    assert admission_order(tmp_path, priority_scheduling=True) == ["r2", "r4", "r0", "r5", "r1", "r3"]


def test_first_come_first_served_admits_in_arrival_order_whatever_the_priorities(tmp_path):
    assert admission_order(tmp_path, priority_scheduling=False) == [f"r{i}" for i in range(len(PRIORITIES))]


class Ending(RecordingEngine):
    """The recording engine, ending each request at once."""

    def submit(self, request) -> None:
        super().submit(request)
        request.sink(Update((), "length"))


class Prioritizing(Ending):
    """The same under priority scheduling."""

    priority_scheduling = True


def test_a_priority_reaches_the_engine_under_priority_scheduling_and_is_refused_under_fcfs():
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED)
    body = {"prompt": "Hi", "max_tokens": 2, "priority": -3}
    first_come, prioritizing = Ending(), Prioritizing()
    fcfs, priority = (
        TestClient(build_app(ServerState(engine, tokenizer, "m", 4096, len(tokenizer), (0,))))
        for engine in (first_come, prioritizing)
    )
    refused = fcfs.post("/v1/completions", json=body)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority", refused.text
    assert fcfs.post("/v1/completions", json={**body, "priority": 0}).status_code == 200
    assert priority.post("/v1/completions", json=body).status_code == 200
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    assert priority.post("/v1/chat/completions", json=chat).status_code == 200
    assert [request.priority for request in prioritizing.submitted] == [-3, 0]
    assert [request.priority for request in first_come.submitted] == [0]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tests.server.live import tiny_chat_checkpoint

    return tiny_chat_checkpoint(tmp_path_factory.mktemp("priority") / "tiny")


def test_a_front_end_process_admits_by_priority(ckpt):
    """One lane, held by a long request: of two that wait, the lower priority value is served first though it came
    second (the priority crosses to the engine's process)."""
    long = {"prompt": "Hi", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    finished: list[str] = []

    def ask(url: str, name: str, priority: int) -> None:
        body = {"prompt": name, "max_tokens": 2, "ignore_eos": True, "priority": priority}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=120).status_code == 200
        finished.append(name)

    def waiting(url: str, count: int) -> None:
        deadline = time.monotonic() + 60
        while httpx.get(f"{url}/health").json()["requests_waiting"] < count:
            assert time.monotonic() < deadline, "the requests did not queue"
            time.sleep(0.02)

    flags = ("--scheduling-policy", "priority", "--max-lanes", "1")
    with served(ckpt, "process", *flags) as (_, url), concurrent.futures.ThreadPoolExecutor(2) as pool:
        with httpx.stream("POST", f"{url}/v1/completions", json=long, timeout=120) as held:
            lines = held.iter_lines()  # kept: a dropped generator would close the stream
            next(line for line in lines if line.startswith("data: {"))  # the lane is taken
            later = pool.submit(ask, url, "later", 5)
            waiting(url, 1)
            sooner = pool.submit(ask, url, "sooner", -5)
            waiting(url, 2)
        # the long request's client has left: its lane goes to the waiting ones
        later.result(), sooner.result()
    assert finished == ["sooner", "later"]


def test_the_responses_api_takes_a_priority_as_the_chat_does():
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED)
    engines = Ending(), Prioritizing()
    fcfs, priority = (
        TestClient(build_app(ServerState(engine, tokenizer, "m", 4096, len(tokenizer), (0,)))) for engine in engines
    )
    body = {"input": "Hi", "max_output_tokens": 2, "priority": 4}
    refused = fcfs.post("/v1/responses", json=body)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority", refused.text
    assert priority.post("/v1/responses", json=body).status_code == 200
    assert [request.priority for request in engines[1].submitted] == [4]
