"""The n-gram (PLE, "Engram") embedding: hashed bigram/trigram table rows gated into every residual stream."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from model.config import FlashNextConfig
from model.hyper import ConvWeight, ZCRMSNorm, linear
from model.ops import causal_conv, zc_rms_norm
from model.parallel import ShardPlan

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_LAYER_STRIDE = 10007


def _splitmix64(value: int) -> int:
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (value ^ (value >> 31)) & _MASK64


def hash_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """Odd per-order multipliers, small enough that `token * m` never overflows int64."""
    half_bound = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + _LAYER_STRIDE * ple_index
    return [2 * (_splitmix64((base + _GAMMA * (i + 1)) & _MASK64) % half_bound) + 1 for i in range(ngram_size)]


MILLER_RABIN_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)  # exact for every n below 3.1e23


def _is_prime(n: int) -> bool:
    """Whether n is prime: Miller-Rabin over bases that decide every n below 3.1e23 (the table's sizes, at most
    config.NGRAM_BASE_MAX, are far below), so a large base costs as little as a small one."""
    if n < 2:
        return False
    for p in MILLER_RABIN_BASES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in MILLER_RABIN_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


@functools.cache
def _primes_after(base: int, count: int) -> tuple[int, ...]:
    primes, n = [], base
    while len(primes) < count:
        n += 1
        if _is_prime(n):
            primes.append(n)
    return tuple(primes)


def head_moduli(cfg: FlashNextConfig, ple_index: int) -> list[int]:
    """Each head's table size: the successive primes after ngram_vocab_size_base - 1, continued across PLE layers."""
    primes = _primes_after(cfg.ngram_vocab_size_base - 1, (ple_index + 1) * cfg.ngram_heads)
    return list(primes[ple_index * cfg.ngram_heads :])


