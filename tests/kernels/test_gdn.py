"""The GDN recurrence kernel against its torch reference under the Triton interpreter: accuracy, kept per-row
states, and row invariance (a lane's bits do not depend on the lanes beside it)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
import torch.nn.functional as F

from kernels.gdn import BLOCK_V, SCAN, gdn_recurrent, gdn_recurrent_reference

HEADS, DIM = 3, 16


def make_inputs(
    lens: list[int], key_heads: int, seed: int = 0, slots: int = 4, heads: int = HEADS
) -> dict[str, torch.Tensor]:
    """bf16 q/k (key heads) and v, fp32 g < 0 and beta in (0, 1), a random fp32 state per slot."""
    gen = torch.Generator().manual_seed(seed)
    seq = sum(lens)
    return {
        "q": torch.randn(seq, key_heads, DIM, generator=gen).bfloat16(),
        "k": torch.randn(seq, key_heads, DIM, generator=gen).bfloat16(),
        "v": torch.randn(seq, heads, DIM, generator=gen).bfloat16(),
        "g": -F.softplus(torch.randn(seq, heads, generator=gen)),
        "beta": torch.sigmoid(torch.randn(seq, heads, generator=gen)),
        "state": torch.randn(slots, heads, DIM, DIM, generator=gen) * 0.3,
    }


def lanes_of(lens: list[int], slots: list[int]) -> torch.Tensor:
    """lane_of_row for consecutive runs of `lens` rows owned by `slots`."""
    return torch.repeat_interleave(torch.tensor(slots), torch.tensor(lens)).int()


def call(fn, inputs: dict[str, torch.Tensor], lanes: torch.Tensor, **kw):
    """Run `fn` on a copy of the state; (out, state after, kept states)."""
    state = inputs["state"].clone()
    out, states = fn(inputs["q"], inputs["k"], inputs["v"], inputs["g"], inputs["beta"], state, lanes, **kw)
    return out, state, states


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("long_runs", [False, True])
@pytest.mark.parametrize("key_heads", [1, HEADS])
def test_matches_reference(key_heads: int, long_runs: bool) -> None:
    lens, slots = [1, 5, 3], [2, 0, 3]
    inputs, lanes = make_inputs(lens, key_heads), lanes_of(lens, slots)
    out, state, states = call(gdn_recurrent, inputs, lanes, keep_states=True, long_runs=long_runs)
    ref_out, ref_state, ref_states = call(gdn_recurrent_reference, inputs, lanes, keep_states=True)
    assert out.dtype == torch.float32 and out.shape == (9, HEADS, DIM)
    assert not out.isnan().any() and not state.isnan().any()
    assert rel(out, ref_out) <= 1e-5
    assert rel(state[slots], ref_state[slots]) <= 1e-5
    assert rel(states, ref_states) <= 1e-5
    assert torch.equal(state[1], inputs["state"][1]), "a slot with no rows must not change"


def test_bf16_output() -> None:
    """A bf16 output is the kernel's fp32 output rounded to nearest even (the interpreter's cast truncates)."""
    lens = [2, 4]
    inputs, lanes = make_inputs(lens, 1, seed=1), lanes_of(lens, [1, 0])
    out, _, _ = call(gdn_recurrent, inputs, lanes, out_dtype=torch.bfloat16)
    wide, _, _ = call(gdn_recurrent, inputs, lanes)
    ref, _, _ = call(gdn_recurrent_reference, inputs, lanes)
    assert out.dtype == torch.bfloat16
    assert rel(out.float(), ref) <= 1e-2
    assert torch.equal(out, wide.bfloat16())


def test_closed_form_first_row() -> None:
    """No decay, beta 1 and a zero state: S = k v^T and o = (q . k) v with q, k unit and q scaled by 1/sqrt(Dk)."""
    inputs = make_inputs([1], HEADS, seed=2)
    inputs["g"].zero_()
    inputs["beta"].fill_(1.0)
    inputs["state"].zero_()
    out, state, _ = call(gdn_recurrent, inputs, lanes_of([1], [0]))
    q, k, v = (inputs[n][0].float() for n in ("q", "k", "v"))
    q = q / q.norm(dim=-1, keepdim=True) / DIM**0.5
    k = k / k.norm(dim=-1, keepdim=True)
    assert rel(state[0], k[:, :, None] * v[:, None, :]) <= 1e-5
    assert rel(out[0], (q * k).sum(-1, keepdim=True) * v) <= 1e-5


def test_kept_states_commit_a_prefix() -> None:
    """The state kept after row p of a verify window equals running only the first p rows."""
    lens, slots = [4, 5], [1, 0]
    inputs, lanes = make_inputs(lens, 1, seed=3), lanes_of(lens, slots)
    out, _, states = call(gdn_recurrent, inputs, lanes, keep_states=True)
    for keep in range(1, 6):
        rows = [*range(4), *range(4, 4 + keep)]
        part = {n: t if n == "state" else t[rows] for n, t in inputs.items()}
        part_out, part_state, _ = call(gdn_recurrent, part, lanes_of([4, keep], slots))
        assert torch.equal(part_state[0], states[3 + keep]), f"prefix of {keep} rows"
        assert torch.equal(part_out, out[rows])


def test_row_invariance() -> None:
    """Each lane's outputs and state are bit-identical alone, beside 4 other lanes, and in another order."""
    lens, slots = [3, 1, 5, 2, 4], [4, 1, 0, 3, 2]
    inputs = make_inputs(lens, 1, seed=4, slots=5)
    together_out, together_state, together_states = call(gdn_recurrent, inputs, lanes_of(lens, slots), keep_states=True)
    starts = [sum(lens[:i]) for i in range(len(lens))]
    for order in ([i] for i in range(len(lens))), [list(reversed(range(len(lens))))]:
        for chosen in order:
            rows = [r for i in chosen for r in range(starts[i], starts[i] + lens[i])]
            part = {n: t if n == "state" else t[rows] for n, t in inputs.items()}
            lanes = lanes_of([lens[i] for i in chosen], [slots[i] for i in chosen])
            out, state, states = call(gdn_recurrent, part, lanes, keep_states=True)
            assert torch.equal(out, together_out[rows])
            assert torch.equal(states, together_states[rows])
            picked = [slots[i] for i in chosen]
            assert torch.equal(state[picked], together_state[picked])


