"""The kernel path's fused projection weights: one stacked tensor, the projections' weights views of it."""

from __future__ import annotations

import torch
from torch import nn

from model.hyper import linear
from model.kernel_blocks import fused_weight


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
