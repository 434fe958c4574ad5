"""The hyper-connection read and write-back kernels against their references, the model, and themselves by batch."""

from __future__ import annotations

import dataclasses
import math
import os
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from kernels import hyper
from kernels.hyper import (
    UP_BLOCK_K,
    ReadTiles,
    Write,
    arrival_counters,
    block_r,
    hc_read,
    hc_read_reference,
    hc_write,
    hc_write_read,
    hc_write_reference,
    k_ranges,
    launch_read,
    stacked_rows,
)
from kernels.linear import k_ranges as linear_k_ranges
from model.hyper import GatedResidual
from tests.kernels.launches import recording_launches
from tests.kernels.sentinels import outputs_with_slack, untouched

D, R, EPS = 32, 8, 1e-6
TILES = (
    ReadTiles(16, 16, 16, 16, False, 4, 1),
    ReadTiles(16, 16, 16, 16, True, 4, 1),
    ReadTiles(32, 16, 32, 32, False, 4, 1),
    ReadTiles(64, 16, 64, 32, True, 4, 1),
)


def weights(hc: int, act: torch.dtype, seed: int = 0, d: int = D) -> dict[str, torch.Tensor]:
    """Random hyper-connection weights for hc streams of d: zero-centred norm weight, scaled projections."""
    g = torch.Generator().manual_seed(seed)
    k = hc * d
    return {
        "hc_norm_weight": (torch.randn(k, generator=g) * 0.1 - 0.06).to(torch.bfloat16),
        "w_down": (torch.randn(R, k, generator=g) / k**0.5).to(act),
        "w_up": (torch.randn(k, R, generator=g) * 2 / R**0.5).to(act),
        "w_inject": (torch.randn(hc, k, generator=g) * 4 / k**0.5).to(act),
    }


def wide_rows(n: int, hc: int, act: torch.dtype, seed: int = 1, d: int = D) -> torch.Tensor:
    """Random wide residual rows [n, hc·d] with a different scale per stream."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.arange(1, hc + 1).float().repeat_interleave(d)
    return (torch.randn(n, hc * d, generator=g) * scale).to(act)


def read(wide: torch.Tensor, w: dict[str, torch.Tensor], inject: bool, hc: int, fn=hc_read):
    """Call a read function with the weights, with or without the inject projection."""
    return fn(wide, w["hc_norm_weight"], w["w_down"], w["w_up"], w["w_inject"] if inject else None, EPS, hc)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error."""
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def tol(act: torch.dtype) -> float:
    """Tolerance: 1e-2 for bf16 outputs, 1e-5 for fp32."""
    return 1e-2 if act == torch.bfloat16 else 1e-5


