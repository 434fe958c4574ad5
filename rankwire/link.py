"""The control link: one socket between rank 0 and rank 1 that carries the handshake, a header per round and each
rank's verdict on it."""

from __future__ import annotations

import contextlib
import hashlib
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

from rankwire.codec import decode_header, encode_header
from rankwire.errors import FrameError, PeerFailed, PeerGone, SettingsMismatch
from rankwire.frames import Frame, Tag, recv_frame, send_frame
from rankwire.header import RoundPlan
from rankwire.wait import HANGUP, POLLIN, poll_fd, wait_readable

CONNECT_RETRY_S = 0.2
_KEEPALIVE = (("TCP_KEEPIDLE", 5), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", 5))
_UNSET = "(unset)"
_PEEK = socket.MSG_PEEK | socket.MSG_DONTWAIT


class ControlLink:
    """One end of the control link; rank 0 sends round headers, rank 1 receives them."""

    def __init__(self, sock: socket.socket, rank: int) -> None:
        self.sock = sock
        self.rank = rank

    @staticmethod
    def listen(host: str, port: int) -> Listener:
        """Rank 0: listen on (host, port) for rank 1 (port 0 picks a free one)."""
        return Listener(socket.create_server((host, port)))

    @classmethod
    def connect(cls, host: str, port: int, timeout: float) -> ControlLink:
        """Rank 1: connect to rank 0, retrying every 200 ms until `timeout` seconds have passed."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=max(0.001, deadline - time.monotonic()))
            except OSError as exc:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"rank 0 at {host}:{port} did not accept within {timeout} s: {exc}") from exc
                time.sleep(min(CONNECT_RETRY_S, left))
            else:
                return cls(_tune(sock), rank=1)

    def handshake(self, settings: dict[str, Any], timeout: float = 30.0) -> None:
        """Exchange settings with the peer; on any difference both ranks raise SettingsMismatch naming it."""
        ours = _canonical(settings)
        digest = hashlib.sha256(ours).digest()
        send_frame(self.sock, Tag.HELLO, digest + ours)
        frame = self._recv(time.monotonic() + timeout, "HELLO")
        if frame.tag is not Tag.HELLO:
            raise FrameError(f"expected HELLO from rank {1 - self.rank}, got {frame.tag.name}")
        peer_digest, theirs = frame.payload[:32], frame.payload[32:]
        if hashlib.sha256(theirs).digest() != peer_digest:
            raise FrameError(f"rank {1 - self.rank}'s HELLO carries a hash that does not match its settings")
        try:
            canonical = _canonical(json.loads(theirs.decode("ascii"))) == theirs
        except (ValueError, RecursionError):  # not ASCII, not JSON, or nested past the parser's depth
            canonical = False
        if not canonical:
            raise FrameError(f"rank {1 - self.rank}'s HELLO does not carry settings as canonical JSON")
        if peer_digest != digest:
            by_rank = (ours, theirs) if self.rank == 0 else (theirs, ours)
            raise SettingsMismatch(_describe_mismatch(*by_rank))

    def send_header(self, plan: RoundPlan) -> None:
        """Send one round header."""
        send_frame(self.sock, Tag.HEADER, encode_header(plan))

    def recv_header(self, deadline: float | None = None) -> RoundPlan:
        """Wait (hybrid) for the next round header until `deadline`, a time.monotonic() value."""
        frame = self._recv(deadline, "round header")
        if frame.tag is not Tag.HEADER:
            raise FrameError(f"expected a round header from rank {1 - self.rank}, got {frame.tag.name}")
        return decode_header(frame.payload)

    def send_verdict(self, problem: str | None) -> None:
        """Send this rank's verdict on the round at hand: None if it runs the round, else why not."""
        if problem == "":
            raise ValueError("a refusal needs a reason")
        send_frame(self.sock, Tag.VERDICT, (problem or "").encode("utf-8"))

    def recv_verdict(self, deadline: float | None = None) -> str | None:
        """Wait (hybrid) for the peer's verdict on the round at hand until `deadline`: None if it runs the round,
        else its reason."""
        frame = self._recv(deadline, "round verdict")
        if frame.tag is not Tag.VERDICT:
            raise FrameError(f"expected a round verdict from rank {1 - self.rank}, got {frame.tag.name}")
        return frame.payload.decode("utf-8", "replace") or None

    def exchange_verdicts(self, problem: str | None, timeout_s: float) -> str | None:
        """The agreement gate: send this rank's verdict on the round at hand, then wait (hybrid) up to `timeout_s`
        for the peer's: None if the peer runs the round, else its reason."""
        self.send_verdict(problem)
        return self.recv_verdict(time.monotonic() + timeout_s)

    def send_error(self, message: str) -> None:
        """Tell the peer this rank failed (best effort: a peer that is already gone is ignored)."""
        with contextlib.suppress(PeerGone, OSError):
            send_frame(self.sock, Tag.ERROR, message.encode("utf-8"))

    def watch_for_hangup(self) -> bool:
        """Without blocking or consuming a frame, say whether the peer has hung up or died."""
        try:
            events = poll_fd(self.sock.fileno(), 0.0, HANGUP | POLLIN)
            return bool(events & HANGUP) or bool(events & POLLIN and not self.sock.recv(1, _PEEK))
        except (InterruptedError, BlockingIOError):  # a frame taken by the reader between the poll and the peek
            return False
        except ConnectionResetError:
            return True

    def close(self) -> None:
        """Say BYE (best effort) and close the socket, ending a wait on it in another thread (a close alone does not
        wake a poll already waiting)."""
        if self.sock.fileno() < 0:
            return
        with contextlib.suppress(PeerGone, OSError):
            send_frame(self.sock, Tag.BYE)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def __enter__(self) -> ControlLink:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _recv(self, deadline: float | None, what: str) -> Frame:
        """Receive one frame, turning ERROR into PeerFailed, BYE into PeerGone and the deadline into TimeoutError."""
        if not wait_readable(self.sock, deadline):
            raise TimeoutError(f"no {what} from rank {1 - self.rank} by the deadline")
        frame = recv_frame(self.sock, deadline)
        if frame.tag is Tag.ERROR:
            raise PeerFailed(frame.payload.decode("utf-8", "replace"))
        if frame.tag is Tag.BYE:
            raise PeerGone(f"rank {1 - self.rank} closed the link")
        return frame


class Listener:
    """Rank 0's listening socket, which accepts exactly one peer."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    @property
    def port(self) -> int:
        """The port it listens on."""
        return self.sock.getsockname()[1]

    def accept(self, timeout: float) -> ControlLink:
        """Accept rank 1 within `timeout` seconds, then stop listening."""
        self.sock.settimeout(timeout)
        try:
            sock, _ = self.sock.accept()
        except TimeoutError:
            raise TimeoutError(f"rank 1 did not connect to port {self.port} within {timeout} s") from None
        finally:
            self.sock.close()
        return ControlLink(_tune(sock), rank=0)

    def close(self) -> None:
        """Stop listening."""
        self.sock.close()


def _tune(sock: socket.socket) -> socket.socket:
    """Make a connected TCP socket blocking, with TCP_NODELAY and keepalive probes that find a dead host in seconds."""
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in _KEEPALIVE:
        if hasattr(socket, name):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    return sock


def _canonical(settings: dict[str, Any]) -> bytes:
    """Settings as canonical JSON: sorted keys, no spaces, ASCII."""
    return json.dumps(settings, sort_keys=True, separators=(",", ":"), allow_nan=False).encode("ascii")


def _describe_mismatch(rank0: bytes, rank1: bytes) -> str:
    """Name the first setting (in key order) whose canonical value differs between the ranks, with both values."""
    fallback = ("(canonical form)", rank0.decode("ascii"), rank1.decode("ascii"))
    key, value0, value1 = next(_differences(json.loads(rank0), json.loads(rank1), ""), fallback)
    return f"setting {key!r} differs: rank 0 has {value0}, rank 1 has {value1}"


def _differences(first: Any, second: Any, path: str) -> Iterator[tuple[str, str, str]]:
    """Yield (dotted name, first value, second value) as canonical JSON for each differing leaf, in key order."""
    if isinstance(first, dict) and isinstance(second, dict):
        for key in sorted(first.keys() | second.keys()):
            name = f"{path}.{key}" if path else key
            if key in first and key in second:
                yield from _differences(first[key], second[key], name)
            else:
                yield name, _shown(first, key), _shown(second, key)
    elif _canonical(first) != _canonical(second):
        yield path, _canonical(first).decode("ascii"), _canonical(second).decode("ascii")


def _shown(values: dict[str, Any], key: str) -> str:
    """One setting's value as canonical JSON, or a marker if it is unset."""
    return _canonical(values[key]).decode("ascii") if key in values else _UNSET
