"""QSA decode/verify kernels: the block indexer (scores, exact top-k, token list) and the sparse GQA attention.

Indexer (`qsa_index`): row t (lane `lanes[t]`, absolute position p = `positions[t]`) sees C = (p + 1) // ratio
complete blocks; block j scores `sum_h relu(q_h . key_j) / sqrt(Di)` in fp32 (products of the bf16 inputs summed
in fp32, heads added in order 0.., then an IEEE division). If C > top_blocks it keeps the top_blocks best blocks,
ties to the LOWER block index (exactly `torch.sort(descending=True, stable=True)`), else all C blocks; plus the
tail tokens C*ratio .. p. The top-k is an exact radix select on the fp32 score bits (scores are >= +0, so their
bits order like the scores): three passes of 11, 10 and 10 bits build per-row histograms with integer atomics (an
integer sum, so its order cannot change the result), and after each the row's last program to count (an arrival
counter picks it) fixes the next digit of the k-th best score and how many of its ties are still needed from the
whole histogram; then a last pass keeps every block above it and the lowest-indexed ties, written in ascending
block order (each tile counting the keys of the tiles before it). Every count is an integer and every score is
computed by one program alone, so a row's selection is independent of the batch. Kernels: score (+ pass 0), radix,
radix, write; rows with C <= top_blocks only take part in the write, and when no lane can hold more than top_blocks
blocks only the write runs. The histograms and arrival counters of up to POOLED_ROWS rows come from a zeroed pool
that each resolve leaves zero (more rows get a memset).

Attention (`qsa_sparse_attention`): row t's query heads attend exactly its selected keys (scale 1/sqrt(D), GQA:
query head h uses kv head h // (Hq / Hkv)); the selected keys are cut into fixed chunks of `split` keys (in the
order of the index list); one program per (row, kv head, chunk) runs an fp32 online softmax over key tiles in
order (q.k^T from bf16 operands with fp32 accumulation; probabilities rounded to bf16 for p.V with fp32
accumulation, as the model's reference does), then one program per (row, kv head) merges the chunks in order 0..
in fp32 and divides (IEEE), rounding to q's dtype to nearest even (on the bits under the interpreter, whose cast
truncates); given the output gate, the merge stores act(out) gated as `kernels.gates.sigmoid_mul`
gates it (`sigmoid_gated`, its element), one launch fewer. Chunk size, tiles and warps are constants, never chosen
by batch size.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from kernels.counters import CounterPool
from kernels.fp32_ops import round_to_act
from kernels.gates import sigmoid_gated
from kernels.pdl import enter, launch_options

NBINS = 2048  # histogram bins of the radix select; passes use bits 20..30, 10..19 and 0..9 of the score bits
SCORE_TILE = 64  # blocks scored per program
SELECT_TILE = 1024  # blocks scanned per program in the select passes
ATTN_SPLIT = 256  # selected keys per attention program (a fixed chunk, not a batch-dependent split)
ATTN_TILE = 64  # keys per inner step of the attention
SCORE_WARPS, SELECT_WARPS, ATTN_WARPS = 4, 4, 4
POOLED_ROWS = 256  # rows (64 lanes' verify windows) whose histograms and arrival counters the pool holds
_ZEROED = CounterPool(POOLED_ROWS * 3 * (NBINS + 1), "qsa_index", "histogram and arrival words")


def _interpret() -> bool:
    """Whether Triton runs in its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def index_width(ratio: int, top_blocks: int) -> int:
    """Entries per row of the index buffer: the top blocks' tokens plus the longest tail."""
    return top_blocks * ratio + ratio - 1


# ----------------------------------------------------------------------------------------------- references


