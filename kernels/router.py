"""MoE router: softmax over the expert logits in fp32, top-k with ties to the lower expert id, renormalised.

`router_topk(logits [N, E], k)` gives (weights [N, k] fp32, ids [N, k] int32), ids in descending probability with
equal probabilities in ascending expert id, as `model.moe.Router` does with a stable descending sort.

Reduction order (the exactness contract). One row is handled by one program over a block of next_pow2(E) lanes,
so a row's bits never depend on the batch. In fp32: m = max(x) (exact in any order); e = exp(x - m), the
subtraction in fp32 and the exponential evaluated in fp64 and rounded once to fp32; s = Σ e as a balanced pairwise
tree over the lanes (lanes 2i and 2i+1 first, then pairs of those sums, and so on), which no warp count or layout
changes; p = e / s with IEEE division. `topk_row` is that row's work: `router_topk` runs it one program a row, and
`kernels.linear.linear_topk` in the linear kernel itself, in the row tile's last arrival, with the same bits. The k
picks are the k largest 64-bit keys (bits(p) << 32 | (BLOCK_E - 1 - id)), in descending order, so the larger
probability wins and among equal ones the lower id; the keys of valid lanes are distinct, so a reduction that takes
the PICKS largest at once (a merge of descending pairs) picks what PICKS maxima taken one by one would, in their
order. Renormalising divides each pick by their sum taken in pick order (descending probability) starting from
zero. A row's program spreads its lanes over `router_warps` warps (more up to WIDE_ROWS rows, whose picks wait on
one program's chain; a warp per 512 lanes beyond); no sum or pick depends on how lanes fall to warps.
Against `router_topk_reference` (torch's softmax, then a stable sort and torch's sum over the
k) the weights may differ in the last fp32 bits only, from the different exp implementation and summation orders;
the ids are identical unless two probabilities land within such a rounding of each other. With bf16 logits that
needs equal logits (equal x - m, so equal probabilities in both, tied to the lower id in both) or logits so small
(|x| below about 1e-5) that neighbouring bf16 values differ by less than fp32 resolves after exp.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.fp32_ops import pairwise_sum
from kernels.pdl import enter, launch_options

PICKS = 2  # keys a reduction takes at once (`topk_row`): 1 or 2, the same picks and bits
WIDE_ROWS = 64  # rows up to which a row's program takes more warps (decode rounds of up to 64 lanes)


def router_topk_reference(logits: torch.Tensor, k: int, renormalise: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [N, k] fp32, ids [N, k] int32) by torch softmax in fp32 and a stable descending sort."""
    probs = torch.softmax(logits.float(), dim=-1)
    order = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = order.values[:, :k], order.indices[:, :k]
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


@triton.jit
def _top2(a0, a1, b0, b1):
    """The two largest of two descending pairs of distinct keys, descending."""
    return tl.maximum(a0, b0), tl.maximum(tl.minimum(a0, b0), tl.maximum(a1, b1))


@triton.jit
def _largest(keys, PICKS: tl.constexpr):
    """The PICKS (1 or 2) largest of the distinct keys [BLOCK_E] (-1 may repeat), descending, in one reduction."""
    if PICKS == 1:
        return (tl.max(keys, 0),)
    else:
        return tl.reduce((keys, tl.full(keys.shape, -1, tl.int64)), 0, _top2)


