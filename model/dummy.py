"""Random weights of the real shapes and formats, made on the device (`--load-format dummy`, for benchmarks)."""

from __future__ import annotations

import os
import zlib

import torch

from model.config import FlashNextConfig
from model.flashnext import FlashNextModel
from model.hyper import set_parameter
from model.moe import ExpertBank
from model.ple import NGramTable

WEIGHT_STD = 0.02
TABLE_CHUNK_ROWS = 1 << 20  # the n-gram table is drawn in slices: a full fp32 draw would not fit beside it


def machine_memory_bytes(device: torch.device) -> int:
    """What this machine could hold weights in: the host's memory, and the GPU's where the device is one."""
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if device.type != "cuda":
        return host
    return host + torch.cuda.get_device_properties(device.index or 0).total_memory


def size_refusal(cfg: FlashNextConfig, world: int, device: torch.device) -> str | None:
    """Why dummy weights of `cfg`'s shapes cannot be made on this machine at `world` ranks (None: they may): the
    weights, every one at 4 bits at the least, a rank's share above all its memory (a config that overflows a size or
    has millions of layers ended in a traceback or a hang)."""
    need = sum(cfg.parameter_counts().values()) // (2 * world)
    have = machine_memory_bytes(device)
    if need <= have:
        return None
    return (
        f"--load-format dummy: config.json's shapes need at least {need / 2**30:,.0f} GiB of weights a rank at "
        f"--tp {world}, more than this machine's {have / 2**30:,.0f} GiB of memory"
    )


def _generator(name: str, seed: int, device: torch.device) -> torch.Generator:
    """A generator seeded by the tensor's name: replicated weights come out the same on every rank."""
    return torch.Generator(device=device).manual_seed(seed + zlib.crc32(name.encode()))


def fill_dummy(
    model: FlashNextModel,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    table_device: torch.device | None = None,
) -> None:
    """Make every parameter, replacing its meta placeholder: BF16 (or `dtype`) dense weights, NVFP4 routed experts,
    an FP8 n-gram table; each rank makes only its own shard, and no dense copy of the experts or the table is made."""
    packed = {
        id(p) for m in model.modules() if isinstance(m, (ExpertBank, NGramTable)) for p in m.parameters(recurse=False)
    }
    for name, param in model.named_parameters():
        if id(param) in packed:
            continue
        set_parameter(model, name, _dense(name, param.shape, dtype, _generator(name, seed, device), device))
    for name, module in model.named_modules():
        gen = _generator(name, seed, device)
        if isinstance(module, ExpertBank):
            module.use_nvfp4(_nvfp4_bank(module, gen, device))
        elif isinstance(module, NGramTable):
            where = table_device or device
            set_parameter(module, "weight", _fp8_table(module.weight.shape, _generator(name, seed, where), where))
            module.weight_scale = torch.tensor(WEIGHT_STD / 200, device=where)


def _dense(
    name: str, shape: torch.Size, dtype: torch.dtype, gen: torch.Generator, device: torch.device
) -> torch.Tensor:
    """A dense weight: unit-scale norms, the GDN decay and step parameters in their ranges, small random matrices."""
    if name.endswith("linear_attn.norm.weight"):  # the GDN output norm is ones-centred
        return torch.ones(shape, dtype=dtype, device=device)
    if "norm" in name:  # every other norm is zero-centred: zero is unit scale
        return torch.zeros(shape, dtype=dtype, device=device)
    if name.endswith("A_log"):
        return torch.rand(shape, generator=gen, device=device).mul(3).sub(2).to(dtype)
    if name.endswith("dt_bias"):
        return torch.ones(shape, dtype=dtype, device=device)
    if len(shape) >= 2:
        return (torch.randn(shape, generator=gen, device=device) * WEIGHT_STD).to(dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def _fp8_table(shape: torch.Size, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """FP8 rows of about WEIGHT_STD * 200 before the scale, drawn TABLE_CHUNK_ROWS rows at a time."""
    table = torch.empty(shape, dtype=torch.float8_e4m3fn, device=device)
    for start in range(0, shape[0], TABLE_CHUNK_ROWS):
        rows = table[start : start + TABLE_CHUNK_ROWS]
        draw = torch.randn(rows.shape, generator=gen, device=device) * 200
        rows.copy_(draw.clamp(-448, 448).to(torch.float8_e4m3fn))
    return table


def _nvfp4_bank(bank: ExpertBank, gen: torch.Generator, device: torch.device) -> dict[str, torch.Tensor]:
    """Random FP4 codes with e4m3 block scales near 1 and a global scale giving weights of about WEIGHT_STD."""
    experts, rows2, d = bank.gate_up_proj.shape
    _, _, width = bank.down_proj.shape

    def codes(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, generator=gen, device=device, dtype=torch.int32).to(torch.uint8)

    def scales(*shape: int) -> torch.Tensor:
        return (0.5 + torch.rand(shape, generator=gen, device=device)).to(torch.float8_e4m3fn)

    scale_2 = WEIGHT_STD / 3.0
    return {
        "gate_up_packed": codes(experts, rows2, d // 2),
        "gate_up_scale": scales(experts, rows2, d // 16),
        "gate_up_scale_2": torch.full((experts, 2), scale_2, device=device),
        "down_packed": codes(experts, d, width // 2),
        "down_scale": scales(experts, d, width // 16),
        "down_scale_2": torch.full((experts,), scale_2, device=device),
    }
