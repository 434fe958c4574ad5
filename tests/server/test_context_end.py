"""A drafting lane near the end of the context: its MTP chain drafts no row past the context, so the kernel path's
lane pool, sized for the context, never grows (which would double its memory and make every captured graph stale)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

from make_checkpoint import make_checkpoint

from model import kernel_path
from model.weights import load_model
from rankwire.header import DrawSpec
from server.drafters import ScriptedDrafter
from server.engine import Engine, Request
from tests.server.engine_harness import Outcome, RecordingRunner, run
from tests.tiny import KERNEL_TEXT, checkpoint, text_config

PROMPT = [7, 19, 40, 33, 2, 91, 12, 44]
GREEDY = DrawSpec(0.0, 0, 1.0, 0.0, 1)


class MtpReach(RecordingRunner):
    """Records how far each round's MTP layer reached in any lane (its cache's length)."""

    def __init__(self, model, max_lanes: int) -> None:
        super().__init__(model, max_lanes)
        self.reach = 0

    def finish(self, launched, tokens_known=None):
        results = super().finish(launched, tokens_known)
        self.reach = max([self.reach, *(lane.mtp_length for lane in self.slots if lane is not None)])
        return results


def serve_to_the_context_end(model, context: int, prompt: list[int], drafter=None) -> tuple[Outcome, MtpReach]:
    """One greedy drafting request whose prompt and max_tokens fill the context."""
    runner = MtpReach(model, 1)
    engine = Engine(runner, context=context, prompt_budget=64, draft_depth=3, drafter=drafter)
    outcome = Outcome()
    engine.submit(Request("r", prompt, context - len(prompt), GREEDY, frozenset(), outcome.sink))
    engine.start()
    try:
        assert outcome.done.wait(120)
    finally:
        engine.stop()
    return outcome, runner


def test_drafts_kept_to_the_context_end_chain_no_mtp_row_past_it(tmp_path) -> None:
    model = load_model(checkpoint(tmp_path / "m"), dtype="float32")
    (reference,), _ = run(model, [PROMPT], 16, [GREEDY], draft=False)

    def script(history, wanted):  # every draft is the target's own token: the depth stays at 3 to the end
        done = len(history) - len(PROMPT)
        return tuple(reference[done : done + wanted])

    outcome, runner = serve_to_the_context_end(model, 24, PROMPT, ScriptedDrafter(script))
    assert outcome.finish == "length" and outcome.tokens == reference
    assert runner.reach <= 24


def test_a_prompt_one_short_of_the_context_leaves_the_lane_pool_as_sized(tmp_path) -> None:
    model = load_model(
        make_checkpoint(text_config("base", **KERNEL_TEXT), tmp_path, fmt="bf16"), "cpu", "bfloat16", kernels="on"
    )
    pool = kernel_path.lane_pool(model, slots=1, context=32)
    outcome, runner = serve_to_the_context_end(model, 32, [*PROMPT] * 3 + PROMPT[:-1])
    assert outcome.finish == "length" and len(outcome.tokens) == 1
    assert runner.reach <= 32 and (pool.context, pool.generation) == (32, 0)
