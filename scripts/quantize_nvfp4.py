"""Convert a BF16/FP32 Flash Next checkpoint into the NVIDIA ModelOpt MIXED_PRECISION (NVFP4 experts) layout."""

from __future__ import annotations

import argparse
import fnmatch
import json
import logging
import math
import re
import shutil
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

try:
    from model import quant
except ModuleNotFoundError:  # run as a file from a checkout where the package is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from model import quant

log = logging.getLogger("quantize_nvfp4")

TEXT_TYPES = ("qwen4_exp_text", "qwen3_8_flash_next_text")
TRUNK = "model.language_model."
ALWAYS_IGNORED = ("lm_head", TRUNK + "embed_tokens")
COPY_PATTERNS = (
    "tokenizer*",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template*",
    "generation_config.json",
    "preprocessor_config.json",
)
EXPERTS = re.compile(
    r"^(?P<mod>(?:model\.language_model|mtp)\.layers\.\d+\.mlp\.experts)\."
    r"(?:(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight|(?P<fused>gate_up_proj|down_proj))$"
)
NGRAM = re.compile(r"^(?P<mod>.+\.ngram_embedding)\.shard_(?P<i>\d+)\.weight$")
NVFP4 = {"quant_algo": "NVFP4", "group_size": quant.NVFP4_GROUP}
FP8_TABLE = {"quant_algo": "FP8"}
FP8_BLOCKS = {"quant_algo": "FP8_PB_WO", "group_size": quant.FP8_BLOCK}


def natural(key: str) -> list[Any]:
    """Sort key that orders layer 10 after layer 9."""
    return [(0, int(p)) if p.isdigit() else (1, p) for p in re.split(r"(\d+)", key)]


class Source:
    """The tensors of a checkpoint folder (one model.safetensors or a sharded index), read lazily via safe_open."""

    def __init__(self, folder: Path, stack: ExitStack) -> None:
        index = folder / "model.safetensors.index.json"
        if index.exists():
            files = json.loads(index.read_text())["weight_map"]
        elif (folder / "model.safetensors").exists():
            with safe_open(folder / "model.safetensors", "pt") as f:
                files = dict.fromkeys(f.keys(), "model.safetensors")
        else:
            raise FileNotFoundError(f"{folder}: neither model.safetensors nor model.safetensors.index.json")
        self.files: dict[str, str] = files
        self.handles = {name: stack.enter_context(safe_open(folder / name, "pt")) for name in set(files.values())}

    def get(self, key: str) -> torch.Tensor:
        return self.handles[self.files[key]].get_tensor(key)

    def numel(self, key: str) -> int:
        return math.prod(self.handles[self.files[key]].get_slice(key).get_shape())


