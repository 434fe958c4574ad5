"""Routed MoE experts as grouped GEMMs (NVFP4 weight-only W4A16, or BF16), with the routing plan read on the GPU.

`moe_forward(x, expert_ids, weights, bank)` computes, for each row and each of its k (row, expert) pairs, `h =
bf16(silu(x·Wgᵀ) * (x·Wuᵀ))` and `y = h·Wdᵀ`, then `out = Σ weight·y` over the row's experts in ascending expert id, in
fp32, rounded once to the output dtype (with `gated`: to bf16, then the gated value, stored in the output dtype). No
host synchronisation, so one CUDA graph replays any routing. Grouped path, four launches: a plan (pairs grouped by
expert, expert bounds, each row tile's expert and first pair), the gate-up kernel (writes h per pair), the down kernel
(writes fp32 y per pair) and the combine kernel (the ordered weighted sum per row, and with `gated` the gated shared
expert). Pairs path, below PAIR_ROWS rows, two launches: each pair alone in a row tile of its own, h placed in its row's
ascending-expert order, and the down kernel's last pair of a row to finish a column tile adds the row's weighted y in
that order. A pair alone is the grouped tile with one row, so both paths give the same bits.

Reduction order (the exactness contract). Every dot accumulates in fp32 through tensor-core MMA steps 16 wide, in
increasing index order over the reduced axis, starting from zero: the gate/up sums run over d, the down sum over I. A
row never shares a sum with another row: tiles group the rows of one expert only to share weight reads. Tile sizes
change with the batch, but on CUDA every config keeps Triton on mma.sync (MMAv2: tile height not a multiple of 64, or
fewer than four warps) with both operands at k width 8 (which k terms a step adds: kernels/moe_gluon.py's MMA_K_WIDTH;
`scripts/sass_loop.py` reports the widths, and a CPU test holds every kernel to it), whose per-element result depends
only on that 16-wide step order, so a row's bits do not depend on the batch. NVFP4 weights are dequantized in registers
to bf16 as fp4(code)·block_scale·2^-7, which is exact in bf16 (at most 6 significant bits, far from its range's ends);
the fp32 global scale_2·2^7 multiplies the fp32 sum afterwards (gate and up each by their own): the same W =
fp4·block_scale·scale_2 with one rounding fewer than scaling each weight, and powers of two leave every partial sum's
rounding as it was (barring fp32 underflow, far below these sums).

Word layout. The kernels read NVFP4 codes as int32 words of eight, with each code's bits moved (once, at load:
`kernel_bank`) to where four cheap extractions (an AND; a rotate and an AND; an AND, a multiply by two powers of two
and an AND; two rotates, two ANDs and an OR) leave the bf16 bit patterns of fp4(code)·2^-126 for elements (2j, 2j+1) in
the low and high halves of one register, which the tensor-core operands take as they are. The checkpoint's layout
(element 2j in the low nibble of byte j) would need shifts, masks and byte permutes for every pair, and turning codes
into bf16 is what bounds these kernels. `kernels/fp4_words.py` owns the layout (`WORD_BITS`); the extractions here
must match it. In a matrix whose K is a multiple of a span width it also moves each row's words and scales within
spans, which the kernels here load as stored and put back in k order in registers, and which `kernels/moe_gluon.py`'s
gate-up and down kernels (the grouped path's on CUDA: the gate-up for decode batches, the down for every batch; the
same bits) load straight into their MMA operands.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import moe_gluon
from kernels.counters import CounterPool
from kernels.fp4_words import PACKED_KEYS, from_words, natural_scales, span_k
from kernels.fp32_ops import round_to_act
from kernels.gates import contiguous_columns, gated_value
from kernels.pdl import enter, launch_options, load_settled

NVFP4_GROUP = 16
# The plan's launches, by pairs (docs/performance.md, seventeenth session): from PLAN_COUNTED_PAIRS a launch first
# counts each PLAN_COUNT pairs' experts (faster from 640 pairs, 64 rows at top-10; one launch below); beyond
# PLAN_MAX_PAIRS (8,192 rows measured) torch ops, as the kernel's sums over every count row grow with the square
PLAN_MAX_PAIRS = 81920
PLAN_COUNTED_PAIRS = 640
PLAN_COUNT = 256
# Below PAIR_ROWS rows each pair runs alone: no plan, and the combine inside the down launch. One row only: a lane's
# verify rows share experts, whose weights the grouped path reads once per tile (docs/performance.md, tenth session).
PAIR_ROWS = 2
PAIR_COUNTERS = 2048  # arrival counters of the pairs path: each row's column tiles of the down projection
PLAN_CHUNK, PLAN_SCAN = 64, 256  # pairs one plan program places; ids it counts a step
# The combine's columns a program: COMBINE_FEW_BLOCK up to COMBINE_FEW_ROWS rows (verify rounds: more programs for few
# rows), else COMBINE_BLOCK; each output element's sum is the same either way
COMBINE_FEW_ROWS, COMBINE_FEW_BLOCK, COMBINE_BLOCK = 16, 256, 1024
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_KEYS = ("gate_up_words", "gate_up_scale", "gate_up_scale_2", "down_words", "down_scale", "down_scale_2")
TWO_POW_119 = tl.constexpr(2.0**119)  # block scale · 2^119 is at most 448·2^119 < the largest bf16
BF16_KEYS = ("gate_up", "down")


@dataclass(frozen=True, slots=True)
class MoeTiles:
    """Launch shape of one call: row tile (shared by both GEMMs), column/reduction tiles, warps, stages."""

    block_m: int
    gate_up_n: int
    gate_up_k: int
    down_n: int
    down_k: int
    num_warps: int
    num_stages: int
    down_group: int = 1  # column tiles of the down projection one program runs in turn, in one pipelined loop


@dataclass(frozen=True, slots=True)
class SharedGate:
    """The shared expert's output `shared` [N, d] and gate logits `gate_logit` [N, 1] (bf16, rows at any stride),
    which the routed sum takes as `kernels.gates.gated_add` does: routed + sigmoid(logit) · shared. `ready` runs
    once (the caller joins there the stream that makes them): before the gate-up launch, so that in the grouped path
    the side stream's kernels are done when it starts (at 64 rows a gate-up that started beside them ran about 14 µs
    longer: docs/performance.md, twenty-eighth session) and in the pairs path the down launch, which reads them,
    depends on the gate-up alone and starts beside it (thirtieth session); and at once when there are no rows."""

    shared: torch.Tensor
    gate_logit: torch.Tensor
    ready: Callable[[], None]


@dataclass(frozen=True, slots=True)
class MoePlan:
    """Routing plan on the device: `pairs` [P] int32 are pair ids (row*k + slot) grouped by ascending expert;
    `bounds` [E+1] int32 the cumulative pair counts; `tile_experts` and `tile_starts` [max_tiles] int32 each row
    tile's expert (E past the last tile) and first position in `pairs` (0 past the last tile)."""

    pairs: torch.Tensor
    bounds: torch.Tensor
    tile_experts: torch.Tensor
    tile_starts: torch.Tensor
    block_m: int
    max_tiles: int


