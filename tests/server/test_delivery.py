"""A round's updates reach the sinks in one `deliver` call, so the HTTP side wakes once a round, not once a lane."""

from __future__ import annotations

import asyncio
import sys
import threading

import pytest
import torch

from model.weights import load_model
from rankwire.header import DrawSpec
from server.engine import Engine, Outbox, Request, Update, deliver_each
from server.handle import deliver_on
from server.runner import ModelRunner
from tests.server.engine_harness import Outcome, RecordingRunner
from tests.tiny import checkpoint

GREEDY = DrawSpec(0.0, 0, 1.0, 0.0, 1)


def serve(engine: Engine, requests: int, tokens: int, wait_s: float = 120) -> list[Outcome]:
    """Start the engine, submit `requests` greedy requests of one 4-token prompt, wait for all, stop it."""
    outcomes = [Outcome() for _ in range(requests)]
    engine.start()
    try:
        for i, outcome in enumerate(outcomes):
            engine.submit(Request(f"r{i}", [5, 9, 14, 3], tokens, GREEDY, frozenset(), outcome.sink))
        assert all(outcome.done.wait(wait_s) for outcome in outcomes), "a request did not finish"
    finally:
        engine.stop()
    return outcomes


def test_each_round_delivers_every_lanes_update_in_one_call(tmp_path) -> None:
    model = load_model(checkpoint(tmp_path / "m"), dtype="float32")
    runner = RecordingRunner(model, 3)
    engine = Engine(runner, context=256, prompt_budget=64)
    batches: list[list[str]] = []

    def deliver(batch: Outbox) -> None:
        batches.append([request.request_id for request, _ in batch])
        deliver_each(batch)

    engine.deliver = deliver
    outcomes = serve(engine, 3, 4)
    assert all(len(outcome.tokens) == 4 and outcome.finish == "length" for outcome in outcomes)
    assert sum(len(batch) for batch in batches) == 12  # every update went through deliver
    assert len(batches) <= len(runner.rounds)  # at most one call a round
    assert ["r0", "r1", "r2"] in batches  # lanes decoding together are delivered together


def test_deliver_on_hands_a_batch_to_the_loop_in_one_wake_up() -> None:
    """Each sink runs on the loop's thread, in order, after one call_soon_threadsafe for the whole batch."""
    seen: list[tuple[str, int, bool]] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        wakes = 0
        real = loop.call_soon_threadsafe

        def counting(*args):
            nonlocal wakes
            wakes += 1
            return real(*args)

        loop.call_soon_threadsafe = counting
        done = asyncio.Event()
        loop_thread = threading.current_thread()

        def sink_for(name: str):
            def sink(update) -> None:
                seen.append((name, update.token_ids[0], threading.current_thread() is loop_thread))
                if name == "b" and update.token_ids[0] == 2:
                    done.set()

            return sink

        requests = {name: Request(name, [1], 2, GREEDY, frozenset(), sink_for(name)) for name in "ab"}
        batch = [(requests["a"], Update((1,))), (requests["b"], Update((1,))), (requests["b"], Update((2,)))]
        worker = threading.Thread(target=deliver_on(loop), args=(batch,))
        worker.start()
        await asyncio.wait_for(done.wait(), 10)
        worker.join()
        assert wakes == 1

    asyncio.run(main())
    assert seen == [("a", 1, True), ("b", 1, True), ("b", 2, True)]


def test_a_failure_reaches_waiting_and_running_requests_through_deliver(tmp_path) -> None:
    model = load_model(checkpoint(tmp_path / "m"), dtype="float32")
    engine = Engine(ModelRunner(model, 1), context=256, prompt_budget=64)
    batches: list[Outbox] = []
    engine.deliver = batches.append
    outcome = Outcome()
    engine.submit(Request("r", [5, 9], 4, GREEDY, frozenset(), outcome.sink))  # not started: it waits
    engine.fail("rank 1 went away")
    assert [[(r.request_id, u.finish_reason, u.error) for r, u in b] for b in batches] == [
        [("r", "error", "rank 1 went away")]
    ]


def test_a_failure_counts_the_waiting_requests_it_ends_in_the_finished_metric(tmp_path) -> None:
    from server.metrics import EngineMetrics

    model = load_model(checkpoint(tmp_path / "m"), dtype="float32")
    metrics = EngineMetrics("m")
    engine = Engine(ModelRunner(model, 1), context=256, prompt_budget=64, metrics=metrics)
    engine.deliver = lambda batch: None
    for i in range(2):  # not started: both wait
        engine.submit(Request(f"r{i}", [5, 9], 4, GREEDY, frozenset(), Outcome().sink))
    engine.fail("rank 1 went away")
    ended = {"model_name": "m", "finished_reason": "error"}
    assert metrics.registry.get_sample_value("flashnext:request_success_total", ended) == 2


