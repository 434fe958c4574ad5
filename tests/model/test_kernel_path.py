"""The kernel path (all rows of a round at once, on the Triton kernels under the interpreter) against the reference,
and its exactness: a lane's bits alone = in a batch = in chunks, and verify-window snapshots = the serial state."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import traceback
from pathlib import Path
from types import SimpleNamespace

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
import triton
from make_checkpoint import make_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

from kernels.gdn import LONG_RUN
from kernels.ngram import ngram_rows, ngram_rows_reference
from model import kernel_blocks, kernel_path
from model.config import LINEAR
from model.flashnext import FlashNextModel, ForwardOutput, single_lane_batch
from model.kernel_blocks import GDN_STEP_ROWS, PendingWrite, hash_multipliers_on, hyper_read, read_after, settle
from model.layers import ForwardBatch, Segment
from model.ple import ngram_row_ids
from model.state import LaneState, copy_lane, restore
from model.weights import load_model, resolve_kernels
from tests.kernels.launches import recording_launches
from tests.tiny import KERNEL_TEXT, text_config

# The kernel path's tiny model (tests.tiny.KERNEL_TEXT). Token 5 is eos: the n-gram hash restarts after it.
PROMPT = [7, 19, 5, 33, 2, 91, 5, 44]
OTHER = [8, 13, 21, 60, 17]
RATIO = text_config("base")["indexer_compress_ratio"]


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, object]:
    root = tmp_path_factory.mktemp("kernel_path")
    text = text_config("base", **KERNEL_TEXT)
    return {fmt: make_checkpoint(text, root / fmt, fmt=fmt) for fmt in ("bf16", "nvfp4")}


@pytest.fixture(scope="module")
def models(paths) -> tuple[FlashNextModel, FlashNextModel]:
    """The bf16 reference and the kernel path on the same bf16 checkpoint."""
    return load_model(paths["bf16"], dtype="bfloat16"), load_model(paths["bf16"], dtype="bfloat16", kernels="on")


def fold(model: FlashNextModel, parts: list[tuple[LaneState, list[int]]], snap=frozenset()) -> ForwardOutput:
    """One forward of each lane's next tokens, segments in the given order; snapshots after every row of the
    segments in `snap`."""
    tokens, positions, segments = [], [], []
    for lane, ids in parts:
        segments.append(Segment(lane, len(tokens), len(ids)))
        tokens.extend(ids)
        positions.extend(range(lane.length, lane.length + len(ids)))
    rows = {i: range(segments[i].length) for i in snap}
    return model(ForwardBatch(torch.tensor(tokens), torch.tensor(positions), segments), snapshot_rows=rows)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def assert_same_state(a: LaneState, b: LaneState) -> None:
    """Bit-identical lane states: recurrent and conv states, n-gram history, length, QSA caches up to the length."""
    assert a.length == b.length and torch.equal(a.ngram_history, b.ngram_history)
    for name in ("gdn_conv", "gdn_recurrent", "ple_conv"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.keys() == y.keys() and all(torch.equal(x[i], y[i]) for i in x), name
    blocks = a.length // RATIO
    for i, cache in a.attention.items():
        other = b.attention[i]
        for field in ("keys", "values", "index_keys"):
            assert torch.equal(getattr(cache, field)[: a.length], getattr(other, field)[: a.length]), field
        assert cache.blocks >= blocks and other.blocks >= blocks
        assert torch.equal(cache.block_keys[:blocks], other.block_keys[:blocks]), "block_keys"


def greedy(model: FlashNextModel, steps: int) -> tuple[torch.Tensor, list[int]]:
    """The prompt's logits and `steps` greedy tokens after it."""
    lane = model.new_lane()
    logits = model(single_lane_batch(lane, torch.tensor(PROMPT), 0)).logits
    first, tokens = logits, []
    for _ in range(steps):
        tokens.append(int(logits[-1].float().argmax()))
        logits = fold(model, [(lane, tokens[-1:])]).logits
    return first, tokens


def test_logits_close_and_greedy_tokens_equal_the_reference(models) -> None:
    ref, ker = models
    want, ref_tokens = greedy(ref, 3)
    got, tokens = greedy(ker, 3)
    assert rel_err(got, want) < 0.05
    assert tokens == ref_tokens


