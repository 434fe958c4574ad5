"""The batched keyed draws against `server.sampling.sample_token`, row by row, under the Triton interpreter."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

import kernels.sample
from kernels.sample import (
    GOLDEN_GAMMA,
    GREEDY_BLOCK,
    MASK64,
    SCAN_BLOCK,
    _mix64_reference,
    argmax_tokens,
    draw_uniforms,
    greedy_tokens,
    greedy_tokens_reference,
    sample_rows,
    sample_rows_reference,
    sequential_cumsum,
    sequential_cumsum_reference,
)
from server.sampling import draw_uniform, sample_token
from tests.kernels.sentinels import outputs_with_slack, untouched

# (temperature, top_k, top_p, min_p): greedy, temperature only, each filter alone, all together, edge values
COMBOS = (
    (0.0, 0, 1.0, 0.0),
    (1.0, 0, 1.0, 0.0),
    (0.7, 5, 1.0, 0.0),
    (1.3, 0, 0.9, 0.0),
    (1.0, 0, 1.0, 0.1),
    (0.8, 20, 0.95, 0.05),
    (2.0, 0, 0.5, 0.0),
    (1.0, 1, 1.0, 0.0),
    (0.5, 400, 0.3, 0.0),
    (1.0, 0, 1e-9, 1.0),
    (0.0, 3, 0.5, 0.2),
    (3.0, 7, 0.99, 0.02),
)
INT64 = (-(2**63), 2**63 - 1)


def params(n: int, gen: torch.Generator, combos: tuple = COMBOS) -> tuple[torch.Tensor, ...]:
    """(temperature, top_k, top_p, min_p, seed, position) for n rows, cycling through combos, random keys."""
    t, k, p, m = zip(*(combos[i % len(combos)] for i in range(n)), strict=True)
    seed = torch.randint(*INT64, (n,), generator=gen)
    position = torch.randint(0, 1 << 40, (n,), generator=gen)
    f64 = torch.float64
    return (
        torch.tensor(t, dtype=f64),
        torch.tensor(k),
        torch.tensor(p, dtype=f64),
        torch.tensor(m, dtype=f64),
        seed,
        position,
    )


def server_tokens(logits: torch.Tensor, args: tuple[torch.Tensor, ...]) -> list[int]:
    """`sample_token` on each row alone, -1 where it raises."""
    out = []
    for i, row in enumerate(logits):
        t, k, p, m, s, pos = (a[i].item() for a in args)
        try:
            out.append(sample_token(row, t, k, p, m, s, pos))
        except ValueError:
            out.append(-1)
    return out


def spread_values(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """Nonnegative fp32 with exponents over the whole fp32 range, subnormals included."""
    exponent = torch.randint(-149, 1, (rows, cols), generator=gen).double()
    mantissa = torch.randint(0, 1 << 24, (rows, cols), generator=gen).double()
    return (mantissa * 2.0 ** (exponent - 24)).float()


def test_draws_match_draw_uniform() -> None:
    gen = torch.Generator().manual_seed(0)
    seed = torch.cat([torch.randint(*INT64, (90,), generator=gen), torch.tensor([0, -1, INT64[0], INT64[1], 1])])
    position = torch.cat([torch.randint(*INT64, (45,), generator=gen), torch.randint(0, 1 << 20, (50,), generator=gen)])
    out = draw_uniforms(seed, position)
    ref = torch.tensor([draw_uniform(int(s), int(p)) for s, p in zip(seed, position, strict=True)], dtype=torch.float64)
    assert torch.equal(out, ref)
    assert ((out >= 0) & (out < 1)).all() and out.unique().numel() == out.numel()


@pytest.mark.parametrize("kind", ["softmax_sorted", "spread_sorted", "spread_unsorted", "halves"])
def test_sequential_cumsum_bit_exact(kind: str) -> None:
    """Every running sum equals the left-to-right fp64 one, also where the order of the adds changes the bits."""
    gen = torch.Generator().manual_seed(1)
    if kind == "softmax_sorted":
        values = torch.softmax(torch.randn(4, 300, generator=gen) * 4, dim=-1).sort(descending=True).values
    elif kind == "halves":  # after 0.75 the grid is 2**-53: odd multiples of 2**-54 round half to even by parity
        values = (torch.randint(0, 8, (4, 300), generator=gen) * 2.0**-54).float()
        values += 2.0**-30 * (torch.rand(4, 300, generator=gen) < 0.2)
        values[:, 0], values[:, 1] = 0.0, 0.75  # a leading zero too: the scan must start from it
    else:
        values = spread_values(4, 300, gen)
        if kind == "spread_sorted":
            values = values.sort(descending=True).values
    out = sequential_cumsum(values)
    ref = sequential_cumsum_reference(values)
    assert torch.equal(out, ref)
    row, running = values[0].double().tolist(), 0.0
    for j, v in enumerate(row):  # the reference is the sequential sum
        running += v
        assert ref[0, j].item() == running
    local = torch.cumsum(values.double().view(4, 10, 30), -1)
    blocked = (local + (torch.cumsum(local[..., -1], -1) - local[..., -1])[..., None]).view(4, 300)
    if kind != "softmax_sorted":  # a blocked scan differs here, so the equality above has teeth
        assert not torch.equal(blocked, ref)


def test_sequential_cumsum_of_rows_that_start_with_zeros() -> None:
    """A running sum that is still 0 stays exactly 0 through the zeros that follow (a short and a long run of leading
    zeros, a row of zeros only), then matches the sequential sum."""
    gen = torch.Generator().manual_seed(17)
    values = spread_values(3, 80, gen)
    values[0, :3] = 0.0
    values[1, :50] = 0.0
    values[2] = 0.0
    assert torch.equal(sequential_cumsum(values), sequential_cumsum_reference(values))


def test_sequential_cumsum_stores_nothing_past_its_rows() -> None:
    """No program stores past its row's sums (rows of 100, not a multiple of the scan chunk): with the sums made inside
    a longer buffer, the elements after them keep their bits. (A store past a row lands in the next row's first sums,
    which on the CPU the next row's program overwrites and on a GPU races; past the last row it shows here.)"""
    values = spread_values(3, 100, torch.Generator().manual_seed(18))
    assert values.shape[1] % SCAN_BLOCK
    with outputs_with_slack((tuple(values.shape),), 2 * SCAN_BLOCK) as slack:
        out = sequential_cumsum(values)
    assert len(slack) == 1 and untouched(slack)
    assert torch.equal(out, sequential_cumsum_reference(values))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [50, 300])
