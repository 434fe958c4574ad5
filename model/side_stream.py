"""The side stream: a sub-block's independent work (the shared expert beside the routed experts, QSA's index path
beside its query, key and value rows, GDN's gates beside the conv) runs there, forked from the current stream and
joined back before its result is used, so the two chains of kernels overlap on the GPU; a side chain that needs
later work of the current stream too follows it (QSA's top-k waits for the index queries, normed on the current
stream beside the block keys). The kernels and their inputs are the same, so the bits are; graphs capture the fork,
the follow and the join. Off CUDA everything runs on the current stream; FLASHNEXT_OVERLAP picks the sites that
fork: 1 (the default) every one of SITES, 0 none, or a comma-separated list of them."""

from __future__ import annotations

import contextlib
import functools
import os

import torch

OVERLAP_ENV = "FLASHNEXT_OVERLAP"
SITES = ("moe", "qsa", "gdn")  # the shared expert, QSA's index path, GDN's gates


@functools.cache
def parse_sites(value: str) -> frozenset[str]:
    """The sites a FLASHNEXT_OVERLAP value names: 1 all of SITES, 0 none, else a comma-separated list of them (parsed
    once per value: every fork of an eager round asks)."""
    value = value.strip()
    if value in ("1", "0"):
        return frozenset(SITES if value == "1" else ())
    sites = frozenset(name.strip() for name in value.split(",") if name.strip())
    if not sites or not sites <= set(SITES):
        raise ValueError(f"expected 0, 1 or some of {', '.join(SITES)}, got {value!r}")
    return sites


def overlapped_sites() -> frozenset[str]:
    """The sites FLASHNEXT_OVERLAP lets fork (all when it is not set), refused by name when malformed."""
    try:
        return parse_sites(os.environ.get(OVERLAP_ENV, "1"))
    except ValueError as exc:
        raise ValueError(f"{OVERLAP_ENV}: {exc}") from exc


@functools.cache
def _side(index: int) -> torch.cuda.Stream:
    """CUDA device `index`'s side stream, made once (graphs captured on it replay on any stream)."""
    return torch.cuda.Stream(device=index)


def fork(device: torch.device, site: str) -> torch.cuda.Stream | None:
    """The side stream of `device`, made to wait for the work queued so far on the current stream; None where
    nothing overlaps (not CUDA, or `site` not among FLASHNEXT_OVERLAP's)."""
    if device.type != "cuda" or site not in overlapped_sites():
        return None
    side = _side(device.index if device.index is not None else torch.cuda.current_device())
    side.wait_stream(torch.cuda.current_stream(device))
    return side


def follow(side: torch.cuda.Stream | None) -> None:
    """Make `side` wait, too, for the work queued on the current stream since the fork (nothing when None); call it
    on that stream, outside `on(side)`."""
    if side is not None:
        side.wait_stream(torch.cuda.current_stream(side.device))


def on(side: torch.cuda.Stream | None) -> contextlib.AbstractContextManager[object]:
    """Queue the block's kernels on `side` (the current stream when None)."""
    return torch.cuda.stream(side) if side is not None else contextlib.nullcontext()


def join(side: torch.cuda.Stream | None) -> None:
    """Make the current stream wait for everything queued on `side`; the side's tensors are safe to use after."""
    if side is not None:
        torch.cuda.current_stream(side.device).wait_stream(side)
