"""The decoder layer's sub-blocks on the kernel path: every row of a round at once, through the Triton kernels.

Row reductions run in kernels whose per-row bits do not depend on the batch; what torch does here is elementwise (the
same per element whatever the batch), gathers and copies. The GDN gates, the sigmoid gates of QSA's output and PLE's
values and RoPE with the cache writes are elementwise kernels (one launch each, not a handful of torch ops), and the
shared expert's silu·up is its gate-up launch's epilogue; their sigmoid is an fp32 formula over exp rather than torch's
own, which on the CPU rounds differently in the vector body and the scalar tail of a tensor and would tie a row's bits
to the batch.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from kernels.conv import causal_conv_update
from kernels.fp4_words import kernel_bank
from kernels.gates import gdn_gates, sigmoid_mul
from kernels.gdn import gdn_recurrent
from kernels.gdn_chunk import ChunkPlan, gdn_prompt
from kernels.gdn_step import fits as gdn_step_fits
from kernels.gdn_step import gdn_step
from kernels.hyper import hc_read, hc_write, hc_write_read
from kernels.linear import linear, linear_silu_mul, linear_topk, pair_rows
from kernels.moe import SharedGate, moe_forward
from kernels.ngram import ngram_rows
from kernels.norm import block_mean, gated_rms_norm, group_dot, zc_rms_norm
from kernels.peer import PeerSum
from kernels.qsa import qsa_index, qsa_sparse_attention
from kernels.rope import norm_rope, rope_inv_freq, scatter_rows
from model.config import LINEAR
from model.gdn import GatedDeltaNet
from model.hyper import GatedResidual, Linear, set_parameter
from model.lane_pool import MTP, LanePool
from model.layers import DecoderLayer
from model.moe import ExpertBank, SparseMoE
from model.parallel import TensorParallel
from model.ple import PLELayer
from model.qsa import QSAIndexer, QSAttention
from model.side_stream import follow, fork, join, on

SHARED_PAIRS = "_pairs:shared_expert"  # where `shared_pairs_weight` keeps its tensor on the MoE module
GDN_STEP_ROWS = 4  # the most one-row lanes GDN takes in one launch; more run faster apart (docs/performance.md)


@dataclass(slots=True)
class RowStates:
    """The states after the rows a forward snapshots, by layer index: GDN conv tails and recurrent states, PLE conv
    tails, each [K, ...] for the K rows of `Round.keep_rows` in order."""

    gdn_conv: dict[int, torch.Tensor] = field(default_factory=dict)
    gdn_recurrent: dict[int, torch.Tensor] = field(default_factory=dict)
    ple_conv: dict[int, torch.Tensor] = field(default_factory=dict)


class SharedOutputs:
    """Where captured graphs write what outlives a replay (the states they keep, logits at two ranks), one buffer per
    layer and output shared by every graph: a round reads them before the next round's forward (the runner clones the
    logits at once and copies kept states out before its next forward), so no bucket holds its own."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, int], torch.Tensor] = {}

    def take(self, name: str, index: int, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """The first shape[0] rows of layer `index`'s buffer `name` (of `like`'s dtype and device); made when absent
        or too small, on the warm-up before a capture (graphs captured earlier keep the buffer they wrote)."""
        buffer = self.buffers.get((name, index))
        fits = buffer is not None and buffer.shape[0] >= shape[0] and buffer.shape[1:] == shape[1:]
        if not fits or buffer.dtype != like.dtype or buffer.device != like.device:
            if like.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"shared output {name} of layer {index} must exist before its graph is captured")
            buffer = like.new_empty(shape)
            self.buffers[name, index] = buffer
        return buffer[: shape[0]]

    def nbytes(self) -> int:
        """Bytes the buffers hold."""
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


