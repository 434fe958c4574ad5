"""Repetition, frequency and presence penalties: vLLM's arithmetic on the ids a lane folded before each draw, and the
contracts around it: drafted = undrafted, planned ahead = in turn, concurrent = solo."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model.weights import load_model
from rankwire.header import DrawSpec, LaneRows, RoundPlan
from server.drafters import MtpDrafter, ScriptedDrafter
from server.penalties import LaneHistories
from server.runner import ModelRunner, RoundRefused
from tests.server.engine_harness import run
from tests.tiny import checkpoint

PROMPT = [7, 19, 40, 33, 2, 91, 12, 44, 8, 13]
GREEDY = DrawSpec(0.0, 0, 1.0, 0.0, 1)
SAMPLED = DrawSpec(0.9, 40, 0.95, 0.0, 4321)


def penalized(draw: DrawSpec, prompt: list[int] = PROMPT, **penalties: float) -> DrawSpec:
    values = {"repetition_penalty": 1.4, "frequency_penalty": 0.6, "presence_penalty": 0.3} | penalties
    return dataclasses.replace(draw, output_from=len(prompt), **values)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(checkpoint(tmp_path_factory.mktemp("penalties") / "m"), dtype="float32")


def by_hand(logits: torch.Tensor, before: list[int], output_from: int, spec: DrawSpec) -> torch.Tensor:
    """One row penalized element by element, as vLLM's sampler does it, from the ids folded before the draw."""
    out = logits.clone()
    output = before[output_from:]
    for token in range(logits.shape[0]):
        value = out[token]
        if token in before and spec.repetition_penalty != 1.0:
            value = value / spec.repetition_penalty if value > 0 else value * spec.repetition_penalty
        count = output.count(token)
        value = value - spec.frequency_penalty * torch.tensor(float(count))
        out[token] = value - spec.presence_penalty * torch.tensor(float(count > 0))
    return out


def test_each_row_counts_the_ids_before_its_position_drafts_included():
    """A verify window's row after k drafts counts those drafts as output; a rejected draft is taken back before the
    next round; repetition reaches the prompt's ids, frequency and presence only the output's."""
    spec = penalized(GREEDY, [3, 4, 4, 5, 6], repetition_penalty=1.5, frequency_penalty=0.75, presence_penalty=0.5)
    output_only = dataclasses.replace(spec, repetition_penalty=1.0)
    histories = LaneHistories(2)
    histories.allocate(0)
    histories.fold(LaneRows(0, (3, 4, 4, 5, 6), 0, spec))
    window = LaneRows(0, (7,), 5, spec, drafts=(7, 4))
    assert histories.problem(window) is None
    histories.fold(window)
    logits = torch.randn(4, 10) * 3
    keys = [(0, spec, 6), (0, spec, 7), (0, spec, 8), (0, output_only, 8)]
    out = histories.penalties(keys, torch.device("cpu")).apply(logits)
    history = [3, 4, 4, 5, 6, 7, 7, 4]
    for row, (_, draw, position) in enumerate(keys):
        assert torch.equal(out[row], by_hand(logits[row], history[:position], 5, draw)), row
    assert torch.equal(out[3, :4], logits[3, :4])  # prompt-only ids: no repetition penalty asked for
    histories.cut(0, 7)  # the draft 4 was rejected: the next round writes the kept token at 7
    nxt = LaneRows(0, (9,), 7, spec)
    assert histories.problem(nxt) is None
    histories.fold(nxt)
    again = histories.penalties([(0, spec, 8)], torch.device("cpu")).apply(logits[:1])
    assert torch.equal(again[0], by_hand(logits[0], [3, 4, 4, 5, 6, 7, 7, 9], 5, spec))


def test_kept_states_carry_their_ids_and_a_lane_after_an_unseen_draw_refuses_penalties():
    histories = LaneHistories(2)
    histories.allocate(0)
    histories.fold(LaneRows(0, (5, 6, 7, 8), 0, None))
    histories.keep(0, 11, length=3)
    histories.allocate(1)
    histories.restore(1, 11)
    assert list(histories.slots[1]) == [5, 6, 7]
    histories.fold(LaneRows(1, (9,), 3, None))
    assert list(histories.kept[11]) == [5, 6, 7]  # the restored lane writes into its own copy
    histories.fold(LaneRows(0, (0,), 4, GREEDY, prior_draw=True))
    problem = histories.problem(LaneRows(0, (1,), 5, penalized(GREEDY)))
    assert problem is not None and "planned ahead" in problem
    assert histories.problem(LaneRows(0, (1,), 5, GREEDY)) is None  # an unpenalized draw needs no ids


def test_a_penalized_row_after_a_prior_draw_is_refused_before_the_forward(model):
    runner = ModelRunner(model, 1)
    spec = penalized(GREEDY)
    runner.execute(RoundPlan(allocate=(0,), rows=(LaneRows(0, tuple(PROMPT), 0, spec),)))
    with pytest.raises(RoundRefused, match="penalties"):
        runner.execute(RoundPlan(rows=(LaneRows(0, (0,), len(PROMPT), spec, prior_draw=True),)))


@pytest.mark.parametrize("draw", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_penalties_change_the_draws_and_drafted_equals_undrafted(model, draw):
    """Scripted drafts that are right, then wrong at every place in turn, reach every accept length; the penalized
    tokens equal the undrafted ones, and differ from the unpenalized."""
    spec = penalized(draw)
    (plain,), _ = run(model, [PROMPT], 40, [draw], draft=False)
    (reference,), _ = run(model, [PROMPT], 40, [spec], draft=False)
    assert reference != plain
    calls = []

    def script(history, wanted):
        done = len(history) - len(PROMPT)
        proposal = list(reference[done : done + wanted])
        wrong = len(calls) % 4
        calls.append(done)
        if wrong < len(proposal):
            proposal[wrong] = (proposal[wrong] + 1) % model.cfg.vocab_size
        return tuple(proposal)

    (scripted,), runner = run(model, [PROMPT], 40, [spec], drafter=ScriptedDrafter(script))
    assert scripted == reference
    assert {r.accepted for results in runner.rounds for r in results if r.tokens} == {0, 1, 2, 3}
    (mtp,), _ = run(model, [PROMPT], 40, [spec], drafter=MtpDrafter())
    assert mtp == reference


def test_a_penalized_request_is_not_planned_ahead_and_equals_its_run_in_turn_beside_others(model):
    """Rounds planned ahead take a lane's token on the device, where its penalties cannot count it: a round with a
    penalized lane is finished before the next is planned, and its tokens are those it gets alone and in turn."""
    spec = penalized(SAMPLED)
    others = [PROMPT[:6], PROMPT[2:]]
    (alone,), _ = run(model, [PROMPT], 24, [spec], draft=False)
    (plain_ahead,), ahead_runner = run(model, [others[0]], 24, [GREEDY], draft=False, plan_ahead=True)
    assert ahead_runner.ahead > 0  # without a penalized lane, rounds are planned ahead
    together, runner = run(model, [PROMPT, *others], 24, [spec, GREEDY, SAMPLED], draft=False, plan_ahead=True)
    assert together[0] == alone and together[1] == plain_ahead
    assert runner.ahead == 0
