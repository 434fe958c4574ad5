"""Batched keyed token draws: each row gets exactly the token `server.sampling.sample_token` gives it alone.

`sample_rows(logits [N, V], temperature, top_k, top_p, min_p, seed, position)` returns tokens [N] int64, where row i
equals `sample_token(logits[i], float(temperature[i]), int(top_k[i]), float(top_p[i]), float(min_p[i]), int(seed[i]),
int(position[i]))` run on the same device, and -1 where that call would raise. Pass top_p, min_p and temperature as
float64 to carry a request's exact values (float32 tensors stand for the doubles they round to).

How each row stays identical to the one-row call:
- The scaled logits and the probabilities come from the same torch ops on the same device: fp32 logits divided by the
  fp32-rounded temperature, as torch divides by a Python float (on CUDA that is a multiply by the fp32 reciprocal,
  on the CPU a true division), then torch's softmax over the row, whose per-row kernel depends on V only (on CUDA
  a row must start 16-byte aligned as a fresh tensor does: for V not a multiple of 4 each row is copied alone).
- Candidates come from torch's stable descending sort: probability descending, token id ascending.
- The kernel (one program per row) re-does the host's fp64 work bit for bit. The cumulative sum over the kept
  candidates must equal torch's sequential left-to-right fp64 `cumsum`; `_scan_row` computes exactly that sequence
  in chunks: each chunk's first element is added by a plain fp64 add; for the rest, while the running sum S stays in
  one binade [2^c, 2^(c+1)) every fp64 add rounds to the grid u = 2^(c-52), so S/u advances by each addend rounded
  to a multiple of u, which depends on the addend alone except at exact halves, where round-half-even depends on
  the parity of S/u. Each element is therefore a map on that parity (two integer increments), maps compose
  associatively, and a parallel scan over them gives every S exactly; the chunk stops at the first element whose
  sum leaves the binade (a result rounded up onto 2^(c+1) is still exact) and the next chunk restarts there.
- min_p's cut, top_p's cut and the inverse-CDF pick, in that order (vLLM's: top_p measures the mass min_p and top_k
  leave), are binary searches over those exact sums (and the sorted fp32 probabilities) with the same fp64 products
  as the host: min_p · p[0], top_p · cdf[keep1-1], u · cdf[keep-1].
- The uniform is splitmix64 of (seed, position) in 64-bit unsigned integer arithmetic, as `draw_uniform`.
Greedy rows (temperature 0) take the first maximal id. A greedy round whose parameters are on the host (as the runner
passes them) is one launch: `greedy_tokens`, one program per row keeping each lane's first maximum over the row.

Work per call: torch's scaled softmax and stable sort of the rows that may draw (every row whose temperature is not
0 when the temperatures are on the host; every row when they are on the device, whose values the host cannot see
without waiting), then one program per such row whose scan covers the row's top_k candidates (all V when top_k is 0:
about V / SCAN_BLOCK chunks one after another) into an fp64 scratch [rows, V]; the searches are O(log V) loads. A
greedy round sorts nothing.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from kernels.host import to_device
from kernels.pdl import enter, launch_options

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
SCAN_BLOCK = 64 if INTERPRET else 4096  # small under the interpreter, so tests cross many chunks
SCAN_WARPS = 8
GREEDY_BLOCK = 64 if INTERPRET else 8192  # logits a greedy program compares at once (gpu_sweep_greedy.py)
GREEDY_WARPS = 32
MASK64 = (1 << 64) - 1
GOLDEN_GAMMA = 0x9E3779B97F4A7C15
MODE_INVALID, MODE_GREEDY, MODE_SAMPLE = 0, 1, 2


def _mix64_reference(z: int) -> int:
    """One splitmix64 step on a Python int modulo 2**64."""
    z = (z + GOLDEN_GAMMA) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def draw_uniform_reference(seed: int, position: int) -> float:
    """The uniform in [0, 1) keyed by (seed, position), each modulo 2**64."""
    z = _mix64_reference(_mix64_reference(seed & MASK64) ^ (position & MASK64))
    return (z >> 11) * 2.0**-53


def sequential_cumsum_reference(values: torch.Tensor) -> torch.Tensor:
    """fp64 running sums of each row, left to right, by torch's sequential CPU cumsum."""
    return torch.cumsum(values.double().cpu(), dim=-1).to(values.device)


def top_k_kept(sorted_probs: torch.Tensor, top_k: int) -> int:
    """How many of a row's sorted probabilities top_k keeps: the first top_k and every one tied with the last of
    them (vLLM keeps each logit not below the k-th); all where top_k is 0 or covers the row."""
    if not 0 < top_k < sorted_probs.numel():
        return sorted_probs.numel()
    return int(torch.count_nonzero(sorted_probs >= sorted_probs[top_k - 1]))


