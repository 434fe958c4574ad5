"""Dense BF16 linear y = x·wᵀ for decode and verify rows, each row computed exactly as it would be alone.

Reduction order (the exactness contract). For a weight [N, K] the K axis is cut into `split` ranges of `k_split`
elements; both come from (N, K) alone (`k_ranges`), never from M; `k_split` is a multiple of BLOCK_K = 128 and the
last range ends at K. Within range s, each output element's fp32 accumulator starts at zero and takes the range's
K tiles (BLOCK_K deep, or a multiple of it: `Tiles.block_k`) in increasing k, each through one tensor-core dot
`acc = dot(x_tile, w_tileᵀ, acc)` (on the GPU a chain of 16-deep MMA steps in increasing k, the same chain whatever
the tile's depth; under the interpreter a tile matmul added to acc, whose bits may depend on the depth, so the
interpreter's tiles keep BLOCK_K: `call_tiles`). With split = 1 that
sum, rounded once to the output dtype, is the result. With split > 1 the range sums P_s land in an fp32 workspace
and are added as ((P_0 + P_1) + P_2) + ... in range order, then rounded once: with 16-row tiles by the program of
the tile's last range to finish (an arrival counter picks it; it reloads every P_s, its own too, so the order is
the same whichever range arrives last; with a top-k, the row tile's last arrival over its tiles and ranges), with
wider tiles by a second kernel. The tiles (`pick_tiles`: 16-row tiles
that stream w once for few rows, 64- or 128-row tiles for many) decide only which program computes an element,
never how its sum is formed; on the H200 every tile shape and depth (mma.sync and wgmma alike) gave identical bits,
and so did the top-k launch on four warps (`topk_tiles`).

Epilogues: `linear_gates` stores the hyper read's gates from the sums; `linear_topk` (router logits of one row) has
the row tile's last arrival pick its rows' top-k with `kernels.router.topk_row`, the router kernel's bits, so the
router needs no launch of its own. With K cut, that arrival is the last of every tile's ranges, which adds each row's
range sums in range order as a tile's last range would (one arrival counter in the chain, not two); that launch runs
on TOPK_WARPS warps at least (`topk_tiles`), so the one program's softmax and picks spread over more threads.
`linear_range_sums` stores the K ranges' sums unadded, for a consumer that adds them in range order itself.
`linear_silu_mul` (the shared expert's gate-up) takes a weight of gate/up row pairs (`pair_rows`): each pair's sums,
rounded to bf16 as `linear` stores them, become silu·up by `silu_mul`'s formula, and the gate logit's row is stored
rounded, so h and the logit have the bits of `linear` over [gate; up; logit] then `silu_mul`, in one launch fewer;
such launches are compiled as `silu_mul` is (no fused multiply-adds; exp keeps subnormals).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kernels.counters import CounterPool
from kernels.fp32_ops import hyper_gates, round_to_act
from kernels.gates import silu_mul_value
from kernels.pdl import enter, launch_options, prefetch_enabled, prefetch_l2
from kernels.router import PICKS as ROUTER_PICKS
from kernels.router import router_topk, topk_row

# The interpreter truncates fp32 -> bf16 inside kernels, so there the kernels store fp32 and torch rounds (RNE).
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_K = 128
DEEP_K = 512  # the K tile of few-row calls over big weights taken whole (`few_row_tiles`)
MAX_SPLIT = 16
MIN_RANGE_TILES = 5
MIN_PROGRAMS = 66
SUM_BLOCK = 1024
MAX_TOPK_COLUMNS = 1024  # logits of one row one program's top-k holds
TOPK_ROWS = 1  # rows up to which the router's top-k runs in its logits' launch (one program picks them one by one)
TOPK_WARPS = 4  # warps at least of that launch: the one program's softmax and picks spread over more threads
MAX_TILES = 4096


@dataclass(frozen=True)
class Tiles:
    """Launch shape of one call: the row tile, the column tile, warps, pipeline depth and the K tile a dot takes (a
    power of two, BLOCK_K or more, that divides the K ranges when K is cut: one dot is the same chain of 16-deep MMA
    steps as its parts)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    block_k: int = BLOCK_K