def ngram_table_rows(cfg: FlashNextConfig, ple_index: int = 0) -> int:
    """Rows of one PLE layer's table, padded to make_ngram_vocab_size_divisible_by."""
    total, div = sum(head_moduli(cfg, ple_index)), cfg.make_ngram_vocab_size_divisible_by
    return -(-total // div) * div


def ngram_row_ids(
    history: torch.Tensor,
    ids: torch.Tensor,
    eos: int,
    multipliers: list[int],
    moduli: torch.Tensor,
    offsets: torch.Tensor,
    heads_per_ngram: int,
) -> torch.Tensor:
    """Table rows [T, heads] for ids [T] after `history` (the previous ngram_size-1 ids); eos starts a new segment."""
    hist = torch.cat((history, ids)).long()
    pos = torch.arange(hist.shape[0], device=hist.device)
    eos_at = torch.where(hist == eos, pos, torch.full_like(pos, -1))
    last_eos_before = torch.cat((eos_at.new_full((1,), -1), torch.cummax(eos_at, 0).values[:-1]))
    seg_start = last_eos_before + 1
    mixed, blocks = None, []
    for shift, mult in enumerate(multipliers):
        src = pos - shift
        valid = (src >= seg_start) & (src >= 0)
        token = torch.where(valid, hist[src.clamp_min(0)], torch.full_like(hist, eos))
        term = token * mult
        mixed = term if mixed is None else torch.bitwise_xor(mixed, term)
        if shift >= 1:
            lo = (shift - 1) * heads_per_ngram
            sl = slice(lo, lo + heads_per_ngram)
            blocks.append(torch.remainder(mixed[:, None], moduli[None, sl]) + offsets[None, sl])
    return torch.cat(blocks, dim=-1)[history.shape[0] :]


class NGramTable(nn.Module):
    """The hashed table; dense, or FP8 with one per-tensor scale (rows dequantized as they are gathered)."""

    def __init__(self, local_rows: tuple[int, int], dim: int, rows_total: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(local_rows[1] - local_rows[0], dim), requires_grad=False)
        self.local_rows, self.rows_total = local_rows, rows_total
        self.weight_scale: torch.Tensor | None = None

    def lookup(self, row_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows [T, heads, dim] for row ids [T, heads], gathered where the table lives (the GPU, or host memory
        when it does not fit there) and returned on the ids' device."""
        rows = F.embedding(row_ids.to(self.weight.device), self.weight)
        if self.weight_scale is not None:
            rows = rows.float() * self.weight_scale.float()
        return rows.to(device=row_ids.device, dtype=dtype, non_blocking=True)


class NGramEmbedding(nn.Module):
    """Hashes n-grams of token ids to table rows (the module named `ple_embedding` in checkpoints); a rank holds
    the rows of its own heads and the ranks' head embeddings are gathered."""

    def __init__(self, cfg: FlashNextConfig, ple_index: int, plan: ShardPlan) -> None:
        super().__init__()
        self.tp = plan.tp
        self.moduli_list = head_moduli(cfg, ple_index)
        self.offsets_list = [sum(self.moduli_list[:i]) for i in range(len(self.moduli_list))]
        self.multipliers = hash_multipliers(cfg.vocab_size, cfg.ngram_size, ple_index, cfg.ngram_seed)
        self.register_buffer("moduli", torch.tensor(self.moduli_list), persistent=False)
        self.register_buffer("offsets", torch.tensor(self.offsets_list), persistent=False)
        self.eos, self.heads_per_ngram = cfg.eos_token_id, cfg.heads_per_ngram
        self.local_heads = plan.ngram_heads
        lo, hi = plan.ngram_heads
        total = ngram_table_rows(cfg, ple_index)
        local_rows = (
            (self.offsets_list[lo], self.offsets_list[hi - 1] + self.moduli_list[hi - 1])
            if plan.tp.world > 1
            else (0, total)
        )
        self.ngram_embedding = NGramTable(local_rows, cfg.ple_embed_dim // cfg.ngram_heads, total)

    def reset_buffers(self, device: torch.device) -> None:
        """Rebuild the hash constants on `device` (after the module was built on the meta device)."""
        self.moduli = torch.tensor(self.moduli_list, device=device)
        self.offsets = torch.tensor(self.offsets_list, device=device)

    def forward(self, history: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Concatenated head embeddings [T, ple_embed_dim]."""
        rows = ngram_row_ids(history, ids, self.eos, self.multipliers, self.moduli, self.offsets, self.heads_per_ngram)
        lo, hi = self.local_heads
        local = self.ngram_embedding.lookup(rows[:, lo:hi] - self.ngram_embedding.local_rows[0], dtype).flatten(-2)
        return self.tp.gather(local, dim=-1)


class PLELayer(nn.Module):
    """Gates the n-gram embedding into each stream and adds a dilated causal conv of it."""

    def __init__(self, cfg: FlashNextConfig, ple_index: int, plan: ShardPlan) -> None:
        super().__init__()
        self.hc, self.d, self.eps = cfg.hc_count, cfg.hidden_size, cfg.rms_norm_eps
        wide = cfg.wide_size
        self.ple_embedding = NGramEmbedding(cfg, ple_index, plan)
        self.key_proj = linear(cfg.ple_embed_dim, wide)
        self.value_proj = linear(cfg.ple_embed_dim, cfg.hidden_size)
        self.norm_key = ZCRMSNorm(wide, cfg.rms_norm_eps, group=cfg.hidden_size)
        self.norm_query = ZCRMSNorm(wide, cfg.rms_norm_eps, group=cfg.hidden_size)
        self.norm_conv = ZCRMSNorm(wide, cfg.rms_norm_eps, group=cfg.hidden_size)
        self.dilation = cfg.ngram_size
        self.conv1d = ConvWeight(wide, cfg.ple_conv_kernel_size)
        self.tail_len = (cfg.ple_conv_kernel_size - 1) * self.dilation

    def forward(
        self, wide: torch.Tensor, history: torch.Tensor, ids: torch.Tensor, tail: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual addition [T, wide] for one lane's rows, and the lane's new conv tail."""
        emb = self.ple_embedding(history, ids, wide.dtype)
        key = self.norm_key(self.key_proj(emb)).unflatten(-1, (self.hc, self.d))
        value = self.value_proj(emb)
        query = self.norm_query(wide).unflatten(-1, (self.hc, self.d))
        gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(self.d)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        gated = (torch.sigmoid(gate) * value.unsqueeze(-2)).flatten(-2)
        normed = zc_rms_norm(gated, self.norm_conv.weight, self.eps, self.d)
        conv, tail = causal_conv(normed, tail, self.conv1d.weight, dilation=self.dilation)
        return gated + F.silu(conv), tail
