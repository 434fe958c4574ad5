"""GDN's rows in one launch: the bits of the conv, gates, recurrence and gated norm kernels run one after another."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from dataclasses import dataclass

import pytest
import torch
import triton
import triton.language as tl

from kernels import gdn_step as step
from kernels.conv import causal_conv_update
from kernels.gates import gdn_gates
from kernels.gdn import gdn_recurrent
from kernels.gdn_step import _element_of, _row_of
from kernels.norm import gated_rms_norm

EPS = 1e-6


@dataclass(frozen=True)
class Shape:
    """A rank's GDN widths: key and value heads, their dims, the conv's taps, the lane slots."""

    key_heads: int = 2
    heads: int = 4
    dk: int = 16
    dv: int = 32
    kernel: int = 4
    slots: int = 6


SMALL = Shape()
RANK = Shape(key_heads=8, heads=24, dk=128, dv=128, kernel=4, slots=80)  # tp=2's per-rank widths


def lanes_and_lens(count: int, rows: int, shape: Shape) -> tuple[list[int], list[int]]:
    """`count` lanes in scattered slots of `shape`'s pool, `rows` rows each."""
    return [(7 * i + 3) % shape.slots for i in range(count)], [rows] * count


def inputs(
    lanes: list[int],
    lens: list[int],
    seed: int = 0,
    shape: Shape = SMALL,
    device: str = "cpu",
    a_scale: float = 4.0,
    act: torch.dtype = torch.bfloat16,
) -> dict[str, torch.Tensor]:
    """One round's rows as the model has them (activations in `act`): mixed, z, b and a are views of one projection
    output; every lane's slot has a random conv tail and state."""
    gen = torch.Generator(device=device).manual_seed(seed)
    seq, qk, vw = sum(lens), shape.key_heads * shape.dk, shape.heads * shape.dv
    channels = 2 * qk + vw
    fused = torch.randn(seq, channels + vw + 2 * shape.heads + 3, generator=gen, device=device).to(act)
    mixed, z, b, a, _ = fused.split([channels, vw, shape.heads, shape.heads, 3], dim=-1)
    conv_weight = 0.5 * torch.randn(channels, shape.kernel, generator=gen, device=device)
    return {
        "mixed": mixed,
        "z": z,
        "b": b * a_scale,
        "a": a * a_scale,
        "tail": torch.randn(shape.slots, shape.kernel - 1, channels, generator=gen, device=device).to(act),
        "conv_weight": conv_weight.to(act),
        "a_log": torch.randn(shape.heads, generator=gen, device=device),
        "dt_bias": torch.randn(shape.heads, generator=gen, device=device),
        "norm_weight": (1.0 + 0.1 * torch.randn(shape.dv, generator=gen, device=device)).to(act),
        "state": 0.1 * torch.randn(shape.slots, shape.heads, shape.dk, shape.dv, generator=gen, device=device),
        "lane_of_row": torch.repeat_interleave(torch.tensor(lanes), torch.tensor(lens)).to(device),
    }


