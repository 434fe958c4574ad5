"""The kernel path's lane pool and captured decode rounds (under the Triton interpreter, where a replay runs the
padded bucket eagerly): padding rows leave real lanes' bits alone, a grown pool keeps every lane, a freed slot
serves a new lane as if fresh."""

from __future__ import annotations

import gc
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
from make_checkpoint import make_checkpoint

from kernels.row_copy import RowCopier
from model import kernel_path
from model import lane_pool as lane_pool_module
from model.flashnext import FlashNextModel, single_lane_batch
from model.graphs import LISTED_LOGITS, PROMPT_KEEPS, RoundGraphs, buckets_for
from model.kernel_blocks import SharedOutputs
from model.layers import ForwardBatch, Segment
from model.state import KeptRow, LaneState, restore
from model.weights import load_model
from tests.kernels.launches import recording_launches
from tests.tiny import KERNEL_TEXT, text_config

PROMPTS = ([7, 19, 5, 33, 2, 91], [8, 13, 21], [4, 4, 4, 4, 4])
STEPS = 3


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_checkpoint(text_config("base", **KERNEL_TEXT), tmp_path_factory.mktemp("lane_pool"), fmt="bf16")


def prefill(model: FlashNextModel, lanes: list[LaneState]) -> None:
    """PROMPTS into the lanes in one round."""
    segments, start = [], 0
    for lane, prompt in zip(lanes, PROMPTS, strict=True):
        segments.append(Segment(lane, start, len(prompt)))
        start += len(prompt)
    positions = torch.cat([torch.arange(len(prompt)) for prompt in PROMPTS])
    model(ForwardBatch(torch.tensor([t for prompt in PROMPTS for t in prompt]), positions, segments))


def decode(model: FlashNextModel, lanes: list[LaneState]) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Prefill the prompts in one round, then STEPS greedy decode rounds of every lane together."""
    prefill(model, lanes)
    tokens, logits = [[1], [2], [3]], []
    for _ in range(STEPS):
        segments = [Segment(lane, i, 1) for i, lane in enumerate(lanes)]
        batch = ForwardBatch(torch.tensor([t[-1] for t in tokens]), torch.tensor([x.length for x in lanes]), segments)
        out = model(batch)
        logits.append(out.logits)
        for t, row in zip(tokens, out.logits, strict=True):
            t.append(int(row.argmax()))
    return logits, tokens


def assert_same_lanes(a: list[LaneState], b: list[LaneState]) -> None:
    """Bit-identical recurrent and conv states and QSA rows up to each lane's length."""
    for x, y in zip(a, b, strict=True):
        assert x.length == y.length
        for name in ("gdn_conv", "gdn_recurrent", "ple_conv"):
            assert all(torch.equal(t, getattr(y, name)[i]) for i, t in getattr(x, name).items()), name
        for i, cache in x.attention.items():
            other = y.attention[i]
            assert torch.equal(cache.keys[: x.length], other.keys[: x.length])
            assert torch.equal(cache.index_keys[: x.length], other.index_keys[: x.length])


@pytest.fixture(scope="module")
def eager(path):
    """Decode rounds on the kernel path without graphs, in a pool with room for every lane."""
    model = load_model(path, dtype="bfloat16", kernels="on")
    kernel_path.lane_pool(model, slots=4, context=16)
    lanes = [model.new_lane() for _ in PROMPTS]
    return model, lanes, *decode(model, lanes)


def test_buckets_cover_every_batch_size() -> None:
    assert buckets_for(1) == (1,)
    assert buckets_for(64) == (1, 2, 4, 8, 16, 32, 64)
    assert buckets_for(48) == (1, 2, 4, 8, 16, 32, 48)
    assert buckets_for(1280, first=128) == (128, 256, 512, 1024, 1280) and buckets_for(24, first=128) == (24,)


def test_replayed_decode_rounds_equal_the_eager_ones_bit_for_bit(path, eager) -> None:
    _, eager_lanes, eager_logits, eager_tokens = eager
    model = load_model(path, dtype="bfloat16", kernels="on")
    kernel_path.lane_pool(model, slots=4, context=16)
    graphs = kernel_path.enable_graphs(model, {"trunk": 4})
    lanes = [model.new_lane() for _ in PROMPTS]
    logits, tokens = decode(model, lanes)
    assert graphs.replays["trunk"] == STEPS  # 3 lanes in the bucket of 4 (the 14 prompt rows run eagerly)
    assert tokens == eager_tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, eager_logits, strict=True))
    assert_same_lanes(lanes, eager_lanes)


