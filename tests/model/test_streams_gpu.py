"""`beside` on a GPU: the side stream starts after the work queued before it, and work queued after waits for it."""

from __future__ import annotations

import os

import pytest
import torch

from model.kernel_blocks import beside

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1", reason="needs CUDA"),
]
SPIN = 200_000_000  # GPU cycles the stream before the fork (or the side stream) spins first: far longer than a launch


def test_the_side_work_sees_what_was_queued_before_it_and_the_main_stream_sees_its_result() -> None:
    """A write queued behind a long spin is read whole by the side work; a side write queued behind a spin is read whole
    by work queued on the main stream after the join."""
    device = torch.device("cuda")
    before = torch.zeros(1 << 20, device=device)
    torch.cuda._sleep(SPIN)
    before.fill_(3.0)

    def side() -> tuple[torch.Tensor, torch.Tensor]:
        seen = before.sum()
        torch.cuda._sleep(SPIN)
        return seen, before.add(1.0)

    (seen, written), main_out = beside(side, lambda: before.mul(2.0), device)
    after = written.sum()
    assert seen.item() == 3.0 * before.numel()
    assert after.item() == 4.0 * before.numel()
    assert main_out.sum().item() == 6.0 * before.numel()
