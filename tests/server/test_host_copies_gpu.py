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


BIAS = ((5, 2.5), (40, -100.0), (91, 4.0))
ALLOWED = tuple(range(0, 200, 3))


@pytest.mark.parametrize(
    "draw",
    [
        GREEDY,
        DrawSpec(0.9, 20, 0.95, 0.0, 7),
        DrawSpec(0.0, 0, 1.0, 0.0, 1, BIAS),
        DrawSpec(0.9, 20, 0.95, 0.0, 7, BIAS, logprobs=5),
        DrawSpec(0.9, 20, 0.95, 0.0, 7, BIAS, repetition_penalty=1.3, presence_penalty=0.25, allowed_ids=ALLOWED),
    ],
    ids=["greedy", "sampled", "greedy-biased", "sampled-biased-logprobs", "sampled-penalized-allowed"],
)
def test_a_round_planned_ahead_is_launched_without_waiting_and_draws_the_same_tokens(tmp_path, draw) -> None:
    """...and takes the same logprobs: a round's are computed before the next round's forward rewrites the logits;
    penalties count a prior draw's token on the device."""
    path = make_checkpoint(text_config("base", **KERNEL_TEXT), tmp_path, fmt="bf16")
    model = load_model(path, "cuda", "bfloat16", kernels="on")
    kernel_path.lane_pool(model, slots=4, context=64)
    kernel_path.enable_graphs(model, {"trunk": 8, "verify": 8, "prompt": 16, "mtp": 8}, listed_logits=8)
    prompts = [(7, 19, 40, 33, 2), (91, 12, 44)]
    first = RoundPlan(allocate=(0, 1), rows=tuple(LaneRows(i, p, 0, draw) for i, p in enumerate(prompts)))
    in_turn, ahead = ModelRunner(model, 2), ModelRunner(model, 2)
    expected = [[(r.tokens, r.logprobs)] for r in in_turn.execute(first)]
    for step in range(5):
        rows = [
            LaneRows(i, e[-1][0][-1:], len(p) + step, draw)
            for i, (p, e) in enumerate(zip(prompts, expected, strict=True))
        ]
        for each, result in zip(expected, in_turn.execute(RoundPlan(rows=tuple(rows))), strict=True):
            each.append((result.tokens, result.logprobs))
    got, pending = [[], []], ahead.launch(first)
    for step in range(5):
        rows = tuple(LaneRows(i, (0,), len(p) + step, draw, prior_draw=True) for i, p in enumerate(prompts))
        if step >= 2:  # compiled and placed: from here each launch is watched
            with syncs_refused():
                launched = ahead.launch(RoundPlan(rows=rows))
        else:
            launched = ahead.launch(RoundPlan(rows=rows))
        for each, result in zip(got, ahead.finish(pending), strict=True):
            each.append((result.tokens, result.logprobs))
        pending = launched
    for each, result in zip(got, ahead.finish(pending), strict=True):
        each.append((result.tokens, result.logprobs))
    assert got == expected
    assert all(len(lps) == (len(tokens) if draw.logprobs is not None else 0) for e in got for tokens, lps in e)


def test_finishing_a_round_waits_for_its_own_draws_not_for_the_round_launched_after_it(tmp_path) -> None:
    """A round planned ahead is launched before the one before it is finished; that finish reads its draws through
    their own copy, so it returns while the GPU still runs what was queued after (here a one-second sleep)."""
    path = make_checkpoint(text_config("base", **KERNEL_TEXT), tmp_path, fmt="bf16")
    model = load_model(path, "cuda", "bfloat16", kernels="on")
    kernel_path.lane_pool(model, slots=4, context=64)
    runner = ModelRunner(model, 2)
    prompts = [(7, 19, 40, 33, 2), (91, 12, 44)]
    first = runner.execute(
        RoundPlan(allocate=(0, 1), rows=tuple(LaneRows(i, p, 0, GREEDY) for i, p in enumerate(prompts)))
    )
    rows = [LaneRows(i, r.tokens, len(p), GREEDY) for i, (p, r) in enumerate(zip(prompts, first, strict=True))]
    launched = runner.launch(RoundPlan(rows=tuple(rows)))
    follows = [LaneRows(i, (0,), len(p) + 1, GREEDY, prior_draw=True) for i, p in enumerate(prompts)]
    ahead = runner.launch(RoundPlan(rows=tuple(follows)))
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU clock cycles, queued after the round planned ahead
    slept = torch.cuda.Event()
    slept.record()
    tokens = [result.tokens for result in runner.finish(launched)]
    assert not slept.query()  # the finish did not wait for the work launched after its round
    torch.cuda.synchronize()
    assert all(len(t) == 1 for t in tokens) and len(runner.finish(ahead)) == 2
