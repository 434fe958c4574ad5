"""The kernel path: a forward that runs every row of a round through each layer at once, on the Triton kernels.

One launch per op covers the whole round, and every kernel gives a row the bits it would have alone (fixed
reduction orders, per-lane state by `lane_of_row`), so a row's output does not depend on how many rows or lanes
share the round or where its segment sits: drafted = undrafted, concurrent = solo, prompt in chunks = whole
(design §5). Lanes keep their own tensors (model/state.py): before a layer the round's lane states are stacked into
the kernels' [L, ...] layout, the kernels update the stack in place and the lanes take back views of it; QSA rows
are written into each lane's cache, whose keys and values are concatenated for the attention. A persistent slot
pool that the kernels update in place is the follow-up that removes these copies. A forward asked for snapshots
keeps the GDN states and conv tails after the rows it lists (`keep_rows`; a verify window lists every row), so a
lane restores to the state after any of them.
"""

from __future__ import annotations

import bisect
import functools
import os
from collections.abc import Collection, Mapping

import torch

from kernels.gdn import LONG_RUN, kept_row_places, run_firsts
from kernels.gdn_chunk import CHUNK, Run, chunk_spans, plan_chunks, recurrent_lanes
from kernels.host import to_device
from kernels.norm import MAX_BLOCK, zc_rms_norm
from model.config import LINEAR, FlashNextConfig
from model.flashnext import FlashNextModel, ForwardOutput
from model.graphs import LISTED_LOGITS, RoundGraphs
from model.kernel_blocks import Round, SharedOutputs, block_keys_of, hyper_read, layer_forward, project, settle
from model.lane_pool import MTP, LanePool
from model.layers import ForwardBatch
from model.parallel import TensorParallel
from model.peer_sums import forward_sites
from model.state import KeptRow, LaneSnapshot


def check(cfg: FlashNextConfig, dtype: torch.dtype, device: torch.device, tp: TensorParallel) -> None:
    """Refuse, naming the setting or config field, a model the kernels cannot run (before any weight is read); the
    device first, since no other setting mends that."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"--kernels on: the Triton kernels run on --device cuda, not {device.type}; pass --kernels off"
        )
    if dtype != torch.bfloat16:
        raise ValueError(
            f"--kernels on: the kernels take bfloat16 weights and activations, but --dtype gives {dtype}; "
            "pass --dtype bfloat16 or --kernels off"
        )
    powers = {
        "linear_key_head_dim": (cfg.linear_key_head_dim, 16),
        "linear_value_head_dim": (cfg.linear_value_head_dim, 16),
        "head_dim": (cfg.head_dim, 16),
        "indexer_head_dim": (cfg.indexer_head_dim, 1),
    }
    for name, (value, least) in powers.items():
        if value < least or value & (value - 1):
            raise ValueError(f"--kernels on: {name} must be a power of two >= {least} for the kernels, got {value}")
    for name in ("head_dim", "indexer_head_dim"):  # norm + RoPE takes a head in one chunk
        if powers[name][0] > MAX_BLOCK:
            raise ValueError(f"--kernels on: {name} must be at most {MAX_BLOCK} for the kernels, got {powers[name][0]}")
    convs = {"linear_conv_kernel_dim": (cfg.linear_conv_kernel_dim, LINEAR in cfg.layer_types)}
    convs["ple_conv_kernel_size"] = (cfg.ple_conv_kernel_size, bool(cfg.ple_layers))
    for name, (taps, used) in convs.items():
        if used and taps < 2:
            raise ValueError(f"--kernels on: {name} must be at least 2 for the conv kernel, got {taps}")
    if cfg.hidden_size % 16 or not 1 <= cfg.hc_count <= 16:
        raise ValueError(
            f"--kernels on: hidden_size must be a multiple of 16 and hc_count at most 16, got {cfg.hidden_size} "
            f"and {cfg.hc_count}"
        )
    lo, hi = tp.span(cfg.moe_intermediate_size, "moe_intermediate_size")
    if (hi - lo) % 16:
        raise ValueError(
            f"--kernels on: a rank's share of moe_intermediate_size must be a multiple of 16, got {hi - lo}"
        )


def lane_pool(model: FlashNextModel, slots: int = 16, context: int = 4096) -> LanePool:
    """The model's lane pool, made on first use with `slots` slots of `context` positions (it grows on demand;
    the server sizes it at start)."""
    if model.lane_pool is None:
        idx_of = {MTP if layer.is_mtp else layer.index: layer.self_attn for layer in qsa_layers(model)}
        block_keys = {
            key: functools.partial(block_keys_of, m.indexer, rotary_dim=m.rotary_dim, theta=m.theta)
            for key, m in idx_of.items()
        }
        ratio = model.cfg.indexer_compress_ratio
        model.lane_pool = LanePool(model.new_lane(), slots, context, ratio, block_keys)
    return model.lane_pool


def qsa_layers(model: FlashNextModel) -> list:
    """The QSA decoder layers of the trunk and the MTP layer."""
    layers = list(model.layers) + ([] if model.mtp is None else list(model.mtp.layers))
    return [layer for layer in layers if layer.kind != LINEAR]


def segment_starts(batch: ForwardBatch) -> list[int]:
    """Each segment's first absolute position (the batch's `starts` when it has them: no copy from the device);
    refuses segments that do not tile the rows in order, rows whose positions are not consecutive, or a lane in two
    segments."""
    rows = batch.token_ids.shape[0]
    if batch.starts is not None and len(batch.starts) != len(batch.segments):
        raise ValueError(f"the batch gives {len(batch.starts)} starts for {len(batch.segments)} segments")
    positions = batch.positions.tolist() if batch.starts is None else None
    starts, end = [], 0
    for i, seg in enumerate(batch.segments):
        if seg.start != end or seg.length < 1:
            raise ValueError(f"segment {i} does not continue the rows at {end} with at least one row")
        if positions is None:
            first = batch.starts[i]
        else:
            first = positions[seg.start]
            if positions[seg.rows] != list(range(first, first + seg.length)):
                raise ValueError(f"segment {i}: its rows' positions are not consecutive")
        starts.append(first)
        end += seg.length
    if end != rows:
        raise ValueError(f"the segments cover {end} of the batch's {rows} rows")
    if len({id(seg.lane) for seg in batch.segments}) != len(batch.segments):
        raise ValueError("a lane appears in two segments of one forward")
    return starts


def lane_runs(batch: ForwardBatch, starts: list[int]) -> list[Run]:
    """Each segment's rows as a run of its lane."""
    return [(seg.start, seg.length, first, seg.lane.slot) for seg, first in zip(batch.segments, starts, strict=True)]


