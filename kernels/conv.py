"""Causal depthwise convolution over lanes of consecutive rows, each lane's kept tail updated in place."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.fp32_ops import add_rn, exp_f32, mul_rn, round_to_act
from kernels.pdl import enter, launch_options

SCAN_ROWS = 256
HEAD_C = 128
# Rows a head program looks through for lane starts: one in rounds of up to FEW_ROWS rows (a start each, run in
# parallel), HEAD_ROWS in larger ones (prompt passes), where a program a row left thousands of programs idle.
FEW_ROWS = 256
HEAD_ROWS = 16
BODY_ROWS = 16
BODY_C = 256
NUM_WARPS = 4


def lane_runs(lane_of_row: torch.Tensor) -> list[tuple[int, int, int]]:
    """(lane, first row, end row) of each lane's run of consecutive rows; a lane may own only one run."""
    runs: list[tuple[int, int, int]] = []
    for row, lane in enumerate(lane_of_row.tolist()):
        if runs and runs[-1][0] == lane:
            runs[-1] = (lane, runs[-1][1], row + 1)
        elif any(seen == lane for seen, _, _ in runs):
            raise ValueError(f"lane_of_row: the rows of lane {lane} are not consecutive")
        else:
            runs.append((lane, row, row + 1))
    return runs


def _silu_f32(x: torch.Tensor) -> torch.Tensor:
    """x / (1 + exp(-x)) in fp32, the order the kernel uses."""
    return x / (1.0 + torch.exp(-x))


def causal_conv_update_reference(
    x: torch.Tensor,
    tail: torch.Tensor,
    weight: torch.Tensor,
    lane_of_row: torch.Tensor,
    dilation: int = 1,
    activation: str | None = "silu",
    row_tails: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain-PyTorch `causal_conv_update`: fp32 taps summed oldest first per lane, tails replaced in place."""
    check_conv(x, tail, weight, lane_of_row, dilation, activation, row_tails)
    kernel, kept = weight.shape[1], tail.shape[1]
    taps = weight.float().t()
    out = torch.empty_like(x)
    for lane, start, end in lane_runs(lane_of_row):
        seq = end - start
        full = torch.cat((tail[lane].float(), x[start:end].float()))
        acc = full[:seq] * taps[0]
        for j in range(1, kernel):
            acc = acc + full[j * dilation : j * dilation + seq] * taps[j]
        out[start:end] = (_silu_f32(acc) if activation == "silu" else acc).to(x.dtype)
        if row_tails is not None:
            for row in range(seq):
                row_tails[start + row] = full[row + 1 : row + 1 + kept].to(tail.dtype)
        tail[lane] = full[seq:].to(tail.dtype)
    return out


def check_conv(
    x: torch.Tensor,
    tail: torch.Tensor,
    weight: torch.Tensor,
    lane_of_row: torch.Tensor,
    dilation: int,
    activation: str | None,
    row_tails: torch.Tensor | None,
) -> None:
    """Raise ValueError naming the argument whose shape, dtype or layout does not fit."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x: expected [T, C] with contiguous channels, got shape {tuple(x.shape)}")
    seq, channels = x.shape
    if weight.dim() != 2 or weight.shape[0] != channels or weight.shape[1] < 2:
        raise ValueError(f"weight: expected [{channels}, K>=2], got {tuple(weight.shape)}")
    if dilation < 1:
        raise ValueError(f"dilation: expected >= 1, got {dilation}")
    kept = (weight.shape[1] - 1) * dilation
    if tail.dim() != 3 or tail.shape[1:] != (kept, channels) or tail.stride(2) != 1:
        raise ValueError(f"tail: expected [L, {kept}, {channels}] with contiguous channels, got {tuple(tail.shape)}")
    if tail.dtype != x.dtype:
        raise ValueError(f"tail: dtype {tail.dtype} differs from x's {x.dtype}")
    if lane_of_row.shape != (seq,) or lane_of_row.dtype not in (torch.int32, torch.int64):
        got = f"{lane_of_row.dtype} {tuple(lane_of_row.shape)}"
        raise ValueError(f"lane_of_row: expected int32 or int64 [{seq}], got {got}")
    if activation not in ("silu", None):
        raise ValueError(f"activation: expected 'silu' or None, got {activation!r}")
    if row_tails is not None and (
        row_tails.shape != (seq, kept, channels) or row_tails.dtype != x.dtype or row_tails.stride(2) != 1
    ):
        got = f"{row_tails.dtype} {tuple(row_tails.shape)}"
        raise ValueError(f"row_tails: expected {x.dtype} [{seq}, {kept}, {channels}], contiguous channels; got {got}")
    tensors = (x, tail, weight, lane_of_row) if row_tails is None else (x, tail, weight, lane_of_row, row_tails)
    if len({t.device for t in tensors}) != 1:
        raise ValueError("x, tail, weight, lane_of_row and row_tails must be on one device")


