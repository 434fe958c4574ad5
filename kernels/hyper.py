"""Gated-residual hyper-connection read (norm, mix, stream mean, inject) and write-back, fused, one row at a time.

`hc_read` turns the wide residual X [N, hc·d] into the sub-block input x [N, d] and the inject weights [N, hc];
`hc_write` adds the sub-block output (or its per-rank fp32 partials, summed here) to every stream. `act` is the
activation dtype (that of X: bf16 in the model, fp32 for exactness tests); every rounding below is round to nearest
even, and every sum and transcendental runs in fp32 (sqrt and division correctly rounded, exp from libdevice).

Read, three launches, each intermediate with its dtype and rounding:
  1. rstd [N, hc] fp32 = 1 / sqrt(Σ x² / d + eps) per stream: one tree sum over the stream held whole (up to
     RSTD_ONE_CHUNK), else lane-wise fp32 sums over chunks of 1,024 in increasing order, then one tree sum; the shape
     depends on d alone.
  2. normed = act(x · rstd · (1 + w_norm)) (rebuilt identically wherever it is used, or stored once, below);
     a [N, r] and a_inj [N, hc] fp32 = normed · W_downᵀ, normed · W_injectᵀ: the K = hc·d axis is cut into
     `split` ranges of `k_split` (from hc·d and d alone, `k_ranges`), each range a chain of tensor-core dots over
     BLOCK_K tiles in increasing k from zero, the range sums added ((P0 + P1) + P2) + ... in range order. Either
     one program runs all ranges in turn, or one program per range stores its sum and the tile's last arrival
     (an arrival counter picks it; it reloads every range sum, so the order is fixed) adds them: same bits.
     Then h [N, r] = act(silu(a / hc)) (stored: the up-projection's operand) and
     inject [N, hc] = act(2 · sigmoid(a_inj / hc)), with silu(v) = v / (1 + exp(-v)), sigmoid(v) = 1 / (1 + exp(-v)).
  3. u = h · W_upᵀ in fp32 (dots over BLOCK_R chunks of r in increasing order), g = sigmoid(u) fp32,
     x [N, d] = act((g_0·normed_0 + g_1·normed_1 + ...) / hc), the stream sum in fp32 in stream order.
With `ReadTiles.via_linear` (bf16 only; the default) step 2 runs on the linear kernel instead: the
first kernel also stores normed [N, hc·d]; the linear kernel forms a and a_inj in one launch over [W_down; W_inject]
(a view when the inject rows follow the down rows in memory, as the model stacks them), whose K ranges, tiles and
range order are those above, so the sums have the same bits, and stores h and inject from them (`linear_gates`; where
its tiles are wider than 16 rows, its second kernel adds the K ranges' sums and stores them). Where the linear kernel
would cut K = hc·d into other ranges (it picks them from its N and K), the fused kernel runs.
With `ReadTiles.up_over_normed` (bf16 only; the default) step 3 runs as one `_up_mix_kernel` launch over the stored
normed rows: u = h · W_upᵀ summed over r in 128-wide tiles (the same chain of 16-deep MMA steps in increasing k as
step 3's BLOCK_R chunks, then zero products past r), kept in registers (never stored), and x formed from u and normed
as step 3 does, so x has the fused kernels' bits (tests/kernels/test_hyper_gpu.py compares them on the GPU). Its
tile holds every stream's columns, so it serves up to UP_MIX_COLUMNS of them (hc, padded to a power of two, times
up_d); wider, the fused kernel runs. With `ReadTiles.up_by_row` (at one row) it gates only the rows that exist, one
at a time, with the same bits; with `ReadTiles.up_adds_ranges` too (at one row) the linear launch stores its K ranges'
sums unadded (`linear_range_sums`) and the up kernel, one row a program, adds them in range order and forms h from
them as the linear kernel's last arrival would, while a column of programs of its own forms and stores inject: the
same bits, with no arrival counter between the two launches.
Write, one launch: y = act(P_0 + P_1 + ...) summed in fp32 in rank order (or y given in act; or, with a
`PeerSum`, this rank's partial and the peer's, exchanged inside the launch: kernels/peer.py), then
  X_b ← act(X_b + inject_b · y) in fp32 (for bf16 the product of two bf16 values is exact in fp32).
Write then read (`hc_write_read`): the read's first launch forms the write's new rows itself (`Write`), stores them
into a tensor of their own and norms them as step 1 does, so the rows, x and inject have the two calls' bits, in one
launch fewer.
Launch tiles (`ReadTiles`) decide only which program computes an element, never how its sums are formed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.counters import CounterPool
from kernels.fp32_ops import hyper_gates, negative_zeros, round_to_act, sigmoid_f32
from kernels.linear import Gates, linear_gates, linear_range_sums
from kernels.linear import k_ranges as linear_k_ranges
from kernels.pdl import enter, launch_options, load_unwritten, prefetch_enabled, prefetch_l2
from kernels.peer import PeerSum, check_peer_sum, exchange_row, peer_args, peer_row_sum, split_peer

# The interpreter computes bf16 dots wrongly and truncates fp32 -> bf16 casts, so there dots run on fp32 operands
# and rounding is done on the bits.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HC_COUNT = 4
MAX_SPLIT = 16
INJECT_BLOCK = 16  # inject columns padded to one 16-wide dot tile, so hc <= 16
MAX_TILES = 1024
MIN_PROGRAMS = 264
WRITE_BLOCK = 256
UP_BLOCK_K = 128  # `_up_mix_kernel`'s chunk of r
RSTD_ONE_CHUNK = 4096  # the widest stream the rstd kernel holds in registers whole
UP_MIX_COLUMNS = 128  # the most columns (streams padded to a power of two, times up_d) of `_up_mix_kernel`'s tile
UP_BY_ROW = 1  # rows up to which `_up_mix_kernel` gates its rows one at a time, not its whole 16-row tile


@dataclass(frozen=True, slots=True)
class ReadTiles:
    """Launch shape of one read: row and column tiles of both GEMM kernels, whether one program runs every K range."""

    down_m: int
    down_r: int
    up_m: int
    up_d: int
    in_program: bool
    num_warps: int
    num_stages: int
    via_linear: bool = False  # the down projection (and inject) by the linear kernel over stored normed rows
    up_over_normed: bool = False  # the up projection and gated stream mean by `_up_mix_kernel` over stored normed rows
    up_by_row: bool = False  # `_up_mix_kernel` gates and sums only its tile's rows that exist, one at a time
    up_adds_ranges: bool = False  # with up_by_row: `_up_mix_kernel` forms h and inject from the down's K-range sums


def block_k(d: int) -> int:
    """Down-projection K tile: the largest of 128, 64, 32, 16 dividing d (so a tile never straddles two streams)."""
    return next(b for b in (128, 64, 32, 16) if d % b == 0)


def block_r(r: int) -> int:
    """Up-projection reduction chunk over r, from r alone."""
    return 64 if r > 32 else max(16, triton.next_power_of_2(r))


def rstd_block(d: int) -> int:
    """The rstd kernel's chunk of a stream, from d alone: the whole stream up to RSTD_ONE_CHUNK, else 1,024."""
    whole = triton.next_power_of_2(d)
    return whole if whole <= RSTD_ONE_CHUNK else 1024


