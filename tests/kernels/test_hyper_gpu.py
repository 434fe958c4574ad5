"""The hyper-connection read compiled on a GPU at the real per-rank shapes: the paths over stored normed rows give the
fused kernels' bits, every row its bits alone, and a write run inside the read gives the two calls' bits."""

from __future__ import annotations

import dataclasses
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kernels.hyper import ReadTiles, hc_read, hc_write, hc_write_read, launch_read, read_tiles

HC, D, R, EPS = 4, 2560, 320, 1e-6
ROWS = (1, 2, 7, 33, 64, 100, 257, 1024)
# the fused kernels (norm + down, then mix), with 16- and 64-row tiles
FUSED = (ReadTiles(16, 32, 16, 16, False, 4, 3), ReadTiles(64, 64, 64, 64, True, 4, 3))

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled kernels"),
]


def model_weights(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """A read's weights as the model holds them: the inject rows stored right after the down rows."""
    k = HC * D
    stacked = (torch.randn(R + HC, k, device="cuda", generator=gen) / k**0.5).bfloat16()
    return {
        "hc_norm_weight": (torch.randn(k, device="cuda", generator=gen) * 0.1).bfloat16(),
        "w_down": stacked[:R],
        "w_up": (torch.randn(k, R, device="cuda", generator=gen) * 2 / R**0.5).bfloat16(),
        "w_inject": stacked[R:],
    }


@pytest.mark.parametrize("inject", [True, False])
def test_the_default_read_has_the_fused_kernels_bits_and_each_row_its_own(inject: bool) -> None:
    """At 1 to 1,024 rows the default read (down by the linear kernel, up and gate mix over the stored normed rows)
    gives x and inject bit for bit as the fused kernels do, and each row as it does alone."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    w = model_weights(gen)
    if not inject:
        w["w_inject"] = None
    wide = (torch.randn(max(ROWS), HC * D, device="cuda", generator=gen) * 3).bfloat16()
    alone = [hc_read(wide[i : i + 1], *w.values(), EPS, HC) for i in range(max(ROWS))]
    for n in ROWS:
        tiles = read_tiles(n, R)
        assert tiles.via_linear and tiles.up_over_normed, n
        x, inj = hc_read(wide[:n], *w.values(), EPS, HC)
        assert torch.equal(x, torch.cat([a[0] for a in alone[:n]])), f"{n} rows"
        for fused in FUSED:
            fx, finj = launch_read(wide[:n], *w.values(), EPS, HC, fused)
            assert torch.equal(x, fx), f"{n} rows, {fused}"
            if inject:
                assert torch.equal(inj, finj), f"{n} rows, {fused}"


def test_up_tiles_decide_only_which_program_computes_an_element() -> None:
    """Row and column tiles of the up kernel, at three warp counts, give the default's bits."""
    gen = torch.Generator(device="cuda").manual_seed(6)
    w = model_weights(gen)
    wide = (torch.randn(300, HC * D, device="cuda", generator=gen) * 3).bfloat16()
    for n in (1, 64, 300):
        x, inj = hc_read(wide[:n], *w.values(), EPS, HC)
        for up_m, up_d, warps in ((16, 8, 2), (16, 16, 4), (32, 16, 4), (64, 16, 4), (128, 32, 8)):
            tiles = dataclasses.replace(read_tiles(n, R), up_m=up_m, up_d=up_d, num_warps=warps)
            tx, tinj = launch_read(wide[:n], *w.values(), EPS, HC, tiles)
            assert torch.equal(x, tx) and torch.equal(inj, tinj), f"{n} rows, {tiles}"


def test_the_up_kernel_gating_row_by_row_gives_the_whole_tiles_bits() -> None:
    """At the real shapes, `_up_mix_kernel` gating its rows one at a time gives x bit for bit as over its whole 16-row
    tile: 1 to 33 rows (a second tile), columns 8, 16 and 32 a tile, 1, 2 and 4 warps, and a feature that is -0.0
    in every stream, which stays -0.0."""
    gen = torch.Generator(device="cuda").manual_seed(8)
    w = model_weights(gen)
    w["hc_norm_weight"] = w["hc_norm_weight"].abs()  # 1 + w > 0: the normed -0.0 keeps its sign
    wide = (torch.randn(33, HC * D, device="cuda", generator=gen) * 3).bfloat16()
    wide[:, [b * D + 7 for b in range(HC)]] = -0.0
    for n in (1, 2, 4, 17, 33):
        for up_d, warps in ((16, 1), (16, 2), (16, 4), (8, 2), (32, 2)):
            tiles = dataclasses.replace(
                read_tiles(1, R), up_d=up_d, num_warps=warps, up_by_row=False, up_adds_ranges=False
            )
            x, _ = launch_read(wide[:n], *w.values(), EPS, HC, tiles)
            by_row, _ = launch_read(wide[:n], *w.values(), EPS, HC, dataclasses.replace(tiles, up_by_row=True))
            case = f"{n} rows, {up_d} columns, {warps} warps"
            assert torch.equal(x.view(torch.int16), by_row.view(torch.int16)), case
            assert torch.signbit(x[:, 7]).all(), case  # the stream sums start from -0.0 (`negative_zeros`)


@pytest.mark.parametrize("inject", [True, False])
def test_the_up_kernel_adding_the_down_projections_range_sums_gives_the_linear_gates_bits(inject: bool) -> None:
    """At the real shapes, 1, 2 and 5 rows, 1, 2 and 4 warps: the up kernel adding the linear launch's K-range sums
    and gating them itself (`up_adds_ranges`) gives x and inject bit for bit as the gates the linear launch stores,
    and as the fused kernels; the first down and inject rows sum 2^25, -2^25 and 1 over the first three K ranges,
    which only range order adds to 1."""
    gen = torch.Generator(device="cuda").manual_seed(9)
    w = model_weights(gen)
    for rows in (w["w_down"], w["w_inject"]):
        rows[0] = 0.0
        rows[0, [0, 640, 1280]] = torch.tensor([2.0**25, -(2.0**25), 1.0], device="cuda").bfloat16()
    w["hc_norm_weight"][:D] = 0.0  # with ones in stream 0, its normed values are 1.0
    if not inject:
        w["w_inject"] = None
    wide = (torch.randn(5, HC * D, device="cuda", generator=gen) * 3).bfloat16()
    wide[:, :D] = 1.0
    for n in (1, 2, 5):
        for warps in (1, 2, 4):
            tiles = dataclasses.replace(read_tiles(1, R), num_warps=warps)
            assert tiles.up_adds_ranges
            # NaNs where the range sums will be (the allocator hands the block back): stale sums cannot pass
            torch.full((16, n, R + HC), float("nan"), device="cuda")
            x, inj = launch_read(wide[:n], *w.values(), EPS, HC, tiles)
            gx, ginj = launch_read(wide[:n], *w.values(), EPS, HC, dataclasses.replace(tiles, up_adds_ranges=False))
            fx, finj = launch_read(wide[:n], *w.values(), EPS, HC, FUSED[0])
            case = f"{n} rows, {warps} warps"
            assert torch.equal(x.view(torch.int16), gx.view(torch.int16)), case
            assert torch.equal(x.view(torch.int16), fx.view(torch.int16)), case
            if inject:
                assert torch.equal(inj.view(torch.int16), ginj.view(torch.int16)), case
                assert torch.equal(inj.view(torch.int16), finj.view(torch.int16)), case
                assert (inj[:, 0] == 1.125).all(), case  # 2·sigmoid(1 / hc) in bf16, not 2·sigmoid(0) = 1


@pytest.mark.parametrize("partials", [False, True])
def test_a_write_inside_the_read_gives_the_write_then_the_read(partials: bool) -> None:
    """At 1 to 1,024 rows, hc_write_read's new rows, x and inject equal hc_write's rows and hc_read's of them, with y
    as one rank's bf16 output or as the fp32 sum of tp=2's reduction."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    w = model_weights(gen)
    n_max = max(ROWS)
    wide = (torch.randn(n_max, HC * D, device="cuda", generator=gen) * 3).bfloat16()
    y = torch.randn(1, n_max, D, device="cuda", generator=gen)
    y = y.bfloat16().float() if partials else y[0].bfloat16()
    inj = (torch.rand(n_max, HC, device="cuda", generator=gen) * 2).bfloat16()
    for n in ROWS:
        rows_y = y[:, :n] if partials else y[:n]
        written = hc_write(wide[:n], rows_y, inj[:n])
        x, read_inj = hc_read(written, *w.values(), EPS, HC)
        new, fx, finj = hc_write_read(wide[:n], rows_y, inj[:n], *w.values(), EPS, HC)
        assert torch.equal(new, written) and torch.equal(fx, x) and torch.equal(finj, read_inj), f"{n} rows"
