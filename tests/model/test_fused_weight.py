"""The kernel path's fused projection weights: one stacked tensor, the projections' weights views of it."""

from __future__ import annotations

import torch
from torch import nn

from kernels.linear import pair_rows
from model.hyper import linear
from model.kernel_blocks import fused_weight, shared_pairs_weight
from model.moe import SharedExpert


def test_projections_sharing_an_input_become_views_of_one_stacked_weight():
    owner = nn.Module()
    owner.a, owner.b = linear(8, 3), linear(8, 5)
    owner.a.weight.data.normal_()
    owner.b.weight.data.normal_()
    before = torch.cat((owner.a.weight.detach().clone(), owner.b.weight.detach().clone()))
    fused = fused_weight(owner, ("a", "b"))
    assert torch.equal(fused, before)
    assert owner.a.weight.data_ptr() == fused.data_ptr()  # no second copy of the weights
    assert owner.b.weight.data_ptr() == fused[3:].data_ptr()
    assert fused_weight(owner, ("a", "b")) is fused  # made once
    x = torch.randn(4, 8)
    assert torch.equal(owner.b(x), x @ before[3:].T)  # the module still computes with its own weight


def test_the_shared_experts_projections_become_views_of_their_paired_weight():
    owner = nn.Module()
    owner.shared_expert = SharedExpert(8, 3)
    owner.shared_expert_gate = linear(8, 1)
    for p in owner.parameters():
        p.data.normal_()
    gate, up = (
        owner.shared_expert.gate_proj.weight.detach().clone(),
        owner.shared_expert.up_proj.weight.detach().clone(),
    )
    logit = owner.shared_expert_gate.weight.detach().clone()
    pairs = shared_pairs_weight(owner)
    assert torch.equal(pairs, pair_rows(gate, up, logit))
    assert owner.shared_expert.gate_proj.weight.data_ptr() == pairs.data_ptr()  # no second copy of the weights
    assert owner.shared_expert.up_proj.weight.data_ptr() == pairs[1].data_ptr()
    assert owner.shared_expert_gate.weight.data_ptr() == pairs[6].data_ptr()
    assert shared_pairs_weight(owner) is pairs  # made once
    x = torch.randn(4, 8)
    expect = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ owner.shared_expert.down_proj.weight.T
    assert torch.allclose(owner.shared_expert(x), expect)  # the modules still compute with their own weights
    assert torch.equal(owner.shared_expert_gate(x), x @ logit.T)