def rstd_warps(block_d: int) -> int:
    """The rstd kernel's warps: eight from chunks of 2,048 (at most 16 elements a thread), else four."""
    return 8 if block_d >= 2048 else 4


def k_ranges(k: int, d: int) -> tuple[int, int]:
    """(split, k_split) for K = hc·d, from the shape alone: up to MAX_SPLIT ranges of at least two K tiles."""
    tiles = k // block_k(d)
    per_range = triton.cdiv(tiles, min(MAX_SPLIT, max(1, tiles // 2)))
    k_split = per_range * block_k(d)
    return triton.cdiv(k, k_split), k_split


def down_via_linear(k: int, d: int, r: int, hc: int, inject: bool) -> bool:
    """May the linear kernel take the down (+ inject) projection? Only where it cuts K as the fused kernel does."""
    return linear_k_ranges(r + (hc if inject else 0), k) == k_ranges(k, d)


def read_tiles(n: int, r: int) -> ReadTiles:
    """Tiles for n rows: down by the linear kernel and up over the stored normed rows (bf16), the up tiles 16 to 128
    rows high."""
    if INTERPRET:  # one program runs a read's K ranges, and tiles are wide: the interpreter runs programs one by one
        return ReadTiles(64, 16, 64, 64, True, 4, 1)
    if n <= 32:
        by_row = n <= UP_BY_ROW
        return ReadTiles(16, 32, 16, 16, False, 2, 3, True, True, up_by_row=by_row, up_adds_ranges=by_row)
    if n <= 256:
        return ReadTiles(16, 32, 64, 16, False, 4, 3, via_linear=True, up_over_normed=True)
    in_program = triton.cdiv(n, 64) * triton.cdiv(r, 64) >= MIN_PROGRAMS
    return ReadTiles(64, 64, 128, 32, in_program, 8, 3, via_linear=True, up_over_normed=True)


@triton.jit
def _dot(a, b, acc, ACT_BF16: tl.constexpr, INTERPRET: tl.constexpr):
    """acc + a·b in fp32: bf16 tensor cores, IEEE fp32 for fp32 operands, fp32 operands under the interpreter."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    elif ACT_BF16:
        return tl.dot(a, b, acc)
    else:
        return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _normed(
    wide_ptr,
    rstd_ptr,
    nw_ptr,
    rows,
    row_ok,
    cols,
    col_ok,
    b,
    stride_w,
    HC: tl.constexpr,
    COL_MASK: tl.constexpr,
    ACT_BF16: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """act(x · rstd_b · (1 + w)) for `rows` × wide columns `cols` of stream b (`col_ok` applied if COL_MASK)."""
    ptrs = wide_ptr + rows.to(tl.int64)[:, None] * stride_w + cols[None, :]
    if COL_MASK:
        x = tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(nw_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    else:
        x = tl.load(ptrs, mask=row_ok[:, None], other=0.0).to(tl.float32)
        w = tl.load(nw_ptr + cols).to(tl.float32)
    rs = tl.load(rstd_ptr + rows * HC + b, mask=row_ok, other=0.0)
    return round_to_act(x * rs[:, None] * (1.0 + w)[None, :], ACT_BF16, INTERPRET)


@triton.jit
def _write_y(y_ptr, recv_ptr, row, cols, ok, D, stride_yr, stride_yn, RANKS: tl.constexpr, PEER: tl.constexpr,
             ACT_BF16: tl.constexpr, INTERPRET: tl.constexpr):  # fmt: skip
    """The write's y at `cols` of one row in fp32: as given, act(Σ partials in rank order) if RANKS, or act(this
    rank's partial + the peer's received one) if PEER."""
    if PEER:
        return round_to_act(peer_row_sum(y_ptr, recv_ptr, row, cols, ok, D, stride_yn), ACT_BF16, INTERPRET).to(
            tl.float32
        )
    y_row = y_ptr + row * stride_yn + cols
    if RANKS == 0:
        return tl.load(y_row, mask=ok, other=0.0).to(tl.float32)
    y = tl.load(y_row, mask=ok, other=0.0)
    for rank in tl.static_range(1, RANKS):
        y += tl.load(y_row + rank * stride_yr, mask=ok, other=0.0)
    return round_to_act(y, ACT_BF16, INTERPRET).to(tl.float32)


@triton.jit
def _written(wide_ptr, inj_ptr, y, row, b, cols, ok, D, stride_w, stride_i, ACT_BF16: tl.constexpr,
             INTERPRET: tl.constexpr):  # fmt: skip
    """The write's new X_b at `cols` of one row: act(X_b + inject_b · y)."""
    s = tl.load(inj_ptr + row * stride_i + b).to(tl.float32)
    x = tl.load(wide_ptr + row * stride_w + b * D + cols, mask=ok, other=0.0).to(tl.float32)
    return round_to_act(x + s * y, ACT_BF16, INTERPRET)


@triton.jit(do_not_specialize=["site"])
def _rstd_kernel(
    wide_ptr,
    rstd_ptr,
    nw_ptr,
    normed_ptr,
    y_ptr,
    inj_ptr,
    new_ptr,
    recv_ptr,
    send_ptr,
    flags_ptr,
    peer_flags_ptr,
    epoch_ptr,
    site,
    D,
    stride_w,
    stride_new,
    stride_n,
    stride_yr,
    stride_yn,
    stride_i,
    eps,
    HC: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WRITE_NORMED: tl.constexpr,
    WRITE: tl.constexpr,
    RANKS: tl.constexpr,
    PEER: tl.constexpr,
    ACT_BF16: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
):
    """rstd[row, b] = 1 / sqrt(mean of x² over stream b + eps), fp32: with ONE_CHUNK one tree sum over the stream
    held in registers, else lane sums over chunks then one tree sum; with WRITE_NORMED also stream b of normed =
    act(x · rstd · (1 + w)). With WRITE, x is first the write's new X_b (`_written`), stored to new_ptr (and read
    back from there by the chunked form); with PEER its y sums this rank's partial and the peer's, exchanged first
    (kernels/peer.py; stream 0's program pushes the row)."""
    row = tl.program_id(0)
    b = tl.program_id(1)
    row64 = row.to(tl.int64)
    base = (new_ptr + row64 * stride_new if WRITE else wide_ptr + row64 * stride_w) + b * D
    cols = tl.arange(0, BLOCK_D)
    ok = cols < D
    if ONE_CHUNK and WRITE_NORMED:  # the norm weight, which no kernel writes, read while the previous kernel runs
        w = load_unwritten(nw_ptr + b * D + cols, ok, 0.0).to(tl.float32)
    enter(PDL)
    if PEER:
        exchange_row(y_ptr, send_ptr, flags_ptr, peer_flags_ptr, epoch_ptr, site, row64, D, stride_yn, b == 0,
                     BLOCK_D)  # fmt: skip
    if ONE_CHUNK:  # the stream in registers: loaded (or written) once, normed from there, nothing read back
        if WRITE:
            y = _write_y(y_ptr, recv_ptr, row64, cols, ok, D, stride_yr, stride_yn, RANKS, PEER, ACT_BF16, INTERPRET)
            written = _written(wide_ptr, inj_ptr, y, row64, b, cols, ok, D, stride_w, stride_i, ACT_BF16, INTERPRET)
            tl.store(base + cols, written, mask=ok)
            x = written.to(tl.float32)
        else:
            x = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)
        mean = tl.div_rn(tl.sum(x * x, axis=0), D.to(tl.float32))
        rs = tl.div_rn(1.0, tl.sqrt_rn(mean + eps))
        tl.store(rstd_ptr + row * HC + b, rs)
        if WRITE_NORMED:
            out = normed_ptr + row64 * stride_n + b * D + cols
            tl.store(out, round_to_act(x * rs * (1.0 + w), ACT_BF16, INTERPRET), mask=ok)
        return
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        if WRITE:
            y = _write_y(
                y_ptr, recv_ptr, row64, cols, cols < D, D, stride_yr, stride_yn, RANKS, PEER, ACT_BF16, INTERPRET
            )
            written = _written(
                wide_ptr, inj_ptr, y, row64, b, cols, cols < D, D, stride_w, stride_i, ACT_BF16, INTERPRET
            )
            tl.store(base + cols, written, mask=cols < D)
            x = written.to(tl.float32)
        else:
            x = tl.load(base + cols, mask=cols < D, other=0.0).to(tl.float32)
        acc += x * x
    mean = tl.div_rn(tl.sum(acc, axis=0), D.to(tl.float32))
    rs = tl.div_rn(1.0, tl.sqrt_rn(mean + eps))
    tl.store(rstd_ptr + row * HC + b, rs)
    if WRITE_NORMED:
        if WRITE:  # the loop below loads the rows this program stored above
            tl.debug_barrier()
        out = normed_ptr + row64 * stride_n + b * D
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            ok = cols < D
            x = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)
            w = tl.load(nw_ptr + b * D + cols, mask=ok, other=0.0).to(tl.float32)
            tl.store(out + cols, round_to_act(x * rs * (1.0 + w), ACT_BF16, INTERPRET), mask=ok)


