"""Outputs made inside longer buffers, so that a store past an output's last element shows as a changed sentinel."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import torch

SENTINEL = -7


@contextmanager
def outputs_with_slack(
    shapes: tuple[tuple[int, ...], ...], tail: int, dtype: torch.dtype | None = None, fill: float = SENTINEL
) -> Iterator[list[torch.Tensor]]:
    """Within: each torch.empty of one of `shapes` (and of `dtype`, if given) is the start of a buffer with `tail`
    elements of `fill` after it (SENTINEL, which `untouched` checks, unless told); yields those tails, in the order
    they were made."""
    real_empty, tails = torch.empty, []

    def empty(*size: object, **kwargs: object) -> torch.Tensor:
        dims = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list)) else size
        if dims not in shapes or (dtype is not None and kwargs.get("dtype") != dtype):
            return real_empty(*size, **kwargs)
        numel = math.prod(dims)
        buf = real_empty(numel + tail, **kwargs).fill_(fill)
        tails.append(buf[numel:])
        return buf[:numel].view(dims)

    with mock.patch.object(torch, "empty", empty):
        yield tails


def untouched(tails: list[torch.Tensor]) -> bool:
    """Whether every tail still holds only the sentinel."""
    return all(torch.equal(t, torch.full_like(t, SENTINEL)) for t in tails)