def check_keeps(spans: list[range], keep_rows: list[int]) -> None:
    """Refuse a state kept inside a chunk (`spans`: the rows the chunked form takes, `chunk_spans`): the chunked form
    makes a state only at a chunk's end."""
    for span in spans:
        inside = [r for r in keep_rows if r in span and (r - span.start) % CHUNK != CHUNK - 1]
        if inside:
            raise ValueError(
                f"a state is kept after row {inside[0]}, inside a GDN chunk of rows {span.start}..{span.stop - 1}: "
                f"prompt passes keep states only at positions that are multiples of {CHUNK}"
            )


def build_round(
    pool: LanePool,
    batch: ForwardBatch,
    starts: list[int],
    keep_rows: list[int] | None,
    ngram_size: int | None,
    chunked_runs: list[Run] | None = None,
) -> Round:
    """The round's rows as the kernels take them (the lanes placed in the pool), keeping the states after
    `keep_rows` (batch row indices, ascending); with `chunked_runs` (the lanes' runs of a round with whole GDN chunks,
    `lane_runs`) those chunks go to GDN's chunked form."""
    device = batch.token_ids.device
    windows = None if ngram_size is None else ngram_windows(batch, ngram_size)
    ratio = pool.ratio
    completing = [
        (seg.start + p - first, p // ratio)
        for seg, first in zip(batch.segments, starts, strict=True)
        for p in range(first, first + seg.length)
        if (p + 1) % ratio == 0
    ]
    block_rows = to_device(device, [r for r, _ in completing], torch.long)
    block_dest = to_device(device, [b for _, b in completing], torch.long)
    kept = None if keep_rows is None else to_device(device, keep_rows, torch.long)
    rows = batch.token_ids.shape[0]
    places = None if kept is None or len(keep_rows) == rows else kept_row_places(kept, rows)  # once, not per layer
    slots = row_slots(batch)
    rnd = Round(
        pool, to_device(device, slots, torch.long), batch.positions, windows, block_rows, block_dest, kept,
        has_long_run(batch), keep_places=places, single_rows=all(seg.length == 1 for seg in batch.segments),
    )  # fmt: skip
    if chunked_runs is not None:
        lanes = recurrent_lanes(slots, chunked_runs)
        rnd.chunks = plan_chunks(chunked_runs, rows, device)
        rnd.recurrent_lanes = to_device(device, lanes, torch.long)
        # a segment starts one run at most
        rnd.recurrent_firsts = to_device(device, run_firsts(lanes, len(chunked_runs)), torch.int32)
    return rnd


def has_long_run(batch: ForwardBatch) -> bool:
    """Whether a lane has `kernels.gdn.LONG_RUN` or more rows in the batch (GDN's prompt-pass kernels serve it)."""
    return max((seg.length for seg in batch.segments), default=0) >= LONG_RUN


def logit_inputs(rnd: Round, wide: torch.Tensor) -> torch.Tensor:
    """The wide rows whose logits a forward makes: the round's logit rows, or every row."""
    return wide if rnd.logit_rows is None else wide.index_select(0, rnd.logit_rows)


def row_slots(batch: ForwardBatch) -> torch.Tensor:
    """Each row's lane-pool slot, on the host, built in Python (torch's CPU repeat_interleave starts its thread pool
    for a few lanes: milliseconds a round beside a busy second rank)."""
    return torch.tensor([seg.lane.slot for seg in batch.segments for _ in range(seg.length)], dtype=torch.long)


def ngram_windows(batch: ForwardBatch, n: int) -> torch.Tensor:
    """Each row's last n tokens [N, n], oldest first: its lane's n-gram history, then the segment's rows (rows of
    the n-wide windows over the lanes' tokens laid end to end; one lane's are all of them)."""
    parts = [t for seg in batch.segments for t in (seg.lane.ngram_history.long(), batch.token_ids[seg.rows].long())]
    windows = torch.cat(parts).unfold(0, n, 1)
    if len(batch.segments) == 1:
        return windows.contiguous()
    # segment i's history sits before its rows, after i earlier histories: row r's window starts at r + i (n - 1)
    firsts = [
        row + i * (n - 1) for i, seg in enumerate(batch.segments) for row in range(seg.start, seg.start + seg.length)
    ]
    return windows.index_select(0, to_device(windows.device, firsts, torch.long))


def snapshots(
    rnd: Round, windows: torch.Tensor, batch: ForwardBatch, starts: list[int], rows: list[int], by_row: bool = False
) -> dict[int, dict[int, LaneSnapshot]]:
    """By segment index and row offset, the lane after each of the kept `rows` (batch row indices, ascending);
    the round kept the states of those rows in order, or with `by_row` of every row; `windows` are the rows'
    n-gram windows. The states are `KeptRow`s of the round's kept stacks: no view is made until one is read."""
    kept, out = rnd.kept, {}
    firsts = [seg.start for seg in batch.segments]
    for order, row in enumerate(rows):
        k = row if by_row else order
        index = bisect.bisect_right(firsts, row) - 1
        offset = row - firsts[index]
        out.setdefault(index, {})[offset] = LaneSnapshot(
            gdn_conv=KeptRow(kept.gdn_conv, k),
            gdn_recurrent=KeptRow(kept.gdn_recurrent, k),
            ple_conv=KeptRow(kept.ple_conv, k),
            ngram_history=windows[row, 1:],
            length=starts[index] + offset + 1,
        )
    return out


def place(model: FlashNextModel, batch: ForwardBatch, starts: list[int]) -> LanePool:
    """Give the batch's lanes pool slots with room for its rows."""
    pool = lane_pool(model)
    end = max(first + seg.length for seg, first in zip(batch.segments, starts, strict=True))
    pool.place([seg.lane for seg in batch.segments], end)
    return pool


def fold_caches(lane_caches: list, end: int, ratio: int) -> None:
    """Host bookkeeping after rows up to position `end` were written: the caches hold exactly that prefix."""
    for cache in lane_caches:
        cache.length, cache.blocks = end, end // ratio


def vocab_logits(model: FlashNextModel, mixed: torch.Tensor, shared: SharedOutputs | None = None) -> torch.Tensor:
    """Logits over the whole vocabulary: each rank's lm_head rows by the linear kernel, gathered in rank order (into
    the graphs' shared buffer when given; one rank's logits are the kernel's own output, which a copy would only
    repeat)."""
    local = project(mixed, model.lm_head)
    if shared is None or model.tp.world == 1:
        return model.tp.gather(local, dim=-1)
    shape = (local.shape[0], local.shape[1] * model.tp.world)
    return model.tp.gather(local, dim=-1, out=shared.take("logits", 0, shape, local))


def logits(model: FlashNextModel, hidden: torch.Tensor, shared: SharedOutputs | None = None) -> torch.Tensor:
    """lm_head logits of pre-mixer wide rows [N, wide], all at once."""
    mixed, _ = hyper_read(model.hyper_connection_mixer, hidden.contiguous())
    return vocab_logits(model, mixed, shared)


def run_layers(model: FlashNextModel, token_ids: torch.Tensor, rnd: Round) -> torch.Tensor:
    """Embed the rows and run them through every decoder layer: the round's GPU work before the logits."""
    with forward_sites(model.tp.peer):
        wide = model.embed_tokens(token_ids).repeat(1, model.cfg.hc_count)
        for layer in model.layers:
            wide = layer_forward(layer, wide, rnd)
        return settle(wide)


def enable_graphs(
    model: FlashNextModel, max_rows: Mapping[str, int], listed_logits: int = LISTED_LOGITS
) -> RoundGraphs:
    """Capture the model's forwards for up to `max_rows` rows of each kind (trunk, verify, prompt, mtp), prompt and
    MTP graphs giving up to `listed_logits` rows' logits, on CUDA; elsewhere replays run eagerly."""
    cfg = model.cfg

    def trunk(rnd: Round, token_ids: torch.Tensor, _hidden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        wide = run_layers(model, token_ids, rnd)
        return logits(model, logit_inputs(rnd, wide), rnd.shared), wide

    def mtp(rnd: Round, token_ids: torch.Tensor, hidden: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return mtp_rows(model, token_ids, hidden, rnd)

    # the prompt graphs before the MTP's: an MTP replay then never writes over a prompt round's kept states
    bodies = {"trunk": trunk, "verify": trunk, "prompt": trunk} | ({} if model.mtp is None else {"mtp": mtp})
    rows = {kind: max_rows[kind] for kind in bodies if max_rows.get(kind)}
    pool = lane_pool(model)
    graphs = RoundGraphs(
        pool, bodies, rows, cfg.ngram_size, cfg.eos_token_id, cfg.wide_size, model.dtype, model.device, listed_logits
    )
    graphs.capture_all()
    model.round_graphs = graphs
    return graphs


def graph_kind(graphs: RoundGraphs, batch: ForwardBatch, keeps: int, logits: int, chunked: bool) -> str | None:
    """The graph that replays a round keeping `keeps` rows' states and giving `logits` rows' logits (None: run
    eagerly): a verify graph keeps every row's; a prompt graph runs GDN's prompt-pass kernels (the same bits) and its
    chunked form (the only kind that does, so a `chunked` round takes no other), keeps a few listed rows' states and
    gives the logits of a few rows."""
    rows = batch.token_ids.shape[0]
    smallest = (graphs.buckets.get("prompt") or (0,))[0]
    prompt_sized = has_long_run(batch) and rows > smallest // 2  # smaller rounds pad less in a trunk bucket
    if chunked:
        order: tuple[str, ...] = ("prompt",)
    else:
        order = ("verify", "prompt") if keeps else ("prompt", "trunk") if prompt_sized else ("trunk",)
    return next((kind for kind in order if graphs.covers(kind, rows, keeps, logits)), None)


def forward(
    model: FlashNextModel,
    batch: ForwardBatch,
    logit_rows: torch.Tensor | None,
    snapshot_rows: Mapping[int, Collection[int]],
) -> ForwardOutput:
    """`FlashNextModel.forward` on the kernels: every segment's rows through each layer at once (a replay of a
    captured graph when the model has one for this many rows); states are kept only after the rows snapshot (a
    verify window's rows, a kept prompt boundary)."""
    keep_rows = sorted({batch.segments[i].start + k for i, offsets in snapshot_rows.items() for k in offsets})
    starts = segment_starts(batch)
    for i, (seg, first) in enumerate(zip(batch.segments, starts, strict=True)):
        if first != seg.lane.length:
            raise ValueError(f"segment {i} starts at position {first} but its lane holds {seg.lane.length} tokens")
    pool = place(model, batch, starts)
    runs = lane_runs(batch, starts)
    spans = chunk_spans(runs)
    check_keeps(spans, keep_rows)
    graphs = model.round_graphs
    wanted = batch.token_ids.shape[0] if logit_rows is None else logit_rows.shape[0]
    kind = None if graphs is None else graph_kind(graphs, batch, len(keep_rows), wanted, any(spans))
    replay = kind is not None
    if replay:
        windows = ngram_windows(batch, model.cfg.ngram_size)
        slots = row_slots(batch)
        all_logits, wide, rnd = graphs.run(
            kind, batch.token_ids, batch.positions, slots, windows, keep_rows=keep_rows, logit_rows=logit_rows,
            runs=runs,
        )  # fmt: skip
        if kind == "prompt":  # its logits are already those of logit_rows
            logit_rows = None
    else:
        chunked = runs if any(spans) else None
        rnd = build_round(pool, batch, starts, keep_rows or None, ngram_size=model.cfg.ngram_size, chunked_runs=chunked)
        windows = rnd.windows
        wide = run_layers(model, batch.token_ids, rnd)
        all_logits = None
    snaps = {i: {} for i in snapshot_rows} | snapshots(rnd, windows, batch, starts, keep_rows, kind == "verify")
    for seg in batch.segments:
        lane = seg.lane
        lane.ngram_history = windows[seg.start + seg.length - 1, 1:]
        lane.length += seg.length
        fold_caches(list(lane.attention.values()), lane.length, pool.ratio)
    if all_logits is not None:
        return ForwardOutput(all_logits if logit_rows is None else all_logits[logit_rows], wide, snaps)
    rows = wide if logit_rows is None else wide[logit_rows]
    return ForwardOutput(logits=logits(model, rows), hidden=wide, snapshots=snaps)


def mtp_rows(
    model: FlashNextModel, token_ids: torch.Tensor, hidden: torch.Tensor, rnd: Round
) -> tuple[torch.Tensor, torch.Tensor]:
    """The MTP layer over every row at once: (draft logits of the round's logit rows, the MTP's pre-mixer wide
    states of every row)."""
    mtp = model.mtp
    n = hidden.shape[0]
    e_norm, h_norm = mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden
    u = project(zc_rms_norm(model.embed_tokens(token_ids), e_norm.weight, e_norm.eps), mtp.fc_embedding)
    streams = zc_rms_norm(hidden, h_norm.weight, h_norm.eps).view(n * mtp.hc, mtp.d)  # one RMS over every stream
    wide = (project(streams, mtp.fc_hidden).view(n, mtp.hc, mtp.d) + u.unsqueeze(1)).flatten(1)
    with forward_sites(model.tp.peer):
        wide = settle(layer_forward(mtp.layers[0], wide, rnd))
    mixed, _ = hyper_read(mtp.hyper_connection_mixer, logit_inputs(rnd, wide))
    return vocab_logits(model, mixed, rnd.shared), wide


def mtp_forward(
    model: FlashNextModel, batch: ForwardBatch, hidden: torch.Tensor, logit_rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`FlashNextModel.mtp_forward` on the kernels: every row through the MTP layer at once (a replay of a
    captured graph when the model has one for these rows), logits for `logit_rows` only (None: every row)."""
    starts = segment_starts(batch)
    pool = place(model, batch, starts)
    graphs, rows = model.round_graphs, batch.token_ids.shape[0]
    if graphs is not None and graphs.covers("mtp", rows, 0, rows if logit_rows is None else logit_rows.shape[0]):
        logits, wide, _ = graphs.run(
            "mtp", batch.token_ids, batch.positions, row_slots(batch), hidden=hidden, logit_rows=logit_rows
        )
    else:
        rnd = build_round(pool, batch, starts, None, ngram_size=None)
        rnd.logit_rows = None if logit_rows is None else logit_rows.to(model.device)
        logits, wide = mtp_rows(model, batch.token_ids, hidden, rnd)
    for seg, first in zip(batch.segments, starts, strict=True):
        seg.lane.mtp_length = first + seg.length
        fold_caches([seg.lane.mtp_attention], seg.lane.mtp_length, pool.ratio)
    return logits, wide
