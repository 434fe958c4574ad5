"""The control link: connect and accept, the settings handshake, headers, and every way a peer can fail or leave."""

from __future__ import annotations

import hashlib
import math
import multiprocessing
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from rankwire import link as link_module
from rankwire.errors import FrameError, LinkError, PeerFailed, PeerGone, SettingsMismatch
from rankwire.frames import Tag, send_frame
from rankwire.header import DrawSpec, LaneOp, LaneOpCode, LaneRows, RoundKind, RoundPlan
from rankwire.link import ControlLink

SETTINGS = {"model": "flash-next", "context": 4096, "lanes": 8, "shapes": {"hidden": 2048, "layers": 48}}
PLAN = RoundPlan(
    allocate=(1,),
    rows=(LaneRows(1, (5, 6, 7), 0, DrawSpec(0.8, 40, 0.9, 0.0, 42), drafts=(8,)),),
    ops=(LaneOp(LaneOpCode.RESTORE, 1, 3),),
)


@pytest.fixture
def links() -> Iterator[tuple[ControlLink, ControlLink]]:
    a, b = socket.socketpair()
    rank0, rank1 = ControlLink(a, rank=0), ControlLink(b, rank=1)
    yield rank0, rank1
    rank0.close()
    rank1.close()


def both(first: Callable[[], Any], second: Callable[[], Any]) -> tuple[Any, Any]:
    """Run two calls at once; return each one's result or the exception it raised."""
    results: list[Any] = [None, None]

    def run(index: int, call: Callable[[], Any]) -> None:
        try:
            results[index] = call()
        except Exception as exc:
            results[index] = exc

    thread = threading.Thread(target=run, args=(1, second))
    thread.start()
    run(0, first)
    thread.join(timeout=10)
    return results[0], results[1]


def test_the_handshake_passes_on_equal_settings(links: tuple[ControlLink, ControlLink]) -> None:
    rank0, rank1 = links
    reordered = dict(reversed(SETTINGS.items()))
    assert both(lambda: rank0.handshake(SETTINGS), lambda: rank1.handshake(reordered)) == (None, None)


@pytest.mark.parametrize(
    ("rank1_settings", "message"),
    [
        ({**SETTINGS, "context": 2048}, "setting 'context' differs: rank 0 has 4096, rank 1 has 2048"),
        ({**SETTINGS, "shapes": {"hidden": 2048, "layers": 40}}, "setting 'shapes.layers' differs: rank 0 has 48"),
        ({**SETTINGS, "drafts": 3}, "setting 'drafts' differs: rank 0 has (unset), rank 1 has 3"),
        ({**SETTINGS, "model": "other"}, 'setting \'model\' differs: rank 0 has "flash-next", rank 1 has "other"'),
        ({**SETTINGS, "context": 4096.0}, "setting 'context' differs: rank 0 has 4096, rank 1 has 4096.0"),
    ],
)
def test_a_mismatch_stops_both_ranks_naming_the_setting(
    links: tuple[ControlLink, ControlLink], rank1_settings: dict[str, Any], message: str
) -> None:
    rank0, rank1 = links
    errors = both(lambda: rank0.handshake(SETTINGS), lambda: rank1.handshake(rank1_settings))
    for error in errors:
        assert isinstance(error, SettingsMismatch)
        assert str(error).startswith(message)
    assert str(errors[0]) == str(errors[1])


def test_headers_cross_in_order(links: tuple[ControlLink, ControlLink]) -> None:
    rank0, rank1 = links
    plans = [PLAN, RoundPlan(free=(1,)), RoundPlan(kind=RoundKind.STOP)]
    for plan in plans:
        rank0.send_header(plan)
    assert [rank1.recv_header(time.monotonic() + 5) for _ in plans] == plans


def test_a_peer_that_closes_is_peer_gone(links: tuple[ControlLink, ControlLink]) -> None:
    rank0, rank1 = links
    rank0.sock.close()
    with pytest.raises(PeerGone, match="closed the link"):
        rank1.recv_header(time.monotonic() + 5)


