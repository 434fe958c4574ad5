"""Gated DeltaNet recurrence over lanes of consecutive rows, one fp32 state per lane updated in place."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.conv import lane_run_end, lane_runs
from kernels.fp32_ops import exp_f32, mul_rn, pairwise_row_sums, pairwise_sum, round_to_act
from kernels.pdl import enter, launch_options

L2_EPS = 1e-6
BLOCK_V = 16
NUM_WARPS = 1
SCAN = 128
LONG_RUN = 16  # rows of one lane from which q and k go to unit norm in a kernel of their own
KEEP_NONE, KEEP_EVERY, KEEP_LISTED = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)  # which rows' states to write


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """Scale the last dim to unit L2 norm (`sum`, not mean), as the model does."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def gdn_recurrent_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    lane_of_row: torch.Tensor,
    keep_states: bool = False,
    out_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plain-PyTorch `gdn_recurrent`: the model's gated delta rule, one row at a time in fp32, per lane."""
    check_gdn(q, k, v, g, beta, state, lane_of_row)
    ratio = v.shape[1] // q.shape[1]
    q = _l2norm(q.float().repeat_interleave(ratio, dim=1)) / (q.shape[-1] ** 0.5)
    k = _l2norm(k.float().repeat_interleave(ratio, dim=1))
    v, g, beta = v.float(), g.float(), beta.float()
    out = torch.empty(v.shape, dtype=out_dtype, device=v.device)
    states = state.new_empty((v.shape[0], *state.shape[1:])) if keep_states else None
    for lane, start, end in lane_runs(lane_of_row):
        s = state[lane]
        for t in range(start, end):
            s = s * g[t].exp()[:, None, None]
            kv_mem = (s * k[t][:, :, None]).sum(-2)
            delta = (v[t] - kv_mem) * beta[t][:, None]
            s = s + k[t][:, :, None] * delta[:, None, :]
            out[t] = (s * q[t][:, :, None]).sum(-2).to(out_dtype)
            if states is not None:
                states[t] = s
        state[lane] = s
    return out, states


def check_gdn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    lane_of_row: torch.Tensor,
) -> None:
    """Raise ValueError naming the argument whose shape, dtype or layout does not fit."""
    if v.dim() != 3 or v.stride(2) != 1:
        raise ValueError(f"v: expected [T, H, Dv] with contiguous Dv, got shape {tuple(v.shape)}")
    seq, heads, dv = v.shape
    for name, t in (("q", q), ("k", k)):
        if t.dim() != 3 or t.shape[0] != seq or t.stride(2) != 1 or heads % max(t.shape[1], 1):
            raise ValueError(f"{name}: expected [{seq}, Hk | {heads}, Dk] with contiguous Dk, got {tuple(t.shape)}")
    if q.shape != k.shape:
        raise ValueError(f"k: shape {tuple(k.shape)} differs from q's {tuple(q.shape)}")
    dk = q.shape[2]
    for name, size in (("Dk", dk), ("Dv", dv)):
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name}: expected a power of two >= 16, got {size}")
    for name, t in (("g", g), ("beta", beta)):
        if t.shape != (seq, heads):
            raise ValueError(f"{name}: expected [{seq}, {heads}], got {tuple(t.shape)}")
    if state.dtype != torch.float32 or state.dim() != 4 or state.shape[1:] != (heads, dk, dv):
        raise ValueError(f"state: expected fp32 [L, {heads}, {dk}, {dv}], got {state.dtype} {tuple(state.shape)}")
    if not state.is_contiguous():
        raise ValueError("state: expected a contiguous tensor")
    if lane_of_row.shape != (seq,) or lane_of_row.dtype not in (torch.int32, torch.int64):
        got = f"{lane_of_row.dtype} {tuple(lane_of_row.shape)}"
        raise ValueError(f"lane_of_row: expected int32 or int64 [{seq}], got {got}")
    if len({t.device for t in (q, k, v, g, beta, state, lane_of_row)}) != 1:
        raise ValueError("q, k, v, g, beta, state and lane_of_row must be on one device")