def qsa_index_reference(
    q_idx: torch.Tensor,
    block_keys: torch.Tensor,
    lanes: torch.Tensor,
    positions: torch.Tensor,
    ratio: int,
    top_blocks: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row torch indexer: (indices [T, width] int32 ascending, -1 padded; counts [T] int32), the model's math."""
    rows, dim = q_idx.shape[0], q_idx.shape[-1]
    out = torch.full((rows, index_width(ratio, top_blocks)), -1, dtype=torch.int32, device=q_idx.device)
    counts = torch.zeros(rows, dtype=torch.int32, device=q_idx.device)
    for t in range(rows):
        end = int(positions[t]) + 1
        visible = end // ratio
        if visible > top_blocks:
            keys = block_keys[int(lanes[t]), :visible].float()
            scores = (q_idx[t].float() @ keys.T).relu().sum(0) / math.sqrt(dim)
            blocks = torch.sort(scores, descending=True, stable=True).indices[:top_blocks].sort().values
        else:
            blocks = torch.arange(visible, device=q_idx.device)
        tokens = (blocks[:, None] * ratio + torch.arange(ratio, device=q_idx.device)).flatten()
        chosen = torch.cat((tokens, torch.arange(visible * ratio, end, device=q_idx.device)))
        out[t, : chosen.numel()] = chosen.to(torch.int32)
        counts[t] = chosen.numel()
    return out, counts


def qsa_sparse_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lanes: torch.Tensor,
    indices: torch.Tensor,
    counts: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Per-row torch attention over the gathered selected keys: fp32 scores, softmax and p.V; bf16 out [T, Hq, D]."""
    heads, dim = q.shape[1], q.shape[2]
    groups = heads // k_cache.shape[2]
    scale = dim**-0.5 if scale is None else scale
    out = torch.empty_like(q)
    for t in range(q.shape[0]):
        idx = indices[t, : int(counts[t])].long()
        keys = k_cache[int(lanes[t]), idx].float().repeat_interleave(groups, dim=1)
        values = v_cache[int(lanes[t]), idx].float().repeat_interleave(groups, dim=1)
        probs = torch.softmax(torch.einsum("hd,nhd->hn", q[t].float(), keys) * scale, dim=-1)
        out[t] = torch.einsum("hn,nhd->hd", probs, values).to(q.dtype)
    return out


# ----------------------------------------------------------------------------------------------- indexer kernels


@triton.jit
def _index_score_kernel(
    q_ptr,
    bk_ptr,
    lane_ptr,
    pos_ptr,
    key_ptr,
    hist_ptr,
    state_ptr,
    arrival_ptr,
    stride_qt,
    stride_qh,
    stride_bl,
    stride_bg,
    stride_kt,
    sqrt_dim,
    RATIO: tl.constexpr,
    TOP: tl.constexpr,
    HEADS: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_G: tl.constexpr,
    NBINS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Score one tile of a row's visible blocks (rows that need a top-k only) and count their top digit; the row's
    last tile to arrive resolves pass 0 (`_resolve_last`)."""
    enter(PDL)
    t = tl.program_id(0)
    g0 = tl.program_id(1) * BLOCK_G
    visible = (tl.load(pos_ptr + t) + 1) // RATIO
    if (visible > TOP) & (g0 < visible):
        lane = tl.load(lane_ptr + t).to(tl.int64)
        blocks = g0 + tl.arange(0, BLOCK_G)
        keep = blocks < visible
        d = tl.arange(0, DIM)
        kptrs = bk_ptr + lane * stride_bl + blocks.to(tl.int64)[:, None] * stride_bg + d[None, :]
        keys = tl.load(kptrs, mask=keep[:, None], other=0.0).to(tl.float32)
        total = tl.zeros([BLOCK_G], dtype=tl.float32)
        for h in tl.static_range(HEADS):
            qh = tl.load(q_ptr + t.to(tl.int64) * stride_qt + h * stride_qh + d).to(tl.float32)
            s = tl.sum(keys * qh[None, :], axis=1)
            total += tl.where(s > 0.0, s, 0.0)
        bits = tl.math.div_rn(total, sqrt_dim).to(tl.int32, bitcast=True)
        tl.store(key_ptr + t.to(tl.int64) * stride_kt + blocks, bits, mask=keep)
        tl.atomic_add(hist_ptr + t.to(tl.int64) * 3 * NBINS + (bits >> 20), 1, mask=keep, sem="relaxed", scope="gpu")
    if visible > TOP:
        _resolve_last(hist_ptr, state_ptr, arrival_ptr, t, 0, TOP, NBINS)


@triton.jit
def _resolve_last(hist_ptr, state_ptr, arrival_ptr, t, PASS: tl.constexpr, TOP: tl.constexpr, NBINS: tl.constexpr):
    """After this program counted its part of radix pass PASS for row t (relaxed atomics, ordered by this arrival):
    the row's last program to arrive (its pass's arrival counter, which starts at zero) fixes the next digit of the
    k-th best score and how many of its ties are still needed, from the whole histogram, and sets that histogram and
    counter back to zero."""
    tl.debug_barrier()
    arrived = tl.atomic_add(arrival_ptr + t * 3 + PASS, 1, sem="acq_rel", scope="gpu")
    if arrived == tl.num_programs(1) - 1:
        if PASS == 0:
            prefix = tl.zeros([], dtype=tl.int32)
            need = tl.full([], TOP, dtype=tl.int32)
        else:
            prefix = tl.load(state_ptr + 2 * t)
            need = tl.load(state_ptr + 2 * t + 1)
        bins = tl.arange(0, NBINS)
        hist = hist_ptr + (t.to(tl.int64) * 3 + PASS) * NBINS + bins
        counts = tl.load(hist, cache_modifier=".cg")
        tl.store(hist, tl.zeros([NBINS], dtype=tl.int32))
        tl.atomic_xchg(arrival_ptr + t * 3 + PASS, 0, sem="relaxed", scope="gpu")
        above = tl.sum(counts, 0) - tl.cumsum(counts, 0)
        digit = tl.max(tl.where((above < need) & (above + counts >= need), bins, 0), 0)
        tl.store(state_ptr + 2 * t, prefix + (digit << (20 - 10 * PASS)))
        tl.store(state_ptr + 2 * t + 1, need - tl.sum(tl.where(bins == digit, above, 0), 0))


@triton.jit
def _index_radix_kernel(
    key_ptr,
    pos_ptr,
    hist_ptr,
    state_ptr,
    arrival_ptr,
    stride_kt,
    PASS: tl.constexpr,
    RATIO: tl.constexpr,
    TOP: tl.constexpr,
    BLOCK: tl.constexpr,
    NBINS: tl.constexpr,
    PDL: tl.constexpr,
):
    """Radix pass PASS (1 or 2): count the next digit of the scores that match the bits resolved so far; the row's
    last tile to arrive resolves the pass (`_resolve_last`)."""
    enter(PDL)
    t = tl.program_id(0)
    j0 = tl.program_id(1) * BLOCK
    visible = (tl.load(pos_ptr + t) + 1) // RATIO
    if (visible > TOP) & (j0 < visible):
        prefix = tl.load(state_ptr + 2 * t)
        blocks = j0 + tl.arange(0, BLOCK)
        keep = blocks < visible
        bits = tl.load(key_ptr + t.to(tl.int64) * stride_kt + blocks, mask=keep, other=0)
        keep = keep & ((bits >> (30 - 10 * PASS)) == (prefix >> (30 - 10 * PASS)))
        digit = (bits - prefix) >> (20 - 10 * PASS)
        tl.atomic_add(hist_ptr + (t.to(tl.int64) * 3 + PASS) * NBINS + digit, 1, mask=keep, sem="relaxed", scope="gpu")
    if visible > TOP:
        _resolve_last(hist_ptr, state_ptr, arrival_ptr, t, PASS, TOP, NBINS)


@triton.jit
def _index_write_kernel(
    key_ptr,
    pos_ptr,
    state_ptr,
    idx_ptr,
    count_ptr,
    stride_kt,
    stride_it,
    RATIO: tl.constexpr,
    TOP: tl.constexpr,
    BLOCK: tl.constexpr,
    WIDTH: tl.constexpr,
    WIDTH_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    """Write a tile's chosen blocks as tokens at their ascending places, after the scores of the tiles before it that
    beat or tie the k-th best (counted here); tile 0 writes the tail, -1 padding, count."""
    enter(PDL)
    t = tl.program_id(0)
    tile = tl.program_id(1)
    j0 = tile * BLOCK
    end = tl.load(pos_ptr + t) + 1
    visible = end // RATIO
    row = idx_ptr + t.to(tl.int64) * stride_it
    if j0 < visible:
        blocks = j0 + tl.arange(0, BLOCK)
        keep = blocks < visible
        if visible > TOP:
            kth = tl.load(state_ptr + 2 * t)
            need = tl.load(state_ptr + 2 * t + 1)
            gt_before = tl.zeros([], dtype=tl.int32)
            eq_before = tl.zeros([], dtype=tl.int32)
            for earlier in range(0, j0, BLOCK):  # whole tiles, all visible (they end at j0 < visible)
                seen_bits = tl.load(key_ptr + t.to(tl.int64) * stride_kt + earlier + tl.arange(0, BLOCK))
                gt_before += tl.sum((seen_bits > kth).to(tl.int32), 0)
                eq_before += tl.sum((seen_bits == kth).to(tl.int32), 0)
            bits = tl.load(key_ptr + t.to(tl.int64) * stride_kt + blocks, mask=keep, other=0)
            tie = keep & (bits == kth)
            tie_rank = eq_before + tl.cumsum(tie.to(tl.int32), 0) - 1
            chosen = (keep & (bits > kth)) | (tie & (tie_rank < need))
            base = gt_before + tl.minimum(eq_before, need)
        else:
            chosen = keep
            base = j0
        slot = base + tl.cumsum(chosen.to(tl.int32), 0) - 1
        for r in tl.static_range(RATIO):
            tl.store(row + slot * RATIO + r, blocks * RATIO + r, mask=chosen)
    if tile == 0:
        filled = tl.minimum(visible, TOP) * RATIO
        slots = tl.arange(0, WIDTH_PAD)
        tail = visible * RATIO + slots - filled
        tl.store(row + slots, tl.where(tail < end, tail, -1), mask=(slots >= filled) & (slots < WIDTH))
        tl.store(count_ptr + t, filled + end - visible * RATIO)


def qsa_index(
    q_idx: torch.Tensor,
    block_keys: torch.Tensor,
    lanes: torch.Tensor,
    positions: torch.Tensor,
    ratio: int,
    top_blocks: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Selected tokens per row: (indices [T, top_blocks*ratio + ratio - 1] int32 ascending, -1 padded; counts [T]).

    q_idx [T, Hi, Di]: normed, RoPE'd index queries. block_keys [L, G, Di]: per lane the pooled, normed, RoPE'd key
    of each complete block (the model's `QSAIndexer.block_keys`), at least (p + 1) // ratio of them for every row's
    lane. lanes, positions [T]: each row's lane and absolute position."""
    rows, heads, dim = q_idx.shape
    blocks = block_keys.shape[1]
    if block_keys.shape[2] != dim or dim & (dim - 1) or block_keys.stride(2) != 1 or q_idx.stride(2) != 1:
        raise ValueError("qsa_index: Di must be a power of two, contiguous, and equal in q_idx and block_keys")
    device = q_idx.device
    width = index_width(ratio, top_blocks)
    lanes = lanes.to(device=device, dtype=torch.int32)
    positions = positions.to(device=device, dtype=torch.int32)
    indices = torch.empty(rows, width, dtype=torch.int32, device=device)
    counts = torch.empty(rows, dtype=torch.int32, device=device)
    if rows == 0:
        return indices, counts
    tiles = max(1, triton.cdiv(blocks, SELECT_TILE))
    keys = torch.empty(rows, max(blocks, 1), dtype=torch.int32, device=device)
    state = torch.empty(rows, 2, dtype=torch.int32, device=device)
    fixed = {"RATIO": ratio, "TOP": top_blocks}
    if blocks > top_blocks:
        words = rows * 3 * (NBINS + 1)
        if rows <= POOLED_ROWS:  # zero: every call's resolves leave it so
            zeroed = _ZEROED.get(device, words)[:words]
        else:
            zeroed = torch.zeros(words, dtype=torch.int32, device=device)
        hist, arrivals = zeroed[: rows * 3 * NBINS].view(rows, 3, NBINS), zeroed[rows * 3 * NBINS :].view(rows, 3)
        _index_score_kernel[(rows, triton.cdiv(blocks, SCORE_TILE))](
            q_idx, block_keys, lanes, positions, keys, hist, state, arrivals,
            q_idx.stride(0), q_idx.stride(1), block_keys.stride(0), block_keys.stride(1), keys.stride(0),
            float(math.sqrt(dim)), HEADS=heads, DIM=dim, BLOCK_G=SCORE_TILE, NBINS=NBINS, num_warps=SCORE_WARPS,
            **fixed, **launch_options(_index_score_kernel, device),
        )  # fmt: skip
        for step in (1, 2):
            _index_radix_kernel[(rows, tiles)](
                keys, positions, hist, state, arrivals, keys.stride(0), PASS=step, BLOCK=SELECT_TILE, NBINS=NBINS,
                num_warps=SELECT_WARPS, **fixed, **launch_options(_index_radix_kernel, device),
            )  # fmt: skip
    _index_write_kernel[(rows, tiles)](
        keys, positions, state, indices, counts, keys.stride(0), indices.stride(0),
        BLOCK=SELECT_TILE, WIDTH=width, WIDTH_PAD=triton.next_power_of_2(width),
        num_warps=SELECT_WARPS, **fixed, **launch_options(_index_write_kernel, device),
    )  # fmt: skip
    return indices, counts


# ----------------------------------------------------------------------------------------------- attention kernels


@triton.jit
def _attn_chunk_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    lane_ptr,
    idx_ptr,
    count_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    stride_qt,
    stride_qh,
    stride_kl,
    stride_kn,
    stride_kh,
    stride_vl,
    stride_vn,
    stride_vh,
    stride_it,
    scale,
    GROUP: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    """Online softmax of one (row, kv head)'s query group over one fixed chunk of its selected keys."""
    enter(PDL)
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    chunk = tl.program_id(2)
    start = chunk * SPLIT
    count = tl.load(count_ptr + t)
    if start < count:
        end = tl.minimum(start + SPLIT, count)
        lane = tl.load(lane_ptr + t).to(tl.int64)
        heads = tl.arange(0, BLOCK_M)
        d = tl.arange(0, DIM)
        live = heads < GROUP
        qptrs = q_ptr + t.to(tl.int64) * stride_qt + (kvh * GROUP + heads)[:, None] * stride_qh + d[None, :]
        q = tl.load(qptrs, mask=live[:, None], other=0.0)
        kbase = k_ptr + lane * stride_kl + kvh * stride_kh
        vbase = v_ptr + lane * stride_vl + kvh * stride_vh
        m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        total = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, DIM], dtype=tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs = n0 + tl.arange(0, BLOCK_N)
            valid = offs < end
            tok = tl.load(idx_ptr + t.to(tl.int64) * stride_it + offs, mask=valid, other=0).to(tl.int64)
            k = tl.load(kbase + tok[:, None] * stride_kn + d[None, :], mask=valid[:, None], other=0.0)
            v = tl.load(vbase + tok[:, None] * stride_vn + d[None, :], mask=valid[:, None], other=0.0)
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32))) if INTERPRET else tl.dot(q, tl.trans(k))
            s = tl.where(valid[None, :], s * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(s - m_new[:, None])
            total = total * alpha + tl.sum(p, 1)
            pb = round_to_act(p, v.dtype == tl.bfloat16, INTERPRET)  # the interpreter's cast truncates
            pv = tl.dot(pb.to(tl.float32), v.to(tl.float32)) if INTERPRET else tl.dot(pb, v)
            acc = acc * alpha[:, None] + pv
            m = m_new
        slot = (t * tl.num_programs(1) + kvh) * tl.num_programs(2) + chunk
        tl.store(m_ptr + slot * BLOCK_M + heads, m)
        tl.store(l_ptr + slot * BLOCK_M + heads, total)
        aptrs = acc_ptr + (slot.to(tl.int64) * BLOCK_M + heads)[:, None] * DIM + d[None, :]
        tl.store(aptrs, acc, mask=live[:, None])


@triton.jit
def _attn_merge_kernel(
    m_ptr,
    l_ptr,
    acc_ptr,
    count_ptr,
    out_ptr,
    gate_ptr,
    stride_ot,
    stride_oh,
    stride_gt,
    stride_gh,
    chunks,
    GROUP: tl.constexpr,
    DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    SPLIT: tl.constexpr,
    GATED: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    """Merge one (row, kv head)'s chunks in order 0.. in fp32 and write the normalised output in its dtype; GATED:
    times the sigmoid of the gate, as `kernels.gates.sigmoid_mul` gates the output (`sigmoid_gated`)."""
    enter(PDL)
    t = tl.program_id(0)
    kvh = tl.program_id(1)
    used = tl.cdiv(tl.load(count_ptr + t), SPLIT)
    heads = tl.arange(0, BLOCK_M)
    d = tl.arange(0, DIM)
    live = heads < GROUP
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DIM], dtype=tl.float32)
    first = (t * tl.num_programs(1) + kvh) * chunks
    for c in range(0, used):
        slot = first + c
        mc = tl.load(m_ptr + slot * BLOCK_M + heads)
        lc = tl.load(l_ptr + slot * BLOCK_M + heads)
        aptrs = acc_ptr + (slot.to(tl.int64) * BLOCK_M + heads)[:, None] * DIM + d[None, :]
        ac = tl.load(aptrs, mask=live[:, None], other=0.0)
        m_new = tl.maximum(m, mc)
        a = tl.exp(m - m_new)
        b = tl.exp(mc - m_new)
        total = total * a + lc * b
        acc = acc * a[:, None] + ac * b[:, None]
        m = m_new
    out = tl.math.div_rn(acc, total[:, None])
    act_bf16: tl.constexpr = out_ptr.dtype.element_ty == tl.bfloat16
    if GATED:
        gptrs = gate_ptr + t.to(tl.int64) * stride_gt + (kvh * GROUP + heads)[:, None] * stride_gh + d[None, :]
        out = sigmoid_gated(out, tl.load(gptrs, mask=live[:, None], other=0.0), act_bf16, INTERPRET)
    else:
        out = round_to_act(out, act_bf16, INTERPRET)
    optrs = out_ptr + t.to(tl.int64) * stride_ot + (kvh * GROUP + heads)[:, None] * stride_oh + d[None, :]
    tl.store(optrs, out, mask=live[:, None])


