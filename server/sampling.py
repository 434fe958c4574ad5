"""Token draws keyed by (seed, absolute position), so a row's token never depends on its batch, rank or device."""

from __future__ import annotations

import math

import torch

from kernels.sample import top_k_kept

MASK64 = (1 << 64) - 1
GOLDEN_GAMMA = 0x9E3779B97F4A7C15


def _mix64(z: int) -> int:
    """One splitmix64 step: advance the state by the golden gamma and scramble it into 64 well-mixed bits."""
    z = (z + GOLDEN_GAMMA) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


class SamplingParamError(ValueError):
    """A draw the request's own sampling parameters make fail; `param` names the request field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def draw_uniform(seed: int, position: int) -> float:
    """A uniform in [0, 1) from (seed, position), each taken modulo 2**64, in pure integer arithmetic."""
    z = _mix64(_mix64(seed & MASK64) ^ (position & MASK64))
    return (z >> 11) * 2.0**-53


def sample_token(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float, seed: int, position: int
) -> int:
    """Draw one token id from one row of logits [V]; greedy when temperature is 0."""
    if logits.dim() != 1:
        raise ValueError(f"sample_token takes one row of logits [V], got shape {tuple(logits.shape)}")
    bad = {
        "temperature": temperature < 0,
        "top_k": top_k < 0,
        "top_p": not 0 < top_p <= 1,
        "min_p": not 0 <= min_p <= 1,
    }
    wrong = [name for name, is_bad in bad.items() if is_bad]
    if wrong:
        raise SamplingParamError(f"bad sampling parameters: {temperature=} {top_k=} {top_p=} {min_p=}", wrong[0])
    row = logits.float()
    best = row.max()
    if not torch.isfinite(best):
        raise ValueError("logits need a finite maximum (NaN or +inf found, or every logit is -inf)")
    if temperature == 0:
        # Ties go to the lower id explicitly, as the router does, rather than relying on argmax's tie rule.
        return int(torch.nonzero(row == best)[0, 0])
    probs = torch.softmax(row / temperature, dim=-1)
    # A stable sort keeps equal probabilities in ascending id order, so tied candidates have one fixed order.
    sorted_probs, sorted_ids = torch.sort(probs, descending=True, stable=True)
    if not math.isfinite(sorted_probs[0].item()):
        raise SamplingParamError(f"temperature {temperature} overflows these logits", "temperature")
    keep = top_k_kept(sorted_probs, top_k)
    mass = sorted_probs[:keep].to(device="cpu", dtype=torch.float64)
    cdf = torch.cumsum(mass, dim=0)
    if min_p > 0:
        keep = min(keep, int(torch.count_nonzero(mass[:keep] >= min_p * mass[0].item())))
    if top_p < 1:
        # Mass is measured after top_k and min_p (vLLM's order), as if the dropped tokens had never been candidates.
        keep = min(keep, int(torch.searchsorted(cdf[:keep], top_p * cdf[keep - 1].item())) + 1)
    target = draw_uniform(seed, position) * cdf[keep - 1].item()
    index = min(int(torch.searchsorted(cdf[:keep], target, right=True)), keep - 1)
    return int(sorted_ids[index])