def test_hyper_writes_run_inside_the_next_read(models) -> None:
    """A forward launches the write kernel only where no read follows a write: before a PLE layer (after the first
    layer) and after the last layer; every other write runs in the next read's first launch."""
    model = models[1]
    layers = model.layers
    with recording_launches() as launched:
        model(single_lane_batch(model.new_lane(), torch.tensor(PROMPT[:3]), 0))
    assert launched.count("_write_kernel") == 1 + sum(layer.ple is not None for layer in layers[1:])
    assert launched.count("_rstd_kernel") == 2 * len(layers) + 1  # each layer's two reads and the final mixer's


def test_sigmoid_gates_are_one_launch_and_block_positions_one_set_a_round(models, monkeypatch) -> None:
    """Each PLE layer's gated values are one sigmoid_mul launch, each QSA layer's output gate runs in its attention's
    merge launch (no launch of its own), and the positions of the blocks a round completes are made once, by the
    first QSA layer, for all of them."""
    model = models[1]
    made = []
    real = kernel_blocks.completed_blocks

    def counting(rnd):
        made.append(rnd.blocks is None)
        return real(rnd)

    monkeypatch.setattr(kernel_blocks, "completed_blocks", counting)
    with recording_launches() as launched:
        model(single_lane_batch(model.new_lane(), torch.tensor(PROMPT), 0))  # rows complete blocks
    qsa_layers = sum(layer.kind != LINEAR for layer in model.layers)
    ple_layers = sum(layer.ple is not None for layer in model.layers)
    assert qsa_layers >= 1 and ple_layers >= 1
    assert launched.count("_sigmoid_mul_kernel") == ple_layers
    assert launched.count("_attn_merge_kernel") == qsa_layers
    assert made == [True] + [False] * (qsa_layers - 1)


def test_side_work_launches_between_its_fork_and_join(models, monkeypatch) -> None:
    """With a stand-in side stream, each site's side launches are its own work only (the shared expert; QSA's index
    path; GDN's gates, in a prompt pass: a decode row runs GDN in one launch on the main stream), and the kernels that
    read them (gated add, attention, recurrence) launch on the main stream after the join."""
    model, side, events = models[1], object(), []
    where = {"side": False}

    def fork(device: torch.device, site: str) -> object:
        events.append(("fork", site))
        return side

    @contextlib.contextmanager
    def on(stream: object):
        assert stream is side
        where["side"] = True
        yield
        where["side"] = False

    real_run = triton.runtime.interpreter.InterpretedFunction.run

    def run(self, *args, **kwargs):
        events.append(("side" if where["side"] else "main", self.fn.__name__))
        return real_run(self, *args, **kwargs)

    monkeypatch.setattr(kernel_blocks, "fork", fork)
    monkeypatch.setattr(kernel_blocks, "on", on)
    monkeypatch.setattr(kernel_blocks, "join", lambda stream: events.append(("join", stream is side)))
    monkeypatch.setattr(kernel_blocks, "follow", lambda stream: events.append(("follow", stream is side)))
    monkeypatch.setattr(triton.runtime.interpreter.InterpretedFunction, "run", run)
    lane = model.new_lane()
    model(single_lane_batch(lane, torch.tensor(PROMPT), 0))  # rows complete blocks: every QSA step runs
    prompt = len(events)
    model(single_lane_batch(lane, torch.tensor(PROMPT[:1]), len(PROMPT)))  # a decode row
    sides: dict[str, set[str]] = {"moe": set(), "qsa": set(), "gdn": set()}
    site = None
    for i, (kind, what) in enumerate(events):
        if kind == "fork":
            assert site is None, "a fork inside a fork"
            site = what
        elif kind == "join":
            assert what and site is not None
            site = None
        elif kind == "follow":  # QSA's top-k waits for the index queries, normed on the main stream after the fork
            assert what and site == "qsa" and events[i - 1] == ("main", "_norm_rope_kernel")
        elif kind == "side":
            assert site is not None, f"{what} on the side stream outside a fork"
            sides[site].add(what)
        else:
            joined_first = {"_gate_up_kernel", "_gate_up_pairs_kernel", "_down_pairs_kernel",
                            "_attn_chunk_kernel", "_gdn_recurrent_kernel"}  # fmt: skip
            assert site is None or what not in joined_first, what
    assert site is None
    forks = [what for kind, what in events[:prompt] if kind == "fork"]
    qsa_layers = sum(layer.kind != LINEAR for layer in model.layers)
    gdn_layers = len(model.layers) - qsa_layers
    assert forks.count("moe") == len(model.layers) and forks.count("gdn") == gdn_layers
    assert forks.count("qsa") == qsa_layers == events[:prompt].count(("follow", True))
    assert ("fork", "gdn") not in events[prompt:]
    assert events[prompt:].count(("main", "_gdn_step_kernel")) == gdn_layers
    assert sides["moe"] == {"_linear_kernel"} and sides["gdn"] == {"_gdn_gates_kernel"}
    assert {"_norm_rope_kernel", "_rope_kernel", "_block_mean_kernel", "_index_write_kernel"} <= sides["qsa"]
    assert all(name.startswith("_index_") or name in {"_norm_rope_kernel", "_rope_kernel", "_block_mean_kernel"}
               for name in sides["qsa"])  # fmt: skip