@triton.jit
def lane_run_end(lane_ptr, ids, start, lane, T, SCAN: tl.constexpr):
    """One past the last row of `lane`'s run from row `start`, given ids = lane_of_row[start : start + SCAN]."""
    # A lane owns one run of rows, so its matches in a window are the run's rows there.
    found = tl.sum((ids == lane).to(tl.int32), axis=0)
    end = start + found
    more = found == SCAN
    while more:
        idx = end + tl.arange(0, SCAN)
        found = tl.sum((tl.load(lane_ptr + idx, mask=idx < T, other=-1) == lane).to(tl.int32), axis=0)
        end += found
        more = found == SCAN
    return end


@triton.jit
def _tap(
    x_ptr,
    tail_ptr,
    rows,
    lanes,
    local,
    m,
    cols,
    mask,
    stride_xt,
    stride_tl,
    stride_ts,
    S: tl.constexpr,
    HEAD: tl.constexpr,
):
    """Row `local - m` of each row's lane: a row of x when it is one of the lane's rows, else a row of its tail."""
    x_at = x_ptr + (rows - m).to(tl.int64)[:, None] * stride_xt + cols[None, :]
    if HEAD:
        from_x = (local >= m)[:, None]
        tail_at = tail_ptr + lanes.to(tl.int64)[:, None] * stride_tl + (S + local - m)[:, None] * stride_ts
        xv = tl.load(x_at, mask=mask & from_x, other=0.0)
        tv = tl.load(tail_at + cols[None, :], mask=mask & ~from_x, other=0.0)
        return tl.where(from_x, xv, tv)
    else:
        return tl.load(x_at, mask=mask, other=0.0)


@triton.jit
def conv_acc(
    x_ptr,
    tail_ptr,
    w_ptr,
    rows,
    lanes,
    local,
    cols,
    mask,
    cmask,
    stride_xt,
    stride_tl,
    stride_ts,
    stride_wc,
    stride_wk,
    K: tl.constexpr,
    DIL: tl.constexpr,
    S: tl.constexpr,
    SILU: tl.constexpr,
    HEAD: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """fp32 conv of the rows (`local`: each row's index in its lane, capped at S), taps summed oldest first."""
    # Every product and sum rounded apart (mul_rn, add_rn): the bits of a kernel compiled with FMA contraction too.
    w = tl.load(w_ptr + cols * stride_wc, mask=cmask, other=0.0).to(tl.float32)
    m = (K - 1) * DIL
    acc = _tap(x_ptr, tail_ptr, rows, lanes, local, m, cols, mask, stride_xt, stride_tl, stride_ts, S, HEAD)
    acc = mul_rn(acc.to(tl.float32), w[None, :], INTERPRET)
    for j in tl.static_range(1, K):
        w = tl.load(w_ptr + cols * stride_wc + j * stride_wk, mask=cmask, other=0.0).to(tl.float32)
        m = (K - 1 - j) * DIL
        tap = _tap(x_ptr, tail_ptr, rows, lanes, local, m, cols, mask, stride_xt, stride_tl, stride_ts, S, HEAD)
        acc = add_rn(acc, mul_rn(tap.to(tl.float32), w[None, :], INTERPRET), INTERPRET)
    if SILU:
        acc = tl.div_rn(acc, add_rn(tl.full(acc.shape, 1.0, tl.float32), exp_f32(-acc, INTERPRET), INTERPRET))
    return acc


@triton.jit
def _store_rows(
    x_ptr,
    tail_ptr,
    out_ptr,
    kept_ptr,
    acc,
    rows,
    lanes,
    local,
    cols,
    mask,
    stride_xt,
    stride_tl,
    stride_ts,
    stride_ot,
    stride_kt,
    stride_ks,
    S: tl.constexpr,
    KEEP: tl.constexpr,
    HEAD: tl.constexpr,
):
    """Store the rows' outputs and, with KEEP, the lane's tail after each row (slot i: lane row local - S + 1 + i)."""
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_ot + cols[None, :], acc, mask=mask)
    if KEEP:
        store_row_tails(
            x_ptr, tail_ptr, kept_ptr, rows, lanes, local, cols, mask, stride_xt, stride_tl, stride_ts, stride_kt,
            stride_ks, S, HEAD,
        )  # fmt: skip


