"""Qwen Sparse Attention: GQA attention over the key blocks its indexer selects, plus the always-kept tail."""

from __future__ import annotations

import math

import torch
from torch import nn

from model.config import FlashNextConfig
from model.hyper import ZCRMSNorm, linear
from model.ops import apply_rope, masked_attention, rope_cos_sin, zc_rms_norm
from model.parallel import ShardPlan
from model.state import AttentionCache


class QSAIndexer(nn.Module):
    """Scores mean-pooled blocks of raw index keys against per-row index queries and picks the top blocks."""

    def __init__(self, cfg: FlashNextConfig) -> None:
        super().__init__()
        self.heads, self.dim = cfg.indexer_n_heads, cfg.indexer_head_dim
        self.ratio, self.top_blocks = cfg.indexer_compress_ratio, cfg.indexer_block_topk
        self.index_qk_proj = linear(cfg.hidden_size, (self.heads + 1) * self.dim)
        self.q_layernorm = ZCRMSNorm(self.dim, cfg.rms_norm_eps)
        self.k_layernorm = ZCRMSNorm(self.dim, cfg.rms_norm_eps)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Index queries [T, heads, dim] (normed, RoPE'd) and raw index keys [T, dim] (kept un-normed)."""
        q, raw = self.index_qk_proj(x).split([self.heads * self.dim, self.dim], dim=-1)
        q = apply_rope(self.q_layernorm(q.unflatten(-1, (self.heads, self.dim))), cos, sin)
        return q, raw

    def block_keys(self, raw: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
        """Keys of the complete blocks among raw keys [L, dim]: mean in fp32, norm, RoPE at the block's start."""
        blocks = raw.shape[0] // self.ratio
        pooled = raw[: blocks * self.ratio].unflatten(0, (blocks, self.ratio)).float().mean(1).to(raw.dtype)
        pooled = self.k_layernorm(pooled)
        starts = torch.arange(blocks, device=raw.device) * self.ratio
        cos, sin = rope_cos_sin(starts, rotary_dim, theta, raw.dtype)
        return apply_rope(pooled.unsqueeze(1), cos, sin).squeeze(1)

    def select(self, q: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, length: int) -> torch.Tensor:
        """Mask [T, length] of the keys each row attends: its top blocks (ties to the lower block) and its tail."""
        blocks = keys.shape[0]
        ends = positions + 1
        complete = (torch.arange(blocks, device=q.device)[None, :] + 1) * self.ratio <= ends[:, None]
        chosen = complete.clone()
        for t, end in enumerate(ends.tolist()):
            visible = end // self.ratio
            if visible > self.top_blocks:
                scores = (q[t].float() @ keys[:visible].float().T).relu().sum(0) / math.sqrt(self.dim)
                top = torch.sort(scores, descending=True, stable=True).indices[: self.top_blocks]
                chosen[t] = False
                chosen[t, top] = True
        chosen = torch.cat((chosen, chosen.new_zeros(chosen.shape[0], 1)), dim=-1)
        token = torch.arange(length, device=q.device)
        block_of = (token // self.ratio).clamp_max(blocks)
        tail = token[None, :] >= (ends // self.ratio * self.ratio)[:, None]
        visible = token[None, :] < ends[:, None]
        return visible & (tail | chosen.gather(1, block_of.expand(q.shape[0], -1)))


class QSAttention(nn.Module):
    """Gated GQA attention with q/k norms and partial RoPE, restricted to the indexer's selection, on this rank's
    query heads (and the KV heads they use); the indexer is replicated so every rank picks the same blocks."""

    def __init__(self, cfg: FlashNextConfig, plan: ShardPlan) -> None:
        super().__init__()
        d, self.head_dim = cfg.hidden_size, cfg.head_dim
        self.tp = plan.tp
        self.heads, self.kv_heads = plan.local_heads, plan.local_kv_heads
        if self.heads % self.kv_heads:
            raise ValueError("num_key_value_heads: a rank's query heads must share whole KV heads")
        self.rotary_dim, self.theta, self.eps = cfg.rotary_dim, cfg.rope_theta, cfg.rms_norm_eps
        self.q_proj = linear(d, self.heads * self.head_dim * 2)
        self.k_proj = linear(d, self.kv_heads * self.head_dim)
        self.v_proj = linear(d, self.kv_heads * self.head_dim)
        self.o_proj = linear(self.heads * self.head_dim, d)
        self.q_norm = ZCRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = ZCRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.indexer = QSAIndexer(cfg)

    def new_cache(self, dtype: torch.dtype, device: torch.device) -> AttentionCache:
        """An empty cache for one lane."""
        return AttentionCache.empty(self.kv_heads, self.head_dim, self.indexer.dim, dtype, device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: AttentionCache) -> torch.Tensor:
        """One lane's rows x [T, d] at consecutive absolute positions; writes them into the cache."""
        seq = x.shape[0]
        cos, sin = rope_cos_sin(positions, self.rotary_dim, self.theta, x.dtype)
        index_q, raw = self.indexer.project(x, cos, sin)
        q, gate = self.q_proj(x).unflatten(-1, (self.heads, 2 * self.head_dim)).chunk(2, dim=-1)
        q = apply_rope(zc_rms_norm(q, self.q_norm.weight, self.eps), cos, sin)
        k = apply_rope(self.k_norm(self.k_proj(x).unflatten(-1, (self.kv_heads, self.head_dim))), cos, sin)
        v = self.v_proj(x).unflatten(-1, (self.kv_heads, self.head_dim))
        start = int(positions[0])
        cache.write(start, k, v, raw)
        length = start + seq
        block_keys = self.indexer.block_keys(cache.index_keys[:length], self.rotary_dim, self.theta)
        mask = self.indexer.select(index_q, block_keys, positions, length)
        out = masked_attention(q, cache.keys[:length], cache.values[:length], mask, self.head_dim**-0.5, positions + 1)
        out = out.reshape(seq, -1) * torch.sigmoid(gate.reshape(seq, -1))
        return self.tp.combine(self.o_proj(out))
