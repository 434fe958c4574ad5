"""Tests for model/quant.py: NVFP4 packing, LUT, rounding, scales and round trips; FP8 per tensor and per block."""

from __future__ import annotations

import pytest
import torch

from model.quant import (
    FP4_E2M1_VALUES,
    dequantize_fp8_block,
    dequantize_fp8_per_tensor,
    dequantize_nvfp4,
    fp4_round,
    quantize_fp8_block,
    quantize_fp8_per_tensor,
    quantize_nvfp4,
    unpack_fp4,
)

ONE = torch.tensor(1.0)


def gaussian(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Random weights whose blocks differ in magnitude, as real expert rows do."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g)
    groups = torch.rand(rows, -(-cols // 16), generator=g).add(0.05)
    return w * groups.repeat_interleave(16, dim=1)[:, :cols]


def unit_grid_row(values: list[float]) -> torch.Tensor:
    """A [1, 16] row quantized with scale_2 = 1 and block scale 448, so each element's ratio is values[i] exactly."""
    assert len(values) == 15
    return torch.tensor([[6.0, *values]]) * 448.0


def test_fp4_values() -> None:
    assert list(FP4_E2M1_VALUES) == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def test_lut_covers_all_codes_with_sign_bit_3() -> None:
    packed = torch.tensor([[c | ((c + 1) << 4) for c in range(0, 16, 2)]], dtype=torch.uint8)
    w = dequantize_nvfp4(packed, torch.ones(1, 1, dtype=torch.float8_e4m3fn), ONE)
    mags = torch.tensor(FP4_E2M1_VALUES)
    assert torch.equal(w[0], torch.cat([mags, -mags]))
    assert not w[0, 0].signbit() and w[0, 8].signbit()  # code 8 is -0.0
    assert w[0, 15].item() == -6.0 and w[0, 11].item() == -1.5


def test_packing_order_low_nibble_first() -> None:
    packed = torch.zeros(1, 8, dtype=torch.uint8)
    packed[0, 3] = 0x2B  # low nibble 0xB = -1.5 is element 6, high nibble 0x2 = 1.0 is element 7
    w = dequantize_nvfp4(packed, torch.full((1, 1), 2.0).to(torch.float8_e4m3fn), torch.tensor(0.5))
    assert w[0, 6].item() == -1.5 and w[0, 7].item() == 1.0
    assert torch.count_nonzero(w).item() == 2
    assert unpack_fp4(packed)[0, 6:8].tolist() == [0xB, 0x2]


def test_quantize_packs_element_pairs() -> None:
    packed, block_scale, scale_2 = quantize_nvfp4(unit_grid_row([-3.0, 0.5, 2.0, *[0.0] * 12]))
    assert scale_2.item() == 1.0 and block_scale.float().item() == 448.0
    assert packed[0, 0].item() == 0x7 | (0xD << 4)  # 6.0 low, -3.0 high
    assert packed[0, 1].item() == 0x1 | (0x4 << 4)  # 0.5 low, 2.0 high
    assert packed.dtype == torch.uint8 and packed.shape == (1, 8)


def test_ties_round_half_to_even_code() -> None:
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    packed, _, _ = quantize_nvfp4(unit_grid_row([*mids, *[-m for m in mids], 0.0]))
    codes = unpack_fp4(packed)[0].tolist()
    assert codes[1:8] == [0, 2, 2, 4, 4, 6, 6]
    assert codes[8:15] == [8, 10, 10, 12, 12, 14, 14]
    assert fp4_round(torch.tensor([0.2501, 0.7499, 4.99, -5.01])).tolist() == [1, 1, 6, 15]
    assert fp4_round(torch.tensor([7.0, -100.0, -0.1, 0.1])).tolist() == [7, 15, 8, 0]  # saturates; keeps -0


def test_scale_formulas() -> None:
    w = gaussian(8, 64)
    _, block_scale, scale_2 = quantize_nvfp4(w)
    assert scale_2.dtype == torch.float32 and scale_2.dim() == 0
    assert scale_2.item() == (w.abs().max() / 2688.0).item()
    expect = (w.view(8, 4, 16).abs().amax(-1) / 6.0 / scale_2).to(torch.float8_e4m3fn)
    assert block_scale.dtype == torch.float8_e4m3fn and block_scale.shape == (8, 4)
    assert torch.equal(block_scale.view(torch.uint8), expect.view(torch.uint8))
    assert block_scale.float().max().item() == 448.0


def test_round_trip_is_the_grid_projection() -> None:
    w = gaussian(16, 128, seed=1)
    packed, block_scale, scale_2 = quantize_nvfp4(w)
    dq = dequantize_nvfp4(packed, block_scale, scale_2)
    # Reference: brute-force nearest signed grid value of w / (block scale * scale_2), computed in float64.
    step = (block_scale.double() * scale_2.double()).repeat_interleave(16, dim=1)
    grid = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float64)
    ratio = w.double() / step
    nearest = grid[(ratio.abs().unsqueeze(-1) - grid).abs().argmin(-1)]
    expect = (torch.where(ratio < 0, -nearest, nearest) * step).float()
    assert torch.equal(dq, expect)


def test_requantize_is_a_fixed_point() -> None:
    for seed in range(4):
        packed, block_scale, scale_2 = quantize_nvfp4(gaussian(32, 96, seed=seed))
        again = quantize_nvfp4(dequantize_nvfp4(packed, block_scale, scale_2))
        assert torch.equal(again[0], packed)
        assert torch.equal(again[1].view(torch.uint8), block_scale.view(torch.uint8))
        # amax/2688 after x2688 can land one fp32 ulp away; the codes and block scales cannot move.
        assert abs(again[2].item() - scale_2.item()) <= scale_2.item() * 2**-23
    # With a power-of-two scale_2 every product is exact, so the whole round trip is bit-identical.
    w = gaussian(32, 96, seed=7)
    w = w / w.abs().max() * 2688.0 * 2**-12
    q = quantize_nvfp4(w)
    assert q[2].item() == 2**-12
    dq = dequantize_nvfp4(*q)
    q2 = quantize_nvfp4(dq)
    assert torch.equal(q2[0], q[0]) and torch.equal(q2[1].view(torch.uint8), q[1].view(torch.uint8))
    assert q2[2].item() == q[2].item()
    assert torch.equal(dequantize_nvfp4(*q2), dq)


def test_error_bound_per_block() -> None:
    w = gaussian(32, 256, seed=2)
    packed, block_scale, scale_2 = quantize_nvfp4(w)
    dq = dequantize_nvfp4(packed, block_scale, scale_2)
    step = (block_scale.float() * scale_2).repeat_interleave(16, dim=1)
    mag = (w / step).abs()
    half_gap = torch.where(mag < 2, 0.25, torch.where(mag < 4, 0.5, 1.0))
    assert ((w - dq).abs() <= half_gap * step * (1 + 1e-6)).all()
    assert (w - dq).abs().max() > 0  # it is a lossy format


def test_zero_blocks_and_zero_weight() -> None:
    w = gaussian(4, 64, seed=3)
    w[1, 16:32] = 0.0
    w[2, 48:64] = -0.0
    packed, block_scale, scale_2 = quantize_nvfp4(w)
    dq = dequantize_nvfp4(packed, block_scale, scale_2)
    assert block_scale[1, 1].float().item() == 0.0 and block_scale[2, 3].float().item() == 0.0
    assert (unpack_fp4(packed)[1, 16:32] == 0).all() and (unpack_fp4(packed)[2, 48:64] == 0).all()
    assert not dq.isnan().any() and (dq[1, 16:32] == 0).all()
    packed, block_scale, scale_2 = quantize_nvfp4(torch.zeros(3, 32))
    assert scale_2.item() == 0.0 and (packed == 0).all() and (block_scale.float() == 0).all()
    assert torch.equal(dequantize_nvfp4(packed, block_scale, scale_2), torch.zeros(3, 32))


def test_stacked_experts_dequantize_in_one_call() -> None:
    quants = [quantize_nvfp4(gaussian(8, 48, seed=10 + e) * (e + 1)) for e in range(3)]
    stacked = [torch.stack([q[i] for q in quants]) for i in range(3)]
    assert stacked[2].shape == (3,)
    whole = dequantize_nvfp4(*stacked, dtype=torch.bfloat16)
    assert whole.shape == (3, 8, 48) and whole.dtype == torch.bfloat16
    for e, q in enumerate(quants):
        assert torch.equal(whole[e], dequantize_nvfp4(*q, dtype=torch.bfloat16))
    shared = dequantize_nvfp4(stacked[0], stacked[1], quants[0][2])  # one 0-dim scale_2 for all experts
    assert torch.equal(shared[0], dequantize_nvfp4(*quants[0]))


def test_dequantize_in_fp32_then_cast() -> None:
    packed, block_scale, scale_2 = quantize_nvfp4(gaussian(4, 32, seed=4))
    fp32 = dequantize_nvfp4(packed, block_scale, scale_2)
    assert torch.equal(dequantize_nvfp4(packed, block_scale, scale_2, dtype=torch.bfloat16), fp32.bfloat16())


def test_fp8_per_tensor_round_trip() -> None:
    w = gaussian(16, 64, seed=5) * 3
    q, scale = quantize_fp8_per_tensor(w)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.dim() == 0
    assert scale.item() == (w.abs().max() / 448.0).item()
    dq = dequantize_fp8_per_tensor(q, scale)
    assert ((w - dq).abs() <= (w.abs() * 2**-4 + scale * 2**-10) * (1 + 1e-6)).all()
    assert (w - dq).abs().max() > 0
    assert torch.equal(dequantize_fp8_per_tensor(q, scale, torch.bfloat16), dq.bfloat16())
    shared, same = quantize_fp8_per_tensor(w[:5], scale=scale)
    assert same.item() == scale.item() and torch.equal(shared.view(torch.uint8), q[:5].view(torch.uint8))
    zq, zs = quantize_fp8_per_tensor(torch.zeros(3, 3))
    assert zs.item() == 0.0 and not dequantize_fp8_per_tensor(zq, zs).isnan().any()


def test_fp8_block_round_trip_with_partial_edges() -> None:
    w = gaussian(300, 200, seed=6)
    w[:128, :128] *= 1000.0  # a per-tensor scale would flush the other blocks
    q, scale_inv = quantize_fp8_block(w)
    assert q.shape == (300, 200) and q.dtype == torch.float8_e4m3fn
    assert scale_inv.shape == (3, 2) and scale_inv.dtype == torch.float32
    assert scale_inv[2, 1].item() == (w[256:, 128:].abs().max() / 448.0).item()  # the 44x72 corner block
    assert scale_inv[0, 0].item() == (w[:128, :128].abs().max() / 448.0).item()
    dq = dequantize_fp8_block(q, scale_inv)
    full = scale_inv.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    assert ((w - dq).abs() <= (w.abs() * 2**-4 + full * 2**-10) * (1 + 1e-6)).all()
    assert torch.equal(dequantize_fp8_block(q, scale_inv, torch.bfloat16), dq.bfloat16())
    small_q, small_s = quantize_fp8_block(w[:40, :50], block=16)
    assert small_s.shape == (3, 4)
    assert (dequantize_fp8_block(small_q, small_s, block=16) - w[:40, :50]).abs().max() <= w.abs().max() / 16


def test_refusals_name_the_argument() -> None:
    with pytest.raises(ValueError, match=r"weight: in=24 is not a multiple of the NVFP4 group size 16"):
        quantize_nvfp4(torch.zeros(4, 24))
    with pytest.raises(ValueError, match=r"weight must be 2-D \[out, in\], got shape \(2, 4, 16\)"):
        quantize_nvfp4(torch.zeros(2, 4, 16))
    with pytest.raises(ValueError, match=r"weight must be 2-D"):
        quantize_nvfp4(torch.zeros(32))
    with pytest.raises(ValueError, match=r"w must be 2-D"):
        quantize_fp8_block(torch.zeros(128))
    with pytest.raises(ValueError, match=r"block_scale shape \(4, 1\) does not match packed \(4, 16\)"):
        dequantize_nvfp4(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 1, dtype=torch.float8_e4m3fn), ONE)
