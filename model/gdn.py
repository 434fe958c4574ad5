"""Gated DeltaNet: the linear-attention mixer of three layers in four."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.config import FlashNextConfig
from model.hyper import ConvWeight, linear
from model.ops import causal_conv, gated_delta_rule, gated_rms_norm
from model.parallel import ShardPlan


class GatedDeltaNet(nn.Module):
    """Projections, causal conv, gated delta recurrence (fp32 state) and the gated output norm, on this rank's
    heads; the output projection's partial sums are combined across ranks."""

    def __init__(self, cfg: FlashNextConfig, plan: ShardPlan) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.tp = plan.tp
        self.key_heads, self.value_heads = plan.gdn_key_heads, plan.gdn_value_heads
        if self.value_heads % self.key_heads:
            raise ValueError("linear_num_value_heads: a rank's value heads must share whole key heads")
        self.key_dim, self.value_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.qk_width = self.key_heads * self.key_dim
        self.v_width = self.value_heads * self.value_dim
        conv_dim = 2 * self.qk_width + self.v_width
        self.eps, self.gate_act = cfg.rms_norm_eps, cfg.output_gate_type
        self.in_proj_qkv = linear(d, conv_dim)
        self.in_proj_z = linear(d, self.v_width)
        self.in_proj_b = linear(d, self.value_heads)
        self.in_proj_a = linear(d, self.value_heads)
        self.conv1d = ConvWeight(conv_dim, cfg.linear_conv_kernel_dim)
        self.A_log = nn.Parameter(torch.zeros(self.value_heads), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.ones(self.value_heads), requires_grad=False)
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.value_dim), requires_grad=False)
        self.out_proj = linear(self.v_width, d)

    def new_state(self, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed (conv tail [K-1, conv_dim] of pre-conv rows, recurrent state [Hv, Dk, Dv] fp32)."""
        conv_dim, kernel = self.conv1d.weight.shape[0], self.conv1d.weight.shape[-1]
        tail = torch.zeros(kernel - 1, conv_dim, dtype=dtype, device=device)
        return tail, torch.zeros(self.value_heads, self.key_dim, self.value_dim, dtype=torch.float32, device=device)

    def forward(
        self, x: torch.Tensor, tail: torch.Tensor, state: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One lane's rows x [T, d] -> (output [T, d], new conv tail, new recurrent state)."""
        seq = x.shape[0]
        qkv, tail = causal_conv(self.in_proj_qkv(x), tail, self.conv1d.weight)
        qkv = F.silu(qkv)
        q, k, v = qkv.split([self.qk_width, self.qk_width, self.v_width], dim=-1)
        repeat = self.value_heads // self.key_heads
        q = q.reshape(seq, self.key_heads, self.key_dim).repeat_interleave(repeat, dim=1)
        k = k.reshape(seq, self.key_heads, self.key_dim).repeat_interleave(repeat, dim=1)
        v = v.reshape(seq, self.value_heads, self.value_dim)
        beta = torch.sigmoid(self.in_proj_b(x))
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        out, state = gated_delta_rule(q, k, v, g, beta, state)
        z = self.in_proj_z(x).reshape(seq, self.value_heads, self.value_dim)
        out = gated_rms_norm(out.to(x.dtype), z, self.norm.weight, self.eps, self.gate_act)
        return self.tp.combine(self.out_proj(out.reshape(seq, self.v_width))), tail, state
