"""A round reads back from the device only what the host needs: its draws, then its drafts in one copy. The forward
takes its segments' first positions from the host, and the MTP chain keeps its tokens on the device, so a chain's
steps are launched back to back (torch.cuda's sync debug mode checks the same on a GPU, tests/server/
test_host_copies_gpu.py)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import collections
import contextlib
import types

import pytest
import torch
from make_checkpoint import make_checkpoint

from model.kernel_path import segment_starts
from model.layers import ForwardBatch, Segment, batch_from_starts
from model.state import LaneState
from model.weights import load_model
from rankwire.header import DrawSpec, LaneRows, RoundPlan
from server.runner import ModelRunner, _MtpRows
from tests.server import engine_harness
from tests.tiny import KERNEL_TEXT, checkpoint, text_config

GREEDY = DrawSpec(0.0, 0, 1.0, 0.0, 1)
READS = ("tolist", "item", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


@contextlib.contextmanager
def reads_back(monkeypatch, phases: dict[str, tuple[type, str]]):
    """Count, by phase (a method wrapped), the tensor reads to the host (tolist, item, int(...)) made inside it."""
    counts: collections.Counter[str] = collections.Counter()
    inside: list[str] = []
    for name in READS:
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(
            torch.Tensor, name, lambda self, *a, _real=real, **k: counts.update(inside[-1:]) or _real(self, *a, **k)
        )
    for phase, (owner, method) in phases.items():
        real = getattr(owner, method)

        def wrapped(*args, _real=real, _phase=phase, **kwargs):
            inside.append(_phase)
            try:
                return _real(*args, **kwargs)
            finally:
                inside.pop()

        monkeypatch.setattr(owner, method, wrapped)
    yield counts


def test_a_rounds_forward_reads_nothing_back_and_its_drafts_come_back_in_one_copy(tmp_path, monkeypatch) -> None:
    model = load_model(
        make_checkpoint(text_config("base", **KERNEL_TEXT), tmp_path, fmt="bf16"), "cpu", "bfloat16", kernels="on"
    )
    drafted: list[int] = []
    draft = ModelRunner._draft

    def counted(self, plan_rows, mtp_rows, before_wait=None):
        drafts = draft(self, plan_rows, mtp_rows, before_wait)
        drafted.append(max(map(len, drafts.values()), default=0))
        return drafts

    monkeypatch.setattr(ModelRunner, "_draft", counted)
    with reads_back(monkeypatch, {"forward": (type(model), "forward"), "draft": (ModelRunner, "_draft")}) as n:
        engine_harness.run(model, [[7, 19, 5, 33], [8, 13, 21]], 8, [GREEDY, GREEDY], depth=3, budget=16)
    assert 3 in drafted  # chains three steps deep ran
    assert n["forward"] == 0  # the trunk's forwards: positions and rows from the host, nothing read back
    assert n["draft"] == len(drafted)  # the MTP layer's forwards and every chained step: one copy a round


def test_segment_starts_come_from_the_host_when_the_batch_has_them(monkeypatch) -> None:
    lanes = [LaneState(), LaneState()]
    segments = [Segment(lanes[0], 0, 3), Segment(lanes[1], 3, 2)]
    batch = batch_from_starts(torch.tensor([5, 6, 7, 8, 9]), segments, [10, 4])
    assert batch.positions.tolist() == [10, 11, 12, 4, 5] and batch.starts == (10, 4)
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: pytest.fail("positions read back"))
    assert segment_starts(batch) == [10, 4]
    with pytest.raises(ValueError, match="2 starts for 1 segments"):
        segment_starts(ForwardBatch(batch.token_ids[:3], batch.positions[:3], segments[:1], (10, 4)))
    with pytest.raises(ValueError, match="cover 3 of the batch's 5 rows"):
        segment_starts(ForwardBatch(batch.token_ids, batch.positions, segments[:1], (10,)))
    with pytest.raises(ValueError, match="segment 1 does not continue the rows at 3"):
        segment_starts(ForwardBatch(batch.token_ids, batch.positions, [segments[0], Segment(lanes[1], 2, 3)], (1, 2)))
    with pytest.raises(ValueError, match="a lane appears in two segments"):
        segment_starts(ForwardBatch(batch.token_ids, batch.positions, [segments[0], Segment(lanes[0], 3, 2)], (1, 9)))
    monkeypatch.undo()
    with pytest.raises(ValueError, match="segment 1: its rows' positions are not consecutive"):
        segment_starts(ForwardBatch(batch.token_ids, torch.tensor([10, 11, 12, 4, 6]), segments))


def draft_step_by_step(
    self: ModelRunner, plan_rows, mtp_rows: list[_MtpRows], before_wait=None
) -> dict[int, tuple[int, ...]]:
    """The MTP chain as the host would step it, one lane at a time: each draft read back as it is drawn, the next
    step's row built from that host token and the lane's wide state of the step before (`before_wait`, the round's
    tokens handed over, first)."""
    if before_wait is not None:
        before_wait()
    depth = {rows.slot: rows.draft_depth if rows.draw is not None else 0 for rows in plan_rows}
    live = [m for m in mtp_rows if m.tokens]
    if not live:
        return {}
    tokens, positions, segments = [], [], []
    for m in live:
        segments.append(Segment(self.slots[m.slot], len(tokens), len(m.tokens)))
        tokens.extend(m.tokens)
        positions.extend(range(m.start, m.start + len(m.tokens)))
    batch = ForwardBatch(torch.tensor(tokens), torch.tensor(positions), segments)
    drafting = [(m.slot, seg.start + seg.length - 1) for m, seg in zip(live, segments, strict=True) if depth[m.slot]]
    lasts = torch.tensor([last for _, last in drafting], dtype=torch.long)
    logits, wide = self.model.mtp_forward(batch, torch.cat([m.hidden for m in live]), logit_rows=lasts)
    drafts = {slot: [int(torch.argmax(row.float()))] for (slot, _), row in zip(drafting, logits, strict=True)}
    state = {slot: (wide[last], positions[last]) for slot, last in drafting}
    for step in range(1, max(depth.values())):
        for s in [s for s in drafts if depth[s] > step]:
            position = state[s][1] + 1
            row = ForwardBatch(torch.tensor([drafts[s][-1]]), torch.tensor([position]), [Segment(self.slots[s], 0, 1)])
            logits, wide = self.model.mtp_forward(row, state[s][0][None])
            drafts[s].append(int(torch.argmax(logits[0].float())))
            state[s] = (wide[0], position)
    return {s: tuple(d) for s, d in drafts.items()}


@pytest.mark.parametrize("depths", [(3, 1, 2), (3, 3, 3)], ids=["mixed", "equal"])
def test_chained_drafts_equal_the_chain_stepped_on_the_host_one_lane_at_a_time(tmp_path, depths) -> None:
    model = load_model(checkpoint(tmp_path / "m"), dtype="float32")
    ours, stepped = ModelRunner(model, 3), ModelRunner(model, 3)
    stepped._draft = types.MethodType(draft_step_by_step, stepped)
    prompts = [[7, 19, 40, 33, 2], [91, 12, 44], [8, 13, 21, 5, 60, 3]]
    rows = [
        LaneRows(i, tuple(p), 0, GREEDY, draft_depth=d) for i, (p, d) in enumerate(zip(prompts, depths, strict=True))
    ]
    plan = RoundPlan(allocate=(0, 1, 2), rows=tuple(rows))
    for _ in range(3):
        got, expected = ours.execute(plan), stepped.execute(plan)
        assert got == expected
        assert [len(r.drafts) for r in got] == list(depths)
        ends = [
            before.start + len(before.token_ids) + len(r.tokens) - 1 for r, before in zip(got, plan.rows, strict=True)
        ]
        plan = RoundPlan(
            rows=tuple(
                LaneRows(i, r.tokens[-1:], end, GREEDY, r.drafts, d)
                for i, (r, end, d) in enumerate(zip(got, ends, depths, strict=True))
            )
        )