@dataclass(slots=True)
class Round:
    """One forward's rows as the kernels take them, all on the GPU (so a CUDA graph can capture the layers): each
    row's lane-pool slot and absolute position, its n-gram window (None: no PLE), the rows that complete an
    indexer block with the block index their key goes to, the rows whose states are kept (None: none), and whether a
    lane has `kernels.gdn.LONG_RUN` or more rows (the prompt graphs say so for any rows: the bits are the same); with
    `chunks`, the prompt rows GDN takes in whole chunks, and `recurrent_lanes`, each row's slot or -1 for those rows."""

    pool: LanePool
    slot_of_row: torch.Tensor
    positions: torch.Tensor
    windows: torch.Tensor | None
    block_rows: torch.Tensor
    block_dest: torch.Tensor
    keep_rows: torch.Tensor | None
    long_runs: bool = False
    kept: RowStates = field(default_factory=RowStates)
    keep_places: torch.Tensor | None = None  # each row's place among keep_rows or -1, where a graph fixes it
    logit_rows: torch.Tensor | None = None  # the only rows whose logits a forward makes (None: every row)
    shared: SharedOutputs | None = None  # where kept states and logits go (None: new tensors)
    chunks: ChunkPlan | None = None
    recurrent_lanes: torch.Tensor | None = None
    recurrent_firsts: torch.Tensor | None = None  # the rows that start the recurrence's runs (-1: none)
    single_rows: bool = False  # every lane has one row (decode): GDN in one launch for `GDN_STEP_ROWS` rows or fewer
    blocks: tuple[torch.Tensor, torch.Tensor] | None = None  # `completed_blocks`, once a round
    int32_rows: tuple[torch.Tensor, torch.Tensor] | None = None  # `int32_slots_positions`, once a round


def int32_slots_positions(rnd: Round) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' slots and positions as int32, as the QSA kernels take them: converted by the first QSA layer, read
    by every other."""
    if rnd.int32_rows is None:
        rnd.int32_rows = (rnd.slot_of_row.to(torch.int32), rnd.positions.to(torch.int32))
    return rnd.int32_rows


def completed_blocks(rnd: Round) -> tuple[torch.Tensor, torch.Tensor]:
    """(slots [B], first positions [B]) of the indexer blocks the round's rows complete: made by the first QSA layer,
    read by every other."""
    if rnd.blocks is None:
        ratio = rnd.pool.ratio
        rnd.blocks = (rnd.slot_of_row[rnd.block_rows], rnd.positions[rnd.block_rows] // ratio * ratio)
    return rnd.blocks


def kept_buffer(rnd: Round, name: str, index: int, like: torch.Tensor) -> torch.Tensor | None:
    """Where layer `index` puts the states after the round's kept rows (rows shaped as `like`'s): the graphs'
    shared buffer, or None for a new tensor."""
    if rnd.keep_rows is None or rnd.shared is None:
        return None
    return rnd.shared.take(name, index, (rnd.keep_rows.shape[0], *like.shape[1:]), like)


def keeps_every_row(rnd: Round, rows: int) -> bool:
    """Whether the round keeps the states after each of its `rows` rows, in order (a verify round): keep_rows then
    lists them all and no graph input places them (`build_round` and the verify graphs)."""
    return rnd.keep_rows is not None and rnd.keep_places is None and rnd.keep_rows.shape[0] == rows


def row_tails_for(rnd: Round, name: str, index: int, tails: torch.Tensor, rows: int) -> torch.Tensor | None:
    """Where the conv writes each row's tail (None where the round keeps no state): when every row is kept, straight
    into the kept tails' buffer (no selection after), else a scratch tensor `keep_tails` selects from."""
    if rnd.keep_rows is None:
        return None
    buffer = kept_buffer(rnd, name, index, tails) if keeps_every_row(rnd, rows) else None
    return buffer if buffer is not None else tails.new_empty((rows, *tails.shape[1:]))


def keep_tails(rnd: Round, name: str, index: int, row_tails: torch.Tensor) -> torch.Tensor:
    """The conv tails after the round's kept rows: `row_tails` itself when every row is kept."""
    if keeps_every_row(rnd, row_tails.shape[0]):
        return row_tails
    return torch.index_select(row_tails, 0, rnd.keep_rows, out=kept_buffer(rnd, name, index, row_tails))


