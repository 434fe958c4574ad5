"""Repetition, frequency and presence penalties: vLLM's arithmetic on the ids a lane folded before each draw, and the
contracts around it: drafted = undrafted, planned ahead = in turn, concurrent = solo."""

from __future__ import annotations

import dataclasses
import math
from array import array
from typing import ClassVar

import pytest
import torch

from model.weights import load_model
from rankwire.header import DrawSpec, LaneRows, RoundPlan
from server.drafters import MtpDrafter, ScriptedDrafter
from server.penalties import DraftPenalties, LaneHistories, PenaltyMarks
from server.runner import ModelRunner, RoundRefused, _adjusted, _biased
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


def test_each_row_counts_the_ids_before_it_its_windows_drafts_included_after_the_bias():
    """A verify window's row after k drafts counts those drafts as output, for that row alone; repetition reaches the
    prompt's ids, frequency and presence only the output's; the penalties follow the logit bias and leave a
    suppressed id at -inf."""
    spec = penalized(GREEDY, [3, 4, 4, 5, 6], repetition_penalty=1.5, frequency_penalty=0.75, presence_penalty=0.5)
    output_only = dataclasses.replace(spec, repetition_penalty=1.0)
    biased = dataclasses.replace(spec, logit_bias=((4, 2.5), (8, -1.0)), suppress_ids=(9,), suppress_before=99)
    marks = PenaltyMarks(2)
    marks.start(1, array("i", [3, 4, 4, 5, 6]), 5, 10, torch.device("cpu"))
    marks.fold([1], torch.tensor([7]))  # the round's window: the token at position 5
    keys = [(1, spec, ()), (1, spec, (7,)), (1, spec, (7, 4)), (1, output_only, (7, 4)), (1, biased, (7,))]
    logits = torch.randn(5, 10) * 3
    draws = [(draw, 6 + len(drafts)) for _, draw, drafts in keys]
    out = _adjusted(logits, draws, marks.penalties(keys, torch.device("cpu")))
    for row, (_, draw, drafts) in enumerate(keys):
        expected = _biased(logits[row : row + 1], [draws[row]])[0]
        assert torch.equal(out[row], by_hand(expected, [3, 4, 4, 5, 6, 7, *drafts], 5, draw)), row
    assert torch.equal(out[3, :4], logits[3, :4])  # prompt-only ids: no repetition penalty asked for
    assert out[4, 9] == -math.inf and out[4, 4] != logits[4, 4] + 2.5
    assert marks.penalties([(1, GREEDY, ())], torch.device("cpu")) is None


def test_kept_states_carry_their_ids_and_a_lane_after_an_unseen_draw_refuses_a_first_penalized_draw():
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


def test_a_first_penalized_draw_after_a_prior_draw_is_refused_before_the_forward(model):
    runner = ModelRunner(model, 1)
    runner.execute(RoundPlan(allocate=(0,), rows=(LaneRows(0, tuple(PROMPT), 0, GREEDY),)))
    plan = RoundPlan(rows=(LaneRows(0, (0,), len(PROMPT), penalized(GREEDY), prior_draw=True),))
    with pytest.raises(RoundRefused, match="penalties"):
        runner.execute(plan)


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


def test_penalized_rounds_planned_ahead_count_the_draw_taken_on_the_device_and_equal_rounds_in_turn(model):
    """A round planned ahead takes a lane's last token from the device: its marks count it there, so the tokens
    are those of rounds in turn, beside other requests too."""
    spec = penalized(SAMPLED, frequency_penalty=1.5)
    others = [PROMPT[:6], PROMPT[2:]]
    (alone,), _ = run(model, [PROMPT], 24, [spec], draft=False)
    (ahead,), runner = run(model, [PROMPT], 24, [spec], draft=False, plan_ahead=True)
    assert ahead == alone and runner.ahead > 10
    together, runner = run(model, [PROMPT, *others], 24, [spec, GREEDY, SAMPLED], draft=False, plan_ahead=True)
    assert together[0] == alone and runner.ahead > 10
    (plain,), _ = run(model, [PROMPT], 24, [SAMPLED], draft=False)
    assert plain != alone


