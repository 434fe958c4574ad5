"""The hybrid wait: short polls for the first 50 ms of each wait, then one blocking poll; it ends at data, deadline or
hang-up. The wrong waits (plain blocking: no window; never stops: an endless window) run through the same checks, which
must tell them apart from the real one."""

from __future__ import annotations

import inspect
import math
import resource
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from rankwire.errors import PeerGone
from rankwire.frames import recv_frame
from rankwire.wait import POLLIN, PollFn, poll_fd, poll_ms, wait_readable

WINDOW_S = 0.05
SHORT_S = 50e-6
MODES = {"hybrid": WINDOW_S, "plain_blocking": 0.0, "never_stops": math.inf}


class CountingPoll:
    """Wraps a poll function, recording when each call started (relative to the first call, so a stall before the wait
    began shifts nothing), its timeout and EINTRs."""

    def __init__(self, inner: PollFn = poll_fd) -> None:
        self.inner = inner
        self.t0: float | None = None
        self.calls: list[tuple[float, float | None, int]] = []
        self.interrupted = 0

    def __call__(self, fd: int, timeout: float | None, events: int) -> int:
        now = time.monotonic()
        if self.t0 is None:
            self.t0 = now
        started = now - self.t0
        try:
            revents = self.inner(fd, timeout, events)
        except InterruptedError:
            self.interrupted += 1
            raise
        self.calls.append((started, timeout, revents))
        return revents


def _eintr_ends_wait(fd: int, timeout: float | None, events: int) -> int:
    """A wrong poll that reports an interrupted poll as ready (the bug test (c) must catch)."""
    try:
        return poll_fd(fd, timeout, events)
    except InterruptedError:
        return POLLIN


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def _later(delay: float, action: Callable[[], None]) -> threading.Thread:
    """Run `action` on a thread after `delay` seconds, with SIGALRM blocked there so signals reach the waiter."""

    def run() -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(delay)
        action()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _window_then_one_block(calls: list[tuple[float, float | None, int]]) -> bool:
    """Many short polls, all inside the window, then exactly one blocking poll, which found the data."""
    short = [call for call in calls if call[1] == SHORT_S]
    blocking = [call for call in calls if call[1] is None]
    return (
        len(short) >= 5
        and all(started < WINDOW_S + 0.05 for started, _, _ in short)  # slack for a stalled thread; the wrong
        # wait polls until the data arrives, 0.15 s in
        and len(blocking) == 1
        and calls[-1] == blocking[0]
        and bool(blocking[0][2] & POLLIN)
    )