@pytest.mark.parametrize("act", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hc", [2, 4])
@pytest.mark.parametrize("inject", [True, False])
def test_read_matches_reference(act: torch.dtype, hc: int, inject: bool) -> None:
    w, wide = weights(hc, act), wide_rows(7, hc, act)
    x, inj = read(wide, w, inject, hc)
    x_ref, inj_ref = read(wide, w, inject, hc, hc_read_reference)
    assert x.shape == (7, D) and x.dtype == act and not x.isnan().any()
    assert rel_err(x, x_ref) <= tol(act)
    if act == torch.bfloat16:  # rounded at the same places, only a sum order's last bit may flip a rounding
        assert (x != x_ref).float().mean() <= 0.05
    if inject:
        assert inj.shape == (7, hc) and inj.dtype == act and not inj.isnan().any()
        assert rel_err(inj, inj_ref) <= tol(act)
        assert act == torch.float32 or (inj != inj_ref).float().mean() <= 0.05
    else:
        assert inj is None and inj_ref is None


@pytest.mark.parametrize("act", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hc", [2, 4])
def test_read_and_write_match_the_model(act: torch.dtype, hc: int) -> None:
    cfg = SimpleNamespace(hc_count=hc, hidden_size=D, wide_size=hc * D, rms_norm_eps=EPS, hc_lowrank=R)
    w, wide = weights(hc, act, seed=2), wide_rows(6, hc, act, seed=3)
    block = GatedResidual(cfg).to(act)
    block.hc_norm.weight.data.copy_(w["hc_norm_weight"])
    block.input_mix_weight_down.weight.data.copy_(w["w_down"])
    block.input_mix_weight_up.weight.data.copy_(w["w_up"])
    block.block_inject_weight.weight.data.copy_(w["w_inject"])
    x, inj = read(wide, w, True, hc)
    x_model, inj_model = block.read(wide)
    assert rel_err(x, x_model) <= tol(act)
    assert rel_err(inj, inj_model) <= tol(act)
    y = torch.randn(6, D, generator=torch.Generator().manual_seed(4)).to(act)
    assert rel_err(hc_write(wide, y, inj), GatedResidual.write(wide, y, inj)) <= tol(act)


@pytest.mark.parametrize("act", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("inject", [True, False])
def test_read_rows_identical_across_batch_sizes(act: torch.dtype, inject: bool) -> None:
    w, wide = weights(4, act, seed=5), wide_rows(5, 4, act, seed=6)
    alone = [read(wide[i : i + 1], w, inject, 4) for i in range(5)]
    for batch in (2, 5):
        x, inj = read(wide[:batch], w, inject, 4)
        assert torch.equal(x, torch.cat([a[0] for a in alone[:batch]]))
        if inject:
            assert torch.equal(inj, torch.cat([a[1] for a in alone[:batch]]))


@pytest.mark.parametrize("act", [torch.bfloat16, torch.float32])
def test_read_tiles_and_split_modes_agree(act: torch.dtype) -> None:
    w, wide = weights(4, act, seed=7), wide_rows(5, 4, act, seed=8)
    assert k_ranges(4 * D, D)[0] > 1, "the test shape should cut K into ranges"
    one = [launch_read(wide[i : i + 1], *w.values(), EPS, 4, TILES[0]) for i in range(5)]
    for tiles in TILES:
        x, inj = launch_read(wide, *w.values(), EPS, 4, tiles)
        assert torch.equal(x, torch.cat([o[0] for o in one])), tiles
        assert torch.equal(inj, torch.cat([o[1] for o in one])), tiles
    assert not arrival_counters(wide.device, 1).any()


def test_read_norms_each_stream_on_its_own() -> None:
    w, wide = weights(2, torch.float32, seed=9), wide_rows(3, 2, torch.float32, seed=10)
    x, inj = read(wide, w, True, 2)
    scaled = wide.clone()
    scaled[:, D:] *= 8
    x_scaled, inj_scaled = read(scaled, w, True, 2)
    assert rel_err(x_scaled, x) <= 1e-5 and rel_err(inj_scaled, inj) <= 1e-5


@pytest.mark.parametrize("act", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hc", [2, 4])
def test_write_matches_reference(act: torch.dtype, hc: int) -> None:
    g = torch.Generator().manual_seed(11)
    wide = wide_rows(7, hc, act, seed=12)
    y = torch.randn(7, D, generator=g).to(act)
    inj = (torch.rand(7, hc, generator=g) * 2).to(act)
    out, ref = hc_write(wide, y, inj), hc_write_reference(wide, y, inj)
    assert out.dtype == act and not out.isnan().any()
    if act == torch.bfloat16:
        assert torch.equal(out, ref), "bf16 products are exact in fp32, so the write-back is bit-exact"
    assert rel_err(out, ref) <= tol(act)
    assert not torch.equal(out, wide)
    in_place = wide.clone()
    assert hc_write(in_place, y, inj, out=in_place) is in_place and torch.equal(in_place, out)


@pytest.mark.parametrize("act", [torch.bfloat16, torch.float32])
def test_write_partials_equal_summing_then_writing(act: torch.dtype) -> None:
    g = torch.Generator().manual_seed(13)
    wide = wide_rows(5, 4, act, seed=14)
    parts = torch.randn(2, 5, D, generator=g)
    inj = (torch.rand(5, 4, generator=g) * 2).to(act)
    expect = hc_write(wide, (parts[0] + parts[1]).to(act), inj)
    assert torch.equal(hc_write(wide, parts, inj), expect)
    assert torch.equal(hc_write_reference(wide, parts, inj), expect)
    assert not torch.equal(hc_write(wide, parts[:1], inj), expect)


def test_write_partials_add_in_rank_order() -> None:
    parts = torch.zeros(3, 1, D)
    parts[0], parts[1], parts[2] = 2.0**24, -(2.0**24), 0.5
    wide, inj = torch.zeros(1, 2 * D), torch.ones(1, 2)
    out = hc_write(wide, parts, inj)
    assert torch.equal(out, torch.full((1, 2 * D), 0.5)), "((p0 + p1) + p2), not p0 + (p1 + p2) = 0"
    assert torch.equal(hc_write_reference(wide, parts, inj), out)


@pytest.mark.parametrize("partials", [False, True])
def test_write_rows_identical_across_batch_sizes(partials: bool) -> None:
    g = torch.Generator().manual_seed(15)
    wide = wide_rows(5, 4, torch.bfloat16, seed=16)
    y = torch.randn(2, 5, D, generator=g) if partials else torch.randn(5, D, generator=g).to(torch.bfloat16)
    inj = (torch.rand(5, 4, generator=g) * 2).to(torch.bfloat16)
    batch = hc_write(wide, y, inj)
    rows = [hc_write(wide[i : i + 1], y[..., i : i + 1, :], inj[i : i + 1]) for i in range(5)]
    assert torch.equal(batch, torch.cat(rows))


def test_empty_batch() -> None:
    w = weights(4, torch.bfloat16)
    x, inj = read(torch.zeros(0, 4 * D, dtype=torch.bfloat16), w, True, 4)
    assert x.shape == (0, D) and inj.shape == (0, 4)
    empty = torch.zeros(0, 4 * D, dtype=torch.bfloat16)
    assert hc_write(empty, torch.zeros(0, D, dtype=torch.bfloat16), inj).shape == (0, 4 * D)


def test_strided_rows() -> None:
    w = weights(4, torch.bfloat16, seed=17)
    wide = wide_rows(3, 4, torch.bfloat16, seed=18)
    padded = torch.cat([wide, torch.ones(3, 16, dtype=torch.bfloat16)], dim=1)[:, : 4 * D]
    assert padded.stride(0) != padded.shape[1]
    x, inj = read(padded, w, True, 4)
    x_ref, inj_ref = read(wide, w, True, 4)
    assert torch.equal(x, x_ref) and torch.equal(inj, inj_ref)
    y = torch.randn(3, D).to(torch.bfloat16)
    assert torch.equal(hc_write(padded, y, inj), hc_write(wide, y, inj))


@pytest.mark.parametrize(("k", "d"), [(10240, 2560), (128, 32), (64, 32), (192, 48), (4 * 1040, 1040)])
def test_k_ranges_tile_k(k: int, d: int) -> None:
    split, k_split = k_ranges(k, d)
    assert 1 <= split <= 16 and (split - 1) * k_split < k <= split * k_split
    assert k_ranges(10240, 2560) == (16, 640)


def test_rejects_bad_inputs() -> None:
    w, wide = weights(4, torch.bfloat16), wide_rows(2, 4, torch.bfloat16)
    with pytest.raises(ValueError, match="w_down"):
        hc_read(wide, w["hc_norm_weight"], w["w_down"].float(), w["w_up"], None, EPS, 4)
    with pytest.raises(ValueError, match="hc_norm_weight"):
        hc_read(wide, w["hc_norm_weight"].double(), w["w_down"], w["w_up"], None, EPS, 4)
    with pytest.raises(ValueError, match="w_inject"):
        hc_read(wide, w["hc_norm_weight"], w["w_down"], w["w_up"], w["w_inject"][:2], EPS, 4)
    with pytest.raises(ValueError, match="wide"):
        hc_read(wide[:, :-8], w["hc_norm_weight"], w["w_down"], w["w_up"], None, EPS, 4)
    with pytest.raises(ValueError, match="wide"):
        hc_read(wide.half(), w["hc_norm_weight"], w["w_down"], w["w_up"], None, EPS, 4)
    inj = torch.ones(2, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="y_or_partials"):
        hc_write(wide, torch.zeros(2, D), inj)
    with pytest.raises(ValueError, match="y_or_partials"):
        hc_write(wide, torch.zeros(2, 2, D, dtype=torch.bfloat16), inj)
    with pytest.raises(ValueError, match="inject"):
        hc_write(wide, torch.zeros(2, D, dtype=torch.bfloat16), inj.float())
    with pytest.raises(ValueError, match="out"):
        hc_write(wide, torch.zeros(2, D, dtype=torch.bfloat16), inj, out=wide.float())
    with pytest.raises(ValueError, match="exceed the 1024 words of its zeroed pool"):
        arrival_counters(wide.device, 4096)


def test_gpu_script_cpu_parts(tmp_path: Path) -> None:
    import gpu_check_hyper as script

    args = script.parse_args(["--out", str(tmp_path), "--only", "read", "write_tp2", "--batches", "1", "64"])
    assert args.out == tmp_path and args.only == ["read", "write_tp2"] and args.batches == [1, 64]
    real = script.REAL
    mem, flop = script.floor_us("read", 1, real)
    weight_bytes = (2 * 320 * 10240 + 4 * 10240) * 2
    assert abs(mem - (weight_bytes + 10240 * 2 + 2560 * 2 + 4 * 2) / 4.27e6) < 1e-6 and flop < mem
    mem, _ = script.floor_us("write_tp2", 8, real)
    assert abs(mem - (2 * 8 * 10240 * 2 + 2 * 8 * 2560 * 4 + 8 * 4 * 2) / 4.27e6) < 1e-6
    small = script.Shape(hc=4, d=D, r=R)
    gen = torch.Generator().manual_seed(0)
    for op in script.OPS:
        row = script.run_case(op, 3, small, gen, torch.device("cpu"), timed=False, invariance_batches=(1, 3))
        assert "error" not in row, row
        assert script.passed(row) and row["row_invariant"] and row["rel_err"] <= 1e-2, row
    row = {"op": "read", "n": 1, "nan": False, "row_invariant": True, "rel_err": 2e-2}
    assert not script.passed(row) and script.passed({**row, "rel_err": 1e-3})
    assert "ERROR" in script.line({"op": "write", "n": 8, "error": "boom"})
    assert script.main(["--out", str(tmp_path)]) == 2


@pytest.mark.parametrize("down, up", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("inject", [True, False])
def test_read_via_linear_matches_the_fused_kernels(inject: bool, down: bool, up: bool) -> None:
    """The down projection by the linear kernel and the up projection by `_up_mix_kernel`, over stored normed rows:
    rows alone equal rows in a batch, and the read equals the fused kernels' and the reference's within bf16
    tolerance. Two streams of 64: a shape whose K the linear kernel cuts as the fused kernel does (one range)."""
    w, wide = weights(2, torch.bfloat16, seed=11, d=64), wide_rows(5, 2, torch.bfloat16, seed=12, d=64)
    assert k_ranges(2 * 64, 64) == linear_k_ranges(R + 2, 2 * 64) == linear_k_ranges(R, 2 * 64)
    if inject:  # the model's layout: the inject rows right after the down rows, in one tensor
        stacked = torch.cat((w["w_down"], w["w_inject"]))
        w["w_down"], w["w_inject"] = stacked[: w["w_down"].shape[0]], stacked[w["w_down"].shape[0] :]
        assert stacked_rows(w["w_down"], w["w_inject"]).data_ptr() == stacked.data_ptr()
    else:
        w["w_inject"] = None
    via = dataclasses.replace(TILES[0], via_linear=down, up_over_normed=up)
    skipped = {"_down_kernel": down, "_mix_kernel": up}  # the fused kernels a via-linear path must not launch
    with ExitStack() as stack:
        for name in (name for name, skip in skipped.items() if skip):
            stack.enter_context(mock.patch.object(hyper, name, None))
        one = [launch_read(wide[i : i + 1], *w.values(), EPS, 2, via) for i in range(5)]
        x, inj = launch_read(wide, *w.values(), EPS, 2, via)
    fused_x, fused_inj = launch_read(wide, *w.values(), EPS, 2, TILES[0])
    assert torch.equal(x, torch.cat([o[0] for o in one]))  # rows alone = in a batch
    assert rel_err(x, fused_x) <= tol(torch.bfloat16)
    ref_x, ref_inj = hc_read_reference(wide, *w.values(), EPS, 2)
    assert rel_err(x, ref_x) <= tol(torch.bfloat16)
    if inject:
        assert torch.equal(inj, torch.cat([o[1] for o in one]))
        assert rel_err(inj, ref_inj) <= tol(torch.bfloat16) and rel_err(inj, fused_inj) <= tol(torch.bfloat16)


def test_the_up_kernel_keeps_a_negative_zero_column_as_the_fused_kernels_do() -> None:
    """A feature that is -0.0 in every stream stays -0.0 through the up kernel's stream sums (each stream's normed
    tile is picked out of one load by its bits), as through the fused mix kernel."""
    w, wide = weights(2, torch.bfloat16, seed=13, d=64), wide_rows(3, 2, torch.bfloat16, seed=14, d=64)
    w["hc_norm_weight"] = w["hc_norm_weight"].abs()  # 1 + w > 0: the normed -0.0 keeps its sign
    wide[:, [5, 64 + 5]] = -0.0
    up = dataclasses.replace(TILES[0], up_over_normed=True)
    x, _ = launch_read(wide, *w.values(), EPS, 2, up)
    fused_x, _ = launch_read(wide, *w.values(), EPS, 2, TILES[0])
    assert torch.signbit(fused_x[:, 5]).all() and (fused_x[:, 5] == 0).all()
    assert torch.equal(x[:, 5].view(torch.int16), fused_x[:, 5].view(torch.int16))


def test_the_read_keeps_the_fused_down_kernel_where_the_linear_kernel_cuts_k_otherwise() -> None:
    """Four streams of 32: the linear kernel would sum K = 128 in one range, the fused kernel in two. Asked for the
    linear path, the read keeps the fused kernel, so a row's bits do not depend on which path its batch size picks."""
    w, wide = weights(4, torch.bfloat16, seed=13), wide_rows(6, 4, torch.bfloat16, seed=14)
    assert k_ranges(4 * D, D) != linear_k_ranges(R + 4, 4 * D)
    fused = launch_read(wide, *w.values(), EPS, 4, TILES[0])
    with mock.patch.object(hyper, "linear_gates", None), mock.patch.object(hyper, "linear_range_sums", None):
        via = launch_read(wide, *w.values(), EPS, 4, dataclasses.replace(TILES[0], via_linear=True))
    assert torch.equal(via[0], fused[0]) and torch.equal(via[1], fused[1])


def test_reads_of_any_row_count_ask_for_the_paths_over_stored_normed_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the GPU every batch size asks for the down projection by the linear kernel and the up projection over the
    stored normed rows (prompt rounds included), gated row by row up to UP_BY_ROW rows."""
    monkeypatch.setattr(hyper, "INTERPRET", False)
    for n in (1, 4, 5, 256, 257, 1024, 8192):
        tiles = hyper.read_tiles(n, 320)
        assert tiles.via_linear and tiles.up_over_normed, n
        assert tiles.up_by_row == tiles.up_adds_ranges == (n <= hyper.UP_BY_ROW), n


@pytest.mark.parametrize("hc, n", [(2, 1), (2, 5), (3, 17)])
def test_the_up_kernel_gating_row_by_row_gives_the_whole_tiles_bits(hc: int, n: int) -> None:
    """`_up_mix_kernel` with `up_by_row` gives x bit for bit as over its whole row tile: one row, a tile of five, a
    second tile of one row, three streams padded to four, and a feature that is -0.0 in every stream."""
    d = 64
    w, wide = weights(hc, torch.bfloat16, seed=15, d=d), wide_rows(n, hc, torch.bfloat16, seed=16, d=d)
    w["hc_norm_weight"] = w["hc_norm_weight"].abs()  # 1 + w > 0: the normed -0.0 keeps its sign
    wide[:, [b * d + 5 for b in range(hc)]] = -0.0
    tiles = dataclasses.replace(TILES[0], up_over_normed=True)
    with recording_launches() as launched:
        x, _ = launch_read(wide, *w.values(), EPS, hc, tiles)
        by_row_x, _ = launch_read(wide, *w.values(), EPS, hc, dataclasses.replace(tiles, up_by_row=True))
    assert launched.count("_up_mix_kernel") == 2 and "_mix_kernel" not in launched
    assert torch.signbit(x[:, 5]).all()
    assert torch.equal(by_row_x.view(torch.int16), x.view(torch.int16))
    assert rel_err(by_row_x, hc_read_reference(wide, *w.values(), EPS, hc)[0]) <= tol(torch.bfloat16)


@pytest.mark.parametrize("inject", [True, False])
def test_the_up_kernel_adding_the_down_projections_range_sums_gives_the_linear_gates_bits(inject: bool) -> None:
    """With `up_adds_ranges` the linear launch stores its K ranges' fp32 sums and `_up_mix_kernel` adds them in range
    order and forms h and inject itself: x and inject bit for bit as from the gates the linear launch stores, with no
    h in memory. The real K (16 ranges of 640), one row and three; the first down and inject rows sum 2^25, -2^25
    and 1 over the first three ranges, which only range order adds to 1."""
    hc, d, r = 4, 2560, 64
    g = torch.Generator().manual_seed(21)
    k = hc * d
    stacked = torch.randn(r + hc, k, generator=g) / k**0.5
    for row in (0, r):
        stacked[row] = 0.0
        stacked[row, [0, 640, 1280]] = torch.tensor([2.0**25, -(2.0**25), 1.0])
    stacked = stacked.bfloat16()
    norm_weight = (torch.randn(k, generator=g) * 0.1).abs()
    norm_weight[:d] = 0.0  # with rows of ones in stream 0, its normed values are 1.0
    w = {
        "hc_norm_weight": norm_weight.bfloat16(),
        "w_down": stacked[:r],
        "w_up": (torch.randn(k, r, generator=g) * 2 / r**0.5).bfloat16(),
        "w_inject": stacked[r:] if inject else None,
    }
    assert k_ranges(k, d) == linear_k_ranges(r + hc, k) == (16, 640)
    tiles = ReadTiles(16, 16, 16, 32, False, 2, 1, via_linear=True, up_over_normed=True, up_by_row=True)
    for n in (1, 3):
        wide = (torch.randn(n, k, generator=g) * 3).bfloat16()
        wide[:, :d] = 1.0
        x, inj = launch_read(wide, *w.values(), EPS, hc, tiles)
        made, real_empty = [], torch.empty

        def recorded_empty(*args, _real=real_empty, _made=made, **kwargs):
            out = _real(*args, **kwargs)
            _made.append((tuple(out.shape), out.dtype))
            return out

        with recording_launches() as launched, mock.patch.object(torch, "empty", recorded_empty):
            sums_x, sums_inj = launch_read(wide, *w.values(), EPS, hc, dataclasses.replace(tiles, up_adds_ranges=True))
        assert launched == ["_rstd_kernel", "_linear_kernel", "_up_mix_kernel"], launched
        assert ((16, n, r + (hc if inject else 0)), torch.float32) in made and ((n, r), torch.bfloat16) not in made
        assert torch.equal(sums_x.view(torch.int16), x.view(torch.int16)), n
        if inject:
            assert torch.equal(sums_inj.view(torch.int16), inj.view(torch.int16)), n
            in_order = torch.tensor(2.0 / (1.0 + math.exp(-1.0 / hc))).bfloat16()  # not 2·sigmoid(0) = 1
            assert (sums_inj[:, 0] == in_order).all(), sums_inj[:, 0]


def test_a_reduced_fp32_sum_writes_the_bits_of_the_combined_bf16_sum() -> None:
    """At tp=2 a sub-block's output reaches hc_write as the all-reduced fp32 sum of two bf16 partials; the write
    rounds it once, so the residual gets the bits it would from `TensorParallel.combine`'s bf16 sum."""
    from model.kernel_blocks import write_input

    g = torch.Generator().manual_seed(15)
    p0, p1 = ((torch.randn(6, D, generator=g) * 300).bfloat16() for _ in range(2))
    total = p0.float() + p1.float()  # what the in-place all-reduce of the two fp32 partials leaves on both ranks
    assert not torch.equal(total.bfloat16().float(), total), "the sum must round for the test to mean anything"
    wide = wide_rows(6, 4, torch.bfloat16, seed=16)
    inject = (torch.rand(6, 4, generator=g) * 2).bfloat16()
    written = hc_write(wide, write_input(total, wide), inject)
    assert torch.equal(written, hc_write(wide, total.bfloat16(), inject))
    assert torch.equal(written, hc_write_reference(wide, total.bfloat16(), inject))


def test_the_down_path_follows_the_fused_kernels_k_ranges() -> None:
    """The down (+ inject) projection by the linear kernel only where it cuts K into the fused kernel's ranges."""
    assert not hyper.down_via_linear(4 * 32, 32, 8, 4, inject=True)  # 2 fused ranges, 1 linear
    assert hyper.down_via_linear(2 * 64, 64, 8, 2, inject=True)  # both 1 range
    assert hyper.down_via_linear(2 * 64, 64, 8, 2, inject=False)


@pytest.mark.parametrize("n", [1, 5, 20])
def test_a_read_over_normed_rows_is_three_launches_that_store_no_fp32_sums(n: int) -> None:
    """Over the stored normed rows a read is the rstd kernel, one linear launch that stores the gates h and inject
    from its sums, and one kernel for the up projection and the gated stream mean: no other kernel, no fp32 sums
    [N, r + hc] or [N, hc·d] in memory; x and inject equal the fused kernels' within bf16 tolerance, each row alone
    as in the batch (20 rows: two row tiles)."""
    w, wide = weights(2, torch.bfloat16, seed=17, d=64), wide_rows(n, 2, torch.bfloat16, seed=18, d=64)
    stacked = torch.cat((w["w_down"], w["w_inject"]))  # the model's layout: one linear launch takes both
    w["w_down"], w["w_inject"] = stacked[:R], stacked[R:]
    via = dataclasses.replace(TILES[0], via_linear=True, up_over_normed=True)
    made, real_empty = [], torch.empty

    def recorded_empty(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        made.append((tuple(out.shape), out.dtype))
        return out

    with recording_launches() as launched, mock.patch.object(torch, "empty", recorded_empty):
        x, inj = launch_read(wide, *w.values(), EPS, 2, via)
    assert launched == ["_rstd_kernel", "_linear_kernel", "_up_mix_kernel"], launched
    assert not {((n, R + 2), torch.float32), ((n, 2 * 64), torch.float32)} & set(made), made
    one = [launch_read(wide[i : i + 1], *w.values(), EPS, 2, via) for i in range(n)]
    assert torch.equal(x, torch.cat([o[0] for o in one])) and torch.equal(inj, torch.cat([o[1] for o in one]))
    fused_x, fused_inj = launch_read(wide, *w.values(), EPS, 2, TILES[0])
    assert rel_err(x, fused_x) <= tol(torch.bfloat16) and rel_err(inj, fused_inj) <= tol(torch.bfloat16)


def test_an_up_tile_wider_than_the_up_kernel_takes_runs_the_fused_mix() -> None:
    """The up kernel's tile holds every stream's columns: past UP_MIX_COLUMNS of them (hc padded to a power of two,
    times up_d) the read keeps the fused mix kernel, with the same x as a narrower tile through the up kernel."""
    w, wide = weights(3, torch.bfloat16, seed=19, d=64), wide_rows(4, 3, torch.bfloat16, seed=20, d=64)
    wide_tile = dataclasses.replace(TILES[0], up_d=64, up_over_normed=True)
    assert 4 * wide_tile.up_d > hyper.UP_MIX_COLUMNS
    with recording_launches() as launched:
        x, inj = launch_read(wide, *w.values(), EPS, 3, wide_tile)
    assert "_mix_kernel" in launched and "_up_mix_kernel" not in launched, launched
    narrow = dataclasses.replace(wide_tile, up_d=16)
    with recording_launches() as launched:
        nx, ninj = launch_read(wide, *w.values(), EPS, 3, narrow)
    assert "_up_mix_kernel" in launched, launched
    assert rel_err(x, nx) <= tol(torch.bfloat16) and torch.equal(inj, ninj)


@pytest.mark.parametrize("act", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("partials", [False, True])
@pytest.mark.parametrize("tiles", [TILES[0], dataclasses.replace(TILES[1], via_linear=True, up_over_normed=True)])
def test_a_write_fused_into_the_read_gives_both_calls_bits(act, partials: bool, tiles: ReadTiles) -> None:
    """The write inside the read's first launch: the new rows, x and inject have the bits of hc_write then the read
    (fused kernels, or the linear and up-mix launches over stored normed rows), one launch fewer, the old rows kept."""
    g = torch.Generator().manual_seed(50)
    w, wide = weights(4, act, seed=51), wide_rows(5, 4, act, seed=52)
    y = torch.randn(2, 5, D, generator=g) if partials else torch.randn(5, D, generator=g).to(act)
    inj = (torch.rand(5, 4, generator=g) * 2).to(act)
    old = wide.clone()
    args = (w["hc_norm_weight"], w["w_down"], w["w_up"], w["w_inject"], EPS, 4, tiles)
    with recording_launches() as apart:
        written = hc_write(wide, y, inj)
        want_x, want_inj = launch_read(written, *args)
    out = torch.empty_like(wide)
    with recording_launches() as fused:
        x, read_inj = launch_read(wide, *args, write=Write(y, inj, out))
    assert apart[0] == "_write_kernel" and fused == apart[1:], (apart, fused)
    assert torch.equal(out, written) and torch.equal(x, want_x) and torch.equal(read_inj, want_inj)
    assert torch.equal(wide, old)
    new_wide, x2, inj2 = hc_write_read(wide, y, inj, *args[:-1])
    assert torch.equal(new_wide, written) and torch.equal(x2, x) and torch.equal(inj2, read_inj)


@pytest.mark.parametrize("limit", [4096, 1024])  # d = 1,040 whole, or in two chunks of 1,024
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])  # bf16: the normed rows stored too
def test_the_rstd_kernel_holds_a_stream_whole_up_to_its_limit(
    limit: int, act: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Streams up to RSTD_ONE_CHUNK wide are normed from registers, wider ones chunk by chunk; both match the
    references, with and without a write in the launch."""
    assert (hyper.rstd_block(2560), hyper.rstd_block(32), hyper.rstd_block(5000)) == (4096, 32, 1024)
    monkeypatch.setattr(hyper, "RSTD_ONE_CHUNK", limit)
    assert hyper.rstd_block(1040) == min(limit, 2048)
    d = 1040
    g = torch.Generator().manual_seed(60)
    w, wide = weights(4, act, seed=61, d=d), wide_rows(2, 4, act, seed=62, d=d)
    args = (w["hc_norm_weight"], w["w_down"], w["w_up"], w["w_inject"], EPS, 4)
    x, inj = hc_read(wide, *args)
    x_ref, inj_ref = hc_read_reference(wide, *args)
    assert rel_err(x, x_ref) <= tol(act) and rel_err(inj, inj_ref) <= tol(act)
    y, scale = torch.randn(2, d, generator=g).to(act), (torch.rand(2, 4, generator=g) * 2).to(act)
    new_wide, x2, inj2 = hc_write_read(wide, y, scale, *args)
    written = hc_write_reference(wide, y, scale)
    x2_ref, inj2_ref = hc_read_reference(written, *args)
    assert torch.equal(new_wide, written)
    assert rel_err(x2, x2_ref) <= tol(act) and rel_err(inj2, inj2_ref) <= tol(act)


def test_a_fused_write_refuses_what_the_read_cannot_take() -> None:
    w, wide = weights(4, torch.float32, seed=53), wide_rows(3, 4, torch.float32, seed=54)
    y, inj = torch.randn(3, D), torch.rand(3, 4)
    args = (w["hc_norm_weight"], w["w_down"], w["w_up"], w["w_inject"], EPS, 4, TILES[0])
    buf = torch.zeros(3 * 4 * D + 3 * D + 3 * 4)  # out, then a y and an inject in the same memory
    out, y_in, inj_in = buf[: 3 * 4 * D].view(3, 4 * D), buf[3 * 4 * D : -12].view(3, D), buf[-12:].view(3, 4)
    for write in (Write(y, inj, wide), Write(y_in, inj, out), Write(y, inj_in, out)):
        with pytest.raises(ValueError, match="a tensor of its own"):
            launch_read(wide, *args, write=write)
    with pytest.raises(ValueError, match="write inject: 2 streams"):  # a write of two streams of 2·D
        launch_read(wide, *args, write=Write(torch.randn(3, 2 * D), torch.rand(3, 2), torch.empty_like(wide)))
    with pytest.raises(ValueError, match="write out"):
        launch_read(wide, *args, write=Write(y, inj, torch.empty(3, 4 * D, dtype=torch.bfloat16)))


@pytest.mark.parametrize("up_over_normed", [False, True], ids=["mix-kernel", "up-mix-kernel"])
def test_a_read_of_the_models_low_rank_takes_every_chunk_of_r_and_column_tile_of_h(up_over_normed: bool) -> None:
    """r = 320 (the model's): the down kernel's 20 column tiles of 16, the mix kernel's five chunks of r (64) or the
    up kernel's three (128); x and inject match the reference."""
    hc, d, r, n = 2, 64, 320, 3
    k = hc * d
    g = torch.Generator().manual_seed(70)
    norm_weight = (torch.randn(k, generator=g) * 0.1).bfloat16()
    w_down = (torch.randn(r, k, generator=g) / k**0.5).bfloat16()
    w_up = (torch.randn(k, r, generator=g) * 2 / r**0.5).bfloat16()
    w_inject = (torch.randn(hc, k, generator=g) * 4 / k**0.5).bfloat16()
    wide = (torch.randn(n, k, generator=g) * 2).bfloat16()
    tiles = ReadTiles(16, 16, 16, 16, False, 4, 1, up_over_normed=up_over_normed)
    assert r > 2 * tiles.down_r and r > 2 * (UP_BLOCK_K if up_over_normed else block_r(r))
    with recording_launches() as launched:
        x, inj = launch_read(wide, norm_weight, w_down, w_up, w_inject, EPS, hc, tiles)
    assert launched[1:] == ["_down_kernel", "_up_mix_kernel" if up_over_normed else "_mix_kernel"], launched
    x_ref, inj_ref = hc_read_reference(wide, norm_weight, w_down, w_up, w_inject, EPS, hc)
    assert rel_err(x, x_ref) <= 1e-2 and (x != x_ref).float().mean() <= 0.05
    assert rel_err(inj, inj_ref) <= 1e-2 and (inj != inj_ref).float().mean() <= 0.05


def test_down_kernel_stores_no_h_column_past_r() -> None:
    """r not a multiple of the down kernel's column tile: h's last tile stores no column r (another row's column 0)."""
    hc, d, r, n = 2, 32, 24, 3
    g = torch.Generator().manual_seed(3)
    k = hc * d
    down_buf = torch.randn(r + 1, k, generator=g) / k**0.5
    down_buf[r] = 50.0  # the row just past w_down: any column r it fed would be far from every true h
    w_down = down_buf[:r]
    norm_w = (torch.randn(k, generator=g) * 0.1).to(torch.bfloat16)
    w_up = torch.randn(k, r, generator=g) * 2 / r**0.5
    wide = torch.randn(n, k, generator=g)
    x, _ = hc_read(wide, norm_w, w_down, w_up, None, 1e-6, hc)
    x_ref, _ = hc_read_reference(wide, norm_w, w_down, w_up, None, 1e-6, hc)
    assert rel_err(x, x_ref) <= 1e-5


def test_chunked_fused_write_stores_no_column_past_the_last_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """d in two rstd chunks (1,040 by 1,024): the fused write's last chunk stores nothing past its row's last stream."""
    monkeypatch.setattr(hyper, "RSTD_ONE_CHUNK", 1024)
    hc, d, r, n = 2, 1040, 16, 2
    g = torch.Generator().manual_seed(5)
    k = hc * d
    wide = torch.randn(n, k, generator=g)
    y, inj = torch.randn(n, d, generator=g), torch.rand(n, hc, generator=g) * 2
    norm_w = (torch.randn(k, generator=g) * 0.1).to(torch.bfloat16)
    w_down, w_up = torch.randn(r, k, generator=g) / k**0.5, torch.randn(k, r, generator=g) / r**0.5
    buf = torch.full((n + 1, k), 7.0)  # out is its first n rows; row n must stay untouched
    tiles = ReadTiles(64, 16, 64, 64, True, 4, 1)
    launch_read(wide, norm_w, w_down, w_up, None, 1e-6, hc, tiles, Write(y, inj, buf[:n]))
    assert torch.equal(buf[:n], hc_write(wide, y, inj))
    assert torch.equal(buf[n], torch.full((k,), 7.0))


def test_the_up_kernels_inject_programs_store_nothing_past_a_rows_streams() -> None:
    """hc = 3 streams in 4 lanes: the up kernel's inject programs (K-range sums added there) store no lane past hc,
    with inject made inside a longer buffer whose elements after it keep their bits. (A store past a row lands in
    the next row's first stream, which on the CPU the next row's program overwrites, and on a GPU races it; past the
    last row it shows here.)"""
    hc, d, r, n = 3, 128, 16, 2
    g = torch.Generator().manual_seed(13)
    k = hc * d
    wide = torch.randn(n, k, generator=g).bfloat16()
    norm_w = (torch.randn(k, generator=g) * 0.1).to(torch.bfloat16)
    w_down, w_inject = ((torch.randn(m, k, generator=g) / k**0.5).bfloat16() for m in (r, hc))
    w_up = (torch.randn(k, r, generator=g) * 2 / r**0.5).bfloat16()
    tiles = ReadTiles(16, 16, 16, 32, False, 2, 1, via_linear=True, up_over_normed=True, up_by_row=True)
    _, want = launch_read(wide, norm_w, w_down, w_up, w_inject, EPS, hc, tiles)
    adds_ranges = dataclasses.replace(tiles, up_adds_ranges=True)
    with recording_launches() as launched, outputs_with_slack(((n, hc),), 16, torch.bfloat16) as slack:
        _, inj = launch_read(wide, norm_w, w_down, w_up, w_inject, EPS, hc, adds_ranges)
    assert launched == ["_rstd_kernel", "_linear_kernel", "_up_mix_kernel"], launched
    assert len(slack) == 1 and untouched(slack), slack
    assert torch.equal(inj.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("by_row", [False, True])
def test_up_mix_over_normed_rows_stores_no_column_past_d(by_row: bool) -> None:
    """d not a multiple of the up-mix column tile (48 by 32): x's last tile stores no column d (the next row's 0)."""
    hc, d, r, n = 2, 48, 16, 3
    g = torch.Generator().manual_seed(9)
    k = hc * d
    wide = torch.randn(n, k, generator=g).bfloat16()
    norm_w = (torch.randn(k, generator=g) * 0.1).to(torch.bfloat16)
    w_down = (torch.randn(r, k, generator=g) / k**0.5).bfloat16()
    w_up = (torch.randn(k, r, generator=g) * 2 / r**0.5).bfloat16()
    over_normed = ReadTiles(16, 16, 16, 32, True, 4, 1, via_linear=True, up_over_normed=True, up_by_row=by_row)
    x, _ = launch_read(wide, norm_w, w_down, w_up, None, 1e-6, hc, over_normed)
    x_ref, _ = hc_read_reference(wide, norm_w, w_down, w_up, None, 1e-6, hc)
    assert rel_err(x, x_ref) <= 1e-2
    assert (x != x_ref).float().mean() <= 0.05