def sample_row_reference(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float, seed: int, position: int
) -> int:
    """One row [V] drawn with torch ops and host fp64 sums; -1 where the parameters or logits are refused."""
    if temperature < 0 or top_k < 0 or not 0 < top_p <= 1 or not 0 <= min_p <= 1:
        return -1
    row = logits.float()
    best = row.max()
    if not torch.isfinite(best):
        return -1
    if temperature == 0:
        return int(torch.nonzero(row == best)[0, 0])
    sorted_probs, sorted_ids = torch.sort(torch.softmax(row / temperature, dim=-1), descending=True, stable=True)
    if not math.isfinite(sorted_probs[0].item()):
        return -1
    keep = top_k_kept(sorted_probs, top_k)
    mass = sorted_probs[:keep].to(device="cpu", dtype=torch.float64)
    cdf = torch.cumsum(mass, dim=0)
    if min_p > 0:
        keep = min(keep, int(torch.count_nonzero(mass[:keep] >= min_p * mass[0].item())))
    if top_p < 1:
        keep = min(keep, int(torch.searchsorted(cdf[:keep], top_p * cdf[keep - 1].item())) + 1)
    target = draw_uniform_reference(seed, position) * cdf[keep - 1].item()
    return int(sorted_ids[min(int(torch.searchsorted(cdf[:keep], target, right=True)), keep - 1)])


def sample_rows_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seed: torch.Tensor,
    position: torch.Tensor,
) -> torch.Tensor:
    """tokens [N] int64 by `sample_row_reference` on each row alone."""
    columns = (temperature, top_k, top_p, min_p, seed, position)
    params = zip(*(c.tolist() for c in columns), strict=True)
    return torch.tensor(
        [sample_row_reference(row, *p) for row, p in zip(logits, params, strict=True)], dtype=torch.int64
    )


@triton.jit
def _mix64(z):
    """One splitmix64 step on uint64 (wrapping arithmetic, logical shifts)."""
    z = z + 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _draw(seed, position):
    """The uniform in [0, 1) keyed by int64 (seed, position), bit-identical to `draw_uniform`."""
    z = _mix64(_mix64(seed.to(tl.uint64, bitcast=True)) ^ position.to(tl.uint64, bitcast=True))
    return (z >> 11).to(tl.float64) * (1.0 / 9007199254740992.0)


@triton.jit
def _compose(l0, l1, r0, r1):
    """Parity maps (increment for an even start, for an odd start): left, then right; saturated at 2**54."""
    n0 = tl.minimum(l0 + tl.where((l0 & 1) == 0, r0, r1), 0x40000000000000)
    n1 = tl.minimum(l1 + tl.where((l1 & 1) == 0, r1, r0), 0x40000000000000)
    return n0, n1


@triton.jit
def _scan_row(src, dst, n, BLOCK: tl.constexpr):
    """dst[j] = fp64 sum of src[0..j] (nonnegative fp32) added left to right; returns dst[n-1] (0 when n is 0)."""
    offs = tl.arange(0, BLOCK)
    start = 0
    total = tl.zeros((), dtype=tl.float64)
    while start < n:
        total = total + tl.load(src + start).to(tl.float64)  # the chunk's first add, as the host does it
        tl.store(dst + start, total)
        # total in [2^c, 2^(c+1)) has the ulp u = 2^(c-52) (biased exponent ulp_biased); s0 = total / u < 2^53
        tbits = total.to(tl.int64, bitcast=True)
        s0 = (tbits & 0xFFFFFFFFFFFFF) | 0x10000000000000
        ulp_biased = tl.maximum(((tbits >> 52) & 0x7FF) - 52, 1)  # kept a finite ulp while total is 0
        # each next addend mant * 2^e as q whole ulps (saturated past 2^53), plus its remainder against half an ulp
        j = start + 1 + offs
        inside = j < n
        bits = tl.load(src + j, mask=inside, other=0.0).to(tl.int32, bitcast=True).to(tl.int64)
        biased = (bits >> 23) & 0xFF
        mant = tl.where(biased == 0, bits & 0x7FFFFF, (bits & 0x7FFFFF) | 0x800000)
        shift = ulp_biased - 1023 - tl.where(biased == 0, -149, biased - 150)
        left = tl.minimum(tl.maximum(-shift, 0), 62)
        right = tl.minimum(tl.maximum(shift, 1), 40)
        rem = mant & ((1 << right) - 1)
        half = 1 << (right - 1)
        exact = shift <= 0
        q = tl.where(exact, tl.where(mant > (0x20000000000000 >> left), 0x20000000000001, mant << left), mant >> right)
        up = tl.where(exact, 0, (rem > half).to(tl.int64))
        tie = tl.where(exact, 0, (rem == half).to(tl.int64))
        # S/u after each add from an even or an odd start; exact while the sum stays below 2^(c+1), i.e. s <= 2^53
        inc_even, inc_odd = tl.associative_scan((q + up + (tie & q), q + up + (tie & (q + 1))), 0, _compose)
        s = s0 + tl.where((s0 & 1) == 0, inc_even, inc_odd)
        ok = inside & (s <= tl.where(total > 0, 0x20000000000000, -1))
        sums = s.to(tl.float64) * (ulp_biased << 52).to(tl.float64, bitcast=True)
        tl.store(dst + j, sums, mask=ok)
        count = tl.sum(ok.to(tl.int32), 0)
        total = tl.where(count > 0, tl.max(tl.where(ok, sums, 0.0), 0), total)
        start = start + 1 + count
    return total


