"""The routed experts' NVFP4 codes moved to the MoE kernels' word layout: once, in place, and never left half moved."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from model import kernel_blocks
from model.kernel_blocks import expert_bank, experts_to_words
from model.moe import ExpertBank

E, D, WIDTH = 2, 32, 16


def nvfp4_bank(seed: int) -> ExpertBank:
    """An ExpertBank holding random checkpoint-layout NVFP4 codes."""
    gen = torch.Generator().manual_seed(seed)
    bank = ExpertBank(SimpleNamespace(num_experts=E, hidden_size=D), WIDTH)
    bank.use_nvfp4(
        {
            "gate_up_packed": torch.randint(0, 256, (E, 2 * WIDTH, D // 2), generator=gen, dtype=torch.uint8),
            "gate_up_scale": torch.ones(E, 2 * WIDTH, D // 16).to(torch.float8_e4m3fn),
            "gate_up_scale_2": torch.ones(E, 2),
            "down_packed": torch.randint(0, 256, (E, D, WIDTH // 2), generator=gen, dtype=torch.uint8),
            "down_scale": torch.ones(E, D, WIDTH // 16).to(torch.float8_e4m3fn),
            "down_scale_2": torch.ones(E),
        }
    )
    return bank


def test_every_bank_moves_once_in_place_and_still_decodes() -> None:
    owner = nn.Module()
    owner.first, owner.second = nvfp4_bank(0), nvfp4_bank(1)
    want = [bank.expert(e, torch.float32) for bank in (nvfp4_bank(0), nvfp4_bank(1)) for e in range(E)]
    memory = owner.first.nvfp4["gate_up_packed"].data_ptr()
    experts_to_words(owner)
    for bank in (owner.first, owner.second):
        assert sorted(k for k in bank.nvfp4 if k.endswith(("_packed", "_words"))) == ["down_words", "gate_up_words"]
    assert owner.first.nvfp4["gate_up_words"].data_ptr() == memory
    words = owner.first.nvfp4["gate_up_words"].clone()
    assert expert_bank(owner.first)["gate_up_words"].equal(words)  # a second call moves nothing
    got = [bank.expert(e, torch.float32) for bank in (owner.first, owner.second) for e in range(E)]
    for pair_got, pair_want in zip(got, want, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(pair_got, pair_want, strict=True))


def test_a_move_that_fails_leaves_no_codes_to_read(monkeypatch) -> None:
    bank = nvfp4_bank(2)

    def fails(tensors, in_place):
        tensors["gate_up_packed"].zero_()  # as if some words had moved
        raise RuntimeError("out of memory")

    monkeypatch.setattr(kernel_blocks, "kernel_bank", fails)
    with pytest.raises(RuntimeError, match="out of memory"):
        expert_bank(bank)
    assert bank.nvfp4 == {}
    with pytest.raises(KeyError):
        bank.expert(0, torch.float32)
