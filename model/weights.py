"""Checkpoint loading: safetensors (single or indexed), both key layouts, BF16/FP32 and ModelOpt mixed precision."""

from __future__ import annotations

import fnmatch
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from model.config import FlashNextConfig, load_config
from model.dummy import fill_dummy
from model.flashnext import FlashNextModel
from model.hyper import set_parameter
from model.parallel import Shard, TensorParallel
from model.ple import NGramEmbedding
from model.quant import dequantize_fp8_block

log = logging.getLogger(__name__)

TRUNK_PREFIXES = ("model.language_model.", "model.")
EXPERT_PARAM = re.compile(r"^(?P<moe>.*\.mlp)\.experts\.(?P<which>gate_up_proj|down_proj)$")
NGRAM_PARAM = re.compile(r"^(?P<table>.*\.ngram_embedding)\.weight$")
KNOWN_ALGOS = {"NVFP4", "FP8", "FP8_PB_WO", "FP8_BLOCK_SCALES"}
FLOAT_DTYPES = (torch.bfloat16, torch.float32, torch.float16)


class CheckpointError(ValueError):
    """A malformed checkpoint; the message names the tensor or setting."""


class TensorIndex:
    """Where each tensor of a checkpoint lives; reads go through memory-mapped safetensors files."""

    def __init__(self, model_dir: Path) -> None:
        index = model_dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
            except (ValueError, AttributeError) as exc:  # not UTF-8, not JSON, or not an object
                raise CheckpointError(f"{index}: not a JSON object with a weight_map ({exc})") from exc
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: no weight_map")
            for name, f in weight_map.items():
                if not isinstance(f, str):
                    raise CheckpointError(f"{index}: weight_map[{name!r}] is {f!r}, not a file name")
            self.files = {name: model_dir / f for name, f in weight_map.items()}
        else:
            files = sorted(model_dir.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"no *.safetensors files in {model_dir}")
            self.files = {}
            for f in files:
                with _open_safetensors(f) as handle:
                    names = handle.keys()
                    for name in names:
                        if name in self.files:
                            raise CheckpointError(f"tensor {name}: in both {self.files[name].name} and {f.name}")
                        self.files[name] = f
        self._open: dict[Path, object] = {}
        self.taken: set[str] = set()  # the tensors read

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def _handle(self, name: str):
        self.taken.add(name)
        path = self.files.get(name)
        if path is None:
            raise CheckpointError(f"missing tensor {name}")
        if path not in self._open:
            if not path.is_file():
                raise CheckpointError(f"tensor {name}: its file {path.name} is missing")
            self._open[path] = _open_safetensors(path)
        return self._open[path]

    def _slice(self, name: str):
        handle = self._handle(name)
        try:
            return handle.get_slice(name)
        except Exception as exc:  # a weight_map naming a file that does not hold the tensor
            raise CheckpointError(f"tensor {name}: not in {self.files[name].name} ({exc})") from exc

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def stored_dtype(self, name: str) -> str:
        """The tensor's dtype as safetensors names it (F8_E4M3, BF16, ...), without reading it."""
        return self._slice(name).get_dtype()

    def get(self, name: str) -> torch.Tensor:
        """The named tensor, or a refusal naming it."""
        try:
            return self._handle(name).get_tensor(name)
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"tensor {name}: unreadable ({exc})") from exc

    def read(self, name: str, shard: Shard | None) -> torch.Tensor:
        """The whole tensor, or only this rank's pieces of it (the other rank's bytes are never read)."""
        if shard is None:
            return self.get(name)
        view = self._slice(name)
        lead = (slice(None),) * shard.dim
        return torch.cat([view[(*lead, slice(lo, hi))] for lo, hi in shard.ranges], dim=shard.dim)