def project(x: torch.Tensor, proj: Linear, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """x [N, K] · Wᵀ by the linear kernel (fp32 sums in a fixed order, rounded once)."""
    return linear(x, proj.weight, out_dtype)


def partial_out(x: torch.Tensor, proj: Linear, tp: TensorParallel) -> torch.Tensor:
    """A row-split projection's partial output: bf16 at one rank; with more, its bf16 values stored as fp32, so the
    ranks' reduction sums it in place."""
    return linear(x, proj.weight, torch.float32, round_bf16=True) if tp.world > 1 else project(x, proj)


def write_input(y: torch.Tensor | PeerSum, wide: torch.Tensor) -> torch.Tensor | PeerSum:
    """A sub-block's reduced output as hc_write takes it: [N, d] in wide's dtype, an fp32 sum as one partial
    [1, N, d] (the write rounds it once, as `TensorParallel.combine` would have), or a PeerSum the write sums."""
    return y if isinstance(y, PeerSum) or y.dtype == wide.dtype else y.unsqueeze(0)


def _stacked_once(
    owner: nn.Module, key: str, what: str, stack: Callable[[], tuple[torch.Tensor, dict[str, torch.Tensor]]]
) -> torch.Tensor:
    """`owner`'s stacked weight `key`, made by `stack` (the tensor, and each projection weight's view of it, which
    replaces that weight, so no memory is doubled) at the first call, which must come before any graph capture."""
    stacked = owner.__dict__.get(key)
    if stacked is None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{what} must exist before a CUDA graph is captured")
        stacked, views = stack()
        for name, view in views.items():
            set_parameter(owner, name, view)
        owner.__dict__[key] = stacked
    return stacked


def fused_weight(owner: nn.Module, names: tuple[str, ...]) -> torch.Tensor:
    """The weights of `owner`'s projections `names` (which share an input) stacked into one [sum of outputs, K], so
    the kernel path runs them as one linear launch; the projections' weights become views of it (`_stacked_once`)."""

    def stack() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        parts = [owner.get_submodule(name).weight for name in names]
        fused, views, start = torch.cat(parts), {}, 0
        for name, part in zip(names, parts, strict=True):
            views[f"{name}.weight"] = fused[start : start + part.shape[0]]
            start += part.shape[0]
        return fused, views

    return _stacked_once(owner, "_fused:" + ",".join(names), f"fused weights {names}", stack)


def shared_pairs_weight(m: SparseMoE) -> torch.Tensor:
    """The shared expert's gate and up rows in pairs, then its gate-logit row (`pair_rows`), so one linear launch
    stores silu·up and the logit; the three projections' weights become views of it, gate and up at a stride of two
    rows (`_stacked_once`)."""

    def stack() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        s = m.shared_expert
        pairs = pair_rows(s.gate_proj.weight, s.up_proj.weight, m.shared_expert_gate.weight)
        width = s.gate_proj.weight.shape[0]
        rows = pairs.view(width + 1, 2, pairs.shape[1])
        views = {
            "shared_expert.gate_proj.weight": rows[:width, 0],
            "shared_expert.up_proj.weight": rows[:width, 1],
            "shared_expert_gate.weight": rows[width:, 0],
        }
        return pairs, views

    return _stacked_once(m, SHARED_PAIRS, "the shared expert's paired weight", stack)


def read_weights(hc: GatedResidual) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, float, int]:
    """A read's arguments after the rows, as `hc_read` takes them: norm weight, down, up and inject weights (None at
    the final mixer), eps, streams."""
    if hc.block_inject_weight is not None:  # stored after the down rows, so one linear launch may take both
        fused_weight(hc, ("input_mix_weight_down", "block_inject_weight"))
    inject = None if hc.block_inject_weight is None else hc.block_inject_weight.weight
    w_down, w_up = hc.input_mix_weight_down.weight, hc.input_mix_weight_up.weight
    return hc.hc_norm.weight, w_down, w_up, inject, hc.hc_norm.eps, hc.hc


