"""Zeroed int32 words that kernels leave zero: arrival counters (a last-arriving program adds range sums in a fixed
order) and the QSA indexer's histograms."""

from __future__ import annotations

import torch


class CounterPool:
    """Zeroed int32 words per (device, stream), `size` of them; every launch that uses them leaves them zero.
    Graphs captured on one stream share a set, so such graphs must be replayed on one stream."""

    def __init__(self, size: int, owner: str, what: str) -> None:
        self.size, self.owner, self.what = size, owner, what
        self.sets: dict[tuple[str, int], torch.Tensor] = {}

    def get(self, device: torch.device, needed: int) -> torch.Tensor:
        """The words of the current stream of `device`, refusing a call that needs more than the pool holds."""
        if needed > self.size:
            raise ValueError(f"{self.owner}: {needed} {self.what} exceed the {self.size} words of its zeroed pool")
        stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
        key = (str(device), stream)
        if key not in self.sets:
            self.sets[key] = torch.zeros(self.size, dtype=torch.int32, device=device)
        return self.sets[key]