def test_a_bye_is_peer_gone(links: tuple[ControlLink, ControlLink]) -> None:
    rank0, rank1 = links
    rank0.close()
    with pytest.raises(PeerGone, match="rank 0 closed the link"):
        rank1.recv_header()


def test_an_error_frame_is_peer_failed_with_its_message(links: tuple[ControlLink, ControlLink]) -> None:
    rank0, rank1 = links
    rank0.send_error("round 12 failed: CUDA out of memory — 2 GiB short")
    with pytest.raises(PeerFailed) as caught:
        rank1.recv_header(time.monotonic() + 5)
    assert caught.value.message == "round 12 failed: CUDA out of memory — 2 GiB short"


def test_an_error_frame_during_the_handshake_is_peer_failed(links: tuple[ControlLink, ControlLink]) -> None:
    rank0, rank1 = links
    rank1.send_error("could not load the checkpoint")
    with pytest.raises(PeerFailed, match="could not load the checkpoint"):
        rank0.handshake(SETTINGS, timeout=5)


def test_a_frame_out_of_place_is_refused(links: tuple[ControlLink, ControlLink]) -> None:
    rank0, rank1 = links
    send_frame(rank0.sock, Tag.HELLO, b"")
    with pytest.raises(FrameError, match="expected a round header from rank 0, got HELLO"):
        rank1.recv_header(time.monotonic() + 5)


def test_the_deadline_is_a_timeout(links: tuple[ControlLink, ControlLink]) -> None:
    _, rank1 = links
    deadline = time.monotonic() + 0.2
    with pytest.raises(TimeoutError, match="no round header from rank 0 by the deadline"):
        rank1.recv_header(deadline)
    assert deadline <= time.monotonic() < deadline + 0.5


def test_a_handshake_with_a_silent_peer_times_out(links: tuple[ControlLink, ControlLink]) -> None:
    rank0, _ = links
    with pytest.raises(TimeoutError, match="no HELLO from rank 1"):
        rank0.handshake(SETTINGS, timeout=0.2)


def test_watch_for_hangup_sees_a_hangup_without_taking_a_frame(links: tuple[ControlLink, ControlLink]) -> None:
    rank0, rank1 = links
    assert not rank0.watch_for_hangup()
    rank1.send_error("rank 1 failed")
    assert not rank0.watch_for_hangup()  # a pending frame is not a hang-up
    rank1.sock.close()
    assert rank0.watch_for_hangup()
    with pytest.raises(PeerFailed, match="rank 1 failed"):  # the frame is still there
        rank0.recv_header(time.monotonic() + 5)


