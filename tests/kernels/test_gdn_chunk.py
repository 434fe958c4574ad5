"""The chunked GDN kernel under the Triton interpreter: against the recurrence and its own torch reference, the bits of
a run alone or among others and in one call or two, kept states at chunk ends, the plan, and refused inputs."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
import torch.nn.functional as F

from kernels.gdn import L2_EPS, gdn_recurrent_reference, unit_qk
from kernels.gdn_chunk import (
    BLOCK_V,
    CHUNK,
    DOT_K,
    PREPARE_COLUMNS,
    ChunkPlan,
    chunked_rows,
    gdn_chunked,
    gdn_chunked_reference,
    plan_chunks,
)

HEADS, KEY_HEADS, DIM = 4, 2, 16
Run = tuple[int, int, int, int]  # (first_row, length, first_position, slot)


def make_inputs(rows: int, seed: int = 0, slots: int = 4, unit_kernel: bool = False) -> dict:
    """Raw bf16 q, k and their unit forms (from `unit_qk` with `unit_kernel`, else the same maths in torch, quicker
    under the interpreter); bf16 v, g and beta as strided views of wider buffers (as the model has them); a state
    per slot."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, KEY_HEADS, DIM, generator=gen).bfloat16()
    k = torch.randn(rows, KEY_HEADS, DIM, generator=gen).bfloat16()
    v = torch.randn(rows, HEADS, 2 * DIM, generator=gen).bfloat16()[:, :, DIM:]
    gates = torch.randn(rows, 2 * HEADS, generator=gen)
    if unit_kernel:
        q_unit, k_unit = unit_qk(q, k)
    else:
        q_unit, k_unit = (x.float() * torch.rsqrt((x.float() ** 2).sum(-1, keepdim=True) + L2_EPS) for x in (q, k))
        q_unit = q_unit / DIM**0.5
    return {
        "q": q,
        "k": k,
        "q_unit": q_unit,
        "k_unit": k_unit,
        "v": v,
        "g": -0.05 * F.softplus(2 * gates[:, :HEADS]),  # mild decay: a state still counts a chunk later
        "beta": torch.sigmoid(gates[:, HEADS:]),
        "state": torch.randn(slots, HEADS, DIM, DIM, generator=gen) * 0.3,
    }


def rows_of(data: dict, rows: list[int]) -> dict:
    """The inputs of the listed rows (a new call's batch), the state pool as it is."""
    return {n: t if n == "state" else t[rows] for n, t in data.items()}


def chunked(fn, data: dict, runs: list[Run], out_dtype=torch.float32, keep: dict[int, int] | None = None, kept=0):
    """`fn` (the kernel or its reference) over `runs` on a copy of the pool; (out with NaN where not written, pool,
    kept states or None); `keep` maps a row to its place among `kept` kept states."""
    rows = data["v"].shape[0]
    state = data["state"].clone()
    out = torch.full(data["v"].shape, float("nan"), dtype=out_dtype)
    places = states = None
    if keep is not None:
        places = torch.full((rows,), -1, dtype=torch.int32)
        places[list(keep)] = torch.tensor(list(keep.values()), dtype=torch.int32)
        states = torch.full((kept, HEADS, DIM, DIM), float("nan"))
    plan = plan_chunks(runs, rows, "cpu")
    fn(data["q_unit"], data["k_unit"], data["v"], data["g"], data["beta"], state, plan, out, places, states)
    return out, state, states


def recurrence(data: dict, runs: list[Run]):
    """The row-by-row reference over the runs' rows (each run all chunks); (out, pool, state after every row)."""
    rows = data["v"].shape[0]
    lanes = torch.full((rows,), -1, dtype=torch.int32)
    for first, length, _, slot in runs:
        lanes[first : first + length] = slot
    state = data["state"].clone()
    out, states = gdn_recurrent_reference(
        data["q"], data["k"], data["v"], data["g"], data["beta"], state, lanes, keep_states=True
    )
    return out, state, states


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