@triton.jit
def _leading(ptr, n, bound, MODE: tl.constexpr):
    """Length of the prefix of the monotone ptr[0:n] with x < bound (MODE 0), x <= bound (1) or x >= bound (2)."""
    lo = 0
    hi = n
    while lo < hi:
        mid = (lo + hi) // 2
        x = tl.load(ptr + mid).to(tl.float64)
        if MODE == 0:
            go = x < bound
        elif MODE == 1:
            go = x <= bound
        else:
            go = x >= bound
        lo = tl.where(go, mid + 1, lo)
        hi = tl.where(go, hi, mid)
    return lo


@triton.jit
def _cumsum_kernel(src_ptr, dst_ptr, n, stride_src, stride_dst, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One row of `sequential_cumsum`."""
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    _scan_row(src_ptr + row * stride_src, dst_ptr + row * stride_dst, n, BLOCK)


@triton.jit
def _sample_kernel(
    probs_ptr,
    ids_ptr,
    cdf_ptr,
    mode_ptr,
    top_k_ptr,
    top_p_ptr,
    min_p_ptr,
    seed_ptr,
    position_ptr,
    tokens_ptr,
    V,
    stride_probs,
    stride_ids,
    stride_cdf,
    SAMPLE: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """One sampled row over its sorted probabilities: exact fp64 cdf, top_k (with its ties), min_p and top_p cuts,
    keyed pick."""
    enter(PDL)
    row = tl.program_id(0)
    probs = probs_ptr + row.to(tl.int64) * stride_probs
    cdf = cdf_ptr + row.to(tl.int64) * stride_cdf
    first = tl.load(probs)
    if tl.load(mode_ptr + row) == SAMPLE:
        if first < float("inf"):
            top_k = tl.load(top_k_ptr + row)
            keep = tl.where(top_k > 0, tl.minimum(top_k, V), V).to(tl.int32)
            if keep < V:  # and every probability tied with the k-th
                keep = _leading(probs, V, tl.load(probs + keep - 1).to(tl.float64), 2).to(tl.int32)
            _scan_row(probs, cdf, keep, BLOCK)
            tl.debug_barrier()  # the searches below read sums other threads of this program stored
            min_p = tl.load(min_p_ptr + row)
            if min_p > 0:
                keep = tl.minimum(keep, _leading(probs, keep, min_p * first.to(tl.float64), 2))
            top_p = tl.load(top_p_ptr + row)
            if top_p < 1:
                keep = tl.minimum(keep, _leading(cdf, keep, top_p * tl.load(cdf + keep - 1), 0) + 1)
            target = _draw(tl.load(seed_ptr + row), tl.load(position_ptr + row)) * tl.load(cdf + keep - 1)
            index = tl.minimum(_leading(cdf, keep, target, 1), keep - 1)
            tl.store(tokens_ptr + row, tl.load(ids_ptr + row.to(tl.int64) * stride_ids + index))
        else:
            tl.store(tokens_ptr + row, -1)


@triton.jit
def _uniform_kernel(seed_ptr, position_ptr, out_ptr, PDL: tl.constexpr):
    """One keyed uniform."""
    enter(PDL)
    i = tl.program_id(0)
    tl.store(out_ptr + i, _draw(tl.load(seed_ptr + i), tl.load(position_ptr + i)))


def sequential_cumsum(values: torch.Tensor) -> torch.Tensor:
    """fp64 running sums [N, L] of nonnegative fp32 rows [N, L], bit-identical to adding left to right in fp64."""
    values = values.float().contiguous()
    out = torch.empty(values.shape, dtype=torch.float64, device=values.device)
    if values.numel():
        _cumsum_kernel[(values.shape[0],)](
            values,
            out,
            values.shape[1],
            values.stride(0),
            out.stride(0),
            BLOCK=SCAN_BLOCK,
            num_warps=SCAN_WARPS,
            enable_fp_fusion=False,
            **launch_options(_cumsum_kernel, values.device),
        )
    return out


def draw_uniforms(seed: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """fp64 uniforms [N] keyed by int64 (seed, position) [N], as `draw_uniform` on each pair."""
    seed = seed.to(torch.int64).contiguous()
    position = position.to(device=seed.device, dtype=torch.int64).contiguous()
    out = torch.empty(seed.shape, dtype=torch.float64, device=seed.device)
    if seed.numel():
        _uniform_kernel[(seed.numel(),)](seed, position, out, **launch_options(_uniform_kernel, seed.device))
    return out


def scaled_softmax(x: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Probabilities [N, V] fp32 of fp32 logits x [N, V] at fp64 temperatures [N], each row as `sample_token` forms
    it alone on this device: torch's softmax of x divided by the fp32-rounded temperature (rows at 0 divided by 1)."""
    t32 = torch.where(temperature == 0, 1.0, temperature).to(torch.float32)[:, None]
    scaled = x * torch.reciprocal(t32) if x.is_cuda else x / t32
    if x.is_cuda and x.shape[1] % 4:
        return torch.stack([torch.softmax(row.clone(), dim=-1) for row in scaled])
    return torch.softmax(scaled, dim=-1)


@triton.jit(do_not_specialize=["V"])
def _greedy_kernel(x_ptr, out_ptr, V, stride_x, BLOCK: tl.constexpr, REFUSE: tl.constexpr, PDL: tl.constexpr):
    """One program per row: the first id of the row's maximum; where the row holds a NaN or no finite maximum, -1
    with REFUSE, else torch.argmax's id (the first NaN's, or the first of the infinite maximum)."""
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    best = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    best_at = tl.zeros((BLOCK,), dtype=tl.int32)
    nan_at = tl.full((BLOCK,), V, dtype=tl.int32)  # each lane's first NaN (V: none)
    for start in tl.range(0, V, BLOCK):
        at = start + offs
        x = tl.load(x_ptr + row * stride_x + at, mask=at < V, other=float("-inf")).to(tl.float32)
        nan_at = tl.where((x != x) & (nan_at == V), at, nan_at)
        take = x > best  # strictly greater: a lane keeps its first maximum
        best = tl.where(take, x, best)
        best_at = tl.where(take, at, best_at)
    top = tl.max(best, axis=0)
    first = tl.min(tl.where(best == top, best_at, V), axis=0)  # the lowest id among the lanes holding the maximum
    first_nan = tl.min(nan_at, axis=0)
    if REFUSE:
        finite = (top < float("inf")) & (top > float("-inf")) & (first_nan == V)
        token = tl.where(finite, first, -1)
    else:
        token = tl.where(first_nan < V, first_nan, first)
    tl.store(out_ptr + row, token.to(tl.int64))


def greedy_tokens(
    logits: torch.Tensor, block: int = GREEDY_BLOCK, warps: int = GREEDY_WARPS, refuse: bool = True
) -> torch.Tensor:
    """tokens [N] int64 of logits [N, V] (any float dtype): each row's first maximal id; where the row holds a NaN or
    its maximum is not finite, -1 (where `sample_token` at temperature 0 raises), or with `refuse` off torch.argmax's
    id of the fp32 row (`argmax_tokens`). The tile (`block` logits at once over `warps` warps) changes no result."""
    if logits.dim() != 2 or logits.shape[1] == 0 or logits.stride(1) != 1:
        raise ValueError(f"greedy_tokens takes logits [N, V] with V > 0 contiguous, got shape {tuple(logits.shape)}")
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    if logits.shape[0]:
        _greedy_kernel[(logits.shape[0],)](
            logits,
            out,
            logits.shape[1],
            logits.stride(0),
            BLOCK=block,
            REFUSE=refuse,
            num_warps=warps,
            **launch_options(_greedy_kernel, logits.device),
        )
    return out


def argmax_tokens(logits: torch.Tensor) -> torch.Tensor:
    """torch.argmax of each fp32 row of logits [N, V] in one launch, on the logits' device (no host copy): the first
    maximal id, or the first NaN's where a row holds one."""
    return greedy_tokens(logits, refuse=False)


def greedy_tokens_reference(logits: torch.Tensor) -> torch.Tensor:
    """Plain-PyTorch `greedy_tokens`: torch's argmax of the fp32 rows where their maximum is finite, else -1."""
    x = logits.float()
    return torch.where(torch.isfinite(x.amax(dim=-1)), torch.argmax(x, dim=-1), -1)


def valid_parameters(
    temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Rows whose parameters `sample_token` accepts (on the parameters' device)."""
    t64, k64 = temperature.to(torch.float64), top_k.to(torch.int64)
    p64, m64 = top_p.to(torch.float64), min_p.to(torch.float64)
    return (t64 >= 0) & (k64 >= 0) & (p64 > 0) & (p64 <= 1) & (m64 >= 0) & (m64 <= 1)


def _drawn_rows(temperature: torch.Tensor, n: int, device: torch.device) -> torch.Tensor | None:
    """Indices on `device` of the rows that may draw (temperature not 0), found without a device sync when the
    temperatures are on the host (every row otherwise); None when none may."""
    if temperature.device.type != "cpu":
        return torch.arange(n, device=device) if n else None
    rows = torch.nonzero(temperature.to(torch.float64) != 0).flatten()
    return to_device(device, rows, torch.long) if rows.numel() else None


def sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seed: torch.Tensor,
    position: torch.Tensor,
) -> torch.Tensor:
    """tokens [N] int64 for logits [N, V] and per-row parameters [N]: row i is `sample_token` of row i, -1 where it
    would raise (bad parameters, no finite maximum, a temperature that overflows)."""
    if logits.dim() != 2:
        raise ValueError(f"sample_rows takes logits [N, V], got shape {tuple(logits.shape)}")
    n, vocab = logits.shape
    dev = logits.device
    if vocab == 0:
        raise ValueError("sample_rows needs at least one logit per row")
    params = (temperature, top_k, top_p, min_p)
    if any(t.shape != (n,) for t in (*params, seed, position)):
        raise ValueError(f"sample_rows: every parameter needs one value per row ({n})")
    if all(t.device.type == "cpu" for t in params) and not temperature.any():  # a greedy round: one launch
        tokens, valid = greedy_tokens(logits.contiguous()), valid_parameters(*params)
        return tokens if valid.all() else torch.where(to_device(dev, valid, torch.bool), tokens, -1)
    # host parameters reach the device without waiting for it (a round may be launched while the one before runs)
    t64 = to_device(dev, temperature, torch.float64)
    k64 = to_device(dev, top_k, torch.int64).contiguous()
    p64 = to_device(dev, top_p, torch.float64).contiguous()
    m64 = to_device(dev, min_p, torch.float64).contiguous()
    x = logits.float()
    valid = valid_parameters(t64, k64, p64, m64) & torch.isfinite(x.amax(dim=-1))
    greedy = t64 == 0
    tokens = torch.where(valid & greedy, torch.argmax(x, dim=-1), -1)
    drawn = _drawn_rows(temperature, n, dev)
    if drawn is None:
        return tokens
    if drawn.numel() < n:  # each row's softmax and sort are its own: the other rows' absence changes no bits
        x, t64, k64, p64, m64 = (v.index_select(0, drawn) for v in (x, t64, k64, p64, m64))
        valid, greedy = valid.index_select(0, drawn), greedy.index_select(0, drawn)
        seed, position = (to_device(dev, v, torch.int64).index_select(0, drawn) for v in (seed, position))
    sorted_probs, sorted_ids = torch.sort(scaled_softmax(x, t64), dim=-1, descending=True, stable=True)
    mode = torch.where(valid, torch.where(greedy, MODE_GREEDY, MODE_SAMPLE), MODE_INVALID).to(torch.int32)
    picked = tokens if drawn.numel() == n else tokens.index_select(0, drawn)  # the kernel fills the sampled rows
    cdf = torch.empty(x.shape[0], vocab, dtype=torch.float64, device=dev)
    _sample_kernel[(x.shape[0],)](
        sorted_probs,
        sorted_ids,
        cdf,
        mode,
        k64,
        p64,
        m64,
        to_device(dev, seed, torch.int64).contiguous(),
        to_device(dev, position, torch.int64).contiguous(),
        picked,
        vocab,
        sorted_probs.stride(0),
        sorted_ids.stride(0),
        cdf.stride(0),
        SAMPLE=MODE_SAMPLE,
        BLOCK=SCAN_BLOCK,
        num_warps=SCAN_WARPS,
        enable_fp_fusion=False,
        **launch_options(_sample_kernel, sorted_probs.device),
    )
    return picked if drawn.numel() == n else tokens.index_copy(0, drawn, picked)
