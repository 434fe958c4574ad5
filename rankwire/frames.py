"""Frames on a stream socket: `tag: u32 | length: u64 | payload`, little-endian, payload at most 64 MiB."""

from __future__ import annotations

import socket
import struct
from enum import IntEnum
from typing import NamedTuple

from rankwire.errors import FrameError, PeerGone

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
    except (BrokenPipeError, ConnectionResetError) as exc:
        raise PeerGone(f"peer hung up while a {Tag(tag).name} frame was sent: {exc}") from exc


def recv_frame(sock: socket.socket) -> Frame:
    """Read exactly one frame (blocking); raise PeerGone at EOF and FrameError for a malformed prefix."""
    raw_tag, length = _PREFIX.unpack(_recv_exact(sock, _PREFIX.size, "frame prefix"))
    try:
        tag = Tag(raw_tag)
    except ValueError:
        raise FrameError(f"unknown frame tag {raw_tag}") from None
    if length > MAX_PAYLOAD:
        raise FrameError(f"{tag.name} frame announces {length} bytes, over the {MAX_PAYLOAD}-byte limit")
    return Frame(tag, _recv_exact(sock, length, f"{tag.name} payload"))


def _recv_exact(sock: socket.socket, size: int, what: str) -> bytes:
    """Read exactly `size` bytes, raising PeerGone if the stream ends first."""
    try:
        chunk = sock.recv(size)
        if len(chunk) == size:
            return chunk
        buf = bytearray(chunk)
        while chunk and len(buf) < size:
            chunk = sock.recv(size - len(buf))
            buf += chunk
    except ConnectionResetError as exc:
        raise PeerGone(f"peer reset the link while reading the {what}") from exc
    if len(buf) < size:
        got = f" after {len(buf)} of {size} bytes" if buf else ""
        raise PeerGone(f"peer closed the link while reading the {what}{got}")
    return bytes(buf)