RUNS: list[Run] = [(0, CHUNK, 0, 2), (CHUNK, 2 * CHUNK, 5 * CHUNK, 0), (3 * CHUNK, 3 * CHUNK, 0, 3)]


def test_matches_the_recurrence() -> None:
    """Runs of 1, 2 and 3 chunks (GQA 2), bf16 or fp32 v, give the recurrence's outputs and final states to fp32
    rounding, from q and k that `unit_qk` made unit."""
    data = make_inputs(6 * CHUNK, seed=1, unit_kernel=True)
    for v_dtype in (torch.bfloat16, torch.float32):
        wide = torch.zeros(6 * CHUNK, HEADS, 3 * DIM, dtype=v_dtype)
        wide[:, :, DIM : 2 * DIM] = data["v"]
        data["v"] = wide[:, :, DIM : 2 * DIM]
        out, state, _ = chunked(gdn_chunked, data, RUNS)
        ref_out, ref_state, _ = recurrence(data, RUNS)
        for first, length, _, slot in RUNS:
            rows = slice(first, first + length)
            assert rel(out[rows], ref_out[rows]) <= 1e-5, (v_dtype, first, length)
            assert rel(state[slot], ref_state[slot]) <= 1e-5, (v_dtype, first, length)
        assert torch.equal(state[1], data["state"][1]), "a slot no run names must not change"


def test_nearly_parallel_keys_match_the_recurrence() -> None:
    """Nearly parallel keys, no decay and beta near 1 (T far from I, in its diagonal blocks and below them): the
    recurrence's outputs and state to fp32 rounding."""
    data = make_inputs(CHUNK, seed=6)
    gen = torch.Generator().manual_seed(6)
    data["k"] = (data["k"][:1].float() + 0.1 * torch.randn(data["k"].shape, generator=gen)).bfloat16()
    data["q_unit"], data["k_unit"] = unit_qk(data["q"], data["k"])
    data["g"] = torch.zeros_like(data["g"])
    data["beta"] = torch.full_like(data["beta"], 0.99)
    runs: list[Run] = [(0, CHUNK, 0, 0)]
    out, state, _ = chunked(gdn_chunked, data, runs)
    ref_out, ref_state, _ = recurrence(data, runs)
    assert rel(out, ref_out) <= 1e-5 and rel(state[0], ref_state[0]) <= 1e-5


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_matches_the_chunked_reference(out_dtype: torch.dtype) -> None:
    """The kernel and its torch reference agree on outputs, final and kept states (same maths, other sum orders)."""
    data = make_inputs(6 * CHUNK, seed=2)
    keep = {CHUNK - 1: 2, 3 * CHUNK - 1: 0, 5 * CHUNK - 1: 1}
    out, state, states = chunked(gdn_chunked, data, RUNS, out_dtype, keep, kept=3)
    ref_out, ref_state, ref_states = chunked(gdn_chunked_reference, data, RUNS, out_dtype, keep, kept=3)
    assert out.dtype == out_dtype and not out.isnan().any()
    assert rel(out.float(), ref_out.float()) <= (1e-6 if out_dtype == torch.float32 else 1e-2)
    assert rel(state, ref_state) <= 1e-6
    assert rel(states, ref_states) <= 1e-6