def quantize_expert(
    prefix: str, weight: torch.Tensor, mtp: bool, scale_2: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """One routed expert projection: NVFP4 in the trunk, FP8 128x128 blocks in the MTP layer. A gate or up projection
    takes the global scale `scale_2` it shares with its pair, as ModelOpt exports them and vLLM's fused MoE reads one
    scale for both; None: the weight's own."""
    try:
        if mtp:
            q, scale_inv = quant.quantize_fp8_block(weight)
            return {f"{prefix}.weight": q, f"{prefix}.weight_scale_inv": scale_inv}
        # No input_scale: that is an activation amax, and we have no calibration data (weight-only W4A16 use).
        packed, scale, scale_2 = quant.quantize_nvfp4(weight, scale_2)
    except ValueError as err:
        raise ValueError(f"{prefix}: {err}") from err
    return {f"{prefix}.weight": packed, f"{prefix}.weight_scale": scale, f"{prefix}.weight_scale_2": scale_2}


class Converter:
    """Maps each output tensor to its source tensor(s) and produces the converted tensors on demand."""

    def __init__(self, src: Source, text_only: bool, tied: bool) -> None:
        self.src = src
        self.sources: dict[str, str] = {}  # output name -> source key
        for key in src.files:
            self.sources[TRUNK + key.removeprefix("model.") if text_only and key.startswith("model.") else key] = key
        if "lm_head.weight" not in self.sources and tied and TRUNK + "embed_tokens.weight" in self.sources:
            self.sources["lm_head.weight"] = self.sources[TRUNK + "embed_tokens.weight"]
        self.tables: dict[str, list[str]] = {}
        for name in sorted(self.sources, key=natural):
            if m := NGRAM.match(name):
                self.tables.setdefault(m["mod"], []).append(name)
        self.table_scales: dict[str, torch.Tensor] = {}
        self.pair_scales: dict[str, torch.Tensor | None] = {}
        self.quantized: dict[str, dict[str, Any]] = {}
        for name in self.sources:
            if m := EXPERTS.match(name):
                self.quantized[m["mod"]] = FP8_BLOCKS if name.startswith("mtp.") else NVFP4
            elif m := NGRAM.match(name):
                self.quantized[m["mod"]] = FP8_TABLE

    def names(self) -> list[str]:
        return sorted(self.sources, key=natural)

    def table_scale(self, mod: str) -> torch.Tensor:
        """One per-tensor FP8 scale for a whole n-gram table: amax over all its shards / 448."""
        if mod not in self.table_scales:
            amax = max(self.src.get(self.sources[n]).float().abs().amax() for n in self.tables[mod])
            self.table_scales[mod] = (amax / quant.FP8_E4M3_MAX).float().reshape(())
        return self.table_scales[mod]

    def pair_scale(self, expert: str) -> torch.Tensor | None:
        """An expert's gate and up NVFP4 global scale, over both, read once for the pair (None: one is missing, and
        the loader refuses that expert)."""
        if expert not in self.pair_scales:
            keys = [self.sources.get(f"{expert}.{proj}.weight") for proj in ("gate_proj", "up_proj")]
            pair = None if None in keys else [self.src.get(key) for key in keys]
            self.pair_scales[expert] = None if pair is None else quant.nvfp4_scale_2(*pair)
        return self.pair_scales[expert]

    def convert(self, name: str) -> dict[str, torch.Tensor]:
        tensor = self.src.get(self.sources[name])
        if m := EXPERTS.match(name):
            mod, mtp = m["mod"], name.startswith("mtp.")
            if m["proj"]:
                paired = not mtp and m["proj"] in ("gate_proj", "up_proj")
                scale_2 = self.pair_scale(f"{mod}.{m['e']}") if paired else None
                return quantize_expert(f"{mod}.{m['e']}.{m['proj']}", tensor, mtp, scale_2)
            out: dict[str, torch.Tensor] = {}
            for e, w in enumerate(tensor):
                if m["fused"] == "down_proj":  # [E, d, I]
                    out |= quantize_expert(f"{mod}.{e}.down_proj", w, mtp)
                else:  # [E, 2I, d]: the gate rows first, then the up rows
                    half = w.shape[0] // 2
                    scale_2 = None if mtp else quant.nvfp4_scale_2(w)  # the gate and up rows together
                    out |= quantize_expert(f"{mod}.{e}.gate_proj", w[:half], mtp, scale_2)
                    out |= quantize_expert(f"{mod}.{e}.up_proj", w[half:], mtp, scale_2)
            return out
        if m := NGRAM.match(name):
            # Quantizing every shard with the table-wide scale equals quantizing the concatenated table once.
            q, scale = quant.quantize_fp8_per_tensor(tensor, scale=self.table_scale(m["mod"]))
            out = {name: q}
            if name == self.tables[m["mod"]][0]:
                out[f"{m['mod']}.weight_scale"] = scale
            return out
        if tensor.is_floating_point():
            tensor = tensor.to(torch.bfloat16)
        return {name: tensor.contiguous().clone()}


def ignore_list(modules: set[str], quantized: list[str]) -> list[str]:
    """Unquantized modules, each as its shortest prefix that no quantized module starts with (a glob when cut)."""
    out = set()
    for mod in modules:
        parts = mod.split(".")
        for n in range(1, len(parts) + 1):
            head = ".".join(parts[:n])
            if not any(q.startswith(head) for q in quantized):
                out.add(head if n == len(parts) else head + "*")
                break
    globs = [g for g in out if g.endswith("*")]
    out = {m for m in out if m in globs or not any(fnmatch.fnmatchcase(m, g) for g in globs)}
    return [*ALWAYS_IGNORED, *sorted(out - set(ALWAYS_IGNORED), key=natural)]


def full_config(cfg: dict[str, Any], text_only: bool, quant_config: dict[str, Any]) -> dict[str, Any]:
    """The released layout's config.json: qwen4_exp wrapper, text config inside, quantization_config."""
    if text_only:
        text = {k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version")}
        top: dict[str, Any] = {"model_type": "qwen4_exp", "text_config": text}
    else:
        top = dict(cfg, model_type="qwen4_exp")
        text = top["text_config"] = dict(cfg["text_config"])
    text.update(model_type="qwen4_exp_text", tie_word_embeddings=False, dtype="bfloat16")
    top.update(architectures=["Qwen4ExpForConditionalGeneration"], tie_word_embeddings=False, dtype="bfloat16")
    top["quantization_config"] = quant_config
    return top


def convert_checkpoint(src: Path, dst: Path, shards: int = 2) -> None:
    """Write dst as the NVIDIA NVFP4 layout of the BF16/FP32 checkpoint in src, split into `shards` files."""
    src, dst = Path(src), Path(dst)
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    if dst.resolve() == src.resolve():
        raise ValueError(f"dst must differ from src ({src})")
    cfg = json.loads((src / "config.json").read_text())
    text_only = cfg.get("model_type") in TEXT_TYPES or "text_config" not in cfg
    text_cfg = cfg if text_only else cfg["text_config"]
    tied = bool(text_cfg.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False)))
    dst.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    unquantized: set[str] = set()
    total_size = 0
    with ExitStack() as stack:
        conv = Converter(Source(src, stack), text_only, tied)
        names = conv.names()
        sizes = [conv.src.numel(conv.sources[n]) for n in names]
        grand = max(sum(sizes), 1)
        plan: list[list[str]] = [[] for _ in range(shards)]
        done = 0
        for name, size in zip(names, sizes, strict=True):
            plan[min(shards - 1, (done + size // 2) * shards // grand)].append(name)
            done += size
        for k, group in enumerate(plan):
            file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            tensors: dict[str, torch.Tensor] = {}
            for name in group:
                tensors |= conv.convert(name)
            save_file(tensors, str(dst / file), metadata={"format": "pt"})
            size = sum(t.numel() * t.element_size() for t in tensors.values())
            total_size += size
            for key, t in tensors.items():
                weight_map[key] = file
                if t.dtype == torch.bfloat16:
                    unquantized.add(key.rsplit(".", 1)[0])
            log.info("[%d/%d] %s: %d tensors, %.1f MiB", k + 1, shards, file, len(tensors), size / 2**20)
    quantized = dict(sorted(conv.quantized.items(), key=lambda kv: natural(kv[0])))
    ignore = ignore_list(unquantized, list(quantized))
    quant_config = {
        "quant_method": "modelopt",
        "quant_algo": "MIXED_PRECISION",
        "quantized_layers": quantized,
        "ignore": ignore,
    }
    hf_layers = {k: dict(v, quant_algo="FP8_BLOCK_SCALES") if v == FP8_BLOCKS else v for k, v in quantized.items()}
    hf_quant = {
        "producer": {"name": "modelopt", "version": "flashnext"},
        "quantization": {"quant_algo": "MIXED_PRECISION", "exclude_modules": ignore, "quantized_layers": hf_layers},
    }
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (dst / "config.json").write_text(json.dumps(full_config(cfg, text_only, quant_config), indent=2) + "\n")
    (dst / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=2) + "\n")
    for pattern in COPY_PATTERNS:
        for path in src.glob(pattern):
            if path.is_file():
                shutil.copy2(path, dst / path.name)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("src", type=Path, help="BF16/FP32 checkpoint folder (text-only or full layout)")
    parser.add_argument("dst", type=Path, help="output folder")
    parser.add_argument("--shards", type=int, default=2, help="number of safetensors files to write")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    convert_checkpoint(args.src, args.dst, args.shards)


if __name__ == "__main__":
    main()