@triton.jit
def store_row_tails(
    x_ptr,
    tail_ptr,
    kept_ptr,
    rows,
    lanes,
    local,
    cols,
    mask,
    stride_xt,
    stride_tl,
    stride_ts,
    stride_kt,
    stride_ks,
    S: tl.constexpr,
    HEAD: tl.constexpr,
):
    """The lane's tail after each of the rows (slot i: lane row local - S + 1 + i), at the rows' places in kept."""
    kept = kept_ptr + rows.to(tl.int64)[:, None] * stride_kt + cols[None, :]
    for i in tl.static_range(S):
        m = S - 1 - i
        tap = _tap(x_ptr, tail_ptr, rows, lanes, local, m, cols, mask, stride_xt, stride_tl, stride_ts, S, HEAD)
        tl.store(kept + i * stride_ks, tap, mask=mask)


@triton.jit(do_not_specialize=["T"])
def _causal_conv_kernel(
    x_ptr,
    tail_ptr,
    w_ptr,
    out_ptr,
    kept_ptr,
    lane_ptr,
    T,
    C,
    stride_xt,
    stride_tl,
    stride_ts,
    stride_wc,
    stride_wk,
    stride_ot,
    stride_kt,
    stride_ks,
    K: tl.constexpr,
    DIL: tl.constexpr,
    S: tl.constexpr,
    S_PAD: tl.constexpr,
    SILU: tl.constexpr,
    KEEP: tl.constexpr,
    BC_HEAD: tl.constexpr,
    HR: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    SCAN: tl.constexpr,
    INTERPRET: tl.constexpr,
    PDL: tl.constexpr,
):
    """Causal conv of lanes' rows: programs for each lane's first S rows and tail, then programs for BT-row blocks."""
    enter(PDL)
    # A head program (one per HR rows and BC_HEAD channels) convolves, for each lane starting in its rows, the
    # lane's first S rows, the only ones that read its tail, then replaces the tail: one program reads and writes
    # it, so no race. A body program convolves the rows S.. of any lane in BT rows and BC channels.
    pid = tl.program_id(0)
    heads = tl.cdiv(T, HR) * tl.cdiv(C, BC_HEAD)
    if pid < heads:
        first = pid // tl.cdiv(C, BC_HEAD) * HR
        head_cols = (pid % tl.cdiv(C, BC_HEAD)) * BC_HEAD + tl.arange(0, BC_HEAD)
        group = first + tl.arange(0, HR)
        in_rows = group < T
        starts = in_rows & (
            tl.load(lane_ptr + group, mask=in_rows, other=-1)
            != tl.load(lane_ptr + group - 1, mask=in_rows & (group > 0), other=-1)
        )
        for j in range(HR):
            if tl.sum(tl.where(group == first + j, starts.to(tl.int32), 0)) > 0:
                unit = first + j
                lane = tl.load(lane_ptr + unit)
                _conv_head(
                    x_ptr,
                    tail_ptr,
                    w_ptr,
                    out_ptr,
                    kept_ptr,
                    lane_ptr,
                    unit,
                    lane,
                    head_cols,
                    T,
                    C,
                    stride_xt,
                    stride_tl,
                    stride_ts,
                    stride_wc,
                    stride_wk,
                    stride_ot,
                    stride_kt,
                    stride_ks,
                    K,
                    DIL,
                    S,
                    S_PAD,
                    SILU,
                    KEEP,
                    SCAN,
                    INTERPRET,
                )
    else:
        block = pid - heads
        rows = block // tl.cdiv(C, BC) * BT + tl.arange(0, BT)
        cols = block % tl.cdiv(C, BC) * BC + tl.arange(0, BC)
        cmask = cols < C
        valid = rows < T
        lanes = tl.load(lane_ptr + rows, mask=valid, other=-1)
        local = tl.zeros_like(rows)
        for i in tl.static_range(1, S + 1):
            before = tl.load(lane_ptr + rows - i, mask=valid & (rows >= i), other=-1)
            local += (before == lanes).to(tl.int32)
        body = (valid & (local == S))[:, None] & cmask[None, :]
        acc = conv_acc(
            x_ptr,
            tail_ptr,
            w_ptr,
            rows,
            lanes,
            local,
            cols,
            body,
            cmask,
            stride_xt,
            stride_tl,
            stride_ts,
            stride_wc,
            stride_wk,
            K,
            DIL,
            S,
            SILU,
            False,
            INTERPRET,
        )
        _store_rows(
            x_ptr,
            tail_ptr,
            out_ptr,
            kept_ptr,
            round_to_act(acc, out_ptr.dtype.element_ty == tl.bfloat16, INTERPRET),
            rows,
            lanes,
            local,
            cols,
            body,
            stride_xt,
            stride_tl,
            stride_ts,
            stride_ot,
            stride_kt,
            stride_ks,
            S,
            KEEP,
            False,
        )


