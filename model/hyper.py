"""Gated-residual hyper-connections: read a sub-block input from the wide residual, write its output back."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.config import FlashNextConfig
from model.ops import zc_rms_norm


class ZCRMSNorm(nn.Module):
    """Zero-centred RMSNorm holding its weight; `group` takes the RMS per group of features."""

    def __init__(self, dim: int, eps: float, group: int | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self.eps, self.group = eps, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return zc_rms_norm(x, self.weight, self.eps, self.group)


class Linear(nn.Module):
    """A bias-free projection; the loader fills its weight."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out_features, in_features), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class ConvWeight(nn.Module):
    """Holds a depthwise causal conv's taps [channels, 1, kernel] (the math lives in `ops.causal_conv`)."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(channels, 1, kernel), requires_grad=False)


def set_parameter(root: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Make `tensor` the parameter `name` under `root` (a parameter built on the meta device cannot take it as data)."""
    owner, _, attr = name.rpartition(".")
    root.get_submodule(owner)._parameters[attr] = nn.Parameter(tensor, requires_grad=False)


def linear(in_features: int, out_features: int) -> Linear:
    """A bias-free projection."""
    return Linear(in_features, out_features)


class GatedResidual(nn.Module):
    """One hyper-connection: norm the streams, gate and average them into the sub-block input."""

    def __init__(self, cfg: FlashNextConfig, inject: bool = True) -> None:
        super().__init__()
        self.hc, self.d = cfg.hc_count, cfg.hidden_size
        wide = cfg.wide_size
        self.hc_norm = ZCRMSNorm(wide, cfg.rms_norm_eps, group=cfg.hidden_size)
        self.input_mix_weight_down = linear(wide, cfg.hc_lowrank)
        self.input_mix_weight_up = linear(cfg.hc_lowrank, wide)
        self.block_inject_weight = linear(wide, cfg.hc_count) if inject else None

    def read(self, wide: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sub-block input [N, d] and the per-stream inject weights [N, hc] (None for the final mixer)."""
        normed = self.hc_norm(wide)
        mix = F.silu(self.input_mix_weight_down(normed) / self.hc)
        mix = torch.sigmoid(self.input_mix_weight_up(mix)).unflatten(-1, (self.hc, self.d))
        x = (mix * normed.unflatten(-1, (self.hc, self.d))).mean(dim=-2)
        if self.block_inject_weight is None:
            return x, None
        return x, 2 * torch.sigmoid(self.block_inject_weight(normed) / self.hc)

    @staticmethod
    def write(wide: torch.Tensor, y: torch.Tensor, inject: torch.Tensor) -> torch.Tensor:
        """Add the sub-block output y [N, d] to every stream, scaled by that stream's inject weight."""
        return wide + (y.unsqueeze(-2) * inject.unsqueeze(-1)).flatten(-2)
