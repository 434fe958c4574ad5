"""The causal depthwise conv kernel against its torch reference under the Triton interpreter: accuracy, tap order,
tails, per-row tails, and row invariance (a lane's bits do not depend on the lanes beside it)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from kernels.conv import SCAN_ROWS, causal_conv_update, causal_conv_update_reference

KERNEL = 4


def make_inputs(
    lens: list[int], channels: int, dilation: int, dtype: torch.dtype, seed: int = 0, slots: int = 4
) -> dict[str, torch.Tensor]:
    """x [T, C], a random tail per slot and the taps [C, K], in `dtype`."""
    gen = torch.Generator().manual_seed(seed)
    kept = (KERNEL - 1) * dilation
    return {
        "x": torch.randn(sum(lens), channels, generator=gen).to(dtype),
        "tail": torch.randn(slots, kept, channels, generator=gen).to(dtype),
        "weight": (torch.randn(channels, KERNEL, generator=gen) * 0.5).to(dtype),
    }


def lanes_of(lens: list[int], slots: list[int]) -> torch.Tensor:
    """lane_of_row for consecutive runs of `lens` rows owned by `slots`."""
    return torch.repeat_interleave(torch.tensor(slots), torch.tensor(lens)).int()


def call(fn, inputs: dict[str, torch.Tensor], lanes: torch.Tensor, dilation: int, activation: str | None = "silu"):
    """Run `fn` on a copy of the tails, keeping per-row tails; (out, tails after, per-row tails)."""
    tail = inputs["tail"].clone()
    x = inputs["x"]
    row_tails = torch.full((x.shape[0], *tail.shape[1:]), float("nan"), dtype=x.dtype)
    out = fn(x, tail, inputs["weight"], lanes, dilation, activation, row_tails)
    return out, tail, row_tails


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# Lanes of 1 to 5 rows, plus one long enough for the rows past the tail (and past a 16-row body block).
CASES = [(1, [1, 5, 3], 40), (3, [2, 12, 4], 136), (1, [40], 300)]


@pytest.mark.parametrize(("dilation", "lens", "channels"), CASES)
@pytest.mark.parametrize("activation", ["silu", None])
def test_fp32_matches_reference(dilation: int, lens: list[int], channels: int, activation: str | None) -> None:
    slots = [2, 0, 3][: len(lens)]
    inputs, lanes = make_inputs(lens, channels, dilation, torch.float32), lanes_of(lens, slots)
    out, tail, row_tails = call(causal_conv_update, inputs, lanes, dilation, activation)
    ref, ref_tail, ref_row_tails = call(causal_conv_update_reference, inputs, lanes, dilation, activation)
    assert not out.isnan().any()
    if activation is None:
        assert torch.equal(out, ref), "fp32 taps in the reference's order give identical bits"
    assert rel(out, ref) <= 1e-5
    assert torch.equal(tail, ref_tail)
    assert torch.equal(row_tails, ref_row_tails)
    assert torch.equal(tail[1], inputs["tail"][1]), "a slot with no rows must not change"


@pytest.mark.parametrize(("dilation", "lens", "channels"), CASES[:2])
def test_bf16_matches_reference(dilation: int, lens: list[int], channels: int) -> None:
    inputs, lanes = make_inputs(lens, channels, dilation, torch.bfloat16, seed=1), lanes_of(lens, [1, 0, 2])
    out, tail, row_tails = call(causal_conv_update, inputs, lanes, dilation)
    ref, ref_tail, ref_row_tails = call(causal_conv_update_reference, inputs, lanes, dilation)
    assert out.dtype == torch.bfloat16 and not out.isnan().any()
    assert rel(out.float(), ref.float()) <= 1e-2
    assert torch.equal(tail, ref_tail) and torch.equal(row_tails, ref_row_tails)


@pytest.mark.parametrize("dilation", [1, 3])
def test_tap_order(dilation: int) -> None:
    """With only tap j set, row t's output is row t - (K-1-j)*dilation of (tail, rows): tap 0 is the oldest."""
    lens = [5]
    for j in range(KERNEL):
        inputs = make_inputs(lens, 8, dilation, torch.float32, seed=2)
        inputs["weight"] = torch.zeros(8, KERNEL)
        inputs["weight"][:, j] = 1.0
        out, _, _ = call(causal_conv_update, inputs, lanes_of(lens, [0]), dilation, None)
        full = torch.cat((inputs["tail"][0], inputs["x"]))
        kept = (KERNEL - 1) * dilation
        shift = (KERNEL - 1 - j) * dilation
        assert torch.equal(out, full[kept - shift : kept - shift + 5]), f"tap {j}"