def _unread(name: str) -> bool:
    """A checkpoint tensor this model never reads by design: the vision tower's, W4A16's activation scales and the
    hyper connections' block inject weights (the MTP layer's too where the model is built without it: `fill`)."""
    return name.startswith("model.visual.") or name.endswith(".input_scale") or "block_inject_weight" in name


def _open_safetensors(path: Path):
    """A safetensors file opened for reading, or a refusal naming it (a truncated download fails here)."""
    try:
        return safe_open(path, "pt")
    except Exception as exc:
        raise CheckpointError(f"{path.name}: not a readable safetensors file ({exc})") from exc


@dataclass(slots=True)
class QuantPlan:
    """Which modules a ModelOpt checkpoint quantized, and how: a MIXED_PRECISION export's `quantized_layers` (by
    module, or by each projection under one), or a single-format export's algorithm for every module its
    `exclude_modules` (or `ignore`) patterns leave."""

    layers: dict[str, str]
    default: str | None = None
    exclude: tuple[str, ...] = ()

    def algo(self, module: str) -> str | None:
        """The module's algorithm; the projections under it must agree (ModelOpt writes one key per Linear)."""
        if module in self.layers:
            return self.layers[module]
        under = {algo for name, algo in self.layers.items() if name.startswith(module + ".")}
        if len(under) > 1:
            raise CheckpointError(f"quantized_layers: the modules under {module} use {sorted(under)}, not one format")
        if under:
            return under.pop()
        excluded = any(fnmatch.fnmatchcase(module, pattern) for pattern in self.exclude)
        return None if excluded else self.default


def _algo(value: object, where: str) -> str:
    """A quant_algo as the loader knows it (ModelOpt may write lower case; W4A16_NVFP4 is NVFP4's packing)."""
    if not isinstance(value, str):
        raise CheckpointError(f"{where}: {value!r} is not a string")
    algo = value.upper()
    algo = "NVFP4" if algo == "W4A16_NVFP4" else algo
    if algo not in KNOWN_ALGOS:
        raise CheckpointError(f"{where}: unknown value {value!r}")
    return algo


def read_quant_plan(model_dir: Path, quantization_config: dict | None) -> QuantPlan:
    """Merge `quantization_config` (config.json) and `hf_quant_config.json`; refuse unknown algorithms."""
    plan = QuantPlan({})
    sources = []
    if quantization_config is not None:
        sources.append(("config.json quantization_config", quantization_config))
    hf_quant = model_dir / "hf_quant_config.json"
    if hf_quant.is_file():
        try:
            quantization = json.loads(hf_quant.read_text(encoding="utf-8")).get("quantization", {})
        except (ValueError, AttributeError) as exc:  # not UTF-8, not JSON, or not an object
            raise CheckpointError(f"{hf_quant}: not a JSON object ({exc})") from exc
        if not isinstance(quantization, dict):
            raise CheckpointError(f"hf_quant_config.json quantization: expected an object, got {quantization!r}")
        sources.append(("hf_quant_config.json quantization", quantization))
    for where, qc in sources:
        method = qc.get("quant_method", "modelopt")
        if method != "modelopt":
            raise CheckpointError(f"{where}.quant_method: unsupported value {method!r} (only modelopt)")
        if str(qc.get("quant_algo")).upper() != "MIXED_PRECISION":
            plan.default = _algo(qc.get("quant_algo"), f"{where}.quant_algo")
            patterns = qc.get("exclude_modules", qc.get("ignore")) or []
            if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
                raise CheckpointError(f"{where}.exclude_modules: expected a list of module patterns, got {patterns!r}")
            plan.exclude = tuple(patterns)
            continue
        quantized = qc.get("quantized_layers") or {}
        if not isinstance(quantized, dict):
            raise CheckpointError(f"{where}.quantized_layers: expected an object, got {type(quantized).__name__}")
        for module, spec in quantized.items():
            layer_algo = spec.get("quant_algo") if isinstance(spec, dict) else None
            plan.layers[module] = _algo(layer_algo, f"{where}.quantized_layers[{module!r}].quant_algo")
    return plan