def test_gdn_runs_in_one_launch_only_for_a_few_one_row_lanes(models) -> None:
    """`gdn_step` serves rounds whose lanes each have one row, up to GDN_STEP_ROWS of them; a lane of several rows
    or more lanes take the four kernels."""
    model = models[1]
    gdn_layers = sum(layer.kind == LINEAR for layer in model.layers)
    lanes = [model.new_lane() for _ in range(GDN_STEP_ROWS + 1)]
    for lane in lanes:
        model(single_lane_batch(lane, torch.tensor(PROMPT[:3]), 0))
    rounds = {
        "three rows of a lane": [(lanes[0], 3)],
        "one row of each of a few lanes": [(lane, 1) for lane in lanes[:GDN_STEP_ROWS]],
        "one row of each of more lanes": [(lane, 1) for lane in lanes],
    }
    steps = {}
    for name, parts in rounds.items():
        segments, start = [], 0
        for lane, rows in parts:
            segments.append(Segment(lane, start, rows))
            start += rows
        tokens = torch.tensor([PROMPT[3 + i] for _, rows in parts for i in range(rows)])
        positions = torch.tensor([lane.length + i for lane, rows in parts for i in range(rows)])
        with recording_launches() as launched:
            model(ForwardBatch(token_ids=tokens, positions=positions, segments=segments))
        steps[name] = launched.count("_gdn_step_kernel")
    assert steps == {
        "three rows of a lane": 0,
        "one row of each of a few lanes": gdn_layers,
        "one row of each of more lanes": 0,
    }