def test_every_combination_matches_sample_token(vocab: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(vocab)
    n = 24
    logits = torch.randn(n, vocab, generator=gen) * 3
    logits[1::3] = torch.randint(-3, 4, (len(logits[1::3]), vocab), generator=gen).float()  # many exact ties
    logits = logits.to(dtype)
    args = params(n, gen)
    expected = server_tokens(logits, args)
    assert sample_rows(logits, *args).tolist() == expected
    assert sample_rows_reference(logits, *args).tolist() == expected


def test_many_keys_on_one_row() -> None:
    """One row drawn at many (seed, position) keys under every filter: each token is sample_token's."""
    gen = torch.Generator().manual_seed(7)
    vocab, n = 173, 36
    logits = (torch.randn(vocab, generator=gen) * 2).expand(n, vocab).contiguous()
    combos = ((1.0, 0, 1.0, 0.0), (0.9, 30, 0.9, 0.02), (1.5, 0, 0.8, 0.0))
    args = params(n, gen, combos)
    expected = server_tokens(logits, args)
    assert sample_rows(logits, *args).tolist() == expected
    assert len(set(expected)) > 10  # the keys do spread the draws


def test_batch_one_equals_batch_five() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 120, generator=gen) * 3
    args = params(5, gen, COMBOS[1:6])
    batch = sample_rows(logits, *args)
    alone = torch.cat([sample_rows(logits[i : i + 1], *(a[i : i + 1] for a in args)) for i in range(5)])
    assert torch.equal(batch, alone)
    assert batch.tolist() == server_tokens(logits, args)


