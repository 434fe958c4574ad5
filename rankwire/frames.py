"""Frames on a stream socket: `tag: u32 | length: u64 | payload`, little-endian, payload at most 64 MiB."""

from __future__ import annotations

import socket
import struct
from enum import IntEnum
from typing import NamedTuple

from rankwire.errors import FrameError, PeerGone
from rankwire.wait import wait_readable

MAX_PAYLOAD = 64 << 20
_PREFIX = struct.Struct("<IQ")


class Tag(IntEnum):
    """What a frame carries."""

    HELLO = 1  # the sender's settings and their hash
    HEADER = 2  # a round header
    ERROR = 3  # the sender failed: a UTF-8 message
    BYE = 4  # clean shutdown
    VERDICT = 5  # the sender's verdict on the round at hand: empty if it runs it, else why not (UTF-8)


class Frame(NamedTuple):
    """One received frame."""

    tag: Tag
    payload: bytes


def send_frame(sock: socket.socket, tag: Tag, payload: bytes = b"") -> None:
    """Send one frame; raise FrameError for a payload over MAX_PAYLOAD and PeerGone if the peer has hung up."""
    if len(payload) > MAX_PAYLOAD:
        raise FrameError(f"frame payload of {len(payload)} bytes exceeds the {MAX_PAYLOAD}-byte limit")
    try:
        sock.sendall(_PREFIX.pack(Tag(tag), len(payload)) + payload)
    except OSError as exc:  # a hang-up, or the link lost (keepalive's timeout, an unreachable host)
        raise PeerGone(f"peer hung up while a {Tag(tag).name} frame was sent: {exc}") from exc


def recv_frame(sock: socket.socket, deadline: float | None = None) -> Frame:
    """Read exactly one frame, all of it by `deadline` (a time.monotonic() value; None blocks); raise PeerGone at
    EOF, FrameError for a malformed prefix and TimeoutError for a frame unfinished at the deadline."""
    raw_tag, length = _PREFIX.unpack(_recv_exact(sock, _PREFIX.size, "frame prefix", deadline))
    try:
        tag = Tag(raw_tag)
    except ValueError:
        raise FrameError(f"unknown frame tag {raw_tag}") from None
    if length > MAX_PAYLOAD:
        raise FrameError(f"{tag.name} frame announces {length} bytes, over the {MAX_PAYLOAD}-byte limit")
    return Frame(tag, _recv_exact(sock, length, f"{tag.name} payload", deadline))


def _recv_exact(sock: socket.socket, size: int, what: str, deadline: float | None) -> bytes:
    """Read exactly `size` bytes, raising PeerGone if the stream ends first and TimeoutError if `deadline` passes
    while bytes are missing (with a deadline each read takes what has come and waits, hybrid, for the rest)."""
    buf = bytearray()
    flags = 0 if deadline is None else socket.MSG_DONTWAIT
    try:
        while len(buf) < size:
            try:
                chunk = sock.recv(size - len(buf), flags)
            except BlockingIOError:
                if not wait_readable(sock, deadline):
                    raise TimeoutError(
                        f"the {what} stopped after {len(buf)} of {size} bytes and was not whole by the deadline"
                    ) from None
                continue
            if not chunk:
                break
            buf += chunk
    except OSError as exc:
        if exc.errno is None:  # the deadline's own TimeoutError, not the socket's
            raise
        raise PeerGone(f"the link failed while reading the {what}: {exc}") from exc
    if len(buf) < size:
        got = f" after {len(buf)} of {size} bytes" if buf else ""
        raise PeerGone(f"peer closed the link while reading the {what}{got}")
    return bytes(buf)
