"""QSA indexer and sparse attention kernels against their torch references and the model's math, in the interpreter."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

from types import SimpleNamespace

import pytest
import torch

import kernels.qsa as qsa
from kernels.gates import sigmoid_mul
from model.ops import masked_attention
from model.qsa import QSAIndexer
from tests.kernels.sentinels import outputs_with_slack, untouched

HQ, HKV, D, HI, DI, RATIO, TOP = 4, 2, 16, 2, 8, 2, 3
LANES, CONTEXT = 3, 40


def _grid_values(shape: tuple[int, ...], gen: torch.Generator, steps: int = 2) -> torch.Tensor:
    """bf16 values on a coarse grid (multiples of 1/steps in [-1, 1]): exact fp32 scores and many ties."""
    return (torch.randint(-steps, steps + 1, shape, generator=gen) / steps).bfloat16()


def _index_inputs(gen: torch.Generator, rows: int) -> tuple[torch.Tensor, ...]:
    """Index queries, block keys with deliberate ties (lane 2: all keys equal), lanes and positions."""
    q = _grid_values((rows, HI, DI), gen)
    keys = _grid_values((LANES, CONTEXT // RATIO, DI), gen)
    keys[0, 7] = keys[0, 2]
    keys[0, 11] = keys[0, 2]
    keys[1, 4:] = keys[1, 3]
    keys[2] = keys[2, 0]
    lanes = torch.arange(rows) % LANES
    positions = torch.randint(0, CONTEXT, (rows,), generator=gen)
    positions[:4] = torch.tensor([0, 1, 6, 7])
    return q, keys, lanes, positions


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def test_index_matches_reference_and_ties_go_to_the_lower_block() -> None:
    gen = torch.Generator().manual_seed(0)
    q, keys, lanes, positions = _index_inputs(gen, 9)
    positions[6:9] = torch.tensor([39, 38, 30])
    idx, counts = qsa.qsa_index(q, keys, lanes, positions, RATIO, TOP)
    ref, ref_counts = qsa.qsa_index_reference(q, keys, lanes, positions, RATIO, TOP)
    assert idx.dtype == torch.int32 and idx.shape == (9, TOP * RATIO + RATIO - 1)
    assert torch.equal(idx, ref) and torch.equal(counts, ref_counts)
    # lane 2 has one key repeated: every score ties, so the first TOP blocks win, then the tail
    assert idx[8].tolist() == [0, 1, 2, 3, 4, 5, 30]
    for t in range(9):
        end = int(positions[t]) + 1
        n = int(counts[t])
        assert n == min(end // RATIO, TOP) * RATIO + end % RATIO
        assert (idx[t, n:] == -1).all() and (idx[t, :n].diff() > 0).all() and int(idx[t, n - 1]) <= end - 1


def test_index_ties_at_the_cut_keep_the_lowest_indices() -> None:
    q = torch.ones(1, HI, DI, dtype=torch.bfloat16)
    keys = torch.zeros(1, 10, DI, dtype=torch.bfloat16)
    keys[0, :, 0] = torch.tensor([1.0, 3.0, 2.0, 2.0, 3.0, 2.0, 0.5, 2.0, 3.0, 2.0]).bfloat16()
    idx, _ = qsa.qsa_index(q, keys, torch.zeros(1), torch.tensor([19]), RATIO, 5)
    # three 3.0s (blocks 1, 4, 8) then the two lowest of the 2.0 ties (blocks 2, 3)
    assert idx[0].tolist()[:10] == [2, 3, 4, 5, 6, 7, 8, 9, 16, 17]
    ref, _ = qsa.qsa_index_reference(q, keys, torch.zeros(1), torch.tensor([19]), RATIO, 5)
    assert torch.equal(idx, ref)


def test_index_across_many_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiles of 4 blocks: a row's last arrival resolves each pass, tiles past a row's visible blocks arriving too
    (row 6: 13 visible blocks of lane 0's random keys, whose scores need every pass)."""
    monkeypatch.setattr(qsa, "SELECT_TILE", 4)
    monkeypatch.setattr(qsa, "SCORE_TILE", 4)
    gen = torch.Generator().manual_seed(1)
    q, keys, lanes, positions = _index_inputs(gen, 7)
    keys[0] = torch.randn(CONTEXT // RATIO, DI, generator=gen).bfloat16()
    keys[0, 6] = keys[0, 1]
    positions[4:] = torch.tensor([39, 33, 25])
    idx, counts = qsa.qsa_index(q, keys, lanes, positions, RATIO, 5)
    ref, ref_counts = qsa.qsa_index_reference(q, keys, lanes, positions, RATIO, 5)
    assert torch.equal(idx, ref) and torch.equal(counts, ref_counts)


def test_index_calls_leave_the_pooled_histograms_zero_and_pool_rows_beyond_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The histograms and arrival counters come zeroed from a pool that each call's resolves leave zero, so calls one
    after the other each match the reference (many tiles, every pass); more rows than the pool holds get their own."""
    monkeypatch.setattr(qsa, "SELECT_TILE", 4)
    monkeypatch.setattr(qsa, "SCORE_TILE", 4)
    monkeypatch.setattr(qsa, "POOLED_ROWS", 5)
    gen = torch.Generator().manual_seed(4)
    for rows in (5, 4, 6, 5):
        q, keys, lanes, positions = _index_inputs(gen, rows)
        keys[0] = torch.randn(CONTEXT // RATIO, DI, generator=gen).bfloat16()
        positions[0] = 39
        idx, counts = qsa.qsa_index(q, keys, lanes, positions, RATIO, 5)
        ref, ref_counts = qsa.qsa_index_reference(q, keys, lanes, positions, RATIO, 5)
        assert torch.equal(idx, ref) and torch.equal(counts, ref_counts), rows
        pool = qsa._ZEROED.get(torch.device("cpu"), 0)
        assert not pool.any(), rows


def test_index_matches_the_model_selection_mask() -> None:
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(4, HI, DI, generator=gen).bfloat16()
    length = 37
    keys = torch.randn(length // RATIO, DI, generator=gen).bfloat16()
    positions = torch.arange(length - 4, length)
    indexer = SimpleNamespace(ratio=RATIO, top_blocks=TOP, dim=DI)
    mask = QSAIndexer.select(indexer, q, keys, positions, length)
    idx, counts = qsa.qsa_index(q, keys[None], torch.zeros(4), positions, RATIO, TOP)
    ours = torch.zeros_like(mask)
    for t in range(4):
        ours[t, idx[t, : int(counts[t])].long()] = True
    assert torch.equal(ours, mask)


def test_index_rows_are_batch_invariant() -> None:
    gen = torch.Generator().manual_seed(3)
    q, keys, lanes, positions = _index_inputs(gen, 5)
    positions[4] = 35
    idx, counts = qsa.qsa_index(q, keys, lanes, positions, RATIO, TOP)
    for t in range(5):
        one, one_count = qsa.qsa_index(q[t : t + 1], keys, lanes[t : t + 1], positions[t : t + 1], RATIO, TOP)
        assert torch.equal(one[0], idx[t]) and int(one_count[0]) == int(counts[t])


def test_index_radix_passes_count_the_last_block_of_a_row() -> None:
    """Scores that share their top 11 bits need every radix pass; a row whose position completes a block (p + 1 a
    multiple of the ratio) counts that last block in each pass as in the first (rows of TOP + 1 and TOP + 2 blocks,
    the best last), as the reference's top-k does."""
    q = torch.ones(3, HI, DI, dtype=torch.bfloat16)
    keys = torch.zeros(1, 5, DI, dtype=torch.bfloat16)
    keys[0, :, 0] = 1 + torch.arange(5) / 128  # scores 0.707..0.729: one top digit, five second digits
    lanes, positions = torch.zeros(3), torch.tensor([9, 7, 3])
    idx, counts = qsa.qsa_index(q, keys, lanes, positions, RATIO, TOP)
    ref, ref_counts = qsa.qsa_index_reference(q, keys, lanes, positions, RATIO, TOP)
    assert torch.equal(idx, ref) and torch.equal(counts, ref_counts)


def test_index_stores_nothing_past_its_rows() -> None:
    """No program stores past a row of the index or past a row's block scores: with the index [5, width] and the
    score scratch [5, blocks] made inside longer buffers, the elements after them keep their bits. (A store past a row
    lands in the next row's first elements, which on the CPU the next row's programs overwrite and on a GPU race;
    past the last row it shows here.)"""
    gen = torch.Generator().manual_seed(11)
    q, keys, lanes, positions = _index_inputs(gen, 5)
    positions[4] = CONTEXT - 1  # the last row needs a top-k
    shapes = ((5, qsa.index_width(RATIO, TOP)), (5, keys.shape[1]))
    with outputs_with_slack(shapes, 64) as slack:
        idx, counts = qsa.qsa_index(q, keys, lanes, positions, RATIO, TOP)
    assert len(slack) == 2 and untouched(slack)
    ref, ref_counts = qsa.qsa_index_reference(q, keys, lanes, positions, RATIO, TOP)
    assert torch.equal(idx, ref) and torch.equal(counts, ref_counts)


def _attention_inputs(
    gen: torch.Generator, rows: int, top: int, context: int, positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    """Queries, per-lane K/V caches and the kernel indexer's selection for random rows (at `positions` if given)."""
    q = torch.randn(rows, HQ, D, generator=gen).bfloat16()
    k_cache = torch.randn(LANES, context, HKV, D, generator=gen).bfloat16()
    v_cache = torch.randn(LANES, context, HKV, D, generator=gen).bfloat16()
    q_idx = torch.randn(rows, HI, DI, generator=gen).bfloat16()
    keys = torch.randn(LANES, context // RATIO, DI, generator=gen).bfloat16()
    lanes = torch.arange(rows) % LANES
    if positions is None:
        positions = torch.randint(0, context, (rows,), generator=gen)
        positions[0] = 0
    idx, counts = qsa.qsa_index(q_idx, keys, lanes, positions, RATIO, top)
    return q, k_cache, v_cache, lanes, idx, counts


def test_attention_matches_reference() -> None:
    gen = torch.Generator().manual_seed(4)
    q, k_cache, v_cache, lanes, idx, counts = _attention_inputs(gen, 6, TOP, CONTEXT)
    out = qsa.qsa_sparse_attention(q, k_cache, v_cache, lanes, idx, counts)
    ref = qsa.qsa_sparse_attention_reference(q, k_cache, v_cache, lanes, idx, counts)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    assert not out.isnan().any()
    assert _rel(out, ref) <= 1e-2
    assert torch.allclose(out[0].float(), v_cache[0, 0].float().repeat_interleave(HQ // HKV, 0), atol=1e-2)


def test_attention_over_several_chunks() -> None:
    gen = torch.Generator().manual_seed(5)
    q, k_cache, v_cache, lanes, idx, counts = _attention_inputs(gen, 4, 20, 64)
    assert int(counts.max()) > 32
    out = qsa.qsa_sparse_attention(q, k_cache, v_cache, lanes, idx, counts, split=16, block_n=16)
    ref = qsa.qsa_sparse_attention_reference(q, k_cache, v_cache, lanes, idx, counts)
    assert not out.isnan().any() and _rel(out, ref) <= 1e-2


def test_attention_matches_the_model_masked_attention() -> None:
    gen = torch.Generator().manual_seed(6)
    length = CONTEXT
    q = torch.randn(4, HQ, D, generator=gen).bfloat16()
    k = torch.randn(length, HKV, D, generator=gen).bfloat16()
    v = torch.randn(length, HKV, D, generator=gen).bfloat16()
    q_idx = torch.randn(4, HI, DI, generator=gen).bfloat16()
    keys = torch.randn(length // RATIO, DI, generator=gen).bfloat16()
    positions = torch.arange(length - 4, length)
    mask = QSAIndexer.select(SimpleNamespace(ratio=RATIO, top_blocks=TOP, dim=DI), q_idx, keys, positions, length)
    ref = masked_attention(q, k, v, mask, D**-0.5, positions + 1)
    lanes = torch.zeros(4)
    idx, counts = qsa.qsa_index(q_idx, keys[None], lanes, positions, RATIO, TOP)
    out = qsa.qsa_sparse_attention(q, k[None], v[None], lanes, idx, counts)
    assert _rel(out, ref) <= 1e-2


def test_attention_rows_are_batch_invariant() -> None:
    gen = torch.Generator().manual_seed(7)
    q, k_cache, v_cache, lanes, idx, counts = _attention_inputs(gen, 5, TOP, CONTEXT)
    out = qsa.qsa_sparse_attention(q, k_cache, v_cache, lanes, idx, counts)
    for t in range(5):
        one = qsa.qsa_sparse_attention(
            q[t : t + 1], k_cache, v_cache, lanes[t : t + 1], idx[t : t + 1], counts[t : t + 1]
        )
        assert torch.equal(one[0].view(torch.int16), out[t].view(torch.int16))


@pytest.mark.parametrize("chunked", [False, True])
def test_a_gated_attention_has_the_bits_of_sigmoid_mul_after_it(chunked: bool) -> None:
    """The output gate in the merge launch: a strided gate (each head's second half of a fused projection, as the
    model's) gives the bits of `sigmoid_mul` over the ungated output, over one chunk of keys or several."""
    gen = torch.Generator().manual_seed(9)
    q, k_cache, v_cache, lanes, idx, counts = _attention_inputs(gen, 5, 20 if chunked else TOP, 64)
    fused = (4 * torch.randn(5, HQ, 2 * D, generator=gen)).bfloat16()
    gate = fused.chunk(2, dim=-1)[1]
    assert not gate.is_contiguous()
    tiles = {"split": 16, "block_n": 16} if chunked else {}
    out = qsa.qsa_sparse_attention(q, k_cache, v_cache, lanes, idx, counts, **tiles)
    gated = qsa.qsa_sparse_attention(q, k_cache, v_cache, lanes, idx, counts, gate=gate, **tiles)
    want = sigmoid_mul(out, gate)
    assert torch.equal(gated.view(torch.int16), want.view(torch.int16))
    assert not torch.equal(gated, out)


def test_attention_refuses_a_gate_unlike_q() -> None:
    gen = torch.Generator().manual_seed(10)
    q, k_cache, v_cache, lanes, idx, counts = _attention_inputs(gen, 2, TOP, CONTEXT)
    for gate in (q[:1], q.float(), q.transpose(1, 2).contiguous().transpose(1, 2)):
        with pytest.raises(ValueError, match="gate"):
            qsa.qsa_sparse_attention(q, k_cache, v_cache, lanes, idx, counts, gate=gate)
    half = q.half()  # sigmoid_mul has no fp16 form to match
    with pytest.raises(ValueError, match="gate needs bf16 or fp32"):
        qsa.qsa_sparse_attention(half, k_cache.half(), v_cache.half(), lanes, idx, counts, gate=half)


def test_attention_over_several_key_tiles_of_one_chunk() -> None:
    """Chunks of 64 selected keys taken 16 at a time: rows of more than 48 keys run four inner steps of one chunk,
    and match the reference."""
    gen = torch.Generator().manual_seed(90)
    q, k_cache, v_cache, lanes, idx, counts = _attention_inputs(gen, 4, 30, 64, torch.tensor([63, 60, 50, 9]))
    assert int(counts.max()) > 3 * 16
    out = qsa.qsa_sparse_attention(q, k_cache, v_cache, lanes, idx, counts, split=64, block_n=16)
    ref = qsa.qsa_sparse_attention_reference(q, k_cache, v_cache, lanes, idx, counts)
    assert not out.isnan().any() and _rel(out, ref) <= 1e-2


def test_attention_merges_only_the_chunks_that_hold_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows whose key count is a multiple of the chunk leave the index's later chunks unwritten, and the merge reads
    none of them: with the fp32 scratch filled with NaN, every output keeps the bits of a plain call."""
    gen = torch.Generator().manual_seed(12)
    q, k_cache, v_cache, lanes, idx, counts = _attention_inputs(gen, 4, 20, 64, torch.tensor([31, 15, 62, 9]))
    tiles = {"split": 16, "block_n": 16}
    assert int((counts % 16 == 0).sum()) == 2 and idx.shape[1] > 32
    plain = qsa.qsa_sparse_attention(q, k_cache, v_cache, lanes, idx, counts, **tiles)
    real_empty = torch.empty

    def empty(*size, **kwargs):
        """The fp32 scratch, filled with NaN."""
        out = real_empty(*size, **kwargs)
        return out.fill_(float("nan")) if out.dtype == torch.float32 else out

    with monkeypatch.context() as patched:
        patched.setattr(torch, "empty", empty)
        got = qsa.qsa_sparse_attention(q, k_cache, v_cache, lanes, idx, counts, **tiles)
    assert torch.equal(got.view(torch.int16), plain.view(torch.int16))


def test_attention_stores_nothing_past_its_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """No merge program stores a head past its kv head's query group: with the output made inside a longer buffer,
    the elements after it keep their bits. (A store past a group lands in the next group's or row's heads, which on
    the CPU a later program overwrites and on a GPU races; past the last row it shows here.)"""
    gen = torch.Generator().manual_seed(13)
    q, k_cache, v_cache, lanes, idx, counts = _attention_inputs(gen, 3, TOP, CONTEXT)
    slack, real_empty_like = [], torch.empty_like

    def empty_like(x: torch.Tensor, **kwargs) -> torch.Tensor:
        """The output as the start of a buffer with 16 heads of sentinel elements after it."""
        if x is not q:
            return real_empty_like(x, **kwargs)
        buf = torch.full((q.numel() + 16 * D,), -7.0, dtype=q.dtype)
        slack.append(buf[q.numel() :])
        return buf[: q.numel()].view(q.shape)

    with monkeypatch.context() as patched:
        patched.setattr(torch, "empty_like", empty_like)
        got = qsa.qsa_sparse_attention(q, k_cache, v_cache, lanes, idx, counts)
    assert len(slack) == 1 and torch.equal(slack[0], torch.full_like(slack[0], -7.0))
    assert _rel(got, qsa.qsa_sparse_attention_reference(q, k_cache, v_cache, lanes, idx, counts)) <= 1e-2


def test_attention_reads_no_cache_position_it_does_not_select() -> None:
    """Keys and values at the positions no row selects are never read: with them all NaN (a lane's token 0 among
    them, where a key tile's unused lanes point), every output keeps its bits."""
    gen = torch.Generator().manual_seed(14)
    q, k_cache, v_cache, lanes, idx, counts = _attention_inputs(gen, 3, TOP, CONTEXT, torch.tensor([39, 38, 37]))
    plain = qsa.qsa_sparse_attention(q, k_cache, v_cache, lanes, idx, counts)
    selected = torch.zeros(LANES, CONTEXT, dtype=torch.bool)
    for t in range(3):
        selected[int(lanes[t]), idx[t, : int(counts[t])].long()] = True
    assert not selected[:, 0].all()
    k_cache[~selected] = float("nan")
    v_cache[~selected] = float("nan")
    got = qsa.qsa_sparse_attention(q, k_cache, v_cache, lanes, idx, counts)
    assert torch.equal(got.view(torch.int16), plain.view(torch.int16))