@triton.jit
def topk_row(
    x, lanes, valid, K: tl.constexpr, K_POW2: tl.constexpr, BLOCK_E: tl.constexpr, RENORMALISE: tl.constexpr,
    PICKS: tl.constexpr,
):  # fmt: skip
    """One row's (weights [K_POW2], ids [K_POW2]) from its fp32 logits x [BLOCK_E] (-inf where not `valid`), the picks
    taken PICKS at a time."""
    shifted = x - tl.max(x, 0)
    e = tl.exp(shifted.to(tl.float64)).to(tl.float32)
    p = tl.math.div_rn(e, pairwise_sum(e, BLOCK_E))
    keys = (p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | (BLOCK_E - 1 - lanes).to(tl.int64)
    keys = tl.where(valid, keys, -1)
    slots = tl.arange(0, K_POW2)
    picked_p = tl.zeros((K_POW2,), dtype=tl.float32)
    picked_id = tl.zeros((K_POW2,), dtype=tl.int32)
    total = tl.zeros((), dtype=tl.float32)
    for first in range(0, K, PICKS):  # a loop, not unrolled: the code stays one reduction's size whatever K is
        best = _largest(keys, PICKS)
        last = best[0]  # the smallest key taken in this reduction: picks past K (odd K) are not taken
        for i in tl.static_range(PICKS):
            best_p = (best[i] >> 32).to(tl.int32).to(tl.float32, bitcast=True)
            picked_p = tl.where(slots == first + i, best_p, picked_p)  # slots past K are never stored
            picked_id = tl.where(slots == first + i, BLOCK_E - 1 - (best[i] & 0xFFFFFFFF).to(tl.int32), picked_id)
            total = total + tl.where(first + i < K, best_p, 0.0)  # + +0.0 leaves the sum (>= +0) as it is
            if i > 0:
                last = tl.where(first + i < K, best[i], last)
        keys = tl.where(keys >= last, -1, keys)  # the keys just picked, being the largest
    if RENORMALISE:
        picked_p = tl.math.div_rn(picked_p, tl.zeros((K_POW2,), dtype=tl.float32) + total)
    return picked_p, picked_id


def router_warps(rows: int, block_e: int) -> int:
    """Warps of a row's program: a warp per 128 lanes up to WIDE_ROWS rows, per 512 beyond, 1 to 8."""
    return max(1, min(8, block_e // (128 if rows <= WIDE_ROWS else 512)))


@triton.jit
def _router_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    E,
    stride_row,
    K: tl.constexpr,
    K_POW2: tl.constexpr,
    BLOCK_E: tl.constexpr,
    RENORMALISE: tl.constexpr,
    PICKS: tl.constexpr,
    PDL: tl.constexpr,
):
    """One row: fp32 softmax over E lanes, then K picks of the largest (probability, lower id) key."""
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    lanes = tl.arange(0, BLOCK_E)
    valid = lanes < E
    x = tl.load(logits_ptr + row * stride_row + lanes, mask=valid, other=float("-inf")).to(tl.float32)
    picked_p, picked_id = topk_row(x, lanes, valid, K, K_POW2, BLOCK_E, RENORMALISE, PICKS)
    slots = tl.arange(0, K_POW2)
    out = row * K + slots
    tl.store(weights_ptr + out, picked_p, mask=slots < K)
    tl.store(ids_ptr + out, picked_id, mask=slots < K)


def router_topk(
    logits: torch.Tensor, k: int, renormalise: bool = True, picks: int = PICKS
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [N, k] fp32, ids [N, k] int32) of logits [N, E] in any float dtype, the picks taken `picks` (1 or 2) a
    reduction; see the module docstring."""
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"router_topk takes float logits [N, E], got {logits.dtype} {tuple(logits.shape)}")
    n, num_experts = logits.shape
    if not 0 < k <= num_experts:
        raise ValueError(f"router_topk needs 0 < k <= E, got k={k} with E={num_experts}")
    if picks not in (1, 2):
        raise ValueError(f"router_topk takes picks of 1 or 2, got {picks}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    weights = torch.empty(n, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(n, k, dtype=torch.int32, device=logits.device)
    if n == 0:
        return weights, ids
    block_e = triton.next_power_of_2(num_experts)
    _router_kernel[(n,)](
        logits,
        weights,
        ids,
        num_experts,
        logits.stride(0),
        K=k,
        K_POW2=triton.next_power_of_2(k),
        BLOCK_E=block_e,
        RENORMALISE=renormalise,
        PICKS=picks,
        num_warps=router_warps(n, block_e),
        enable_fp_fusion=False,
        **launch_options(_router_kernel, logits.device),
    )
    return weights, ids