def drafted_rounds(model: FlashNextModel) -> tuple[list[torch.Tensor], list[LaneState]]:
    """Prompts in chunks of different lengths side by side, a verify window per lane with every row's state kept
    and a rejection restoring each lane after its first row, then MTP rows of both lanes at once (two rows' logits)."""
    lanes = [model.new_lane() for _ in PROMPTS[:2]]
    outs = [
        model(
            ForwardBatch(
                torch.tensor(PROMPTS[0] + PROMPTS[1]),
                torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2]),
                [Segment(lanes[0], 0, 6), Segment(lanes[1], 6, 3)],
            )
        ).logits
    ]
    window = ForwardBatch(
        torch.tensor([9, 10, 11, 12, 13]),
        torch.tensor([6, 7, 8, 3, 4]),
        [Segment(lanes[0], 0, 3), Segment(lanes[1], 3, 2)],
    )
    out = model(window, snapshot_rows={0: {0, 1}, 1: {0}})
    outs.append(out.logits)
    restore(lanes[0], out.snapshots[0][0])
    restore(lanes[1], out.snapshots[1][0])
    rows = ForwardBatch(
        torch.tensor([10, 13, 14]), torch.tensor([6, 3, 4]), [Segment(lanes[0], 0, 1), Segment(lanes[1], 1, 2)]
    )
    outs.extend(model.mtp_forward(rows, out.hidden[[0, 3, 4]], logit_rows=torch.tensor([2, 0])))
    outs.append(
        model(
            ForwardBatch(
                torch.tensor([21, 22]), torch.tensor([7, 4]), [Segment(lanes[0], 0, 1), Segment(lanes[1], 1, 1)]
            )
        ).logits
    )
    return outs, lanes


def pooled(path, context: int) -> FlashNextModel:
    """The checkpoint on the kernel path with a lane pool of four slots of `context` positions."""
    model = load_model(path, dtype="bfloat16", kernels="on")
    kernel_path.lane_pool(model, slots=4, context=context)
    return model


def test_replayed_prompt_verify_and_mtp_rows_equal_the_eager_ones_bit_for_bit(path) -> None:
    expected, expected_lanes = drafted_rounds(pooled(path, 16))
    model = pooled(path, 16)
    graphs = kernel_path.enable_graphs(model, {"trunk": 16, "verify": 8, "mtp": 4})
    got, lanes = drafted_rounds(model)
    assert graphs.replays == {"trunk": 2, "verify": 1, "mtp": 1}
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert_same_lanes(lanes, expected_lanes)
    for a, b in zip(lanes, expected_lanes, strict=True):
        assert a.mtp_length == b.mtp_length
        assert torch.equal(a.mtp_attention.keys[: a.mtp_length], b.mtp_attention.keys[: b.mtp_length])


def verify_window(model: FlashNextModel) -> tuple[list[LaneState], dict]:
    """Three prompts in one round, then a verify window of 3, 2 and 3 rows keeping every row's state: (the lanes,
    the window's snapshots)."""
    lanes = [model.new_lane() for _ in PROMPTS]
    prefill(model, lanes)
    window = ForwardBatch(
        torch.tensor([9, 10, 11, 12, 13, 14, 15, 16]),
        torch.tensor([6, 7, 8, 3, 4, 5, 6, 7]),
        [Segment(lanes[0], 0, 3), Segment(lanes[1], 3, 2), Segment(lanes[2], 5, 3)],
    )
    return lanes, model(window, snapshot_rows={0: {0, 1}, 1: {0}, 2: {0, 1}}).snapshots


def test_the_pool_restores_lanes_together_in_one_launch_with_each_lanes_restore_bits(path) -> None:
    """The pool's restore of three lanes to rows of one verify window (`KeptRow`s of its kept stacks) is one
    `copy_rows` launch and leaves each lane as `restore` does one lane at a time; a lane of no pool beside them is
    restored on its own."""
    rows = {0: 1, 1: 0, 2: 0}
    ref_lanes, ref_snaps = verify_window(pooled(path, 16))
    for i, row in rows.items():
        restore(ref_lanes[i], ref_snaps[i][row])
    model = pooled(path, 16)
    lanes, snaps = verify_window(model)
    assert all(isinstance(getattr(snaps[0][0], name), KeptRow) for name in ("gdn_conv", "gdn_recurrent", "ple_conv"))
    loose = model.new_lane()  # no slot: restored by `restore`
    with recording_launches() as launched:
        model.restore_lanes([*((lanes[i], snaps[i][row]) for i, row in rows.items()), (loose, snaps[2][1])])
    assert launched == ["_copy_rows_kernel"]
    assert_same_lanes(lanes, ref_lanes)
    assert all(torch.equal(a.ngram_history, b.ngram_history) for a, b in zip(lanes, ref_lanes, strict=True))
    assert loose.length == snaps[2][1].length and torch.equal(loose.gdn_recurrent[0], snaps[2][1].gdn_recurrent[0])


