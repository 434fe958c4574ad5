"""Gated DeltaNet over whole chunks of a prompt's rows: the chunked form of the recurrence in kernels/gdn.py.

Per value head, with fp32 state S [Dk, Dv] and unit q, k (q also divided by sqrt(Dk), as `unit_qk` makes them),
the recurrence is S_t = exp(g_t) S_{t-1} + k_t delta_t^T with delta_t = beta_t (v_t - (exp(g_t) S_{t-1})^T k_t),
and o_t = S_t^T q_t. Over a chunk of CHUNK consecutive rows of one lane, with b the inclusive cumulative sum of g
inside the chunk, A[i, j] = -beta_i (k_i . k_j) exp(b_i - b_j) for j < i (else 0) and T = (I - A)^-1 (by DOT_K-row
blocks: substitution inside the diagonal blocks, block forward substitution below), the chunk's rows are, from the
state S at its start:

    u = T (beta v),  w = T (beta exp(b) k),  v_new = u - w S
    o = (q exp(b)) S + (tril(q k^T exp(b_i - b_j)) v_new),  S' = exp(b_last) S + (k exp(b_last - b))^T v_new

the same maths as flash-linear-attention's chunk_gated_delta_rule (and transformers' torch_chunk_gated_delta_rule),
all in fp32, with every product an IEEE fp32 dot; only the output is rounded, once, to its dtype.

Chunks sit at absolute positions that are multiples of CHUNK: `plan_chunks` takes a lane run's full chunks only when
the run starts at such a position, and leaves the rest to the recurrent kernel. A prompt's chunks are thus the same
rows whether it runs fresh, resumes from a kept state, or is cut into passes (the caller cuts passes and keeps states
only at multiples of CHUNK), so its outputs and states are the same bits in every case.

Reduction-order contract: the prepare kernel works on one (chunk, head) from that chunk's rows alone; the sequential
kernel walks one run's chunks in order, one (run, head, Dv tile) a program, from the run's starting state. No sum
crosses runs, there are no atomics, and the grids depend on the tensors' shapes only. So a run's outputs, kept states
and final state depend only on its own rows and starting state, not on the runs beside it, where it sits in the
batch, T or the plan's size; and since S is stored in fp32, its chunks in one call or split at a chunk boundary
across two calls (the second starting from the state the first wrote) give the same bits. (The bits do depend on
the module's tile and warp constants, which no call changes.)
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.fp32_ops import exp_f32, round_to_act
from kernels.gdn import gdn_recurrent, unit_qk
from kernels.host import to_device
from kernels.pdl import enter, launch_options

CHUNK = 64
BLOCK_V = 32  # Dv columns of the state a sequential program carries
DOT_K = 16  # terms of a product's sum taken from memory at a time, and the rows of T's blocks
PREPARE_COLUMNS = 32  # columns of u and w a prepare program makes at a time
PREPARE_WARPS = 4  # part of the sums' order: other counts give other bits (the scan's shapes do not)
SCAN_WARPS = 8
SCAN_STAGES = 3  # the sequential kernel's inner loads run that many blocks ahead (it waits on them, not the FMAs)


Run = tuple[int, int, int, int]  # a lane's consecutive rows in a call: (first row, rows, first position, slot)


@dataclass(frozen=True)
class ChunkPlan:
    """Which rows of a call the chunked form takes: whole chunks of CHUNK rows of lane runs that start at a position
    that is a multiple of CHUNK; sizes fixed by the call's row count, so a CUDA graph can take any plan."""

    chunk_rows: torch.Tensor  # int32 [NC]: first row of each chunk, -1 = unused entry
    runs: torch.Tensor  # int32 [NR, 3]: (first_row, n_chunks, slot) per lane run; unused entries have n_chunks = 0


def chunked_length(length: int, first_position: int) -> int:
    """How many of a run's first rows the chunked form takes: its full chunks if it starts at a chunk boundary."""
    return length - length % CHUNK if first_position % CHUNK == 0 else 0


