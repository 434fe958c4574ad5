"""Checkpoint loading: safetensors (single or indexed), both key layouts, BF16/FP32 and ModelOpt mixed precision."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from model.config import FlashNextConfig, load_config
from model.flashnext import FlashNextModel
from model.ple import NGramEmbedding
from model.quant import dequantize_fp8_block

log = logging.getLogger(__name__)

TRUNK_PREFIXES = ("model.language_model.", "model.")
EXPERT_PARAM = re.compile(r"^(?P<moe>.*\.mlp)\.experts\.(?P<which>gate_up_proj|down_proj)$")
NGRAM_PARAM = re.compile(r"^(?P<table>.*\.ngram_embedding)\.weight$")
KNOWN_ALGOS = {"NVFP4", "FP8", "FP8_PB_WO", "FP8_BLOCK_SCALES"}


class CheckpointError(ValueError):
    """A malformed checkpoint; the message names the tensor or setting."""


class TensorIndex:
    """Where each tensor of a checkpoint lives; reads go through memory-mapped safetensors files."""

    def __init__(self, model_dir: Path) -> None:
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text()).get("weight_map")
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: no weight_map")
            self.files = {name: model_dir / f for name, f in weight_map.items()}
        else:
            files = sorted(model_dir.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"no *.safetensors files in {model_dir}")
            self.files = {}
            for f in files:
                with safe_open(f, "pt") as handle:
                    self.files.update(dict.fromkeys(handle.keys(), f))
        self._open: dict[Path, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> torch.Tensor:
        """The named tensor, or a refusal naming it."""
        path = self.files.get(name)
        if path is None:
            raise CheckpointError(f"missing tensor {name}")
        if path not in self._open:
            if not path.is_file():
                raise CheckpointError(f"tensor {name}: its file {path.name} is missing")
            self._open[path] = safe_open(path, "pt")
        try:
            return self._open[path].get_tensor(name)
        except Exception as exc:
            raise CheckpointError(f"tensor {name}: not in {path.name} ({exc})") from exc


@dataclass(slots=True)
class QuantPlan:
    """Which modules a ModelOpt MIXED_PRECISION checkpoint quantized, and how."""

    layers: dict[str, str]

    def algo(self, module: str) -> str | None:
        return self.layers.get(module)


def read_quant_plan(model_dir: Path, quantization_config: dict | None) -> QuantPlan:
    """Merge `quantization_config` (config.json) and `hf_quant_config.json`; refuse unknown algorithms."""
    layers: dict[str, str] = {}
    sources = []
    if quantization_config is not None:
        sources.append(("config.json quantization_config", quantization_config))
    hf_quant = model_dir / "hf_quant_config.json"
    if hf_quant.is_file():
        sources.append(("hf_quant_config.json quantization", json.loads(hf_quant.read_text()).get("quantization", {})))
    for where, qc in sources:
        method = qc.get("quant_method", "modelopt")
        if method != "modelopt":
            raise CheckpointError(f"{where}.quant_method: unsupported value {method!r} (only modelopt)")
        algo = qc.get("quant_algo")
        if algo != "MIXED_PRECISION":
            raise CheckpointError(f"{where}.quant_algo: unsupported value {algo!r} (only MIXED_PRECISION)")
        for module, spec in (qc.get("quantized_layers") or {}).items():
            layer_algo = spec.get("quant_algo") if isinstance(spec, dict) else None
            if layer_algo not in KNOWN_ALGOS:
                raise CheckpointError(f"{where}.quantized_layers[{module!r}].quant_algo: unknown value {layer_algo!r}")
            layers[module] = layer_algo
    return QuantPlan(layers)


class WeightLoader:
    """Fills a FlashNextModel from a checkpoint, checking every tensor's presence, shape and dtype."""

    def __init__(self, model_dir: Path, cfg: FlashNextConfig) -> None:
        self.dir, self.cfg = model_dir, cfg
        self.index = TensorIndex(model_dir)
        self.plan = read_quant_plan(model_dir, cfg.quantization_config)
        self.prefix = next((p for p in TRUNK_PREFIXES if f"{p}embed_tokens.weight" in self.index), None)
        if self.prefix is None:
            raise CheckpointError(
                "missing tensor model.language_model.embed_tokens.weight (or model.embed_tokens.weight)"
            )

    def has_mtp(self) -> bool:
        return any(name.startswith("mtp.") for name in self.index.files)

    def key(self, name: str) -> str:
        """Checkpoint key of a model parameter name."""
        return name if name.startswith(("lm_head.", "mtp.")) else self.prefix + name

    def fill(self, model: FlashNextModel, dtype: torch.dtype, device: torch.device) -> None:
        """Load every parameter of `model` in `dtype` on `device`."""
        params = dict(model.named_parameters())
        for name, param in tqdm(params.items(), desc="loading weights", unit="tensor", leave=False):
            tensor = self._load(name, param, model, dtype, device)
            if tensor is not None:
                param.data = tensor
        for name, module in model.named_modules():
            if isinstance(module, NGramEmbedding):
                self._check_hash_constants(name, module)

    def _check_hash_constants(self, name: str, module: NGramEmbedding) -> None:
        """Checkpoints may store the hash constants; they must equal the ones derived from the config."""
        derived = {
            "layer_multipliers": module.multipliers,
            "ngram_heads_vocab_sizes": module.moduli_list,
            "ngram_heads_offsets": module.offsets_list,
        }
        for buffer, values in derived.items():
            key = self.key(f"{name}.{buffer}")
            if key in self.index and self.index.get(key).tolist() != values:
                raise CheckpointError(
                    f"tensor {key}: {self.index.get(key).tolist()} differs from the config's {values}"
                )

    def _load(self, name: str, param: torch.Tensor, model: FlashNextModel, dtype: torch.dtype, device: torch.device):
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings and "lm_head.weight" not in self.index:
            return self._float(self.key("embed_tokens.weight"), param.shape, dtype, device)
        if m := EXPERT_PARAM.match(name):
            return self._experts(m["moe"], m["which"], model.get_submodule(m["moe"] + ".experts"), dtype, device)
        if m := NGRAM_PARAM.match(name):
            return self._ngram_table(m["table"], model.get_submodule(m["table"]), param.shape, dtype, device)
        return self._float(self.key(name), param.shape, dtype, device)

    def _float(self, key: str, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        tensor = self.index.get(key)
        if not tensor.is_floating_point() or tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise CheckpointError(f"tensor {key}: dtype {tensor.dtype}, expected bfloat16 or float32")
        _check_shape(key, tensor, tuple(shape))
        return _own(tensor, device, dtype)

    def _experts(self, moe: str, which: str, bank, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        base = self.key(f"{moe}.experts")
        algo = self.plan.algo(base)
        e, d, i = self.cfg.num_experts, self.cfg.hidden_size, self.cfg.moe_intermediate_size
        if algo == "NVFP4":
            if which == "gate_up_proj":
                bank.use_nvfp4(self._nvfp4_bank(base, device))
            return None
        projections = ("gate_proj", "up_proj") if which == "gate_up_proj" else ("down_proj",)
        shape = (2 * i, d) if which == "gate_up_proj" else (d, i)
        if f"{base}.{which}" in self.index:
            return self._float(f"{base}.{which}", (e, *shape), dtype, device)
        rows = []
        for expert in range(e):
            parts = [self._expert_matrix(f"{base}.{expert}.{p}", algo, dtype, device) for p in projections]
            rows.append(torch.cat(parts))
            _check_shape(f"{base}.{expert}.{which}", rows[-1], shape)
        return torch.stack(rows)

    def _expert_matrix(self, key: str, algo: str | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        if algo in ("FP8_PB_WO", "FP8_BLOCK_SCALES"):
            weight = self.index.get(f"{key}.weight")
            if weight.dtype != torch.float8_e4m3fn:
                raise CheckpointError(f"tensor {key}.weight: dtype {weight.dtype}, expected float8_e4m3fn")
            scale_key = f"{key}.weight_scale_inv" if f"{key}.weight_scale_inv" in self.index else f"{key}.weight_scale"
            scale = self.index.get(scale_key)
            blocks = (-(-weight.shape[0] // 128), -(-weight.shape[1] // 128))
            _check_shape(scale_key, scale, blocks)
            return dequantize_fp8_block(weight.to(device), scale.to(device), dtype=torch.float32).to(dtype)
        tensor = self.index.get(f"{key}.weight")
        if not tensor.is_floating_point() or tensor.dtype == torch.float8_e4m3fn:
            raise CheckpointError(f"tensor {key}.weight: dtype {tensor.dtype}, expected bfloat16 or float32")
        return _own(tensor, device, dtype)

    def _nvfp4_bank(self, base: str, device: torch.device) -> dict[str, torch.Tensor]:
        e, d, i = self.cfg.num_experts, self.cfg.hidden_size, self.cfg.moe_intermediate_size
        packed = {"gate_up": [], "down": []}
        scales = {"gate_up": [], "down": []}
        scale_2 = {"gate_up": [], "down": []}
        shapes = {"gate_proj": (i, d), "up_proj": (i, d), "down_proj": (d, i)}
        for expert in tqdm(range(e), desc=f"{base} (NVFP4)", unit="expert", leave=False):
            pair = []
            for proj, (rows, cols) in shapes.items():
                key = f"{base}.{expert}.{proj}"
                weight, scale, s2 = (self.index.get(f"{key}.{s}") for s in ("weight", "weight_scale", "weight_scale_2"))
                _check(f"{key}.weight", weight, (rows, cols // 2), torch.uint8)
                _check(f"{key}.weight_scale", scale, (rows, cols // 16), torch.float8_e4m3fn)
                _check(f"{key}.weight_scale_2", s2.reshape(()), (), torch.float32)
                group = "down" if proj == "down_proj" else "gate_up"
                if group == "gate_up":
                    pair.append((weight, scale, s2.reshape(())))
                else:
                    packed[group].append(weight)
                    scales[group].append(scale)
                    scale_2[group].append(s2.reshape(()))
            packed["gate_up"].append(torch.cat([p[0] for p in pair]))
            scales["gate_up"].append(torch.cat([p[1] for p in pair]))
            scale_2["gate_up"].append(torch.stack([p[2] for p in pair]))
        out = {}
        for group in ("gate_up", "down"):
            out[f"{group}_packed"] = torch.stack(packed[group]).to(device)
            out[f"{group}_scale"] = torch.stack(scales[group]).to(device)
            out[f"{group}_scale_2"] = torch.stack(scale_2[group]).to(device)
        return out

    def _ngram_table(self, table: str, module, shape: torch.Size, dtype: torch.dtype, device: torch.device):
        base = self.key(table)
        algo = self.plan.algo(base)
        if f"{base}.weight" in self.index:
            tensor = self.index.get(f"{base}.weight")
        else:
            shards = sorted(
                (int(m[1]), k)
                for k in self.index.files
                if (m := re.fullmatch(re.escape(base) + r"\.shard_(\d+)\.weight", k))
            )
            if not shards:
                raise CheckpointError(f"missing tensor {base}.weight (or its shards {base}.shard_N.weight)")
            if [n for n, _ in shards] != list(range(len(shards))):
                raise CheckpointError(
                    f"tensor {base}.shard_N.weight: shard numbers {[n for n, _ in shards]} have a gap"
                )
            tensor = torch.cat([self.index.get(k) for _, k in shards])
        _check_shape(f"{base}.weight", tensor, tuple(shape))
        if algo == "FP8":
            if tensor.dtype != torch.float8_e4m3fn:
                raise CheckpointError(f"tensor {base}.weight: dtype {tensor.dtype}, expected float8_e4m3fn (FP8)")
            module.weight_scale = self.index.get(f"{base}.weight_scale").float().reshape(()).to(device)
            return _own(tensor, device, tensor.dtype)
        if not tensor.is_floating_point() or tensor.dtype == torch.float8_e4m3fn:
            raise CheckpointError(f"tensor {base}.weight: dtype {tensor.dtype}, expected bfloat16 or float32")
        return _own(tensor, device, dtype)


def _own(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A fresh, allocator-aligned copy: a memory-mapped tensor's offset in its file would otherwise change CPU
    kernels' vector paths, and so the bits, from one load (or one rank) to the next."""
    return tensor.to(device=device, dtype=dtype, copy=True)


def _check_shape(key: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != tuple(shape):
        raise CheckpointError(f"tensor {key}: shape {list(tensor.shape)}, expected {list(shape)}")


def _check(key: str, tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    _check_shape(key, tensor, shape)
    if tensor.dtype != dtype:
        raise CheckpointError(f"tensor {key}: dtype {tensor.dtype}, expected {dtype}")


def resolve_dtype(name: str, cfg: FlashNextConfig, device: torch.device) -> torch.dtype:
    """`auto` is float32 on CPU and the checkpoint's dtype (bfloat16 when it says so) on CUDA."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else getattr(torch, cfg.torch_dtype)
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"--dtype: unknown value {name!r}; expected auto, float32 or bfloat16")
    return getattr(torch, name)


def load_model(model_dir: str | Path, device: str | torch.device = "cpu", dtype: str = "auto") -> FlashNextModel:
    """Parse the config, build the model on `device` and fill it from the checkpoint."""
    model_dir, device = Path(model_dir), torch.device(device)
    cfg = load_config(model_dir)
    torch_dtype = resolve_dtype(dtype, cfg, device)
    loader = WeightLoader(model_dir, cfg)
    with_mtp = bool(cfg.mtp_num_hidden_layers) and loader.has_mtp()
    if cfg.mtp_num_hidden_layers and not with_mtp:
        log.warning("%s has no mtp.* tensors: drafting is off", model_dir)
    with torch.device("meta"):
        model = FlashNextModel(cfg, with_mtp=with_mtp)
    model.to_empty(device=device)
    for module in model.modules():
        if isinstance(module, NGramEmbedding):
            module.reset_buffers(device)
    loader.fill(model, torch_dtype, device)
    model.eval()
    log.info(
        "loaded %s: %d layers, dtype %s, device %s, MTP %s",
        model_dir,
        cfg.num_hidden_layers,
        torch_dtype,
        device,
        "on" if with_mtp else "off",
    )
    return model