def test_a_lane_slot_taken_again_by_a_request_of_the_same_prompt_length_starts_its_marks_afresh(model):
    """Two penalized requests through one lane slot, one after the other: the second's tokens are its own alone."""
    first, second = PROMPT, [(p * 7) % 300 + 5 for p in PROMPT]
    draws = [penalized(GREEDY), penalized(GREEDY)]
    (expected,), _ = run(model, [second], 20, draws[1:], draft=False)
    (_, after), _ = run(model, [first, second], 20, draws, draft=False, lanes=1)
    assert after == expected


def test_marks_that_missed_ids_the_lane_folded_are_built_again_from_the_host(model):
    """A window without a draw between two penalized draws (no engine plans one, but a plan may hold it): the marks
    have not counted its ids, so the next penalized draw builds them again from the host's ids instead of drawing
    from marks that miss them; it equals the same ids folded in one pass."""
    spec = penalized(GREEDY, frequency_penalty=2.0, presence_penalty=2.0)
    split = ModelRunner(model, 1)
    first = split.execute(RoundPlan(allocate=(0,), rows=(LaneRows(0, tuple(PROMPT), 0, spec),)))[0].tokens[0]
    middle = (first, 50, 51, 52)
    split.execute(RoundPlan(rows=(LaneRows(0, middle, len(PROMPT), None),)))
    after = split.execute(RoundPlan(rows=(LaneRows(0, (53,), len(PROMPT) + 4, spec),)))[0].tokens
    whole = ModelRunner(model, 1)
    plan = RoundPlan(allocate=(0,), rows=(LaneRows(0, (*PROMPT, *middle, 53), 0, spec),))
    assert whole.execute(plan)[0].tokens == after
    assert torch.equal(split.marks.marks[0], whole.marks.marks[0]) and split.marks.marks[0, 50] >= 2


def test_the_draft_chains_penalties_count_as_the_verify_rows_do():
    """A draft's penalties are those the target's row at its place takes: the lane's marks, the round's last draw
    and the drafts before it counted in; a lane whose marks have not counted up to its last draw takes none, and a
    lane that leaves the chain is followed."""
    vocab, ids, spec = 128, array("i", [*PROMPT[:6], 5, 9, 9]), penalized(GREEDY, PROMPT[:6])
    marks = PenaltyMarks(4)
    marks.start(1, ids, 6, vocab, torch.device("cpu"))  # counted up to position 9
    marks.start(3, ids, 6, vocab, torch.device("cpu"))
    lanes, specs = [0, 1, 3], [GREEDY, spec, spec]
    chain = DraftPenalties(marks, lanes, specs, [(2, 9), (11, 9), (12, 8)])  # lane 3's marks run past position 8
    logits = torch.randn(3, vocab)

    def expected(before: tuple[int, ...], row: int) -> torch.Tensor:
        keys = [(slot, s, before if i == row else ()) for i, (slot, s) in enumerate(zip(lanes, specs, strict=True))]
        keys = [key if i == row else (key[0], GREEDY, ()) for i, key in enumerate(keys)]
        return marks.penalties(keys, torch.device("cpu")).apply(logits)

    assert chain.places == [1]
    assert torch.equal(chain.penalties().apply(logits), expected((11,), 1))
    chain.count(torch.tensor([4, 20, 6]))
    assert torch.equal(chain.penalties().apply(logits), expected((11, 20), 1))
    chain.keep([1])  # only lane 1 drafts on: its row is now the chain's first
    chain.count(torch.tensor([30]))
    lanes, specs, logits = [1], [spec], logits[1:2]
    assert torch.equal(chain.penalties().apply(logits), expected((11, 20, 30), 0))
    chain.keep([])
    assert chain.penalties() is None
    assert DraftPenalties(marks, [0], [GREEDY], [(2, 9)]).penalties() is None


