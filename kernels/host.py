"""Host values to the device in one copy that does not wait for the GPU: launch tables and draw parameters."""

from __future__ import annotations

import torch


def to_device(device: torch.device, values: list, dtype: torch.dtype) -> torch.Tensor:
    """A host list (of rows, or flat) as a tensor on `device`, copied from pinned memory without waiting for the GPU
    on CUDA (the pinned block is kept until its copy has run); the tensor itself elsewhere."""
    table = torch.tensor(values, dtype=dtype)
    return table.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else table
