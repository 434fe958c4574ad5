"""The grouped MoE kernels against their PyTorch reference under the Triton interpreter (NVFP4 and BF16 banks)."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import moe, moe_gluon
from kernels.fp4_words import WORD_BITS, from_words, kernel_bank, natural_scales, span_k, to_words
from kernels.gates import gated_add
from kernels.moe import (
    SharedGate,
    expert_weights,
    moe_forward,
    moe_forward_reference,
    moe_plan,
    moe_plan_reference,
)
from model.quant import dequantize_nvfp4, quantize_nvfp4
from tests.kernels.launches import recording_launches

E, D, INTER, TOP_K = 8, 64, 32, 2


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64."""
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def make_bank(fp4: bool, seed: int = 0, d: int = D, inter: int = INTER) -> dict[str, torch.Tensor]:
    """A random bank of E experts, quantized per matrix by the checkpoint's NVFP4 quantizer when fp4."""
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(E, 2 * inter, d, generator=g) * d**-0.5
    down = torch.randn(E, d, inter, generator=g) * inter**-0.5
    if not fp4:
        return {"gate_up": gate_up.bfloat16(), "down": down.bfloat16()}
    parts: dict[str, list[torch.Tensor]] = {key: [] for key in ("gup", "gus", "gus2", "dp", "ds", "ds2")}
    for e in range(E):
        halves = [quantize_nvfp4(gate_up[e, :inter]), quantize_nvfp4(gate_up[e, inter:])]
        parts["gup"].append(torch.cat([halves[0][0], halves[1][0]]))
        parts["gus"].append(torch.cat([halves[0][1], halves[1][1]]))
        parts["gus2"].append(torch.stack([halves[0][2], halves[1][2]]))
        packed, scale, scale_2 = quantize_nvfp4(down[e])
        parts["dp"].append(packed)
        parts["ds"].append(scale)
        parts["ds2"].append(scale_2)
    return {
        "gate_up_packed": torch.stack(parts["gup"]),
        "gate_up_scale": torch.stack(parts["gus"]),
        "gate_up_scale_2": torch.stack(parts["gus2"]).float(),
        "down_packed": torch.stack(parts["dp"]),
        "down_scale": torch.stack(parts["ds"]),
        "down_scale_2": torch.stack(parts["ds2"]).float(),
    }


def make_routing(n: int, seed: int, top_k: int = TOP_K) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [n, D] bf16, distinct expert ids [n, k] int32 in random order, renormalised weights [n, k] fp32)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:top_k] for _ in range(n)]).to(torch.int32)
    w = torch.rand(n, top_k, generator=g) + 0.1
    return x, ids, w / w.sum(-1, keepdim=True)


def near_tie_rows(x: torch.Tensor, ids: torch.Tensor, bank: dict[str, torch.Tensor]) -> torch.Tensor:
    """Rows with an h (summed in fp64) within 3e-4 of a bf16 step of a rounding midpoint: fp32 sums in
    another order may round such an h either way, one bf16 step apart, so only those rows may differ more."""
    ties = torch.zeros(x.shape[0], dtype=torch.bool)
    for r, s in torch.cartesian_prod(torch.arange(ids.shape[0]), torch.arange(ids.shape[1])).tolist():
        gate, up, _ = expert_weights(bank, int(ids[r, s]))
        xr = x[r].double()
        h = F.silu(gate.double() @ xr) * (up.double() @ xr)
        steps = torch.frexp(h).mantissa.abs() * 2**8  # bf16 keeps 8 significant bits
        ties[r] |= bool(((steps - steps.floor() - 0.5).abs() < 3e-4).any())
    return ties