def test_the_qsa_kernels_convert_no_row_indices(models) -> None:
    """The QSA kernels take the round's int32 slots and positions as they are: no dtype conversion in them."""
    model = models[1]
    lane = model.new_lane()
    model(single_lane_batch(lane, torch.tensor(PROMPT), 0))
    conversions = []

    class Conversions(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.startswith("_to_copy"):
                sites = [f.filename for f in traceback.extract_stack() if "/kernels/" in f.filename]
                conversions.append(Path(sites[-1]).name if sites else "")
            return func(*args, **(kwargs or {}))

    with Conversions():
        fold(model, [(lane, [50])])
    assert "qsa.py" not in conversions


def test_completed_blocks_are_made_once_for_every_qsa_layer() -> None:
    """Slots and first positions of the blocks the round's rows complete, and the rows' slots and positions as int32,
    made on the first call only."""
    rnd = kernel_blocks.Round(
        SimpleNamespace(ratio=4), torch.tensor([2, 2, 5]), torch.tensor([7, 8, 3]), None, torch.tensor([0, 2]),
        torch.tensor([1, 0]), None,
    )  # fmt: skip
    slots, firsts = kernel_blocks.completed_blocks(rnd)
    assert slots.tolist() == [2, 5] and firsts.tolist() == [4, 0]
    again = kernel_blocks.completed_blocks(rnd)
    assert all(a is b for a, b in zip(again, (slots, firsts), strict=True))
    slots32, positions32 = kernel_blocks.int32_slots_positions(rnd)
    assert slots32.dtype == positions32.dtype == torch.int32
    assert slots32.tolist() == [2, 2, 5] and positions32.tolist() == [7, 8, 3]
    assert all(a is b for a, b in zip(kernel_blocks.int32_slots_positions(rnd), (slots32, positions32), strict=True))


def test_a_pending_write_read_equals_the_write_then_the_read(models) -> None:
    """`read_after` of a pending write gives `settle`'s rows and the read of them, bit for bit."""
    hc = models[1].layers[0].mlp_hyper_connection
    g = torch.Generator().manual_seed(3)
    width = hc.hc_norm.weight.shape[0]
    wide = torch.randn(3, width, generator=g).bfloat16()
    y, inject = torch.randn(3, width // hc.hc, generator=g).bfloat16(), torch.rand(3, hc.hc, generator=g).bfloat16()
    pending = PendingWrite(wide, y, inject)
    new, x, read_inject = read_after(hc, pending)
    written = settle(pending)
    want_x, want_inject = hyper_read(hc, written)
    assert torch.equal(new, written) and torch.equal(x, want_x) and torch.equal(read_inject, want_inject)
    assert not torch.equal(written, wide) and read_after(hc, wide)[0] is wide


def test_nvfp4_experts_run_in_the_moe_kernel(paths) -> None:
    ref = load_model(paths["nvfp4"], dtype="bfloat16")
    ker = load_model(paths["nvfp4"], dtype="bfloat16", kernels="on")
    # loading for the kernel path moved the codes to the kernels' word layout in place; the reference decodes both
    bank = ker.layers[0].mlp.experts
    assert "gate_up_words" in bank.nvfp4 and "gate_up_packed" not in bank.nvfp4
    assert "gate_up_packed" in ref.layers[0].mlp.experts.nvfp4
    want, got = (m(single_lane_batch(m.new_lane(), torch.tensor(PROMPT[:6]), 0)).logits for m in (ref, ker))
    assert rel_err(got, want) < 0.05
    for e in (0, bank.nvfp4["gate_up_words"].shape[0] - 1):
        got_w, want_w = bank.expert(e, torch.float32), ref.layers[0].mlp.experts.expert(e, torch.float32)
        assert all(torch.equal(a, b) for a, b in zip(got_w, want_w, strict=True))


def test_a_lane_has_the_same_bits_alone_batched_and_in_chunks(models) -> None:
    _, ker = models
    alone = ker.new_lane()
    solo = fold(ker, [(alone, PROMPT)])
    batched_lane, other = ker.new_lane(), ker.new_lane()
    batched = fold(ker, [(other, OTHER), (batched_lane, PROMPT)])
    n = len(OTHER)
    assert torch.equal(batched.hidden[n:], solo.hidden) and torch.equal(batched.logits[n:], solo.logits)
    assert_same_state(batched_lane, alone)
    chunked_lane, other_chunked = ker.new_lane(), ker.new_lane()
    first = fold(ker, [(chunked_lane, PROMPT[:3]), (other_chunked, OTHER[:4])])
    second = fold(ker, [(other_chunked, OTHER[4:]), (chunked_lane, PROMPT[3:4])])
    third = fold(ker, [(chunked_lane, PROMPT[4:])])
    chunked = torch.cat((first.hidden[:3], second.hidden[1:], third.hidden))
    assert torch.equal(chunked, solo.hidden) and torch.equal(third.logits, solo.logits[4:])
    assert torch.equal(torch.cat((first.hidden[3:], second.hidden[:1])), batched.hidden[:n])
    assert_same_state(chunked_lane, alone)
    assert_same_state(other_chunked, other)


def test_a_long_prompt_pass_takes_the_unit_norm_kernel_with_the_same_bits(models, monkeypatch) -> None:
    """A lane of LONG_RUN or more rows has q and k normalized by their own kernel; its bits equal short chunks'."""
    from model import kernel_blocks

    _, ker = models
    prompt = (PROMPT + OTHER + PROMPT)[: LONG_RUN + 2]
    flags = []
    recurrent = kernel_blocks.gdn_recurrent
    monkeypatch.setattr(
        kernel_blocks, "gdn_recurrent", lambda *a, **kw: flags.append(kw["long_runs"]) or recurrent(*a, **kw)
    )
    whole_lane, chunked_lane = ker.new_lane(), ker.new_lane()
    whole = fold(ker, [(whole_lane, prompt)])
    assert flags and all(flags)
    flags.clear()
    half = len(prompt) // 2
    chunks = [fold(ker, [(chunked_lane, prompt[:half])]), fold(ker, [(chunked_lane, prompt[half:])])]
    assert flags and not any(flags)
    assert torch.equal(torch.cat([c.hidden for c in chunks]), whole.hidden)
    assert_same_state(chunked_lane, whole_lane)


def test_verify_window_snapshots_restore_the_serial_state(models) -> None:
    _, ker = models
    lane = ker.new_lane()
    fold(ker, [(lane, PROMPT[:6])])
    serial = copy_lane(lane)
    window = fold(ker, [(ker.new_lane(), [3]), (lane, [9, 10, 11, 12])], snap=frozenset({1}))
    assert len(window.snapshots[1]) == 4 and lane.length == 10
    restore(lane, window.snapshots[1][0])  # keep the first row: the drafts at positions 7.. are rejected
    decoded = fold(ker, [(serial, [9])])
    assert torch.equal(window.logits[1], decoded.logits[0])  # a window's row = the same row decoded alone
    assert_same_state(lane, serial)
    # a different token at position 7 completes the 2-token block (6, 7) again: its block key must be rebuilt
    after, expect = fold(ker, [(lane, [44])]), fold(ker, [(serial, [44])])
    assert torch.equal(after.logits, expect.logits)
    assert_same_state(lane, serial)


def test_only_the_rows_asked_for_keep_their_states(models, monkeypatch) -> None:
    _, ker = models
    lanes = [ker.new_lane() for _ in range(4)]
    fold(ker, [(lane, PROMPT[:6]) for lane in lanes])
    kept_rows = []
    build_round = kernel_path.build_round
    monkeypatch.setattr(
        kernel_path,
        "build_round",
        lambda pool, batch, starts, rows, **kw: kept_rows.append(rows) or build_round(pool, batch, starts, rows, **kw),
    )
    batch = [(lanes[0], [3]), (lanes[1], [9, 10, 11, 12])]
    every = fold(ker, batch, snap=frozenset({1}))
    segments = [Segment(lanes[2], 0, 1), Segment(lanes[3], 1, 4)]
    rows = ForwardBatch(torch.tensor([3, 9, 10, 11, 12]), torch.tensor([6, 6, 7, 8, 9]), segments)
    one = ker(rows, snapshot_rows={1: [2, 2]})  # a row asked for twice is kept once
    assert kept_rows[-2] == [1, 2, 3, 4] and kept_rows[-1] == [3]  # batch rows, not every row of the forward
    assert list(one.snapshots) == [1] and list(one.snapshots[1]) == [2]
    a, b = one.snapshots[1][2], every.snapshots[1][2]
    assert a.length == b.length == 9 and torch.equal(a.ngram_history, b.ngram_history)
    for part in ("gdn_conv", "gdn_recurrent", "ple_conv"):
        theirs = getattr(b, part)
        assert all(torch.equal(t, theirs[i]) for i, t in getattr(a, part).items()) and getattr(a, part)


def test_a_round_keeping_every_row_has_the_conv_write_the_kept_tails(models, monkeypatch) -> None:
    """When every row of a round is kept (a lane's verify window alone) the conv kernels write the kept tails
    themselves, with no row selection after; its snapshots equal those of the same rows kept beside a row that is
    not (which the selection serves)."""
    _, ker = models
    lanes = [ker.new_lane() for _ in range(3)]
    fold(ker, [(lane, PROMPT[:6]) for lane in lanes])
    selected = []
    index_select = torch.index_select
    monkeypatch.setattr(torch, "index_select", lambda *a, **kw: selected.append(a[0].shape) or index_select(*a, **kw))
    alone = fold(ker, [(lanes[0], [9, 10, 11, 12])], snap=frozenset({0}))
    assert selected == []
    beside = fold(ker, [(lanes[2], [3]), (lanes[1], [9, 10, 11, 12])], snap=frozenset({1}))
    assert selected  # the partial keep selects its rows' tails
    for row in range(4):
        a, b = alone.snapshots[0][row], beside.snapshots[1][row]
        for part in ("gdn_conv", "gdn_recurrent", "ple_conv"):
            theirs = getattr(b, part)
            assert getattr(a, part) and all(torch.equal(t, theirs[i]) for i, t in getattr(a, part).items())


def test_mtp_rows_batched_equal_alone_and_match_the_reference(models) -> None:
    ref, ker = models
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(len(PROMPT) - 1, ker.cfg.wide_size, generator=g).to(torch.bfloat16)  # the trunk's wide rows
    other_hidden = torch.randn(len(OTHER) - 1, ker.cfg.wide_size, generator=g).to(torch.bfloat16)

    def mtp(model, parts):
        tokens, positions, segments, wides = [], [], [], []
        for lane, ids, wide in parts:
            segments.append(Segment(lane, len(tokens), len(ids)))
            tokens.extend(ids)
            positions.extend(range(len(ids)))
            wides.append(wide)
        batch = ForwardBatch(torch.tensor(tokens), torch.tensor(positions), segments)
        return model.mtp_forward(batch, torch.cat(wides))

    alone_logits, alone_wide = mtp(ker, [(ker.new_lane(), PROMPT[1:], hidden)])
    lane = ker.new_lane()
    logits, wide = mtp(ker, [(ker.new_lane(), OTHER[1:], other_hidden), (lane, PROMPT[1:], hidden)])
    n = len(OTHER) - 1
    assert torch.equal(logits[n:], alone_logits) and torch.equal(wide[n:], alone_wide)
    assert lane.mtp_length == len(PROMPT) - 1
    want, _ = mtp(ref, [(ref.new_lane(), PROMPT[1:], hidden)])
    assert rel_err(alone_logits, want) < 0.05


def test_ngram_rows_of_windows_equal_the_reference_hash(models) -> None:
    _, ker = models
    emb = next(layer.ple for layer in ker.layers if layer.ple is not None).ple_embedding
    lanes = [ker.new_lane(), ker.new_lane()]
    lanes[1].ngram_history = torch.tensor([5, 17])
    ids = [torch.tensor([5, 5, 8, 9, 5]), torch.tensor([3, 5, 4])]
    batch = ForwardBatch(
        torch.cat(ids), torch.zeros(8, dtype=torch.long), [Segment(lanes[0], 0, 5), Segment(lanes[1], 5, 3)]
    )
    windows = kernel_path.ngram_windows(batch, ker.cfg.ngram_size)
    got = ngram_rows_reference(windows, emb.eos, emb.multipliers, emb.moduli, emb.offsets, emb.heads_per_ngram)
    multipliers = hash_multipliers_on(tuple(emb.multipliers), windows.device)
    heads = emb.moduli.shape[0]
    kernel = ngram_rows(windows, emb.eos, multipliers, emb.moduli, emb.offsets, emb.heads_per_ngram, (0, heads))
    half = ngram_rows(windows, emb.eos, multipliers, emb.moduli, emb.offsets, emb.heads_per_ngram, (2, heads), 40)
    want = torch.cat(
        [
            ngram_row_ids(lane.ngram_history, t, emb.eos, emb.multipliers, emb.moduli, emb.offsets, emb.heads_per_ngram)
            for lane, t in zip(lanes, ids, strict=True)
        ]
    )
    assert torch.equal(got, want) and torch.equal(kernel, want)
    assert torch.equal(half, want[:, 2:] - 40)  # a rank's heads, from its first local row


def test_bad_combinations_are_refused_by_setting(models, paths, monkeypatch) -> None:
    _, ker = models
    assert resolve_kernels("auto", "cuda") and not resolve_kernels("auto", "cpu")
    assert resolve_kernels("on", "cpu") and not resolve_kernels("off", "cuda")
    with pytest.raises(ValueError, match="--kernels"):
        resolve_kernels("sometimes", "cpu")
    with pytest.raises(ValueError, match="--dtype"):
        load_model(paths["bf16"], dtype="float32", kernels="on")
    narrow = dataclasses.replace(ker.cfg, linear_key_head_dim=8)
    with pytest.raises(ValueError, match="linear_key_head_dim"):
        kernel_path.check(narrow, torch.bfloat16, torch.device("cpu"), ker.tp)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="--device cuda"):
        kernel_path.check(ker.cfg, torch.bfloat16, torch.device("cpu"), ker.tp)
    with pytest.raises(ValueError, match="--device cuda"):  # the device first: --dtype bfloat16 would not mend it
        kernel_path.check(ker.cfg, torch.float32, torch.device("cpu"), ker.tp)


@pytest.mark.parametrize(
    ("setting", "changes"),
    [
        ("linear_conv_kernel_dim", {"linear_conv_kernel_dim": 1}),
        ("ple_conv_kernel_size", {"ple_conv_kernel_size": 1}),
        ("head_dim", {"head_dim": 2048}),
        ("indexer_head_dim", {"indexer_head_dim": 2048}),
    ],
)
def test_sizes_the_kernels_cannot_take_are_refused_at_load_by_setting(models, setting: str, changes: dict) -> None:
    """A conv of one tap (the conv kernel needs two) or a head wider than norm + RoPE's one chunk (1,024) is refused
    before any weight is read, naming the setting, not at the first forward by a kernel's argument."""
    _, ker = models
    with pytest.raises(ValueError, match=setting):
        kernel_path.check(dataclasses.replace(ker.cfg, **changes), torch.bfloat16, torch.device("cpu"), ker.tp)


def test_a_one_tap_ple_conv_is_taken_without_ple_layers(models) -> None:
    """The PLE conv's width is not checked where the model has no PLE layer to run it."""
    _, ker = models
    kernel_path.check(
        dataclasses.replace(ker.cfg, ple_conv_kernel_size=1, ple_layers=()), torch.bfloat16, torch.device("cpu"), ker.tp
    )


def test_the_kernels_setting_is_checked_at_start_and_agreed_by_the_ranks(paths, capsys) -> None:
    from server.cli import build_parser, main
    from server.serve import canonical_settings
    from server.settings import EnvSettings

    args = build_parser().parse_args(["serve", str(paths["bf16"])])
    assert args.kernels == "auto" and canonical_settings(args, 2, EnvSettings())["kernels"] == "off"
    on_gpu = build_parser().parse_args(["serve", str(paths["bf16"]), "--device", "cuda"])
    assert canonical_settings(on_gpu, 2, EnvSettings())["kernels"] == "on"
    argv = ["generate", str(paths["bf16"]), "--kernels", "on", "--dtype", "float32", "--prompt-ids", "1"]
    assert main(argv) == 2
    assert "--dtype" in capsys.readouterr().err


def test_gpu_forward_check_pure_parts(tmp_path, models) -> None:
    import gpu_forward_check as script

    args = script.parse_args(["--out", str(tmp_path), "--models", "tiny"])
    assert args.out == tmp_path and args.models == ["tiny"] and args.steps > 0
    texts = script.prompts(64, 320, 0)
    assert texts == script.prompts(64, 320, 0) and len(texts) == 64
    assert all(5 <= len(t) <= 24 and min(t) >= 0 and max(t) < 320 for t in texts)
    assert len({len(t) for t in texts}) > 10
    assert script.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert script.first_divergence([1, 2, 3], [1, 4, 3]) == 1 and script.first_divergence([1, 2], [1, 2, 3]) == 2
    _, ker = models
    a, b = ker.new_lane(), ker.new_lane()
    assert script.state_diff(a, b) is None
    b.length += 1
    assert script.state_diff(a, b) == "length"
    if not torch.cuda.is_available():
        assert script.main(["--out", str(tmp_path)]) == 2