def tails_and_states(data: dict[str, torch.Tensor], copies: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The lanes' conv tails and states a call updates: copies, or data's own (a timed call's, updated in place)."""
    return (data["tail"].clone(), data["state"].clone()) if copies else (data["tail"], data["state"])


def unfused(
    data: dict[str, torch.Tensor], keep: bool, act: str, key_heads: int, copies: bool = True
) -> tuple[torch.Tensor | None, ...]:
    """The four kernels one after another (on copies of the tails and states unless `copies` is False): (y, tails,
    states, kept, row tails)."""
    tail, state = tails_and_states(data, copies)
    seq = data["mixed"].shape[0]
    row_tails = tail.new_empty((seq, *tail.shape[1:])) if keep else None
    qkv = causal_conv_update(data["mixed"], tail, data["conv_weight"], data["lane_of_row"], row_tails=row_tails)
    q, k, v = step._split_heads(qkv, state, key_heads)
    beta, g = gdn_gates(data["b"], data["a"], data["a_log"], data["dt_bias"])
    out, kept = gdn_recurrent(q, k, v, g, beta, state, data["lane_of_row"], keep)
    y = gated_rms_norm(out, data["z"].unflatten(-1, v.shape[1:]), data["norm_weight"], EPS, act)
    return y, tail, state, kept, row_tails


def fused(
    data: dict[str, torch.Tensor], keep: bool, act: str, key_heads: int, copies: bool = True, window: int = 1
) -> tuple[torch.Tensor | None, ...]:
    """`gdn_step` reading `window` rows of a lane at once (on copies of the tails and states unless `copies` is
    False), the same five results."""
    tail, state = tails_and_states(data, copies)
    seq = data["mixed"].shape[0]
    row_tails = tail.new_empty((seq, *tail.shape[1:])) if keep else None
    y, kept = step.gdn_step(
        data["mixed"], tail, data["conv_weight"], data["b"], data["a"], data["a_log"], data["dt_bias"], data["z"],
        data["norm_weight"], EPS, act, state, data["lane_of_row"], key_heads, row_tails=row_tails, keep_states=keep,
        window=window,
    )  # fmt: skip
    return y, tail, state, kept, row_tails


def bits(t: torch.Tensor) -> torch.Tensor:
    """t's bits as integers of its width (-0.0 is not 0.0; a NaN equals itself)."""
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same_bits(want: tuple[torch.Tensor | None, ...], got: tuple[torch.Tensor | None, ...]) -> None:
    """Every result of the two paths equal bit for bit (None on both sides where nothing is kept)."""
    for name, w, g in zip(("y", "tails", "states", "kept states", "row tails"), want, got, strict=True):
        assert (w is None) == (g is None), name
        assert w is None or torch.equal(bits(w), bits(g)), name


@pytest.mark.parametrize(
    ("lanes", "lens", "keep", "act", "window"),
    [
        ([3, 0, 5, 1], [1, 1, 1, 1], False, "silu", 1),  # decode rows
        ([2, 4, 0], [3, 1, 5], True, "silu", 1),  # verify windows, a run longer than the tail, states kept
        ([1], [2], True, "sigmoid", 1),
        ([2, 4, 0], [3, 1, 5], True, "silu", 4),  # a window's rows read at once; a run longer than that
        ([2, 4, 0], [3, 1, 5], True, "sigmoid", 2),  # runs of whole and part windows
        ([1, 5], [4, 1], True, "silu", 8),  # windows wider than every run
        ([2, 4], [4, 2], False, "silu", 2),  # runs of whole windows only
    ],
)
def test_one_launch_gives_the_four_kernels_bits(lanes, lens, keep, act, window) -> None:
    data = inputs(lanes, lens)
    want = unfused(data, keep, act, SMALL.key_heads)
    assert_same_bits(want, fused(data, keep, act, SMALL.key_heads, window=window))
    assert not step._COUNTERS.get(torch.device("cpu"), 0).any()  # every counter left zero


@triton.jit
def _pick_kernel(tile_ptr, rows_ptr, elements_ptr, W: tl.constexpr, C: tl.constexpr):
    """Every row of a [W, C] tile and every element of its first column, picked out as the window's steps do."""
    w = tl.arange(0, W)
    c = tl.arange(0, C)
    tile = tl.load(tile_ptr + w[:, None] * C + c[None, :])
    column = tl.load(tile_ptr + w * C)
    for i in tl.static_range(W):
        tl.store(rows_ptr + i * C + c, _row_of(tile, i, W, True))
        tl.store(elements_ptr + i, _element_of(column, i, W, True))


def test_a_windows_rows_are_picked_out_with_their_bits() -> None:
    """-0.0, subnormals, infinities and NaN keep their bits when a row or an element is picked out of a window's
    tile (the interpreter's sum starts from +0.0)."""
    special = [-0.0, 0.0, 1e-45, -1e-45, float("inf"), -float("inf"), float("nan"), -1.5]
    tile = torch.stack([torch.tensor(special).roll(r) for r in range(4)])  # each row its own order
    rows, elements = torch.empty_like(tile), torch.empty(4)
    _pick_kernel[(1,)](tile, rows, elements, W=4, C=8)
    assert torch.equal(bits(rows), bits(tile)) and torch.equal(bits(elements), bits(tile[:, 0]))


def test_strided_gate_parameters_are_read_as_the_gates_kernel_reads_them() -> None:
    data = inputs([3, 0], [1, 1])
    for name in ("a_log", "dt_bias"):
        data[name] = torch.stack((data[name], -data[name]), dim=1)[:, 0]  # every other element of a wider tensor
    assert not data["a_log"].is_contiguous()
    assert_same_bits(unfused(data, False, "silu", SMALL.key_heads), fused(data, False, "silu", SMALL.key_heads))


def test_it_stays_close_to_the_plain_reference() -> None:
    """With fp32 activations nothing is rounded to bf16 between the steps: fp32 tolerances against the reference."""
    data = inputs([2, 4, 0], [3, 1, 5], seed=1, a_scale=1.0, act=torch.float32)
    y, tail, state, kept, _ = fused(data, True, "silu", SMALL.key_heads)
    ref_tail, ref_state = data["tail"].clone(), data["state"].clone()
    ref_y, ref_kept = step.gdn_step_reference(
        data["mixed"], ref_tail, data["conv_weight"], data["b"], data["a"], data["a_log"], data["dt_bias"],
        data["z"], data["norm_weight"], EPS, "silu", ref_state, data["lane_of_row"], SMALL.key_heads, keep_states=True,
    )  # fmt: skip
    assert torch.equal(tail, ref_tail)
    for got, want in ((y, ref_y), (state, ref_state), (kept, ref_kept)):
        assert (got - want).norm() / want.norm() < 1e-5


def call(data: dict[str, torch.Tensor], key_heads: int = SMALL.key_heads, act: str = "silu", **keep) -> tuple:
    """`gdn_step` on `data` as it is (tails and states updated in place)."""
    return step.gdn_step(
        data["mixed"], data["tail"], data["conv_weight"], data["b"], data["a"], data["a_log"], data["dt_bias"],
        data["z"], data["norm_weight"], EPS, act, data["state"], data["lane_of_row"], key_heads, **keep,
    )  # fmt: skip


def test_listed_kept_rows_into_a_given_buffer_and_one_value_head_a_key_head() -> None:
    """States kept only after listed rows (`keep_rows`, or their places given as `keep_places`), into `states_out`,
    equal the recurrence's; and a rank whose value heads each have a key head of their own."""
    shape = Shape(key_heads=4, heads=4)
    data = inputs([2, 4, 0], [3, 1, 5], seed=2, shape=shape)
    listed = torch.tensor([0, 2, 7])
    places = torch.full((9,), -1, dtype=torch.int32)
    places[listed] = torch.arange(3, dtype=torch.int32)
    want = unfused(data, True, "silu", shape.key_heads)
    for window, keep in ((1, {"keep_rows": listed}), (4, {"keep_rows": listed, "keep_places": places})):
        copy = dict(data, tail=data["tail"].clone(), state=data["state"].clone())
        out = torch.empty(3, shape.heads, shape.dk, shape.dv)
        y, kept = call(copy, shape.key_heads, keep_states=True, states_out=out, window=window, **keep)
        assert kept is out
        got = (y, copy["tail"], copy["state"], kept)
        for name, w, g in zip(("y", "tails", "states", "kept states"), want[:4], got, strict=True):
            assert torch.equal(w[listed] if name == "kept states" else w, g), name


def test_bad_arguments_are_refused_by_name() -> None:
    data = inputs([0], [1])
    bad = {
        "gate_act": (dict(data), {"act": "relu"}),
        "key_heads": (dict(data), {"key_heads": 3}),
        "mixed": (dict(data, mixed=data["mixed"][:, 1:]), {}),
        "conv_weight": (dict(data, conv_weight=data["conv_weight"][:, :1]), {}),
        "b": (dict(data, b=data["b"][:, :2], a=data["a"][:, :2]), {}),
        "z": (dict(data, z=data["z"][:, 1:]), {}),
        "norm_weight": (dict(data, norm_weight=data["norm_weight"][1:]), {}),
        "tail": (dict(data, tail=data["tail"][:, 1:]), {}),
        "window": (dict(data), {"window": 3}),
    }
    for name, (args, options) in bad.items():
        with pytest.raises(ValueError, match=f"^{name}:"):
            call(args, **options)