def qsa_sparse_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lanes: torch.Tensor,
    indices: torch.Tensor,
    counts: torch.Tensor,
    scale: float | None = None,
    split: int | None = None,
    block_n: int | None = None,
    gate: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [T, Hq, D] over the selected keys of its lane: out [T, Hq, D] in q's dtype; with `gate` (q's
    shape and dtype, any row and head strides, D contiguous) out is gated in the merge as `sigmoid_mul(out, gate)`.

    k_cache, v_cache [L, maxlen, Hkv, D] (any lane/position/head strides, D contiguous); indices [T, W] int32 whose
    first counts[t] entries are row t's token positions (as `qsa_index` writes them), the rest ignored. `split`
    and `block_n` (default ATTN_SPLIT, ATTN_TILE) are fixed constants of the deployment (split a multiple of
    block_n), never tied to batch size."""
    rows, heads, dim = q.shape
    kv_heads = k_cache.shape[2]
    split = ATTN_SPLIT if split is None else split
    block_n = ATTN_TILE if block_n is None else block_n
    if heads % kv_heads or dim & (dim - 1) or dim < 16 or k_cache.shape[3] != dim or split % block_n:
        raise ValueError("qsa_sparse_attention: Hq must be a multiple of Hkv, D a power of two >= 16")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("qsa_sparse_attention: the head dim must be contiguous")
    if gate is not None:
        if q.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"qsa_sparse_attention: a gate needs bf16 or fp32 q (as sigmoid_mul), got {q.dtype}")
        if gate.shape != q.shape or gate.dtype != q.dtype or gate.device != q.device:
            raise ValueError(
                f"qsa_sparse_attention: gate {gate.dtype} {tuple(gate.shape)} on {gate.device} is not q's "
                f"{q.dtype} {tuple(q.shape)} on {q.device}"
            )
        if gate.stride(2) != 1:
            raise ValueError("qsa_sparse_attention: the gate's head dim must be contiguous")
    group = heads // kv_heads
    block_m = max(16, triton.next_power_of_2(group))
    chunks = max(1, triton.cdiv(indices.shape[1], split))
    device = q.device
    lanes = lanes.to(device=device, dtype=torch.int32)
    counts = counts.to(device=device, dtype=torch.int32)
    out = torch.empty_like(q)
    if rows == 0:
        return out
    m = torch.empty(rows * kv_heads * chunks * block_m, dtype=torch.float32, device=device)
    total = torch.empty_like(m)
    acc = torch.empty(m.numel(), dim, dtype=torch.float32, device=device)
    scale = dim**-0.5 if scale is None else scale
    _attn_chunk_kernel[(rows, kv_heads, chunks)](
        q, k_cache, v_cache, lanes, indices, counts, m, total, acc,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), indices.stride(0), float(scale),
        GROUP=group, DIM=dim, BLOCK_M=block_m, BLOCK_N=block_n, SPLIT=split, INTERPRET=_interpret(),
        num_warps=ATTN_WARPS, **launch_options(_attn_chunk_kernel, q.device),
    )  # fmt: skip
    gate_arg = out if gate is None else gate
    _attn_merge_kernel[(rows, kv_heads)](
        m, total, acc, counts, out, gate_arg, out.stride(0), out.stride(1), gate_arg.stride(0), gate_arg.stride(1),
        chunks,
        GROUP=group, DIM=dim, BLOCK_M=block_m, SPLIT=split, GATED=gate is not None, INTERPRET=_interpret(),
        num_warps=ATTN_WARPS, **launch_options(_attn_merge_kernel, m.device),
    )  # fmt: skip
    return out
