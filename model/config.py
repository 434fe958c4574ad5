"""Flash Next text config: parsed from every spelling of the architecture, refused by field when wrong."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WRAPPER_TYPES = ("qwen4_exp", "qwen3_8_flash_next")
TEXT_TYPES = ("qwen4_exp_text", "qwen3_8_flash_next_text")
DTYPES = ("bfloat16", "float32", "float16")  # the checkpoint dtypes a config may name
LINEAR = "linear_attention"
QSA = "qsa"
NGRAM_BASE_MAX = 2**40  # a table head's rows at most (the real model's are 2e7; no memory holds 2^40 rows)
# Every spelling transformers or the checkpoints have used for a QSA (indexed sparse attention) layer, and for a
# GDN layer (transformers' legacy-name map reads `deepseek_sparse_attention` and `mamba` as these kinds).
QSA_SPELLINGS = ("full_attention", "indexed_attention", "qwen_sparse_attention", "deepseek_sparse_attention")
LINEAR_SPELLINGS = (LINEAR, "mamba")


class ConfigError(ValueError):
    """A config value that is missing, of the wrong type, unknown or inconsistent; the message names the field."""


@dataclass(frozen=True, slots=True)
class FlashNextConfig:
    """The text model's shape, normalised (0-based PLE layers, canonical layer types)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    max_position_embeddings: int
    rms_norm_eps: float
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    output_gate_type: str
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    hc_count: int
    hc_lowrank: int
    ple_layers: tuple[int, ...]
    ple_embed_dim: int
    ple_conv_kernel_size: int
    ngram_size: int
    heads_per_ngram: int
    ngram_vocab_size_base: int
    make_ngram_vocab_size_divisible_by: int
    ngram_seed: int
    split_ngram_parts: int
    indexer_n_heads: int
    indexer_head_dim: int
    indexer_budget: int
    indexer_compress_ratio: int
    eos_token_id: int
    mtp_num_hidden_layers: int
    tie_word_embeddings: bool
    torch_dtype: str
    quantization_config: dict[str, Any] | None = field(default=None, compare=False, repr=False)

    @property
    def wide_size(self) -> int:
        """Width of the hyper-connection residual: hc_count streams of hidden_size."""
        return self.hc_count * self.hidden_size

    @property
    def qsa_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == QSA)

    @property
    def ngram_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def indexer_block_topk(self) -> int:
        return self.indexer_budget // self.indexer_compress_ratio

    def parameter_counts(self) -> dict[str, int]:
        """Parameters by part: the main model, the n-gram table, the MTP layer (from the shapes alone)."""
        from model.ple import ngram_table_rows

        d, wide = self.hidden_size, self.wide_size
        hc = wide + self.hc_lowrank * wide * 2 + self.hc_count * wide
        mixer = wide + self.hc_lowrank * wide * 2
        moe = (
            self.num_experts * d
            + self.num_experts * 3 * d * self.moe_intermediate_size
            + 3 * d * self.shared_expert_intermediate_size
            + d
        )
        kd = self.linear_num_key_heads * self.linear_key_head_dim
        vd = self.linear_num_value_heads * self.linear_value_head_dim
        gdn = (
            d * (2 * kd + vd)
            + d * vd
            + 2 * d * self.linear_num_value_heads
            + (2 * kd + vd) * self.linear_conv_kernel_dim
            + 2 * self.linear_num_value_heads
            + self.linear_value_head_dim
            + vd * d
        )
        qsa = (
            d * self.num_attention_heads * self.head_dim * 2
            + 2 * d * self.num_key_value_heads * self.head_dim
            + self.num_attention_heads * self.head_dim * d
            + 2 * self.head_dim
            + d * (self.indexer_n_heads + 1) * self.indexer_head_dim
            + 2 * self.indexer_head_dim
        )
        ple = self.ple_embed_dim * wide + self.ple_embed_dim * d + 3 * wide + wide * self.ple_conv_kernel_size
        main = 2 * self.vocab_size * d if not self.tie_word_embeddings else self.vocab_size * d
        main += mixer
        for i, kind in enumerate(self.layer_types):
            main += 2 * hc + moe + (gdn if kind == LINEAR else qsa) + (ple if i in self.ple_layers else 0)
        table = len(self.ple_layers) * ngram_table_rows(self) * (self.ple_embed_dim // max(self.ngram_heads, 1))
        mtp = 0
        if self.mtp_num_hidden_layers:
            mtp = 2 * d * d + d + wide + mixer + self.mtp_num_hidden_layers * (2 * hc + qsa + moe)
        return {"main": main, "ngram_table": table, "mtp": mtp}


def load_config(model_dir: str | Path) -> FlashNextConfig:
    """Read and parse `config.json` from a checkpoint folder."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"no config.json in {model_dir}")
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:  # not JSON, or not UTF-8
        raise ConfigError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return parse_config(data)


def parse_config(data: dict[str, Any]) -> FlashNextConfig:
    """Parse a config dict in any supported spelling into a FlashNextConfig."""
    if not isinstance(data, dict):
        raise ConfigError("config must be a JSON object")
    model_type = data.get("model_type")
    if model_type in WRAPPER_TYPES:
        text = data.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"text_config: required (an object) when model_type is {model_type!r}")
        text = dict(text)
        text_type = text.get("model_type", model_type + "_text")
        if text_type not in TEXT_TYPES:
            raise ConfigError(f"text_config.model_type: unknown value {text_type!r}; expected one of {TEXT_TYPES}")
        top = _Reader(data, "")  # transformers reads these top-level fields too: refused here by name
        text.setdefault("tie_word_embeddings", top.bool("tie_word_embeddings", False))
        top_dtype = _dtype(data, "")
        if not (text.get("dtype") or text.get("torch_dtype")):
            text["dtype"] = top_dtype
        text.setdefault("quantization_config", data.get("quantization_config"))
        return _parse_text(text, prefix="text_config.")
    if model_type in TEXT_TYPES:
        return _parse_text(data, prefix="")
    raise ConfigError(f"model_type: unknown value {model_type!r}; expected one of {WRAPPER_TYPES + TEXT_TYPES}")


class _Reader:
    """Typed field access that names the field on every refusal."""

    def __init__(self, data: dict[str, Any], prefix: str) -> None:
        self.data, self.prefix = data, prefix

    def name(self, key: str) -> str:
        return self.prefix + key

    def int(self, key: str, default: int | None = None, minimum: int = 1, maximum: int | None = None) -> int:
        value = self.data.get(key, default)
        if value is None:
            raise ConfigError(f"{self.name(key)}: required")
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{self.name(key)}: expected an integer, got {value!r}")
        if value < minimum:
            raise ConfigError(f"{self.name(key)}: must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise ConfigError(f"{self.name(key)}: must be <= {maximum}, got {value}")
        return value

    def float(self, key: str, default: float | None = None) -> float:
        value = self.data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"{self.name(key)}: expected a positive number, got {value!r}")
        return float(value)

    def bool(self, key: str, default: bool) -> bool:
        value = self.data.get(key, default)
        if not isinstance(value, bool):
            raise ConfigError(f"{self.name(key)}: expected true or false, got {value!r}")
        return value

    def choice(self, key: str, default: str, allowed: tuple[str, ...]) -> str:
        value = self.data.get(key, default)
        if value is None:
            value = default
        if value not in allowed:
            raise ConfigError(f"{self.name(key)}: unknown value {value!r}; expected one of {allowed}")
        return value


def _layer_types(r: _Reader, num_layers: int) -> tuple[str, ...]:
    raw = r.data.get("layer_types")
    if raw is None:
        interval = r.int("full_attention_interval", 4)
        return tuple(LINEAR if (i + 1) % interval else QSA for i in range(num_layers))
    if not isinstance(raw, list):
        raise ConfigError(f"{r.name('layer_types')}: expected a list, got {raw!r}")
    if len(raw) != num_layers:
        raise ConfigError(f"{r.name('layer_types')}: has {len(raw)} entries but num_hidden_layers is {num_layers}")
    types = []
    for i, kind in enumerate(raw):
        if kind in LINEAR_SPELLINGS:
            types.append(LINEAR)
        elif kind in QSA_SPELLINGS:
            types.append(QSA)
        else:
            allowed = (*LINEAR_SPELLINGS, *QSA_SPELLINGS)
            raise ConfigError(f"{r.name('layer_types')}[{i}]: unknown layer type {kind!r}; expected one of {allowed}")
    return tuple(types)


def _eos(r: _Reader) -> int:
    """The first end-of-sequence id, which must be a token of the vocabulary."""
    eos = r.data.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if eos is None:
        raise ConfigError(f"{r.name('eos_token_id')}: required (it is the n-gram embedding's reset token)")
    if isinstance(eos, bool) or not isinstance(eos, int) or eos < 0:
        raise ConfigError(f"{r.name('eos_token_id')}: expected a token id, got {eos!r}")
    vocab = r.int("vocab_size")
    if eos >= vocab:
        raise ConfigError(f"{r.name('eos_token_id')}: {eos} is outside the vocabulary (vocab_size {vocab})")
    return eos


def _mtp_layers(r: _Reader, rope_theta: float) -> int:
    """The MTP layers (0 or 1); the MTP settings this loader cannot honour (its own embeddings, a GDN layer, a
    hidden state from another layer, another rope theta) are refused by name."""
    mtp = r.data.get("mtp")
    m = _Reader(mtp if isinstance(mtp, dict) else {}, r.name("mtp") + ".")
    if "mtp_num_hidden_layers" in r.data or not isinstance(mtp, dict):
        name, value = r.name("mtp_num_hidden_layers"), r.int("mtp_num_hidden_layers", 0, minimum=0)
    else:  # the count comes from the mtp object
        name, value = m.name("num_hidden_layers"), m.int("num_hidden_layers", 1, minimum=0)
    if value > 1:
        raise ConfigError(f"{name}: only one MTP layer is supported, got {value}")
    if value and r.bool("mtp_use_dedicated_embeddings", False):
        raise ConfigError(
            f"{r.name('mtp_use_dedicated_embeddings')}: an MTP layer with its own embeddings is not supported"
        )
    if not value or not isinstance(mtp, dict):
        return value
    kinds = mtp.get("layer_types", [QSA_SPELLINGS[0]])
    if not isinstance(kinds, list) or any(kind not in QSA_SPELLINGS for kind in kinds):
        raise ConfigError(f"{m.name('layer_types')}: only a QSA MTP layer is supported, got {kinds!r}")
    if mtp.get("mtp_use_hidden_state_from_layer") is not None:
        raise ConfigError(
            f"{m.name('mtp_use_hidden_state_from_layer')}: only the trunk's last hidden state is supported"
        )
    if m.float("rope_theta", rope_theta) != rope_theta:
        raise ConfigError(f"{m.name('rope_theta')}: must equal the trunk's rope_theta {rope_theta:g}")
    return value


def _parse_text(data: dict[str, Any], prefix: str) -> FlashNextConfig:
    r = _Reader(data, prefix)
    num_layers = r.int("num_hidden_layers")
    hidden = r.int("hidden_size")
    layer_types = _layer_types(r, num_layers)
    # transformers reads a legacy rope_scaling in place of rope_parameters, and a legacy "type" as rope_type
    rope_key = "rope_scaling" if data.get("rope_scaling") else "rope_parameters"
    rope = data.get(rope_key) or {}
    if not isinstance(rope, dict):
        raise ConfigError(f"{r.name(rope_key)}: expected an object, got {rope!r}")
    rope_r = _Reader(rope, prefix + rope_key + ".")
    rope_r.choice("type" if "type" in rope and "rope_type" not in rope else "rope_type", "default", ("default",))
    theta = rope_r.float("rope_theta", data.get("rope_theta", 10_000.0))
    partial = rope_r.float("partial_rotary_factor", data.get("partial_rotary_factor", 1.0))
    head_dim = r.int("head_dim", 256)  # transformers' default, not hidden_size / heads
    rotary_dim = int(head_dim * partial)
    if rotary_dim % 2 or rotary_dim > head_dim:
        raise ConfigError(
            f"{rope_r.name('partial_rotary_factor')}: gives rotary dim {rotary_dim} for head_dim {head_dim}"
        )

    heads, kv_heads = r.int("num_attention_heads"), r.int("num_key_value_heads")
    if r.bool("attention_bias", False):
        raise ConfigError(f"{r.name('attention_bias')}: QSA projections with biases are not supported")
    if heads % kv_heads:
        raise ConfigError(f"{r.name('num_key_value_heads')}: {kv_heads} does not divide num_attention_heads {heads}")
    lk, lv = r.int("linear_num_key_heads", 16), r.int("linear_num_value_heads", 32)
    if lv % lk:
        raise ConfigError(f"{r.name('linear_num_value_heads')}: {lv} is not a multiple of linear_num_key_heads {lk}")
    r.choice("hidden_act", "silu", ("silu",))
    gate = r.choice("output_gate_type", data.get("hidden_act") or "silu", ("sigmoid", "silu"))
    experts, top_k = r.int("num_experts", 512), r.int("num_experts_per_tok", 10)
    if top_k > experts:
        raise ConfigError(f"{r.name('num_experts_per_tok')}: {top_k} exceeds num_experts {experts}")

    has_qsa = QSA in layer_types
    idx_fields = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
    given = [k for k in idx_fields if data.get(k) is not None]
    if (has_qsa or given) and len(given) != len(idx_fields):
        missing = next(k for k in idx_fields if data.get(k) is None)
        raise ConfigError(f"{r.name(missing)}: required for QSA layers (all indexer_* fields must be set)")
    idx = {k: r.int(k) for k in idx_fields} if given else dict.fromkeys(idx_fields, 1)
    if given:
        if idx["indexer_kv_heads"] != 1:
            raise ConfigError(f"{r.name('indexer_kv_heads')}: QSA needs exactly 1 indexer key head")
        if idx["indexer_budget"] % idx["indexer_compress_ratio"]:
            raise ConfigError(f"{r.name('indexer_budget')}: must be a multiple of indexer_compress_ratio")
        if rotary_dim > idx["indexer_head_dim"]:
            raise ConfigError(f"{r.name('indexer_head_dim')}: smaller than the rotary dim {rotary_dim}")

    ple_ids = data.get("ple_layer_ids") or []
    if not isinstance(ple_ids, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in ple_ids):
        raise ConfigError(f"{r.name('ple_layer_ids')}: expected a list of 1-based layer ids, got {ple_ids!r}")
    ple_layers = tuple(sorted({i - 1 for i in ple_ids}))
    for layer in ple_layers:
        if not 0 <= layer < num_layers:
            raise ConfigError(f"{r.name('ple_layer_ids')}: {layer + 1} is outside 1..{num_layers}")
        if layer_types[layer] != LINEAR:
            raise ConfigError(f"{r.name('ple_layer_ids')}: layer {layer + 1} is not a linear_attention layer")
    ngram_size, per_ngram = r.int("ngram_size", 3, minimum=2), r.int("heads_per_ngram", 8)
    ple_dim = r.int("ple_embed_dim", hidden)
    if ple_layers and ple_dim % ((ngram_size - 1) * per_ngram):
        raise ConfigError(f"{r.name('ple_embed_dim')}: {ple_dim} is not divisible by the n-gram head count")

    dtype = _dtype(data, prefix)
    return FlashNextConfig(
        vocab_size=r.int("vocab_size"),
        hidden_size=hidden,
        num_hidden_layers=num_layers,
        layer_types=layer_types,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        rope_theta=theta,
        max_position_embeddings=r.int("max_position_embeddings", 32768),
        rms_norm_eps=r.float("rms_norm_eps", 1e-6),
        linear_num_key_heads=lk,
        linear_num_value_heads=lv,
        linear_key_head_dim=r.int("linear_key_head_dim", 128),
        linear_value_head_dim=r.int("linear_value_head_dim", 128),
        linear_conv_kernel_dim=r.int("linear_conv_kernel_dim", 4),
        output_gate_type=gate,
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=r.int("moe_intermediate_size", 512),
        shared_expert_intermediate_size=r.int("shared_expert_intermediate_size", 512),
        norm_topk_prob=r.bool("norm_topk_prob", True),
        hc_count=r.int("hc_count", 4, minimum=2),
        hc_lowrank=r.int("hc_lowrank", 320),
        ple_layers=ple_layers,
        ple_embed_dim=ple_dim,
        ple_conv_kernel_size=r.int("ple_conv_kernel_size", 4),
        ngram_size=ngram_size,
        heads_per_ngram=per_ngram,
        ngram_vocab_size_base=r.int("ngram_vocab_size_base", 20_000_000, maximum=NGRAM_BASE_MAX),
        make_ngram_vocab_size_divisible_by=r.int("make_ngram_vocab_size_divisible_by", 128),
        ngram_seed=r.int("seed", 1234, minimum=0),
        split_ngram_parts=r.int("split_ngram_parts", 512),
        indexer_n_heads=idx["indexer_n_heads"],
        indexer_head_dim=idx["indexer_head_dim"],
        indexer_budget=idx["indexer_budget"],
        indexer_compress_ratio=idx["indexer_compress_ratio"],
        eos_token_id=_eos(r),
        mtp_num_hidden_layers=_mtp_layers(r, theta),
        tie_word_embeddings=r.bool("tie_word_embeddings", False),
        torch_dtype=dtype,
        quantization_config=_quantization_config(r),
    )


def _dtype(data: dict[str, Any], prefix: str) -> str:
    """The checkpoint's dtype from `dtype` (or the older `torch_dtype`); bfloat16 where neither is given."""
    key = "dtype" if data.get("dtype") else "torch_dtype"
    dtype = data.get(key) or "bfloat16"
    if dtype not in DTYPES:
        raise ConfigError(f"{prefix}{key}: unknown value {dtype!r}; expected one of {DTYPES}")
    return dtype


def _quantization_config(r: _Reader) -> dict[str, Any] | None:
    qc = r.data.get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise ConfigError(f"{r.name('quantization_config')}: expected an object, got {qc!r}")
    return qc
