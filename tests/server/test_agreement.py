"""The agreement gate on the control link: each rank sends its verdict on a round and waits for the other's, so a
round one rank refuses runs on neither, before any collective, and each names the refusing rank's reason."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from model.parallel import TensorParallel
from model.weights import load_model
from rankwire.errors import PeerFailed
from rankwire.frames import Tag, send_frame
from rankwire.header import DrawSpec, LaneRows, RoundKind, RoundPlan
from rankwire.link import ControlLink
from server.round_trace import RoundTrace
from server.runner import ModelRunner, RoundRefused
from server.tp import LinkedRunner, follow
from tests.tiny import checkpoint

GREEDY = DrawSpec(0.0, 0, 1.0, 0.0, 1)
PROMPT = (7, 19, 40, 33, 2)
REASON = "round plan uses lane slot 0, which is not allocated"


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return checkpoint(tmp_path_factory.mktemp("agree") / "m")


class Ranks:
    """Rank 0's LinkedRunner in this thread, rank 1 following in another, over a socket pair; each model's forwards
    counted."""

    def __init__(self, path) -> None:
        a, b = socket.socketpair()
        self.links = ControlLink(a, rank=0), ControlLink(b, rank=1)
        self.runners = [ModelRunner(load_model(path, dtype="float32"), 1) for _ in range(2)]
        self.forwards = [0, 0]
        for rank, runner in enumerate(self.runners):
            forward = runner.model.forward

            def counted(*args, _rank=rank, _forward=forward, **kwargs):
                self.forwards[_rank] += 1
                return _forward(*args, **kwargs)

            runner.model.forward = counted
        self.rank0 = LinkedRunner(self.runners[0], self.links[0], timeout_s=10)
        self.exit: list[int] = []
        self.thread = threading.Thread(target=lambda: self.exit.append(follow(self.links[1], self.runners[1], 10)))
        self.thread.start()

    def run(self, plan: RoundPlan) -> list:
        """One round on both ranks, as rank 0's engine runs it."""
        return self.rank0.finish(self.rank0.launch(plan))

    def close(self) -> None:
        self.rank0.close()
        self.thread.join(timeout=10)
        self.links[1].close()


@pytest.mark.parametrize("refusing", [0, 1])
def test_a_round_one_rank_refuses_runs_on_neither_and_both_name_the_reason(path, refusing: int) -> None:
    ranks = Ranks(path)
    try:
        first = ranks.run(RoundPlan(allocate=(0,), rows=(LaneRows(0, PROMPT, 0, GREEDY),)))
        assert len(first[0].tokens) == 1 and ranks.forwards == [1, 1]  # an agreed round runs on both
        ranks.runners[refusing].slots[0] = None  # this rank lost the lane (rank 1 waits for the next header)
        with pytest.raises(RoundRefused) as refused:
            ranks.run(RoundPlan(rows=(LaneRows(0, first[0].tokens, len(PROMPT), GREEDY),)))
        ranks.thread.join(timeout=10)
        assert ranks.forwards == [1, 1]  # neither rank ran the refused round
        assert str(refused.value) == (REASON if refusing == 0 else f"rank 1 refused the round: {REASON}")
        assert ranks.exit == [1]  # rank 1 stops on a refused round, its own or rank 0's
    finally:
        ranks.close()


def test_a_runner_of_two_ranks_without_the_link_refuses_to_run(path) -> None:
    runner = ModelRunner(load_model(path, dtype="float32"), 1)
    runner.model.tp = TensorParallel(0, 2)  # the gate comes before any collective
    with pytest.raises(RuntimeError, match="needs the control link's agreement"):
        runner.execute(RoundPlan(allocate=(0,), rows=(LaneRows(0, PROMPT, 0, GREEDY),)))


def test_stop_never_lands_between_a_rounds_header_and_its_verdict() -> None:
    """`LinkedRunner.close` (the engine stopping) while a round is being prepared waits for the round's verdict."""
    a, b = socket.socketpair()
    rank0, rank1 = ControlLink(a, rank=0), ControlLink(b, rank=1)
    preparing, closing = threading.Event(), threading.Event()

    class Preparing:
        """A runner still preparing its round when the engine stops."""

        trace = RoundTrace(None)
        agreement = None

        def launch(self, plan: RoundPlan, launched=None) -> None:
            preparing.set()
            closing.wait(5)
            time.sleep(0.1)  # close() is waiting for the link by now
            self.agreement(None)

    linked, seen = LinkedRunner(Preparing(), rank0, timeout_s=5), []

    def rank_1() -> None:
        try:
            rank1.recv_header(time.monotonic() + 5)
            rank1.send_verdict(None)
            seen.extend((rank1.recv_verdict(time.monotonic() + 5), rank1.recv_header(time.monotonic() + 5).kind))
        except Exception as exc:
            seen.append(exc)

    threads = [threading.Thread(target=rank_1), threading.Thread(target=linked.launch, args=(RoundPlan(),))]
    for thread in threads:
        thread.start()
    assert preparing.wait(5)
    closer = threading.Thread(target=linked.close)
    closer.start()
    closing.set()
    for thread in (*threads, closer):
        thread.join(timeout=10)
    rank1.close()
    assert seen == [None, RoundKind.STOP]


def test_a_header_rank_1_cannot_read_is_named_to_rank_0() -> None:
    """A header of another codec version (or a broken frame) ends rank 1, which tells rank 0 why: before, rank 0
    saw only that rank 1 had hung up."""
    a, b = socket.socketpair()
    rank0, rank1 = ControlLink(a, rank=0), ControlLink(b, rank=1)
    exit_codes: list[int] = []

    class Untouched:
        """A runner that must never be asked to run a round."""

        trace = RoundTrace(None)
        agreement = None

    thread = threading.Thread(target=lambda: exit_codes.append(follow(rank1, Untouched(), 5)))
    thread.start()
    send_frame(a, Tag.HEADER, b"\xff" * 8)  # no header this codec can decode
    thread.join(timeout=10)
    with pytest.raises(PeerFailed, match="rank 1 cannot read rank 0's round header"):
        rank0.recv_verdict(time.monotonic() + 5)
    assert exit_codes == [1]
    rank0.close()
    rank1.close()