@triton.jit
def _gdn_norm_kernel(
    q_ptr,
    k_ptr,
    qn_ptr,
    kn_ptr,
    HK,
    SCALE,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    DK: tl.constexpr,
    EPS: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (row, key head): q and k at unit L2 norm in fp32, q also divided by sqrt(Dk)."""
    enter(PDL)
    pid = tl.program_id(0)
    row = (pid // HK).to(tl.int64)
    head = pid % HK
    dk = tl.arange(0, DK)
    q = tl.load(q_ptr + row * stride_qt + head * stride_qh + dk).to(tl.float32)
    k = tl.load(k_ptr + row * stride_kt + head * stride_kh + dk).to(tl.float32)
    at = (row * HK + head) * DK + dk
    tl.store(qn_ptr + at, unit_q(q, SCALE, EPS, DK, INTERPRET))
    tl.store(kn_ptr + at, unit_k(k, EPS, DK, INTERPRET))


@triton.jit(do_not_specialize=["T"])
def _gdn_recurrent_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    lane_ptr,
    out_ptr,
    states_ptr,
    keep_ptr,
    firsts_ptr,
    T,
    H,
    RATIO,
    SCALE,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_gt,
    stride_gh,
    stride_bt,
    stride_bh,
    stride_ot,
    stride_oh,
    DK: tl.constexpr,
    DV: tl.constexpr,
    BV: tl.constexpr,
    EPS: tl.constexpr,
    UNIT_QK: tl.constexpr,
    KEEP: tl.constexpr,
    SCAN: tl.constexpr,
    INTERPRET: tl.constexpr,
    MAPPED: tl.constexpr,
    PDL: tl.constexpr,
):
    """One program per (row, value head, Dv tile), or with MAPPED per (listed run start, ...); a lane's first row
    loops over its rows (UNIT_QK: q, k come unit; rows of lane -1 are skipped)."""
    enter(PDL)
    pid = tl.program_id(0)
    tiles = DV // BV
    row = pid // (H * tiles)
    if MAPPED:  # a program per listed run start (-1: none), not per row
        row = tl.load(firsts_ptr + row)
    listed = row >= 0
    row = tl.maximum(row, 0)
    head = (pid // tiles) % H
    dk = tl.arange(0, DK)
    dv = (pid % tiles) * BV + tl.arange(0, BV)
    # Columns of the state are independent, so a Dv tile carries its own [Dk, BV] part of S in registers.
    tile = dk[:, None] * DV + dv[None, :]
    # Scalar row pointers, advanced per row, keep the live registers of the row loop few.
    row64 = row.to(tl.int64)
    q_at = q_ptr + row64 * stride_qt + (head // RATIO) * stride_qh
    k_at = k_ptr + row64 * stride_kt + (head // RATIO) * stride_kh
    v_at = v_ptr + row64 * stride_vt + head * stride_vh
    g_at = g_ptr + row64 * stride_gt + head * stride_gh
    beta_at = beta_ptr + row64 * stride_bt + head * stride_bh
    out_at = out_ptr + row64 * stride_ot + head * stride_oh
    states_at = states_ptr + (row64 * H + head) * DK * DV  # a row's kept state when every row keeps one
    # Issue every independent load before the first wait: the lane ids, this row's inputs, the state.
    lane = tl.where(listed, tl.load(lane_ptr + row), -1)
    # a lane id of -1 marks rows another kernel ran (a prompt's whole chunks): they start no run
    first = lane != tl.where(lane >= 0, tl.load(lane_ptr + row - 1, mask=row > 0, other=-1), lane)
    idx = row + tl.arange(0, SCAN)
    ids = tl.load(lane_ptr + idx, mask=idx < tl.where(first, T, 0), other=-1)
    q, k, v, g, beta = _row_inputs(q_at, k_at, v_at, g_at, beta_at, dk, dv, first, DK, DV)
    if first:
        slot = state_ptr + (lane.to(tl.int64) * H + head) * DK * DV
        s = tl.load(slot + tile)
        end = lane_run_end(lane_ptr, ids, row, lane, T, SCAN)
        if UNIT_QK:
            # The pointers walk one row ahead of the output: they load the inputs of the row the next update makes.
            q_at += stride_qt
            k_at += stride_kt
            v_at += stride_vt
            g_at += stride_gt
            beta_at += stride_bt
            q_up, k_up, v_up, g_up, beta_up = _row_inputs(
                q_at, k_at, v_at, g_at, beta_at, dk, dv, row + 1 < end, DK, DV
            )
            s = delta_step(s, k, v, g, beta, INTERPRET)
            if KEEP != KEEP_NONE:  # (a helper call costs the interpreter milliseconds a row)
                keep_state(states_at, states_ptr, keep_ptr, row, H, head, tile, s, KEEP, DK, DV)
            # Rotated: an iteration stores the previous row's output and makes row t's update, two independent sums
            # over Dk in one branch-free block; the same sums on the same values as one row at a time.
            for t in tl.range(row + 1, end):
                q_at += stride_qt
                k_at += stride_kt
                v_at += stride_vt
                g_at += stride_gt
                beta_at += stride_bt
                q_next, k_next, v_next, g_next, beta_next = _row_inputs(
                    q_at, k_at, v_at, g_at, beta_at, dk, dv, t + 1 < end, DK, DV
                )
                tl.store(out_at + dv, read_out(s, q, out_ptr, INTERPRET))
                s = delta_step(s, k_up, v_up, g_up, beta_up, INTERPRET)
                q = q_up
                q_up, k_up, v_up, g_up, beta_up = q_next, k_next, v_next, g_next, beta_next
                out_at += stride_ot
                states_at += H * DK * DV
                if KEEP != KEEP_NONE:
                    keep_state(states_at, states_ptr, keep_ptr, t, H, head, tile, s, KEEP, DK, DV)
            tl.store(out_at + dv, read_out(s, q, out_ptr, INTERPRET))
        else:  # one row an iteration, each row's q and k brought to unit norm here (decode and verify rows)
            for t in tl.range(row, end):
                q_next, k_next, v_next, g_next, beta_next = _row_inputs(
                    q_at + stride_qt,
                    k_at + stride_kt,
                    v_at + stride_vt,
                    g_at + stride_gt,
                    beta_at + stride_bt,
                    dk,
                    dv,
                    t + 1 < end,
                    DK,
                    DV,
                )
                q = unit_q(q, SCALE, EPS, DK, INTERPRET)
                s = delta_step(s, unit_k(k, EPS, DK, INTERPRET), v, g, beta, INTERPRET)
                tl.store(out_at + dv, read_out(s, q, out_ptr, INTERPRET))
                if KEEP != KEEP_NONE:
                    keep_state(states_at, states_ptr, keep_ptr, t, H, head, tile, s, KEEP, DK, DV)
                q, k, v, g, beta = q_next, k_next, v_next, g_next, beta_next
                q_at += stride_qt
                k_at += stride_kt
                v_at += stride_vt
                g_at += stride_gt
                beta_at += stride_bt
                out_at += stride_ot
                states_at += H * DK * DV
        tl.store(slot + tile, s)


@triton.jit
def keep_state(
    states_at, states_ptr, keep_ptr, t, H, head, tile, s, KEEP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr
):
    """Row t's state, where it is kept: KEEP_EVERY at `states_at` (row t's place), KEEP_LISTED at row t's place in
    the kept rows (-1 in keep_ptr: not kept)."""
    if KEEP == KEEP_EVERY:
        tl.store(states_at + tile, s)
    elif KEEP == KEEP_LISTED:
        at = tl.load(keep_ptr + t)
        dest = states_ptr + (tl.maximum(at, 0).to(tl.int64) * H + head) * DK * DV + tile
        tl.store(dest, s, mask=tile < tl.where(at >= 0, DK * DV, 0))


@triton.jit
def _inverse_norm(x, EPS: tl.constexpr, DK: tl.constexpr, INTERPRET: tl.constexpr):
    """1 / sqrt(Σ x² + eps) over a [DK] vector: squares rounded apart, summed as a tree of neighbour pairs (so the
    bits depend on no layout, whichever kernel made x)."""
    return tl.div_rn(1.0, tl.sqrt_rn(pairwise_sum(mul_rn(x, x, INTERPRET), DK) + EPS))


@triton.jit
def unit_q(q, SCALE, EPS: tl.constexpr, DK: tl.constexpr, INTERPRET: tl.constexpr):
    """q at unit L2 norm, divided by sqrt(Dk)."""
    return tl.div_rn(q * _inverse_norm(q, EPS, DK, INTERPRET), SCALE)


@triton.jit
def unit_k(k, EPS: tl.constexpr, DK: tl.constexpr, INTERPRET: tl.constexpr):
    """k at unit L2 norm."""
    return k * _inverse_norm(k, EPS, DK, INTERPRET)


@triton.jit
def _inverse_row_norms(x, ROWS: tl.constexpr, EPS: tl.constexpr, DK: tl.constexpr, INTERPRET: tl.constexpr):
    """`_inverse_norm` of each row of x [ROWS, DK]: [ROWS], the same tree of rounded squares."""
    total = tl.sqrt_rn(pairwise_row_sums(mul_rn(x, x, INTERPRET), ROWS, DK) + EPS)
    return tl.div_rn(tl.full(total.shape, 1.0, tl.float32), total)


@triton.jit
def unit_q_rows(q, SCALE, ROWS: tl.constexpr, EPS: tl.constexpr, DK: tl.constexpr, INTERPRET: tl.constexpr):
    """`unit_q` of each row of q [ROWS, DK]."""
    return tl.div_rn(q * _inverse_row_norms(q, ROWS, EPS, DK, INTERPRET)[:, None], SCALE)


@triton.jit
def unit_k_rows(k, ROWS: tl.constexpr, EPS: tl.constexpr, DK: tl.constexpr, INTERPRET: tl.constexpr):
    """`unit_k` of each row of k [ROWS, DK]."""
    return k * _inverse_row_norms(k, ROWS, EPS, DK, INTERPRET)[:, None]


@triton.jit
def read_out(s, q, out_ptr, INTERPRET: tl.constexpr):
    """A row's output from its state and unit q, in the output's dtype."""
    out = round_to_act(
        tl.sum(mul_rn(s, q[:, None], INTERPRET), axis=0), out_ptr.dtype.element_ty == tl.bfloat16, INTERPRET
    )
    return out.to(out_ptr.dtype.element_ty)


@triton.jit
def delta_step(s, k, v, g, beta, INTERPRET: tl.constexpr):
    """One row's gated delta rule on a [Dk, BV] part of the state: decay, then write v against what k reads. Every
    product is rounded apart and the update is one explicit fused multiply-add (two roundings under the interpreter,
    as the reference), so no kernel's surroundings change how the compiler contracts them."""
    s = mul_rn(s, exp_f32(g, INTERPRET), INTERPRET)
    delta = (v - tl.sum(mul_rn(s, k[:, None], INTERPRET), axis=0)) * beta
    if INTERPRET:
        return s + k[:, None] * delta[None, :]
    else:
        return tl.fma(k[:, None], delta[None, :], s)