def test_a_run_has_the_same_bits_alone_and_among_others() -> None:
    """A 2-chunk run gives the same bits alone and behind other runs, at another row, with another slot beside; rows
    no chunk takes (an unaligned run, a run's tail) and slots no run names are left alone."""
    data = make_inputs(7 * CHUNK, seed=3, slots=5)
    alone_rows = list(range(4 * CHUNK + 10, 6 * CHUNK + 10))
    alone = chunked(gdn_chunked, rows_of(data, alone_rows), [(0, 2 * CHUNK, 3 * CHUNK, 4)])
    runs = [(0, CHUNK + 7, 0, 1), (CHUNK + 7, 3 * CHUNK + 3, 13, 2), (4 * CHUNK + 10, 2 * CHUNK, 3 * CHUNK, 4)]
    mixed = chunked(gdn_chunked, data, runs, keep={6 * CHUNK + 9: 0}, kept=1)
    assert torch.equal(alone[0], mixed[0][alone_rows])
    assert torch.equal(alone[1][4], mixed[1][4])
    assert torch.equal(mixed[2][0], mixed[1][4]), "the kept state after the run's last chunk is its final state"
    covered = chunked_rows(runs)
    assert covered == [*range(CHUNK), *alone_rows]
    others = [r for r in range(7 * CHUNK) if r not in covered]
    assert mixed[0][others].isnan().all() and not mixed[0][covered].isnan().any()
    for slot in (0, 2, 3):
        assert torch.equal(mixed[1][slot], data["state"][slot]), slot


def test_one_call_or_two_give_the_same_bits() -> None:
    """A 3-chunk run in one call, or a 1-chunk call then a 2-chunk call from the state it wrote: the same bits."""
    data = make_inputs(3 * CHUNK, seed=4)
    whole = chunked(gdn_chunked, data, [(0, 3 * CHUNK, 0, 1)])
    first = chunked(gdn_chunked, rows_of(data, list(range(CHUNK))), [(0, CHUNK, 0, 1)])
    rest = rows_of(data, list(range(CHUNK, 3 * CHUNK))) | {"state": first[1]}
    second = chunked(gdn_chunked, rest, [(0, 2 * CHUNK, CHUNK, 1)])
    assert torch.equal(whole[0], torch.cat([first[0], second[0]]))
    assert torch.equal(whole[1], second[1])


def test_kept_states_are_the_states_at_chunk_ends() -> None:
    """States kept at chunk ends match the recurrence's state after that row and are the bits of a call that stops
    there; a place on a row inside a chunk is not written (only chunk ends can be kept)."""
    data = make_inputs(3 * CHUNK, seed=5)
    runs: list[Run] = [(0, 3 * CHUNK, 0, 2)]
    keep = {2 * CHUNK - 1: 0, CHUNK - 1: 2, CHUNK + 5: 1}
    _, state, states = chunked(gdn_chunked, data, runs, keep=keep, kept=3)
    _, _, ref_states = recurrence(data, runs)
    assert rel(states[2], ref_states[CHUNK - 1]) <= 1e-5
    assert rel(states[0], ref_states[2 * CHUNK - 1]) <= 1e-5
    assert states[1].isnan().all()
    for chunks in (1, 2):
        part = chunked(gdn_chunked, rows_of(data, list(range(chunks * CHUNK))), [(0, chunks * CHUNK, 0, 2)])
        assert torch.equal(part[1][2], states[2 if chunks == 1 else 0]), chunks
    assert not state.isnan().any()