def test_cuts_on_exact_boundaries() -> None:
    """Four equal logits (probabilities exactly 1/4) and the rest -inf: top_p 0.5 keeps the two candidates whose
    mass reaches it, top_k 2 all four ties (vLLM keeps what is not below the k-th), min_p 1 all four; every key agrees
    with sample_token."""
    logits = torch.full((3, 64), float("-inf"))
    logits[:, [3, 10, 20, 50]] = 1.5
    n = 30
    combos = ((1.0, 0, 0.5, 0.0), (1.0, 2, 1.0, 0.0), (1.0, 0, 1.0, 1.0))
    args = params(n, torch.Generator().manual_seed(11), combos)
    rows = logits.repeat(n // 3, 1)
    out = sample_rows(rows, *args)
    assert out.tolist() == server_tokens(rows, args)
    assert set(out[0::3].tolist()) == {3, 10}
    for tied in (out[1::3], out[2::3]):
        assert set(tied.tolist()) <= {3, 10, 20, 50} and set(tied.tolist()) & {20, 50}


def _unmix64(z: int) -> int:
    """The inverse of one splitmix64 step (`_mix64_reference`) on a Python int modulo 2**64."""

    def unshift(y: int, shift: int) -> int:
        """x from y = x ^ (x >> shift)."""
        x = y
        for _ in range(64 // shift + 1):
            x = y ^ (x >> shift)
        return x

    z = unshift(z, 31)
    z = unshift((z * pow(0x94D049BB133111EB, -1, 1 << 64)) & MASK64, 27)
    z = unshift((z * pow(0xBF58476D1CE4E5B9, -1, 1 << 64)) & MASK64, 30)
    return (z - GOLDEN_GAMMA) & MASK64


def test_a_draw_landing_on_a_cumulative_sum_takes_the_next_candidate() -> None:
    """Keys whose uniforms are exactly 1/4, 1/2 and 3/4 (found by inverting splitmix64) over four candidates of
    probability 1/4: each target equals a cumulative sum, and every token is sample_token's (searchsorted right)."""
    n, seed = 3, 12345
    uniforms = (0.25, 0.5, 0.75)
    positions = [_unmix64(int(u * 2**53) << 11) ^ _mix64_reference(seed) for u in uniforms]
    positions = [p - (1 << 64) if p >> 63 else p for p in positions]  # as int64
    assert [draw_uniform(seed, p) for p in positions] == list(uniforms)
    logits = torch.full((n, 64), float("-inf"))
    logits[:, [3, 10, 20, 50]] = 1.5
    args = (
        torch.ones(n, dtype=torch.float64),
        torch.zeros(n, dtype=torch.int64),
        torch.ones(n, dtype=torch.float64),
        torch.zeros(n, dtype=torch.float64),
        torch.full((n,), seed),
        torch.tensor(positions),
    )
    assert sample_rows(logits, *args).tolist() == server_tokens(logits, args)


def test_greedy_ties_go_to_the_lower_id() -> None:
    logits = torch.zeros(3, 64)
    logits[0, [5, 9, 40]] = 2.0
    logits[1, [63, 17]] = 1.0
    args = params(3, torch.Generator().manual_seed(0), ((0.0, 0, 1.0, 0.0),))
    assert sample_rows(logits, *args).tolist() == [5, 17, 0]


def test_refused_rows_give_minus_one() -> None:
    """Where sample_token raises, the row gets -1; the other rows are still drawn."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(9, 60, generator=gen)
    logits[1, 3] = float("nan")
    logits[2, 7] = float("inf")
    logits[3] = float("-inf")
    combos = (
        (1.0, 0, 1.0, 0.0),
        (1.0, 0, 1.0, 0.0),
        (1.0, 0, 1.0, 0.0),
        (0.0, 0, 1.0, 0.0),
        (-1.0, 0, 1.0, 0.0),
        (1.0, -2, 1.0, 0.0),
        (1.0, 0, 0.0, 0.0),
        (1.0, 0, 1.0, 1.5),
        (1e-50, 0, 1.0, 0.0),
    )
    args = params(9, gen, combos)
    expected = server_tokens(logits, args)
    assert expected[0] >= 0 and expected[1:] == [-1] * 8
    assert sample_rows(logits, *args).tolist() == expected


def test_only_rows_that_draw_are_sorted(monkeypatch) -> None:
    """With the temperatures on the host, greedy rows skip the softmax and sort: a greedy batch sorts nothing, a
    mixed one sorts only its sampled rows, and every row still equals sample_token's."""
    sorted_rows: list[int] = []
    real_sort = torch.sort

    def counting_sort(values, *args, **kwargs):
        sorted_rows.append(values.shape[0])
        return real_sort(values, *args, **kwargs)

    monkeypatch.setattr(torch, "sort", counting_sort)
    gen = torch.Generator().manual_seed(13)
    logits = torch.randn(6, 90, generator=gen) * 3
    greedy = params(6, gen, ((0.0, 0, 1.0, 0.0),))
    mixed = params(6, gen, ((0.0, 0, 1.0, 0.0), (0.8, 20, 0.95, 0.05), (0.0, 3, 0.5, 0.2)))
    expected = server_tokens(logits, greedy), server_tokens(logits, mixed)  # sample_token sorts row by row
    sorted_rows.clear()
    assert sample_rows(logits, *greedy).tolist() == expected[0] == logits.argmax(-1).tolist()
    assert sorted_rows == []
    assert sample_rows(logits, *mixed).tolist() == expected[1]
    assert sorted_rows == [2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, GREEDY_BLOCK - 1, 3 * GREEDY_BLOCK + 5])
def test_greedy_tokens_take_the_first_maximum_and_refuse_rows_without_a_finite_one(vocab: int, dtype) -> None:
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(8, vocab, generator=gen).to(dtype)
    if vocab > GREEDY_BLOCK:
        logits[1, [GREEDY_BLOCK + 2, 3, 2 * GREEDY_BLOCK]] = 9.0  # a tie across lanes: the lowest id, in a later lane
        logits[2, [GREEDY_BLOCK + 1, 2 * GREEDY_BLOCK + 1]] = 9.0  # a tie within one lane: its first
    logits[3, vocab // 2] = float("nan")
    logits[4, vocab - 1] = float("inf")
    logits[5] = float("-inf")
    logits[6, : vocab // 2] = float("-inf")  # a finite maximum among minus infinities
    logits[7] = 0.0  # every id ties: the first
    expected = greedy_tokens_reference(logits)
    assert greedy_tokens(logits).tolist() == expected.tolist()
    assert expected[3:6].tolist() == [-1, -1, -1] and expected[7] == 0
    if vocab > GREEDY_BLOCK:
        assert expected[1:3].tolist() == [3, GREEDY_BLOCK + 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, GREEDY_BLOCK - 1, 3 * GREEDY_BLOCK + 5])
def test_argmax_tokens_equal_torchs_argmax_whatever_a_row_holds(vocab: int, dtype) -> None:
    """Rows without a finite maximum too: the first NaN, the first infinite maximum, or id 0 of a row of -inf."""
    gen = torch.Generator().manual_seed(vocab + 1)
    logits = torch.randn(8, vocab, generator=gen).to(dtype)
    logits[1, vocab // 2] = float("nan")
    logits[2, [vocab - 1, vocab // 3]] = float("nan")  # two NaNs, maybe in different lanes: the lower id
    logits[2, 0] = float("inf")  # an infinity before them: the NaN still wins
    logits[3, [vocab - 1, vocab // 2]] = float("inf")
    logits[4] = float("-inf")
    logits[5, : vocab // 2] = float("-inf")
    logits[6] = 0.0  # every id ties: the first
    logits[7, vocab - 1] = 7.0  # the maximum in the last, partial tile
    expected = torch.argmax(logits.float(), dim=-1)
    assert argmax_tokens(logits).tolist() == expected.tolist()
    assert argmax_tokens(logits).tolist() != greedy_tokens(logits).tolist()  # the refusing form gives -1 for some


def test_a_greedy_round_with_host_parameters_is_one_launch_and_refuses_by_row(monkeypatch) -> None:
    """With every temperature 0 and the parameters on the host, sample_rows is `greedy_tokens` alone: no casts, no
    sort; a row whose parameters sample_token refuses still gets -1."""
    launches: list[int] = []
    real = kernels.sample.greedy_tokens

    def counted(logits: torch.Tensor) -> torch.Tensor:
        launches.append(logits.shape[0])
        return real(logits)

    monkeypatch.setattr(kernels.sample, "greedy_tokens", counted)
    monkeypatch.setattr(torch, "argmax", None)  # the general path's argmax would fail
    gen = torch.Generator().manual_seed(21)
    logits = torch.randn(5, 90, generator=gen).bfloat16()
    logits[2, 40] = float("nan")
    args = params(5, gen, ((0.0, 0, 1.0, 0.0), (0.0, 3, 0.5, 0.2), (0.0, 0, 1.0, 0.0), (0.0, -1, 1.0, 0.0)))
    tokens = sample_rows(logits, *args).tolist()
    monkeypatch.undo()
    assert launches == [5]
    assert tokens == server_tokens(logits, args) and tokens[2:4] == [-1, -1]


def test_parameters_of_another_length_than_the_rows_are_refused() -> None:
    gen = torch.Generator().manual_seed(2)
    args = params(3, gen, ((0.0, 0, 1.0, 0.0),))
    with pytest.raises(ValueError, match="one value per row"):
        sample_rows(torch.randn(2, 30, generator=gen), *args)
