"""Prompt passes stop short of a prompt's end, and keep states, only at multiples of the runner's alignment (the GDN
chunk on the kernels), so a prompt's chunks are the same however its passes were cut or resumed."""

from __future__ import annotations

from model.weights import load_model
from rankwire.header import DrawSpec, LaneOpCode
from server.engine import Engine, Request
from server.prompt_cache import PromptCache
from tests.server.engine_harness import Outcome, RecordingRunner
from tests.tiny import checkpoint

GREEDY = DrawSpec(0.0, 0, 1.0, 0.0, 1)
ALIGN = 8


class AlignedRunner(RecordingRunner):
    """The reference forward, asking the engine for passes aligned as the kernels' chunks would be."""

    @property
    def prompt_align(self) -> int:
        return ALIGN


def serve_together(runner: RecordingRunner, prompts: list[list[int]], budget: int, keep_at=()) -> list[Outcome]:
    """Serve the prompts at once with a prompt cache on a grid of 12 (not a multiple of ALIGN)."""
    engine = Engine(runner, context=256, prompt_budget=budget, prompt_cache=PromptCache(1 << 30), cache_grid=12)
    outcomes = [Outcome() for _ in prompts]
    engine.start()
    try:
        for i, (prompt, outcome) in enumerate(zip(prompts, outcomes, strict=True)):
            engine.submit(Request(f"r{i}", prompt, 3, GREEDY, frozenset(), outcome.sink, keep_at=keep_at))
        assert all(outcome.done.wait(120) for outcome in outcomes), "a request did not finish"
    finally:
        engine.stop()
    return outcomes


def prompt_passes(runner: RecordingRunner, lengths: dict[int, int]) -> list[tuple[int, int, int]]:
    """(slot, first position, end position) of every prompt pass the runner ran."""
    return [
        (rows.slot, rows.start, rows.start + len(rows.token_ids))
        for plan in runner.plans
        for rows in plan.rows
        if rows.start < lengths[rows.slot]
    ]


def test_passes_cut_by_the_budget_stop_at_the_alignment_and_keeps_sit_on_it(tmp_path) -> None:
    model = load_model(checkpoint(tmp_path / "m"), dtype="float32")
    prompts = [[(7 * i) % 50 + 3 for i in range(45)], [(11 * i) % 50 + 3 for i in range(30)]]
    runner = AlignedRunner(model, 2)
    outcomes = serve_together(runner, prompts, budget=20, keep_at=(21,))
    lengths = {0: 45, 1: 30}
    passes = prompt_passes(runner, lengths)
    assert {slot for slot, _, _ in passes} == {0, 1}
    for slot, first, end in passes:
        assert first % ALIGN == 0, f"a pass of lane {slot} starts at {first}"
        assert end == lengths[slot] or end % ALIGN == 0, f"a pass of lane {slot} stops at {end}"
    kept = [
        rows.start + op.after
        for plan in runner.plans
        for op in plan.ops
        if op.code is LaneOpCode.KEEP
        for rows in plan.rows
        if rows.slot == op.slot
    ]
    assert kept and all(position % ALIGN == 0 for position in kept), kept
    # the reference forward is exact wherever a pass stops: the aligned engine serves the tokens the plain one does
    plain = serve_together(RecordingRunner(model, 2), prompts, budget=20, keep_at=(21,))
    assert [o.tokens for o in outcomes] == [o.tokens for o in plain]


def test_a_budget_under_the_alignment_cuts_passes_anywhere(tmp_path) -> None:
    model = load_model(checkpoint(tmp_path / "m"), dtype="float32")
    runner = AlignedRunner(model, 1)
    serve_together(runner, [[(5 * i) % 40 + 3 for i in range(20)]], budget=ALIGN - 2)
    ends = [end for _, _, end in prompt_passes(runner, {0: 20})]
    assert ends[:2] == [ALIGN - 2, 2 * (ALIGN - 2)]