def test_plan_takes_whole_chunks_of_aligned_runs() -> None:
    """Unaligned runs take no chunks; a 130-row aligned run takes two; sizes follow the call's rows alone."""
    plan = plan_chunks([(0, 200, 3, 0), (200, 100, 65, 1)], 300, "cpu")
    assert plan.chunk_rows.tolist() == [-1] * 4 and plan.runs[:, 1].tolist() == [0] * 4
    plan = plan_chunks([(5, 130, 2 * CHUNK, 3), (135, 20, 0, 1)], 300, "cpu")
    assert plan.chunk_rows.tolist() == [5, 5 + CHUNK, -1, -1]
    assert plan.runs.tolist() == [[5, 2, 3], [0, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert plan.chunk_rows.dtype == plan.runs.dtype == torch.int32
    assert chunked_rows([(5, 130, 2 * CHUNK, 3), (135, 20, 0, 1)]) == list(range(5, 5 + 2 * CHUNK))
    for rows, size in ((0, 1), (10, 1), (CHUNK, 1), (4 * CHUNK - 1, 3), (4 * CHUNK, 4)):
        empty = plan_chunks([], rows, "cpu")
        assert empty.chunk_rows.shape == (size,) and empty.runs.shape == (size, 3), rows
    with pytest.raises(ValueError, match="runs"):
        plan_chunks([(10, CHUNK, 0, 0)], CHUNK, "cpu")


def test_bad_inputs_are_refused_by_name() -> None:
    data = make_inputs(CHUNK)
    q_unit, k_unit = data["q_unit"], data["k_unit"]
    args = {
        "q_unit": q_unit,
        "k_unit": k_unit,
        "v": data["v"],
        "g": data["g"],
        "beta": data["beta"],
        "state": data["state"],
        "plan": plan_chunks([(0, CHUNK, 0, 0)], CHUNK, "cpu"),
        "out": torch.empty(CHUNK, HEADS, DIM),
    }
    bad = {
        "q_unit": q_unit.bfloat16(),
        "k_unit": k_unit[:, :, :8].contiguous(),
        "v": data["v"].half(),
        "g": data["g"][:, :2],
        "beta": data["beta"].double(),
        "state": data["state"].transpose(2, 3),
        "out": torch.empty(CHUNK, HEADS, DIM, dtype=torch.float16),
        "plan": ChunkPlan(torch.zeros(2, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.int32)),
    }
    for name, value in bad.items():
        with pytest.raises(ValueError, match=name):
            gdn_chunked(**(args | {name: value}))
    places = torch.full((CHUNK,), -1, dtype=torch.int32)
    with pytest.raises(ValueError, match="keep_places"):
        gdn_chunked(**args, keep_places=places)
    with pytest.raises(ValueError, match="keep_places"):
        gdn_chunked(**args, keep_places=places.long(), states_out=torch.empty(1, HEADS, DIM, DIM))
    with pytest.raises(ValueError, match="states_out"):
        gdn_chunked(**args, keep_places=places, states_out=torch.empty(1, HEADS, DIM, 2 * DIM))
    with pytest.raises(ValueError, match="Dk"):
        odd = {"q_unit": q_unit[:, :, :12].contiguous(), "k_unit": k_unit[:, :, :12].contiguous()}
        gdn_chunked(**(args | odd))


def test_head_dims_of_several_tiles_match_the_chunked_reference() -> None:
    """Dk = Dv = 128 (the model's): eight DOT_K steps over Dk, four PREPARE_COLUMNS columns of u and w, four scan
    tiles of BLOCK_V; one chunk's outputs and the final state match the reference."""
    heads, dim = 1, 128
    assert dim > 2 * max(DOT_K, PREPARE_COLUMNS, BLOCK_V)
    gen = torch.Generator().manual_seed(110)
    q, k = (torch.randn(CHUNK, 1, dim, generator=gen) for _ in range(2))
    q_unit = q * torch.rsqrt((q**2).sum(-1, keepdim=True) + L2_EPS) / dim**0.5
    k_unit = k * torch.rsqrt((k**2).sum(-1, keepdim=True) + L2_EPS)
    v = torch.randn(CHUNK, heads, dim, generator=gen).bfloat16()
    g = -0.05 * F.softplus(2 * torch.randn(CHUNK, heads, generator=gen))
    beta = torch.sigmoid(torch.randn(CHUNK, heads, generator=gen))
    state = torch.randn(2, heads, dim, dim, generator=gen) * 0.3
    plan = plan_chunks([(0, CHUNK, 0, 1)], CHUNK, "cpu")
    results = []
    for fn in (gdn_chunked, gdn_chunked_reference):
        pool, out = state.clone(), torch.full((CHUNK, heads, dim), float("nan"))
        fn(q_unit, k_unit, v, g, beta, pool, plan, out, None, None)
        results.append((out, pool))
    (out, pool), (ref_out, ref_pool) = results
    assert not out.isnan().any()
    assert rel(out, ref_out) <= 1e-6 and rel(pool, ref_pool) <= 1e-6
    assert torch.equal(pool[0], state[0])