@pytest.mark.parametrize("key_heads", [1, 2])
@pytest.mark.parametrize("keep_states", [False, True])
def test_long_runs_give_the_same_bits(keep_states: bool, key_heads: int) -> None:
    """q and k brought to unit norm by their own kernel give every output and state the bits of the one-kernel form."""
    lens, slots = [1, 9, 2, 17], [3, 0, 2, 1]
    inputs, lanes = make_inputs(lens, key_heads, seed=5, heads=4), lanes_of(lens, slots)
    one = call(gdn_recurrent, inputs, lanes, keep_states=keep_states)
    two = call(gdn_recurrent, inputs, lanes, keep_states=keep_states, long_runs=True)
    for a, b in zip(one, two, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("long_runs", [False, True])
@pytest.mark.parametrize("rows", [[0, 4, 11, 28], list(range(29))])
def test_listed_rows_keep_only_their_states_with_the_same_bits(rows: list[int], long_runs: bool) -> None:
    """States kept for listed rows only (a prompt pass keeping a few boundaries) are, in the rows' order, the bits of
    the states kept for every row; outputs and final states are unchanged."""
    lens, slots = [1, 9, 2, 17], [3, 0, 2, 1]
    inputs, lanes = make_inputs(lens, 2, seed=7, heads=4), lanes_of(lens, slots)
    every = call(gdn_recurrent, inputs, lanes, keep_states=True, long_runs=long_runs)
    listed = call(gdn_recurrent, inputs, lanes, keep_states=True, long_runs=long_runs, keep_rows=torch.tensor(rows))
    assert listed[2].shape[0] == len(rows)
    assert torch.equal(listed[2], every[2][rows])
    assert torch.equal(listed[0], every[0]) and torch.equal(listed[1], every[1])


@pytest.mark.parametrize("rows", [None, [2, 5]])
def test_kept_states_go_into_a_given_buffer_with_the_same_bits(rows: list[int] | None) -> None:
    """A graph's shared buffer (`states_out`) receives the kept states, every row's or the listed rows', bit for bit."""
    lens, slots = [2, 4], [1, 3]
    inputs, lanes = make_inputs(lens, 1, seed=3), lanes_of(lens, slots)
    listed = {} if rows is None else {"keep_rows": torch.tensor(rows)}
    fresh = call(gdn_recurrent, inputs, lanes, keep_states=True, **listed)
    buffer = torch.full((8, HEADS, DIM, DIM), float("nan"))
    into = buffer[: 6 if rows is None else 2]
    given = call(gdn_recurrent, inputs, lanes, keep_states=True, states_out=into, **listed)
    assert given[2].data_ptr() == buffer.data_ptr()
    assert all(torch.equal(a, b) for a, b in zip(given, fresh, strict=True))


def test_a_kept_state_buffer_of_the_wrong_shape_or_without_kept_states_is_refused() -> None:
    inputs, lanes = make_inputs([3], 1), lanes_of([3], [0])
    with pytest.raises(ValueError, match="states_out"):
        call(gdn_recurrent, inputs, lanes, keep_states=True, states_out=torch.empty(2, HEADS, DIM, DIM))
    with pytest.raises(ValueError, match="states_out"):
        call(gdn_recurrent, inputs, lanes, states_out=torch.empty(3, HEADS, DIM, DIM))


def test_listed_rows_need_kept_states() -> None:
    inputs, lanes = make_inputs([2], 1), lanes_of([2], [0])
    with pytest.raises(ValueError, match="keep_rows"):
        call(gdn_recurrent, inputs, lanes, keep_rows=torch.tensor([1]))


def test_rejects_bad_shapes() -> None:
    inputs, lanes = make_inputs([2], 1), lanes_of([2], [0])
    with pytest.raises(ValueError, match="state"):
        inputs["state"] = inputs["state"].double()
        call(gdn_recurrent, inputs, lanes)
    with pytest.raises(ValueError, match="not consecutive"):
        call(gdn_recurrent_reference, make_inputs([3], 1), torch.tensor([0, 1, 0], dtype=torch.int32))


def test_gpu_check_script_smoke(tmp_path) -> None:
    """The GPU check script's CPU path (tiny shapes under the interpreter) runs and reports every case clean."""
    import gpu_check_gdn

    assert gpu_check_gdn.main(["--out", str(tmp_path), "--smoke"]) == 0
    assert (tmp_path / "gdn.json").exists()


def test_a_state_of_several_dv_tiles_matches_the_reference() -> None:
    """Dv = 64 (four tiles of BLOCK_V): outputs, final and kept states match the reference, decode rows and long
    runs alike."""
    heads, dk, dv, lens, slots = 2, 16, 64, [1, 4], [1, 0]
    assert dv > 2 * BLOCK_V
    gen = torch.Generator().manual_seed(100)
    seq = sum(lens)
    q, k = (torch.randn(seq, 1, dk, generator=gen).bfloat16() for _ in range(2))
    v = torch.randn(seq, heads, dv, generator=gen).bfloat16()
    g = -F.softplus(torch.randn(seq, heads, generator=gen))
    beta = torch.sigmoid(torch.randn(seq, heads, generator=gen))
    state = torch.randn(2, heads, dk, dv, generator=gen) * 0.3
    lanes = lanes_of(lens, slots)
    ref_state = state.clone()
    ref_out, ref_states = gdn_recurrent_reference(q, k, v, g, beta, ref_state, lanes, keep_states=True)
    for long_runs in (False, True):
        got_state = state.clone()
        out, states = gdn_recurrent(q, k, v, g, beta, got_state, lanes, keep_states=True, long_runs=long_runs)
        assert rel(out, ref_out) <= 1e-5 and rel(got_state, ref_state) <= 1e-5 and rel(states, ref_states) <= 1e-5


def test_a_run_longer_than_two_scan_windows_runs_every_row() -> None:
    """One lane of 2·SCAN + 44 rows: its first row's program finds the run's end over three scan windows of lane ids
    and steps every row, outputs and final state as the reference's."""
    lens, slots = [2 * SCAN + 44], [1]
    inputs, lanes = make_inputs(lens, 1, seed=101, slots=2, heads=1), lanes_of(lens, slots)
    inputs["g"] = inputs["g"] * 0.05  # a slow decay, so the last rows still see the first ones
    out, state, _ = call(gdn_recurrent, inputs, lanes, long_runs=True)
    ref_out, ref_state, _ = call(gdn_recurrent_reference, inputs, lanes)
    assert rel(out, ref_out) <= 1e-5 and rel(state, ref_state) <= 1e-5
