"""Host values to the device in one copy that does not wait for the GPU: launch tables, draw parameters, inputs."""

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
