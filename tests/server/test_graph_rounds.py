"""Served rounds through the captured graphs equal eager rounds: prompt chunks keeping cache states, verify windows
and their restores, MTP drafts. Under the Triton interpreter a replay runs its bucket's body eagerly, but writes the
graphs' shared output buffers, so the runner's order of reads and writes is what this checks."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import torch
from make_checkpoint import make_checkpoint

from model import kernel_path
from model.weights import load_model
from rankwire.header import DrawSpec
from tests.server import engine_harness
from tests.tiny import KERNEL_TEXT, text_config

PROMPTS = [[7, 19, 5, 33, 2, 91, 8, 13, 21, 60, 17, 4]]  # more rows than the largest verify graph: a prompt graph
DRAWS = [DrawSpec(0.9, 8, 0.9, 0.0, 1234)]


def states(lane) -> list[torch.Tensor]:
    """A kept lane's GDN recurrent states and conv tails and PLE conv tails, in layer order."""
    return [t for name in ("gdn_recurrent", "gdn_conv", "ple_conv") for _, t in sorted(getattr(lane, name).items())]


def test_rounds_through_graphs_give_the_eager_rounds_tokens_drafts_and_kept_states(tmp_path) -> None:
    path = make_checkpoint(text_config("base", **KERNEL_TEXT), tmp_path, fmt="bf16")

    def serve(graphs: bool):
        model = load_model(path, "cpu", "bfloat16", kernels="on")
        if graphs:
            kernel_path.lane_pool(model, slots=4, context=64)
            rows = {"trunk": 16, "verify": 8, "prompt": 16, "mtp": 16}
            kernel_path.enable_graphs(model, rows, listed_logits=8)
        tokens, runner = engine_harness.run(model, PROMPTS, 3, DRAWS, depth=2, budget=16, cache_grid=4)
        kept = {handle: (lane.length, states(lane)) for handle, lane in runner.kept.items()}
        return tokens, runner.rounds, kept, model.round_graphs

    tokens, rounds, kept, _ = serve(False)
    got_tokens, got_rounds, got_kept, graphs = serve(True)
    assert graphs.replays["prompt"] >= 1 and graphs.replays["verify"] >= 1 and graphs.replays["mtp"] >= 1
    assert len(kept) >= 3  # the grid's and the last-but-one keeps, read after the round's MTP pass
    # rounds with rows (a last round that only frees the lane runs or not, as the engine stops before it or after)
    assert got_tokens == tokens and [r for r in got_rounds if r] == [r for r in rounds if r]
    assert got_kept.keys() == kept.keys()
    for handle, (length, tensors) in kept.items():
        assert got_kept[handle][0] == length
        assert all(torch.equal(a, b) for a, b in zip(got_kept[handle][1], tensors, strict=True)), handle