@pytest.mark.parametrize("mode", MODES)
def test_a_short_polls_then_one_blocking_poll_per_wait(mode: str, pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    verdicts = []
    for _ in range(2):  # each wait starts its own window
        poll = CountingPoll()
        sender = _later(0.15, lambda: b.send(b"x"))
        assert wait_readable(a, None, poll_window_s=MODES[mode], poll=poll)
        sender.join()
        assert a.recv(1) == b"x"
        verdicts.append(_window_then_one_block(poll.calls))
    assert verdicts == [mode == "hybrid"] * 2


@pytest.mark.skipif(not hasattr(resource, "RUSAGE_THREAD"), reason="needs per-thread rusage (Linux)")
@pytest.mark.parametrize("mode", MODES)
def test_a_voluntary_context_switches_are_bounded(mode: str, pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    sender = _later(0.5, lambda: b.send(b"x"))
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
    assert wait_readable(a, time.monotonic() + 2.0, poll_window_s=MODES[mode])
    switches = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw - before
    sender.join()
    # Each short poll sleeps at least 50 µs, so the window holds at most 1,000 of them; blocking adds one switch.
    bounded = 5 <= switches <= WINDOW_S / SHORT_S + 10
    assert bounded == (mode == "hybrid"), f"{switches} voluntary context switches"


@pytest.mark.parametrize("mode", MODES)
def test_b_an_idle_wait_goes_back_to_blocking(mode: str, pair: tuple[socket.socket, socket.socket]) -> None:
    a, _ = pair
    poll = CountingPoll()
    cpu = time.thread_time()
    assert not wait_readable(a, time.monotonic() + 1.0, poll_window_s=MODES[mode], poll=poll)
    cpu = time.thread_time() - cpu
    late_polls = sum(1 for started, _, _ in poll.calls if started > 0.1)
    assert (cpu < 0.05 and late_polls == 0) == (mode != "never_stops"), f"{cpu:.4f} s CPU, {late_polls} late polls"


@pytest.fixture
def alarms() -> Iterator[list[int]]:
    """SIGALRM every 10 ms on this (the main) thread while the test runs; yields the list of signals seen."""
    seen: list[int] = []
    previous = signal.signal(signal.SIGALRM, lambda signum, frame: seen.append(signum))
    signal.setitimer(signal.ITIMER_REAL, 0.01, 0.01)
    yield seen
    signal.setitimer(signal.ITIMER_REAL, 0, 0)
    signal.signal(signal.SIGALRM, previous)


def _wait_under_signals(
    a: socket.socket, b: socket.socket, window: float, inner: PollFn
) -> tuple[bool, float, float, CountingPoll]:
    """Wait for data sent after 0.3 s; return (ready, when it returned, when the data was sent, the poll record)."""
    sent_at: list[float] = []
    sender = _later(0.3, lambda: (sent_at.append(time.monotonic()), b.send(b"x")))
    poll = CountingPoll(inner)
    ready = wait_readable(a, time.monotonic() + 1.5, poll_window_s=window, poll=poll)
    returned_at = time.monotonic()
    sender.join()
    return ready, returned_at, sent_at[0], poll


@pytest.mark.parametrize("mode", [*MODES, "eintr_ends_wait"])
def test_c_a_signal_does_not_end_a_wait(
    mode: str, pair: tuple[socket.socket, socket.socket], alarms: list[int]
) -> None:
    a, b = pair
    inner = _eintr_ends_wait if mode == "eintr_ends_wait" else poll_fd
    ready, returned_at, sent_at, poll = _wait_under_signals(a, b, MODES.get(mode, WINDOW_S), inner)
    assert len(alarms) >= 10
    if mode != "eintr_ends_wait":
        assert poll.interrupted >= 1  # the signals did interrupt polls
    assert (ready and returned_at >= sent_at) == (mode != "eintr_ends_wait")


@pytest.mark.parametrize("mode", MODES)
def test_c_a_signal_does_not_end_a_wait_before_its_deadline(
    mode: str, pair: tuple[socket.socket, socket.socket], alarms: list[int]
) -> None:
    a, _ = pair
    poll = CountingPoll()
    deadline = time.monotonic() + 0.3
    assert not wait_readable(a, deadline, poll_window_s=MODES[mode], poll=poll)
    assert time.monotonic() >= deadline
    assert len(alarms) >= 10 and poll.interrupted >= 1


POLLS = {"ppoll": poll_fd, "poll_ms": poll_ms}


@pytest.mark.parametrize("poll", POLLS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("after", [0.02, 0.2])
def test_d_the_deadline_ends_a_wait(
    after: float, mode: str, poll: str, pair: tuple[socket.socket, socket.socket]
) -> None:
    a, _ = pair
    deadline = time.monotonic() + after
    assert not wait_readable(a, deadline, poll_window_s=MODES[mode], poll=POLLS[poll])
    assert deadline <= time.monotonic() < deadline + 0.5


@pytest.mark.parametrize("poll", POLLS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("after", [0.02, 0.15])
def test_e_the_peers_hangup_ends_a_wait(
    after: float, mode: str, poll: str, pair: tuple[socket.socket, socket.socket]
) -> None:
    a, b = pair
    closed_at: list[float] = []
    closer = _later(after, lambda: (closed_at.append(time.monotonic()), b.close()))
    assert wait_readable(a, time.monotonic() + 2.0, poll_window_s=MODES[mode], poll=POLLS[poll])
    returned_at = time.monotonic()
    closer.join()
    assert closed_at[0] <= returned_at < closed_at[0] + 1.0
    with pytest.raises(PeerGone, match="closed the link"):
        recv_frame(a)


def test_data_already_waiting_is_seen_at_a_passed_deadline(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    b.send(b"x")
    assert wait_readable(a, time.monotonic() - 1.0)


def test_a_closed_socket_is_refused() -> None:
    a, b = socket.socketpair()
    a.close()
    b.close()
    with pytest.raises(OSError, match="closed socket"):
        wait_readable(a, None)


def test_the_defaults_are_the_design_figures() -> None:
    parameters = inspect.signature(wait_readable).parameters
    assert parameters["poll_window_s"].default == WINDOW_S
    assert parameters["poll_timeout_s"].default == SHORT_S
