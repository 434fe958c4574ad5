"""The chunked GDN kernel compiled on a GPU at tp=2's per-rank widths: the compiled recurrence's results to fp32
rounding, and a run's bits alone or among others, in one call or two, eager or replayed from a CUDA graph."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import torch.nn.functional as F

from kernels.gdn import gdn_recurrent, unit_qk
from kernels.gdn_chunk import CHUNK, chunked_rows, gdn_chunked, plan_chunks

HEADS, KEY_HEADS, DIM = 24, 8, 128
PROMPT = 1024
Run = tuple[int, int, int, int]  # (first_row, length, first_position, slot)
# a prompt pass beside a resumed prompt (2 chunks and a tail), an unaligned run and a 1-chunk run
MIXED: list[Run] = [(0, 130, 2 * CHUNK, 2), (130, 5, 17, 3), (135, PROMPT, 0, 0), (PROMPT + 135, CHUNK, 0, 1)]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels"),
]


def inputs(rows: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Unit q, k (from `unit_qk`), and v as views of one post-conv buffer; g, beta as views of one gate buffer."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    qk = KEY_HEADS * DIM
    qkv = F.silu(torch.randn(rows, 2 * qk + HEADS * DIM, generator=gen, device="cuda")).bfloat16()
    gates = torch.randn(rows, 2 * HEADS, generator=gen, device="cuda")
    q, k = qkv[:, :qk].view(rows, KEY_HEADS, DIM), qkv[:, qk : 2 * qk].view(rows, KEY_HEADS, DIM)
    q_unit, k_unit = unit_qk(q, k)
    return {
        "q": q,
        "k": k,
        "q_unit": q_unit,
        "k_unit": k_unit,
        "v": qkv[:, 2 * qk :].view(rows, HEADS, DIM),
        "g": -0.05 * F.softplus(2 * gates[:, :HEADS]),  # mild decay: a state still counts a chunk later
        "beta": torch.sigmoid(gates[:, HEADS:]),
        "state": 0.1 * torch.randn(4, HEADS, DIM, DIM, generator=gen, device="cuda"),
    }


def rows_of(data: dict[str, torch.Tensor], rows: range) -> dict[str, torch.Tensor]:
    """The inputs of consecutive rows (another call's batch), the state pool as it is."""
    return {n: t if n == "state" else t[rows.start : rows.stop] for n, t in data.items()}


def chunked(data: dict[str, torch.Tensor], runs: list[Run], out_dtype=torch.float32, keep_rows: list[int] = ()):
    """The kernel over `runs` on a copy of the pool; (out, pool after, the states after `keep_rows`, in order)."""
    rows = data["v"].shape[0]
    state = data["state"].clone()
    out = torch.zeros(data["v"].shape, dtype=out_dtype, device="cuda")
    places = torch.full((rows,), -1, dtype=torch.int32, device="cuda")
    places[list(keep_rows)] = torch.arange(len(keep_rows), dtype=torch.int32, device="cuda")
    states = torch.empty((len(keep_rows), HEADS, DIM, DIM), device="cuda")
    args = [data[n] for n in ("q_unit", "k_unit", "v", "g", "beta")]
    gdn_chunked(*args, state, plan_chunks(runs, rows, "cuda"), out, places, states)
    return out, state, states


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_matches_the_compiled_recurrence() -> None:
    """A 1024-row prompt and the mixed batch's chunks: outputs, final and kept states within 1e-5 of gdn_recurrent
    over the same rows."""
    data = inputs(PROMPT + 135 + CHUNK, seed=1)
    ends = [135 + c * CHUNK - 1 for c in range(1, PROMPT // CHUNK + 1)]
    out, state, states = chunked(data, MIXED, keep_rows=ends)
    rows = chunked_rows(MIXED)
    slots = [next(slot for first, n, _, slot in MIXED if first <= r < first + n) for r in rows]
    ref_state = data["state"].clone()
    args = [data[n][rows] for n in ("q", "k", "v", "g", "beta")]
    keep = torch.tensor([rows.index(e) for e in ends], device="cuda")
    lanes = torch.tensor(slots, dtype=torch.int32, device="cuda")
    ref_out, ref_states = gdn_recurrent(*args, ref_state, lanes, keep_states=True, long_runs=True, keep_rows=keep)
    for first, length, _, slot in MIXED:
        taken = [i for i, r in enumerate(rows) if first <= r < first + length]
        if taken:  # the rows the chunks take, as a batch of their own in the recurrence
            assert rel(out[[rows[i] for i in taken]], ref_out[taken]) < 1e-5, first
            assert rel(state[slot], ref_state[slot]) < 1e-5, first
    assert rel(states, ref_states) < 1e-5


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_has_the_same_bits_alone_and_among_others(out_dtype: torch.dtype) -> None:
    """A 1024-row prompt alone (at row 0, slot 0) and in the mixed batch (at row 135): the same bits."""
    data = inputs(PROMPT + 135 + CHUNK, seed=2)
    ends = [135 + c * CHUNK - 1 for c in range(1, PROMPT // CHUNK + 1)]
    mixed = chunked(data, MIXED, out_dtype, keep_rows=ends)
    alone = chunked(rows_of(data, range(135, 135 + PROMPT)), [(0, PROMPT, 0, 0)], out_dtype, [e - 135 for e in ends])
    assert torch.equal(alone[0], mixed[0][135 : 135 + PROMPT])
    assert torch.equal(alone[1][0], mixed[1][0])
    assert torch.equal(alone[2], mixed[2])


def test_one_call_or_two_give_the_same_bits() -> None:
    """A 1024-row prompt in one call, or as 320 rows then 704 from the state the first call wrote: the same bits."""
    data = inputs(PROMPT, seed=3)
    whole = chunked(data, [(0, PROMPT, 0, 1)])
    first = chunked(rows_of(data, range(320)), [(0, 320, 0, 1)])
    second = chunked(rows_of(data, range(320, PROMPT)) | {"state": first[1]}, [(0, PROMPT - 320, 320, 1)])
    assert torch.equal(whole[0], torch.cat([first[0], second[0]]))
    assert torch.equal(whole[1], second[1])


def test_a_cuda_graph_replays_any_plan_with_the_eager_bits() -> None:
    """One graph captured for the mixed batch's row count replays other plans (copied into its plan tensors) with
    the bits of eager calls."""
    data = inputs(PROMPT + 135 + CHUNK, seed=4)
    rows = data["v"].shape[0]
    plans = [MIXED, [(0, 3 * CHUNK, 0, 3), (3 * CHUNK, PROMPT, 5 * CHUNK, 1)]]
    static = plan_chunks(plans[0], rows, "cuda")
    state = data["state"].clone()
    out = torch.zeros(data["v"].shape, device="cuda")
    args = [data[n] for n in ("q_unit", "k_unit", "v", "g", "beta")]
    gdn_chunked(*args, state, static, out)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gdn_chunked(*args, state, static, out)
    for runs in plans:
        plan = plan_chunks(runs, rows, "cuda")
        static.chunk_rows.copy_(plan.chunk_rows)
        static.runs.copy_(plan.runs)
        state.copy_(data["state"])
        out.zero_()
        graph.replay()
        eager = chunked(data, runs)
        assert torch.equal(out, eager[0]) and torch.equal(state, eager[1])