def hyper_read(hc: GatedResidual, wide: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The sub-block input and inject weights of a hyper-connection (the final mixer has no inject)."""
    return hc_read(wide, *read_weights(hc))


@dataclass(frozen=True, slots=True)
class PendingWrite:
    """A hyper-connection write not yet run: the rows before it, the sub-block output as `hc_write` takes it, and the
    inject weights. The next read runs it inside its first launch (`read_after`); anything else runs it first
    (`settle`)."""

    wide: torch.Tensor
    y: torch.Tensor | PeerSum
    inject: torch.Tensor


def settle(wide: torch.Tensor | PendingWrite) -> torch.Tensor:
    """The wide rows, after the pending write if there is one."""
    return hc_write(wide.wide, wide.y, wide.inject) if isinstance(wide, PendingWrite) else wide


def read_after(
    hc: GatedResidual, wide: torch.Tensor | PendingWrite
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(the wide rows, the sub-block input, inject weights) of a read, a pending write run in its first launch."""
    if not isinstance(wide, PendingWrite):
        return wide, *hyper_read(hc, wide)
    return hc_write_read(wide.wide, wide.y, wide.inject, *read_weights(hc))


def expert_bank(bank: ExpertBank) -> dict[str, torch.Tensor]:
    """The routed experts as the MoE kernel takes them: the NVFP4 tensors (moved to the kernels' word layout in place
    on first use, outside graph capture), or the dense BF16 ones."""
    if bank.nvfp4 is None:
        return {"gate_up": bank.gate_up_proj, "down": bank.down_proj}
    if "gate_up_packed" in bank.nvfp4:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the NVFP4 experts must be in the kernels' word layout before a CUDA graph is captured")
        try:
            bank.use_nvfp4(kernel_bank(bank.nvfp4, in_place=True))
        except BaseException:
            bank.use_nvfp4({})  # some codes may have moved already: no kernel or reference may read them
            raise
    return bank.nvfp4


def experts_to_words(model: nn.Module) -> None:
    """Every NVFP4 expert bank of `model` in the MoE kernels' word layout, in place: done at load, so that the
    scratch it takes is given back before the server plans memory."""
    for module in model.modules():
        if isinstance(module, ExpertBank):
            expert_bank(module)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def moe(m: SparseMoE, x: torch.Tensor) -> torch.Tensor | PeerSum:
    """Routed experts (router logits in fp32 from the linear kernel and their top-k, in one launch for one row) plus
    the gated shared expert, which runs on the side stream beside the router and is joined before the routed gate-up
    launch (`SharedGate`)."""
    side = fork(x.device, "moe")
    with on(side):  # silu·up and the gate logit in the gate-up launch's epilogue
        h, gate_logit = linear_silu_mul(x, shared_pairs_weight(m))
        shared = project(h, m.shared_expert.down_proj)
    weights, ids = linear_topk(x, m.gate.weight, m.gate.top_k, m.gate.renormalise)
    gated = SharedGate(shared, gate_logit, functools.partial(join, side))
    out_dtype = torch.float32 if m.tp.world > 1 else torch.bfloat16
    return m.tp.pending(moe_forward(x, ids, weights, expert_bank(m.experts), out_dtype, gated=gated))


def gdn(m: GatedDeltaNet, index: int, x: torch.Tensor, rnd: Round) -> torch.Tensor | PeerSum:
    """Gated DeltaNet of layer `index`: the kernels update the rows' slots of the pool's conv tails and recurrent
    states in place. Decode rounds of a few lanes run the conv, gates, recurrence and gated norm in one launch
    (`gdn_step`); other rounds run them apart, the gates on the side stream beside the conv: the same bits."""
    n = x.shape[0]
    tails, states = rnd.pool.gdn_conv[index], rnd.pool.gdn_recurrent[index]
    keep = rnd.keep_rows is not None
    row_tails = row_tails_for(rnd, "gdn_conv", index, tails, n)
    fused = linear(x, fused_weight(m, ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")))
    mixed, z, b, a = fused.split([2 * m.qk_width + m.v_width, m.v_width, m.value_heads, m.value_heads], dim=-1)
    states_out = kept_buffer(rnd, "gdn_recurrent", index, states)
    if rnd.single_rows and n <= GDN_STEP_ROWS and gdn_step_fits(n, m.value_heads):
        y, kept_states = gdn_step(
            mixed, tails, m.conv1d.weight[:, 0], b, a, m.A_log, m.dt_bias, z, m.norm.weight, m.eps, m.gate_act,
            states, rnd.slot_of_row, m.key_heads, row_tails=row_tails, keep_states=keep, keep_rows=rnd.keep_rows,
            keep_places=rnd.keep_places, states_out=states_out,
        )  # fmt: skip
    else:
        side = fork(x.device, "gdn")
        with on(side):  # the gates beside the conv
            beta, g = gdn_gates(b, a, m.A_log, m.dt_bias)
        qkv = causal_conv_update(mixed, tails, m.conv1d.weight[:, 0], rnd.slot_of_row, row_tails=row_tails)
        q, k, v = qkv.split([m.qk_width, m.qk_width, m.v_width], dim=-1)
        q = q.unflatten(-1, (m.key_heads, m.key_dim))
        k = k.unflatten(-1, (m.key_heads, m.key_dim))
        v = v.unflatten(-1, (m.value_heads, m.value_dim))
        join(side)
        out, kept_states = gdn_rows(q, k, v, g, beta, states, rnd, states_out)
        y = gated_rms_norm(out, z.unflatten(-1, (m.value_heads, m.value_dim)), m.norm.weight, m.eps, m.gate_act)
    if keep:  # only the rows asked for outlive the layer
        rnd.kept.gdn_conv[index] = keep_tails(rnd, "gdn_conv", index, row_tails)
        rnd.kept.gdn_recurrent[index] = kept_states
    return m.tp.pending(partial_out(y.view(n, m.v_width), m.out_proj, m.tp))


def gdn_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    rnd: Round,
    states_out: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(o, kept states) of the round's rows: prompts' whole chunks in the chunked form first (`rnd.chunks`), then every
    other row by the recurrence, from the states the chunks left."""
    keep = rnd.keep_rows is not None
    if rnd.chunks is None:
        return gdn_recurrent(
            q, k, v, g, beta, states, rnd.slot_of_row, keep, long_runs=rnd.long_runs, keep_rows=rnd.keep_rows,
            keep_places=rnd.keep_places, states_out=states_out,
        )  # fmt: skip
    return gdn_prompt(
        q, k, v, g, beta, states, rnd.chunks, rnd.recurrent_lanes, rnd.keep_rows, rnd.keep_places, states_out,
        rnd.recurrent_firsts,
    )  # fmt: skip


@functools.cache
def inv_freq(rotary_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """RoPE's inverse frequencies, made once per shape and device (captured graphs read them in place)."""
    return rope_inv_freq(rotary_dim, theta, device)


def block_keys_of(
    indexer: QSAIndexer,
    raw: torch.Tensor,
    firsts: torch.Tensor,
    rotary_dim: int,
    theta: float,
    into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The keys [B, Di] of B complete blocks with first positions firsts [B], pooled, normed and RoPE'd, from their raw
    index keys [B*ratio, Di]; or with `into` = (block keys [S, C, Di], slots [B], block indices [B]) from the pool
    [S, P, Di] whose slot slots[b] holds block b's from firsts[b] on, written into the block keys."""
    norm, freqs = indexer.k_layernorm, inv_freq(rotary_dim, theta, raw.device)
    if into is None:
        return norm_rope(block_mean(raw, indexer.ratio), norm.weight, norm.eps, firsts, freqs)
    dest, slots, index = into
    pooled = block_mean(raw, indexer.ratio, slots=slots, firsts=firsts)
    return norm_rope(pooled, norm.weight, norm.eps, firsts, freqs, dest=dest, slot_of_row=slots, dest_index=index)


def qsa(m: QSAttention, key: int, x: torch.Tensor, rnd: Round) -> torch.Tensor | PeerSum:
    """QSA of the layer whose cache key is `key`: rows are written into their slots of the pool's caches, the
    rows that complete a block write its key, then the indexer picks blocks and the attention reads the slots; the
    block keys run on the side stream beside the index queries' norm, then the indexer's top-k there beside the
    query, key and value rows."""
    positions, idx, pool, slot_of_row = rnd.positions, m.indexer, rnd.pool, rnd.slot_of_row
    freqs = inv_freq(m.rotary_dim, m.theta, x.device)
    fused = linear(x, fused_weight(m, ("indexer.index_qk_proj", "q_proj", "k_proj", "v_proj")))
    kv_width = m.kv_heads * m.head_dim
    index_q, raw, q_gate, k, v = fused.split(
        [idx.heads * idx.dim, idx.dim, 2 * m.heads * m.head_dim, kv_width, kv_width], dim=-1
    )
    keys, values, raw_keys, block_keys = pool.keys[key], pool.values[key], pool.index_keys[key], pool.block_keys[key]
    side = fork(x.device, "qsa")
    with on(side):  # the index path: the raw index keys and the blocks they complete
        scatter_rows(raw_keys, slot_of_row, positions, raw)
        if rnd.block_rows.numel():
            slots, firsts = completed_blocks(rnd)
            into = (block_keys, slots, rnd.block_dest)
            block_keys_of(idx, raw_keys, firsts, m.rotary_dim, m.theta, into=into)
    index_q = norm_rope(index_q.unflatten(-1, (idx.heads, idx.dim)), idx.q_layernorm.weight, m.eps, positions, freqs)
    follow(side)  # the index queries were normed here, beside the block keys: the top-k waits for both
    with on(side):
        slots32, positions32 = int32_slots_positions(rnd)
        indices, counts = qsa_index(index_q, block_keys, slots32, positions32, idx.ratio, idx.top_blocks)
    q, gate = q_gate.unflatten(-1, (m.heads, 2 * m.head_dim)).chunk(2, dim=-1)
    q = norm_rope(q, m.q_norm.weight, m.eps, positions, freqs)
    k = k.unflatten(-1, (m.kv_heads, m.head_dim))
    v = v.unflatten(-1, (m.kv_heads, m.head_dim))
    norm_rope(k, m.k_norm.weight, m.eps, positions, freqs, dest=keys, slot_of_row=slot_of_row)
    scatter_rows(values, slot_of_row, positions, v)
    join(side)
    out = qsa_sparse_attention(q, keys, values, slots32, indices, counts, gate=gate).view(x.shape[0], -1)
    return m.tp.pending(partial_out(out, m.o_proj, m.tp))


@functools.cache
def hash_multipliers_on(multipliers: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """A PLE layer's hash multipliers as an int64 tensor on `device`, made once (graph replays read it in place)."""
    return torch.tensor(multipliers, dtype=torch.int64, device=device)


def ple(p: PLELayer, index: int, wide: torch.Tensor, rnd: Round) -> torch.Tensor:
    """The wide residual plus layer `index`'s n-gram addition; the conv kernel updates the rows' slots of the
    pool's dilated conv tails in place."""
    n, dtype, emb = wide.shape[0], wide.dtype, p.ple_embedding
    lo, hi = emb.local_heads
    table = emb.ngram_embedding
    multipliers = hash_multipliers_on(tuple(emb.multipliers), wide.device)
    rows = ngram_rows(
        rnd.windows, emb.eos, multipliers, emb.moduli, emb.offsets, emb.heads_per_ngram, (lo, hi), table.local_rows[0]
    )
    embedded = emb.tp.gather(table.lookup(rows, dtype).flatten(-2), dim=-1)
    key = zc_rms_norm(project(embedded, p.key_proj).view(n, p.hc, p.d), p.norm_key.weight, p.eps)
    query = zc_rms_norm(wide.view(n, p.hc, p.d), p.norm_query.weight, p.eps)
    gate = group_dot(key, query).to(dtype) / math.sqrt(p.d)
    gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
    value = project(embedded, p.value_proj).unsqueeze(-2).expand(n, p.hc, p.d)
    gated = sigmoid_mul(value, gate.unsqueeze(-1).expand(n, p.hc, p.d)).flatten(-2)
    normed = zc_rms_norm(gated.view(n, p.hc, p.d), p.norm_conv.weight, p.eps).view(n, -1)
    tails = rnd.pool.ple_conv[index]
    keep = rnd.keep_rows is not None
    row_tails = row_tails_for(rnd, "ple_conv", index, tails, n)
    conv = causal_conv_update(
        normed, tails, p.conv1d.weight[:, 0], rnd.slot_of_row, dilation=p.dilation, row_tails=row_tails
    )
    if keep:
        rnd.kept.ple_conv[index] = keep_tails(rnd, "ple_conv", index, row_tails)
    return wide + (gated + conv)


def layer_forward(layer: DecoderLayer, wide: torch.Tensor | PendingWrite, rnd: Round) -> PendingWrite:
    """One decoder layer over every row of the round: optional PLE, the mixer and the MoE between hyper-connections.
    Its last write is left pending (the next layer's first read runs it; `settle` does where nothing reads next)."""
    if layer.ple is not None:
        wide = ple(layer.ple, layer.index, settle(wide), rnd)
    wide, x, inject = read_after(layer.attn_hyper_connection, wide)
    if layer.kind == LINEAR:
        y = gdn(layer.linear_attn, layer.index, x, rnd)
    else:
        y = qsa(layer.self_attn, MTP if layer.is_mtp else layer.index, x, rnd)
    wide, x, inject = read_after(layer.mlp_hyper_connection, PendingWrite(wide, write_input(y, wide), inject))
    return PendingWrite(wide, write_input(moe(layer.mlp, x), wide), inject)
