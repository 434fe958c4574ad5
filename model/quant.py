"""Weight quantization formats of the Flash Next checkpoints: NVFP4 (ModelOpt), FP8 per tensor, FP8 128x128 blocks."""

from __future__ import annotations

import itertools

import torch
from torch import Tensor

FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_MAX = 6.0
FP8_E4M3_MAX = 448.0
NVFP4_GROUP = 16
FP8_BLOCK = 128

_FP4_MIDPOINTS = tuple((a + b) / 2 for a, b in itertools.pairwise(FP4_E2M1_VALUES))


def fp4_lut(device: torch.device | str | None = None) -> Tensor:
    """The 16 signed E2M1 values indexed by code: codes 8..15 are the negatives of 0..7 (code 8 is -0.0)."""
    mags = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])


def fp4_round(x: Tensor) -> Tensor:
    """E2M1 codes (uint8) of the nearest grid value of x; ties go to the even code (round half to even)."""
    mag = x.abs().clamp(max=FP4_MAX)
    mids = torch.tensor(_FP4_MIDPOINTS, dtype=torch.float32, device=x.device)
    code = torch.bucketize(mag, mids)  # a value equal to a midpoint lands on the lower code here
    at_mid = mag == mids[code.clamp(max=len(_FP4_MIDPOINTS) - 1)]
    code = code + (at_mid & (code % 2 == 1)).long()
    return (code | (torch.signbit(x).long() << 3)).to(torch.uint8)


def nvfp4_scale_2(*weights: Tensor) -> Tensor:
    """The fp32 global scale NVFP4 gives these weights together: their amax / (6 · 448)."""
    return max(w.float().abs().amax() for w in weights) / (FP4_MAX * FP8_E4M3_MAX)


def quantize_nvfp4(weight: Tensor, scale_2: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """ModelOpt NVFP4 of a [out, in] weight: (uint8 codes [out, in//2], e4m3 scales [out, in//16], fp32 scale_2);
    `scale_2` shared with modules that take the same input (an expert's gate and up), else the weight's own."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [out, in], got shape {tuple(weight.shape)}")
    rows, cols = weight.shape
    if cols % NVFP4_GROUP:
        raise ValueError(f"weight: in={cols} is not a multiple of the NVFP4 group size {NVFP4_GROUP}")
    w = weight.float().reshape(rows, cols // NVFP4_GROUP, NVFP4_GROUP)
    scale_2 = nvfp4_scale_2(w) if scale_2 is None else scale_2.float().clone()  # its own: not the caller's tensor
    block_amax = w.abs().amax(dim=-1)
    want = torch.where(scale_2 > 0, block_amax / FP4_MAX / scale_2, torch.zeros_like(block_amax))
    block_scale = want.clamp(max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    denom = (block_scale.float() * scale_2).unsqueeze(-1)
    # A block whose scale is 0 (all zero, or below e4m3's smallest subnormal) encodes as +0 codes.
    ratio = torch.where(denom > 0, w / denom, torch.zeros_like(w))
    codes = fp4_round(ratio).reshape(rows, cols)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, block_scale, scale_2


def unpack_fp4(packed: Tensor) -> Tensor:
    """Codes [..., 2n] of packed bytes [..., n]: element 2j is the low nibble of byte j, element 2j+1 the high one."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)


def dequantize_nvfp4(
    packed: Tensor, block_scale: Tensor, scale_2: Tensor, dtype: torch.dtype = torch.float32
) -> Tensor:
    """W = fp4(code) * e4m3 block scale * scale_2 in fp32; [out, ...] or stacked [E, out, ...] with scale_2 [E]."""
    codes = unpack_fp4(packed)
    if codes.shape[-1] != block_scale.shape[-1] * NVFP4_GROUP or codes.shape[:-1] != block_scale.shape[:-1]:
        raise ValueError(f"block_scale shape {tuple(block_scale.shape)} does not match packed {tuple(packed.shape)}")
    values = fp4_lut(packed.device)[codes.long()].unflatten(-1, (-1, NVFP4_GROUP))
    w = (values * block_scale.float().unsqueeze(-1)).flatten(-2)
    s2 = scale_2.float()
    if s2.dim() > 0:
        s2 = s2.reshape(*s2.shape, 1, 1)
    return (w * s2).to(dtype)


def quantize_fp8_per_tensor(w: Tensor, scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """FP8 e4m3 with one fp32 scale = amax/448 (or the given scale, e.g. one shared by the shards of a table)."""
    w = w.float()
    if scale is None:
        scale = w.abs().amax() / FP8_E4M3_MAX
    scale = scale.float().reshape(())
    q = (w / scale) if scale > 0 else torch.zeros_like(w)
    return q.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn), scale


def dequantize_fp8_per_tensor(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """W = float(q) * scale."""
    return (q.float() * scale.float()).to(dtype)


def _expand_blocks(scale: Tensor, rows: int, cols: int, block: int) -> Tensor:
    """A per-block [ceil(rows/b), ceil(cols/b)] grid broadcast to [rows, cols]."""
    return scale.repeat_interleave(block, dim=0)[:rows].repeat_interleave(block, dim=1)[:, :cols]


def quantize_fp8_block(w: Tensor, block: int = FP8_BLOCK) -> tuple[Tensor, Tensor]:
    """FP8 e4m3 per b x b tile: (fp8 [out, in], scale_inv fp32 [ceil(out/b), ceil(in/b)]); W = fp8 * scale_inv."""
    if w.dim() != 2:
        raise ValueError(f"w must be 2-D [out, in], got shape {tuple(w.shape)}")
    rows, cols = w.shape
    w = w.float()
    nr, nc = -(-rows // block), -(-cols // block)
    padded = torch.zeros(nr * block, nc * block, dtype=torch.float32, device=w.device)
    padded[:rows, :cols] = w.abs()
    scale_inv = padded.view(nr, block, nc, block).amax(dim=(1, 3)) / FP8_E4M3_MAX
    full = _expand_blocks(scale_inv, rows, cols, block)
    q = torch.where(full > 0, w / full, torch.zeros_like(w))
    return q.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn), scale_inv


def dequantize_fp8_block(
    q: Tensor, scale_inv: Tensor, dtype: torch.dtype = torch.float32, block: int = FP8_BLOCK
) -> Tensor:
    """W = float(q) * scale_inv of its block x block tile."""
    rows, cols = q.shape
    return (q.float() * _expand_blocks(scale_inv.float(), rows, cols, block)).to(dtype)
