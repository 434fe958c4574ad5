"""GDN's rows in one launch, compiled on a GPU at tp=2's per-rank widths: the bits of the four kernels it stands
for (compiled with other FMA and subnormal options), for every lane alone and in any batch."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kernels import gdn_step as step
from tests.kernels.test_gdn_step import RANK, assert_same_bits, fused, inputs, lanes_and_lens, unfused

ROW_INPUTS = ("mixed", "z", "b", "a", "lane_of_row")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels"),
]


@pytest.mark.parametrize("act", ["silu", "sigmoid"])
@pytest.mark.parametrize(
    ("count", "rows", "keep", "window"),
    [
        (1, 1, False, 1),
        (7, 1, False, 1),
        (64, 1, False, 1),
        (8, 1, True, 1),
        (8, 4, False, 1),
        (8, 4, True, 1),
        (1, 4, True, 4),  # a verify window's rows read at once
        (8, 4, True, 4),
        (2, 3, True, 4),  # runs shorter than the window
        (3, 5, True, 2),  # runs of whole and part windows
    ],
)
@pytest.mark.parametrize("a_scale", [1.0, 60.0])  # 60: sigmoids and softplus far in their tails, exp past fp32
def test_one_launch_gives_the_four_kernels_bits(
    count: int, rows: int, keep: bool, window: int, act: str, a_scale: float
) -> None:
    lanes, lens = lanes_and_lens(count, rows, RANK)
    data = inputs(lanes, lens, seed=count + rows, shape=RANK, device="cuda", a_scale=a_scale)
    want = unfused(data, keep, act, RANK.key_heads)
    assert_same_bits(want, fused(data, keep, act, RANK.key_heads, window=window))
    assert not step._COUNTERS.get(data["mixed"].device, 0).any()  # every counter left zero


@pytest.mark.parametrize("window", [1, 4])
def test_every_lane_alone_has_its_bits_in_the_batch(window: int) -> None:
    lanes, lens = lanes_and_lens(16, 1, RANK)
    lens[3], lens[9] = 3, 2  # verify windows beside decode rows
    data = inputs(lanes, lens, seed=5, shape=RANK, device="cuda")
    y, tail, state, _, _ = fused(data, False, "silu", RANK.key_heads, window=window)
    start = 0
    for lane, n in zip(lanes, lens, strict=True):
        alone = {name: value[start : start + n] if name in ROW_INPUTS else value for name, value in data.items()}
        y_alone, tail_alone, state_alone, _, _ = fused(alone, False, "silu", RANK.key_heads, window=1)
        assert torch.equal(y_alone, y[start : start + n]), lane
        assert torch.equal(tail_alone[lane], tail[lane]) and torch.equal(state_alone[lane], state[lane]), lane
        start += n