def test_a_frame_read_between_the_watchers_poll_and_peek_is_no_hang_up(
    links: tuple[ControlLink, ControlLink], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0's engine reads rank 1's verdicts while its watcher polls the same socket: the frame the poll saw may be
    gone when the watcher peeks."""
    rank0, rank1 = links
    rank1.send_verdict(None)
    poll = link_module.poll_fd

    def poll_then_read(fd: int, timeout: float | None, events: int) -> int:
        seen = poll(fd, timeout, events)
        assert rank0.recv_verdict(time.monotonic() + 5) is None  # the engine thread takes the frame meanwhile
        return seen

    monkeypatch.setattr(link_module, "poll_fd", poll_then_read)
    assert not rank0.watch_for_hangup()


def test_tcp_connect_retries_until_rank_0_listens() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    connected: list[ControlLink] = []
    connector = threading.Thread(target=lambda: connected.append(ControlLink.connect("127.0.0.1", port, timeout=5)))
    connector.start()
    time.sleep(0.5)  # rank 1 is already retrying
    listener = ControlLink.listen("127.0.0.1", port)
    rank0 = listener.accept(timeout=5)
    connector.join(timeout=5)
    rank1 = connected[0]
    for link in (rank0, rank1):
        assert link.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        assert link.sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
    assert (rank0.rank, rank1.rank) == (0, 1)
    assert both(lambda: rank0.handshake(SETTINGS), lambda: rank1.handshake(SETTINGS)) == (None, None)
    rank0.send_header(PLAN)
    assert rank1.recv_header(time.monotonic() + 5) == PLAN
    rank0.close()
    rank1.close()


def test_tcp_connect_and_accept_time_out() -> None:
    listener = ControlLink.listen("127.0.0.1", 0)
    with pytest.raises(TimeoutError, match=f"rank 1 did not connect to port {listener.port} within 0.2 s"):
        listener.accept(timeout=0.2)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=f"rank 0 at 127.0.0.1:{port} did not accept within 0.5 s"):
        ControlLink.connect("127.0.0.1", port, timeout=0.5)
    assert 0.5 <= time.monotonic() - started < 1.5


def _rank1_child(port: int) -> None:
    """A rank 1 process that connects, passes the handshake and then hangs until it is killed."""
    link = ControlLink.connect("127.0.0.1", port, timeout=10)
    link.handshake(SETTINGS, timeout=10)
    time.sleep(60)


def test_a_killed_peer_process_is_noticed() -> None:
    listener = ControlLink.listen("127.0.0.1", 0)
    child = multiprocessing.get_context("spawn").Process(target=_rank1_child, args=(listener.port,), daemon=True)
    child.start()
    try:
        rank0 = listener.accept(timeout=20)
        rank0.handshake(SETTINGS, timeout=20)
        assert not rank0.watch_for_hangup()
        child.kill()
        child.join(timeout=10)
        deadline = time.monotonic() + 5
        while not rank0.watch_for_hangup():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(PeerGone):
            rank0.recv_header(time.monotonic() + 5)
        rank0.close()
    finally:
        child.kill()
        child.join(timeout=10)


def test_verdicts_cross_both_ways_with_their_reasons(links: tuple[ControlLink, ControlLink]) -> None:
    rank0, rank1 = links
    rank0.send_verdict(None)
    rank1.send_verdict("round plan uses lane slot 3, which is not allocated")
    assert rank1.recv_verdict(time.monotonic() + 5) is None
    assert rank0.recv_verdict(time.monotonic() + 5) == "round plan uses lane slot 3, which is not allocated"
    with pytest.raises(ValueError, match="a refusal needs a reason"):
        rank0.send_verdict("")
    assert both(lambda: rank0.exchange_verdicts(None, 5), lambda: rank1.exchange_verdicts("lane 2 lost", 5)) == (
        "lane 2 lost",
        None,
    )


def test_a_header_where_a_verdict_is_due_is_refused_and_an_error_is_peer_failed(
    links: tuple[ControlLink, ControlLink],
) -> None:
    rank0, rank1 = links
    rank0.send_header(PLAN)
    with pytest.raises(FrameError, match="expected a round verdict from rank 0, got HEADER"):
        rank1.recv_verdict(time.monotonic() + 5)
    rank1.send_error("rank 1: CUDA out of memory")
    with pytest.raises(PeerFailed, match="CUDA out of memory"):
        rank0.recv_verdict(time.monotonic() + 5)
    with pytest.raises(TimeoutError, match="no round verdict from rank 0 by the deadline"):
        rank1.recv_verdict(time.monotonic() + 0.05)


def test_a_frame_left_unfinished_past_the_deadline_is_a_timeout(links: tuple[ControlLink, ControlLink]) -> None:
    """The deadline covered only a frame's first byte: a peer stalled after part of a frame (stopped, or wedged in
    its send) held the agreement gate's wait past its deadline for good, where the design asks for a timeout."""
    rank0, rank1 = links
    rank1.sock.sendall(struct.pack("<IQ", Tag.VERDICT, 10) + b"abc")
    outcome: list[BaseException] = []

    def wait() -> None:
        try:
            rank0.recv_verdict(time.monotonic() + 0.2)
        except BaseException as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(timeout=30)
    if waiter.is_alive():
        rank1.sock.close()  # lets the stuck read end, as a peer's hang-up would
        waiter.join()
    assert len(outcome) == 1 and isinstance(outcome[0], TimeoutError), outcome
    assert "VERDICT payload stopped after 3 of 10 bytes" in str(outcome[0])


def test_a_frame_sent_in_pieces_before_the_deadline_arrives_whole(links: tuple[ControlLink, ControlLink]) -> None:
    rank0, rank1 = links
    frame = struct.pack("<IQ", Tag.VERDICT, 6) + b"no way"
    rank1.sock.sendall(frame[:5])
    sender = threading.Timer(0.1, rank1.sock.sendall, (frame[5:],))
    sender.start()
    assert rank0.recv_verdict(time.monotonic() + 30) == "no way"
    sender.join()


