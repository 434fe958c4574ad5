"""The RoPE kernel against the model's rope, bit for bit given the same cos/sin tables; its cache writes and
`scatter_rows` against index_put."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np
import pytest
import torch

from kernels.norm import zc_rms_norm
from kernels.rope import TILE, norm_rope, rope, rope_inv_freq, rope_reference, scatter_rows
from model.ops import apply_rope, rope_cos_sin
from tests.kernels.sentinels import outputs_with_slack, untouched

MAX_POSITION = 300_000
THETA = 10_000_000.0
SHAPES = [(4, 256, 64), (1, 128, 64), (2, 64, 64), (3, 96, 48), (1, 640, 64)]  # (heads, head dim, rotary dim)
DTYPES = [torch.bfloat16, torch.float32]


def rows(*shape: int, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.Tensor:
    """Random rows in the given dtype."""
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)


def positions_of(n: int, seed: int = 0, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """n positions up to MAX_POSITION, the first MAX_POSITION and the last 0 when there are two or more."""
    pos = torch.randint(0, MAX_POSITION + 1, (n,), generator=torch.Generator().manual_seed(seed))
    if n >= 2:
        pos[0], pos[-1] = MAX_POSITION, 0
    return pos.to(dtype)


def numpy_tables(
    positions: torch.Tensor, rot: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [N, rot] as `rope_cos_sin` builds them, but with numpy's fp32 cos/sin (the interpreter's)."""
    freqs = (positions.float()[:, None] * rope_inv_freq(rot, theta, "cpu")[None, :]).numpy()
    cos, sin = torch.from_numpy(np.cos(freqs)), torch.from_numpy(np.sin(freqs))
    return torch.cat((cos, cos), -1).to(dtype), torch.cat((sin, sin), -1).to(dtype)


def check_rope(out: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, rot: int, theta: float = THETA) -> None:
    """out is the model's rope of x: bit for bit given numpy's tables, and given torch's where the two agree;
    close to it everywhere."""
    x3, out3 = (x.unsqueeze(1), out.unsqueeze(1)) if x.dim() == 2 else (x, out)
    assert out.shape == x.shape and out.dtype == x.dtype
    cos, sin = numpy_tables(positions, rot, theta, x.dtype)
    assert torch.equal(out3, apply_rope(x3, cos, sin))
    torch_cos, torch_sin = rope_cos_sin(positions, rot, theta, x.dtype)
    model = apply_rope(x3, torch_cos, torch_sin)
    agree = (cos == torch_cos) & (sin == torch_sin)
    pass_through = torch.ones(x3.shape[0], x3.shape[2] - rot, dtype=torch.bool)
    agree = torch.cat((agree, pass_through), -1)[:, None, :].expand(x3.shape)
    assert x3.numel() == 0 or agree.float().mean() > 0.5
    assert torch.equal(out3[agree], model[agree])
    tol = 5e-2 if x.dtype == torch.bfloat16 else 2e-5
    torch.testing.assert_close(out3.float(), model.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("theta", [10_000.0, THETA])
def test_reference_and_inv_freq_are_the_models(dtype: torch.dtype, theta: float) -> None:
    x, pos = rows(9, 3, 96, dtype=dtype), positions_of(9)
    model = apply_rope(x, *rope_cos_sin(pos, 48, theta, dtype))
    assert torch.equal(rope_reference(x, pos, rope_inv_freq(48, theta, "cpu")), model)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 2, 7, 33, 64])  # 33: programs of 16 rows under the interpreter, one partial