@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    part_ptr,
    count_ptr,
    inj_ptr,
    M,
    N,
    K,
    K_SPLIT,
    stride_xm,
    stride_wn,
    FUSED_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    GATES_R: tl.constexpr,
    GATES_HC: tl.constexpr,
    topk_w_ptr,
    topk_id_ptr,
    TOPK: tl.constexpr,
    TOPK_POW2: tl.constexpr,
    BLOCK_E: tl.constexpr,
    RENORMALISE: tl.constexpr,
    TOPK_PICKS: tl.constexpr,
    PAIRS_H: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of one K range; with FUSED_SPLIT = S the tile's last range adds all S in order
    (with TOPK, the row tile's last arrival over its tiles and ranges).
    ROUND_BF16: the fp32 output holds the sums rounded to bf16; GATES_R > 0: the sums become gates, PAIRS_H > 0:
    silu·up of column pairs (`_store`);
    TOPK > 0: the sums are router logits, and the row tile's last tile or range to be stored picks its rows' top-k
    (`_topk_rows`)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + cols.to(tl.int64)[None, :] * stride_wn
    k_start = pid_s * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, K)
    if PREFETCH:  # weights are never written by a kernel: fetch this program's into L2 while the previous one runs
        lines = w_ptr + tl.minimum(cols, N - 1).to(tl.int64)[None, :] * stride_wn
        for k0 in range(k_start, k_end, BLOCK_K):
            prefetch_l2(lines + tl.minimum(k0 + tl.arange(0, BLOCK_K // 64) * 64, K - 1)[:, None])
    enter(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        kk = k0 + ks
        if EVEN_K:
            a = tl.load(x_rows + kk[None, :], mask=row_ok[:, None], other=0.0)
            b = tl.load(w_cols + kk[:, None], mask=col_ok[None, :], other=0.0)
        else:
            a = tl.load(x_rows + kk[None, :], mask=row_ok[:, None] & (kk[None, :] < K), other=0.0)
            b = tl.load(w_cols + kk[:, None], mask=col_ok[None, :] & (kk[:, None] < K), other=0.0)
        if INTERPRET:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
    ok = row_ok[:, None] & col_ok[None, :]
    offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
    mn = M.to(tl.int64) * N
    if FUSED_SPLIT == 0:
        _store(acc, out_ptr + pid_s * mn, inj_ptr, rows.to(tl.int64)[:, None], cols[None, :], ok, N, ROUND_BF16,
               GATES_R, GATES_HC, PAIRS_H, INTERPRET)  # fmt: skip
        if TOPK > 0:
            _topk_rows(out_ptr, out_ptr, topk_w_ptr, topk_id_ptr, count_ptr, pid_m, M, N, 1, BLOCK_M, TOPK,
                       TOPK_POW2, BLOCK_E, RENORMALISE, TOPK_PICKS)  # fmt: skip
    elif TOPK > 0:
        tl.store(part_ptr + pid_s * mn + offs, acc, mask=ok)
        _topk_rows(part_ptr, out_ptr, topk_w_ptr, topk_id_ptr, count_ptr, pid_m, M, N, FUSED_SPLIT, BLOCK_M, TOPK,
                   TOPK_POW2, BLOCK_E, RENORMALISE, TOPK_PICKS)  # fmt: skip
    else:
        tl.store(part_ptr + pid_s * mn + offs, acc, mask=ok)
        tl.debug_barrier()
        counter = count_ptr + pid_m * tl.num_programs(1) + pid_n
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == FUSED_SPLIT - 1:
            total = tl.load(part_ptr + offs, mask=ok, other=0.0, cache_modifier=".cg")
            for s in tl.static_range(1, FUSED_SPLIT):
                total += tl.load(part_ptr + s * mn + offs, mask=ok, other=0.0, cache_modifier=".cg")
            _store(total, out_ptr, inj_ptr, rows.to(tl.int64)[:, None], cols[None, :], ok, N, ROUND_BF16,
                   GATES_R, GATES_HC, PAIRS_H, INTERPRET)  # fmt: skip
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit
def _topk_rows(
    sums_ptr, out_ptr, w_ptr, id_ptr, count_ptr, pid_m, M, N, RANGES: tl.constexpr, BLOCK_M: tl.constexpr,
    TOPK: tl.constexpr, TOPK_POW2: tl.constexpr, BLOCK_E: tl.constexpr, RENORMALISE: tl.constexpr,
    PICKS: tl.constexpr,
):  # fmt: skip
    """After this program stored its sums (its tile's logits, or with RANGES > 1 its K range's): the row tile's last
    arrival of all its tiles and ranges reloads each of its rows' N logits, with RANGES > 1 adding the ranges' sums in
    range order as a tile's last range does and storing them, and stores their top-k (`kernels.router.topk_row`)."""
    tl.debug_barrier()
    done = count_ptr + pid_m
    if tl.atomic_add(done, 1, sem="acq_rel", scope="gpu") == tl.num_programs(1) * RANGES - 1:
        lanes = tl.arange(0, BLOCK_E)
        valid = lanes < N
        slots = tl.arange(0, TOPK_POW2)
        mn = M.to(tl.int64) * N
        for r in range(BLOCK_M):
            row = (pid_m * BLOCK_M + r).to(tl.int64)
            if row < M:
                logits = tl.load(sums_ptr + row * N + lanes, mask=valid, other=float("-inf"), cache_modifier=".cg")
                for s in tl.static_range(1, RANGES):
                    logits += tl.load(sums_ptr + s * mn + row * N + lanes, mask=valid, other=0.0, cache_modifier=".cg")
                if RANGES > 1:
                    tl.store(out_ptr + row * N + lanes, logits, mask=valid)
                weights, ids = topk_row(logits, lanes, valid, TOPK, TOPK_POW2, BLOCK_E, RENORMALISE, PICKS)
                tl.store(w_ptr + row * TOPK + slots, weights, mask=slots < TOPK)
                tl.store(id_ptr + row * TOPK + slots, ids, mask=slots < TOPK)
        tl.atomic_xchg(done, 0, sem="relaxed", scope="gpu")


@triton.jit
def _output(acc, out_ptr, ROUND_BF16: tl.constexpr):
    """fp32 sums as the output's dtype; ROUND_BF16: rounded to bf16 first (into an fp32 output)."""
    if ROUND_BF16:
        return acc.to(tl.bfloat16).to(tl.float32)
    return acc.to(out_ptr.dtype.element_ty)


@triton.jit
def _pair_halves(x):
    """(even, odd) elements, in row-major order, of a tensor whose last axis has even length."""
    return tl.split(tl.reshape(x, (x.numel // 2, 2)))


@triton.jit
def _store_pairs(total, out_ptr, logit_ptr, rows, cols, ok, H: tl.constexpr, INTERPRET: tl.constexpr):
    """Column pairs (2j, 2j+1) of the sums as (gate, up) rounded to bf16: silu·up (`silu_mul_value`) into out [M, H]
    for j < H, and pair H's first column rounded into logit [M, 1]."""
    gate, up = _pair_halves(total)
    row, _ = _pair_halves(tl.broadcast_to(rows, total.shape))
    col, _ = _pair_halves(tl.broadcast_to(cols, total.shape))
    here, _ = _pair_halves(tl.broadcast_to(ok, total.shape))
    j = col // 2
    gate = round_to_act(gate, True, INTERPRET)
    tl.store(out_ptr + row * H + j, silu_mul_value(gate, round_to_act(up, True, INTERPRET), True, INTERPRET),
             mask=here & (j < H))  # fmt: skip
    tl.store(logit_ptr + row, gate, mask=here & (j == H))


@triton.jit
def _store(
    total, out_ptr, inj_ptr, rows, cols, ok, N, ROUND_BF16: tl.constexpr, GATES_R: tl.constexpr,
    GATES_HC: tl.constexpr, PAIRS_H: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """Store a tile's fp32 sums a: as the output (GATES_R = PAIRS_H = 0), as the hyper read's gates (`hyper_gates`):
    act(silu) of the first GATES_R columns into out [M, GATES_R], act(2·sigmoid) of the rest into inj [M, hc]; or as
    silu·up of column pairs (`_store_pairs`, PAIRS_H > 0), the logit into inj."""
    if PAIRS_H > 0:
        _store_pairs(total, out_ptr, inj_ptr, rows, cols, ok, PAIRS_H, INTERPRET)
    elif GATES_R == 0:
        tl.store(out_ptr + rows * N + cols, _output(total, out_ptr, ROUND_BF16), mask=ok)
    else:
        act_bf16: tl.constexpr = out_ptr.dtype.element_ty == tl.bfloat16
        h, inj = hyper_gates(total, GATES_HC, INTERPRET)
        is_h = cols < GATES_R
        tl.store(out_ptr + rows * GATES_R + cols, round_to_act(h, act_bf16, INTERPRET), mask=ok & is_h)
        tl.store(inj_ptr + rows * GATES_HC + (cols - GATES_R), round_to_act(inj, act_bf16, INTERPRET), mask=ok & ~is_h)


@triton.jit
def _split_sum_kernel(
    part_ptr, out_ptr, inj_ptr, M, N, SPLIT: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
    ROUND_BF16: tl.constexpr, GATES_R: tl.constexpr, GATES_HC: tl.constexpr, PAIRS_H: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    """Add the K-range partials [SPLIT, M·N] in range order and store them once (`_store`)."""
    enter(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mn = M.to(tl.int64) * N
    ok = offs < mn
    acc = tl.load(part_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(part_ptr + s * mn + offs, mask=ok, other=0.0)
    _store(acc, out_ptr, inj_ptr, offs // N, offs % N, ok, N, ROUND_BF16, GATES_R, GATES_HC, PAIRS_H, INTERPRET)


_POOL = CounterPool(MAX_TILES, "linear", "16-row output tiles")


def arrival_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 arrival counters for the current stream of `device`; every launch leaves them zero."""
    return _POOL.get(device, tiles)


@functools.cache
def k_ranges(n: int, k: int) -> tuple[int, int]:
    """(split, k_split) for a weight [n, k], from its shape alone: split K only when 16-wide column tiles are few."""
    tiles_k = triton.cdiv(k, BLOCK_K)
    split = 1
    if triton.cdiv(n, 16) < 256:
        while split * 2 <= MAX_SPLIT and tiles_k >= MIN_RANGE_TILES * split * 2:
            split *= 2
    k_split = triton.cdiv(tiles_k, split) * BLOCK_K
    return triton.cdiv(k, k_split), k_split


def pick_tiles(m: int, n: int, k: int) -> Tiles:
    """Tiles for m rows of a weight [n, k]: 16-row tiles (one pass over w) for few rows, else the first wide tile that
    fills the GPU."""
    split, _ = k_ranges(n, k)
    if m <= 16 or (m <= 32 and n < 1024 and split <= 4):  # from 17 rows o_proj and the hyper read's down go wide
        return few_row_tiles(n, k, split)
    wide = (Tiles(128, 128, 8, 3), Tiles(64, 128, 4, 3)) if m > 64 else (Tiles(64, 128, 4, 3),)
    for tiles in wide:
        if triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n) * split >= MIN_PROGRAMS:
            return tiles
    return Tiles(64, 64, 4, 4)


def few_row_tiles(n: int, k: int, split: int) -> Tiles:
    """16-row tiles by the weight's shape, the fastest of `scripts/gpu_sweep_linear.py` at one and four rows: the vocab
    head 64 columns wide in 256-deep K tiles, the big projections 512-deep ones (32 columns wide from about 7,000
    columns), the row-split ones (o_proj, out_proj) 32 columns in 4 K ranges, the rest 16 columns. (`k_ranges` keeps
    K whole from 4,096 columns, so the deep tiles take whole K.)"""
    if n >= 16384:
        return Tiles(16, 64, 4, 6, 256) if k % 256 == 0 else Tiles(16, 32, 2, 6)
    if n >= 4096 and k % DEEP_K == 0:
        return Tiles(16, 32 if n >= 7168 else 16, 2, 3, DEEP_K)
    if split > 1 and n >= 2048:
        return Tiles(16, 32, 2, 6)
    return Tiles(16, 16, 2, 6 if split == 1 else 4)


@dataclass(frozen=True)
class Gates:
    """Where a launch stores the hyper read's gates instead of its sums (`_store`): h [M, r] from the weight's first r
    rows and inject [M, hc] from the hc after them (None: the weight has r rows)."""

    h: torch.Tensor
    inject: torch.Tensor | None
    hc: int


@dataclass(frozen=True)
class SiluPairs:
    """Where a launch over a weight of gate/up row pairs stores silu·up (`_store_pairs`) instead of its sums: h [M, H]
    from rows 2j (gate) and 2j+1 (up), and logit [M, 1] from row 2H (row 2H+1 is zeros), both bf16."""

    h: torch.Tensor
    logit: torch.Tensor


@dataclass(frozen=True)
class TopK:
    """Where a launch of router logits also stores each row's top-k (`kernels.router.router_topk`'s weights [M, k]
    fp32 and ids [M, k] int32), renormalised or not, the picks taken `picks` a reduction."""

    weights: torch.Tensor
    ids: torch.Tensor
    renormalise: bool
    picks: int = ROUTER_PICKS


def _check_topk(
    topk: TopK, m: int, n: int, out_dtype: torch.dtype, tiles: Tiles, other_epilogue: bool, device: torch.device
) -> None:
    """Refuse a top-k the launch cannot store: it needs 16-row tiles, fp32 sums and no other epilogue."""
    k = topk.weights.shape[-1]
    if topk.weights.shape != (m, k) or topk.ids.shape != (m, k) or not 0 < k <= n or n > MAX_TOPK_COLUMNS:
        raise ValueError(f"launch: top-k weights {tuple(topk.weights.shape)} and ids {tuple(topk.ids.shape)} for "
                         f"{m} rows of {n} logits (at most {MAX_TOPK_COLUMNS})")  # fmt: skip
    if topk.picks not in (1, 2):
        raise ValueError(f"launch: top-k picks must be 1 or 2, got {topk.picks}")
    if topk.weights.dtype != torch.float32 or topk.ids.dtype != torch.int32:
        raise ValueError(
            f"launch: top-k weights must be fp32 and ids int32, got {topk.weights.dtype} and {topk.ids.dtype}"
        )
    if not (topk.weights.is_contiguous() and topk.ids.is_contiguous()):
        raise ValueError("launch: top-k weights and ids must be contiguous")
    if topk.weights.device != device or topk.ids.device != device:
        raise ValueError(f"launch: top-k weights and ids must be on {device}")
    if tiles.block_m != 16 or out_dtype != torch.float32 or other_epilogue:
        raise ValueError("launch: a top-k needs 16-row tiles, fp32 logits and no rounding or gates")


def _check_pairs(pairs: SiluPairs, m: int, n: int, tiles: Tiles, other_epilogue: bool, device: torch.device) -> None:
    """Refuse silu·up outputs the launch cannot store: bf16 h [M, H] and logit [M, 1] for 2H + 2 weight rows, with even
    column tiles and no other epilogue."""
    h = pairs.h.shape[1] if pairs.h.dim() == 2 else -1
    if pairs.h.shape != (m, h) or n != 2 * h + 2 or h < 1:
        raise ValueError(f"launch: pairs h {tuple(pairs.h.shape)} for {m} rows needs a weight of 2·H + 2 rows, got {n}")
    if pairs.logit.shape != (m, 1):
        raise ValueError(f"launch: pairs logit {tuple(pairs.logit.shape)} is not [{m}, 1]")
    for name, t in (("h", pairs.h), ("logit", pairs.logit)):
        if not t.is_contiguous() or t.dtype != torch.bfloat16 or t.device != device:
            raise ValueError(f"launch: pairs {name} must be contiguous bf16 on {device}")
    if tiles.block_n % 2 or other_epilogue:
        raise ValueError("launch: silu·up pairs need even column tiles and no rounding, gates, top-k or range sums")


def call_tiles(m: int, n: int, k: int) -> Tiles:
    """The tiles a call takes: `pick_tiles`', or under the interpreter, which runs a launch's programs one by one in
    Python, 64 columns wide (16 rows for few rows, 64 for more), so fewer programs: tiles never change the bits."""
    if INTERPRET:
        return Tiles(16, 64, 2, 1) if m <= 16 else Tiles(64, 64, 4, 1)
    return pick_tiles(m, n, k)


def topk_tiles(m: int, n: int, k: int) -> Tiles:
    """`call_tiles`' on at least TOPK_WARPS warps, for a launch whose last arrival picks its rows' top-k."""
    tiles = call_tiles(m, n, k)
    return replace(tiles, num_warps=max(tiles.num_warps, TOPK_WARPS))


def launch(
    x: torch.Tensor,
    w: torch.Tensor,
    out_dtype: torch.dtype,
    tiles: Tiles,
    split: int,
    k_split: int,
    round_bf16: bool = False,
    gates: Gates | None = None,
    topk: TopK | None = None,
    range_sums: bool = False,
    pairs: SiluPairs | None = None,
) -> torch.Tensor:
    """Launch the kernel with explicit tiles and K ranges (the knobs tests and benchmarks turn); with `gates` the
    output is gates.h (and gates.inject is written); with `topk` (16-row tiles, fp32 out) its rows' top-k are
    written too; with `range_sums` the output is the K ranges' fp32 sums [split, M, N], not added; with `pairs` the
    output is pairs.h (and pairs.logit is written)."""
    m, k = x.shape
    n = w.shape[0]
    if topk is not None:
        _check_topk(topk, m, n, out_dtype, tiles, round_bf16 or gates is not None, x.device)
    if range_sums and (round_bf16 or gates is not None or topk is not None or out_dtype != torch.float32):
        raise ValueError("launch: range sums are fp32, with no rounding, gates or top-k")
    if pairs is not None:
        _check_pairs(pairs, m, n, tiles, round_bf16 or gates is not None or topk is not None or range_sums, x.device)
    if k_split % BLOCK_K or split != triton.cdiv(k, k_split):
        raise ValueError(f"launch: {split} ranges of {k_split} do not tile K = {k} in steps of {BLOCK_K}")
    depth = tiles.block_k
    if depth < BLOCK_K or depth & (depth - 1) or (split > 1 and k_split % depth):
        raise ValueError(
            f"launch: tiles.block_k = {depth} must be a power of two of at least {BLOCK_K} that divides the K ranges "
            f"({split} of {k_split})"
        )
    if pairs is not None:
        out, gates_r, gates_hc, inject = pairs.h, 0, 1, pairs.logit
    elif gates is None:
        shape = (split, m, n) if range_sums else (m, n)
        out = torch.empty(shape, dtype=torch.float32 if INTERPRET else out_dtype, device=x.device)
        gates_r, gates_hc, inject = 0, 1, out
    else:
        out, gates_r, gates_hc = gates.h, gates.h.shape[1], gates.hc
        inject = gates.inject if gates.inject is not None else out
        if out.shape != (m, gates_r) or n != gates_r + (0 if gates.inject is None else gates_hc):
            raise ValueError(f"launch: gates h {tuple(out.shape)} and hc {gates_hc} do not match w {tuple(w.shape)}")
        if inject is not out and inject.shape != (m, gates_hc):
            raise ValueError(f"launch: gates inject {tuple(inject.shape)} is not [{m}, {gates_hc}]")
        for name, t in (("h", out), ("inject", inject)):  # both are rounded to h's dtype
            if not t.is_contiguous() or t.dtype not in (torch.bfloat16, torch.float32) or t.device != x.device:
                raise ValueError(f"launch: gates {name} must be contiguous bf16 or fp32 on {x.device}")
        if inject.dtype != out.dtype:
            raise ValueError(f"launch: gates inject is {inject.dtype}, h {out.dtype}: they must share a dtype")
    if m == 0:
        return out if gates is not None or range_sums or pairs is not None else out.to(out_dtype)
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n), split)
    fused = split > 1 and tiles.block_m == 16 and not range_sums
    later = split > 1 and not fused and not range_sums  # the K ranges are summed by the second kernel
    part = out if split == 1 or range_sums else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    if topk is not None:  # a row tile's
        counters = arrival_counters(x.device, grid[0])
    else:
        counters = arrival_counters(x.device, grid[0] * grid[1]) if fused else part
    topk_w, topk_id = (topk.weights, topk.ids) if topk is not None else (out, out)
    top_k = 0 if topk is None else topk.weights.shape[1]
    pairs_h = 0 if pairs is None else pairs.h.shape[1]
    # the router's top-k and silu·up are compiled without fused multiply-adds; silu·up's exp keeps subnormals
    exact = {"enable_fp_fusion": topk is None and pairs is None}
    if pairs is not None:
        exact["enable_reflect_ftz"] = False
    _linear_kernel[grid](
        x,
        w,
        part if later else out,
        part,
        counters,
        inject,
        m,
        n,
        k,
        k_split,
        x.stride(0),
        w.stride(0),
        FUSED_SPLIT=split if fused else 0,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        EVEN_K=k % tiles.block_k == 0,
        INTERPRET=INTERPRET,
        PREFETCH=prefetch_enabled(x.device),
        ROUND_BF16=round_bf16 and not INTERPRET and not later,  # partials stay exact fp32
        GATES_R=0 if later else gates_r,
        GATES_HC=gates_hc,
        topk_w_ptr=topk_w,
        topk_id_ptr=topk_id,
        TOPK=top_k,
        TOPK_POW2=triton.next_power_of_2(max(top_k, 1)),
        BLOCK_E=triton.next_power_of_2(n) if topk is not None else 1,
        RENORMALISE=topk is not None and topk.renormalise,
        TOPK_PICKS=1 if topk is None else topk.picks,
        PAIRS_H=0 if later else pairs_h,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        **exact,
        **launch_options(_linear_kernel, x.device),
    )
    if later:
        _split_sum_kernel[(triton.cdiv(m * n, SUM_BLOCK),)](
            part, out, inject, m, n, SPLIT=split, BLOCK=SUM_BLOCK, ROUND_BF16=round_bf16 and not INTERPRET,
            GATES_R=gates_r, GATES_HC=gates_hc, PAIRS_H=pairs_h, INTERPRET=INTERPRET, **exact,
            **launch_options(_split_sum_kernel, x.device),
        )  # fmt: skip
    if gates is not None or range_sums or pairs is not None:
        return out
    if INTERPRET and round_bf16:  # the kernels stored fp32 there: round in torch (nearest even)
        return out.to(torch.bfloat16).to(torch.float32)
    return out.to(out_dtype)


def linear(
    x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16, round_bf16: bool = False
) -> torch.Tensor:
    """y[M, N] = x[M, K] · w[N, K]ᵀ in bf16 with fp32 sums in the fixed K order above, rounded once to out_dtype;
    `round_bf16` (fp32 out): the sums rounded to bf16, stored as fp32 (the bf16 result, ready to all-reduce)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"linear: x {tuple(x.shape)} and w {tuple(w.shape)} do not match as [M, K], [N, K]")
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        raise TypeError(f"linear: x and w must be bf16, got {x.dtype} and {w.dtype}")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise TypeError(f"linear: out_dtype must be bf16 or fp32, got {out_dtype}")
    if round_bf16 and out_dtype != torch.float32:
        raise TypeError(f"linear: round_bf16 stores into fp32, not {out_dtype}")
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    n, k = w.shape
    split, k_split = k_ranges(n, k)
    return launch(x, w, out_dtype, call_tiles(x.shape[0], n, k), split, k_split, round_bf16)


def _launch_bf16(name: str, x: torch.Tensor, w: torch.Tensor, **epilogue) -> torch.Tensor:
    """Check bf16 x [M, K] and w [N, K] for `name`, then launch with `linear`'s K ranges and tiles, fp32 sums into
    the epilogue given (`launch`'s gates, range_sums or pairs)."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1] or x.dtype != torch.bfloat16:
        raise ValueError(f"{name}: x {x.dtype} {tuple(x.shape)} and w {tuple(w.shape)} do not match as bf16")
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    n, k = w.shape
    split, k_split = k_ranges(n, k)
    return launch(x, w, torch.float32, call_tiles(x.shape[0], n, k), split, k_split, **epilogue)


def linear_gates(x: torch.Tensor, w: torch.Tensor, gates: Gates) -> torch.Tensor:
    """The hyper read's gates from its down (+ inject) projection in one launch: the sums of x · wᵀ formed as `linear`
    forms them, then stored as `_store` says into gates.h (returned) and gates.inject."""
    return _launch_bf16("linear_gates", x, w, gates=gates)


def linear_range_sums(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The fp32 sums of x · wᵀ over each of `k_ranges`' K ranges, [split, M, N], formed as `linear` forms them and
    not added: for a consumer that adds them in range order itself (the hyper read's up kernel at one row)."""
    return _launch_bf16("linear_range_sums", x, w, range_sums=True)


def linear_silu_mul(x: torch.Tensor, w_pairs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(gate)·up [M, H], logit [M, 1]), bf16, in one launch over w_pairs [2H + 2, K] (`pair_rows`): the sums of
    x · w_pairsᵀ formed as `linear` forms them, then each pair's two rounded to bf16 and combined as `silu_mul` does,
    so h and logit have the bits of `linear` over [gate; up; logit] followed by `silu_mul`."""
    if w_pairs.dim() != 2 or w_pairs.shape[0] < 4 or w_pairs.shape[0] % 2:
        raise ValueError(f"linear_silu_mul: w_pairs {tuple(w_pairs.shape)} is not [2·H + 2, K] with H >= 1")
    m, h = x.shape[0], (w_pairs.shape[0] - 2) // 2
    pairs = SiluPairs(
        torch.empty((m, h), dtype=torch.bfloat16, device=x.device),
        torch.empty((m, 1), dtype=torch.bfloat16, device=x.device),
    )
    _launch_bf16("linear_silu_mul", x, w_pairs, pairs=pairs)
    return pairs.h, pairs.logit


def pair_rows(gate: torch.Tensor, up: torch.Tensor, logit: torch.Tensor) -> torch.Tensor:
    """gate and up [H, K] and logit [1, K] as `linear_silu_mul`'s weight [2H + 2, K]: rows 2j and 2j+1 gate and up
    row j, then the logit row and a zero row (so pairs never straddle a tile or a row of the sums)."""
    if gate.dim() != 2 or up.shape != gate.shape or logit.shape != (1, gate.shape[1]):
        raise ValueError(
            f"pair_rows: gate {tuple(gate.shape)}, up {tuple(up.shape)} and logit {tuple(logit.shape)} are not "
            "[H, K], [H, K] and [1, K]"
        )
    last = torch.cat([logit, torch.zeros_like(logit)])
    return torch.cat([torch.stack([gate, up], dim=1).flatten(0, 1), last])


def linear_reference(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Plain PyTorch: fp32 matmul of the upcast inputs, rounded once to out_dtype."""
    return (x.float() @ w.float().T).to(out_dtype)


def linear_topk(
    x: torch.Tensor, w: torch.Tensor, k: int, renormalise: bool = True, picks: int = ROUTER_PICKS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router top-k (weights [M, k] fp32, ids [M, k] int32) of the logits x · wᵀ formed as `linear` forms them in
    fp32, with `router_topk`'s bits (its picks `picks` a reduction): up to TOPK_ROWS rows in the logits' own launch
    (one dependent launch fewer), else the router kernel after it."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"linear_topk: x {tuple(x.shape)} and w {tuple(w.shape)} do not match as [M, K], [E, K]")
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        raise TypeError(f"linear_topk: x and w must be bf16, got {x.dtype} and {w.dtype}")
    m, n = x.shape[0], w.shape[0]
    if not 0 < k <= n:
        raise ValueError(f"linear_topk needs 0 < k <= E, got k={k} with E={n}")
    x = x if x.stride(1) == 1 else x.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    split, k_split = k_ranges(n, x.shape[1])
    if m > TOPK_ROWS or n > MAX_TOPK_COLUMNS:
        logits = launch(x, w, torch.float32, call_tiles(m, n, x.shape[1]), split, k_split)
        return router_topk(logits, k, renormalise, picks)
    weights = torch.empty(m, k, dtype=torch.float32, device=x.device)
    ids = torch.empty(m, k, dtype=torch.int32, device=x.device)
    topk = TopK(weights, ids, renormalise, picks)
    launch(x, w, torch.float32, topk_tiles(m, n, x.shape[1]), split, k_split, topk=topk)
    return weights, ids
