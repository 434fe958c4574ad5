"""The MTP layer: from the trunk's pre-mixer wide state at t and the token t+1, logits for token t+2."""

from __future__ import annotations

import torch
from torch import nn

from model.config import QSA, FlashNextConfig
from model.hyper import GatedResidual, ZCRMSNorm, linear
from model.layers import DecoderLayer, ForwardBatch
from model.parallel import ShardPlan


class MTPLayer(nn.Module):
    """fc of the normed embedding plus fc of each normed stream, one QSA+MoE layer, its own mixer."""

    def __init__(self, cfg: FlashNextConfig, plan: ShardPlan) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.hc, self.d = cfg.hc_count, d
        self.fc_embedding = linear(d, d)
        self.fc_hidden = linear(d, d)
        self.pre_fc_norm_embedding = ZCRMSNorm(d, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = ZCRMSNorm(cfg.wide_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(cfg, plan, cfg.num_hidden_layers, QSA, None, mtp=True)])
        self.hyper_connection_mixer = GatedResidual(cfg, inject=False)

    def forward(self, next_embeds: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> tuple[torch.Tensor, ...]:
        """(mixed output [N, d] for the lm_head, the MTP's own pre-mixer wide state [N, wide] for chaining)."""
        u = self.fc_embedding(self.pre_fc_norm_embedding(next_embeds))
        streams = self.pre_fc_norm_hidden(hidden).unflatten(-1, (self.hc, self.d))
        wide = (self.fc_hidden(streams) + u.unsqueeze(-2)).flatten(-2)
        wide = self.layers[0](wide, batch)
        mixed, _ = self.hyper_connection_mixer.read(wide)
        return mixed, wide