def experts_nvfp4(model_dir: Path, cfg: FlashNextConfig, load_format: str) -> bool:
    """Whether the routed experts load as NVFP4: always with dummy weights, else where the checkpoint quantized them."""
    if load_format == "dummy":
        return True
    plan = read_quant_plan(model_dir, cfg.quantization_config)
    modules = (
        f"{prefix}layers.{layer}.mlp.experts" for prefix in TRUNK_PREFIXES for layer in range(cfg.num_hidden_layers)
    )
    return any(plan.algo(module) == "NVFP4" for module in modules)


class WeightLoader:
    """Fills a FlashNextModel from a checkpoint, checking every tensor's presence, shape and dtype; at tensor
    parallel each rank reads only its shard (ShardPlan)."""

    def __init__(self, model_dir: Path, cfg: FlashNextConfig) -> None:
        self.dir, self.cfg = model_dir, cfg
        self.index = TensorIndex(model_dir)
        self.quant = read_quant_plan(model_dir, cfg.quantization_config)
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

    def fill(
        self, model: FlashNextModel, dtype: torch.dtype, device: torch.device, table_device: torch.device | None = None
    ) -> None:
        """Load every parameter of `model` in `dtype` on `device` (the n-gram table on `table_device`)."""
        self.shards = model.plan
        self.table_device = table_device or device
        params = dict(model.named_parameters())
        for name, param in tqdm(params.items(), desc="loading weights", unit="tensor", leave=False, disable=None):
            tensor = self._load(name, param, model, dtype, device)
            if tensor is not None:
                set_parameter(model, name, tensor)
        for name, module in model.named_modules():
            if isinstance(module, NGramEmbedding):
                self._check_hash_constants(name, module)
        built_mtp = any(name.startswith("mtp.") for name in params)
        unused = sorted(
            name
            for name in self.index.files
            if name not in self.index.taken and not _unread(name) and (built_mtp or not name.startswith("mtp."))
        )
        if unused:  # as transformers says of weights a model does not take: loud, yet a checkpoint may carry more
            shown = ", ".join(unused[:5]) + (f" and {len(unused) - 5} more" if len(unused) > 5 else "")
            log.warning("%d checkpoint tensors are not part of this model (its config.json): %s", len(unused), shown)

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
        shard = self.shards.shard(name)
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings and "lm_head.weight" not in self.index:
            return self._float(self.key("embed_tokens.weight"), param.shape, shard, dtype, device)
        if m := EXPERT_PARAM.match(name):
            return self._experts(m["moe"], m["which"], model.get_submodule(m["moe"] + ".experts"), dtype, device)
        if m := NGRAM_PARAM.match(name):
            return self._ngram_table(m["table"], model.get_submodule(m["table"]), dtype, device)
        return self._float(self.key(name), param.shape, shard, dtype, device)

    def _read(self, key: str, local: tuple[int, ...], shard: Shard | None, dtypes: tuple[torch.dtype, ...]):
        """Check the checkpoint tensor's full shape and dtype, then read this rank's part of it."""
        full = list(local)
        if shard is not None:
            full[shard.dim] = shard.full
        _check_shape(key, self.index.shape(key), tuple(full))
        tensor = self.index.read(key, shard)
        if tensor.dtype not in dtypes:
            expected = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise CheckpointError(f"tensor {key}: dtype {tensor.dtype}, expected {expected}")
        return tensor

    def _float(self, key: str, local, shard: Shard | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return _own(self._read(key, tuple(local), shard, FLOAT_DTYPES), device, dtype)

    def _experts(self, moe: str, which: str, bank, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        base = self.key(f"{moe}.experts")
        algo = self.quant.algo(base)
        e, d = self.cfg.num_experts, self.cfg.hidden_size
        i = bank.gate_up_proj.shape[1] // 2 if bank.gate_up_proj is not None else None
        if algo == "NVFP4":
            if which == "gate_up_proj":
                bank.use_nvfp4(self._nvfp4_bank(base, device))
            return None
        local = (2 * i, d) if which == "gate_up_proj" else (d, i)
        if f"{base}.{which}" in self.index:
            return self._float(
                f"{base}.{which}", (e, *local), self.shards.shard(f"{moe}.experts.{which}"), dtype, device
            )
        projections = ("gate_proj", "up_proj") if which == "gate_up_proj" else ("down_proj",)
        rows = []
        for expert in range(e):
            parts = [self._expert_matrix(f"{base}.{expert}.{p}", p, algo, dtype, device) for p in projections]
            rows.append(torch.cat(parts))
            _check_shape(f"{base}.{expert}.{which}", tuple(rows[-1].shape), local)
        return torch.stack(rows)

    def _expert_matrix(self, key: str, proj: str, algo: str | None, dtype, device: torch.device) -> torch.Tensor:
        """One expert projection in `dtype`: BF16/FP32 read as this rank's shard, FP8 blocks dequantized whole."""
        shard = self.shards.expert_shard(proj)
        d, i = self.cfg.hidden_size, self.cfg.moe_intermediate_size
        whole = (d, i) if proj == "down_proj" else (i, d)
        if algo not in ("FP8_PB_WO", "FP8_BLOCK_SCALES"):
            local = list(whole)
            if shard is not None:
                local[shard.dim] = sum(hi - lo for lo, hi in shard.ranges)
            return _own(self._read(f"{key}.weight", tuple(local), shard, FLOAT_DTYPES), device, dtype)
        weight = self._read(f"{key}.weight", whole, None, (torch.float8_e4m3fn,))
        scale_key = f"{key}.weight_scale_inv" if f"{key}.weight_scale_inv" in self.index else f"{key}.weight_scale"
        blocks = (-(-whole[0] // 128), -(-whole[1] // 128))
        scale = self._read(scale_key, blocks, None, (torch.float32, torch.bfloat16))
        # 128x128 blocks do not follow a rank's share (320 of 640 is 2.5 blocks): dequantize, then take the share
        full = dequantize_fp8_block(weight.to(device), scale.float().to(device), dtype=torch.float32).to(dtype)
        return full if shard is None else shard.take(full).clone()

    def _nvfp4_bank(self, base: str, device: torch.device) -> dict[str, torch.Tensor]:
        """All experts' NVFP4 codes and scales, this rank's share of each expert's width."""
        e, d = self.cfg.num_experts, self.cfg.hidden_size
        lo, hi = self.shards.expert_cols
        i = hi - lo
        groups: dict[str, list[list[torch.Tensor]]] = {"gate_up": [[], [], []], "down": [[], [], []]}
        for expert in tqdm(range(e), desc=f"{base} (NVFP4)", unit="expert", leave=False, disable=None):
            parts = []
            for proj in ("gate_proj", "up_proj", "down_proj"):
                key = f"{base}.{expert}.{proj}"
                down = proj == "down_proj"
                rows, cols = (d, i) if down else (i, d)
                weight = self._read(
                    f"{key}.weight", (rows, cols // 2), self.shards.expert_shard(proj, 2), (torch.uint8,)
                )
                scale = self._read(
                    f"{key}.weight_scale",
                    (rows, cols // 16),
                    self.shards.expert_shard(proj, 16),
                    (torch.float8_e4m3fn,),
                )
                scale_2 = _scalar(f"{key}.weight_scale_2", self.index.get(f"{key}.weight_scale_2"))
                _check(f"{key}.weight_scale_2", scale_2, (), torch.float32)
                parts.append((weight, scale, scale_2))
            gate, up, down = parts
            for slot, tensors in enumerate(((gate[0], up[0]), (gate[1], up[1]))):
                groups["gate_up"][slot].append(torch.cat(tensors))
            groups["gate_up"][2].append(torch.stack((gate[2], up[2])))
            for slot in range(3):
                groups["down"][slot].append(down[slot])
        out = {}
        for group, (packed, scales, scale_2) in groups.items():
            out[f"{group}_packed"] = torch.stack(packed).to(device)
            out[f"{group}_scale"] = torch.stack(scales).to(device)
            out[f"{group}_scale_2"] = torch.stack(scale_2).to(device)
        return out

    def _ngram_table(self, table: str, module, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """This rank's heads' rows of the n-gram table, read across the on-disk shards; FP8 keeps its scale."""
        base = self.key(table)
        lo, hi = module.local_rows
        if f"{base}.weight" in self.index:
            pieces = [(f"{base}.weight", 0)]
        else:
            numbered = sorted(
                (int(m[1]), k)
                for k in self.index.files
                if (m := re.fullmatch(re.escape(base) + r"\.shard_(\d+)\.weight", k))
            )
            if not numbered:
                raise CheckpointError(f"missing tensor {base}.weight (or its shards {base}.shard_N.weight)")
            if [n for n, _ in numbered] != list(range(len(numbered))):
                raise CheckpointError(
                    f"tensor {base}.shard_N.weight: shard numbers {[n for n, _ in numbered]} have a gap"
                )
            pieces, start = [], 0
            for _, key in numbered:
                pieces.append((key, start))
                start += self.index.shape(key)[0]
        dim = module.weight.shape[1]
        total = 0
        first = self.index.stored_dtype(pieces[0][0])
        for key, _ in pieces:  # every shard as wide as the table, of one dtype, so their rows join
            if (stored := self.index.stored_dtype(key)) != first:
                raise CheckpointError(f"tensor {key}: dtype {stored}, its first shard's {first}")
            rows, *rest = self.index.shape(key)
            _check_shape(key, (rows, *rest), (rows, dim))
            total += rows
        _check_shape(f"{base}.weight", (total, dim), (module.rows_total, dim))
        parts = []
        for key, start in pieces:
            rows = self.index.shape(key)[0]
            a, b = max(lo, start), min(hi, start + rows)
            if a < b:
                parts.append(self.index.read(key, Shard(0, ((a - start, b - start),), rows)))
        tensor = torch.cat(parts)
        if self.quant.algo(base) == "FP8":
            if tensor.dtype != torch.float8_e4m3fn:
                raise CheckpointError(f"tensor {base}.weight: dtype {tensor.dtype}, expected float8_e4m3fn (FP8)")
            scale = _scalar(f"{base}.weight_scale", self.index.get(f"{base}.weight_scale"))
            module.weight_scale = scale.float().to(self.table_device)
            return _host_or_device(tensor, self.table_device, tensor.dtype)
        if tensor.dtype not in FLOAT_DTYPES:
            raise CheckpointError(f"tensor {base}.weight: dtype {tensor.dtype}, expected bfloat16 or float32")
        return _host_or_device(tensor, self.table_device, dtype)


def _host_or_device(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The n-gram table where it was asked to live; in host memory it is pinned when a GPU will read it."""
    table = _own(tensor, device, dtype)
    return table.pin_memory() if device.type == "cpu" and torch.cuda.is_available() else table


def _own(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """A fresh, allocator-aligned copy: a memory-mapped tensor's offset in its file would otherwise change CPU
    kernels' vector paths, and so the bits, from one load (or one rank) to the next."""
    return tensor.to(device=device, dtype=dtype, copy=True)


def _check_shape(key: str, got: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if tuple(got) != tuple(expected):
        raise CheckpointError(f"tensor {key}: shape {list(got)}, expected {list(expected)}")


def _scalar(key: str, tensor: torch.Tensor) -> torch.Tensor:
    """A per-tensor scale as a 0-d tensor (stored as [] or [1]), or a refusal naming it."""
    if tensor.numel() != 1:
        raise CheckpointError(f"tensor {key}: shape {list(tensor.shape)}, expected a single value ([] or [1])")
    return tensor.reshape(())


def _check(key: str, tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    _check_shape(key, tuple(tensor.shape), shape)
    if tensor.dtype != dtype:
        raise CheckpointError(f"tensor {key}: dtype {tensor.dtype}, expected {dtype}")


def resolve_dtype(name: str, cfg: FlashNextConfig, device: torch.device) -> torch.dtype:
    """`auto` is float32 on CPU and the checkpoint's dtype (bfloat16 when it says so) on CUDA."""
    if name == "auto":
        return torch.float32 if device.type == "cpu" else getattr(torch, cfg.torch_dtype)
    if name not in ("float32", "bfloat16"):
        raise ValueError(f"--dtype: unknown value {name!r}; expected auto, float32 or bfloat16")
    return getattr(torch, name)


def resolve_kernels(name: str, device: str | torch.device) -> bool:
    """Whether the Triton kernel path runs: `auto` is on for CUDA and off for the CPU."""
    if name not in ("auto", "on", "off"):
        raise ValueError(f"--kernels: unknown value {name!r}; expected auto, on or off")
    return name == "on" or (name == "auto" and torch.device(device).type == "cuda")


def load_model(
    model_dir: str | Path,
    device: str | torch.device = "cpu",
    dtype: str = "auto",
    tp: TensorParallel | None = None,
    load_format: str = "auto",
    ngram_table: str = "device",
    kernels: str = "off",
) -> FlashNextModel:
    """Parse the config, build this rank's part of the model on `device` and fill it from the checkpoint (or, with
    load_format "dummy", with random weights of the real shapes and formats); `kernels` (auto, on, off) picks the
    Triton kernel path, refused at once when the model cannot run on it."""
    model_dir, device = Path(model_dir), torch.device(device)
    cfg = load_config(model_dir)
    torch_dtype = resolve_dtype(dtype, cfg, device)
    use_kernels = resolve_kernels(kernels, device)
    if use_kernels:
        from model.kernel_path import check  # imports Triton: only when the kernel path is asked for

        check(cfg, torch_dtype, device, tp or TensorParallel())
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"--load-format: unknown value {load_format!r}; expected auto or dummy")
    if ngram_table not in ("device", "host"):
        raise ValueError(f"--ngram-table: unknown value {ngram_table!r}; expected device or host")
    table_device = torch.device("cpu") if ngram_table == "host" else device
    loader = WeightLoader(model_dir, cfg) if load_format == "auto" else None
    with_mtp = bool(cfg.mtp_num_hidden_layers) and (loader is None or loader.has_mtp())
    if cfg.mtp_num_hidden_layers and not with_mtp:
        log.warning("%s has no mtp.* tensors: drafting is off", model_dir)
    with torch.device("meta"):
        model = FlashNextModel(cfg, with_mtp=with_mtp, tp=tp, kernels=use_kernels)
    for module in model.modules():  # parameters stay on meta until filled: no dense copy of experts or table
        if isinstance(module, NGramEmbedding):
            module.reset_buffers(device)
    if loader is None:
        fill_dummy(model, torch_dtype, device, table_device=table_device)
    else:
        loader.fill(model, torch_dtype, device, table_device)
    unfilled = [name for name, p in model.named_parameters() if p.is_meta]
    if unfilled:
        raise CheckpointError(f"{model_dir}: no weights were made for {', '.join(unfilled[:5])}")
    if use_kernels:
        from model.kernel_blocks import experts_to_words

        experts_to_words(model)
    model.eval()
    log.info(
        "loaded %s: %d layers, dtype %s, device %s, MTP %s, kernels %s",
        model_dir,
        cfg.num_hidden_layers,
        torch_dtype,
        device,
        "on" if with_mtp else "off",
        "on" if use_kernels else "off",
    )
    return model
