"""The GDN recurrence compiled on a GPU at tp=2's per-rank widths: both forms give a row the same bits, in any batch."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import torch.nn.functional as F

from kernels.gdn import LONG_RUN, gdn_recurrent

HEADS, KEY_HEADS, DIM = 24, 8, 128
LENS = (1, LONG_RUN + 4, 3, 1, 200, 4)  # decode rows, verify windows and prompt passes in one round

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels"),
]


def inputs(lens: tuple[int, ...], seed: int = 0) -> dict[str, torch.Tensor]:
    """q, k, v as views of one post-conv buffer (as the model has them), g, beta, and a state per lane."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    seq, qk = sum(lens), KEY_HEADS * DIM
    qkv = F.silu(torch.randn(seq, 2 * qk + HEADS * DIM, generator=gen, device="cuda")).bfloat16()
    return {
        "q": qkv[:, :qk].view(seq, KEY_HEADS, DIM),
        "k": qkv[:, qk : 2 * qk].view(seq, KEY_HEADS, DIM),
        "v": qkv[:, 2 * qk :].view(seq, HEADS, DIM),
        "g": -F.softplus(torch.randn(seq, HEADS, generator=gen, device="cuda") + 1.0) * 0.5,
        "beta": torch.sigmoid(torch.randn(seq, HEADS, generator=gen, device="cuda")),
        "state": 0.1 * torch.randn(len(lens), HEADS, DIM, DIM, generator=gen, device="cuda"),
    }


def run(data: dict[str, torch.Tensor], lens: tuple[int, ...], lanes: list[int], long_runs: bool):
    """The kernel over the rows of `lanes` (consecutive runs), on a copy of their states; (out, states, kept)."""
    starts = [sum(lens[:i]) for i in range(len(lens))]
    rows = torch.tensor([r for i in lanes for r in range(starts[i], starts[i] + lens[i])], device="cuda")
    counts = torch.tensor([lens[i] for i in lanes], device="cuda")
    lane_of_row = torch.repeat_interleave(torch.tensor(lanes, device="cuda"), counts)
    state = data["state"].clone()
    q, k, v, g, beta = (data[n][rows] for n in ("q", "k", "v", "g", "beta"))
    out, kept = gdn_recurrent(q, k, v, g, beta, state, lane_of_row.int(), keep_states=True, long_runs=long_runs)
    return out, state[lanes], kept


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_both_forms_give_every_row_the_same_bits_alone_and_batched(out_dtype: torch.dtype) -> None:
    """A round's rows take the unit-norm form when a lane has LONG_RUN rows: every lane must keep its bits whichever
    form it takes, alone or beside the others."""
    data = inputs(LENS)
    every = list(range(len(LENS)))
    batched = run(data, LENS, every, long_runs=True)
    assert all(torch.equal(a, b) for a, b in zip(batched, run(data, LENS, every, long_runs=False), strict=True))
    start = 0
    for lane, n in enumerate(LENS):
        alone = run(data, LENS, [lane], long_runs=n >= LONG_RUN)  # as the model chooses for a lane alone
        assert torch.equal(alone[0], batched[0][start : start + n]), lane
        assert torch.equal(alone[1], batched[1][lane : lane + 1]), lane
        assert torch.equal(alone[2], batched[2][start : start + n]), lane
        start += n


@pytest.mark.parametrize("long_runs", [False, True])
def test_listed_rows_keep_the_bits_of_every_row_kept(long_runs: bool) -> None:
    """States kept for a few listed rows (a prompt pass's kept boundaries) equal those rows' states when every row
    keeps one; outputs and final states are the same either way."""
    data, seq = inputs(LENS, seed=3), sum(LENS)
    listed = torch.tensor([0, 21, 30, 129, seq - 1], device="cuda")
    lane_of_row = torch.repeat_interleave(torch.arange(len(LENS), device="cuda"), torch.tensor(LENS, device="cuda"))
    args = [data[n] for n in ("q", "k", "v", "g", "beta")]
    outs = []
    for keep_rows in (None, listed):
        state = data["state"].clone()
        out, kept = gdn_recurrent(
            *args, state, lane_of_row.int(), keep_states=True, long_runs=long_runs, keep_rows=keep_rows
        )
        outs.append((out, state, kept))
    assert torch.equal(outs[1][0], outs[0][0]) and torch.equal(outs[1][1], outs[0][1])
    assert outs[1][2].shape[0] == listed.shape[0] and torch.equal(outs[1][2], outs[0][2][listed])
