"""The hybrid link wait: poll with a 50 µs timeout for the first 50 ms of a wait, then block."""

from __future__ import annotations

import ctypes
import errno
import math
import os
import select
import socket
import time
from collections.abc import Callable

POLLIN = select.POLLIN
POLLRDHUP = getattr(select, "POLLRDHUP", 0)
HANGUP = select.POLLHUP | select.POLLERR | select.POLLNVAL | POLLRDHUP

PollFn = Callable[[int, float | None, int], int]


class _PollFd(ctypes.Structure):
    """struct pollfd."""

    _fields_ = (("fd", ctypes.c_int), ("events", ctypes.c_short), ("revents", ctypes.c_short))


class _Timespec(ctypes.Structure):
    """struct timespec."""

    _fields_ = (("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long))


_libc = ctypes.CDLL(None, use_errno=True)


def _ppoll(fd: int, timeout_s: float | None, events: int = POLLIN) -> int:
    """One ppoll(2) of `fd` with nanosecond resolution; return revents (0 on timeout), InterruptedError on EINTR."""
    entry = _PollFd(fd, events, 0)
    timespec = None if timeout_s is None else ctypes.byref(_Timespec(*divmod(max(0, round(timeout_s * 1e9)), 10**9)))
    if _libc.ppoll(ctypes.byref(entry), 1, timespec, None) < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return entry.revents


def poll_ms(fd: int, timeout_s: float | None, events: int = POLLIN) -> int:
    """One poll(2) of `fd` where ppoll is missing (timeouts round up to whole milliseconds); return revents."""
    poller = select.poll()
    poller.register(fd, events)
    ready = poller.poll(None if timeout_s is None else timeout_s * 1e3)
    return ready[0][1] if ready else 0


if hasattr(_libc, "ppoll"):
    _libc.ppoll.argtypes = (ctypes.POINTER(_PollFd), ctypes.c_ulong, ctypes.POINTER(_Timespec), ctypes.c_void_p)
    _libc.ppoll.restype = ctypes.c_int
    poll_fd: PollFn = _ppoll
else:
    poll_fd = poll_ms


def wait_readable(
    sock: socket.socket,
    deadline: float | None = None,
    poll_window_s: float = 0.05,
    poll_timeout_s: float = 50e-6,
    poll: PollFn = poll_fd,
) -> bool:
    """Wait until `sock` is readable or hung up (True) or `deadline`, a time.monotonic() value, passes (False);
    an infinite deadline is none."""
    if deadline is not None and math.isnan(deadline):
        raise ValueError("deadline: NaN is no time")
    if deadline == math.inf:
        deadline = None
    fd = sock.fileno()
    if fd < 0:
        raise OSError(errno.EBADF, "wait on a closed socket")
    window_end = time.monotonic() + poll_window_s
    while True:
        now = time.monotonic()
        timeout = None if deadline is None else max(0.0, deadline - now)  # the blocking poll's
        if now < window_end:
            timeout = poll_timeout_s if timeout is None else min(poll_timeout_s, timeout)
        try:
            if poll(fd, timeout, POLLIN):
                return True
        except InterruptedError:
            pass  # an interrupted poll counts as an empty one
        if deadline is not None and time.monotonic() >= deadline:
            return False
