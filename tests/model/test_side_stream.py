"""The side stream: nothing forks off CUDA or with FLASHNEXT_OVERLAP=0; on a GPU, the kernel path's rounds give the
same bits with the shared expert and QSA's index path beside the main chain as without, eager (graphs replay them in
`scripts/gpu_graph_check.py` and the served checks)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from model import side_stream
from model.flashnext import single_lane_batch
from model.layers import ForwardBatch, Segment
from model.shipped import SHIPPED_MODEL
from model.weights import load_model

PROMPT = [7, 19, 5, 33, 2, 91, 5, 44, 12, 60, 3, 17]
gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels"
)


def test_nothing_forks_off_cuda_or_where_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert side_stream.fork(torch.device("cpu"), "moe") is None
    monkeypatch.setenv(side_stream.OVERLAP_ENV, "0")
    assert side_stream.fork(torch.device("cuda", 0), "moe") is None
    monkeypatch.setenv(side_stream.OVERLAP_ENV, "qsa, gdn")
    assert side_stream.fork(torch.device("cuda", 0), "moe") is None
    assert side_stream.overlapped_sites() == {"qsa", "gdn"}
    side_stream.join(None)
    with side_stream.on(None):
        pass


def test_the_overlap_setting_names_its_sites(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(side_stream.OVERLAP_ENV, raising=False)
    assert side_stream.overlapped_sites() == set(side_stream.SITES)
    monkeypatch.setenv(side_stream.OVERLAP_ENV, "moe,shared")
    with pytest.raises(
        ValueError, match=r"^FLASHNEXT_OVERLAP: expected 0, 1 or some of moe, qsa, gdn, got 'moe,shared'"
    ):
        side_stream.overlapped_sites()


def rounds(model, overlap: str, monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Logits of a prompt then four decode rows of one lane, with FLASHNEXT_OVERLAP set to `overlap`."""
    monkeypatch.setenv(side_stream.OVERLAP_ENV, overlap)
    lane = model.new_lane()
    out = [model(single_lane_batch(lane, torch.tensor(PROMPT, device="cuda"), 0)).logits]
    for step in range(4):
        token = int(out[-1][-1].float().argmax())
        at = torch.tensor([len(PROMPT) + step], device="cuda")
        batch = ForwardBatch(torch.tensor([token], device="cuda"), at, [Segment(lane, 0, 1)])
        out.append(model(batch).logits)
    return [o.clone() for o in out]


@gpu
@pytest.mark.gpu
def test_rounds_beside_equal_rounds_on_one_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_model(SHIPPED_MODEL, device="cuda", dtype="bfloat16", kernels="on")
    alone = rounds(model, "0", monkeypatch)
    beside = rounds(model, "1", monkeypatch)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(alone, beside, strict=True))