@pytest.mark.parametrize(("heads", "dim", "rot"), SHAPES)
def test_rope_matches_model(n: int, heads: int, dim: int, rot: int, dtype: torch.dtype) -> None:
    x, pos = rows(n, heads, dim, dtype=dtype), positions_of(n)
    check_rope(rope(x, pos, rope_inv_freq(rot, THETA, "cpu")), x, pos, rot)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_takes_two_dim_rows_and_int32_positions(dtype: torch.dtype) -> None:
    x, pos = rows(7, 128, dtype=dtype), positions_of(7, dtype=torch.int32)
    out = rope(x, pos, rope_inv_freq(64, THETA, "cpu"))
    check_rope(out, x, pos, 64)
    assert torch.equal(out, rope(x.unsqueeze(1), pos.long(), rope_inv_freq(64, THETA, "cpu")).squeeze(1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_takes_strided_views(dtype: torch.dtype) -> None:
    inv, pos = rope_inv_freq(64, THETA, "cpu"), positions_of(7)
    q, _ = rows(7, 4, 2 * 256, dtype=dtype).chunk(2, dim=-1)  # q of a [q | gate] projection
    index_q, _ = rows(7, 3 * 128 + 128, dtype=dtype).split([3 * 128, 128], dim=-1)  # an indexer [q | raw] projection
    index_q = index_q.unflatten(-1, (3, 128))
    heads = rows(7, 6, 128, dtype=dtype)[:, ::2]  # every other head: head stride 2·D
    for x in (q, index_q, heads):
        assert not x.is_contiguous()
        out = rope(x, pos, inv)
        assert out.is_contiguous() and torch.equal(out, rope(x.contiguous(), pos, inv))
        check_rope(out, x, pos, 64)


def test_rows_identical_across_batch_sizes() -> None:
    x, pos, inv = rows(9, 4, 256), positions_of(9), rope_inv_freq(64, THETA, "cpu")
    alone = torch.cat([rope(x[i : i + 1], pos[i : i + 1], inv) for i in range(9)])
    assert torch.equal(rope(x, pos, inv), alone)
    assert torch.equal(rope(x[2:7], pos[2:7], inv), alone[2:7])


def test_rope_writes_into_out() -> None:
    x, pos, inv = rows(7, 4, 256), positions_of(7), rope_inv_freq(64, THETA, "cpu")
    big = torch.full((7, 5, 300), 7.0, dtype=torch.bfloat16)
    out = big[:, 1:, :256]
    assert rope(x, pos, inv, out) is out
    assert torch.equal(out, rope(x, pos, inv))
    assert (big[:, 0] == 7).all() and (big[:, :, 256:] == 7).all()


def cache_rows(n: int, slots: int, context: int, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct (slot, position) pairs for n rows."""
    g = torch.Generator().manual_seed(seed)
    flat = torch.randperm(slots * context, generator=g)[:n]
    return flat // context, flat % context


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 7, 33])
def test_rope_into_cache_is_index_put_of_the_result(n: int, dtype: torch.dtype) -> None:
    inv, pos = rope_inv_freq(64, THETA, "cpu"), positions_of(n)
    slot_of_row, index = cache_rows(n, 3, 40)
    keys = rows(3, 80, 4, 128, dtype=dtype, seed=6)[:, ::2, ::2]  # a strided [slots, context, H, D] view
    x = rows(n, 4, 128, dtype=dtype)[:, ::2]
    expected = keys.clone()
    expected[slot_of_row, index] = apply_rope(x, *numpy_tables(pos, 64, THETA, dtype))
    dest = keys.clone()
    assert rope(x, pos, inv, dest=dest, slot_of_row=slot_of_row, dest_index=index) is dest
    assert torch.equal(dest, expected)
    assert torch.equal(dest[slot_of_row, index], rope(x, pos, inv))


def test_rope_into_cache_at_positions() -> None:
    inv = rope_inv_freq(64, THETA, "cpu")
    slot_of_row, pos = cache_rows(9, 4, 50)
    x = rows(9, 2, 128)
    cache = rows(4, 50, 2, 128, seed=7)
    expected = cache.clone()
    expected[slot_of_row, pos] = rope(x, pos, inv)
    rope(x, pos, inv, dest=cache, slot_of_row=slot_of_row)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("two_dim", [False, True])
def test_block_keys_into_a_one_head_cache(two_dim: bool) -> None:
    inv = rope_inv_freq(64, THETA, "cpu")
    slots, blocks = cache_rows(5, 3, 12)
    firsts = blocks * 128  # each block's first position
    pooled = rows(5, 128) if two_dim else rows(5, 1, 128)
    block_keys = rows(3, 12, 128, seed=8)
    expected = block_keys.clone()
    expected[slots, blocks] = rope(pooled, firsts, inv).view(5, 128)
    rope(pooled, firsts, inv, dest=block_keys, slot_of_row=slots, dest_index=blocks)
    assert torch.equal(block_keys, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 7, 33, 64])
def test_scatter_rows_is_index_put(n: int, dtype: torch.dtype) -> None:
    slot_of_row, pos = cache_rows(n, 4, 40)
    v = rows(n, 2, 128, dtype=dtype)
    raw = rows(n, 3 * 96 + 96, dtype=dtype, seed=2).split([3 * 96, 96], dim=-1)[1]  # strided rows [N, D]
    for cache, src in ((rows(4, 40, 2, 128, dtype=dtype, seed=3), v), (rows(4, 40, 96, dtype=dtype, seed=4), raw)):
        expected = cache.clone()
        expected[slot_of_row, pos] = src
        scatter_rows(cache, slot_of_row.int(), pos, src)
        assert torch.equal(cache, expected)


def test_rejects_bad_inputs() -> None:
    x, pos, inv = rows(3, 2, 128), positions_of(3), rope_inv_freq(64, THETA, "cpu")
    cache, slot = rows(2, 10, 2, 128), torch.tensor([0, 1, 0])
    idx = torch.tensor([0, 1, 2])
    cases = [
        (ValueError, "rotary_dim", lambda: rope_inv_freq(63, THETA, "cpu")),
        (ValueError, "x", lambda: rope(x.transpose(1, 2), pos, inv)),
        (ValueError, "x", lambda: rope(x[None], pos, inv)),
        (TypeError, "x", lambda: rope(x.half(), pos, inv)),
        (ValueError, "positions", lambda: rope(x, pos[:2], inv)),
        (TypeError, "positions", lambda: rope(x, pos.float(), inv)),
        (ValueError, "inv_freq", lambda: rope(x, pos, rope_inv_freq(258, THETA, "cpu"))),
        (TypeError, "inv_freq", lambda: rope(x, pos, inv.double())),
        (ValueError, "out", lambda: rope(x, pos, inv, torch.empty(3, 2, 64, dtype=x.dtype))),
        (ValueError, "out", lambda: rope(x, pos, inv, torch.empty(3, 2, 128), dest=cache, slot_of_row=slot)),
        (ValueError, "slot_of_row", lambda: rope(x, pos, inv, slot_of_row=slot)),
        (ValueError, "slot_of_row", lambda: rope(x, idx, inv, dest=cache)),
        (ValueError, "slot_of_row", lambda: rope(x, idx, inv, dest=cache, slot_of_row=slot[:2])),
        (ValueError, "dest", lambda: rope(x, idx, inv, dest=cache[:, :, :1], slot_of_row=slot)),
        (ValueError, "dest", lambda: rope(x, idx, inv, dest=rows(2, 10, 128), slot_of_row=slot)),
        (TypeError, "dest", lambda: rope(x, idx, inv, dest=cache.float(), slot_of_row=slot)),
        (ValueError, "dest_index", lambda: rope(x, pos, inv, dest=cache, slot_of_row=slot, dest_index=idx[:1])),
        (TypeError, "rows", lambda: scatter_rows(cache, slot, idx, x.half())),
        (ValueError, "positions", lambda: scatter_rows(cache, slot, idx[:2], x)),
        (TypeError, "slot_of_row", lambda: scatter_rows(cache, slot.float(), idx, x)),
    ]
    for error, name, call in cases:
        with pytest.raises(error, match=name):
            call()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "dim", "rot"), [(12, 256, 64), (4, 128, 64), (1, 256, 256), (3, 96, 32)])
def test_norm_rope_has_the_bits_of_the_norm_then_rope(heads: int, dim: int, rot: int, dtype: torch.dtype) -> None:
    n = 21
    fused = rows(n, heads, 3 * dim, dtype=dtype, seed=heads)
    x = fused[..., dim : 2 * dim]  # a strided view, as QSA's q is of its fused projection
    weight = rows(dim, dtype=dtype, seed=dim) * 0.1
    pos, inv = positions_of(n, seed=rot, dtype=torch.int32), rope_inv_freq(rot, THETA, "cpu")
    want = rope(zc_rms_norm(x, weight, 1e-6), pos, inv)
    got = norm_rope(x, weight, 1e-6, pos, inv)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert got.is_contiguous() and torch.equal(got.view(bits), want.view(bits))


def test_norm_rope_into_a_cache_and_with_a_weight_per_head() -> None:
    n, heads, dim = 9, 2, 128
    x = rows(n, heads, dim, seed=3)
    weight = rows(heads * dim, seed=4) * 0.1
    pos, inv = positions_of(n, seed=5), rope_inv_freq(64, THETA, "cpu")
    slots, index = torch.arange(n) % 3, torch.arange(n) // 3 + 2
    want = torch.zeros(3, 8, heads, dim, dtype=torch.bfloat16)
    rope(zc_rms_norm(x, weight, 1e-6), pos, inv, dest=want, slot_of_row=slots, dest_index=index)
    got = torch.zeros_like(want)
    assert norm_rope(x, weight, 1e-6, pos, inv, dest=got, slot_of_row=slots, dest_index=index) is got
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    one = torch.zeros(3, 8, dim, dtype=torch.bfloat16)  # a one-head cache [S, C, D], written at the positions
    norm_rope(x[:, :1], weight[:dim], 1e-6, pos % 8, inv, dest=one, slot_of_row=slots)
    want_one = torch.zeros_like(one)
    rope(zc_rms_norm(x[:, :1], weight[:dim], 1e-6), pos % 8, inv, dest=want_one, slot_of_row=slots)
    assert torch.equal(one.view(torch.int16), want_one.view(torch.int16))


def test_norm_rope_rejects_bad_inputs() -> None:
    x, w, pos, inv = rows(4, 2, 64), rows(64), positions_of(4), rope_inv_freq(64, THETA, "cpu")
    with pytest.raises(ValueError, match=r"^weight:"):
        norm_rope(x, w[:32], 1e-6, pos, inv)
    with pytest.raises(ValueError, match=r"^inv_freq:"):
        norm_rope(x, w, 1e-6, pos, rope_inv_freq(128, THETA, "cpu"))
    with pytest.raises(ValueError, match=r"^positions:"):
        norm_rope(x, w, 1e-6, pos[:3], inv)
    with pytest.raises(ValueError, match=r"^x: a head of 2048"):
        norm_rope(rows(1, 1, 2048), rows(2048), 1e-6, pos[:1], inv)
    with pytest.raises(ValueError, match=r"^slot_of_row, dest_index:"):
        norm_rope(x, w, 1e-6, pos, inv, slot_of_row=pos)


def test_heads_past_one_tile_equal_their_rope_in_single_tile_calls() -> None:
    """40 heads of 256 (rotary 64): three head tiles of TILE // 256 = 16; each head's bits are those of a call over
    its 16 heads alone (one tile), and close to the reference."""
    n, heads, dim = 3, 40, 256
    per_tile = TILE // dim
    assert heads > 2 * per_tile
    g = torch.Generator().manual_seed(80)
    x = (torch.randn(n, heads, dim, generator=g) * 2).bfloat16()
    pos, inv = torch.tensor([MAX_POSITION, 17, 0]), rope_inv_freq(64, THETA, "cpu")
    out = rope(x, pos, inv)
    alone = torch.cat([rope(x[:, h : h + per_tile], pos, inv) for h in range(0, heads, per_tile)], dim=1)
    assert torch.equal(out.view(torch.int16), alone.view(torch.int16))
    torch.testing.assert_close(out.float(), rope_reference(x, pos, inv).float(), rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize(("dim", "rot"), [(40, 40), (88, 40)])  # half 20 in 32 lanes; no pass-through, or 48 in 64
def test_rope_stores_nothing_past_its_output(dim: int, rot: int) -> None:
    """No program stores past the last row, head, rotated pair or passed-through dim: with the output of 33 rows
    (a partial third program under the interpreter) of 3 heads (in 4 lanes) made inside a longer buffer, the
    elements after it keep their bits, and the output is the model's rope."""
    n, heads = 33, 3
    x, pos, inv = rows(n, heads, dim, seed=12), positions_of(n, seed=12), rope_inv_freq(rot, THETA, "cpu")
    with outputs_with_slack(((n, heads, dim),), 16 * 4 * 128) as slack:  # a whole program's lanes past
        out = rope(x, pos, inv)
    assert len(slack) == 1 and untouched(slack)
    check_rope(out, x, pos, rot)


@pytest.mark.parametrize(("dim", "rot"), [(40, 40), (88, 40)])
def test_norm_rope_stores_nothing_past_its_output(dim: int, rot: int) -> None:
    """No norm_rope program stores past its (row, head) pairs, rotated pairs or other dims: with the output of
    33 rows of 3 heads made inside a longer buffer, the elements after it keep their bits, and the output has the
    bits of the norm then rope."""
    n, heads = 33, 3
    x, weight = rows(n, heads, dim, seed=13), rows(dim, seed=14) * 0.1
    pos, inv = positions_of(n, seed=13), rope_inv_freq(rot, THETA, "cpu")
    room = torch.zeros(2 * n * heads * dim, dtype=torch.bfloat16)  # rope's own stores kept in a buffer too
    want = rope(zc_rms_norm(x, weight, 1e-6), pos, inv, room[: n * heads * dim].view(n, heads, dim))
    with outputs_with_slack(((n, heads, dim),), 4096 * 2) as slack:  # a whole tile's lanes past
        got = norm_rope(x, weight, 1e-6, pos, inv)
    assert len(slack) == 1 and untouched(slack)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("dim", [41, 40 + 257])  # the other dims: one chunk of 1, or chunks of 256 and 1
def test_last_chunk_of_one_passed_through_dim(dim: int) -> None:
    """A head whose dims past the rotary ones end in a chunk of a single dim still passes that dim through: rope's
    output (made in a NaN-filled out) is the model's, and norm_rope's has the bits of the norm then rope."""
    n, heads, rot = 5, 2, 40
    x, pos, inv = rows(n, heads, dim, seed=15), positions_of(n, seed=15), rope_inv_freq(rot, THETA, "cpu")
    out = torch.full_like(x, float("nan"))
    check_rope(rope(x, pos, inv, out), x, pos, rot)
    weight = rows(dim, seed=16) * 0.1
    want = rope(zc_rms_norm(x, weight, 1e-6), pos, inv)
    assert torch.equal(norm_rope(x, weight, 1e-6, pos, inv).view(torch.int16), want.view(torch.int16))
