"""Gated DeltaNet's decode and verify rows in one launch: causal conv, gates, recurrence and the gated output norm.

`gdn_step` gives the bits of `causal_conv_update` (SiLU), `gdn_gates`, `gdn_recurrent` and `gated_rms_norm` run one
after another on the same rows, from the same jit helpers: one program per (row, value head, Dv tile) as in the
recurrence kernel, and a lane's first row runs the lane's rows in order, `window` rows at a time. For a window it
keeps the rows' conv tails, forms its key head's q and k by the conv kernel's `conv_acc` (rounded to the activation
dtype, as the conv kernel stores them) at unit norm, and its head's beta and g by `gdn_gate_values`, all in one wave
of loads; then for each row its own Dv tile of v and the recurrence kernel's step. The conv and gate helpers round
every product and sum apart, so this kernel, compiled with FMA contraction as the recurrence is, gives them the bits
their own kernels give them without it. The fp32 outputs go to a scratch [T, H, Dv]; the last of a (row, value
head)'s Dv tiles to arrive (an arrival counter) runs `gated_norm_pairs` on the lane's rows, a window at a time.
A key head's q, k tail is read by every program of that key head, so the last of them to arrive replaces it; each
program replaces its own v channels' tail. Counters are left zero.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.conv import (
    SCAN_ROWS,
    causal_conv_update_reference,
    check_conv,
    conv_acc,
    lane_run_end,
    replace_tail,
    store_row_tails,
)
from kernels.counters import CounterPool
from kernels.fp32_ops import negative_zeros, round_to_act
from kernels.gates import check_gdn_gates, contiguous_columns, gdn_gate_values, gdn_gates_reference
from kernels.gdn import (
    BLOCK_V,
    KEEP_NONE,
    L2_EPS,
    NUM_WARPS,
    check_gdn,
    delta_step,
    gdn_recurrent_reference,
    keep_state,
    kept_states_plan,
    read_out,
    unit_k_rows,
    unit_q_rows,
)
from kernels.norm import block_c, gated_norm_pairs, gated_rms_norm_reference, row_groups
from kernels.pdl import enter, launch_options, load_settled

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
MAX_ROWS = 1024  # rows one launch takes (its arrival counters: a key-head and a value-head set per row)
MAX_HEADS = 64  # value heads per rank the counters cover
WINDOWS = (1, 2, 4, 8)  # rows of a lane one program reads at once
_COUNTERS = CounterPool(MAX_ROWS * 2 * MAX_HEADS, "gdn_step", "row heads")


@triton.jit
def _conv_rows(
    x_ptr, tail_ptr, w_ptr, rows, lane, local, inside, cols, stride_xt, stride_tl, stride_ts, stride_wc, stride_wk,
    K: tl.constexpr, S: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    """The rows' conv outputs (SiLU) in the given channels [W, C], as the conv kernel stores them, in fp32 (zeros in
    rows not `inside`)."""
    mask = inside[:, None] & (cols >= 0)[None, :]
    acc = conv_acc(
        x_ptr, tail_ptr, w_ptr, rows, tl.zeros_like(rows) + lane, local, cols, mask, cols >= 0, stride_xt, stride_tl,
        stride_ts, stride_wc, stride_wk, K, 1, S, True, True, INTERPRET,
    )  # fmt: skip
    return round_to_act(acc, x_ptr.dtype.element_ty == tl.bfloat16, INTERPRET).to(tl.float32)


@triton.jit
def _store_tails_after(
    x_ptr, tail_ptr, row_tails_ptr, rows, lane, local, inside, cols, stride_xt, stride_tl, stride_ts, stride_kt,
    stride_ks, S: tl.constexpr,
):  # fmt: skip
    """The lane's conv tail after each of the rows `inside`, in the given channels, at the rows' places in row_tails."""
    store_row_tails(
        x_ptr, tail_ptr, row_tails_ptr, rows, tl.zeros_like(rows) + lane, local, cols,
        inside[:, None] & (cols >= 0)[None, :], stride_xt, stride_tl, stride_ts, stride_kt, stride_ks, S, True,
    )  # fmt: skip


@triton.jit
def _picked(values, pick, INTERPRET: tl.constexpr):
    """Σ over axis 0 of fp32 values where `pick` holds one entry a column: that entry, exactly. On the GPU every
    other entry adds -0.0; the interpreter's sum starts from +0.0, so there the bits are summed as integers."""
    if INTERPRET:
        bits = tl.where(pick, values.to(tl.uint32, bitcast=True), 0)
        return tl.sum(bits, axis=0).to(tl.float32, bitcast=True)
    else:
        return tl.sum(tl.where(pick, values, negative_zeros(values.shape)), axis=0)