@triton.jit
def _conv_head(
    x_ptr,
    tail_ptr,
    w_ptr,
    out_ptr,
    kept_ptr,
    lane_ptr,
    unit,
    lane,
    cols,
    T,
    C,
    stride_xt,
    stride_tl,
    stride_ts,
    stride_wc,
    stride_wk,
    stride_ot,
    stride_kt,
    stride_ks,
    K: tl.constexpr,
    DIL: tl.constexpr,
    S: tl.constexpr,
    S_PAD: tl.constexpr,
    SILU: tl.constexpr,
    KEEP: tl.constexpr,
    SCAN: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """The first S rows of the lane starting at row `unit`, then its new tail, in the given channels."""
    cmask = cols < C
    idx = unit + tl.arange(0, SCAN)
    ids = tl.load(lane_ptr + idx, mask=idx < T, other=-1)
    local = tl.arange(0, S_PAD)
    rows = unit + local
    lanes = tl.zeros_like(local) + lane
    # Rows past the lane's end read harmless rows here and are never stored, so the taps need not wait for the
    # run's length.
    loadable = ((local < S) & (rows < T))[:, None] & cmask[None, :]
    acc = conv_acc(
        x_ptr,
        tail_ptr,
        w_ptr,
        rows,
        lanes,
        local,
        cols,
        loadable,
        cmask,
        stride_xt,
        stride_tl,
        stride_ts,
        stride_wc,
        stride_wk,
        K,
        DIL,
        S,
        SILU,
        True,
        INTERPRET,
    )
    seq = lane_run_end(lane_ptr, ids, unit, lane, T, SCAN) - unit
    head = (local < tl.minimum(seq, S))[:, None] & cmask[None, :]
    _store_rows(
        x_ptr,
        tail_ptr,
        out_ptr,
        kept_ptr,
        round_to_act(acc, out_ptr.dtype.element_ty == tl.bfloat16, INTERPRET),
        rows,
        lanes,
        local,
        cols,
        head,
        stride_xt,
        stride_tl,
        stride_ts,
        stride_ot,
        stride_kt,
        stride_ks,
        S,
        KEEP,
        True,
    )
    replace_tail(x_ptr, tail_ptr, unit, lane, seq, cols, cmask, stride_xt, stride_tl, stride_ts, S, S_PAD)


@triton.jit
def replace_tail(
    x_ptr, tail_ptr, unit, lane, seq, cols, cmask, stride_xt, stride_tl, stride_ts, S: tl.constexpr, S_PAD: tl.constexpr
):
    """The lane's new tail in the given channels: the last S rows of (old tail, its `seq` rows from row `unit`)."""
    local = tl.arange(0, S_PAD)
    src = seq - S + local  # slot i holds lane row seq - S + i
    keep = (local < S)[:, None] & cmask[None, :]
    from_x = (src >= 0)[:, None]
    xv = tl.load(x_ptr + (unit + src).to(tl.int64)[:, None] * stride_xt + cols[None, :], mask=keep & from_x, other=0.0)
    tail = tail_ptr + lane.to(tl.int64) * stride_tl + cols[None, :]
    tv = tl.load(tail + (S + src)[:, None] * stride_ts, mask=keep & ~from_x, other=0.0)
    new = tl.where(from_x, xv, tv)
    # Every read of the old tail in this program happens before any write to it.
    tl.debug_barrier()
    tl.store(tail + local[:, None] * stride_ts, new, mask=keep)


def causal_conv_update(
    x: torch.Tensor,
    tail: torch.Tensor,
    weight: torch.Tensor,
    lane_of_row: torch.Tensor,
    dilation: int = 1,
    activation: str | None = "silu",
    row_tails: torch.Tensor | None = None,
    head_rows: int | None = None,
) -> torch.Tensor:
    """Depthwise causal conv of each lane's consecutive rows of x [T, C] after its tail [L, S, C]; out [T, C].
    `head_rows` (a sweep's choice; by default 1 up to FEW_ROWS rows, else HEAD_ROWS) never changes a bit."""
    check_conv(x, tail, weight, lane_of_row, dilation, activation, row_tails)
    if head_rows is not None and (head_rows < 1 or head_rows & (head_rows - 1)):
        raise ValueError(f"head_rows: {head_rows} is not a power of two")
    seq, channels = x.shape
    kernel = weight.shape[1]
    kept = (kernel - 1) * dilation
    out = torch.empty_like(x)
    if seq == 0:
        return out
    keep = row_tails is not None
    row_tails = row_tails if keep else tail
    if head_rows is None:
        head_rows = 1 if seq <= FEW_ROWS else HEAD_ROWS
    heads = triton.cdiv(seq, head_rows) * triton.cdiv(channels, HEAD_C)
    grid = (heads + triton.cdiv(seq, BODY_ROWS) * triton.cdiv(channels, BODY_C),)
    _causal_conv_kernel[grid](
        x,
        tail,
        weight,
        out,
        row_tails,
        lane_of_row,
        seq,
        channels,
        x.stride(0),
        tail.stride(0),
        tail.stride(1),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        row_tails.stride(0),
        row_tails.stride(1),
        K=kernel,
        DIL=dilation,
        S=kept,
        S_PAD=triton.next_power_of_2(kept),
        SILU=activation == "silu",
        KEEP=keep,
        BC_HEAD=HEAD_C,
        HR=head_rows,
        BT=BODY_ROWS,
        BC=BODY_C,
        SCAN=SCAN_ROWS,
        INTERPRET=os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=NUM_WARPS,
        enable_fp_fusion=False,
        enable_reflect_ftz=False,
        **launch_options(_causal_conv_kernel, x.device),
    )
    return out
