"""Reference math primitives of the Flash Next forward, in plain PyTorch (the seams where kernels plug in)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def zc_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, group: int | None = None) -> torch.Tensor:
    """Zero-centred RMSNorm `x * rsqrt(mean(x^2) + eps) * (1 + w)` in fp32, RMS per `group` features if given."""
    xf = x.float()
    if group is not None:
        xf = xf.unflatten(-1, (-1, group))
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if group is not None:
        out = out.flatten(-2)
    return (out * (1.0 + weight.float())).type_as(x)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, act: str) -> torch.Tensor:
    """GDN output norm: ones-centred RMSNorm of `x`, then times `act(gate)`, rounded to x's dtype."""
    dtype = x.dtype
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * normed.to(dtype)
    gate_f = gate.float()
    out = out * (torch.sigmoid(gate_f) if act == "sigmoid" else F.silu(gate_f))
    return out.to(dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Scale the last dim to unit L2 norm (`sum`, not mean)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def rope_cos_sin(
    positions: torch.Tensor, rotary_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [N, rotary_dim] for absolute positions (text rows: all mRoPE axes agree)."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float, device=positions.device) / rotary_dim)
    )
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary dims of x [N, H, D] (rotate-half pairing); cos/sin are [N, rotary]."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    x_rot = x_rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat((x_rot, x_pass), dim=-1)


def causal_conv(
    x: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor, dilation: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv of x [T, C] after the kept tail [S, C], taps summed oldest first in fp32 and rounded
    once to x's dtype, as transformers' conv1d rounds; (out, new tail)."""
    seq, kernel = x.shape[0], weight.shape[-1]
    full = torch.cat((tail.to(x.dtype), x))
    wide, taps = full.float(), weight[:, 0, :].transpose(0, 1).float()
    offset = full.shape[0] - seq - (kernel - 1) * dilation
    out = wide[offset : offset + seq] * taps[0]
    for k in range(1, kernel):
        start = offset + k * dilation
        out = out + wide[start : start + seq] * taps[k]
    return out.to(x.dtype), full[full.shape[0] - tail.shape[0] :].clone()


def gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule, one row at a time in fp32: q,k [T,H,Dk], v [T,H,Dv], g,beta [T,H], state [H,Dk,Dv]."""
    q = l2norm(q.float()) / (q.shape[-1] ** 0.5)
    k = l2norm(k.float())
    v, g, beta = v.float(), g.float(), beta.float()
    s = state.float()
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        kv_mem = (s * k[t][:, :, None]).sum(-2)
        delta = (v[t] - kv_mem) * beta[t][:, None]
        s = s + k[t][:, :, None] * delta[:, None, :]
        out[t] = (s * q[t][:, :, None]).sum(-2)
    return out, s


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, ends: torch.Tensor
) -> torch.Tensor:
    """Row t of q [T,H,D] attends keys k,v [L,Hkv,D] up to ends[t] where mask [T,L] is set; fp32 softmax.

    Each row runs alone over exactly its visible keys, so its bits do not depend on the chunk it came in."""
    groups = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for t in range(q.shape[0]):
        end = int(ends[t])
        keys = k[:end].repeat_interleave(groups, dim=1)
        values = v[:end].repeat_interleave(groups, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[t], keys) * scale
        scores = scores.float().masked_fill(~mask[t, :end][None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out[t] = torch.einsum("hl,lhd->hd", probs, values)
    return out


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate x) * up x) with gate_up = [gate rows; up rows]."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, down)
