"""The side stream: a sub-block's independent work (the shared expert beside the routed experts, QSA's index path
beside its cache writes) runs there, forked from the current stream and joined back before its result is used, so
the two chains of kernels overlap on the GPU. The kernels and their inputs are the same, so the bits are; graphs
capture the fork and the join. Off CUDA, or with FLASHNEXT_OVERLAP=0, everything runs on the current stream."""

from __future__ import annotations

import contextlib
import functools
import os

import torch

OVERLAP_ENV = "FLASHNEXT_OVERLAP"


@functools.cache
def _side(index: int) -> torch.cuda.Stream:
    """CUDA device `index`'s side stream, made once (graphs captured on it replay on any stream)."""
    return torch.cuda.Stream(device=index)


def fork(device: torch.device) -> torch.cuda.Stream | None:
    """The side stream of `device`, made to wait for the work queued so far on the current stream; None where
    nothing overlaps (not CUDA, or FLASHNEXT_OVERLAP=0)."""
    if device.type != "cuda" or os.environ.get(OVERLAP_ENV, "1") == "0":
        return None
    side = _side(device.index if device.index is not None else torch.cuda.current_device())
    side.wait_stream(torch.cuda.current_stream(device))
    return side


def on(side: torch.cuda.Stream | None) -> contextlib.AbstractContextManager[object]:
    """Queue the block's kernels on `side` (the current stream when None)."""
    return torch.cuda.stream(side) if side is not None else contextlib.nullcontext()


def join(side: torch.cuda.Stream | None) -> None:
    """Make the current stream wait for everything queued on `side`; the side's tensors are safe to use after."""
    if side is not None:
        torch.cuda.current_stream(side.device).wait_stream(side)