def test_restores_from_one_forwards_stacks_check_and_table_them_once(path, monkeypatch) -> None:
    """A graph's kept stacks are the same tensors every replay: the pool keeps the copier it made for them, and makes
    a new one for another forward's stacks or after it grew; every restore still has `restore`'s bits."""
    made = []
    monkeypatch.setattr(lane_pool_module, "RowCopier", lambda pairs: made.append(len(pairs)) or RowCopier(pairs))
    ref_lanes, ref_snaps = verify_window(pooled(path, 16))
    model = pooled(path, 16)
    lanes, snaps = verify_window(model)
    for row in (1, 0):
        model.restore_lanes([(lanes[0], snaps[0][row])])
        restore(ref_lanes[0], ref_snaps[0][row])
        assert_same_lanes([lanes[0]], [ref_lanes[0]])
    assert len(made) == 1
    model.lane_pool._grow(8, model.lane_pool.context)
    model.restore_lanes([(lanes[1], snaps[1][0])])
    other_lanes, other_snaps = verify_window(model)
    model.restore_lanes([(other_lanes[0], other_snaps[0][1])])
    assert len(made) == 3


def test_a_full_copier_cache_drops_those_of_freed_stacks_first(path, monkeypatch) -> None:
    """An eager round's stacks are freed after it; when the cache is full their copiers go, not a live graph's."""
    made = []
    monkeypatch.setattr(lane_pool_module, "RowCopier", lambda pairs: made.append(len(pairs)) or RowCopier(pairs))
    monkeypatch.setattr(lane_pool_module, "COPIERS", 2)
    model = pooled(path, 16)
    model.lane_pool._grow(16, model.lane_pool.context)  # room for every window's lanes: no copier dies of a growth
    kept_lanes, kept_snaps = verify_window(model)  # stacks that stay alive, as a captured graph's do
    model.restore_lanes([(kept_lanes[0], kept_snaps[0][1])])
    lanes, snaps = verify_window(model)
    model.restore_lanes([(lanes[0], snaps[0][1])])
    del lanes, snaps
    gc.collect()
    lanes, snaps = verify_window(model)
    model.restore_lanes([(lanes[0], snaps[0][1])])  # the cache is full: the freed window's copier goes
    model.restore_lanes([(kept_lanes[0], kept_snaps[0][0])])
    assert len(made) == 3


def test_lanes_of_two_forwards_restored_after_the_pool_grew_take_a_launch_a_forward(path) -> None:
    """Snapshots of two verify windows (two forwards' kept stacks) restored in one call after the pool grew: one
    launch for each forward's lanes, and the bits of `restore` one lane at a time; a pooled lane of another model's
    pool is restored as `restore` does it, with no launch."""
    rows = {0: 1, 1: 0, 2: 1}
    ref = pooled(path, 16)
    ref_lanes = []
    for _ in range(2):
        lanes, snaps = verify_window(ref)
        for i, row in rows.items():
            restore(lanes[i], snaps[i][row])
        ref_lanes += lanes
    model = pooled(path, 16)
    windows = [verify_window(model) for _ in range(2)]  # six lanes: the pool of four slots grows once
    model.lane_pool._grow(16, model.lane_pool.context)
    stranger, stranger_snaps = verify_window(pooled(path, 16))
    restores = [(lanes[i], snaps[i][row]) for lanes, snaps in windows for i, row in rows.items()]
    with recording_launches() as launched:
        model.restore_lanes([*restores, (stranger[0], stranger_snaps[0][1])])
    assert launched == ["_copy_rows_kernel", "_copy_rows_kernel"]
    assert_same_lanes([lane for lanes, _ in windows for lane in lanes], ref_lanes)
    assert_same_lanes([stranger[0]], [ref_lanes[0]])  # the same window and row as the reference's first lane


