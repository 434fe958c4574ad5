"""Host values to the device in one copy that does not wait for the GPU (launch tables, draw parameters, inputs), and
device values back to the host in one copy that waits only for itself (draws)."""

from __future__ import annotations

import torch


def to_device(device: torch.device, values: list | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A host list (of rows, or flat) or a tensor as a tensor on `device`, a host one copied from pinned memory
    without waiting for the GPU on CUDA (the pinned block is kept until its copy has run); the host tensor itself
    elsewhere."""
    if isinstance(values, torch.Tensor) and values.device.type != "cpu":
        return values.to(device=device, dtype=dtype)
    table = torch.as_tensor(values, dtype=dtype)
    return table.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else table


def copy_in(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) without waiting for the GPU: a host source reaches a CUDA destination through pinned memory
    (a copy from pageable memory waits for the stream to drain first)."""
    if src.device.type == "cpu" and dst.device.type == "cuda":
        src = src.pin_memory()
    dst.copy_(src, non_blocking=True)


class HostCopy:
    """A tensor's copy to the host, started without waiting for the GPU (into pinned memory, with an event after it),
    so reading it waits only for the work queued before it, not for what was launched since."""

    def __init__(self, source: torch.Tensor) -> None:
        self.ready: torch.cuda.Event | None = None
        if source.device.type != "cuda":
            self.host = source
            return
        self.host = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
        self.host.copy_(source, non_blocking=True)
        self.ready = torch.cuda.Event()
        self.ready.record(torch.cuda.current_stream(source.device))

    def tolist(self) -> list:
        """The values, once the copy has run."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()