def test_the_app_delivers_on_its_loop_and_shortens_the_switch_interval_while_it_runs(tmp_path) -> None:
    """Started by its lifespan, the app's engine delivers through the event loop and the GIL switch interval is
    ENGINE_SWITCH_INTERVAL_S; shutting down restores both the engine and the interval."""
    from fastapi.testclient import TestClient

    from server.app import ServerState, build_app
    from server.handle import ENGINE_SWITCH_INTERVAL_S, LocalEngine
    from server.metrics import EngineMetrics

    model = load_model(checkpoint(tmp_path / "m"), dtype="float32")
    engine = Engine(ModelRunner(model, 1), context=256, prompt_budget=64)
    state = ServerState(LocalEngine(engine, EngineMetrics("m")), None, "m", 256, model.cfg.vocab_size, ())
    before = sys.getswitchinterval()
    assert before != ENGINE_SWITCH_INTERVAL_S
    with TestClient(build_app(state)) as http:
        assert sys.getswitchinterval() == ENGINE_SWITCH_INTERVAL_S
        assert engine.deliver is not deliver_each and engine.thread.is_alive()
        body = {"model": "m", "prompt": [5, 9, 14], "max_tokens": 3, "temperature": 0, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as response:
            chunks = [line for line in response.iter_lines() if line.startswith("data: {")]
        assert response.status_code == 200 and len(chunks) >= 3
    assert sys.getswitchinterval() == before and not engine.thread.is_alive()


def test_updates_reach_the_sinks_once_the_next_round_is_launched_or_the_engine_idles(tmp_path) -> None:
    """Delivery waits for the next round's forward to be on its way (the HTTP side's work then overlaps the GPU's),
    and the last round's updates go out when no round follows."""
    events: list[str] = []

    class Ordered(ModelRunner):
        def launch(self, plan, launched=None):
            events.append("launch")

            def on_launch() -> None:
                events.append("launched")
                launched()

            return super().launch(plan, on_launch)

    model = load_model(checkpoint(tmp_path / "m"), dtype="float32")
    engine = Engine(Ordered(model, 2), context=256, prompt_budget=64)
    engine.deliver = lambda batch: (events.append("deliver"), deliver_each(batch))
    outcomes = serve(engine, 2, 3)
    assert all(len(outcome.tokens) == 3 for outcome in outcomes)
    delivered = [i for i, event in enumerate(events) if event == "deliver"]
    assert len(delivered) >= 3
    assert all(events[i - 1] == "launched" for i in delivered)  # each round's updates ride on the next launch
    assert events.count("launched") == events.count("launch")  # rows or not, every round says when it is launched


def test_updates_still_arrive_when_the_runner_never_says_launched(tmp_path) -> None:
    """With nothing left to run the engine delivers what it holds, whatever the runner does."""

    class Silent(ModelRunner):
        def launch(self, plan, launched=None):
            return super().launch(plan)

    model = load_model(checkpoint(tmp_path / "m"), dtype="float32")
    (outcome,) = serve(Engine(Silent(model, 1), context=256, prompt_budget=64), 1, 3, wait_s=60)
    assert len(outcome.tokens) == 3 and outcome.finish == "length"


def test_the_last_round_before_a_stop_still_hands_its_tokens_over(tmp_path) -> None:
    """Rounds in turn: the engine stops right after finishing its second round, with no round in flight; that
    round's token is delivered all the same."""
    model = load_model(checkpoint(tmp_path / "m"), dtype="float32")

    class StopsAfterTwoRounds(RecordingRunner):
        def finish(self, launched, tokens_known=None):
            results = super().finish(launched, tokens_known)
            if len(self.rounds) == 2:
                with engine.cond:
                    engine.stopped = True
            return results

    engine = Engine(StopsAfterTwoRounds(model, 1), context=256, prompt_budget=64)
    outcome = Outcome()
    engine.submit(Request("r0", [5, 9, 14, 3], 8, GREEDY, frozenset(), outcome.sink))
    engine.start()
    engine.thread.join(60)
    assert not engine.thread.is_alive() and len(outcome.tokens) == 2


def test_a_failure_from_another_thread_reaches_the_sink_after_the_tokens_gathered_before_it(tmp_path) -> None:
    """A peer's failure ends every request from the watcher's thread while the engine thread is still delivering
    a round's tokens: the error must not overtake them."""
    model = load_model(checkpoint(tmp_path / "m"), dtype="float32")
    engine = Engine(RecordingRunner(model, 1), context=256, prompt_budget=64)
    delivering, release, seen = threading.Event(), threading.Event(), []

    def deliver(batch: Outbox) -> None:
        if threading.current_thread() is engine.thread and not delivering.is_set():
            delivering.set()
            release.wait(30)  # the engine thread is held inside its delivery of the first round's token
        seen.extend(update.finish_reason or "token" for _, update in batch)

    engine.deliver = deliver
    engine.submit(Request("r0", [5, 9, 14, 3], 8, GREEDY, frozenset(), Outcome().sink))
    engine.start()
    assert delivering.wait(60)
    failing = threading.Thread(target=engine.fail, args=("the other rank went away",))
    failing.start()
    failing.join(0.5)  # time for the failure's own delivery, if it does not wait its turn
    release.set()
    failing.join(30)
    engine.thread.join(30)
    assert seen[0] == "token" and seen[-1] == "error", seen


def test_a_request_aborted_while_it_waits_for_a_lane_gets_its_finish(tmp_path) -> None:
    """One lane, two requests: the second is aborted before it has a lane; its sink still learns it ended, and the
    finished-requests metric counts it."""
    from server.metrics import EngineMetrics

    model = load_model(checkpoint(tmp_path / "m"), dtype="float32")
    metrics = EngineMetrics("m")
    engine = Engine(RecordingRunner(model, 1), context=256, prompt_budget=64, metrics=metrics)
    first, second = Outcome(), Outcome()
    engine.submit(Request("r0", [5, 9, 14, 3], 6, GREEDY, frozenset(), first.sink))
    engine.submit(Request("r1", [5, 9, 14, 3], 6, GREEDY, frozenset(), second.sink))
    engine.abort("r1")
    engine.start()
    try:
        assert first.done.wait(60) and second.done.wait(10)
    finally:
        engine.stop()
    assert (first.finish, second.finish, second.tokens) == ("length", "abort", [])
    ended = {"model_name": "m", "finished_reason": "abort"}
    assert metrics.registry.get_sample_value("flashnext:request_success_total", ended) == 1


def test_a_failure_in_the_engines_own_work_ends_its_requests_and_stops_it(tmp_path) -> None:
    """Outside a round's launch and finish (here: a finish that gives one result too few, which the engine's own
    bookkeeping trips on) the engine thread died, and its request waited forever; now it ends with the error, the
    engine takes no more work, and the server is told once so that it exits."""
    from server.engine import EngineStopped

    class OneResultShort(ModelRunner):
        def finish(self, launched, tokens_known=None):
            return super().finish(launched, tokens_known)[:-1]

    model = load_model(checkpoint(tmp_path / "m"), dtype="float32")
    fatal: list[str] = []
    engine = Engine(OneResultShort(model, 1), context=256, prompt_budget=64, on_fatal=fatal.append)
    outcome = Outcome()
    engine.start()
    engine.submit(Request("r0", [5, 9, 14, 3], 4, GREEDY, frozenset(), outcome.sink))
    assert outcome.done.wait(60), "the request was never ended"
    engine.thread.join(10)
    assert outcome.finish == "error" and outcome.error.startswith("the engine failed: ValueError")
    assert not engine.thread.is_alive() and len(fatal) == 1
    with pytest.raises(EngineStopped):
        engine.submit(Request("r1", [5, 9], 4, GREEDY, frozenset(), Outcome().sink))


def test_a_failed_round_that_another_rank_ran_too_ends_every_request_with_its_error(tmp_path) -> None:
    """With a peer the round's failure leaves the peer's state unknown: the engine stops, each request ends with the
    round's own error, and the server is told once (the engine asked the linked runner a question it could not
    answer, and its clients read an AttributeError instead)."""
    import socket

    from rankwire.link import ControlLink
    from server.tp import LinkedRunner

    class FailsToLaunch(ModelRunner):
        def launch(self, plan, launched=None):
            raise RuntimeError("out of memory")

    model = load_model(checkpoint(tmp_path / "m"), dtype="float32")
    ours, theirs = socket.socketpair()
    fatal: list[str] = []
    runner = LinkedRunner(FailsToLaunch(model, 1), ControlLink(ours, rank=0), timeout_s=5)
    engine = Engine(runner, context=256, prompt_budget=64, on_fatal=fatal.append)
    outcome = Outcome()
    engine.start()
    engine.submit(Request("r0", [5, 9, 14, 3], 4, GREEDY, frozenset(), outcome.sink))
    try:
        assert outcome.done.wait(60), "the request was never ended"
        engine.thread.join(10)  # the server is told after the requests' ends are delivered
        assert (outcome.finish, outcome.error) == ("error", "the round failed: out of memory")
        assert fatal == ["the round failed: out of memory"]
    finally:
        engine.stop()
        theirs.close()


def test_a_drafting_rounds_tokens_are_delivered_while_its_mtp_chain_runs(tmp_path) -> None:
    """A round that drafts hands its tokens over before it waits for the MTP chain's drafts (inside the runner's
    finish), not after, when the next round is launched: the chain's time is no longer in every token's latency,
    the first one's included. The tokens are those of the same requests served without drafts."""
    events: list[str] = []
    told: list[tuple[list, list]] = []  # (what tokens_known got, what finish returned) in rounds that told early

    class Watched(ModelRunner):
        def finish(self, launched, tokens_known=None):
            events.append("finish")
            early: list = []
            results = super().finish(launched, lambda got: (early.append(list(got)), tokens_known(got)))
            events.append("finished")
            told.extend((got, results) for got in early)
            return results

    model = load_model(checkpoint(tmp_path / "m"), dtype="float32")
    engine = Engine(Watched(model, 2), context=256, prompt_budget=64, draft_depth=3)
    engine.deliver = lambda batch: (events.append("deliver"), deliver_each(batch))
    drafted = serve(engine, 2, 6)
    undrafted = serve(Engine(ModelRunner(model, 2), context=256, prompt_budget=64), 2, 6)
    assert [o.tokens for o in drafted] == [o.tokens for o in undrafted]
    assert all(o.finish == "length" for o in drafted)
    inside, where = False, []
    for event in events:
        inside = event == "finish" or (inside and event != "finished")
        if event == "deliver":
            where.append(inside)
    assert where and all(where), f"deliveries inside a finish: {where}"
    assert told and all(len(got) == len(results) for got, results in told)
    for got, results in told:  # the same tokens, before the drafts were known; the drafts came after
        assert [r.tokens for r in got] == [r.tokens for r in results] and not any(r.drafts for r in got)
    assert any(r.drafts for _, results in told for r in results)


def test_a_failure_of_the_engines_own_work_in_a_drafting_rounds_hand_over_stops_the_engine(tmp_path) -> None:
    """The hand-over inside a drafting round's finish is the engine's own work (its bookkeeping, metrics, sinks): a
    failure there stops the engine and tells the server, as it does anywhere else, and is not taken for the round's
    failure (which at one rank would end only that round's requests and carry on)."""
    from server.metrics import EngineMetrics

    class Broken:
        def observe(self, _: float) -> None:
            raise RuntimeError("a metric broke")

    metrics = EngineMetrics("m")
    metrics.time_to_first_token = Broken()
    model = load_model(checkpoint(tmp_path / "m"), dtype="float32")
    fatal: list[str] = []
    engine = Engine(
        ModelRunner(model, 1), context=256, prompt_budget=64, draft_depth=3, on_fatal=fatal.append, metrics=metrics
    )
    outcome = Outcome()
    engine.start()
    try:
        engine.submit(Request("r0", [5, 9, 14, 3], 4, GREEDY, frozenset(), outcome.sink))
        assert outcome.done.wait(60), "the request was never ended"
        engine.thread.join(10)
        assert outcome.error.startswith("the engine failed: RuntimeError: a metric broke"), outcome.error
        assert len(fatal) == 1 and not engine.thread.is_alive()
    finally:
        engine.stop()


def test_a_drafting_rounds_tokens_are_delivered_before_its_drafts_are_read_back(tmp_path) -> None:
    """The hand-over comes before the MTP chain's one read-back (its `.tolist()` in `_draft`), not merely somewhere
    inside finish: that wait is what it keeps out of the tokens' latency."""
    events: list[str] = []
    real = torch.Tensor.tolist

    class Watched(ModelRunner):
        def _draft(self, plan_rows, mtp_rows, before_wait=None):
            def tolist(t):
                events.append("tolist")
                return real(t)

            torch.Tensor.tolist = tolist
            try:
                drafts = super()._draft(plan_rows, mtp_rows, before_wait)
            finally:
                torch.Tensor.tolist = real
            if drafts:  # the chain ran: its read-back is this call's last tolist
                events[max(i for i, e in enumerate(events) if e == "tolist")] = "read drafts"
            return drafts

    model = load_model(checkpoint(tmp_path / "m"), dtype="float32")
    engine = Engine(Watched(model, 1), context=256, prompt_budget=64, draft_depth=3)
    engine.deliver = lambda batch: (events.append("deliver"), deliver_each(batch))
    (outcome,) = serve(engine, 1, 6)
    assert outcome.finish == "length"
    reads = [i for i, e in enumerate(events) if e == "read drafts"]
    assert reads and all(events[i - 1] == "deliver" for i in reads), events