@triton.jit
def _row_of(tile, i, W: tl.constexpr, INTERPRET: tl.constexpr):
    """Row i of a [W, C] fp32 tile, exactly."""
    return _picked(tile, (tl.arange(0, W) == i)[:, None], INTERPRET)


@triton.jit
def _element_of(vector, i, W: tl.constexpr, INTERPRET: tl.constexpr):
    """Element i of a [W] fp32 vector, exactly."""
    return _picked(vector, tl.arange(0, W) == i, INTERPRET)


@triton.jit(do_not_specialize=["T"])
def _gdn_step_kernel(
    x_ptr, tail_ptr, conv_w_ptr, b_ptr, a_ptr, a_log_ptr, dt_bias_ptr, z_ptr, norm_w_ptr, state_ptr, lane_ptr,
    o_ptr, y_ptr, row_tails_ptr, states_ptr, keep_ptr, count_ptr,
    T, H, RATIO, QK, SCALE, norm_eps,
    stride_xt, stride_tl, stride_ts, stride_wc, stride_wk, stride_bt, stride_at, stride_zt, stride_kt, stride_ks,
    DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, K: tl.constexpr, S: tl.constexpr, S_PAD: tl.constexpr,
    EPS: tl.constexpr, KEEP: tl.constexpr, KEEP_TAILS: tl.constexpr, SILU_GATE: tl.constexpr,
    B_BF16: tl.constexpr, ACT_BF16: tl.constexpr, NORM_BLOCK: tl.constexpr, SCAN: tl.constexpr,
    W: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One program per (row, value head, Dv tile); a lane's first row runs the lane's rows (others, and rows of
    lane -1, return)."""
    pid = tl.program_id(0)
    tiles = DV // BV
    row = pid // (H * tiles)
    head = (pid // tiles) % H
    key_head = head // RATIO
    dk = tl.arange(0, DK)
    dv = (pid % tiles) * BV + tl.arange(0, BV)
    # the row's lane (written at the round's start) and its state tile (by this layer's step a round before), read
    # while the input projection before this launch still runs
    lane = load_settled(lane_ptr + row, None, None)
    first = lane != tl.where(lane >= 0, load_settled(lane_ptr + row - 1, row > 0, -1), lane)
    slot = state_ptr + (lane.to(tl.int64) * H + head) * DK * DV
    state_tile = dk[:, None] * DV + dv[None, :]
    s = load_settled(slot + state_tile, tl.where(first, state_tile >= 0, False), 0.0)  # a bool tile (interpreter)
    enter(PDL)
    if first:
        idx = row + tl.arange(0, SCAN)
        ids = tl.load(lane_ptr + idx, mask=idx < T, other=-1)
        end = lane_run_end(lane_ptr, ids, row, lane, T, SCAN)
        q_cols = key_head * DK + dk
        k_cols = QK + key_head * DK + dk
        both = tl.arange(0, 2 * DK)
        qk_cols = tl.where(both < DK, key_head * DK + both, QK + key_head * DK + both - DK)  # q's, then k's
        v_cols = 2 * QK + head * DV + dv
        a_log = tl.load(a_log_ptr + head)
        dt_bias = tl.load(dt_bias_ptr + head)
        row64 = row.to(tl.int64)
        # W rows at a time: their conv tails kept, their unit q and k and their gates formed in one wave of loads,
        # then the recurrence's steps one row after another
        for base in tl.range(row, end, W):
            rows = base + tl.arange(0, W)
            inside = rows < end
            local = tl.minimum(rows - row, S)
            if KEEP_TAILS:
                _store_tails_after(x_ptr, tail_ptr, row_tails_ptr, rows, lane, local, inside, v_cols, stride_xt,
                                   stride_tl, stride_ts, stride_kt, stride_ks, S)  # fmt: skip
                if (head % RATIO == 0) & (pid % tiles == 0):  # one program a key head keeps its q, k tails
                    _store_tails_after(x_ptr, tail_ptr, row_tails_ptr, rows, lane, local, inside, qk_cols,
                                       stride_xt, stride_tl, stride_ts, stride_kt, stride_ks, S)  # fmt: skip
            k_conv = _conv_rows(x_ptr, tail_ptr, conv_w_ptr, rows, lane, local, inside, k_cols, stride_xt, stride_tl,
                                stride_ts, stride_wc, stride_wk, K, S, INTERPRET)  # fmt: skip
            k_all = unit_k_rows(k_conv, W, EPS, DK, INTERPRET)
            q_conv = _conv_rows(x_ptr, tail_ptr, conv_w_ptr, rows, lane, local, inside, q_cols, stride_xt, stride_tl,
                                stride_ts, stride_wc, stride_wk, K, S, INTERPRET)  # fmt: skip
            q_all = unit_q_rows(q_conv, SCALE, W, EPS, DK, INTERPRET)
            rows64 = row64 + (rows - row)
            b = tl.load(b_ptr + rows64 * stride_bt + head, mask=inside, other=0.0)
            a = tl.load(a_ptr + rows64 * stride_at + head, mask=inside, other=0.0)
            beta_all, g_all = gdn_gate_values(b, a, a_log, dt_bias, B_BF16, INTERPRET)
            beta_all = beta_all.to(tl.float32)
            for t in tl.range(base, tl.minimum(base + W, end)):
                i = t - base
                t64 = row64 + (t - row)  # (under the interpreter t is a Python int)
                # v is formed row by row: picked out of the window's tile, it gave the recurrence other bits on the
                # GPU (docs/performance.md, thirty-third session)
                row_t = tl.zeros((1,), tl.int32) + t  # row t as a one-row tile
                v = _conv_rows(x_ptr, tail_ptr, conv_w_ptr, row_t, lane, tl.minimum(row_t - row, S), row_t >= 0,
                               v_cols, stride_xt, stride_tl, stride_ts, stride_wc, stride_wk, K, S,
                               INTERPRET)  # fmt: skip
                s = delta_step(s, _row_of(k_all, i, W, INTERPRET), tl.reshape(v, (BV,)),
                               _element_of(g_all, i, W, INTERPRET), _element_of(beta_all, i, W, INTERPRET),
                               INTERPRET)  # fmt: skip
                o = read_out(s, _row_of(q_all, i, W, INTERPRET), o_ptr, INTERPRET)
                tl.store(o_ptr + (t64 * H + head) * DV + dv, o)
                if KEEP != KEEP_NONE:
                    keep_state(states_ptr + (t64 * H + head) * DK * DV, states_ptr, keep_ptr, t64, H, head,
                               state_tile, s, KEEP, DK, DV)  # fmt: skip
        tl.store(slot + state_tile, s)
        seq = end - row
        replace_tail(x_ptr, tail_ptr, row, lane, seq, v_cols, v_cols >= 0, stride_xt, stride_tl, stride_ts, S, S_PAD)
        tl.debug_barrier()  # this program's tail reads and output stores, before it arrives
        key_count = count_ptr + row64 * (2 * H) + key_head
        if tl.atomic_add(key_count, 1, sem="acq_rel", scope="gpu") == RATIO * tiles - 1:
            replace_tail(x_ptr, tail_ptr, row, lane, seq, qk_cols, qk_cols >= 0, stride_xt, stride_tl, stride_ts, S,
                         S_PAD)  # fmt: skip
            tl.atomic_xchg(key_count, 0, sem="relaxed", scope="gpu")
        head_count = count_ptr + row64 * (2 * H) + H + head
        if tl.atomic_add(head_count, 1, sem="acq_rel", scope="gpu") == tiles - 1:
            width = tl.zeros((), tl.int32) + DV  # a runtime width, as the norm kernel has
            for base in tl.range(row, end, W):
                rows64 = row64 + (base - row) + tl.arange(0, W)
                pairs = rows64 * H + head
                gated_norm_pairs(o_ptr, z_ptr, norm_w_ptr, y_ptr, pairs, pairs * DV, rows64 * stride_zt + head * DV,
                                 rows64 < row64 + (end - row), width, norm_eps, SILU_GATE, ACT_BF16, W, NORM_BLOCK,
                                 INTERPRET)  # fmt: skip
            tl.atomic_xchg(head_count, 0, sem="relaxed", scope="gpu")


def fits(rows: int, value_heads: int) -> bool:
    """Can one launch take `rows` rows of `value_heads` heads (its arrival counters)?"""
    return rows <= MAX_ROWS and value_heads <= MAX_HEADS


def _split_heads(
    mixed: torch.Tensor, state: torch.Tensor, key_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, Hk, Dk], k [T, Hk, Dk] and v [T, H, Dv]: views of the conv's channels (q | k | v) of `mixed`'s rows."""
    _, heads, dk, dv = state.shape
    qk = key_heads * dk
    if mixed.dim() != 2 or mixed.shape[1] != 2 * qk + heads * dv:
        raise ValueError(f"mixed: expected [T, {2 * qk + heads * dv}] (q, k and v channels), got {tuple(mixed.shape)}")
    q, k, v = mixed.split([qk, qk, heads * dv], dim=-1)
    return q.unflatten(-1, (key_heads, dk)), k.unflatten(-1, (key_heads, dk)), v.unflatten(-1, (heads, dv))


def _check_step(
    mixed: torch.Tensor,
    tail: torch.Tensor,
    conv_weight: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    gate_act: str,
    state: torch.Tensor,
    lane_of_row: torch.Tensor,
    key_heads: int,
    row_tails: torch.Tensor | None,
) -> torch.Tensor:
    """z as [T, H, Dv]; raise ValueError (TypeError for a dtype, as the gates do) naming the argument that does not
    fit, where the four kernels this launch stands for would refuse it."""
    if state.dim() != 4:
        raise ValueError(f"state: expected fp32 [L, H, Dk, Dv], got {tuple(state.shape)}")
    heads, dv = state.shape[1], state.shape[3]
    if key_heads < 1 or heads % key_heads:
        raise ValueError(f"key_heads: expected a divisor of the state's {heads} value heads, got {key_heads}")
    if mixed.dim() != 2 or mixed.stride(-1) != 1:
        raise ValueError(f"mixed: expected [T, C] with contiguous channels, got {tuple(mixed.shape)}")
    q, k, v = _split_heads(mixed, state, key_heads)
    if conv_weight.dim() != 2 or conv_weight.shape[0] != mixed.shape[1] or conv_weight.shape[1] < 2:
        raise ValueError(f"conv_weight: expected [{mixed.shape[1]}, K>=2], got {tuple(conv_weight.shape)}")
    if b.shape != (mixed.shape[0], heads):
        raise ValueError(f"b: expected [{mixed.shape[0]}, {heads}], got {tuple(b.shape)}")
    check_gdn_gates(b, a, a_log, dt_bias)
    check_conv(mixed, tail, conv_weight, lane_of_row, 1, "silu", row_tails)
    check_gdn(q, k, v, b, b, state, lane_of_row)
    if z.dim() == 2 and z.shape[-1] != heads * dv:
        raise ValueError(f"z: expected [{mixed.shape[0]}, {heads * dv}] or {tuple(v.shape)}, got {tuple(z.shape)}")
    z3 = row_groups(z.unflatten(-1, (heads, dv)) if z.dim() == 2 else z, "z")
    if z3.shape != v.shape or z3.stride(1) != dv:
        raise ValueError(f"z: expected {tuple(v.shape)} like v with contiguous heads, got {tuple(z.shape)}")
    if norm_weight.shape != (dv,) or norm_weight.stride(0) != 1:
        raise ValueError(f"norm_weight: expected contiguous [{dv}], got {tuple(norm_weight.shape)}")
    if gate_act not in ("sigmoid", "silu"):
        raise ValueError(f"gate_act: expected 'sigmoid' or 'silu', got {gate_act!r}")
    if not fits(mixed.shape[0], heads):
        raise ValueError(f"mixed: {mixed.shape[0]} rows of {heads} heads exceed one launch's counters")
    tensors = (mixed, b, a, a_log, dt_bias, z, norm_weight, state)
    if len({t.device for t in (*tensors, lane_of_row)}) != 1:
        raise ValueError("mixed, b, a, a_log, dt_bias, z, norm_weight, state and lane_of_row must be on one device")
    return z3


def gdn_step(
    mixed: torch.Tensor,
    tail: torch.Tensor,
    conv_weight: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_eps: float,
    gate_act: str,
    state: torch.Tensor,
    lane_of_row: torch.Tensor,
    key_heads: int,
    row_tails: torch.Tensor | None = None,
    keep_states: bool = False,
    keep_rows: torch.Tensor | None = None,
    keep_places: torch.Tensor | None = None,
    states_out: torch.Tensor | None = None,
    window: int = 1,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(y [T, H, Dv] in z's dtype, kept states or None): the GDN mixer's rows from the input projection's mixed
    [T, conv channels], b and a [T, H] and z [T, H, Dv] (or [T, H·Dv]), through the conv (its tails in place,
    `row_tails` as `causal_conv_update` keeps them), the gates, the recurrence (states in place; the keep arguments as
    `gdn_recurrent` takes them) and the gated norm, with those kernels' bits. Rows of lane -1 are left alone (their
    y unwritten), as the recurrence leaves them. A lane's rows are read `window` (one of WINDOWS) at a time; any
    window gives the same bits (the model reads one: docs/performance.md, thirty-third session)."""
    if window not in WINDOWS:
        raise ValueError(f"window: expected one of {WINDOWS}, got {window}")
    z3 = _check_step(
        mixed, tail, conv_weight, b, a, a_log, dt_bias, z, norm_weight, gate_act, state, lane_of_row, key_heads,
        row_tails,
    )  # fmt: skip
    seq, (_, heads, dk, dv) = mixed.shape[0], state.shape
    states, keep_places, mode = kept_states_plan(state, lane_of_row, keep_states, keep_rows, keep_places, states_out)
    y = torch.empty((seq, heads, dv), dtype=z.dtype, device=z.device)
    if seq == 0:
        return y, states
    b, a, a_log, dt_bias = contiguous_columns(b), contiguous_columns(a), a_log.contiguous(), dt_bias.contiguous()
    o = torch.empty((seq, heads, dv), dtype=torch.float32, device=mixed.device)
    kept_tails = row_tails if row_tails is not None else tail
    kernel, block_v = conv_weight.shape[1], min(BLOCK_V, dv)
    _gdn_step_kernel[(seq * heads * (dv // block_v),)](
        mixed, tail, conv_weight, b, a, a_log, dt_bias, z3, norm_weight, state, lane_of_row, o, y, kept_tails,
        state if states is None else states, keep_places, _COUNTERS.get(mixed.device, seq * 2 * heads),
        seq, heads, heads // key_heads, key_heads * dk, dk**0.5, norm_eps,
        mixed.stride(0), tail.stride(0), tail.stride(1), conv_weight.stride(0), conv_weight.stride(1), b.stride(0),
        a.stride(0), z3.stride(0), kept_tails.stride(0), kept_tails.stride(1),
        DK=dk, DV=dv, BV=block_v, K=kernel, S=kernel - 1, S_PAD=triton.next_power_of_2(kernel - 1), EPS=L2_EPS,
        KEEP=mode.value, KEEP_TAILS=row_tails is not None, SILU_GATE=gate_act == "silu",
        B_BF16=b.dtype == torch.bfloat16, ACT_BF16=z.dtype == torch.bfloat16, NORM_BLOCK=block_c(dv), SCAN=SCAN_ROWS,
        W=window, INTERPRET=INTERPRET,
        num_warps=NUM_WARPS, enable_fp_fusion=True, enable_reflect_ftz=False,
        **launch_options(_gdn_step_kernel, mixed.device),
    )  # fmt: skip
    return y, states


def gdn_step_reference(
    mixed: torch.Tensor,
    tail: torch.Tensor,
    conv_weight: torch.Tensor,
    b: torch.Tensor,
    a: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    z: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_eps: float,
    gate_act: str,
    state: torch.Tensor,
    lane_of_row: torch.Tensor,
    key_heads: int,
    row_tails: torch.Tensor | None = None,
    keep_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plain-PyTorch `gdn_step`: the four references one after another (the kept states of every row)."""
    qkv = causal_conv_update_reference(mixed, tail, conv_weight, lane_of_row, row_tails=row_tails)
    q, k, v = _split_heads(qkv, state, key_heads)
    beta, g = gdn_gates_reference(b, a, a_log, dt_bias)
    out, states = gdn_recurrent_reference(q, k, v, g, beta, state, lane_of_row, keep_states)
    y = gated_rms_norm_reference(out, z.view(v.shape), norm_weight, norm_eps, gate_act)
    return y, states