def test_model_math_in_fp32() -> None:
    """The reference is model/ops.py's causal_conv (cat tail and rows, sum taps oldest first) lane by lane."""
    dilation, lens, slots = 3, [4, 2], [1, 0]
    inputs = make_inputs(lens, 24, dilation, torch.float32, seed=3)
    out, tail, _ = call(causal_conv_update, inputs, lanes_of(lens, slots), dilation, None)
    start = 0
    for seq, slot in zip(lens, slots, strict=True):
        full = torch.cat((inputs["tail"][slot], inputs["x"][start : start + seq]))
        taps = inputs["weight"].transpose(0, 1)
        want = full[:seq] * taps[0]
        for k in range(1, KERNEL):
            want = want + full[k * dilation : k * dilation + seq] * taps[k]
        assert torch.equal(out[start : start + seq], want)
        assert torch.equal(tail[slot], full[seq:])
        start += seq


def test_row_invariance() -> None:
    """Each lane's outputs and tails are bit-identical alone, beside 4 other lanes, and in another order."""
    dilation, lens, slots = 3, [3, 1, 11, 2, 4], [4, 1, 0, 3, 2]
    inputs = make_inputs(lens, 40, dilation, torch.bfloat16, seed=4, slots=5)
    together = call(causal_conv_update, inputs, lanes_of(lens, slots), dilation)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    for chosen in [[i] for i in range(len(lens))] + [list(reversed(range(len(lens))))]:
        rows = [r for i in chosen for r in range(starts[i], starts[i] + lens[i])]
        part = {"x": inputs["x"][rows], "tail": inputs["tail"], "weight": inputs["weight"]}
        lanes = lanes_of([lens[i] for i in chosen], [slots[i] for i in chosen])
        out, tail, row_tails = call(causal_conv_update, part, lanes, dilation)
        picked = [slots[i] for i in chosen]
        assert torch.equal(out, together[0][rows])
        assert torch.equal(row_tails, together[2][rows])
        assert torch.equal(tail[picked], together[1][picked])


@pytest.mark.parametrize("dilation", [1, 3])
def test_a_round_of_many_rows_convolves_every_lanes_head_as_a_few_row_round_does(dilation: int) -> None:
    """Past FEW_ROWS rows a head program looks through HEAD_ROWS rows for lane starts: several starts in one group
    (lanes of 1 and 2 rows), one on a group's last row, and lanes shorter than the tail, all with the reference's
    outputs and tails; each lane's bits are those it has in a round of its own (HR 1)."""
    from kernels.conv import FEW_ROWS, HEAD_ROWS

    lens = [1, 2, 1, 11, 1, 200, 3, 30, 2, 50]  # starts at rows 0, 1, 3, 4, 15 (a group's last), 16, 216, ...
    assert sum(lens) > FEW_ROWS and 15 % HEAD_ROWS == HEAD_ROWS - 1
    slots = [7, 2, 9, 0, 5, 1, 8, 3, 6, 4]
    inputs = make_inputs(lens, 40, dilation, torch.float32, seed=5, slots=10)
    out, tail, row_tails = call(causal_conv_update, inputs, lanes_of(lens, slots), dilation, None)
    ref, ref_tail, ref_row_tails = call(causal_conv_update_reference, inputs, lanes_of(lens, slots), dilation, None)
    assert torch.equal(out, ref) and torch.equal(tail, ref_tail) and torch.equal(row_tails, ref_row_tails)
    start = 0
    for seq, slot in zip(lens, slots, strict=True):
        rows = slice(start, start + seq)
        part = {"x": inputs["x"][rows], "tail": inputs["tail"], "weight": inputs["weight"]}
        alone, alone_tail, _ = call(causal_conv_update, part, lanes_of([seq], [slot]), dilation, None)
        assert torch.equal(alone, out[rows]) and torch.equal(alone_tail[slot], tail[slot])
        start += seq