def in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Start `call` on a daemon thread; the list gets its result or the exception it raised."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as exc:  # the test reads whatever ended the call
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_closing_the_link_ends_a_wait_on_it(links: tuple[ControlLink, ControlLink]) -> None:
    """close() from another thread ends a blocked wait on the same link at once with a LinkError, not a hang."""
    rank0, rank1 = links
    waiter, outcome = in_thread(rank1.recv_header)  # no deadline, as rank 1's follow() waits
    time.sleep(0.2)  # past the 50 ms window: the wait is in its blocking poll
    rank1.close()
    waiter.join(2.0)
    hung = waiter.is_alive()
    rank0.sock.close()  # the peer's hang-up releases a stuck waiter
    waiter.join(2.0)
    assert not hung, "the wait was still blocked 2 s after its own link was closed"
    assert len(outcome) == 1 and isinstance(outcome[0], LinkError), outcome


def hello(settings_bytes: bytes) -> bytes:
    """A HELLO payload whose hash matches its settings bytes."""
    return hashlib.sha256(settings_bytes).digest() + settings_bytes


@pytest.mark.parametrize(
    "theirs",
    [b"not json at all", '{"context":4096,"model":"flash-n\u00e9xt"}'.encode()],
    ids=["not_json", "utf8_not_canonical"],
)
def test_a_hello_that_is_not_canonical_settings_is_a_link_error(
    links: tuple[ControlLink, ControlLink], theirs: bytes
) -> None:
    """A HELLO whose (hash-consistent) settings are not canonical ASCII JSON is refused as a LinkError naming HELLO."""
    rank0, rank1 = links
    send_frame(rank1.sock, Tag.HELLO, hello(theirs))
    waiter, outcome = in_thread(lambda: rank0.handshake(SETTINGS, timeout=1.0))
    waiter.join(2.0)
    assert not waiter.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], LinkError), repr(outcome)


def test_an_endless_deadline_waits_for_the_header(links: tuple[ControlLink, ControlLink]) -> None:
    """recv_header(deadline=math.inf) waits as with no deadline and returns the header that comes 0.2 s later."""
    rank0, rank1 = links
    waiter, outcome = in_thread(lambda: rank1.recv_header(math.inf))
    time.sleep(0.2)
    rank0.send_header(RoundPlan(kind=RoundKind.STOP))
    waiter.join(2.0)
    assert not waiter.is_alive()
    assert outcome == [RoundPlan(kind=RoundKind.STOP)], repr(outcome)


def test_a_nan_deadline_is_refused_not_spun_on(links: tuple[ControlLink, ControlLink]) -> None:
    """recv_header(deadline=nan) is refused at once (ValueError naming the deadline), not a poll spun forever."""
    rank0, rank1 = links
    waiter, outcome = in_thread(lambda: rank1.recv_header(math.nan))
    waiter.join(1.0)
    hung = waiter.is_alive()
    rank0.sock.close()  # ends a spinning wait
    waiter.join(2.0)
    assert not hung, "the wait with a NaN deadline was still running (spinning on zero-timeout polls) after 1 s"
    assert len(outcome) == 1 and isinstance(outcome[0], ValueError), repr(outcome)


def test_a_hello_of_deeply_nested_json_is_a_frame_error():
    """A (hash-consistent) HELLO whose settings are JSON nested past Python's recursion limit is refused as a
    FrameError naming the HELLO, as any other non-canonical settings are, not a RecursionError."""
    a, b = socket.socketpair()
    rank0, rank1 = ControlLink(a, rank=0), ControlLink(b, rank=1)
    try:
        theirs = b"[" * 100_000 + b"]" * 100_000
        send_frame(rank1.sock, Tag.HELLO, hashlib.sha256(theirs).digest() + theirs)
        with pytest.raises(FrameError, match="HELLO"):
            rank0.handshake({"model": "m"}, timeout=5.0)
    finally:
        rank0.close()
        rank1.close()