def test_a_lane_listed_twice_is_refused_before_any_copy(path) -> None:
    model = pooled(path, 16)
    lanes, snaps = verify_window(model)
    before = lanes[1].gdn_recurrent[0].clone()
    with pytest.raises(ValueError, match="a lane is listed twice"):
        model.restore_lanes([(lanes[1], snaps[1][0]), (lanes[0], snaps[0][0]), (lanes[0], snaps[0][1])])
    assert torch.equal(lanes[1].gdn_recurrent[0], before) and lanes[1].length == snaps[1][0].length + 1


def prompt_round(model: FlashNextModel) -> tuple[list[torch.Tensor], list[LaneState]]:
    """A 17-token prompt beside a new lane's first row, keeping the states after two of its rows and asking for three
    rows' logits: (the logits and the kept states' tensors, the lanes)."""
    lanes = [model.new_lane() for _ in range(2)]
    prompt = torch.arange(17) * 7 % 97 + 1
    both = ForwardBatch(
        torch.cat([prompt, torch.tensor([5])]),
        torch.tensor([*range(17), 0]),
        [Segment(lanes[0], 0, 17), Segment(lanes[1], 17, 1)],
    )
    out = model(both, logit_rows=torch.tensor([17, 16, 3]), snapshot_rows={0: {8, 15}})
    kept = [out.snapshots[0][row] for row in (8, 15)]
    states = [
        t for snap in kept for name in ("gdn_conv", "gdn_recurrent", "ple_conv") for t in getattr(snap, name).values()
    ]
    return [out.logits, *states], lanes


def test_replayed_prompt_rounds_keeping_listed_rows_equal_the_eager_ones_bit_for_bit(path) -> None:
    expected, expected_lanes = prompt_round(pooled(path, 32))
    model = pooled(path, 32)
    graphs = kernel_path.enable_graphs(model, {"trunk": 4, "prompt": 18})
    got, lanes = prompt_round(model)
    assert graphs.buckets["prompt"] == (18,) and graphs.replays == {"trunk": 0, "prompt": 1}
    assert got[0].shape[0] == 3 and len(got) == len(expected) > 1
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert_same_lanes(lanes, expected_lanes)
    shared = {b.untyped_storage().data_ptr() for b in graphs.shared.buffers.values()}
    assert all(t.untyped_storage().data_ptr() in shared for t in got[1:])  # no bucket holds kept states of its own
    assert ("logits", 0) not in graphs.shared.buffers  # one rank's logits stay the kernel's output: no copy


def test_shared_outputs_serve_smaller_takes_from_one_buffer_and_grow_when_too_small() -> None:
    outputs, like = SharedOutputs(), torch.zeros(1)
    big = outputs.take("gdn_recurrent", 4, (8, 3, 2), like)
    small = outputs.take("gdn_recurrent", 4, (2, 3, 2), like)
    assert big.shape == (8, 3, 2) and small.shape == (2, 3, 2) and small.data_ptr() == big.data_ptr()
    assert outputs.take("gdn_conv", 4, (2, 3, 2), like).data_ptr() != big.data_ptr()  # another output
    grown = outputs.take("gdn_recurrent", 4, (9, 3, 2), like)
    assert grown.shape[0] == 9 and outputs.take("gdn_recurrent", 4, (8, 3, 2), like).data_ptr() == grown.data_ptr()
    assert outputs.take("gdn_recurrent", 4, (2, 3, 5), like).shape == (2, 3, 5)  # other rows: a buffer of their own
    assert outputs.nbytes() == (2 * 3 * 5 + 2 * 3 * 2) * 4


def fake_graphs(buckets: dict[str, tuple[int, ...]]) -> RoundGraphs:
    """RoundGraphs with these buckets and nothing captured: enough for covers() and graph_kind()."""

    class Pool:
        generation = 0

    graphs = RoundGraphs.__new__(RoundGraphs)
    graphs.pool, graphs.generation, graphs.buckets, graphs.listed_logits = Pool(), 0, buckets, LISTED_LOGITS
    return graphs


def test_a_prompt_graph_keeps_and_gives_logits_of_at_most_its_rows_and_a_verify_graph_any() -> None:
    graphs = fake_graphs({"trunk": (1, 2), "verify": (1, 2), "prompt": (16,)})
    assert graphs.covers("prompt", 16, PROMPT_KEEPS) and not graphs.covers("prompt", 16, PROMPT_KEEPS + 1)
    assert graphs.covers("prompt", 16, 0, LISTED_LOGITS) and not graphs.covers("prompt", 16, 0, LISTED_LOGITS + 1)
    assert graphs.covers("verify", 2, 2) and not graphs.covers("trunk", 2, 1) and not graphs.covers("prompt", 17)


