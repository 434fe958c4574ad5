"""Tiny random Flash Next models for tests: transformers' oracle and checkpoints of the same weights."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import torch
from make_checkpoint import hf_model as _hf_model
from make_checkpoint import make_checkpoint

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "tiny"
VARIANTS = ("base", "gqa12-hc4", "no-ple")
# Overrides of "base" for the kernel path's tests: GDN head dims the kernels take (powers of two >= 16); an indexer
# budget of two 2-token blocks, so prompts of a few tokens already choose blocks; three layers (GDN, QSA with the PLE,
# GDN): two GDN layers keep their states apart, at three quarters of four layers' interpreter time; three value heads
# on one key head, the real model's ratio, in half the GDN programs of base's six on two (the interpreter runs one
# program at a time; the kernels' own tests take other head counts).
KERNEL_TEXT = {
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 1,
    "linear_num_value_heads": 3,
    "indexer_budget": 4,
    "num_hidden_layers": 3,
}
# KERNEL_TEXT for two ranks: each rank's half has KERNEL_TEXT's heads.
KERNEL_TEXT_TP2 = {**KERNEL_TEXT, "linear_num_key_heads": 2, "linear_num_value_heads": 6}


def text_config(name: str = "base", **overrides: Any) -> dict[str, Any]:
    """One of the tiny text configs in configs/tiny, with overrides."""
    return {**json.loads((CONFIGS / f"{name}.json").read_text()), **overrides}


def hf_model(name: str = "base", seed: int = 0, **overrides: Any):
    """transformers' model on a tiny config with every parameter random (fp32, eager attention)."""
    return _hf_model(text_config(name, **overrides), seed)


def checkpoint(path: Path, name: str = "base", seed: int = 0, **kwargs: Any) -> Path:
    """Write the tiny checkpoint whose trunk equals `hf_model(name, seed)` (fp32 unless `fmt` says otherwise)."""
    kwargs.setdefault("fmt", "fp32")
    return make_checkpoint(text_config(name), path, seed=seed, **kwargs)


@contextlib.contextmanager
def ties_to_lower_index():
    """Make transformers' top-k pick the lower index among equal scores, the order our contract fixes.

    transformers leaves the order of tied scores to torch.topk (unspecified); the QSA indexer's ReLU makes exact ties
    (score 0) common in random tiny models."""
    original = torch.Tensor.topk

    def stable_topk(self, k, dim=-1, largest=True, sorted=True):
        order = torch.sort(self, dim=dim, descending=largest, stable=True)
        return torch.return_types.topk((order.values.narrow(dim, 0, k), order.indices.narrow(dim, 0, k)))

    torch.Tensor.topk = stable_topk
    try:
        yield
    finally:
        torch.Tensor.topk = original