def assert_matches_reference(out32: torch.Tensor, x, ids, w, bank) -> None:
    """Within 1e-5 of the reference in fp32, but rows with an h at a near tie within 1e-3."""
    ref = moe_forward_reference(x, ids, w, bank, out_dtype=torch.float32)
    ties = near_tie_rows(x, ids, bank)
    if not ties.all():
        assert rel_err(out32[~ties], ref[~ties]) <= 1e-5
    assert rel_err(out32, ref) <= 1e-3


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of a bf16 or fp32 tensor, so that equality means the same bits (signed zeros, NaNs)."""
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


PACKED = make_bank(True)
BANKS = {"nvfp4": kernel_bank(PACKED), "bf16": make_bank(False)}


@pytest.mark.parametrize("kind", ["nvfp4", "bf16"])
@pytest.mark.parametrize("n", [1, 7])
def test_matches_reference(kind: str, n: int) -> None:
    bank = BANKS[kind]
    x, ids, w = make_routing(n, seed=n)
    out = moe_forward(x, ids, w, bank)
    out32 = moe_forward(x, ids, w, bank, out_dtype=torch.float32)
    assert out.dtype == torch.bfloat16 and out32.dtype == torch.float32
    assert not out.isnan().any() and not out32.isnan().any()
    assert rel_err(out, moe_forward_reference(x, ids, w, bank)) <= 1e-2
    assert_matches_reference(out32, x, ids, w, bank)
    assert torch.equal(out, out32.bfloat16())  # the bf16 output is the fp32 sum rounded once


@pytest.mark.parametrize("kind", ["nvfp4", "bf16"])
def test_row_invariance(kind: str) -> None:
    bank = BANKS[kind]
    x, ids, w = make_routing(5, seed=11)
    ids[1] = ids[0]  # two rows share both experts, so they share tiles
    batch = moe_forward(x, ids, w, bank, out_dtype=torch.float32)
    for r in range(5):
        alone = moe_forward(x[r : r + 1], ids[r : r + 1], w[r : r + 1], bank, out_dtype=torch.float32)
        assert torch.equal(alone[0], batch[r]), f"row {r} differs from the same row run alone"


def test_combine_ascending_whatever_slot_order() -> None:
    bank = BANKS["nvfp4"]
    x, ids, w = make_routing(4, seed=5)
    out = moe_forward(x, ids, w, bank, out_dtype=torch.float32)
    flipped = moe_forward(x, ids.flip(1).contiguous(), w.flip(1).contiguous(), bank, out_dtype=torch.float32)
    assert torch.equal(out, flipped)


def test_weights_follow_routing() -> None:
    bank = BANKS["bf16"]
    x, ids, w = make_routing(3, seed=8)
    out = moe_forward(x, ids, w, bank, out_dtype=torch.float32)
    w2 = w.clone()
    w2[:, 0] = 0.0
    single = moe_forward(x, ids, w2, bank, out_dtype=torch.float32)
    assert_matches_reference(single, x, ids, w2, bank)
    assert rel_err(out, single) > 1e-2


def test_dequantization_matches_checkpoint_formula() -> None:
    bank = BANKS["nvfp4"]
    for e in (0, E - 1):
        gate, up, down = expert_weights(bank, e)
        ref_gate = dequantize_nvfp4(
            PACKED["gate_up_packed"][e, :INTER], PACKED["gate_up_scale"][e, :INTER], PACKED["gate_up_scale_2"][e, 0]
        )
        ref_down = dequantize_nvfp4(PACKED["down_packed"][e], PACKED["down_scale"][e], PACKED["down_scale_2"][e])
        assert torch.equal(gate, ref_gate) and torch.equal(down, ref_down)
        assert up.shape == (INTER, D)


def test_word_layout_round_trips_and_moves_every_bit() -> None:
    assert sorted(bit for bits in WORD_BITS for bit in bits) == list(range(32))
    packed = torch.randint(0, 256, (3, 5, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    words = kernel_bank({"gate_up_packed": packed, "down_packed": packed[:, :, :8].contiguous()})["gate_up_words"]
    assert words.shape == (3, 5, 4) and words.dtype == torch.int32
    assert torch.equal(from_words(words), packed)
    assert not torch.equal(words, packed.view(torch.int32))
    source = packed.clone()
    in_place = kernel_bank({"gate_up_packed": source, "down_packed": packed.clone()}, in_place=True)
    assert torch.equal(in_place["gate_up_words"], words)
    assert in_place["gate_up_words"].data_ptr() == source.data_ptr()
    assert torch.equal(from_words(words.transpose(0, 1)), packed.transpose(0, 1).contiguous())


def spans_moved(natural: torch.Tensor, moved: torch.Tensor, span: int, per_block: int, threads: int) -> bool:
    """Whether, in each span of the last axis (span // 32 blocks of `per_block` values), position
    `per_block·blocks·s + blocks·t + b` of `moved` holds value `per_block·blocks·s + threads·b + t` of `natural`."""
    blocks = span // 32
    spans = natural.shape[-1] // (per_block * blocks)
    s, t, b = torch.meshgrid(torch.arange(spans), torch.arange(threads), torch.arange(blocks), indexing="ij")
    base = per_block * blocks * s
    return torch.equal(moved[..., base + blocks * t + b], natural[..., base + threads * b + t])


@pytest.mark.parametrize("span", [128, 64])
def test_spans_move_words_and_scales_and_are_undone(span: int) -> None:
    """In a matrix with K a multiple of a span width each thread's words (and scales) of a span sit together."""
    gen = torch.Generator().manual_seed(9)
    k = 3 * span if span == 64 else 2 * span  # K = 192 is spanned by 64 only
    packed = torch.randint(0, 256, (2, 3, k // 2), dtype=torch.uint8, generator=gen)
    short = torch.randint(0, 256, (2, 3, 16), dtype=torch.uint8, generator=gen)  # K = 32: not spanned
    scale = torch.randint(0, 120, (2, 3, k // 16), dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)
    short_scale = torch.randint(0, 120, (2, 3, 2), dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)
    bank = {"gate_up_packed": packed, "gate_up_scale": scale, "down_packed": short, "down_scale": short_scale}
    moved = kernel_bank(bank)
    assert spans_moved(to_words(packed), moved["gate_up_words"], span, 4, 4)
    assert spans_moved(scale.view(torch.uint8), moved["gate_up_scale"].view(torch.uint8), span, 2, 2)
    assert torch.equal(from_words(moved["gate_up_words"]), packed)
    assert torch.equal(natural_scales(moved["gate_up_scale"]).view(torch.uint8), scale.view(torch.uint8))
    assert torch.equal(moved["down_words"], to_words(short)) and moved["down_scale"] is short_scale
    assert torch.equal(bank["gate_up_scale"].view(torch.uint8), scale.view(torch.uint8))  # not in place: untouched


def test_a_down_projection_splits_its_spans_into_two_powers_of_two() -> None:
    """The Gluon down kernel's I as a main run of spans and a shorter rest, both powers of two (tiles must be)."""
    powers = {1 << i for i in range(8)}
    for inter in range(16, 8192 + 1, 16):
        span = span_k(inter)
        split = moe_gluon.down_spans(inter)
        spans = inter // span if span else 0
        fits = any(spans - main in powers and main >= spans - main for main in powers if main < spans)
        assert (split is not None) == fits, inter
        if split is not None:
            main, rest = split
            assert main in powers and rest in powers and main >= rest and main + rest == spans, inter
    assert moe_gluon.down_spans(320) == (4, 1)  # the real I per rank at tp=2: five 64-k spans


def test_rows_a_down_program_takes() -> None:
    """Half a 16-row plan tile a down program while experts average at most six pairs, the whole tile beyond (where
    most tiles hold more than eight rows and two half programs would each read the weights), half a prompt's tile."""
    experts = 512
    limit = moe_gluon.MAX_PAIRS_PER_EXPERT * experts
    rows = [moe_gluon.down_rows(16, pairs, experts) for pairs in (1, 80, limit, limit + 1, 8190)]
    assert rows == [8, 8, 8, 16, 16]
    assert moe_gluon.down_rows(16, 3080, experts) == 16 and moe_gluon.down_rows(16, 3070, experts) == 8  # 308, 307 rows
    assert moe_gluon.down_rows(32, 8200, experts) == 16  # half of a prompt's 32-row tile


SPANNED_D, SPANNED_INTER = 128, 64  # the gate-up one span of 128 k a row, the down one of 64


@pytest.mark.parametrize("n", [1, 3])
def test_spanned_bank_matches_reference_and_rows_alone(n: int) -> None:
    bank = kernel_bank(make_bank(True, seed=4, d=SPANNED_D, inter=SPANNED_INTER))
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, SPANNED_D, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(n)]).to(torch.int32)
    w = torch.rand(n, TOP_K, generator=gen) + 0.1
    out = moe_forward(x, ids, w, bank, out_dtype=torch.float32)
    assert_matches_reference(out, x, ids, w, bank)
    for r in range(n):
        alone = moe_forward(x[r : r + 1], ids[r : r + 1], w[r : r + 1], bank, out_dtype=torch.float32)
        assert torch.equal(bits(alone[0]), bits(out[r]))


def bf16_value(bits: int) -> float:
    """The bf16 whose bit pattern is the low 16 bits of `bits`, as a float."""
    return torch.tensor([(bits & 0xFFFF) << 16], dtype=torch.int64).to(torch.int32).view(torch.float32).item()


@triton.jit
def _extract(words_ptr, out_ptr, N: tl.constexpr):
    """The kernels' four extractions of N words, stored as [N, 4] uint32 registers."""
    offs = tl.arange(0, N)
    r0, r1, r2, r3 = moe._bf16_pairs(tl.load(words_ptr + offs))
    tl.store(out_ptr + offs * 4, r0.to(tl.int32, bitcast=True))
    tl.store(out_ptr + offs * 4 + 1, r1.to(tl.int32, bitcast=True))
    tl.store(out_ptr + offs * 4 + 2, r2.to(tl.int32, bitcast=True))
    tl.store(out_ptr + offs * 4 + 3, r3.to(tl.int32, bitcast=True))


def test_word_extractions_give_every_code_scaled_by_two_to_minus_126() -> None:
    # each register holds elements 2j (low half) and 2j+1 (high half)
    lut = moe.fp4_lut()
    gen = torch.Generator().manual_seed(5)
    packed = torch.cat([torch.arange(256).repeat(4), torch.randint(0, 256, (3072,), generator=gen)]).to(torch.uint8)
    rows = packed.view(-1, 16)  # K = 32: words in k order (no spans)
    words = kernel_bank({"gate_up_packed": rows, "down_packed": packed[:4]})["gate_up_words"]
    registers = torch.empty(words.numel(), 4, dtype=torch.int32)
    _extract[(1,)](words, registers, N=words.numel())
    codes = torch.stack([packed & 0xF, packed >> 4], -1).flatten().view(-1, 8)
    for regs, elements in zip(registers.tolist(), codes.tolist(), strict=True):
        got = []
        for r in regs:
            got += [bf16_value(r), bf16_value((r & 0xFFFFFFFF) >> 16)]
        assert got == [lut[c].item() * 2.0**-126 for c in elements]


def tile_map(ids: torch.Tensor, num_experts: int, block_m: int, num_tiles: int) -> tuple[list[int], list[int]]:
    """(expert, first sorted position) of each row tile, in plain Python: (E, 0) past the last tile."""
    flat = ids.reshape(-1).tolist()
    experts, starts, pos = [], [], 0
    for e in range(num_experts):
        count = flat.count(e)
        experts += [e] * len(range(0, count, block_m))
        starts += [pos + r for r in range(0, count, block_m)]
        pos += count
    pad = num_tiles - len(experts)
    return experts + [num_experts] * pad, starts + [0] * pad


@pytest.mark.parametrize("block_m", [1, 2, 4, 16])
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("blocks", [(8, 16), (64, 256)])
@pytest.mark.parametrize("counted", [False, True])
def test_plan_matches_torch_plan_and_python(
    block_m: int, seed: int, blocks: tuple[int, int], counted: bool, monkeypatch
) -> None:
    """Scanning every earlier pair or reading counts made a launch before (counted: rows of 1.5 chunks, so a chunk
    also scans the pairs after the last whole row), the plan is the stable sort's."""
    monkeypatch.setattr(moe, "PLAN_CHUNK", blocks[0])  # small: several programs, each counting in several steps
    monkeypatch.setattr(moe, "PLAN_SCAN", blocks[1])
    monkeypatch.setattr(moe, "PLAN_COUNTED_PAIRS", 0 if counted else 1 << 30)
    monkeypatch.setattr(moe, "PLAN_COUNT", 3 * blocks[0] // 2)
    g = torch.Generator().manual_seed(seed)
    n, k = (7, TOP_K) if seed == 0 else (int(torch.randint(1, 40, (1,), generator=g)), 1 + seed)
    ids = torch.randint(0, E, (n, k), generator=g, dtype=torch.int32)
    if seed == 2:
        ids[ids == 3] = 5  # expert 3 gets no row, expert 5 the most
    plan, ref = moe_plan(ids, E, block_m), moe_plan_reference(ids, E, block_m)
    assert torch.equal(plan.pairs, ref.pairs) and torch.equal(plan.bounds, ref.bounds)
    assert torch.equal(plan.tile_experts, ref.tile_experts) and torch.equal(plan.tile_starts, ref.tile_starts)
    experts, starts = tile_map(ids, E, block_m, plan.max_tiles)
    assert plan.max_tiles == ref.max_tiles >= len([e for e in experts if e < E])
    assert plan.tile_experts.tolist() == experts and plan.tile_starts.tolist() == starts
    flat = ids.reshape(-1)
    assert torch.equal(flat[plan.pairs.long()], flat.sort(stable=True).values)
    assert torch.equal(plan.bounds, torch.tensor([0, *flat.bincount(minlength=E).cumsum(0).tolist()]).int())


def test_no_pairs_plan_no_tiles() -> None:
    plan, ref = moe_plan(torch.empty(0, TOP_K, dtype=torch.int32), E, 4), moe_plan_reference(torch.empty(0), E, 4)
    assert plan.bounds.tolist() == ref.bounds.tolist() == [0] * (E + 1)
    assert plan.tile_experts.tolist() == ref.tile_experts.tolist() == [E] and plan.tile_starts.tolist() == [0]


def test_tiles_past_the_last_get_no_expert() -> None:
    ids = torch.tensor([[2, 5], [2, 6], [2, 5]], dtype=torch.int32)  # 3 tiles where 6 pairs on 6 experts need 6
    for plan in (moe_plan(ids, E, 4), moe_plan_reference(ids, E, 4)):
        assert plan.max_tiles == 6
        assert plan.tile_experts.tolist() == [2, 5, 6, E, E, E] and plan.tile_starts.tolist() == [0, 3, 5, 0, 0, 0]


@pytest.mark.parametrize("kind", ["nvfp4", "bf16"])
def test_torch_plan_gives_the_same_bits(kind: str, monkeypatch) -> None:
    x, ids, w = make_routing(9, seed=4)
    ids[3] = ids[2]
    triton_plan = moe_forward(x, ids, w, BANKS[kind], out_dtype=torch.float32)
    monkeypatch.setattr(moe, "moe_plan", moe_plan_reference)
    torch_plan = moe_forward(x, ids, w, BANKS[kind], out_dtype=torch.float32)
    assert torch.equal(triton_plan.view(torch.int32), torch_plan.view(torch.int32))
    assert_matches_reference(torch_plan, x, ids, w, BANKS[kind])


def test_rejects_bad_bank() -> None:
    x, ids, w = make_routing(1, seed=0)
    with pytest.raises(ValueError, match="bank needs keys"):
        moe_forward(x, ids, w, {"gate_up": BANKS["bf16"]["gate_up"]})
    bad = dict(BANKS["nvfp4"], down_scale_2=torch.ones(E, 2))
    with pytest.raises(ValueError, match="down_scale_2"):
        moe_forward(x, ids, w, bad)
    with pytest.raises(ValueError, match="kernel_bank"):
        moe_forward(x, ids, w, PACKED)


@pytest.mark.parametrize("group", [2, 3])
@pytest.mark.parametrize("down_k", [16, 64])  # I = 32: two K tiles, or one masked past I
def test_down_column_tiles_run_in_turn_give_the_same_bits(group: int, down_k: int) -> None:
    x, ids, w = make_routing(6, seed=8)
    one = moe.MoeTiles(16, 32, 32, 16, down_k, 4, 1)
    grouped = moe.MoeTiles(16, 32, 32, 16, down_k, 4, 1, down_group=group)  # D = 64: 4 column tiles, a group short
    for bank in BANKS.values():
        want = moe_forward(x, ids, w, bank, torch.float32, tiles=one)
        got = moe_forward(x, ids, w, bank, torch.float32, tiles=grouped)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
        assert rel_err(got, moe_forward_reference(x, ids, w, bank, torch.float32)) <= 1e-3  # h's bf16 roundings


@pytest.mark.parametrize("kind", ["nvfp4", "bf16"])
@pytest.mark.parametrize("n", [1, 4])
def test_rows_below_pair_rows_run_each_pair_alone_with_the_grouped_bits(kind: str, n: int, monkeypatch) -> None:
    """Below PAIR_ROWS (one row; four with the limit raised) a call is two launches (no plan, the combine inside the
    down launch) and gives the bits of the grouped path's four, in both output dtypes, also where rows share experts
    and slots are out of order."""
    x, ids, w = make_routing(n, seed=30 + n)
    ids[-1] = ids[0].flip(0)  # the last row takes the first row's experts, in the other slot order
    assert moe.PAIR_ROWS == 2
    monkeypatch.setattr(moe, "PAIR_ROWS", n + 1)
    for out_dtype in (torch.float32, torch.bfloat16):
        with recording_launches() as launched:
            pairs = moe_forward(x, ids, w, BANKS[kind], out_dtype)
        assert launched == ["_gate_up_pairs_kernel", "_down_pairs_kernel"], launched
        with monkeypatch.context() as patched:
            patched.setattr(moe, "PAIR_ROWS", 0)
            with recording_launches() as launched:
                grouped = moe_forward(x, ids, w, BANKS[kind], out_dtype)
        assert launched == ["_plan_kernel", "_gate_up_kernel", "_down_kernel", "_combine_kernel"], launched
        assert torch.equal(bits(pairs), bits(grouped))
    assert_matches_reference(moe_forward(x, ids, w, BANKS[kind], torch.float32), x, ids, w, BANKS[kind])


@pytest.mark.parametrize("inter", [96, 192])  # three K tiles of the down projection: unspanned, and spans of 64
def test_the_pairs_paths_down_takes_each_k_tiles_own_block_scales(inter: int, monkeypatch) -> None:
    """The one-row down launch scales each K tile by that tile's own block scales: over three K tiles it gives the
    grouped path's bits and the reference's values (the other tests' down projections are one K tile deep)."""
    bank = kernel_bank(make_bank(True, seed=5, inter=inter))
    assert moe._k_tile(moe.moe_tiles(1, TOP_K, E).down_k, True, inter)[0] * 3 == inter
    x, ids, w = make_routing(1, seed=9)
    with recording_launches() as launched:
        pairs = moe_forward(x, ids, w, bank, torch.float32)
    assert launched == ["_gate_up_pairs_kernel", "_down_pairs_kernel"], launched
    monkeypatch.setattr(moe, "PAIR_ROWS", 0)
    assert torch.equal(bits(pairs), bits(moe_forward(x, ids, w, bank, torch.float32)))
    assert_matches_reference(pairs, x, ids, w, bank)


@pytest.mark.parametrize("kind", ["nvfp4", "bf16"])
@pytest.mark.parametrize(("n", "pair_rows"), [(1, 2), (3, 4), (5, 2)])  # the pairs path (three rows: limit raised)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_the_gated_shared_expert_is_added_as_gated_add_adds_it(
    kind: str, n: int, pair_rows: int, out_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the shared expert's output and gate logits the routed call gives gated_add's bits (in the pairs path's
    down launch, in the grouped path's combine launch: no launch of its own), and calls `ready` once, before the
    gate-up launch: so in the pairs path the down launch follows the gate-up alone, and may start beside it."""
    monkeypatch.setattr(moe, "PAIR_ROWS", pair_rows)
    x, ids, w = make_routing(n, seed=60 + n)
    g = torch.Generator().manual_seed(61)
    shared = (torch.randn(n, 2 * D, generator=g) * 4).bfloat16()[:, D:]  # rows at a stride of their own
    logits = (torch.randn(n, 3, generator=g) * 8).bfloat16()[:, 1:2]  # a column view, as the fused projection's
    logits[-1] = -88.0  # a sigmoid below fp32's normal range
    with recording_launches() as launched:
        marks: list[list[str]] = []
        ready = lambda: marks.append(list(launched))  # noqa: E731
        got = moe_forward(x, ids, w, BANKS[kind], out_dtype, gated=SharedGate(shared, logits, ready))
    routed = moe_forward(x, ids, w, BANKS[kind])
    want = gated_add(routed, logits, shared, out_dtype)
    assert got.dtype == out_dtype and torch.equal(bits(got), bits(want))
    if n < pair_rows:
        assert launched == ["_gate_up_pairs_kernel", "_down_pairs_kernel"], launched
        assert marks == [[]], marks
    else:
        assert launched[-1] == "_combine_kernel" and "_gated_add_kernel" not in launched, launched
        assert marks == [launched[: launched.index("_gate_up_kernel")]], (launched, marks)


@pytest.mark.parametrize("kind", ["nvfp4", "bf16"])
def test_the_combine_in_several_column_programs_gives_the_same_bits(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The grouped combine in 16-column programs (4 a row at D = 64) equals it in one program a row, gated or not:
    each output element's sum is its own, whatever the program that forms it."""
    x, ids, w = make_routing(5, seed=77)
    g = torch.Generator().manual_seed(78)
    shared, logits = (torch.randn(5, D, generator=g) * 4).bfloat16(), (torch.randn(5, 1, generator=g) * 8).bfloat16()
    gates = (None, SharedGate(shared, logits, lambda: None))
    whole = [moe_forward(x, ids, w, BANKS[kind], gated=gate) for gate in gates]
    monkeypatch.setattr(moe, "COMBINE_FEW_BLOCK", 16)
    assert moe.combine_block(5) == 16 and moe.combine_block(moe.COMBINE_FEW_ROWS + 1) == moe.COMBINE_BLOCK
    split = [moe_forward(x, ids, w, BANKS[kind], gated=gate) for gate in gates]
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(whole, split, strict=True))


def test_a_shared_gate_of_other_rows_is_refused() -> None:
    x, ids, w = make_routing(2, seed=62)
    shared, logits = torch.zeros(2, D, dtype=torch.bfloat16), torch.zeros(2, 1, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"gated\.shared"):
        moe_forward(x, ids, w, BANKS["bf16"], gated=SharedGate(shared[:1], logits, lambda: None))
    with pytest.raises(TypeError, match=r"gated\.gate_logit"):
        moe_forward(x, ids, w, BANKS["bf16"], gated=SharedGate(shared, logits.float(), lambda: None))
    with pytest.raises(ValueError, match=r"gated\.gate_logit"):
        moe_forward(x, ids, w, BANKS["bf16"], gated=SharedGate(shared, logits.T, lambda: None))


def test_no_rows_with_a_shared_gate_still_join() -> None:
    x, ids, w = make_routing(1, seed=63)
    joined: list[bool] = []
    empty = torch.zeros(0, D, dtype=torch.bfloat16), torch.zeros(0, 1, dtype=torch.bfloat16)
    out = moe_forward(x[:0], ids[:0], w[:0], BANKS["bf16"], gated=SharedGate(*empty, lambda: joined.append(True)))
    assert out.shape == (0, D) and joined == [True]


def test_a_row_alone_equals_the_row_in_a_grouped_batch() -> None:
    """A row alone (pairs path) equals the same row in a batch (grouped path), bit for bit."""
    n = moe.PAIR_ROWS + 1
    x, ids, w = make_routing(n, seed=41)
    for bank in BANKS.values():
        batch = moe_forward(x, ids, w, bank, torch.float32)
        for r in (0, n - 1):
            alone = moe_forward(x[r : r + 1], ids[r : r + 1], w[r : r + 1], bank, torch.float32)
            assert torch.equal(bits(alone[0]), bits(batch[r])), f"row {r}"


@pytest.mark.parametrize("kind", ["nvfp4", "bf16"])
def test_the_pairs_path_adds_a_rows_experts_in_ascending_id(kind: str, monkeypatch) -> None:
    """With four experts a row (three additions, whose order changes the fp32 sum), the pairs path gives the grouped
    path's bits: it adds the row's weighted outputs in ascending expert id, not in slot order."""
    x, ids, w = make_routing(3, seed=60, top_k=4)
    monkeypatch.setattr(moe, "PAIR_ROWS", 4)
    pairs = moe_forward(x, ids, w, BANKS[kind], torch.float32)
    monkeypatch.setattr(moe, "PAIR_ROWS", 0)
    grouped = moe_forward(x, ids, w, BANKS[kind], torch.float32)
    assert torch.equal(bits(pairs), bits(grouped))


@pytest.mark.parametrize("kind", ["nvfp4", "bf16"])
def test_the_pairs_path_ranks_three_slots_and_a_repeated_expert_as_grouped(kind: str, monkeypatch) -> None:
    """Three experts a row (so the kernels' slot vectors hold a padding slot) and a row that names one expert twice
    (its places ordered by slot): the pairs path, whose down kernel ranks the router's ids itself, gives the grouped
    path's bits."""
    x, ids, w = make_routing(3, seed=61, top_k=3)
    ids[1] = torch.tensor([6, 1, 6], dtype=torch.int32)
    w[1] = torch.tensor([0.5, 0.2, 0.3])
    monkeypatch.setattr(moe, "PAIR_ROWS", 4)
    pairs = moe_forward(x, ids, w, BANKS[kind], torch.float32)
    monkeypatch.setattr(moe, "PAIR_ROWS", 0)
    grouped = moe_forward(x, ids, w, BANKS[kind], torch.float32)
    assert torch.equal(bits(pairs), bits(grouped))


def test_partial_last_k_tiles_match_the_reference() -> None:
    """D and I not multiples of the K tile (48 against 32 under the interpreter): four rows (grouped path) match the
    fp32 reference, and one row (pairs path: gate-up over D, down over I, each ending in half a tile) has the bits
    of its row among the four."""
    d = inter = 48
    assert moe.moe_tiles(1, TOP_K, E).gate_up_k == 32 and d % 32 and inter % 32
    bank = make_bank(False, seed=3, d=d, inter=inter)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, d, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:TOP_K] for _ in range(4)]).to(torch.int32)
    w = torch.rand(4, TOP_K, generator=g) + 0.1
    w = w / w.sum(-1, keepdim=True)
    grouped = moe_forward(x, ids, w, bank, out_dtype=torch.float32)
    assert rel_err(grouped, moe_forward_reference(x, ids, w, bank, out_dtype=torch.float32)) <= 1e-3
    alone = moe_forward(x[:1], ids[:1], w[:1], bank, out_dtype=torch.float32)
    assert torch.equal(bits(alone[0]), bits(grouped[0]))
