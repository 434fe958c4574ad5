"""On a GPU, a drafted round waits for the GPU only where the host needs a value: torch.cuda's sync debug mode finds
no synchronizing call in the verify forward (a graph replay) and one in the MTP chain, its single copy of the
drafts, so the chain's steps are launched back to back."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import contextlib

import pytest
import torch
from make_checkpoint import make_checkpoint

from model import kernel_path
from model.weights import load_model
from rankwire.header import DrawSpec, LaneRows, RoundPlan
from server.runner import ModelRunner
from tests.tiny import KERNEL_TEXT, text_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels"),
]
GREEDY = DrawSpec(0.0, 0, 1.0, 0.0, 1)


@contextlib.contextmanager
def syncs_refused():
    """torch.cuda's sync debug mode at "error": any call that makes the host wait for the GPU raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_the_verify_forward_never_waits_and_the_mtp_chain_waits_once(tmp_path, monkeypatch) -> None:
    path = make_checkpoint(text_config("base", **KERNEL_TEXT), tmp_path, fmt="bf16")
    model = load_model(path, "cuda", "bfloat16", kernels="on")
    kernel_path.lane_pool(model, slots=4, context=64)
    graphs = kernel_path.enable_graphs(model, {"trunk": 8, "verify": 8, "prompt": 16, "mtp": 8}, listed_logits=8)
    runner = ModelRunner(model, 2)
    copies: list[int] = []
    forward, draft, tolist = type(model).forward, ModelRunner._draft, torch.Tensor.tolist

    def refusing_forward(self, *args, **kwargs):
        with syncs_refused():
            return forward(self, *args, **kwargs)

    def counted_tolist(self):
        """The chain's one read: counted, with the debug mode off while it waits."""
        copies.append(self.numel())
        torch.cuda.set_sync_debug_mode("default")
        try:
            return tolist(self)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    def refusing_draft(self, *args):
        with syncs_refused(), pytest.MonkeyPatch.context() as reads:
            reads.setattr(torch.Tensor, "tolist", counted_tolist)
            return draft(self, *args)

    rows = [LaneRows(i, p, 0, GREEDY, draft_depth=3) for i, p in enumerate([(7, 19, 40, 33, 2), (91, 12, 44)])]
    plan = RoundPlan(allocate=(0, 1), rows=tuple(rows))
    replays = 0
    for round_index in range(5):
        if round_index == 2:  # the kernels are compiled and the pool placed: from here every round is watched
            monkeypatch.setattr(type(model), "forward", refusing_forward)
            monkeypatch.setattr(ModelRunner, "_draft", refusing_draft)
            replays = graphs.replays["verify"]
        copies.clear()
        results = runner.execute(plan)
        if round_index >= 2:
            assert copies == [6]  # both lanes' three drafts, in one copy
        plan = RoundPlan(
            rows=tuple(
                LaneRows(i, r.tokens[-1:], rows.start + len(rows.token_ids) + len(r.tokens) - 1, GREEDY, r.drafts, 3)
                for i, (r, rows) in enumerate(zip(results, plan.rows, strict=True))
            )
        )
    assert graphs.replays["verify"] - replays == 3  # the watched forwards were replays of the verify graph