def _interpreting() -> bool:
    """Whether Triton runs under its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def moe_tiles(num_rows: int, top_k: int, num_experts: int) -> MoeTiles:
    """Tiles for a batch: small row tiles while each expert sees few rows (two warps from 8 rows), taller ones for
    prefill; from 8 rows a down program runs two column tiles in turn (the same bits; docs/performance.md)."""
    if _interpreting():
        return MoeTiles(16, 32, 32, 32, 32, 4, 1)
    if num_rows < 8:
        return MoeTiles(16, 32, 256, 64, 64, 4, 4)
    if num_rows * top_k <= 16 * num_experts:  # the fastest of the H200 tile sweep at 8 and 64 rows (same bits)
        return MoeTiles(16, 32, 128, 128, 64, 2, 3, down_group=2)
    return MoeTiles(32, 64, 128, 128, 64, 4, 3, down_group=2)


def max_tiles(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on Σ_e ceil(count_e / block_m) over any routing of `num_pairs` pairs."""
    used = min(num_experts, num_pairs)
    return max(1, min(num_pairs, (num_pairs + used * (block_m - 1)) // block_m))


@triton.jit
def _histogram(ids_ptr, start, end, E_POW2: tl.constexpr, SCAN: tl.constexpr):
    """How many of pairs [start, end) each expert has, SCAN ids a step."""
    scan = tl.arange(0, SCAN)
    counts = tl.zeros((E_POW2,), tl.int32)
    for first in range(start, end, SCAN):
        q = first + scan
        counts += tl.histogram(tl.load(ids_ptr + q, mask=q < end, other=0), E_POW2, mask=q < end)
    return counts


@triton.jit(do_not_specialize=["P"])
def _count_kernel(ids_ptr, counts_ptr, P, E_POW2: tl.constexpr, COUNT: tl.constexpr, SCAN: tl.constexpr,
                  PDL: tl.constexpr):  # fmt: skip
    """Row c of counts [cdiv(P, COUNT), E_POW2]: how many of pairs [c·COUNT, (c+1)·COUNT) each expert has."""
    enter(PDL)
    lo = tl.program_id(0) * COUNT
    counts = _histogram(ids_ptr, lo, tl.minimum(lo + COUNT, P), E_POW2, SCAN)
    tl.store(counts_ptr + tl.program_id(0) * E_POW2 + tl.arange(0, E_POW2), counts)


@triton.jit(do_not_specialize=["P", "T"])
def _plan_kernel(
    ids_ptr,
    counts_ptr,
    pairs_ptr,
    bounds_ptr,
    tile_experts_ptr,
    tile_starts_ptr,
    P,
    T,
    E: tl.constexpr,
    E_POW2: tl.constexpr,
    CHUNK: tl.constexpr,
    SCAN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    COUNTED: tl.constexpr,
    COUNT: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program p places pairs [p·CHUNK, (p+1)·CHUNK) with no sort: a pair's sorted position is its expert's first
    position plus its rank, the number of earlier pairs with its expert (a stable sort's order), counted from a
    histogram of the pairs before the chunk and comparisons within it. The histograms come from scans of every pair
    or, when COUNTED, from `_count_kernel`'s rows (the pairs between the last whole row and the chunk scanned). A
    pair whose rank is a multiple of BLOCK_M starts a tile; tiles past the last, up to T, get E; program 0 writes
    the bounds."""
    enter(PDL)
    lo = tl.program_id(0) * CHUNK
    if COUNTED:
        e_all = tl.arange(0, E_POW2)
        rows_before = lo // COUNT
        before = _histogram(ids_ptr, rows_before * COUNT, lo, E_POW2, SCAN)
        total = tl.zeros((E_POW2,), tl.int32)
        for r in range(0, tl.cdiv(P, COUNT)):
            row = tl.load(counts_ptr + r * E_POW2 + e_all)
            total += row
            before += tl.where(r < rows_before, row, 0)
    else:
        before = _histogram(ids_ptr, 0, lo, E_POW2, SCAN)
        total = before + _histogram(ids_ptr, lo, P, E_POW2, SCAN)
    c = tl.arange(0, CHUNK)
    q = lo + c
    valid = q < P
    ids = tl.load(ids_ptr + q, mask=valid, other=0)
    earlier_same = (ids[:, None] == ids[None, :]) & (c[None, :] < c[:, None])
    rank = tl.gather(before, ids, 0) + tl.sum(earlier_same.to(tl.int32), 1)
    ends = tl.cumsum(total, 0)
    pos = tl.gather(ends - total, ids, 0) + rank
    tl.store(pairs_ptr + pos, q, mask=valid)
    tiles = (total + BLOCK_M - 1) // BLOCK_M
    tile_ends = tl.cumsum(tiles, 0)
    tile = tl.gather(tile_ends - tiles, ids, 0) + rank // BLOCK_M
    starts = valid & (rank % BLOCK_M == 0)
    tl.store(tile_experts_ptr + tile, ids, mask=starts)
    tl.store(tile_starts_ptr + tile, pos, mask=starts)
    past = (q >= tl.sum(tiles, 0)) & (q < T)
    tl.store(tile_experts_ptr + q, E, mask=past)
    tl.store(tile_starts_ptr + q, 0, mask=past)
    if lo == 0:
        e = tl.arange(0, E_POW2)
        tl.store(bounds_ptr + 1 + e, ends, mask=e < E)
        tl.store(bounds_ptr, 0)


def moe_plan_reference(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> MoePlan:
    """The routing plan with torch ops on the ids' device (no host synchronisation)."""
    flat = expert_ids.reshape(-1)
    dev, num_pairs = flat.device, flat.numel()
    pairs = torch.argsort(flat, stable=True).to(torch.int32)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=dev)
    counts.index_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int32))
    bounds = F.pad(torch.cumsum(counts, 0, dtype=torch.int32), (1, 0))
    sorted_ids = flat[pairs.long()].long()
    q = torch.arange(num_pairs, device=dev)
    starts = (q - bounds[sorted_ids]) % block_m == 0
    num_tiles = max_tiles(num_pairs, num_experts, block_m)
    # a tile's first position writes its slot; the others all write one extra slot, dropped
    slot = torch.where(starts, torch.cumsum(starts, 0) - 1, num_tiles)
    tile_experts = torch.full((num_tiles + 1,), num_experts, dtype=torch.int32, device=dev)
    tile_starts = torch.zeros(num_tiles + 1, dtype=torch.int32, device=dev)
    tile_experts.scatter_(0, slot, sorted_ids.to(torch.int32))
    tile_starts.scatter_(0, slot, q.to(torch.int32))
    return MoePlan(pairs, bounds, tile_experts[:num_tiles], tile_starts[:num_tiles], block_m, num_tiles)


def moe_plan(expert_ids: torch.Tensor, num_experts: int, block_m: int) -> MoePlan:
    """The routing plan of expert_ids [N, k]: one launch of CHUNK pairs a program (from PLAN_COUNTED_PAIRS pairs after
    a launch that counts the experts of each PLAN_COUNT pairs), or torch ops for many pairs."""
    num_pairs = expert_ids.numel()
    if num_pairs > PLAN_MAX_PAIRS:
        return moe_plan_reference(expert_ids, num_experts, block_m)
    dev = expert_ids.device
    num_tiles = max_tiles(num_pairs, num_experts, block_m)
    pairs = torch.empty(num_pairs, dtype=torch.int32, device=dev)
    bounds = torch.empty(num_experts + 1, dtype=torch.int32, device=dev)
    tile_experts = torch.empty(num_tiles, dtype=torch.int32, device=dev)
    tile_starts = torch.empty(num_tiles, dtype=torch.int32, device=dev)
    ids = expert_ids.reshape(-1).to(torch.int32)
    e_pow2 = triton.next_power_of_2(num_experts)
    counted = num_pairs >= PLAN_COUNTED_PAIRS
    counts = pairs  # read only when counted
    if counted:
        counts = torch.empty(triton.cdiv(num_pairs, PLAN_COUNT), e_pow2, dtype=torch.int32, device=dev)
        _count_kernel[(counts.shape[0],)](
            ids, counts, num_pairs, E_POW2=e_pow2, COUNT=PLAN_COUNT, SCAN=PLAN_SCAN, num_warps=4,
            **launch_options(_count_kernel, dev),
        )  # fmt: skip
    _plan_kernel[(max(1, triton.cdiv(num_pairs, PLAN_CHUNK)),)](  # one program writes the bounds of no pairs
        ids,
        counts,
        pairs,
        bounds,
        tile_experts,
        tile_starts,
        num_pairs,
        num_tiles,
        E=num_experts,
        E_POW2=e_pow2,
        CHUNK=PLAN_CHUNK,
        SCAN=PLAN_SCAN,
        BLOCK_M=block_m,
        COUNTED=counted,
        COUNT=PLAN_COUNT,
        num_warps=4,
        **launch_options(_plan_kernel, expert_ids.device),
    )
    return MoePlan(pairs, bounds, tile_experts, tile_starts, block_m, num_tiles)


@triton.jit
def _tile_rows(pairs_ptr, bounds_ptr, tile_experts_ptr, tile_starts_ptr, t, E: tl.constexpr, BLOCK_M: tl.constexpr):
    """Tile t of the plan: (expert, sorted positions [BLOCK_M], their mask, pair ids); expert == E past the end."""
    e = tl.load(tile_experts_ptr + t)
    pos = tl.load(tile_starts_ptr + t) + tl.arange(0, BLOCK_M)
    ok = pos < tl.load(bounds_ptr + e + 1, mask=e < E, other=0)
    pair = tl.load(pairs_ptr + pos, mask=ok, other=0)
    return e, pos, ok, pair


@triton.jit
def _bf16_pairs(words):
    """Words of eight codes in the kernels' layout -> four uint32 registers: register j holds the bf16 bit patterns of
    fp4(code)·2^-126 of elements 2j (low half) and 2j+1 (high half); code 1 lands on the subnormal 2^-127."""
    w = words.to(tl.uint32, bitcast=True)
    r0 = w & 0x81C081C0
    r1 = ((w << 13) | (w >> 19)) & 0x81C081C0
    r2 = ((w & 0x00390039) * 0x8008) & 0x81C081C0  # the two shifted copies never carry into a kept bit
    r3 = (((w << 10) | (w >> 22)) & 0x01C001C0) | (((w << 14) | (w >> 18)) & 0x80008000)
    return r0, r1, r2, r3


@triton.jit
def _halves(r, INTERPRET: tl.constexpr):
    """The (low, high) bf16 halves of uint32 r: one PTX move, so no shifts (fp32 under the interpreter, which flushes
    bf16 subnormals)."""
    if INTERPRET:
        return (r << 16).to(tl.float32, bitcast=True), (r & 0xFFFF0000).to(tl.float32, bitcast=True)
    return tl.inline_asm_elementwise(
        "mov.b32 {$0, $1}, $2;", "=h,=h,r", [r], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1
    )


@triton.jit
def _weight_tile(
    w_ptr,
    s_ptr,
    rows,
    row_ok,
    k0,
    K,
    stride_wn,
    stride_sn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    FP4: tl.constexpr,
    INTERPRET: tl.constexpr,
    SPAN: tl.constexpr,
):
    """Weight rows [BLOCK_N] x columns [k0, k0+BLOCK_K) as bf16; NVFP4 codes (int32 words of 8 in the kernels'
    layout) times block scales times 2^-7, exact in bf16. SPAN (0: none): the width of the spans the words and
    scales were moved within (kernels/fp4_words.py; BLOCK_K a multiple of it), loaded as stored and put back in k
    order in registers."""
    if FP4:
        kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        kg = k0 // 16 + tl.arange(0, BLOCK_K // 16)
        w_mask = row_ok[:, None] if EVEN_K else row_ok[:, None] & (kw < K // 8)[None, :]
        s_mask = row_ok[:, None] if EVEN_K else row_ok[:, None] & (kg < K // 16)[None, :]
        words = tl.load(w_ptr + rows[:, None] * stride_wn + kw[None, :], mask=w_mask, other=0)
        scale = tl.load(s_ptr + rows[:, None] * stride_sn + kg[None, :], mask=s_mask, other=0.0)
        if SPAN:
            words = tl.permute(words.reshape(BLOCK_N, BLOCK_K // SPAN, 4, SPAN // 32), (0, 1, 3, 2))
            words = words.reshape(BLOCK_N, BLOCK_K // 8)
            scale = tl.permute(scale.reshape(BLOCK_N, BLOCK_K // SPAN, 2, SPAN // 32), (0, 1, 3, 2))
            scale = scale.reshape(BLOCK_N, BLOCK_K // 16)
        r0, r1, r2, r3 = _bf16_pairs(words)
        l0, h0 = _halves(r0, INTERPRET)
        l1, h1 = _halves(r1, INTERPRET)
        l2, h2 = _halves(r2, INTERPRET)
        l3, h3 = _halves(r3, INTERPRET)
        # element 8m + 4*b2 + 2*b1 + b0 of word m: nest the joins so b0 (low or high half) varies fastest
        low = tl.join(tl.join(l0, l2), tl.join(l1, l3))
        high = tl.join(tl.join(h0, h2), tl.join(h1, h3))
        codes = tl.join(low, high).reshape(BLOCK_N, BLOCK_K // 16, 16)
        # times block scale·2^119 in one packed multiply: fp4·block_scale·2^-7, exact
        w = codes * (scale.to(codes.dtype) * TWO_POW_119)[:, :, None]
        return w.reshape(BLOCK_N, BLOCK_K).to(tl.bfloat16)
    else:
        kk = k0 + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] if EVEN_K else row_ok[:, None] & (kk < K)[None, :]
        return tl.load(w_ptr + rows[:, None] * stride_wn + kk[None, :], mask=mask, other=0.0)


@triton.jit
def _mma(a, w, acc, INTERPRET: tl.constexpr):
    """acc + a·wᵀ in fp32 (operands upcast under the interpreter, whose bf16 dot is wrong)."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
    return tl.dot(a, tl.trans(w), acc)


@triton.jit
def _gate_up_tile(
    x_rows, ok, e, w_ptr, s_ptr, s2_ptr, cols, col_ok, D, INTER, stride_we, stride_wn, stride_se, stride_sn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, FP4: tl.constexpr,
    INTERPRET: tl.constexpr, SPAN: tl.constexpr,
):  # fmt: skip
    """bf16(silu(x·Wgᵀ) * x·Wuᵀ) [BLOCK_M, BLOCK_N] of expert e for the rows at `x_rows` (those in `ok`)."""
    w_e = w_ptr + e.to(tl.int64) * stride_we
    s_e = s_ptr + e.to(tl.int64) * stride_se
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        a_mask = ok[:, None] if EVEN_K else ok[:, None] & (kk < D)[None, :]
        a = tl.load(x_rows + kk[None, :], mask=a_mask, other=0.0)
        wg = _weight_tile(
            w_e, s_e, cols, col_ok, k0, D, stride_wn, stride_sn, BLOCK_N, BLOCK_K, EVEN_K, FP4, INTERPRET, SPAN
        )
        gate = _mma(a, wg, gate, INTERPRET)
        wu = _weight_tile(
            w_e, s_e, cols + INTER, col_ok, k0, D, stride_wn, stride_sn, BLOCK_N, BLOCK_K, EVEN_K, FP4, INTERPRET,
            SPAN,
        )  # fmt: skip
        up = _mma(a, wu, up, INTERPRET)
    if FP4:
        gate = gate * (tl.load(s2_ptr + e * 2) * 128.0)
        up = up * (tl.load(s2_ptr + e * 2 + 1) * 128.0)
    return round_to_act(gate * tl.sigmoid(gate) * up, True, INTERPRET)


@triton.jit
def _gate_up_kernel(
    x_ptr,
    pairs_ptr,
    bounds_ptr,
    tile_experts_ptr,
    tile_starts_ptr,
    w_ptr,
    s_ptr,
    s2_ptr,
    h_ptr,
    D,
    INTER,
    stride_xn,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    TOP_K: tl.constexpr,
    E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    FP4: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
    SPAN: tl.constexpr,
):
    """h [BLOCK_M pairs, BLOCK_N] = bf16(silu(x·Wgᵀ) * x·Wuᵀ) for one tile of one expert's pairs."""
    enter(PDL)
    n_blocks = tl.cdiv(INTER, BLOCK_N)
    t = tl.program_id(0) // n_blocks
    nb = tl.program_id(0) % n_blocks
    e, pos, ok, pair = _tile_rows(pairs_ptr, bounds_ptr, tile_experts_ptr, tile_starts_ptr, t, E, BLOCK_M)
    if e >= E:
        return
    x_rows = x_ptr + (pair // TOP_K).to(tl.int64)[:, None] * stride_xn
    cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < INTER
    h = _gate_up_tile(
        x_rows, ok, e, w_ptr, s_ptr, s2_ptr, cols, col_ok, D, INTER, stride_we, stride_wn, stride_se, stride_sn,
        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, FP4, INTERPRET, SPAN,
    )  # fmt: skip
    tl.store(h_ptr + pos.to(tl.int64)[:, None] * INTER + cols[None, :], h, mask=ok[:, None] & col_ok[None, :])


@triton.jit
def _gate_up_pairs_kernel(
    x_ptr,
    ids_ptr,
    w_ptr,
    s_ptr,
    s2_ptr,
    h_ptr,
    D,
    INTER,
    stride_xn,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    TOP_K: tl.constexpr,
    K_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    FP4: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
    SPAN: tl.constexpr,
):
    """h of one (row, slot) pair in one column tile, alone in a BLOCK_M-row tile (the grouped kernel's tile with one
    row), stored at the pair's place in its row's ascending-expert order."""
    enter(PDL)
    n_blocks = tl.cdiv(INTER, BLOCK_N)
    pair = tl.program_id(0) // n_blocks
    nb = tl.program_id(0) % n_blocks
    row = pair // TOP_K
    slots = tl.arange(0, K_POW2)
    row_ids = tl.load(ids_ptr + row * TOP_K + slots, mask=slots < TOP_K, other=2147483647)
    e = tl.load(ids_ptr + pair)
    before = (row_ids < e) | ((row_ids == e) & (slots < pair % TOP_K))
    place = row * TOP_K + tl.sum(before.to(tl.int32), 0)
    ok = tl.arange(0, BLOCK_M) == 0
    x_rows = x_ptr + row.to(tl.int64) * stride_xn + tl.zeros((BLOCK_M, 1), dtype=tl.int64)
    cols = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < INTER
    h = _gate_up_tile(
        x_rows, ok, e, w_ptr, s_ptr, s2_ptr, cols, col_ok, D, INTER, stride_we, stride_wn, stride_se, stride_sn,
        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, FP4, INTERPRET, SPAN,
    )  # fmt: skip
    h_rows = h_ptr + place.to(tl.int64) * INTER + tl.zeros((BLOCK_M, 1), dtype=tl.int64)
    tl.store(h_rows + cols[None, :], h, mask=ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr,
    pairs_ptr,
    bounds_ptr,
    tile_experts_ptr,
    tile_starts_ptr,
    w_ptr,
    s_ptr,
    s2_ptr,
    y_ptr,
    D,
    INTER,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    E: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    EVEN_K: tl.constexpr,
    FP4: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
    SPAN: tl.constexpr,
):
    """y [BLOCK_M pairs, GROUP column tiles of BLOCK_N] = h·Wdᵀ in fp32 for one tile of one expert's pairs, stored by
    pair id: the column tiles in turn, as one loop over (column tile, K tile), so the pipeline does not drain between
    them (K = I is a few tiles); each output's sum is the same chain of K tiles from zero."""
    enter(PDL)
    n_groups = tl.cdiv(tl.cdiv(D, BLOCK_N), GROUP)
    t = tl.program_id(0) // n_groups
    group = tl.program_id(0) % n_groups
    e, pos, ok, pair = _tile_rows(pairs_ptr, bounds_ptr, tile_experts_ptr, tile_starts_ptr, t, E, BLOCK_M)
    if e >= E:
        return
    h_rows = h_ptr + pos.to(tl.int64)[:, None] * INTER
    y_rows = y_ptr + pair.to(tl.int64)[:, None] * D
    w_e = w_ptr + e.to(tl.int64) * stride_we
    s_e = s_ptr + e.to(tl.int64) * stride_se
    scale_2 = tl.load(s2_ptr + e) * 128.0 if FP4 else 1.0
    k_tiles = tl.cdiv(INTER, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, GROUP * k_tiles):  # a last group past D masks its columns (moe_tiles' groups divide D's)
        cols = (group * GROUP + step // k_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < D
        k0 = (step % k_tiles) * BLOCK_K
        kk = k0 + tl.arange(0, BLOCK_K)
        a_mask = ok[:, None] if EVEN_K else ok[:, None] & (kk < INTER)[None, :]
        a = tl.load(h_rows + kk[None, :], mask=a_mask, other=0.0)
        w = _weight_tile(
            w_e, s_e, cols, col_ok, k0, INTER, stride_wn, stride_sn, BLOCK_N, BLOCK_K, EVEN_K, FP4, INTERPRET, SPAN
        )
        acc = _mma(a, w, acc, INTERPRET)
        if step % k_tiles == k_tiles - 1:
            tl.store(y_rows + cols[None, :], acc * scale_2, mask=ok[:, None] & col_ok[None, :])
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)


@triton.jit
def _ascending_places(ids, slots):
    """Each slot's place among a row's slots by ascending expert id, ties by slot (padding slots, which hold the
    largest id, last); registers only."""
    before = (ids[None, :] < ids[:, None]) | ((ids[None, :] == ids[:, None]) & (slots[None, :] < slots[:, None]))
    return tl.sum(before.to(tl.int32), 1)


@triton.jit
def _combine_kernel(
    y_ptr,
    ids_ptr,
    wts_ptr,
    out_ptr,
    shared_ptr,
    logit_ptr,
    D,
    stride_logit,
    TOP_K: tl.constexpr,
    K_POW2: tl.constexpr,
    BLOCK_D: tl.constexpr,
    OUT_BF16: tl.constexpr,
    GATED: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[row] = Σ weight·y over the row's pairs in ascending expert id (ties by slot), fp32, one rounding. GATED:
    out = `gated_value(that sum, the row's shared-expert logit, its shared output)`, `_gated_add_kernel`'s bits, as
    `_down_pairs_kernel` stores it. Before its wait, while the down runs, it reads its row's ids and weights (written
    before the plan) and the shared expert's output and logit (joined before the gate-up) and ranks the ids."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    slots = tl.arange(0, K_POW2)
    slot_ok = slots < TOP_K
    ids = load_settled(ids_ptr + row * TOP_K + slots, slot_ok, 2147483647)
    wts = load_settled(wts_ptr + row * TOP_K + slots, slot_ok, 0.0)
    rank = _ascending_places(ids, slots)
    if GATED:
        shared = load_settled(shared_ptr + row.to(tl.int64) * D + cols, col_ok, 0.0)
        logit = load_settled(logit_ptr + row.to(tl.int64) * stride_logit, None, None)
    enter(PDL)
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # unrolled, so that the pairs' loads need not wait on the sum before them
        chosen = rank == j
        slot = tl.sum(tl.where(chosen, slots, 0), 0)
        w = tl.sum(tl.where(chosen, wts, 0.0), 0)
        y = tl.load(y_ptr + (row * TOP_K + slot).to(tl.int64) * D + cols, mask=col_ok, other=0.0)
        acc = acc + w * y
    out = out_ptr + row.to(tl.int64) * D + cols
    if GATED:
        acc = gated_value(acc, logit, shared, True, INTERPRET)
    tl.store(out, round_to_act(acc, OUT_BF16, INTERPRET), mask=col_ok)  # fp32 stays as it is


@triton.jit
def _down_pairs_kernel(
    h_ptr,
    ids_ptr,
    wts_ptr,
    w_ptr,
    s_ptr,
    s2_ptr,
    y_ptr,
    count_ptr,
    out_ptr,
    shared_ptr,
    logit_ptr,
    D,
    INTER,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_logit,
    TOP_K: tl.constexpr,
    K_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    FP4: tl.constexpr,
    OUT_BF16: tl.constexpr,
    GATED: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
    SPAN: tl.constexpr,
):
    """y = h·Wdᵀ of the pair at one place in one column tile, formed as `_down_kernel` forms it (the pair alone in a
    BLOCK_M-row tile) and stored by place; the last of the row's pairs to arrive at the column tile (an arrival
    counter picks it) adds the row's weighted y in place order, ascending expert id, as `_combine_kernel` adds them,
    and stores the output: the same order whichever pair arrives last. GATED: the output is
    `gated_value(bf16 sum, the row's shared-expert logit, its shared output)`, `_gated_add_kernel`'s bits. Before its
    wait, while the gate-up pairs kernel runs, it finds its place's expert from its row's ids and weights (the
    router's, or `moe_forward`'s copies of them), written before that kernel, which waited for them."""
    n_cols = tl.cdiv(D, BLOCK_N)
    place = tl.program_id(0) // n_cols
    col_tile = tl.program_id(0) % n_cols
    row = place // TOP_K
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < D
    slots = tl.arange(0, K_POW2)
    row_ids = load_settled(ids_ptr + row * TOP_K + slots, slots < TOP_K, 2147483647)
    row_wts = load_settled(wts_ptr + row * TOP_K + slots, slots < TOP_K, 0.0)
    rank = _ascending_places(row_ids, slots)
    e = tl.sum(tl.where(rank == place % TOP_K, row_ids, 0), 0)
    w_e = w_ptr + e.to(tl.int64) * stride_we
    s_e = s_ptr + e.to(tl.int64) * stride_se
    enter(PDL)
    ok = tl.arange(0, BLOCK_M) == 0
    no_rows = tl.zeros((BLOCK_M, 1), dtype=tl.int64)
    h_row = h_ptr + place.to(tl.int64) * INTER + no_rows
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        a_mask = ok[:, None] if EVEN_K else ok[:, None] & (kk < INTER)[None, :]
        a = tl.load(h_row + kk[None, :], mask=a_mask, other=0.0)
        w = _weight_tile(
            w_e, s_e, cols, col_ok, k0, INTER, stride_wn, stride_sn, BLOCK_N, BLOCK_K, EVEN_K, FP4, INTERPRET, SPAN
        )
        acc = _mma(a, w, acc, INTERPRET)
    scale_2 = tl.load(s2_ptr + e) * 128.0 if FP4 else 1.0
    mask = ok[:, None] & col_ok[None, :]
    tl.store(y_ptr + place.to(tl.int64) * D + no_rows + cols[None, :], acc * scale_2, mask=mask)
    tl.debug_barrier()
    counter = count_ptr + row * n_cols + col_tile
    if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == TOP_K - 1:
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for j in range(TOP_K):
            y_row = y_ptr + (row * TOP_K + j).to(tl.int64) * D + no_rows
            y = tl.load(y_row + cols[None, :], mask=mask, other=0.0, cache_modifier=".cg")
            total = total + tl.sum(tl.where(rank == j, row_wts, 0.0), 0) * y
        out = out_ptr + row.to(tl.int64) * D + no_rows + cols[None, :]
        if GATED:
            shared = tl.load(shared_ptr + row.to(tl.int64) * D + no_rows + cols[None, :], mask=mask, other=0.0)
            z = tl.load(logit_ptr + row.to(tl.int64) * stride_logit + no_rows)
            total = gated_value(total, z, shared, True, INTERPRET)  # rounds the routed sum to bf16 first
        tl.store(out, round_to_act(total, OUT_BF16, INTERPRET), mask=mask)  # fp32 stays as it is
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


def _bank_layout(bank: Mapping[str, torch.Tensor]) -> tuple[bool, int, int, int]:
    """(is NVFP4, experts E, hidden d, intermediate I) of a bank, checking its tensors' shapes and dtypes."""
    if any(key in bank for key in PACKED_KEYS):
        raise ValueError("NVFP4 bank in the checkpoint's layout (*_packed): convert it once with kernel_bank")
    if all(key in bank for key in FP4_KEYS):
        gu, gs, gs2 = bank["gate_up_words"], bank["gate_up_scale"], bank["gate_up_scale_2"]
        dp, ds, ds2 = bank["down_words"], bank["down_scale"], bank["down_scale_2"]
        e, two_i, eighth_d = gu.shape
        d, inter = 8 * eighth_d, two_i // 2
        want = {
            "gate_up_words": ((e, two_i, eighth_d), torch.int32),
            "gate_up_scale": ((e, two_i, d // NVFP4_GROUP), torch.float8_e4m3fn),
            "gate_up_scale_2": ((e, 2), torch.float32),
            "down_words": ((e, d, inter // 8), torch.int32),
            "down_scale": ((e, d, inter // NVFP4_GROUP), torch.float8_e4m3fn),
            "down_scale_2": ((e,), torch.float32),
        }
        fp4 = True
        if d % NVFP4_GROUP or inter % NVFP4_GROUP:
            raise ValueError(f"NVFP4 bank: d={d} and I={inter} must be multiples of {NVFP4_GROUP}")
        tensors = dict(zip(FP4_KEYS, (gu, gs, gs2, dp, ds, ds2), strict=True))
    elif all(key in bank for key in BF16_KEYS):
        gu, dn = bank["gate_up"], bank["down"]
        e, two_i, d = gu.shape
        inter = two_i // 2
        want = {"gate_up": ((e, two_i, d), torch.bfloat16), "down": ((e, d, inter), torch.bfloat16)}
        fp4 = False
        tensors = {"gate_up": gu, "down": dn}
    else:
        raise ValueError(f"bank needs keys {FP4_KEYS} (NVFP4) or {BF16_KEYS} (BF16), got {sorted(bank)}")
    for key, (shape, dtype) in want.items():
        t = tensors[key]
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"bank[{key!r}]: expected {shape} {dtype}, got {tuple(t.shape)} {t.dtype}")
        if t.stride(-1) != 1:
            raise ValueError(f"bank[{key!r}] must be contiguous in its last dimension")
    if two_i % 2:
        raise ValueError(f"bank gate_up rows must be 2*I, got {two_i}")
    return fp4, e, d, inter


_COUNTERS = CounterPool(PAIR_COUNTERS, "moe_forward", "row column tiles of the pairs path")


@dataclass(frozen=True, slots=True)
class _Weights:
    """A checked bank as the kernels take it (the BF16 bank's scale slots hold placeholders no kernel reads)."""

    fp4: bool
    experts: int
    d: int
    inter: int
    gate_up: torch.Tensor
    gate_up_scale: torch.Tensor
    gate_up_scale_2: torch.Tensor
    down: torch.Tensor
    down_scale: torch.Tensor
    down_scale_2: torch.Tensor


def _weights(bank: Mapping[str, torch.Tensor]) -> _Weights:
    """The bank's tensors in the kernels' argument order, checked by `_bank_layout`."""
    fp4, experts, d, inter = _bank_layout(bank)
    if fp4:
        return _Weights(fp4, experts, d, inter, *(bank[key] for key in FP4_KEYS))
    gate_up, down = bank["gate_up"], bank["down"]
    return _Weights(fp4, experts, d, inter, gate_up, gate_up, gate_up, down, down, down)


def moe_forward(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    bank: Mapping[str, torch.Tensor],
    out_dtype: torch.dtype = torch.bfloat16,
    tiles: MoeTiles | None = None,
    gated: SharedGate | None = None,
) -> torch.Tensor:
    """Routed experts of x [N, d] bf16 with expert_ids [N, k] and weights [N, k] -> [N, d] out_dtype (bf16/fp32):
    below PAIR_ROWS rows each pair alone (two launches), else grouped by expert (four); the same bits either way.
    With `gated` the output is `gated_add(routed in bf16, gated.gate_logit, gated.shared, out_dtype)`: in the pairs
    path's down launch, else in the combine launch (`SharedGate` says where each path calls `ready`)."""
    wb = _weights(bank)
    n, top_k = expert_ids.shape
    if x.shape != (n, wb.d) or x.dtype != torch.bfloat16 or x.stride(-1) != 1:
        raise ValueError(f"x: expected ({n}, {wb.d}) bf16 contiguous rows, got {tuple(x.shape)} {x.dtype}")
    if weights.shape != (n, top_k):
        raise ValueError(f"weights: expected {(n, top_k)}, got {tuple(weights.shape)}")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype must be bfloat16 or float32, got {out_dtype}")
    if gated is not None:
        _check_shared_gate(gated, x)
    if n == 0:
        if gated is not None:
            gated.ready()
        return torch.empty(n, wb.d, dtype=out_dtype, device=x.device)
    tiles = tiles or moe_tiles(n, top_k, wb.experts)
    ids = expert_ids.to(torch.int32).contiguous()
    wts = weights.to(torch.float32).contiguous()
    if n < PAIR_ROWS:
        out = torch.empty(n, wb.d, dtype=out_dtype, device=x.device)
        _pairs_forward(x, ids, wts, wb, out, tiles, gated)
        return out
    out = torch.empty(n, wb.d, dtype=out_dtype, device=x.device)
    _grouped_forward(x, ids, wts, wb, out, tiles, gated)
    return out


def _check_shared_gate(gated: SharedGate, x: torch.Tensor) -> None:
    """Raise on a shared output or gate logits that do not match x's rows, dtype and device."""
    shared, logit = gated.shared, gated.gate_logit
    for name, t, shape in (("gated.shared", shared, tuple(x.shape)), ("gated.gate_logit", logit, (x.shape[0], 1))):
        if t.dtype != torch.bfloat16:
            raise TypeError(f"{name}: expected bf16, got {t.dtype}")
        if tuple(t.shape) != shape or t.device != x.device:
            raise ValueError(f"{name}: expected {shape} on {x.device}, got {tuple(t.shape)} on {t.device}")


def _k_tile(block_k: int, fp4: bool, k: int) -> tuple[int, int]:
    """(reduction tile, span width or 0) for an NVFP4 (or BF16) matrix reducing over k: a spanned matrix takes
    whole spans a tile (the bits do not depend on the tile)."""
    span = span_k(k) if fp4 else 0
    return max(block_k, span), span


def _pairs_forward(
    x: torch.Tensor,
    ids: torch.Tensor,
    wts: torch.Tensor,
    wb: _Weights,
    out: torch.Tensor,
    tiles: MoeTiles,
    gated: SharedGate | None,
) -> None:
    """Each (row, expert) pair in its own programs: h by place in each row's ascending-expert order, then the down
    projection with the ordered weighted sum (and the gated shared expert) in the same launch; no plan."""
    n, top_k = ids.shape
    interpret = _interpreting()
    h = torch.empty(n * top_k, wb.inter, dtype=torch.bfloat16, device=x.device)
    gate_up_k, gate_up_span = _k_tile(tiles.gate_up_k, wb.fp4, wb.d)
    down_k, down_span = _k_tile(tiles.down_k, wb.fp4, wb.inter)
    shared, logit = out, out
    if gated is not None:  # joined and laid out before the gate-up, so that the down launches right behind it
        gated.ready()
        shared, logit = gated.shared.contiguous(), contiguous_columns(gated.gate_logit)
    _gate_up_pairs_kernel[(n * top_k * triton.cdiv(wb.inter, tiles.gate_up_n),)](
        x, ids, wb.gate_up, wb.gate_up_scale, wb.gate_up_scale_2, h, wb.d, wb.inter,
        x.stride(0), wb.gate_up.stride(0), wb.gate_up.stride(1), wb.gate_up_scale.stride(0),
        wb.gate_up_scale.stride(1), TOP_K=top_k, K_POW2=triton.next_power_of_2(top_k), BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.gate_up_n, BLOCK_K=gate_up_k, EVEN_K=wb.d % gate_up_k == 0, FP4=wb.fp4,
        INTERPRET=interpret, SPAN=gate_up_span, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        **launch_options(_gate_up_pairs_kernel, x.device),
    )  # fmt: skip
    n_cols = triton.cdiv(wb.d, tiles.down_n)
    y = torch.empty(n * top_k, wb.d, dtype=torch.float32, device=x.device)
    _down_pairs_kernel[(n * top_k * n_cols,)](
        h, ids, wts, wb.down, wb.down_scale, wb.down_scale_2, y, _COUNTERS.get(x.device, n * n_cols), out,
        shared, logit, wb.d, wb.inter, wb.down.stride(0), wb.down.stride(1), wb.down_scale.stride(0),
        wb.down_scale.stride(1), logit.stride(0), TOP_K=top_k, K_POW2=triton.next_power_of_2(top_k),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.down_n, BLOCK_K=down_k, EVEN_K=wb.inter % down_k == 0, FP4=wb.fp4,
        OUT_BF16=out.dtype == torch.bfloat16, GATED=gated is not None, INTERPRET=interpret, SPAN=down_span,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        **launch_options(_down_pairs_kernel, x.device),
    )  # fmt: skip


def _grouped_forward(
    x: torch.Tensor,
    ids: torch.Tensor,
    wts: torch.Tensor,
    wb: _Weights,
    out: torch.Tensor,
    tiles: MoeTiles,
    gated: SharedGate | None = None,
) -> None:
    """The rows' pairs grouped by expert through the plan: gate-up and down by row tile, then the combine (adding the
    gated shared expert, whose `ready` runs between the plan and the gate-up launch)."""
    n, top_k = ids.shape
    interpret = _interpreting()
    plan = moe_plan(ids, wb.experts, tiles.block_m)
    h = torch.empty(n * top_k, wb.inter, dtype=torch.bfloat16, device=x.device)
    shared, logit = out, out
    if gated is not None:
        gated.ready()
        shared, logit = gated.shared.contiguous(), contiguous_columns(gated.gate_logit)
    _gate_up_grouped(x, plan, wb, h, top_k, tiles, interpret)
    y = torch.empty(n * top_k, wb.d, dtype=torch.float32, device=x.device)
    _down_grouped(h, plan, wb, y, tiles, interpret)
    block_d = min(combine_block(n), triton.next_power_of_2(wb.d))
    _combine_kernel[(n, triton.cdiv(wb.d, block_d))](
        y, ids, wts, out, shared, logit, wb.d, logit.stride(0), TOP_K=top_k, K_POW2=triton.next_power_of_2(top_k),
        BLOCK_D=block_d, OUT_BF16=out.dtype == torch.bfloat16, GATED=gated is not None, INTERPRET=interpret,
        num_warps=4, **launch_options(_combine_kernel, x.device),
    )  # fmt: skip


def combine_block(rows: int) -> int:
    """The combine's columns a program for a call of `rows` rows."""
    return COMBINE_FEW_BLOCK if rows <= COMBINE_FEW_ROWS else COMBINE_BLOCK


def _gate_up_grouped(
    x: torch.Tensor, plan: MoePlan, wb: _Weights, h: torch.Tensor, top_k: int, tiles: MoeTiles, interpret: bool
) -> None:
    """h by plan position from x: kernels/moe_gluon.py's gate-up kernel where it runs, else ours."""
    gate_up_k, gate_up_span = _k_tile(tiles.gate_up_k, wb.fp4, wb.d)
    if gate_up_span and moe_gluon.gate_up(x, plan, wb, h, top_k, interpret):
        return
    _gate_up_kernel[(plan.max_tiles * triton.cdiv(wb.inter, tiles.gate_up_n),)](
        x, plan.pairs, plan.bounds, plan.tile_experts, plan.tile_starts, wb.gate_up, wb.gate_up_scale,
        wb.gate_up_scale_2, h, wb.d, wb.inter, x.stride(0), wb.gate_up.stride(0), wb.gate_up.stride(1),
        wb.gate_up_scale.stride(0), wb.gate_up_scale.stride(1), TOP_K=top_k, E=wb.experts, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.gate_up_n, BLOCK_K=gate_up_k, EVEN_K=wb.d % gate_up_k == 0, FP4=wb.fp4, INTERPRET=interpret,
        SPAN=gate_up_span, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        **launch_options(_gate_up_kernel, x.device),
    )  # fmt: skip


def _down_grouped(
    h: torch.Tensor, plan: MoePlan, wb: _Weights, y: torch.Tensor, tiles: MoeTiles, interpret: bool
) -> None:
    """fp32 y by pair id from h by plan position: kernels/moe_gluon.py's down kernel where it runs, else ours."""
    down_k, down_span = _k_tile(tiles.down_k, wb.fp4, wb.inter)
    if down_span and moe_gluon.down(h, plan, wb, y, interpret):
        return
    _down_kernel[(plan.max_tiles * triton.cdiv(triton.cdiv(wb.d, tiles.down_n), tiles.down_group),)](
        h, plan.pairs, plan.bounds, plan.tile_experts, plan.tile_starts, wb.down, wb.down_scale, wb.down_scale_2, y,
        wb.d, wb.inter, wb.down.stride(0), wb.down.stride(1), wb.down_scale.stride(0), wb.down_scale.stride(1),
        E=wb.experts, BLOCK_M=tiles.block_m, BLOCK_N=tiles.down_n, BLOCK_K=down_k, GROUP=tiles.down_group,
        EVEN_K=wb.inter % down_k == 0, FP4=wb.fp4, INTERPRET=interpret, SPAN=down_span, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, **launch_options(_down_kernel, h.device),
    )  # fmt: skip


def fp4_lut(device: torch.device | str | None = None) -> torch.Tensor:
    """The 16 signed E2M1 values indexed by code: codes 8..15 are the negatives of 0..7."""
    mags = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])


def dequantize_nvfp4(packed: torch.Tensor, block_scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """fp32 W [out, in] = fp4(code) * e4m3 block scale * scale_2; element 2j is the low nibble of byte j."""
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)
    values = fp4_lut(packed.device)[codes.long()].unflatten(-1, (-1, NVFP4_GROUP))
    return (values * block_scale.float().unsqueeze(-1)).flatten(-2) * scale_2.float()


def expert_weights(bank: Mapping[str, torch.Tensor], e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert e's (gate [I, d], up [I, d], down [d, I]) in fp32, dequantized by the NVFP4 formula if packed."""
    fp4, _, _, inter = _bank_layout(bank)
    if not fp4:
        gate_up = bank["gate_up"][e].float()
        return gate_up[:inter], gate_up[inter:], bank["down"][e].float()
    packed, s2 = from_words(bank["gate_up_words"][e]), bank["gate_up_scale_2"][e]
    scale = natural_scales(bank["gate_up_scale"][e])
    gate = dequantize_nvfp4(packed[:inter], scale[:inter], s2[0])
    up = dequantize_nvfp4(packed[inter:], scale[inter:], s2[1])
    down_scale = natural_scales(bank["down_scale"][e])
    down = dequantize_nvfp4(from_words(bank["down_words"][e]), down_scale, bank["down_scale_2"][e])
    return gate, up, down


def moe_forward_reference(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    bank: Mapping[str, torch.Tensor],
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Plain PyTorch moe_forward: per expert in ascending id, fp32 dots, h rounded to bf16, fp32 weighted sum."""
    xf = x.float()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    wts = weights.float()
    for e in torch.unique(expert_ids).tolist():
        rows, slot = torch.where(expert_ids == e)
        gate, up, down = expert_weights(bank, e)
        g = xf[rows] @ gate.T
        h = (F.silu(g) * (xf[rows] @ up.T)).to(torch.bfloat16).float()
        out[rows] = out[rows] + wts[rows, slot, None] * (h @ down.T)
    return out.to(out_dtype)
