"""Drafting never changes a token: drafted = undrafted, concurrent = solo, rejected drafts leave no state behind."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from make_checkpoint import write_safetensors

from model.shipped import SHIPPED_MODEL
from model.weights import TensorIndex, load_model
from rankwire.header import DrawSpec, LaneOp, LaneOpCode, LaneRows, RoundPlan
from server.drafters import CopyDrafter, History, MtpDrafter, ScriptedDrafter
from server.runner import ModelRunner, RoundRefused
from tests.server.engine_harness import run
from tests.tiny import checkpoint

PROMPT = [7, 19, 40, 33, 2, 91, 12, 44, 8, 13]
GREEDY = DrawSpec(0.0, 0, 1.0, 0.0, 1)
SAMPLED = DrawSpec(0.9, 40, 0.95, 0.0, 4321)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(checkpoint(tmp_path_factory.mktemp("draft") / "m"), dtype="float32")


@pytest.fixture(scope="module")
def shipped():
    return load_model(SHIPPED_MODEL, dtype="float32")


def shipped_prompts() -> list[list[int]]:
    """Python-looking prompts in the shipped model's tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(SHIPPED_MODEL))
    texts = (
        "def read_config(path):\n    ",
        "import os\n\n\nclass Cache:\n    def __init__(self",
        "for item in items:\n",
    )
    return [tokenizer.encode(text) for text in texts]


def accept_lengths(runner) -> set[int]:
    return {r.accepted for results in runner.rounds for r in results if r.tokens}


@pytest.mark.parametrize("draw", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_scripted_drafts_reach_every_accept_length_and_change_nothing(model, draw):
    depth = 3
    (reference,), _ = run(model, [PROMPT], 40, [draw], depth=depth, draft=False)

    calls = []

    def script(history, wanted):
        done = len(history) - len(PROMPT)  # the pending token is the last of history; drafts follow it
        proposal = list(reference[done : done + wanted])
        wrong = len(calls) % (depth + 1)  # round by round, the first wrong draft in every slot, then none
        calls.append(done)
        if wrong < len(proposal):
            proposal[wrong] = (proposal[wrong] + 1) % model.cfg.vocab_size
        return tuple(proposal)

    (drafted,), runner = run(model, [PROMPT], 40, [draw], depth=depth, drafter=ScriptedDrafter(script))
    assert drafted == reference
    assert accept_lengths(runner) == set(range(depth + 1))
    windows = [
        (len(rows.drafts), r.accepted)
        for plan, results in zip(runner.plans, runner.rounds, strict=True)
        for rows, r in zip(plan.rows, results, strict=True)
        if r.tokens and rows.drafts
    ]
    engine = runner.engine
    assert engine.drafted_at == [sum(n > i for n, _ in windows) for i in range(depth)]
    assert engine.accepted_at == [sum(a > i for _, a in windows) for i in range(depth)]
    assert engine.accepted_at[0] > engine.accepted_at[depth - 1] > 0


def state_bits(lane) -> dict[str, torch.Tensor]:
    bits = {"ngram": lane.ngram_history, "length": torch.tensor(lane.length)}
    for name, states in (("conv", lane.gdn_conv), ("recurrent", lane.gdn_recurrent), ("ple", lane.ple_conv)):
        bits.update({f"{name}{i}": t for i, t in states.items()})
    for i, cache in lane.attention.items():
        bits[f"kv{i}"] = torch.cat((cache.keys[: cache.length].flatten(), cache.values[: cache.length].flatten()))
        bits[f"index{i}"] = cache.index_keys[: cache.length]
    return bits


def test_a_round_with_rejected_drafts_leaves_the_serial_state(model):
    serial, drafted = ModelRunner(model, 1), ModelRunner(model, 1)
    first = serial.execute(RoundPlan(allocate=(0,), rows=(LaneRows(0, tuple(PROMPT), 0, GREEDY),)))[0].tokens[0]
    reference = [first]
    for _ in range(3):
        start = len(PROMPT) + len(reference) - 1
        reference += serial.execute(RoundPlan(rows=(LaneRows(0, (reference[-1],), start, GREEDY),)))[0].tokens
    drafted.execute(RoundPlan(allocate=(0,), rows=(LaneRows(0, tuple(PROMPT), 0, GREEDY),)))
    wrong = (reference[2] + 1) % model.cfg.vocab_size
    window = LaneRows(0, (first,), len(PROMPT), GREEDY, drafts=(reference[1], wrong, reference[3]))
    result = drafted.execute(RoundPlan(rows=(window,)))[0]
    assert result.tokens == (reference[1], reference[2]) and result.accepted == 1
    # the serial lane has folded `first` and reference[1] and drawn reference[2]; it has also folded reference[2]
    # and reference[3] since, so compare with a serial lane stopped at the same point
    again = ModelRunner(model, 1)
    again.execute(RoundPlan(allocate=(0,), rows=(LaneRows(0, tuple(PROMPT), 0, GREEDY),)))
    for i in range(2):
        again.execute(RoundPlan(rows=(LaneRows(0, (reference[i],), len(PROMPT) + i, GREEDY),)))
    expected, got = state_bits(again.slots[0]), state_bits(drafted.slots[0])
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected), [
        k for k in expected if not torch.equal(expected[k], got[k])
    ]