@pytest.mark.parametrize(
    ("lengths", "keeps", "kind", "chunked"),
    [
        ([1, 1], 0, "trunk", False),
        ([1, 1], 2, "verify", False),
        ([20, 1], 0, "prompt", False),  # a long run: the prompt graph's GDN kernels
        ([20, 1], 3, "prompt", False),
        ([20, 1], PROMPT_KEEPS + 1, None, False),  # more kept rows than a prompt graph holds: eagerly
        ([5, 1], 0, "trunk", False),  # no long run
        ([16, 40], 0, "trunk", False),  # a long run, but a round too small for a prompt bucket's padding
        ([16, 40], 0, "prompt", True),  # a whole GDN chunk: only the prompt graph runs the chunked form
        ([20, 1], 2, "prompt", True),  # a verify graph would keep every row, inside the chunk too
        ([1, 1], 0, None, True),  # no prompt bucket holds it: eagerly
    ],
)
def test_graph_kind_takes_the_prompt_graph_for_long_runs_and_kept_rows(lengths, keeps, kind, chunked) -> None:
    graphs = fake_graphs({"trunk": (1, 2, 4, 64), "verify": (1, 2), "prompt": (128,)})
    if lengths == [20, 1]:
        graphs.buckets["prompt"] = (16, 32)
    if lengths == [1, 1]:
        del graphs.buckets["prompt"]
    segments, start = [], 0
    for n in lengths:
        segments.append(Segment(None, start, n))
        start += n
    batch = ForwardBatch(torch.zeros(start, dtype=torch.long), torch.arange(start), segments)
    assert kernel_path.graph_kind(graphs, batch, keeps, 1, chunked) == kind


def test_a_grown_pool_keeps_every_lane_and_stops_replaying(path, eager) -> None:
    _, eager_lanes, eager_logits, _ = eager
    model = load_model(path, dtype="bfloat16", kernels="on")
    pool = kernel_path.lane_pool(model, slots=2, context=4)  # too few slots and positions for the prompts
    graphs = kernel_path.enable_graphs(model, {"trunk": 4})
    lanes = [model.new_lane() for _ in PROMPTS]
    logits, _ = decode(model, lanes)
    assert pool.slots >= 3 and pool.context >= 9 and pool.generation >= 2
    assert graphs.replays["trunk"] == 0  # the graphs point at the old tensors
    assert all(torch.equal(a, b) for a, b in zip(logits, eager_logits, strict=True))
    assert_same_lanes(lanes, eager_lanes)


def test_a_lane_collected_after_the_pool_grew_gives_its_slot_back(path) -> None:
    model = load_model(path, dtype="bfloat16", kernels="on")
    pool = kernel_path.lane_pool(model, slots=1, context=16)
    first = model.new_lane()
    model(single_lane_batch(first, torch.tensor(PROMPTS[1]), 0))
    second = model.new_lane()
    model(single_lane_batch(second, torch.tensor(PROMPTS[1]), 0))  # no free slot: the pool grows
    assert pool.generation == 1 and first.slot != second.slot
    slot = first.slot
    del first
    gc.collect()
    assert slot in pool.free


def test_a_freed_slot_serves_a_new_lane_as_if_fresh(path, eager) -> None:
    model = load_model(path, dtype="bfloat16", kernels="on")
    pool = kernel_path.lane_pool(model, slots=1, context=16)
    used = model.new_lane()
    model(single_lane_batch(used, torch.tensor(PROMPTS[0]), 0))
    slot = used.slot
    del used
    gc.collect()
    lane = model.new_lane()
    out = model(single_lane_batch(lane, torch.tensor(PROMPTS[1]), 0))
    assert lane.slot == slot and pool.slots == 1  # the slot came back and was reused, stale rows and all
    fresh = load_model(path, dtype="bfloat16", kernels="on")
    expected = fresh(single_lane_batch(fresh.new_lane(), torch.tensor(PROMPTS[1]), 0))
    assert torch.equal(out.logits, expected.logits)


def test_a_slot_takes_the_bytes_the_server_plans_for(path) -> None:
    from model.state import slot_state_bytes

    model = load_model(path, dtype="bfloat16", kernels="on")
    pool = kernel_path.lane_pool(model, slots=3, context=41)  # rounded up to whole blocks, tensors included
    ratio = model.cfg.indexer_compress_ratio
    assert pool.nbytes() == 4 * slot_state_bytes(model.new_lane(), pool.context, ratio)  # 3 slots and the scratch