class CheckedChain(DraftPenalties):
    """The runner's chain, checked at every step against the verify rows' count: PenaltyMarks.penalties with each
    row's last draw and the drafts before it as host ids (a sync a step), for a lane whose marks have counted up to
    its last draw."""

    checked: ClassVar[list[int]] = []  # the penalized rows of each step checked
    handed: ClassVar[list] = [None, 0]  # the Penalties the last step handed out (held), and the chain's rows then

    def __init__(self, marks: PenaltyMarks, lanes: list[int], specs: list[DrawSpec], last_draws: list) -> None:
        super().__init__(marks, lanes, specs, last_draws)
        self.all_marks, self.lanes, self.specs = marks, list(lanes), list(specs)
        self.taking = [
            s.penalized and marks.holds(lane, s, at) for lane, s, (_, at) in zip(lanes, specs, last_draws, strict=True)
        ]
        self.before = [(token,) for token, _ in last_draws]
        self.steps = 0

    def penalties(self):
        ours = super().penalties()
        assert all(len(before) == self.steps + 1 for before in self.before)  # every step before it was counted
        self.steps += 1
        rows = zip(self.lanes, self.specs, self.taking, self.before, strict=True)
        keys = [(lane, spec if taking else GREEDY, before) for lane, spec, taking, before in rows]
        reference = self.all_marks.penalties(keys, torch.device("cpu"))
        assert (ours is None) == (reference is None)
        if ours is not None:
            assert torch.equal(ours.rows, reference.rows) and torch.equal(ours.marks, reference.marks)
            assert torch.equal(ours.factors, reference.factors)
            CheckedChain.checked.append(len(ours.rows))
            CheckedChain.handed[:] = [ours, len(self.lanes)]
        return ours

    def count(self, drawn: torch.Tensor) -> None:
        super().count(drawn)
        self.before = [(*before, token) for before, token in zip(self.before, drawn.tolist(), strict=True)]

    def keep(self, rows: list[int]) -> None:
        super().keep(rows)
        for name in ("lanes", "specs", "taking", "before"):
            setattr(self, name, [getattr(self, name)[i] for i in rows])


def test_the_runners_draft_chain_is_penalized_as_the_verify_rows_count(model, monkeypatch):
    """Penalized and plain lanes draft together at every depth, lanes leaving the chain at different steps: at every
    step of every chain the penalties are those the verify rows would take after the same ids, and the penalized
    lanes take part (their marks have counted up to the round's last draw)."""
    import server.runner

    adjusted = server.runner._adjusted

    def rows_followed(logits, keys, penalties, guide_masks=None):
        """A chain's penalties meet logits of as many rows as the chain holds (it followed the lanes that left)."""
        assert penalties is None or penalties is not CheckedChain.handed[0] or CheckedChain.handed[1] == len(keys)
        return adjusted(logits, keys, penalties, guide_masks)

    monkeypatch.setattr(server.runner, "DraftPenalties", CheckedChain)
    monkeypatch.setattr(server.runner, "_adjusted", rows_followed)
    CheckedChain.checked, CheckedChain.handed = [], [None, 0]
    prompts = [PROMPT, PROMPT[:6], PROMPT[3:], [5, 5, 5, 9, 9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
    only_repetition = {"repetition_penalty": 2.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}
    specs = [penalized(GREEDY, PROMPT, frequency_penalty=1.5), GREEDY, penalized(SAMPLED, PROMPT[3:]),
             penalized(GREEDY, prompts[3], **only_repetition)]  # fmt: skip
    out, _ = run(model, prompts, 40, specs, drafter=MtpDrafter(), budget=8)
    assert len(CheckedChain.checked) >= 40 and max(CheckedChain.checked) == 3  # all three penalized lanes at once
    assert out == run(model, prompts, 40, specs, draft=False)[0]