@pytest.mark.parametrize("drafter", [MtpDrafter(), CopyDrafter()], ids=["mtp", "copy"])
@pytest.mark.parametrize("draw", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_mtp_and_copy_drafts_equal_undrafted(model, drafter, draw):
    (reference,), _ = run(model, [PROMPT], 30, [draw], draft=False)
    (drafted,), runner = run(model, [PROMPT], 30, [draw], drafter=drafter)
    assert drafted == reference
    assert any(r.drafts for results in runner.rounds for r in results)  # drafts really were proposed


@pytest.mark.parametrize("draw", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_mtp_drafts_follow_the_logit_bias_and_change_nothing(model, draw):
    """A request's logit bias reaches its MTP drafts too: with +100 on one token every draw is that token, and so is
    every draft, so every window is kept whole; beside an unbiased request, and equal to undrafted."""
    token = 123
    biased = dataclasses.replace(draw, logit_bias=((token, 100.0),))
    (reference,), _ = run(model, [PROMPT], 24, [biased], draft=False)
    together, runner = run(model, [PROMPT, PROMPT[:6]], 24, [biased, draw], drafter=MtpDrafter())
    (unbiased,), _ = run(model, [PROMPT[:6]], 24, [draw], draft=False)
    assert together == [reference, unbiased] and reference == [token] * 24
    windows = [
        (len(rows.drafts), r.accepted) for plan, results in zip(runner.plans, runner.rounds, strict=True)
        for rows, r in zip(plan.rows, results, strict=True) if r.tokens and r.tokens[0] == token and rows.drafts
    ]  # fmt: skip
    assert len(windows) > 3 and all(accepted == drafted for drafted, accepted in windows)


def test_eight_concurrent_drafted_requests_each_equal_their_solo_run(model):
    prompts = [[(p + 11 * i) % 300 + 6 for p in PROMPT][: 4 + i] for i in range(8)]
    draws = [DrawSpec(0.0 if i % 2 else 1.0, 0, 1.0, 0.0, 100 + i) for i in range(8)]
    together, _ = run(model, prompts, 20, draws, drafter=CopyDrafter(), budget=16)
    for prompt, draw, tokens in zip(prompts, draws, together, strict=True):
        (alone,), _ = run(model, [prompt], 20, [draw], drafter=CopyDrafter())
        (serial,), _ = run(model, [prompt], 20, [draw], draft=False)
        assert tokens == alone == serial


@pytest.fixture(scope="module")
def cycling(tmp_path_factory) -> Path:
    """A checkpoint whose blocks add nothing: the next token is a function of the current one, so greedy output
    falls into a cycle, the repetition copy drafts are for."""
    path = checkpoint(tmp_path_factory.mktemp("cycle") / "m")
    index = TensorIndex(path)
    tensors = {name: index.get(name) for name in index.files}
    silent = ("out_proj.weight", "o_proj.weight", "down_proj.weight", "ple.value_proj.weight", "experts.down_proj")
    for name in tensors:
        if name.startswith("model.") and name.endswith(silent):
            tensors[name] = torch.zeros_like(tensors[name])
    (path / "model.safetensors").unlink()
    write_safetensors(tensors, path, 1)
    return path


def test_copy_drafts_are_accepted_on_repetitive_output(cycling):
    repetitive = load_model(cycling, dtype="float32")
    (reference,), _ = run(repetitive, [PROMPT], 60, [GREEDY], draft=False)
    (drafted,), runner = run(repetitive, [PROMPT], 60, [GREEDY], drafter=CopyDrafter())
    assert drafted == reference
    accepted = sum(r.accepted for results in runner.rounds for r in results)
    assert accepted >= 20  # once the cycle repeats, whole windows are kept
    assert len(runner.rounds) < 60


def test_copy_continuation_follows_the_latest_earlier_occurrence():
    history = History([1, 2, 3, 4, 9, 1, 2, 3, 4, 7, 5])
    assert history.copy_continuation(2) == ()  # the last four tokens never occurred before
    history.extend([1, 2, 3, 4])
    assert history.copy_continuation(2) == (7, 5)  # the latest of the two earlier occurrences wins
    assert History([4, 5, 6, 1, 2]).copy_continuation(3) == ()
    grown = History([8, 1, 2, 3])
    grown.extend([4, 0, 1, 2, 3, 4])
    assert grown.copy_continuation(4) == (0, 1, 2, 3)


def test_a_kept_state_shares_the_lanes_cache_rows_and_never_sees_later_writes(model):
    runner = ModelRunner(model, 2)
    runner.execute(RoundPlan(allocate=(0,), rows=(LaneRows(0, tuple(PROMPT[:6]), 0, None),)))
    runner.execute(RoundPlan(ops=(LaneOp(LaneOpCode.KEEP, 0, 7),)))
    kept, lane = runner.kept[7], runner.slots[0]
    layer = next(iter(lane.attention))
    assert kept.attention[layer].keys.data_ptr() == lane.attention[layer].keys.data_ptr()  # shared, not copied
    before = {k: v.clone() for k, v in state_bits(kept).items()}
    # the lane goes on, drafts are rejected and rewritten: none of it reaches the kept prefix
    window = LaneRows(0, tuple(PROMPT[6:]), 6, GREEDY, drafts=(1, 2, 3))
    runner.execute(RoundPlan(rows=(window,)))
    assert all(torch.equal(before[k], v) for k, v in state_bits(kept).items())
    runner.execute(RoundPlan(allocate=(1,), ops=(LaneOp(LaneOpCode.RESTORE, 1, 7),)))
    restored = runner.slots[1].attention[layer]
    assert restored.keys.data_ptr() != kept.attention[layer].keys.data_ptr()  # a resumed lane writes into its own


def test_the_draft_depth_adapts_to_what_a_lane_keeps(model):
    (reference,), _ = run(model, [PROMPT], 30, [GREEDY], draft=False)

    def right(history, wanted):
        done = len(history) - len(PROMPT)
        return tuple(reference[done : done + wanted])

    def wrong(history, wanted):
        return tuple((t + 1) % model.cfg.vocab_size for t in right(history, wanted))

    windows = {}
    for name, script in (("right", right), ("wrong", wrong)):
        (tokens,), runner = run(model, [PROMPT], 30, [GREEDY], depth=3, drafter=ScriptedDrafter(script))
        assert tokens == reference
        windows[name] = [len(rows.drafts) for plan in runner.plans for rows in plan.rows if rows.drafts]
    assert max(windows["right"]) == 3 and windows["right"][0] == 3
    assert windows["wrong"][0] == 3 and windows["wrong"][-3:] == [1, 1, 1]  # a lane that keeps nothing drafts less


@pytest.mark.parametrize("draw", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_the_shipped_models_mtp_drafts_are_accepted_and_change_nothing(shipped, draw):
    prompts = shipped_prompts()
    draws = [draw] * len(prompts)
    alone = [run(shipped, [p], 24, [draw], draft=False)[0][0] for p in prompts]
    together, runner = run(shipped, prompts, 24, draws, drafter=MtpDrafter())
    assert together == alone  # drafted = undrafted, concurrent = solo
    engine = runner.engine
    assert engine.accepted_at[0] >= engine.drafted_at[0] // 3 > 0  # a trained MTP: first drafts really kept


def kept_bits(lane) -> dict[str, torch.Tensor]:
    """Every part of a kept state a resume reads, the MTP layer's included."""
    bits = state_bits(lane) | {"mtp_length": torch.tensor(lane.mtp_length)}
    if lane.mtp_attention is not None:
        n = lane.mtp_attention.length
        bits["mtp_kv"] = torch.cat((lane.mtp_attention.keys[:n].flatten(), lane.mtp_attention.values[:n].flatten()))
        bits["mtp_index"] = lane.mtp_attention.index_keys[:n]
    if lane.mtp_pending is not None:
        bits["mtp_pending"] = lane.mtp_pending
    return bits


@pytest.mark.parametrize("depth", [0, 3], ids=["no-mtp", "mtp"])
def test_a_state_kept_inside_a_round_equals_one_kept_between_rounds(model, depth):
    whole, split = ModelRunner(model, 1), ModelRunner(model, 1)
    rows = LaneRows(0, tuple(PROMPT), 0, GREEDY, draft_depth=depth)
    whole.execute(RoundPlan(allocate=(0,), rows=(rows,), ops=(LaneOp(LaneOpCode.KEEP, 0, 5, after=6),)))
    split.execute(RoundPlan(allocate=(0,), rows=(LaneRows(0, tuple(PROMPT[:6]), 0, None, draft_depth=depth),)))
    rest = LaneRows(0, tuple(PROMPT[6:]), 6, GREEDY, draft_depth=depth)
    split.execute(RoundPlan(rows=(rest,), ops=(LaneOp(LaneOpCode.KEEP, 0, 5),)))
    ours, theirs = kept_bits(whole.kept[5]), kept_bits(split.kept[5])
    assert ours.keys() == theirs.keys() and ("mtp_pending" in ours) == bool(depth)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours), [k for k in ours if not torch.equal(ours[k], theirs[k])]
    with pytest.raises(RoundRefused, match="after 11 rows of lane slot 0, which has 10"):
        ModelRunner(model, 1).execute(
            RoundPlan(allocate=(0,), rows=(rows,), ops=(LaneOp(LaneOpCode.KEEP, 0, 5, after=11),))
        )