@pytest.mark.parametrize("head_rows", [2, 8, 32])
def test_any_head_rows_gives_one_row_a_programs_bits(head_rows: int) -> None:
    """A sweep's head rows (lane starts side by side in a group, on its last row, and past the first group) change
    no bit of the outputs or the tails."""
    lens, slots = [1, 1, 2, 7, 1, 20, 3], [3, 0, 6, 1, 5, 2, 4]
    inputs = make_inputs(lens, 40, 3, torch.bfloat16, seed=9, slots=7)
    lanes = lanes_of(lens, slots)

    def run(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        tail = inputs["tail"].clone()
        return causal_conv_update(inputs["x"], tail, inputs["weight"], lanes, 3, "silu", head_rows=rows), tail

    (out, tail), (one_out, one_tail) = run(head_rows), run(1)
    assert torch.equal(out, one_out) and torch.equal(tail, one_tail)


@pytest.mark.parametrize("head_rows", [0, 3, 12])
def test_head_rows_not_a_power_of_two_is_refused(head_rows: int) -> None:
    inputs, lanes = make_inputs([2], 8, 1, torch.float32), lanes_of([2], [0])
    with pytest.raises(ValueError, match="head_rows"):
        causal_conv_update(inputs["x"], inputs["tail"], inputs["weight"], lanes, head_rows=head_rows)


def test_rejects_bad_shapes() -> None:
    inputs, lanes = make_inputs([2], 8, 1, torch.float32), lanes_of([2], [0])
    with pytest.raises(ValueError, match="tail"):
        causal_conv_update(inputs["x"], inputs["tail"][:, :2], inputs["weight"], lanes)
    with pytest.raises(ValueError, match="not consecutive"):
        call(causal_conv_update_reference, make_inputs([3], 8, 1, torch.float32), torch.tensor([0, 1, 0]).int(), 1)


def test_a_run_longer_than_two_scan_windows_ends_where_its_rows_do() -> None:
    """One lane of 2·SCAN_ROWS + 40 rows after a one-row lane: the head program finds the run's end over three scan
    windows, so outputs, the lane's new tail and the per-row tails equal the reference's bits (fp32, no activation)."""
    lens, slots = [1, 2 * SCAN_ROWS + 40], [1, 0]
    inputs, lanes = make_inputs(lens, 8, 1, torch.float32, seed=120, slots=2), lanes_of(lens, slots)
    got = call(causal_conv_update, inputs, lanes, 1, None)
    want = call(causal_conv_update_reference, inputs, lanes, 1, None)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize("activation", [None, "silu"])
def test_bf16_outputs_round_to_nearest_as_the_reference(activation) -> None:
    """The kernel's bf16 outputs are its fp32 sums rounded to nearest even, the reference's bits (the interpreter's
    cast truncates), for a PLE-like conv: dilation 3, 11 rows."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(11, 96, generator=g).bfloat16()
    tail = torch.randn(2, 9, 96, generator=g).bfloat16()
    weight = torch.randn(96, 4, generator=g).bfloat16()
    lanes = torch.ones(11, dtype=torch.long)
    out = causal_conv_update(x, tail.clone(), weight, lanes, 3, activation)
    ref = causal_conv_update_reference(x, tail.clone(), weight, lanes, 3, activation)
    exact = causal_conv_update(x.float(), tail.float(), weight.float(), lanes, 3, activation)
    assert torch.equal(exact.bfloat16(), ref)  # the fp32 sums are the reference's: only the last rounding may differ
    assert torch.equal(out, ref), f"{(out != ref).float().mean().item():.0%} of the outputs differ"
