"""The sparse MoE: fp32 softmax router with top-k, routed SwiGLU experts, and the gated shared expert."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.fp4_words import from_words, natural_scales
from model.config import FlashNextConfig
from model.hyper import linear
from model.ops import swiglu
from model.parallel import ShardPlan
from model.quant import dequantize_nvfp4


class ExpertBank(nn.Module):
    """Routed experts' weights, dense ([E, 2I, d] gate rows then up rows; [E, d, I]) or NVFP4-packed."""

    def __init__(self, cfg: FlashNextConfig, width: int) -> None:
        super().__init__()
        e, d, i = cfg.num_experts, cfg.hidden_size, width
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, d), requires_grad=False)
        self.down_proj = nn.Parameter(torch.zeros(e, d, i), requires_grad=False)
        self.nvfp4: dict[str, torch.Tensor] | None = None
        self.dequantized: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def use_nvfp4(self, tensors: dict[str, torch.Tensor]) -> None:
        """Hold NVFP4 weights: `{gate_up,down}_{packed,scale,scale_2}` (scale_2 [E, 2] for gate/up, [E] for down), or
        `_words` in the MoE kernels' layout for `_packed`."""
        self.nvfp4 = tensors
        self.gate_up_proj = None
        self.down_proj = None

    def expert(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (gate_up [2I, d], down [d, I]) in the compute dtype; NVFP4 dequantized by the formula (on the
        CPU once per expert and kept, since dequantizing dominated a decode step there)."""
        if self.nvfp4 is None:
            return self.gate_up_proj[e].to(dtype), self.down_proj[e].to(dtype)
        if (e, dtype) in self.dequantized:
            return self.dequantized[e, dtype]
        weights = self._dequantize(e, dtype)
        if weights[0].device.type == "cpu":
            self.dequantized[e, dtype] = weights
        return weights

    def _dequantize(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's NVFP4 weights as dense (gate_up, down) in `dtype`."""
        w = self.nvfp4
        gate_up_scale, down_scale = w["gate_up_scale"][e], w["down_scale"][e]
        if "gate_up_words" in w:  # the MoE kernels' layout: back to the checkpoint's
            gate_up_codes, down_codes = from_words(w["gate_up_words"][e]), from_words(w["down_words"][e])
            gate_up_scale, down_scale = natural_scales(gate_up_scale), natural_scales(down_scale)
        else:
            gate_up_codes, down_codes = w["gate_up_packed"][e], w["down_packed"][e]
        half = gate_up_codes.shape[0] // 2
        gate = dequantize_nvfp4(gate_up_codes[:half], gate_up_scale[:half], w["gate_up_scale_2"][e, 0])
        up = dequantize_nvfp4(gate_up_codes[half:], gate_up_scale[half:], w["gate_up_scale_2"][e, 1])
        down = dequantize_nvfp4(down_codes, down_scale, w["down_scale_2"][e])
        return torch.cat((gate, up)).to(dtype), down.to(dtype)


class SharedExpert(nn.Module):
    """The always-on SwiGLU expert."""

    def __init__(self, d: int, width: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = linear(d, width), linear(d, width), linear(width, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Softmax over expert logits in fp32, top-k with ties to the lower expert id, renormalised."""

    def __init__(self, cfg: FlashNextConfig) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.num_experts, cfg.hidden_size), requires_grad=False)
        self.top_k, self.renormalise = cfg.num_experts_per_tok, cfg.norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [N, k] in x's dtype, expert ids [N, k])."""
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits.float(), dim=-1)
        order = torch.sort(probs, dim=-1, descending=True, stable=True)
        weights, ids = order.values[:, : self.top_k], order.indices[:, : self.top_k]
        if self.renormalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), ids


class SparseMoE(nn.Module):
    """Routed experts plus the sigmoid-gated shared expert (checkpoint module `mlp`), each on this rank's share
    of the intermediate width; the router is replicated and the partial outputs are combined once."""

    def __init__(self, cfg: FlashNextConfig, plan: ShardPlan) -> None:
        super().__init__()
        self.tp = plan.tp
        self.gate = Router(cfg)
        self.experts = ExpertBank(cfg, plan.expert_cols[1] - plan.expert_cols[0])
        self.shared_expert = SharedExpert(cfg.hidden_size, plan.shared_cols[1] - plan.shared_cols[0])
        self.shared_expert_gate = linear(cfg.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Rows x [N, d] -> [N, d]; each row's expert sum runs in ascending expert id, whatever the batch."""
        shared = self.shared_expert(x)
        weights, ids = self.gate(x)
        routed = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # summed in fp32, rounded once
        for e in torch.unique(ids).tolist():
            rows, slot = torch.where(ids == e)
            gate_up, down = self.experts.expert(e, x.dtype)
            out = swiglu(x[rows], gate_up, down) * weights[rows, slot, None]
            routed[rows] = routed[rows] + out.to(x.dtype).float()  # a row meets each expert at most once
        return self.tp.combine(routed.to(x.dtype) + torch.sigmoid(self.shared_expert_gate(x)) * shared)
