"""Frames: `tag: u32 | length: u64 | payload` little-endian, payload at most 64 MiB."""

from __future__ import annotations

import errno
import os
import socket
import struct
import threading
from collections.abc import Iterator

import pytest

from rankwire.errors import FrameError, PeerGone
from rankwire.frames import MAX_PAYLOAD, Frame, Tag, recv_frame, send_frame


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_frames_keep_their_tag_and_payload(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    sent = [Frame(Tag.HELLO, b"hash"), Frame(Tag.HEADER, bytes(range(256))), Frame(Tag.ERROR, "déjà".encode())]
    sent.append(Frame(Tag.BYE, b""))
    for frame in sent:
        send_frame(a, *frame)
    assert [recv_frame(b) for _ in sent] == sent


def test_the_wire_format_is_pinned(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    send_frame(a, Tag.ERROR, b"oops")
    assert b.recv(100) == struct.pack("<IQ", 3, 4) + b"oops"


def test_a_large_frame_arrives_whole(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    payload = bytes(range(256)) * 16384  # 4 MiB: many partial reads
    sender = threading.Thread(target=send_frame, args=(a, Tag.HEADER, payload))
    sender.start()
    assert recv_frame(b) == (Tag.HEADER, payload)
    sender.join()


def test_a_payload_over_64_mib_is_refused_by_length(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    with pytest.raises(FrameError, match=f"{MAX_PAYLOAD + 1} bytes exceeds"):
        send_frame(a, Tag.HEADER, bytes(MAX_PAYLOAD + 1))
    b.sendall(struct.pack("<IQ", Tag.HEADER, 2**40))
    with pytest.raises(FrameError, match=f"announces {2**40} bytes"):
        recv_frame(a)


def test_an_unknown_tag_is_refused(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    b.sendall(struct.pack("<IQ", 77, 0))
    with pytest.raises(FrameError, match="unknown frame tag 77"):
        recv_frame(a)


def test_eof_is_peer_gone_at_a_frame_boundary_or_inside_one(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    b.sendall(struct.pack("<IQ", Tag.HEADER, 10) + b"abc")
    b.close()
    with pytest.raises(PeerGone, match="HEADER payload after 3 of 10 bytes"):
        recv_frame(a)
    c, d = socket.socketpair()
    d.close()
    with pytest.raises(PeerGone, match=r"closed the link while reading the frame prefix$"):
        recv_frame(c)
    c.close()


def test_sending_to_a_closed_peer_is_peer_gone(pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    b.close()
    with pytest.raises(PeerGone, match="HEADER"):
        send_frame(a, Tag.HEADER, b"x")


class LostLink:
    """A socket whose link is lost as keepalive or routing report it: every call raises that OSError."""

    def __init__(self, code: int) -> None:
        self.error = OSError(code, os.strerror(code))

    def recv(self, *_args) -> bytes:
        raise self.error

    def sendall(self, _data: bytes) -> None:
        raise self.error


@pytest.mark.parametrize("code", [errno.ETIMEDOUT, errno.EHOSTUNREACH, errno.ECONNABORTED])
def test_a_lost_link_is_peer_gone_in_either_direction(code: int) -> None:
    """Not only a reset: keepalive's timeout or an unreachable host end the link as the peer's hang-up does, so a
    rank says that its peer went away instead of dying with a traceback."""
    with pytest.raises(PeerGone, match=os.strerror(code)):
        recv_frame(LostLink(code))  # type: ignore[arg-type]
    with pytest.raises(PeerGone, match=os.strerror(code)):
        send_frame(LostLink(code), Tag.HEADER, b"x")  # type: ignore[arg-type]
