"""The routed MoE compiled on a GPU at tp=2's per-rank widths: the word-layout decode (PTX halves, packed multiplies)
against the reference, and every row's bits alone and batched on decode and prompt tiles."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kernels import moe, moe_gluon
from kernels.fp4_words import kernel_bank
from kernels.gates import gated_add
from kernels.moe import moe_forward, moe_forward_reference, moe_plan, moe_plan_reference, moe_tiles

E, D, INTER, TOP_K = 512, 2560, 320, 10


def bank_and_routing(n: int) -> tuple[dict[str, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Random NVFP4 experts (every code, scales from 1/8 to 8 and a few subnormal ones) and n rows' routing."""
    gen = torch.Generator(device="cuda").manual_seed(n)

    def scales(*size: int) -> torch.Tensor:
        s = torch.exp2(torch.rand(*size, device="cuda", generator=gen) * 6 - 3)
        s[..., 0] = 2.0**-8  # an e4m3 subnormal in every row
        return s.to(torch.float8_e4m3fn)

    def codes(*size: int) -> torch.Tensor:
        return torch.randint(0, 256, size, device="cuda", generator=gen, dtype=torch.uint8)

    packed = {
        "gate_up_packed": codes(E, 2 * INTER, D // 2),
        "gate_up_scale": scales(E, 2 * INTER, D // 16),
        "gate_up_scale_2": torch.full((E, 2), 0.2 * D**-0.5, device="cuda"),
        "down_packed": codes(E, D, INTER // 2),
        "down_scale": scales(E, D, INTER // 16),
        "down_scale_2": torch.full((E,), 0.2 * INTER**-0.5, device="cuda"),
    }
    x = torch.randn(n, D, device="cuda", generator=gen).bfloat16()
    ids = torch.rand(n, E, device="cuda", generator=gen).argsort(dim=1)[:, :TOP_K].to(torch.int32)
    w = torch.rand(n, TOP_K, device="cuda", generator=gen) + 0.05
    return kernel_bank(packed, in_place=True), (x, ids, w / w.sum(-1, keepdim=True))


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels")
def test_matches_reference() -> None:
    """Within 1e-3 in fp32 (h is rounded to bf16 between the GEMMs, and cuBLAS's sums flip some of those roundings)."""
    bank, (x, ids, w) = bank_and_routing(3)
    assert (
        rel_err(moe_forward(x, ids, w, bank, torch.float32), moe_forward_reference(x, ids, w, bank, torch.float32))
        < 1e-3
    )
    assert rel_err(moe_forward(x, ids, w, bank), moe_forward_reference(x, ids, w, bank)) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels")
@pytest.mark.parametrize("n", [8, 64, 1024])
def test_rows_alone_equal_rows_batched(n: int) -> None:
    """Rows of a batch (decode tiles at 8 and 64 rows, prompt tiles at 1,024) equal the same rows alone."""
    bank, (x, ids, w) = bank_and_routing(n)
    assert moe_tiles(1, TOP_K, E) != moe_tiles(n, TOP_K, E)
    batch = moe_forward(x, ids, w, bank, torch.float32)
    for r in (0, n // 2, n - 1):
        alone = moe_forward(x[r : r + 1], ids[r : r + 1], w[r : r + 1], bank, torch.float32)
        assert torch.equal(alone[0], batch[r])


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels")
@pytest.mark.parametrize("n", [1, 7, 64, 256, 1024, 4096])
@pytest.mark.parametrize("skewed", [False, True])
def test_plan_equals_the_torch_plan(n: int, skewed: bool) -> None:
    """The plan kernel's arrays equal the torch ops' at decode, verify and prompt sizes, also where a few experts take
    most pairs (their runs then span many of the kernel's chunks and many row tiles)."""
    gen = torch.Generator(device="cuda").manual_seed(n)
    ids = torch.rand(n, E, device="cuda", generator=gen).argsort(dim=1)[:, :TOP_K].to(torch.int32)
    if skewed:
        ids = torch.where(ids % 3 == 0, ids % 12, ids)
    block_m = moe_tiles(n, TOP_K, E).block_m
    plan, ref = moe_plan(ids, E, block_m), moe_plan_reference(ids, E, block_m)
    for field in ("pairs", "bounds", "tile_experts", "tile_starts"):
        assert torch.equal(getattr(plan, field), getattr(ref, field)), field


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels")
@pytest.mark.parametrize("n", [1, 4, 7])
def test_pairs_path_equals_the_grouped_path(n: int, monkeypatch) -> None:
    """The pairs path (each pair alone, two launches; the default at one row) gives the grouped path's bits, in both
    output dtypes, at 1 to 7 rows."""
    from kernels import moe

    bank, (x, ids, w) = bank_and_routing(n)
    ids[-1] = ids[0].flip(0)  # two rows on the same experts, in other slot orders
    monkeypatch.setattr(moe, "PAIR_ROWS", n + 1)
    pairs = [moe_forward(x, ids, w, bank, dtype) for dtype in (torch.float32, torch.bfloat16)]
    monkeypatch.setattr(moe, "PAIR_ROWS", 0)
    grouped = [moe_forward(x, ids, w, bank, dtype) for dtype in (torch.float32, torch.bfloat16)]
    assert torch.equal(pairs[0].view(torch.int32), grouped[0].view(torch.int32))
    assert torch.equal(pairs[1].view(torch.int16), grouped[1].view(torch.int16))


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels")
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n", [1, 4, 64])
def test_the_gated_shared_expert_in_the_down_or_combine_launch_gives_gated_adds_bits(
    n: int, out_dtype: torch.dtype
) -> None:
    """One row's down launch, and more rows' combine launch, add the gated shared expert with the elementwise kernel's
    bits, compiled as they are (FMA contraction, ftz), over logits from -120 to 120 and shared values down to bf16's
    subnormals."""
    assert (n < moe.PAIR_ROWS) == (n == 1)  # one row takes the pairs path, more the grouped one
    bank, (x, ids, w) = bank_and_routing(n)
    gen = torch.Generator(device="cuda").manual_seed(7)
    routed = moe_forward(x, ids, w, bank)
    for scale in (1.0, 2.0**-120, 2.0**-133):
        shared = (torch.randn(n, D, device="cuda", generator=gen) * scale).bfloat16()
        for z in (-120.0, -88.5, -87.0, -3.3, 0.0, 0.7, 30.0, 120.0):
            rows = torch.arange(n, device="cuda")[:, None] * 0.375  # each row its own logit, in a column view
            logit = (torch.full((n, 3), z, device="cuda") - rows).bfloat16()[:, 1:2]
            got = moe_forward(x, ids, w, bank, out_dtype, gated=moe.SharedGate(shared, logit, lambda: None))
            want = gated_add(routed, logit, shared, out_dtype)
            as_int = torch.int16 if out_dtype == torch.bfloat16 else torch.int32
            assert torch.equal(got.view(as_int), want.view(as_int)), (scale, z)


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels")
@pytest.mark.parametrize("n", [8, 64, 256])
def test_the_gluon_gate_up_gives_the_triton_kernels_bits(n: int, monkeypatch) -> None:
    """kernels/moe_gluon.py's gate-up runs on these widths and its outputs are the Triton kernel's, bit for bit."""
    bank, (x, ids, w) = bank_and_routing(n)
    gluon_gate_up = moe_gluon.gate_up
    ran: list[bool] = []
    monkeypatch.setattr(moe_gluon, "gate_up", lambda *args: ran.append(gluon_gate_up(*args)) or ran[-1])
    with_gluon = moe_forward(x, ids, w, bank, torch.float32)
    assert ran == [True]
    monkeypatch.setattr(moe_gluon, "gate_up", lambda *args: False)
    without = moe_forward(x, ids, w, bank, torch.float32)
    assert torch.equal(with_gluon.view(torch.int32), without.view(torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels")
@pytest.mark.parametrize("n", [2, 8, 64, 512])
def test_the_gluon_down_gives_the_triton_kernels_bits(n: int, monkeypatch) -> None:
    """kernels/moe_gluon.py's down projection runs on these widths (I = 320: spans of 64 k) in each of its shapes
    and every y it stores is the Triton kernel's, bit for bit."""
    bank, (_, ids, _) = bank_and_routing(n)
    weights, tiles = moe._weights(bank), moe_tiles(n, TOP_K, E)
    plan = moe_plan(ids, E, tiles.block_m)
    h = torch.randn(n * TOP_K, INTER, device="cuda", generator=torch.Generator(device="cuda").manual_seed(n))
    h = h.bfloat16()
    assert moe_gluon.down(h, plan, weights, torch.empty(n * TOP_K, D, device="cuda"), False)
    with_gluon = torch.full((n * TOP_K, D), float("nan"), device="cuda")
    moe._down_grouped(h, plan, weights, with_gluon, tiles, False)
    monkeypatch.setattr(moe_gluon, "down", lambda *args: False)
    without = torch.full_like(with_gluon, float("nan"))
    moe._down_grouped(h, plan, weights, without, tiles, False)
    assert not without.isnan().any()
    assert torch.equal(with_gluon.view(torch.int32), without.view(torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels")
def test_flashnext_gluon_0_runs_the_triton_kernels(monkeypatch) -> None:
    bank, (x, ids, _) = bank_and_routing(8)
    plan = moe_plan(ids, E, 16)
    weights = moe._weights(bank)
    h = torch.empty(ids.numel(), INTER, dtype=torch.bfloat16, device="cuda")
    y = torch.empty(ids.numel(), D, device="cuda")
    assert moe_gluon.gate_up(x, plan, weights, h, TOP_K, False) and moe_gluon.down(h, plan, weights, y, False)
    monkeypatch.setenv(moe_gluon.ENV, "0")
    assert not moe_gluon.gate_up(x, plan, weights, h, TOP_K, False)
    assert not moe_gluon.down(h, plan, weights, y, False)


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels")
def test_the_gluon_kernels_run_only_where_they_are_faster() -> None:
    """The gate-up from 8 rows (80 pairs) up to 6 pairs an expert (307 rows at top-10 of 512), the down kernel for
    every batch: 16-row plans (up to 819 rows) and prompts' 32-row plans."""
    bank, _ = bank_and_routing(8)
    weights = moe._weights(bank)
    cases = ((2, False, True), (8, True, True), (307, True, True), (308, False, True), (819, False, True))
    for n, gate_up_runs, down_runs in (*cases, (820, False, True), (8192, False, True)):
        ids = torch.rand(n, E, device="cuda").argsort(dim=1)[:, :TOP_K].to(torch.int32)
        plan = moe_plan(ids, E, moe_tiles(n, TOP_K, E).block_m)
        assert moe_gluon.gate_up_usable(weights, plan) == gate_up_runs, n
        assert moe_gluon.down_usable(weights, plan) == down_runs, n


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels")
@pytest.mark.parametrize("n", [64, 512])
def test_programs_of_sixteen_rows_give_the_same_bits(n: int, monkeypatch) -> None:
    """The Gluon kernels taking a whole 16-row plan tile a program (the sweep's `--program-rows 16`) give every h and
    y of the 8-row programs and of the Triton kernels."""
    bank, (x, ids, w) = bank_and_routing(n)
    monkeypatch.setattr(moe_gluon, "GATE_UP_MIN_PAIRS", 0)
    monkeypatch.setattr(moe_gluon, "MAX_PAIRS_PER_EXPERT", E)
    halves = moe_forward(x, ids, w, bank, torch.float32)
    monkeypatch.setattr(moe_gluon, "GATE_UP_ROWS", 16)
    monkeypatch.setattr(moe_gluon, "DOWN_ROWS", 16)
    weights, tiles = moe._weights(bank), moe_tiles(n, TOP_K, E)
    plan = moe_plan(ids, E, tiles.block_m)
    assert moe_gluon.gate_up_usable(weights, plan) and moe_gluon.down_usable(weights, plan)
    whole = moe_forward(x, ids, w, bank, torch.float32)
    monkeypatch.setattr(moe_gluon, "gate_up", lambda *args: False)
    monkeypatch.setattr(moe_gluon, "down", lambda *args: False)
    triton_only = moe_forward(x, ids, w, bank, torch.float32)
    assert torch.equal(whole.view(torch.int32), halves.view(torch.int32))
    assert torch.equal(whole.view(torch.int32), triton_only.view(torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels")
@pytest.mark.parametrize("rows", [16, 32])
@pytest.mark.parametrize("n", [820, 1024, 3000])
def test_prompt_tiles_give_the_triton_kernels_bits(n: int, rows: int, monkeypatch) -> None:
    """A prompt's 32-row plan tiles through the Gluon down kernel, 16 or 32 rows a program, give every output bit of
    the Triton kernel."""
    bank, (x, ids, w) = bank_and_routing(n)
    monkeypatch.setattr(moe_gluon, "PROMPT_ROWS", rows)
    weights, tiles = moe._weights(bank), moe_tiles(n, TOP_K, E)
    plan = moe_plan(ids, E, tiles.block_m)
    assert tiles.block_m == moe_gluon.PROMPT_BLOCK_M
    assert not moe_gluon.gate_up_usable(weights, plan) and moe_gluon.down_usable(weights, plan)
    gluon = moe_forward(x, ids, w, bank, torch.float32)
    monkeypatch.setattr(moe_gluon, "gate_up", lambda *args: False)
    monkeypatch.setattr(moe_gluon, "down", lambda *args: False)
    triton_only = moe_forward(x, ids, w, bank, torch.float32)
    assert torch.equal(gluon.view(torch.int32), triton_only.view(torch.int32))