@triton.jit
def _row_inputs(q_at, k_at, v_at, g_at, beta_at, dk, dv, mask, DK: tl.constexpr, DV: tl.constexpr):
    """One row's q, k, v, g and beta of this head in fp32 (zeros where the scalar `mask` is false)."""
    # `x < where(mask, N, 0)` rather than `mask & ...`: the interpreter mistypes a scalar bool broadcast by `&`.
    q = tl.load(q_at + dk, mask=dk < tl.where(mask, DK, 0), other=0.0).to(tl.float32)
    k = tl.load(k_at + dk, mask=dk < tl.where(mask, DK, 0), other=0.0).to(tl.float32)
    v = tl.load(v_at + dv, mask=dv < tl.where(mask, DV, 0), other=0.0).to(tl.float32)
    g = tl.load(g_at, mask=mask, other=0.0).to(tl.float32)
    beta = tl.load(beta_at, mask=mask, other=0.0).to(tl.float32)
    return q, k, v, g, beta


def gdn_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    lane_of_row: torch.Tensor,
    keep_states: bool = False,
    out_dtype: torch.dtype = torch.float32,
    long_runs: bool = False,
    keep_rows: torch.Tensor | None = None,
    keep_places: torch.Tensor | None = None,
    states_out: torch.Tensor | None = None,
    unit_given: bool = False,
    out: torch.Tensor | None = None,
    firsts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated delta rule over each lane's consecutive rows; (o [T, H, Dv], states or None): with `keep_states` the
    state after every row, or with `keep_rows` (ascending row indices, distinct) only after those, in their order;
    `keep_places` (int32 [T], each row's place among keep_rows or -1) spares making that map (a graph's input);
    `states_out` receives the kept states instead of a new tensor. Rows of lane -1 are left alone (their outputs
    in `out`, when given, are kept). `unit_given`: q and k come from `unit_qk`. `firsts` (int32 or int64, -1 for
    none) lists every row that starts a run: the launch then has programs for those alone."""
    # long_runs (a prompt pass): q and k go to unit norm in a kernel of their own first; the bits are the same
    check_gdn(q, k, v, g, beta, state, lane_of_row)
    seq, heads, dv = v.shape
    dk = q.shape[2]
    if out is None:
        out = torch.empty((seq, heads, dv), dtype=out_dtype, device=v.device)
    elif out.shape != v.shape or out.stride(2) != 1 or out.device != v.device:
        raise ValueError(f"out: expected [T, H, Dv] {tuple(v.shape)} with contiguous Dv on {v.device}")
    states, keep_places, mode = kept_states_plan(state, lane_of_row, keep_states, keep_rows, keep_places, states_out)
    if seq == 0:
        return out, states
    if long_runs and not unit_given:
        q, k = unit_qk(q, k)
    block_v = min(BLOCK_V, dv)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if firsts is None and interpret:  # the interpreter pays for every program
        firsts = _run_firsts(lane_of_row)
    mapped = firsts is not None
    rows = firsts.shape[0] if mapped else seq
    firsts = firsts if mapped else lane_of_row  # lane_of_row: a pointer never read
    if rows == 0:  # every row is another kernel's
        return out, states
    _gdn_recurrent_kernel[(rows * heads * (dv // block_v),)](
        q,
        k,
        v,
        g,
        beta,
        state,
        lane_of_row,
        out,
        state if states is None else states,
        keep_places,
        firsts,
        seq,
        heads,
        heads // q.shape[1],
        dk**0.5,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        g.stride(0),
        g.stride(1),
        beta.stride(0),
        beta.stride(1),
        out.stride(0),
        out.stride(1),
        DK=dk,
        DV=dv,
        BV=block_v,
        EPS=L2_EPS,
        UNIT_QK=long_runs or unit_given,
        KEEP=mode.value,
        SCAN=SCAN,
        INTERPRET=interpret,
        MAPPED=mapped,
        num_warps=NUM_WARPS,
        enable_fp_fusion=True,
        enable_reflect_ftz=False,
        **launch_options(_gdn_recurrent_kernel, q.device),
    )
    return out, states


def kept_states_plan(
    state: torch.Tensor,
    lane_of_row: torch.Tensor,
    keep_states: bool,
    keep_rows: torch.Tensor | None,
    keep_places: torch.Tensor | None,
    states_out: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor, tl.constexpr]:
    """(where the kept states go or None, each row's place among them, the kernels' KEEP mode) for the keep
    arguments of `gdn_recurrent`, refused by name where they do not fit together."""
    if keep_rows is not None and not keep_states:
        raise ValueError("keep_rows: given without keep_states")
    if keep_places is not None and keep_rows is None:
        raise ValueError("keep_places: given without keep_rows")
    seq = lane_of_row.shape[0]
    listed = keep_places is not None or (keep_rows is not None and keep_rows.shape[0] != seq)  # else every row
    kept = keep_rows.shape[0] if listed else seq
    shape = (kept, *state.shape[1:])
    states = state.new_empty(shape) if keep_states and states_out is None else states_out
    if states_out is not None:
        _check_states_out(states_out, keep_states, shape, state.dtype)
    if keep_places is None:
        keep_places = kept_row_places(keep_rows, seq) if listed else lane_of_row  # lane_of_row: a pointer never read
    return states, keep_places, KEEP_LISTED if listed else KEEP_EVERY if keep_states else KEEP_NONE


def _run_firsts(lane_of_row: torch.Tensor) -> torch.Tensor:
    """The rows that start a run of a lane (not lane -1): the only rows whose programs do work."""
    lanes = lane_of_row.long()
    before = torch.cat((lanes.new_full((1,), -1), lanes[:-1]))
    return torch.nonzero((lanes != before) & (lanes >= 0)).flatten()


def run_firsts(lane_of_row: torch.Tensor, size: int) -> torch.Tensor:
    """`_run_firsts` of host lane ids as int32, padded with -1 to `size` entries (a graph's static input)."""
    starts = _run_firsts(lane_of_row)
    if starts.shape[0] > size:
        raise ValueError(f"firsts: {starts.shape[0]} runs start, more than the {size} entries")
    return torch.cat((starts, starts.new_full((size - starts.shape[0],), -1))).int()


def _check_states_out(out: torch.Tensor, keep_states: bool, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """Refuse a `states_out` the kernel cannot write the kept states into."""
    if not keep_states:
        raise ValueError("states_out: given without keep_states")
    if tuple(out.shape) != shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(
            f"states_out: expected a contiguous {dtype} tensor of {shape}, got {out.dtype} {tuple(out.shape)}"
        )


def kept_row_places(keep_rows: torch.Tensor, seq: int) -> torch.Tensor:
    """Each of `seq` rows' place among `keep_rows` (int32; -1 for rows not kept), made on the rows' device."""
    places = torch.full((seq,), -1, dtype=torch.int32, device=keep_rows.device)
    places[keep_rows] = torch.arange(keep_rows.shape[0], dtype=torch.int32, device=keep_rows.device)
    return places


def unit_qk(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k [T, Hk, Dk] at unit L2 norm in fp32, q also divided by sqrt(Dk), as the recurrence kernel makes them."""
    seq, key_heads, dk = q.shape
    q_unit = torch.empty((seq, key_heads, dk), dtype=torch.float32, device=q.device)
    k_unit = torch.empty_like(q_unit)
    _gdn_norm_kernel[(seq * key_heads,)](
        q,
        k,
        q_unit,
        k_unit,
        key_heads,
        dk**0.5,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        DK=dk,
        EPS=L2_EPS,
        INTERPRET=os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=NUM_WARPS,
        enable_fp_fusion=True,
        **launch_options(_gdn_norm_kernel, q.device),
    )
    return q_unit, k_unit
