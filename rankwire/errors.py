"""The control link's errors."""

from __future__ import annotations


class LinkError(Exception):
    """Something went wrong on the control link."""


class FrameError(LinkError):
    """A frame that breaks the wire format (unknown tag, too long, unexpected where it came)."""


class PeerGone(LinkError):
    """The peer hung up, died, or said goodbye."""


class PeerFailed(LinkError):
    """The peer reported that it failed; the message is the peer's own."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class SettingsMismatch(LinkError):
    """The two ranks were started with different settings."""
