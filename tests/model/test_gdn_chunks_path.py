"""GDN's chunked form on the kernel path (the interpreter): a prompt's whole chunks, at positions that are multiples of
CHUNK, give a lane the same bits in one pass, in passes cut at chunk boundaries and beside other lanes; states are
kept only at chunk ends."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
from make_checkpoint import make_checkpoint

from kernels.gdn_chunk import CHUNK, chunk_spans
from model import kernel_path
from model.config import LINEAR
from model.flashnext import FlashNextModel, single_lane_batch
from model.graphs import RoundGraphs
from model.kernel_path import enable_graphs
from model.layers import ForwardBatch, Segment
from model.state import copy_lane, restore
from model.weights import load_model
from tests.kernels.launches import recording_launches
from tests.model.test_kernel_path import assert_same_state, fold
from tests.tiny import KERNEL_TEXT, text_config

PROMPT = [(13 * i) % 97 + 6 for i in range(CHUNK + 9)]
OTHER = [8, 13, 21, 60, 17]


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    """A tiny bf16 checkpoint of one GDN layer (the interpreter pays per row: 73-row passes through more are slow)."""
    text = text_config("base", **{**KERNEL_TEXT, "num_hidden_layers": 1, "ple_layer_ids": [1]})
    return make_checkpoint(text, tmp_path_factory.mktemp("chunks") / "m", fmt="bf16")


@pytest.fixture(scope="module")
def ker(path) -> FlashNextModel:
    """The kernel path on that checkpoint."""
    return load_model(path, dtype="bfloat16", kernels="on")


def chunk_launches(names: list[str]) -> int:
    """How many launches of the chunked form's kernels a forward made."""
    return sum(name.startswith("_gdn_chunk") for name in names)


def test_whole_chunks_take_the_chunked_form_with_the_same_bits_however_the_passes_are_cut(ker) -> None:
    assert [layer.kind for layer in ker.layers] == [LINEAR]
    whole_lane = ker.new_lane()
    with recording_launches() as launched:
        whole = ker(single_lane_batch(whole_lane, torch.tensor(PROMPT), 0), snapshot_rows={0: [CHUNK - 1]})
    assert chunk_launches(launched) == 2  # the chunk's prepare and scan
    # cut at the chunk's end, the second pass beside another lane's rows
    cut_lane, other = ker.new_lane(), ker.new_lane()
    first = fold(ker, [(cut_lane, PROMPT[:CHUNK])])
    at_chunk_end = copy_lane(cut_lane)
    second = fold(ker, [(other, OTHER), (cut_lane, PROMPT[CHUNK:])])
    assert torch.equal(torch.cat((first.hidden, second.hidden[len(OTHER) :])), whole.hidden)
    assert torch.equal(second.logits[len(OTHER) :], whole.logits[CHUNK:])
    assert_same_state(cut_lane, whole_lane)
    restore(whole_lane, whole.snapshots[0][CHUNK - 1])  # the state kept at the chunk's end = a pass stopped there
    for part in ("gdn_conv", "gdn_recurrent", "ple_conv"):
        kept, stopped = getattr(whole_lane, part), getattr(at_chunk_end, part)
        assert kept.keys() == stopped.keys() and all(torch.equal(kept[i], stopped[i]) for i in kept), part
    with pytest.raises(ValueError, match="inside a GDN chunk"):
        ker(single_lane_batch(ker.new_lane(), torch.tensor(PROMPT), 0), snapshot_rows={0: [CHUNK - 2]})


def test_only_runs_starting_on_a_chunk_boundary_take_whole_chunks(ker) -> None:
    lanes = [ker.new_lane() for _ in range(3)]
    lanes[1].length = 3
    segments = [
        Segment(lanes[0], 0, CHUNK + 2),
        Segment(lanes[1], CHUNK + 2, CHUNK + 1),
        Segment(lanes[2], 2 * CHUNK + 3, 1),
    ]
    positions = [*range(CHUNK + 2), *range(3, CHUNK + 4), 0]
    batch = ForwardBatch(torch.zeros(len(positions), dtype=torch.long), torch.tensor(positions), segments)
    starts = kernel_path.segment_starts(batch)
    pool = kernel_path.place(ker, batch, starts)
    runs = kernel_path.lane_runs(batch, starts)
    rnd = kernel_path.build_round(pool, batch, starts, None, ngram_size=None, chunked_runs=runs)
    assert rnd.chunks.chunk_rows[0] == 0 and (rnd.chunks.chunk_rows[1:] == -1).all()
    lanes_of_rows = rnd.recurrent_lanes.tolist()
    assert lanes_of_rows[:CHUNK] == [-1] * CHUNK and -1 not in lanes_of_rows[CHUNK:]
    decode = ForwardBatch(torch.zeros(1, dtype=torch.long), torch.tensor([0]), [Segment(lanes[2], 0, 1)])
    assert not any(chunk_spans(kernel_path.lane_runs(decode, [0])))  # so the forward gives build_round no runs
    assert kernel_path.build_round(pool, decode, [0], None, ngram_size=None).chunks is None


def test_a_chunked_round_replays_the_prompt_graph_with_the_eager_bits(path) -> None:
    ker = load_model(path, dtype="bfloat16", kernels="on")
    eager_lane = ker.new_lane()
    eager = fold(ker, [(ker.new_lane(), OTHER), (eager_lane, PROMPT)])
    graphs: RoundGraphs = enable_graphs(ker, {"trunk": 8, "prompt": 2 * CHUNK})
    try:
        replayed_lane = ker.new_lane()
        replayed = fold(ker, [(ker.new_lane(), OTHER), (replayed_lane, PROMPT)])
        assert graphs.replays["prompt"] == 1
        assert torch.equal(replayed.hidden, eager.hidden) and torch.equal(replayed.logits, eager.logits)
        assert_same_state(replayed_lane, eager_lane)
    finally:
        ker.round_graphs = None
