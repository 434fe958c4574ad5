"""The QSA indexer compiled on a GPU at the real per-rank shapes, on scores with many exact ties: every row's
selection equals the torch reference's (ties to the lower block), alone, in batches and replayed in a graph; the
attention's output gate in its merge launch has `sigmoid_mul`'s bits; completed blocks averaged in the pool equal
those gathered."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kernels import qsa
from kernels.gates import sigmoid_mul
from kernels.norm import block_mean
from kernels.qsa import qsa_index, qsa_index_reference, qsa_sparse_attention

HI, DI, RATIO, TOP = 4, 128, 4, 512
HQ, HKV, D = 12, 1, 256  # one rank's query and kv heads at tp=2

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels"),
]


def grid(shape: tuple[int, ...], gen: torch.Generator, steps: int) -> torch.Tensor:
    """bf16 multiples of 1/steps in [-1, 1]: fp32 scores are exact sums, and many tie."""
    return (torch.randint(-steps, steps + 1, shape, device="cuda", generator=gen) / steps).bfloat16()


@pytest.mark.parametrize("context", [2_051, 8_192, 32_768])
@pytest.mark.parametrize("steps", [1, 4])
def test_selection_equals_the_reference_and_each_row_alone(context: int, steps: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(context + steps)
    lanes = 8
    keys = grid((lanes, context // RATIO, DI), gen, steps)
    keys[1, 100:] = keys[1, 7]  # a lane where nearly every block ties
    q = grid((3 * lanes, HI, DI), gen, steps)
    rows_lanes = torch.arange(3 * lanes, device="cuda", dtype=torch.int32) % lanes
    positions = torch.randint(0, context, (3 * lanes,), device="cuda", generator=gen, dtype=torch.int32)
    positions[:lanes] = context - 1
    idx, counts = qsa_index(q, keys, rows_lanes, positions, RATIO, TOP)
    ref, ref_counts = qsa_index_reference(q, keys, rows_lanes, positions, RATIO, TOP)
    assert torch.equal(counts, ref_counts)
    assert torch.equal(idx, ref)
    for t in (0, 1, 5, 3 * lanes - 1):
        one, one_count = qsa_index(q[t : t + 1], keys, rows_lanes[t : t + 1], positions[t : t + 1], RATIO, TOP)
        assert torch.equal(one[0], idx[t]) and int(one_count[0]) == int(counts[t])


def test_the_indexer_in_a_graph_selects_anew_at_each_replay_and_leaves_its_pool_zero() -> None:
    """Captured in a CUDA graph on a stream of its own, the indexer (its histograms and counters from that stream's
    zeroed pool, no memset) gives the reference's selection at each replay over new inputs, and leaves the pool
    zero."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    lanes, context, rows = 8, 8_192, 16
    keys = grid((lanes, context // RATIO, DI), gen, 4)
    q = grid((rows, HI, DI), gen, 4)
    row_lanes = torch.arange(rows, device="cuda", dtype=torch.int32) % lanes
    positions = torch.full((rows,), context - 1, device="cuda", dtype=torch.int32)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        qsa_index(q, keys, row_lanes, positions, RATIO, TOP)  # compiles, and makes this stream's pool
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            idx, counts = qsa_index(q, keys, row_lanes, positions, RATIO, TOP)
        pool = qsa._ZEROED.get(q.device, 0)
    torch.cuda.current_stream().wait_stream(stream)
    for replay in range(3):
        keys.copy_(grid(tuple(keys.shape), gen, 4 + replay))
        q.copy_(grid(tuple(q.shape), gen, 4 + replay))
        positions.copy_(torch.randint(TOP * RATIO + RATIO, context, (rows,), device="cuda", generator=gen))
        graph.replay()
        ref, ref_counts = qsa_index_reference(q, keys, row_lanes, positions, RATIO, TOP)
        assert torch.equal(idx, ref) and torch.equal(counts, ref_counts), f"replay {replay}"
        assert not pool.any(), f"replay {replay}"


@pytest.mark.parametrize("rows", [1, 4, 64])
def test_the_gate_in_the_merge_has_the_bits_of_sigmoid_mul_after_it(rows: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(rows)
    lanes, context = 8, 4_096
    keys = torch.randn((lanes, context // RATIO, DI), device="cuda", generator=gen).bfloat16()
    k_cache = torch.randn((lanes, context, HKV, D), device="cuda", generator=gen).bfloat16()
    v_cache = torch.randn((lanes, context, HKV, D), device="cuda", generator=gen).bfloat16()
    q = torch.randn((rows, HQ, D), device="cuda", generator=gen).bfloat16()
    gate = (4 * torch.randn((rows, HQ, 2 * D), device="cuda", generator=gen)).bfloat16().chunk(2, dim=-1)[1]
    row_lanes = torch.arange(rows, device="cuda", dtype=torch.int32) % lanes
    positions = torch.randint(0, context, (rows,), device="cuda", generator=gen, dtype=torch.int32)
    idx, counts = qsa_index(grid((rows, HI, DI), gen, 4), keys, row_lanes, positions, RATIO, TOP)
    out = qsa_sparse_attention(q, k_cache, v_cache, row_lanes, idx, counts)
    gated = qsa_sparse_attention(q, k_cache, v_cache, row_lanes, idx, counts, gate=gate)
    assert torch.equal(gated.view(torch.int16), sigmoid_mul(out, gate).view(torch.int16))
    one = qsa_sparse_attention(q[-1:], k_cache, v_cache, row_lanes[-1:], idx[-1:], counts[-1:], gate=gate[-1:])
    assert torch.equal(one.view(torch.int16), gated[-1:].view(torch.int16))


@pytest.mark.parametrize("blocks", [1, 5, 64])
def test_block_means_read_in_the_pool_equal_those_of_the_rows_gathered(blocks: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(blocks)
    lanes, context = 8, 4_096
    raw_keys = torch.randn((lanes, context, DI), device="cuda", generator=gen).bfloat16()
    slots = torch.randint(0, lanes, (blocks,), device="cuda", generator=gen)
    firsts = torch.randint(0, context // RATIO, (blocks,), device="cuda", generator=gen) * RATIO
    gathered = raw_keys[slots[:, None], firsts[:, None] + torch.arange(RATIO, device="cuda")].flatten(0, 1)
    in_place = block_mean(raw_keys, RATIO, slots=slots, firsts=firsts)
    assert torch.equal(in_place.view(torch.int16), block_mean(gathered, RATIO).view(torch.int16))