def plan_size(rows: int) -> int:
    """Entries of a plan's chunk_rows and runs for a call of `rows` rows."""
    return max(rows // CHUNK, 1)


def chunk_spans(runs: Sequence[Run]) -> list[range]:
    """The rows the plan of these runs covers, one range per run that starts at a chunk boundary."""
    return [range(first, first + chunked_length(length, position)) for first, length, position, _ in runs]


def chunked_rows(runs: Sequence[Run]) -> list[int]:
    """The rows the plan of these runs covers, ascending per run."""
    return [row for span in chunk_spans(runs) for row in span]


def recurrent_lanes(slots: torch.Tensor, runs: Sequence[Run]) -> torch.Tensor:
    """Each row's slot, -1 for the rows the chunked form takes (the recurrence skips them)."""
    lanes = slots.clone()
    for span in chunk_spans(runs):
        lanes[span.start : span.stop] = -1
    return lanes


def plan_chunks(runs: Sequence[Run], rows: int, device: torch.device | str) -> ChunkPlan:
    """The plan for a call of `rows` rows whose lane runs are (first_row, length, first_position, slot), made on the
    host and copied to `device` without waiting for the GPU (a CUDA graph copies it into the plan it was captured
    with)."""
    size = plan_size(rows)
    chunk_rows = [-1] * size
    plan_runs = [(0, 0, 0)] * size
    chunks = taken = 0
    for first, length, position, slot in runs:
        if first < 0 or length < 0 or first + length > rows:
            raise ValueError(f"runs: run ({first}, {length}) does not fit in {rows} rows")
        n = chunked_length(length, position) // CHUNK
        if n == 0:
            continue
        if taken == size or chunks + n > size:
            raise ValueError("runs: more chunks than the rows hold (overlapping runs?)")
        plan_runs[taken] = (first, n, slot)
        chunk_rows[chunks : chunks + n] = range(first, first + n * CHUNK, CHUNK)
        taken, chunks = taken + 1, chunks + n
    where = torch.device(device)
    return ChunkPlan(to_device(where, chunk_rows, torch.int32), to_device(where, plan_runs, torch.int32))


@triton.jit
def _gdn_chunk_prepare_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    chunk_rows_ptr,
    b_ptr,
    w_ptr,
    u_ptr,
    aqk_ptr,
    H,
    HK,
    RATIO,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_gh,
    stride_bt,
    stride_bh,
    C: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    KB: tl.constexpr,
    PB: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (chunk, value head): b, w = T beta e^b k, u = T beta v and the masked decayed q k^T."""
    enter(PDL)
    row0 = tl.load(chunk_rows_ptr + tl.program_id(0))
    head = tl.program_id(1)
    if row0 >= 0:
        i = tl.arange(0, C)
        kb = tl.arange(0, KB)
        rows = row0.to(tl.int64) + i
        rows_h = rows * H + head
        qk_rows = (rows * HK + head // RATIO) * DK
        g = tl.load(g_ptr + rows * stride_gt + head * stride_gh).to(tl.float32)
        beta = tl.load(beta_ptr + rows * stride_bt + head * stride_bh).to(tl.float32)
        b = tl.cumsum(g, axis=0)
        tl.store(b_ptr + rows_h, b)
        # The products run KB terms at a time on operands loaded from memory: an fp32 FMA dot holds its whole K
        # extent of both operands in registers, so a Dk- or chunk-long K would spill.
        kk = tl.zeros((C, C), tl.float32)
        for d in range(0, DK, KB):
            k_t = tl.load(k_ptr + qk_rows[None, :] + d + kb[:, None])  # [KB, C]
            kk = tl.dot(tl.load(k_ptr + qk_rows[:, None] + d + kb[None, :]), k_t, kk, input_precision="ieee")
        below = i[:, None] > i[None, :]
        a = tl.where(below, -(beta[:, None] * kk) * _decay(b, INTERPRET), 0.0)
        # T = (I - A)^-1 by KB x KB blocks, in aqk's scratch (u and w then read it KB columns at a time): A first.
        t_at = aqk_ptr + (row0.to(tl.int64) * H + head) * C  # T[r, c] at t_at + r * H * C + c
        tl.store(t_at + i[:, None] * H * C + i[None, :], a)
        tl.debug_barrier()  # A and b written for every thread
        # The diagonal blocks D_n = (I - A_nn)^-1 all at once, by substitution on D = I + D A_nn column by column from
        # the right: column c is e_c + D A_nn[:, c] from the final columns > c (A_nn[k, c] = 0 for k <= c), the last
        # e_{KB-1}. A step's sums run along D's rows, within a warp; A's columns come from memory, off the chain.
        blk = tl.arange(0, C // KB)[:, None, None] * KB
        r3 = kb[None, :, None]
        c3 = kb[None, None, :]
        diag_at = t_at + (blk + r3) * H * C + blk + c3
        a_cols = t_at + (blk + c3) * H * C + blk  # + c: A_nn[:, c] as a row
        d = tl.where(r3 == c3, 1.0, tl.load(diag_at))  # [C / KB, KB, KB]
        for c in tl.static_range(KB - 2, -1, -1):
            d_c = tl.sum(d * tl.load(a_cols + c), axis=2, keep_dims=True)
            d = tl.where(c3 == c, tl.where(r3 == c, 1.0, d_c), d)
        tl.debug_barrier()  # A's diagonal blocks read by every thread
        tl.store(diag_at, d)
        tl.debug_barrier()  # D written for every thread
        # The blocks below, a block row [KB, C] at a time from the final rows above: T_nm = D_n sum_{m <= l < n} A_nl
        # T_lm, zero from column n * KB on (A's blocks right of the diagonal are zero), where T keeps D_n and zeros.
        # Rows go through memory: held in registers they take 190 registers a thread, 2 programs an SM instead of 3.
        for n in tl.static_range(1, C // KB):
            row_n = t_at + (n * KB + kb)[:, None] * H * C
            acc = tl.zeros((KB, C), tl.float32)
            for m in tl.static_range(n):
                t_m = tl.load(t_at + (m * KB + kb)[:, None] * H * C + i[None, :])
                acc = tl.dot(tl.load(row_n + m * KB + kb[None, :]), t_m, acc, input_precision="ieee")
            t_n = tl.dot(tl.load(row_n + n * KB + kb[None, :]), acc, input_precision="ieee")
            tl.debug_barrier()  # A's block row n read by every thread
            tl.store(row_n + i[None, :], t_n, mask=i[None, :] < n * KB)
            tl.debug_barrier()  # T's block row n written for every thread
        # u and w PB columns at a time, to keep the accumulator small.
        pb = tl.arange(0, PB)
        for col in range(0, DV, PB):
            u = tl.zeros((C, PB), tl.float32)
            for j in range(0, C, KB):
                rows_j = row0.to(tl.int64) + j + kb
                beta_j = tl.load(beta_ptr + rows_j * stride_bt + head * stride_bh).to(tl.float32)
                v_j = tl.load(v_ptr + rows_j[:, None] * stride_vt + head * stride_vh + col + pb[None, :])
                t = tl.load(aqk_ptr + rows_h[:, None] * C + j + kb[None, :])  # T[:, j:j+KB]
                u = tl.dot(t, v_j.to(tl.float32) * beta_j[:, None], u, input_precision="ieee")
            tl.store(u_ptr + rows_h[:, None] * DV + col + pb[None, :], u)
        for col in range(0, DK, PB):
            w = tl.zeros((C, PB), tl.float32)
            for j in range(0, C, KB):
                rows_j = row0.to(tl.int64) + j + kb
                scale_j = tl.load(beta_ptr + rows_j * stride_bt + head * stride_bh).to(tl.float32) * exp_f32(
                    tl.load(b_ptr + rows_j * H + head), INTERPRET
                )
                k_j = tl.load(k_ptr + (rows_j * HK + head // RATIO)[:, None] * DK + col + pb[None, :])
                t = tl.load(aqk_ptr + rows_h[:, None] * C + j + kb[None, :])
                w = tl.dot(t, k_j * scale_j[:, None], w, input_precision="ieee")
            tl.store(w_ptr + rows_h[:, None] * DK + col + pb[None, :], w)
        qk = tl.zeros((C, C), tl.float32)
        for d in range(0, DK, KB):
            k_t = tl.load(k_ptr + qk_rows[None, :] + d + kb[:, None])
            qk = tl.dot(tl.load(q_ptr + qk_rows[:, None] + d + kb[None, :]), k_t, qk, input_precision="ieee")
        aqk = qk * _decay(b, INTERPRET)
        tl.debug_barrier()  # every thread done reading T
        tl.store(aqk_ptr + rows_h[:, None] * C + i[None, :], aqk)


@triton.jit
def _decay(b, INTERPRET: tl.constexpr):
    """exp(b_i - b_j) on and below the diagonal, 0 above (masked before the exp, where b_i - b_j > 0 could overflow
    and inf * 0 would be nan in a dot)."""
    i = tl.arange(0, b.shape[0])
    causal = i[:, None] >= i[None, :]
    return tl.where(causal, exp_f32(tl.where(causal, b[:, None] - b[None, :], 0.0), INTERPRET), 0.0)


@triton.jit
def _gdn_chunk_scan_kernel(
    q_ptr,
    k_ptr,
    b_ptr,
    w_ptr,
    u_ptr,
    aqk_ptr,
    runs_ptr,
    state_ptr,
    out_ptr,
    keep_ptr,
    states_ptr,
    H,
    HK,
    RATIO,
    stride_ot,
    stride_oh,
    C: tl.constexpr,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BV: tl.constexpr,
    KB: tl.constexpr,
    KEEP: tl.constexpr,
    OUT_BF16: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (run, value head, Dv tile): the run's chunks in order on a [Dk, BV] part of the state."""
    enter(PDL)
    run = tl.program_id(0)
    head = tl.program_id(1)
    first = tl.load(runs_ptr + run * 3).to(tl.int64)
    n = tl.load(runs_ptr + run * 3 + 1)
    slot = tl.load(runs_ptr + run * 3 + 2)
    if n > 0:
        i = tl.arange(0, C)
        kb = tl.arange(0, KB)
        dk = tl.arange(0, DK)
        dv = tl.program_id(2) * BV + tl.arange(0, BV)
        tile = dk[:, None] * DV + dv[None, :]
        # S lives in registers and, for the products that read it KB rows at a time, in its slot of the pool (which
        # so holds the state after each chunk while the call runs).
        slot_at = state_ptr + (slot.to(tl.int64) * H + head) * DK * DV
        s = tl.load(slot_at + tile)
        for c in range(0, n):
            rows = first + c * C + i
            rows_h = rows * H + head
            qk_rows = (rows * HK + head // RATIO) * DK
            e_b = exp_f32(tl.load(b_ptr + rows_h), INTERPRET)
            ws = tl.zeros((C, BV), tl.float32)
            o = tl.zeros((C, BV), tl.float32)
            for d in range(0, DK, KB):
                s_d = tl.load(slot_at + (d + kb)[:, None] * DV + dv[None, :])
                ws = tl.dot(tl.load(w_ptr + rows_h[:, None] * DK + d + kb[None, :]), s_d, ws, input_precision="ieee")
                q_d = tl.load(q_ptr + qk_rows[:, None] + d + kb[None, :]) * e_b[:, None]
                o = tl.dot(q_d, s_d, o, input_precision="ieee")
            # v_new replaces u in its scratch, for the products that take it KB rows at a time.
            u_at = u_ptr + rows_h[:, None] * DV + dv[None, :]
            tl.store(u_at, tl.load(u_at) - ws)
            tl.debug_barrier()  # v_new written and the slot read by every thread
            b_last = tl.load(b_ptr + (first + c * C + C - 1) * H + head)
            s = s * exp_f32(b_last, INTERPRET)
            for j in range(0, C, KB):
                rows_j = first + c * C + j + kb
                v_new = tl.load(u_ptr + (rows_j * H + head)[:, None] * DV + dv[None, :])  # [KB, BV]
                aqk = tl.load(aqk_ptr + rows_h[:, None] * C + j + kb[None, :])
                o = tl.dot(aqk, v_new, o, input_precision="ieee")
                k_t = tl.load(k_ptr + (rows_j * HK + head // RATIO)[None, :] * DK + dk[:, None])  # [DK, KB]
                e_j = exp_f32(b_last - tl.load(b_ptr + rows_j * H + head), INTERPRET)
                s = tl.dot(k_t * e_j[None, :], v_new, s, input_precision="ieee")
            o_at = out_ptr + rows[:, None] * stride_ot + head * stride_oh + dv[None, :]
            tl.store(o_at, round_to_act(o, OUT_BF16, INTERPRET))
            tl.store(slot_at + tile, s)
            if KEEP:  # the state after the chunk, where its last row has a place among the kept rows
                place = tl.load(keep_ptr + first + c * C + C - 1)
                dest = states_ptr + (tl.maximum(place, 0).to(tl.int64) * H + head) * DK * DV + tile
                tl.store(dest, s, mask=tile < tl.where(place >= 0, DK * DV, 0))
            tl.debug_barrier()  # the slot holds the new state for every thread


def _check_chunked(
    q_unit: torch.Tensor,
    k_unit: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    plan: ChunkPlan,
    out: torch.Tensor,
    keep_places: torch.Tensor | None,
    states_out: torch.Tensor | None,
) -> None:
    """Raise ValueError naming the argument whose shape, dtype, layout or device does not fit."""
    if v.dim() != 3 or v.stride(2) != 1 or v.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"v: expected bf16 or fp32 [T, H, Dv] with contiguous Dv, got {v.dtype} {tuple(v.shape)}")
    seq, heads, dv = v.shape
    for name, t in (("q_unit", q_unit), ("k_unit", k_unit)):
        if t.dtype != torch.float32 or t.dim() != 3 or t.shape[0] != seq or not t.is_contiguous():
            raise ValueError(f"{name}: expected contiguous fp32 [{seq}, Hk, Dk], got {t.dtype} {tuple(t.shape)}")
        if heads % max(t.shape[1], 1):
            raise ValueError(f"{name}: {t.shape[1]} key heads do not divide {heads} value heads")
    if q_unit.shape != k_unit.shape:
        raise ValueError(f"k_unit: shape {tuple(k_unit.shape)} differs from q_unit's {tuple(q_unit.shape)}")
    dk = q_unit.shape[2]
    for name, size in (("Dk", dk), ("Dv", dv)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name}: expected a power of two >= 16, got {size}")
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != (seq, heads) or t.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"{name}: expected bf16 or fp32 [{seq}, {heads}], got {t.dtype} {tuple(t.shape)}")
    if state.dtype != torch.float32 or state.dim() != 4 or state.shape[1:] != (heads, dk, dv):
        raise ValueError(f"state: expected fp32 [L, {heads}, {dk}, {dv}], got {state.dtype} {tuple(state.shape)}")
    if not state.is_contiguous():
        raise ValueError("state: expected a contiguous tensor")
    if out.shape != v.shape or out.stride(2) != 1 or out.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out: expected bf16 or fp32 {tuple(v.shape)} with contiguous Dv, got {out.dtype}")
    size = plan_size(seq)
    chunk_rows = plan.chunk_rows
    if chunk_rows.shape != (size,) or chunk_rows.dtype != torch.int32 or not chunk_rows.is_contiguous():
        got = f"{chunk_rows.dtype} {tuple(chunk_rows.shape)}"
        raise ValueError(f"plan: chunk_rows expected contiguous int32 [{size}] for {seq} rows, got {got}")
    if plan.runs.shape != (size, 3) or plan.runs.dtype != torch.int32 or not plan.runs.is_contiguous():
        raise ValueError(f"plan: runs expected contiguous int32 [{size}, 3], got {plan.runs.dtype} {plan.runs.shape}")
    if (keep_places is None) != (states_out is None):
        raise ValueError("keep_places: given without states_out, or states_out without keep_places")
    tensors = [q_unit, k_unit, v, g, beta, state, plan.chunk_rows, plan.runs, out]
    if keep_places is not None and states_out is not None:
        if keep_places.shape != (seq,) or keep_places.dtype != torch.int32:
            raise ValueError(f"keep_places: expected int32 [{seq}], got {keep_places.dtype} {tuple(keep_places.shape)}")
        if states_out.dtype != torch.float32 or states_out.dim() != 4 or states_out.shape[1:] != state.shape[1:]:
            got = f"{states_out.dtype} {tuple(states_out.shape)}"
            raise ValueError(f"states_out: expected fp32 [K, {heads}, {dk}, {dv}], got {got}")
        if not states_out.is_contiguous():
            raise ValueError("states_out: expected a contiguous tensor")
        tensors += [keep_places, states_out]
    if len({t.device for t in tensors}) != 1:
        raise ValueError("q_unit, k_unit, v, g, beta, state, plan, out, keep_places, states_out: not on one device")


def gdn_chunked(
    q_unit: torch.Tensor,
    k_unit: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    plan: ChunkPlan,
    out: torch.Tensor,
    keep_places: torch.Tensor | None = None,
    states_out: torch.Tensor | None = None,
) -> None:
    """The plan's chunks: outputs into `out` at their rows, each run's state in place at its slot, and the state
    after a chunk into states_out[p] where the chunk's LAST row has place p >= 0 in `keep_places` (only chunk ends
    can be kept: places of a chunk's other rows are ignored)."""
    _check_chunked(q_unit, k_unit, v, g, beta, state, plan, out, keep_places, states_out)
    seq, heads, dv = v.shape
    key_heads, dk = q_unit.shape[1:]
    size = plan_size(seq)
    block_v = min(BLOCK_V, dv)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    scratch = {"dtype": torch.float32, "device": v.device}
    b = torch.empty((seq, heads), **scratch)
    w = torch.empty((seq, heads, dk), **scratch)
    u = torch.empty((seq, heads, dv), **scratch)
    aqk = torch.empty((seq, heads, CHUNK), **scratch)
    _gdn_chunk_prepare_kernel[(size, heads)](
        q_unit,
        k_unit,
        v,
        g,
        beta,
        plan.chunk_rows,
        b,
        w,
        u,
        aqk,
        heads,
        key_heads,
        heads // key_heads,
        v.stride(0),
        v.stride(1),
        g.stride(0),
        g.stride(1),
        beta.stride(0),
        beta.stride(1),
        C=CHUNK,
        DK=dk,
        DV=dv,
        KB=DOT_K,
        PB=min(PREPARE_COLUMNS, dk, dv),
        INTERPRET=interpret,
        num_warps=PREPARE_WARPS,
        num_stages=1,
        enable_fp_fusion=True,
        **launch_options(_gdn_chunk_prepare_kernel, v.device),
    )
    keep = keep_places is not None
    _gdn_chunk_scan_kernel[(size, heads, dv // block_v)](
        q_unit,
        k_unit,
        b,
        w,
        u,
        aqk,
        plan.runs,
        state,
        out,
        keep_places if keep else plan.runs,  # a pointer never read without KEEP
        states_out if keep else state,
        heads,
        key_heads,
        heads // key_heads,
        out.stride(0),
        out.stride(1),
        C=CHUNK,
        DK=dk,
        DV=dv,
        BV=block_v,
        KB=DOT_K,
        KEEP=keep,
        OUT_BF16=out.dtype == torch.bfloat16,
        INTERPRET=interpret,
        num_warps=SCAN_WARPS,
        num_stages=SCAN_STAGES,
        enable_fp_fusion=True,
        **launch_options(_gdn_chunk_scan_kernel, v.device),
    )


def gdn_prompt(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    plan: ChunkPlan,
    lanes: torch.Tensor,
    keep_rows: torch.Tensor | None = None,
    keep_places: torch.Tensor | None = None,
    states_out: torch.Tensor | None = None,
    firsts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(o fp32 [T, H, Dv], kept states or None) of rows holding prompts' whole chunks: the plan's chunks in the
    chunked form, then the other rows (`lanes`: each row's slot, -1 on the chunks' rows) by the recurrence from the
    states the chunks left (`firsts`: the rows that start its runs, `gdn.run_firsts`); states are kept after
    `keep_rows` (with their `keep_places`), chunk ends or other rows."""
    if (keep_rows is None) != (keep_places is None):
        raise ValueError("keep_rows: given without keep_places, or keep_places without keep_rows")
    q, k = unit_qk(q, k)
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    if keep_rows is not None and states_out is None:
        states_out = state.new_empty((keep_rows.shape[0], *state.shape[1:]))
    gdn_chunked(q, k, v, g, beta, state, plan, out, keep_places=keep_places, states_out=states_out)
    return gdn_recurrent(
        q, k, v, g, beta, state, lanes, keep_rows is not None, keep_rows=keep_rows, keep_places=keep_places,
        states_out=states_out, unit_given=True, out=out, firsts=firsts,
    )  # fmt: skip


def gdn_chunked_reference(
    q_unit: torch.Tensor,
    k_unit: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    plan: ChunkPlan,
    out: torch.Tensor,
    keep_places: torch.Tensor | None = None,
    states_out: torch.Tensor | None = None,
) -> None:
    """Plain-PyTorch `gdn_chunked`: the same chunk maths in fp32, all heads at once, one chunk at a time."""
    _check_chunked(q_unit, k_unit, v, g, beta, state, plan, out, keep_places, states_out)
    ratio = v.shape[1] // q_unit.shape[1]
    i = torch.arange(CHUNK, device=v.device)
    below, causal = i[:, None] > i[None, :], i[:, None] >= i[None, :]
    for first, n, slot in plan.runs.tolist():
        s = state[slot]
        for row0 in range(first, first + n * CHUNK, CHUNK):
            rows = slice(row0, row0 + CHUNK)
            q = q_unit[rows].repeat_interleave(ratio, dim=1).transpose(0, 1)  # [H, C, Dk]
            k = k_unit[rows].repeat_interleave(ratio, dim=1).transpose(0, 1)
            vh = v[rows].float().transpose(0, 1)  # [H, C, Dv]
            bh = g[rows].float().t().cumsum(-1)  # [H, C]
            be = beta[rows].float().t()[..., None]
            decay = torch.where(causal, torch.where(causal, bh[..., :, None] - bh[..., None, :], 0.0).exp(), 0.0)
            a = torch.where(below, -(be * (k @ k.transpose(1, 2))) * decay, 0.0)
            for r in range(1, CHUNK):
                a[:, r] = a[:, r] + (a[:, r, :, None] * a).sum(1)
            t = torch.where(i[:, None] == i[None, :], 1.0, a)
            u, w = t @ (vh * be), t @ (k * be * bh.exp()[..., None])
            v_new = u - w @ s
            o = (q * bh.exp()[..., None]) @ s + torch.where(causal, (q @ k.transpose(1, 2)) * decay, 0.0) @ v_new
            out[rows] = o.transpose(0, 1).to(out.dtype)
            last = bh[:, -1:]
            s = s * last.exp()[..., None] + (k * (last - bh).exp()[..., None]).transpose(1, 2) @ v_new
            if keep_places is not None and states_out is not None and keep_places[row0 + CHUNK - 1] >= 0:
                states_out[keep_places[row0 + CHUNK - 1]] = s
        state[slot] = s