@triton.jit
def _range_dot(
    wide_ptr,
    rstd_ptr,
    nw_ptr,
    wd_ptr,
    wi_ptr,
    rows,
    row_ok,
    cols,
    col_ok,
    k_start,
    k_end,
    D,
    stride_w,
    stride_wd,
    stride_wi,
    with_inject,
    HC: tl.constexpr,
    ACT_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_I: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """One K range's fp32 sums from zero, tiles in increasing k: (normed · W_downᵀ, normed · W_injectᵀ)."""
    ks = tl.arange(0, BLOCK_K)
    icols = tl.arange(0, BLOCK_I)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    iacc = tl.zeros((BLOCK_M, BLOCK_I), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        kk = k0 + ks
        a = _normed(
            wide_ptr, rstd_ptr, nw_ptr, rows, row_ok, kk, row_ok, k0 // D, stride_w, HC, False, ACT_BF16, INTERPRET
        )
        w = tl.load(wd_ptr + cols.to(tl.int64)[None, :] * stride_wd + kk[:, None], mask=col_ok[None, :], other=0.0)
        acc = _dot(a, w, acc, ACT_BF16, INTERPRET)
        if with_inject:
            wi = tl.load(wi_ptr + icols[None, :] * stride_wi + kk[:, None], mask=icols[None, :] < HC, other=0.0)
            iacc = _dot(a, wi, iacc, ACT_BF16, INTERPRET)
    return acc, iacc


@triton.jit
def _finish_down(
    acc,
    iacc,
    h_ptr,
    inj_ptr,
    rows,
    row_ok,
    cols,
    col_ok,
    R,
    with_inject,
    HC: tl.constexpr,
    ACT_BF16: tl.constexpr,
    BLOCK_I: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Store h = act(silu(a / hc)) and, for the first column tile, inject = act(2·sigmoid(a_inj / hc))."""
    h, _no_inject = hyper_gates(acc, HC, INTERPRET)
    ok = row_ok[:, None] & col_ok[None, :]
    tl.store(h_ptr + rows.to(tl.int64)[:, None] * R + cols[None, :], round_to_act(h, ACT_BF16, INTERPRET), mask=ok)
    if with_inject:
        icols = tl.arange(0, BLOCK_I)
        _no_h, inj = hyper_gates(iacc, HC, INTERPRET)
        tl.store(
            inj_ptr + rows.to(tl.int64)[:, None] * HC + icols[None, :],
            round_to_act(inj, ACT_BF16, INTERPRET),
            mask=row_ok[:, None] & (icols[None, :] < HC),
        )


@triton.jit(do_not_specialize=["M"])
def _down_kernel(
    wide_ptr,
    rstd_ptr,
    nw_ptr,
    wd_ptr,
    wi_ptr,
    part_ptr,
    ipart_ptr,
    h_ptr,
    inj_ptr,
    count_ptr,
    M,
    D,
    R,
    K_SPLIT,
    stride_w,
    stride_wd,
    stride_wi,
    HC: tl.constexpr,
    SPLIT: tl.constexpr,
    IN_PROGRAM: tl.constexpr,
    HAS_INJ: tl.constexpr,
    ACT_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_I: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    """Norm + down (+ inject) projection of one [BLOCK_M, BLOCK_R] tile: all K ranges, or range pid_s of SPLIT."""
    enter(PDL)
    pid_j = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_j * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < M
    col_ok = cols < R
    K = HC * D
    # `first`: whether this program also forms inject (a constexpr False drops that code when there is none)
    first = pid_j == 0 if HAS_INJ else False
    if IN_PROGRAM:
        acc, iacc = _range_dot(
            wide_ptr,
            rstd_ptr,
            nw_ptr,
            wd_ptr,
            wi_ptr,
            rows,
            row_ok,
            cols,
            col_ok,
            0,
            tl.minimum(K_SPLIT, K),
            D,
            stride_w,
            stride_wd,
            stride_wi,
            first,
            HC,
            ACT_BF16,
            BLOCK_M,
            BLOCK_R,
            BLOCK_K,
            BLOCK_I,
            INTERPRET,
        )
        for s in range(1, SPLIT):
            k_start = s * K_SPLIT
            part, ipart = _range_dot(
                wide_ptr,
                rstd_ptr,
                nw_ptr,
                wd_ptr,
                wi_ptr,
                rows,
                row_ok,
                cols,
                col_ok,
                k_start,
                tl.minimum(k_start + K_SPLIT, K),
                D,
                stride_w,
                stride_wd,
                stride_wi,
                first,
                HC,
                ACT_BF16,
                BLOCK_M,
                BLOCK_R,
                BLOCK_K,
                BLOCK_I,
                INTERPRET,
            )
            acc += part
            iacc += ipart
        _finish_down(acc, iacc, h_ptr, inj_ptr, rows, row_ok, cols, col_ok, R, first, HC, ACT_BF16, BLOCK_I, INTERPRET)
    else:
        k_start = pid_s * K_SPLIT
        acc, iacc = _range_dot(
            wide_ptr,
            rstd_ptr,
            nw_ptr,
            wd_ptr,
            wi_ptr,
            rows,
            row_ok,
            cols,
            col_ok,
            k_start,
            tl.minimum(k_start + K_SPLIT, K),
            D,
            stride_w,
            stride_wd,
            stride_wi,
            first,
            HC,
            ACT_BF16,
            BLOCK_M,
            BLOCK_R,
            BLOCK_K,
            BLOCK_I,
            INTERPRET,
        )
        if SPLIT == 1:
            _finish_down(
                acc, iacc, h_ptr, inj_ptr, rows, row_ok, cols, col_ok, R, first, HC, ACT_BF16, BLOCK_I, INTERPRET
            )
        else:
            ok = row_ok[:, None] & col_ok[None, :]
            offs = rows.to(tl.int64)[:, None] * R + cols[None, :]
            ioffs = rows.to(tl.int64)[:, None] * BLOCK_I + tl.arange(0, BLOCK_I)[None, :]
            mr = M.to(tl.int64) * R
            mi = M.to(tl.int64) * BLOCK_I
            tl.store(part_ptr + pid_s * mr + offs, acc, mask=ok)
            if first:
                tl.store(ipart_ptr + pid_s * mi + ioffs, iacc, mask=row_ok[:, None])
            tl.debug_barrier()
            counter = count_ptr + pid_m * tl.num_programs(0) + pid_j
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
                total = tl.load(part_ptr + offs, mask=ok, other=0.0, cache_modifier=".cg")
                itotal = tl.zeros((BLOCK_M, BLOCK_I), dtype=tl.float32)
                if first:
                    itotal = tl.load(ipart_ptr + ioffs, mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
                for s in tl.static_range(1, SPLIT):
                    total += tl.load(part_ptr + s * mr + offs, mask=ok, other=0.0, cache_modifier=".cg")
                    if first:
                        itotal += tl.load(
                            ipart_ptr + s * mi + ioffs, mask=row_ok[:, None], other=0.0, cache_modifier=".cg"
                        )
                _finish_down(
                    total,
                    itotal,
                    h_ptr,
                    inj_ptr,
                    rows,
                    row_ok,
                    cols,
                    col_ok,
                    R,
                    first,
                    HC,
                    ACT_BF16,
                    BLOCK_I,
                    INTERPRET,
                )
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["M"])
def _mix_kernel(
    wide_ptr,
    rstd_ptr,
    nw_ptr,
    h_ptr,
    wu_ptr,
    x_ptr,
    M,
    D,
    R,
    stride_w,
    stride_wu,
    HC: tl.constexpr,
    ACT_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    """x tile = act(Σ_b sigmoid(h · W_up,bᵀ) · normed_b / hc), streams summed in order."""
    enter(PDL)
    pid_t = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_t * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = rows < M
    col_ok = cols < D
    rks = tl.arange(0, BLOCK_R)
    h_rows = h_ptr + rows.to(tl.int64)[:, None] * R
    # -0.0 is the exact additive identity, so the stream sum starts with the first term's own bits
    total = negative_zeros((BLOCK_M, BLOCK_D))
    for b in tl.static_range(HC):
        wide_cols = b * D + cols
        w_cols = wu_ptr + wide_cols.to(tl.int64)[None, :] * stride_wu
        u = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):
            rk = r0 + rks
            rk_ok = rk < R
            hh = tl.load(h_rows + rk[None, :], mask=row_ok[:, None] & rk_ok[None, :], other=0.0)
            w = tl.load(w_cols + rk[:, None], mask=rk_ok[:, None] & col_ok[None, :], other=0.0)
            u = _dot(hh, w, u, ACT_BF16, INTERPRET)
        normed = _normed(
            wide_ptr, rstd_ptr, nw_ptr, rows, row_ok, wide_cols, col_ok, b, stride_w, HC, True, ACT_BF16, INTERPRET
        )
        total = total + sigmoid_f32(u, INTERPRET) * normed.to(tl.float32)
    x = round_to_act(tl.div_rn(total, tl.full(total.shape, HC, tl.float32)), ACT_BF16, INTERPRET)
    tl.store(x_ptr + rows.to(tl.int64)[:, None] * D + cols[None, :], x, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _bits(x, ACT_BF16: tl.constexpr):
    """x's bits (act: bf16 or fp32) as uint32: integer sums of one term and zeros keep them, whatever the backend."""
    if ACT_BF16:
        return x.to(tl.uint16, bitcast=True).to(tl.uint32)
    else:
        return x.to(tl.uint32, bitcast=True)


@triton.jit
def _from_bits(bits, ACT_BF16: tl.constexpr):
    """The fp32 value of act bits from `_bits`."""
    if ACT_BF16:
        return (bits << 16).to(tl.float32, bitcast=True)
    else:
        return bits.to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["M"])
def _up_mix_kernel(
    h_ptr,
    wu_ptr,
    normed_ptr,
    x_ptr,
    inj_ptr,
    M,
    D,
    R,
    stride_wu,
    stride_n,
    HC: tl.constexpr,
    HC_PAD: tl.constexpr,
    ACT_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
    PREFETCH: tl.constexpr,
    BY_ROW: tl.constexpr,
    RANGES: tl.constexpr,
    INJ: tl.constexpr,
):
    """x tile = act(Σ_b sigmoid(u_b) · normed_b / hc) over the stored normed rows, streams summed in order from -0.0;
    u = h · W_upᵀ for the tile's columns of every stream at once ([BLOCK_M, HC_PAD · BLOCK_D], stream-major), in fp32
    as `_mix_kernel` sums it (one chain over r from zero, zero products past r), kept in registers. BY_ROW: the gates
    and the sum run on the tile's rows below M one at a time (`_mix_rows`), not on all BLOCK_M rows.
    RANGES > 0 (with BY_ROW): one row a program (its tile's first); h_ptr holds the down projection's K-range sums
    [RANGES, M, R (+ HC with INJ)] in fp32, from which the kernel forms the row's h (`_gated_row`); with INJ a last
    column of programs, past D, stores each row's inject and nothing else."""
    pid_d = tl.program_id(0)
    pid_m = tl.program_id(1)
    k_end = R  # of the dots over r
    if RANGES > 0:
        row0 = pid_m
        rows_here = 1
        if INJ:  # a program past D stores inject, and runs no dots and stores no x
            inject_only = pid_d * BLOCK_D >= D
            rows_here = tl.where(inject_only, 0, 1)
            k_end = tl.where(inject_only, 0, R)
    else:
        row0 = pid_m * BLOCK_M
        rows_here = tl.minimum(BLOCK_M, M - row0)
    rows = row0 + tl.arange(0, BLOCK_M)
    row_ok = tl.arange(0, BLOCK_M) < rows_here
    lanes = tl.arange(0, HC_PAD * BLOCK_D)
    stream = lanes // BLOCK_D
    cols = pid_d * BLOCK_D + lanes % BLOCK_D
    lane_ok = (stream < HC) & (cols < D)
    w_rows = (tl.minimum(stream, HC - 1) * D + tl.minimum(cols, D - 1)).to(tl.int64) * stride_wu  # in W_up
    ks = tl.arange(0, BLOCK_K)
    if PREFETCH:  # weights are never written by a kernel: fetch this program's into L2 while the previous one runs
        for k0 in range(0, k_end, BLOCK_K):
            prefetch_l2(wu_ptr + w_rows[None, :] + tl.minimum(k0 + tl.arange(0, BLOCK_K // 64) * 64, R - 1)[:, None])
    which = tl.arange(0, HC_PAD)[None, :, None]
    d_cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = row_ok[:, None] & (d_cols < D)[None, :]
    enter(PDL)
    if RANGES > 0 and INJ:  # the range sums are the previous launch's: read after the wait
        _store_inject(h_ptr, inj_ptr, row0, inject_only, M, R, RANGES, HC, HC_PAD, ACT_BF16, INTERPRET)
    # every stream's normed tile, loaded before the dots so that its latency passes under theirs
    if BY_ROW:  # in u's lane order
        normed_at = normed_ptr + rows.to(tl.int64)[:, None] * stride_n + (stream * D + cols)[None, :]
        normed_bits = _bits(tl.load(normed_at, mask=row_ok[:, None] & lane_ok[None, :], other=0.0), ACT_BF16)
    else:
        normed_at = normed_ptr + rows.to(tl.int64)[:, None, None] * stride_n + which * D + d_cols[None, None, :]
        normed_bits = _bits(tl.load(normed_at, mask=ok[:, None, :] & (which < HC), other=0.0), ACT_BF16)
    h_rows = h_ptr + rows.to(tl.int64)[:, None] * R
    sums_n = R + HC if INJ else R  # columns of the K-range sums
    u = tl.zeros((BLOCK_M, HC_PAD * BLOCK_D), dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        kk = k0 + ks
        if RANGES > 0:
            hh = _gated_row(h_ptr, row0, M, sums_n, kk, R, RANGES, HC, ACT_BF16, BLOCK_M, BLOCK_K, INTERPRET)
        else:
            hh = tl.load(h_rows + kk[None, :], mask=row_ok[:, None] & (kk[None, :] < R), other=0.0)
        w = tl.load(wu_ptr + w_rows[None, :] + kk[:, None], mask=lane_ok[None, :] & (kk[:, None] < R), other=0.0)
        u = _dot(hh, w, u, ACT_BF16, INTERPRET)
    if BY_ROW:
        _mix_rows(u, normed_bits, x_ptr, row0, rows_here, D, d_cols, HC, HC_PAD, ACT_BF16, BLOCK_M, BLOCK_D, INTERPRET)
    else:
        by_stream = tl.reshape(u, (BLOCK_M, HC_PAD, BLOCK_D))
        total = negative_zeros((BLOCK_M, BLOCK_D))
        for b in tl.static_range(HC):
            u_b = tl.sum(tl.where(which == b, by_stream, 0.0), axis=1)  # one term and +0.0s: u_b's own value
            normed = _from_bits(tl.sum(tl.where(which == b, normed_bits, 0), axis=1), ACT_BF16)  # one term's bits
            total = total + sigmoid_f32(u_b, INTERPRET) * normed
        x = round_to_act(tl.div_rn(total, tl.full(total.shape, HC, tl.float32)), ACT_BF16, INTERPRET)
        tl.store(x_ptr + rows.to(tl.int64)[:, None] * D + d_cols[None, :], x, mask=ok)


@triton.jit
def _range_total(sums_ptr, row, cols, ok, M, N, RANGES: tl.constexpr):
    """One row's fp32 sums over the K ranges at cols, added ((P_0 + P_1) + P_2) + ... in range order, as the linear
    kernel's last arrival adds them."""
    at = sums_ptr + row.to(tl.int64) * N + cols
    mn = M.to(tl.int64) * N
    total = tl.load(at, mask=ok, other=0.0)
    for s in tl.static_range(1, RANGES):
        total += tl.load(at + s * mn, mask=ok, other=0.0)
    return total


@triton.jit
def _gated_row(
    sums_ptr, row, M, N, kk, R, RANGES: tl.constexpr, HC: tl.constexpr, ACT_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """The h tile [BLOCK_M, BLOCK_K] at r = kk with one row, the first: act(silu(a / hc)) from the row's K-range
    sums, the linear kernel's gates (`hyper_gates`) bit for bit; +0.0 past r and in the other rows, as a masked load
    gives."""
    h, _no_inject = hyper_gates(_range_total(sums_ptr, row, kk, kk < R, M, N, RANGES), HC, INTERPRET)
    h = round_to_act(h, ACT_BF16, INTERPRET)
    return tl.where(tl.arange(0, BLOCK_M)[:, None] == 0, h[None, :], tl.zeros((BLOCK_M, BLOCK_K), h.dtype))


@triton.jit
def _store_inject(
    sums_ptr, inj_ptr, row, here, M, R, RANGES: tl.constexpr, HC: tl.constexpr, HC_PAD: tl.constexpr,
    ACT_BF16: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """If `here` (this program's task), the row's inject = act(2·sigmoid(a / hc)), from the K-range sums of its last
    HC columns."""
    if here:
        lanes = tl.arange(0, HC_PAD)
        sums = _range_total(sums_ptr, row, R + lanes, lanes < HC, M, R + HC, RANGES)
        _no_h, inj = hyper_gates(sums, HC, INTERPRET)
        tl.store(inj_ptr + row.to(tl.int64) * HC + lanes, round_to_act(inj, ACT_BF16, INTERPRET), mask=lanes < HC)


@triton.jit
def _mix_rows(
    u, normed_bits, x_ptr, row0, rows_here, D, d_cols, HC: tl.constexpr, HC_PAD: tl.constexpr,
    ACT_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """`_up_mix_kernel`'s x for the first rows_here rows of its tile (rows row0, row0 + 1, ...), one at a time: u
    [BLOCK_M, HC_PAD · BLOCK_D] and the normed bits in the same lanes; each row and stream is picked out by a sum of
    one term and zeros, so each term of the stream sum is the 2-D form's (sigmoid(±0.0) is 0.5 either way)."""
    at_row = tl.arange(0, BLOCK_M)[:, None]
    which = tl.arange(0, HC_PAD)[:, None]
    for r in range(0, rows_here):
        gates = tl.reshape(sigmoid_f32(tl.sum(tl.where(at_row == r, u, 0.0), axis=0), INTERPRET), (HC_PAD, BLOCK_D))
        bits = tl.reshape(tl.sum(tl.where(at_row == r, normed_bits, 0), axis=0), (HC_PAD, BLOCK_D))
        total = negative_zeros((BLOCK_D,))
        for b in tl.static_range(HC):
            normed = _from_bits(tl.sum(tl.where(which == b, bits, 0), axis=0), ACT_BF16)
            total = total + tl.sum(tl.where(which == b, gates, 0.0), axis=0) * normed
        x = round_to_act(tl.div_rn(total, tl.full(total.shape, HC, tl.float32)), ACT_BF16, INTERPRET)
        tl.store(x_ptr + (row0 + r).to(tl.int64) * D + d_cols, x, mask=d_cols < D)


@triton.jit(do_not_specialize=["site"])
def _write_kernel(
    wide_ptr,
    y_ptr,
    inj_ptr,
    out_ptr,
    recv_ptr,
    send_ptr,
    flags_ptr,
    peer_flags_ptr,
    epoch_ptr,
    site,
    D,
    stride_w,
    stride_o,
    stride_yr,
    stride_yn,
    stride_i,
    HC: tl.constexpr,
    RANKS: tl.constexpr,
    PEER: tl.constexpr,
    ACT_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    """out_b = act(X_b + inject_b · y) for one row and BLOCK columns; y = act(Σ partials in rank order) if RANKS, or
    of this rank's partial and the peer's, exchanged first (the row's first program pushes it), if PEER."""
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    if PEER:
        exchange_row(y_ptr, send_ptr, flags_ptr, peer_flags_ptr, epoch_ptr, site, row, D, stride_yn,
                     tl.program_id(1) == 0, BLOCK)  # fmt: skip
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < D
    y = _write_y(y_ptr, recv_ptr, row, cols, ok, D, stride_yr, stride_yn, RANKS, PEER, ACT_BF16, INTERPRET)
    for b in tl.static_range(HC):
        x = _written(wide_ptr, inj_ptr, y, row, b, cols, ok, D, stride_w, stride_i, ACT_BF16, INTERPRET)
        tl.store(out_ptr + row * stride_o + b * D + cols, x, mask=ok)


_POOL = CounterPool(MAX_TILES, "hc_read", "output tiles with K ranges across programs")


def arrival_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 arrival counters for the current stream of `device`; every launch leaves them zero."""
    return _POOL.get(device, tiles)


@dataclass(frozen=True, slots=True)
class Write:
    """A write fused into the next read's first launch: y [N, d] (or fp32 partials [R, N, d], or this rank's
    partial of a two-rank `PeerSum`), the write's inject weights [N, hc], and out [N, hc·d], where the new rows go
    (the rows read are the old ones, never overwritten)."""

    y_or_partials: torch.Tensor | PeerSum
    inject: torch.Tensor
    out: torch.Tensor


def _check_fused_write(wide: torch.Tensor, write: Write, hc: int) -> None:
    """Raise on a fused write that hc_write would refuse, or whose streams, out or rows the read cannot take."""
    _check_write(wide, write.y_or_partials, write.inject)
    if write.inject.shape[1] != hc:
        raise ValueError(f"write inject: {write.inject.shape[1]} streams, the read has {hc}")
    out = write.out
    if out.shape != wide.shape or out.dtype != wide.dtype or out.stride(-1) != 1 or out.device != wide.device:
        raise ValueError(f"write out: expected {wide.dtype} {tuple(wide.shape)} with contiguous rows on {wide.device}")
    y, _ = split_peer(write.y_or_partials)
    shared = {t.untyped_storage().data_ptr() for t in (wide, y, write.inject)}
    if out.untyped_storage().data_ptr() in shared:
        raise ValueError("write out must be a tensor of its own, not sharing memory with wide, y or inject")


def _check_read(
    wide: torch.Tensor,
    hc_norm_weight: torch.Tensor,
    w_down: torch.Tensor,
    w_up: torch.Tensor,
    w_inject: torch.Tensor | None,
    hc: int,
) -> None:
    """Raise on shapes, dtypes, layouts or devices hc_read cannot take."""
    if wide.dim() != 2 or wide.dtype not in (torch.bfloat16, torch.float32) or wide.stride(-1) != 1:
        raise ValueError(
            f"wide: expected bf16 or fp32 [N, hc·d] with contiguous rows, got {wide.dtype} {tuple(wide.shape)}"
        )
    k = wide.shape[1]
    if not 1 <= hc <= INJECT_BLOCK or k % hc or (k // hc) % 16:
        raise ValueError(f"wide: width {k} is not hc = {hc} (at most {INJECT_BLOCK}) streams of a multiple of 16")
    r = w_down.shape[0]
    want = {"hc_norm_weight": (hc_norm_weight, (k,)), "w_down": (w_down, (r, k)), "w_up": (w_up, (k, r))}
    if w_inject is not None:
        want["w_inject"] = (w_inject, (hc, k))
    for name, (t, shape) in want.items():
        if tuple(t.shape) != shape or t.stride(-1) != 1 or t.device != wide.device:
            raise ValueError(
                f"{name}: expected {list(shape)} with a contiguous last dim on {wide.device}, "
                f"got {tuple(t.shape)} on {t.device}"
            )
        want_dtype = (torch.bfloat16, torch.float32) if name == "hc_norm_weight" else (wide.dtype,)
        if t.dtype not in want_dtype:
            raise ValueError(f"{name}: expected dtype in {want_dtype}, got {t.dtype}")


def stacked_rows(top: torch.Tensor, bottom: torch.Tensor) -> torch.Tensor:
    """[top; bottom] as one tensor: a view when bottom's rows follow top's in memory (weights stacked once, as the
    model's are), else a copy."""
    adjacent = (
        top.is_contiguous()
        and bottom.is_contiguous()
        and top.dtype == bottom.dtype
        and top.untyped_storage().data_ptr() == bottom.untyped_storage().data_ptr()
        and bottom.storage_offset() == top.storage_offset() + top.numel()
    )
    if adjacent:
        return top.as_strided((top.shape[0] + bottom.shape[0], top.shape[1]), top.stride())
    return torch.cat((top, bottom))


def _launch_down(
    wide: torch.Tensor,
    rstd: torch.Tensor,
    hc_norm_weight: torch.Tensor,
    w_down: torch.Tensor,
    w_inject: torch.Tensor | None,
    h: torch.Tensor,
    inject: torch.Tensor | None,
    tiles: ReadTiles,
    hc: int,
) -> None:
    """The fused norm + down (+ inject) projection kernel: stores h = act(silu(a / hc)) and inject."""
    n, k = wide.shape
    d, r, dev, act = k // hc, w_down.shape[0], wide.device, wide.dtype
    split, k_split = k_ranges(k, d)
    grid = (triton.cdiv(r, tiles.down_r), triton.cdiv(n, tiles.down_m), 1 if tiles.in_program else split)
    spread = split > 1 and not tiles.in_program
    part = torch.empty((split, n, r), dtype=torch.float32, device=dev) if spread else h
    ipart = torch.empty((split, n, INJECT_BLOCK), dtype=torch.float32, device=dev) if spread else h
    counters = arrival_counters(dev, grid[0] * grid[1]) if spread else h
    w_inj = w_inject if w_inject is not None else w_down
    _down_kernel[grid](
        wide, rstd, hc_norm_weight, w_down, w_inj, part, ipart, h, inject if inject is not None else h, counters,
        n, d, r, k_split, wide.stride(0), w_down.stride(0), w_inj.stride(0),
        HC=hc, SPLIT=split, IN_PROGRAM=tiles.in_program, HAS_INJ=w_inject is not None,
        ACT_BF16=act == torch.bfloat16, BLOCK_M=tiles.down_m, BLOCK_R=tiles.down_r, BLOCK_K=block_k(d),
        BLOCK_I=INJECT_BLOCK, INTERPRET=INTERPRET, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        **launch_options(_down_kernel, wide.device),
    )  # fmt: skip


def launch_read(
    wide: torch.Tensor,
    hc_norm_weight: torch.Tensor,
    w_down: torch.Tensor,
    w_up: torch.Tensor,
    w_inject: torch.Tensor | None,
    eps: float,
    hc: int,
    tiles: ReadTiles,
    write: Write | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hc_read with explicit launch tiles (the knob tests and benchmarks turn); with `write`, of the rows that write
    puts into write.out, in the read's first launch. hc_norm_weight is read before that launch's PDL wait: it must be
    a weight, which no kernel writes."""
    _check_read(wide, hc_norm_weight, w_down, w_up, w_inject, hc)
    if write is not None:
        _check_fused_write(wide, write, hc)
    n, k = wide.shape
    d, r = k // hc, w_down.shape[0]
    act, dev = wide.dtype, wide.device
    x = torch.empty((n, d), dtype=act, device=dev)
    inject = torch.empty((n, hc), dtype=act, device=dev) if w_inject is not None else None
    if n == 0:
        return x, inject
    rstd = torch.empty((n, hc), dtype=torch.float32, device=dev)
    bf16 = act == torch.bfloat16
    via_linear = tiles.via_linear and bf16 and down_via_linear(k, d, r, hc, w_inject is not None)
    up_over_normed = tiles.up_over_normed and bf16 and triton.next_power_of_2(hc) * tiles.up_d <= UP_MIX_COLUMNS
    normed = torch.empty((n, k), dtype=act, device=dev) if via_linear or up_over_normed else rstd
    y, inj, new = (write.y_or_partials, write.inject, write.out) if write is not None else (rstd, rstd, wide)
    y, peer = split_peer(y)
    ranks = y.shape[0] if write is not None and y.dim() == 3 else 0
    block_d = rstd_block(d)
    _rstd_kernel[(n, hc)](
        wide, rstd, hc_norm_weight, normed, y, inj, new, *peer_args(peer, rstd), d, wide.stride(0), new.stride(0),
        normed.stride(0), y.stride(0) if ranks else 0, y.stride(-2), inj.stride(0), eps,
        HC=hc, BLOCK_D=block_d, WRITE_NORMED=via_linear or up_over_normed, WRITE=write is not None, RANKS=ranks,
        PEER=peer is not None, ACT_BF16=bf16, INTERPRET=INTERPRET, ONE_CHUNK=block_d >= d,
        num_warps=rstd_warps(block_d),
        **launch_options(_rstd_kernel, wide.device),
    )  # fmt: skip
    wide = new  # the later launches read the rows the write stored
    adds_ranges = via_linear and up_over_normed and tiles.up_by_row and tiles.up_adds_ranges
    if via_linear:  # one linear launch over the stacked down and inject weights
        stacked = w_down if w_inject is None else stacked_rows(w_down, w_inject)
        if adds_ranges:  # its K ranges' sums, which the up kernel adds and gates itself
            h = linear_range_sums(normed, stacked)
        else:  # storing h and inject
            h = torch.empty((n, r), dtype=act, device=dev)
            linear_gates(normed, stacked, Gates(h, inject, hc))
    else:
        h = torch.empty((n, r), dtype=act, device=dev)
        _launch_down(wide, rstd, hc_norm_weight, w_down, w_inject, h, inject, tiles, hc)
    if up_over_normed:  # u = h · W_upᵀ and the gated stream mean in one kernel, u never stored (h: or its range sums)
        inject_program = adds_ranges and inject is not None  # a last column of programs that stores inject only
        _up_mix_kernel[(triton.cdiv(d, tiles.up_d) + inject_program, n if adds_ranges else triton.cdiv(n, tiles.up_m))](
            h, w_up, normed, x, inject if inject is not None else x, n, d, r, w_up.stride(0), normed.stride(0),
            HC=hc, HC_PAD=triton.next_power_of_2(hc), ACT_BF16=bf16, BLOCK_M=tiles.up_m, BLOCK_D=tiles.up_d,
            BLOCK_K=UP_BLOCK_K, INTERPRET=INTERPRET, PREFETCH=prefetch_enabled(wide.device), BY_ROW=tiles.up_by_row,
            RANGES=h.shape[0] if adds_ranges else 0, INJ=inject_program,
            num_warps=tiles.num_warps, num_stages=tiles.num_stages,
            **launch_options(_up_mix_kernel, wide.device),
        )  # fmt: skip
        return x, inject
    _mix_kernel[(triton.cdiv(d, tiles.up_d), triton.cdiv(n, tiles.up_m))](
        wide, rstd, hc_norm_weight, h, w_up, x, n, d, r, wide.stride(0), w_up.stride(0),
        HC=hc, ACT_BF16=bf16, BLOCK_M=tiles.up_m, BLOCK_D=tiles.up_d, BLOCK_R=block_r(r), INTERPRET=INTERPRET,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, **launch_options(_mix_kernel, wide.device),
    )  # fmt: skip
    return x, inject


def hc_read(
    wide: torch.Tensor,
    hc_norm_weight: torch.Tensor,
    w_down: torch.Tensor,
    w_up: torch.Tensor,
    w_inject: torch.Tensor | None,
    eps: float,
    hc: int = HC_COUNT,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sub-block input x [N, d] and inject weights [N, hc] (None without w_inject) from wide [N, hc·d], in its dtype
    (hc_norm_weight a weight no kernel writes: `launch_read`)."""
    tiles = read_tiles(wide.shape[0], w_down.shape[0])
    return launch_read(wide, hc_norm_weight, w_down, w_up, w_inject, eps, hc, tiles)


def hc_write_read(
    wide: torch.Tensor,
    y_or_partials: torch.Tensor | PeerSum,
    inject: torch.Tensor,
    hc_norm_weight: torch.Tensor,
    w_down: torch.Tensor,
    w_up: torch.Tensor,
    w_inject: torch.Tensor | None,
    eps: float,
    hc: int = HC_COUNT,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`hc_write` then `hc_read` of its rows, the write inside the read's first launch: (the new wide rows, x, the
    read's inject), each with the bits of the two calls."""
    out = torch.empty(wide.shape, dtype=wide.dtype, device=wide.device)
    tiles = read_tiles(wide.shape[0], w_down.shape[0])
    x, read_inject = launch_read(
        wide, hc_norm_weight, w_down, w_up, w_inject, eps, hc, tiles, Write(y_or_partials, inject, out)
    )
    return out, x, read_inject


def hc_read_reference(
    wide: torch.Tensor,
    hc_norm_weight: torch.Tensor,
    w_down: torch.Tensor,
    w_up: torch.Tensor,
    w_inject: torch.Tensor | None,
    eps: float,
    hc: int = HC_COUNT,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plain-PyTorch hc_read: fp32 math rounded to wide's dtype at the same places as the kernels."""
    _check_read(wide, hc_norm_weight, w_down, w_up, w_inject, hc)
    act = wide.dtype
    xf = wide.float().unflatten(-1, (hc, -1))
    rstd = 1.0 / torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    normed = (xf * rstd * (1.0 + hc_norm_weight.float().view(hc, -1))).to(act).float()
    flat = normed.flatten(1)
    v = (flat @ w_down.float().T) / hc
    h = (v / (1.0 + torch.exp(-v))).to(act).float()
    terms = (1.0 / (1.0 + torch.exp(-(h @ w_up.float().T)))).unflatten(-1, (hc, -1)) * normed
    total = terms[:, 0]
    for b in range(1, hc):
        total = total + terms[:, b]
    x = (total / hc).to(act)
    if w_inject is None:
        return x, None
    iv = (flat @ w_inject.float().T) / hc
    return x, (2.0 * (1.0 / (1.0 + torch.exp(-iv)))).to(act)


def _check_write(wide: torch.Tensor, y_or_partials: torch.Tensor | PeerSum, inject: torch.Tensor) -> None:
    """Raise on shapes, dtypes, layouts or devices hc_write cannot take."""
    if wide.dim() != 2 or wide.dtype not in (torch.bfloat16, torch.float32) or wide.stride(-1) != 1:
        raise ValueError(
            f"wide: expected bf16 or fp32 [N, hc·d] with contiguous rows, got {wide.dtype} {tuple(wide.shape)}"
        )
    n, k = wide.shape
    if inject.dim() != 2 or inject.shape[0] != n or inject.dtype != wide.dtype or inject.stride(-1) != 1:
        raise ValueError(f"inject: expected {wide.dtype} [{n}, hc], got {inject.dtype} {tuple(inject.shape)}")
    hc = inject.shape[1]
    if hc < 1 or k % hc:
        raise ValueError(f"wide: width {k} is not {hc} streams")
    d = k // hc
    y = y_or_partials
    if isinstance(y, PeerSum):
        check_peer_sum(y, n, d)
        if y.device != wide.device or inject.device != wide.device:
            raise ValueError("wide, the PeerSum and inject must be on one device")
        return
    two_d = y.dim() == 2 and y.dtype == wide.dtype and tuple(y.shape) == (n, d)
    three_d = y.dim() == 3 and y.dtype == torch.float32 and y.shape[0] >= 1 and tuple(y.shape[1:]) == (n, d)
    if not (two_d or three_d) or y.stride(-1) != 1:
        raise ValueError(
            f"y_or_partials: expected {wide.dtype} [{n}, {d}] or fp32 partials [R, {n}, {d}], got "
            f"{y.dtype} {tuple(y.shape)}"
        )
    if len({wide.device, y.device, inject.device}) != 1:
        raise ValueError("wide, y_or_partials and inject must be on one device")


def hc_write(
    wide: torch.Tensor, y_or_partials: torch.Tensor | PeerSum, inject: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """X_b + inject_b · y for each stream b; y [N, d] in wide's dtype, fp32 partials [R, N, d] summed in order, or a
    two-rank `PeerSum` (this rank's partial and the peer's).

    `out` (may be `wide` itself) receives the result; by default a new tensor does."""
    _check_write(wide, y_or_partials, inject)
    if out is None:
        out = torch.empty_like(wide)
    elif out.shape != wide.shape or out.dtype != wide.dtype or out.stride(-1) != 1 or out.device != wide.device:
        raise ValueError(
            f"out: expected {wide.dtype} {tuple(wide.shape)} with contiguous rows, got {out.dtype} {tuple(out.shape)}"
        )
    n, k = wide.shape
    hc = inject.shape[1]
    if n == 0:
        return out
    y, peer = split_peer(y_or_partials)
    ranks = y.shape[0] if y.dim() == 3 else 0
    stride_yr = y.stride(0) if ranks else 0
    # with a PeerSum, programs of the rstd kernel's chunk: at the real width one a row, so a row's flag has one waiter
    block = rstd_block(k // hc) if peer is not None else WRITE_BLOCK if n <= 64 else 4 * WRITE_BLOCK
    _write_kernel[(n, triton.cdiv(k // hc, block))](
        wide, y, inject, out, *peer_args(peer, y), k // hc, wide.stride(0), out.stride(0), stride_yr, y.stride(-2),
        inject.stride(0), HC=hc, RANKS=ranks, PEER=peer is not None, ACT_BF16=wide.dtype == torch.bfloat16,
        BLOCK=block, INTERPRET=INTERPRET, num_warps=rstd_warps(block) if peer is not None else 4,
        **launch_options(_write_kernel, wide.device),
    )  # fmt: skip
    return out


def hc_write_reference(wide: torch.Tensor, y_or_partials: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
    """Plain-PyTorch hc_write: partials summed in rank order in fp32 and rounded, then act(X_b + inject_b·y) in fp32."""
    if isinstance(y_or_partials, PeerSum):
        raise TypeError("hc_write_reference: a PeerSum is summed by the kernels only; pass the partials [R, N, d]")
    _check_write(wide, y_or_partials, inject)
    y = y_or_partials
    if y.dim() == 3:
        total = y[0]
        for rank in range(1, y.shape[0]):
            total = total + y[rank]
        y = total.to(wide.dtype)
    hc = inject.shape[1]
    xf = wide.float().unflatten(-1, (hc, -1))
    return (xf + inject.float()[:, :, None] * y.float()[:, None, :]).flatten(1).to(wide.dtype)
