"""Config parsing: every spelling of the architecture, the real shape, and refusals that name the field."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from make_checkpoint import hf_text_config

from model.config import LINEAR, QSA, ConfigError, load_config, parse_config
from tests.tiny import text_config

REAL = Path(__file__).resolve().parents[2] / "configs" / "qwen3.8-flash-next"


def real_text() -> dict:
    return json.loads((REAL / "config.json").read_text())["text_config"]


@pytest.mark.parametrize("model_type", ["qwen4_exp", "qwen3_8_flash_next"])
def test_wrapper_spellings_parse_their_text_config(model_type):
    text = {**text_config(), "model_type": model_type + "_text"}
    wrapped = parse_config({"model_type": model_type, "text_config": text})
    direct = parse_config(text)
    assert wrapped == direct
    assert wrapped.layer_types == (LINEAR, QSA, LINEAR, QSA)


def text_without_dtype() -> dict:
    """A tiny text_config for a wrapper, naming no dtype."""
    text = {**text_config(), "model_type": "qwen4_exp_text"}
    return {key: value for key, value in text.items() if key not in ("dtype", "torch_dtype")}


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("tie_word_embeddings", "yes", "tie_word_embeddings: expected true or false, got 'yes'"),
        ("tie_word_embeddings", None, "tie_word_embeddings: expected true or false, got None"),
        ("dtype", "float99", "dtype: unknown value 'float99'"),
        ("dtype", 7, "dtype: unknown value 7"),
        ("torch_dtype", "float99", "torch_dtype: unknown value 'float99'"),
    ],
)
def test_a_wrappers_bad_top_level_field_is_refused_by_name(field, value, message):
    """transformers reads the wrapper's own tie_word_embeddings and dtype too: a bad one was refused only as the
    tokenizer not loading (or, for a dtype of 7, not at all); it is refused by its name."""
    text = text_without_dtype()
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        parse_config({"model_type": "qwen4_exp", "text_config": text, field: value})


def test_a_wrappers_dtype_is_its_text_configs_when_that_names_none():
    """A wrapper's top-level dtype (as transformers' composite configs carry it) is the model's where text_config
    names none; text_config's own wins where it does."""
    text = text_without_dtype()
    assert parse_config({"model_type": "qwen4_exp", "text_config": text, "dtype": "float16"}).torch_dtype == "float16"
    both = {"model_type": "qwen4_exp", "text_config": {**text, "dtype": "float32"}, "dtype": "float16"}
    assert parse_config(both).torch_dtype == "float32"
    assert parse_config({"model_type": "qwen4_exp", "text_config": text}).torch_dtype == "bfloat16"


@pytest.mark.parametrize("spelling", ["full_attention", "indexed_attention", "qwen_sparse_attention"])
def test_every_qsa_spelling_means_qsa(spelling):
    cfg = parse_config({**text_config(), "layer_types": ["linear_attention", spelling] * 2})
    assert cfg.qsa_layers == (1, 3)


def test_layer_types_from_the_interval_match_transformers():
    cfg = parse_config(text_config("gqa12-hc4"))
    hf_types = hf_text_config(text_config("gqa12-hc4")).layer_types
    assert [LINEAR if t == "linear_attention" else QSA for t in hf_types] == list(cfg.layer_types)
    assert cfg.ple_layers == (1,)  # ple_layer_ids are 1-based


def test_a_config_without_head_dim_takes_transformers_default():
    from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

    data = real_text()
    del data["head_dim"]
    assert parse_config(data).head_dim == Qwen4ExpTextConfig.head_dim == 256


def test_real_config_parses_with_the_model_card_shape():
    cfg = load_config(REAL)
    assert cfg.qsa_layers == tuple(range(3, 48, 4))
    assert (cfg.hidden_size, cfg.wide_size, cfg.rotary_dim) == (2560, 10240, 64)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (24, 2, 256)
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads) == (16, 48)
    assert cfg.ple_layers == (1,) and cfg.ngram_heads == 16 and cfg.eos_token_id == 248044
    assert cfg.indexer_block_topk == 512 and cfg.mtp_num_hidden_layers == 1


def test_real_parameter_counts_match_the_model_card_and_transformers():
    cfg = load_config(REAL)
    counts = cfg.parameter_counts()
    assert counts["ngram_table"] == 320_001_536 * 160  # 51.2B: 16 prime-sized heads padded to 128 rows
    assert 124e9 < counts["main"] < 127e9  # "about 125B"
    assert 2.5e9 < counts["mtp"] < 4e9
    from transformers import Qwen4ExpForCausalLM

    with torch.device("meta"):
        hf = Qwen4ExpForCausalLM(hf_text_config(real_text()))
    table = sum(p.numel() for n, p in hf.named_parameters() if "ngram_embedding" in n)
    assert table == counts["ngram_table"]
    assert sum(p.numel() for p in hf.parameters()) - table == counts["main"]


def refuse(data: dict, field: str) -> str:
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert field in str(err.value)
    return str(err.value)


def test_refusals_name_the_field():
    base = text_config()
    refuse({**base, "model_type": "llama"}, "model_type")
    refuse({"model_type": "qwen4_exp"}, "text_config")
    refuse({"model_type": "qwen4_exp", "text_config": {**base, "model_type": "bert"}}, "text_config.model_type")
    refuse({**base, "layer_types": ["linear_attention", "hybrid_indexed"] * 2}, "layer_types[1]")
    refuse({**base, "layer_types": ["linear_attention"] * 3}, "layer_types")
    refuse({**base, "hidden_size": "32"}, "hidden_size")
    refuse({**base, "num_hidden_layers": 0}, "num_hidden_layers")
    refuse({**base, "num_key_value_heads": 3}, "num_key_value_heads")
    refuse({**base, "attention_bias": True}, "attention_bias")  # transformers adds q/k/v/o biases: not ignored
    refuse({**base, "linear_num_value_heads": 5}, "linear_num_value_heads")
    refuse({**base, "num_experts_per_tok": 9}, "num_experts_per_tok")
    refuse({**base, "indexer_budget": None}, "indexer_budget")
    refuse({**base, "indexer_kv_heads": 2}, "indexer_kv_heads")
    refuse({**base, "indexer_budget": 7}, "indexer_budget")
    refuse({**base, "ple_layer_ids": [2]}, "ple_layer_ids")  # layer 2 is a QSA layer
    refuse({**base, "eos_token_id": base["vocab_size"]}, "eos_token_id")  # the n-gram reset token must exist
    refuse({**base, "ple_layer_ids": [9]}, "ple_layer_ids")
    refuse({**base, "output_gate_type": "tanh"}, "output_gate_type")
    refuse({**base, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_parameters.rope_type")
    # the legacy spellings transformers still reads: "type" for rope_type, rope_scaling for rope_parameters
    yarn = {"type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.25}
    refuse({**base, "rope_parameters": yarn}, "rope_parameters.type")
    refuse({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type")
    refuse({**base, "eos_token_id": None}, "eos_token_id")
    refuse({**base, "mtp_num_hidden_layers": 2}, "mtp_num_hidden_layers")
    refuse({"model_type": "qwen4_exp", "text_config": {**base, "hc_count": 1}}, "text_config.hc_count")


def test_transformers_legacy_layer_type_spellings_parse():
    """`deepseek_sparse_attention` and `mamba`, which transformers' legacy-name map reads as a QSA and a GDN layer,
    parse as those kinds."""
    text = text_config("base", layer_types=["mamba", "deepseek_sparse_attention", "linear_attention", "full_attention"])
    assert parse_config(text).layer_types == (LINEAR, QSA, LINEAR, QSA)


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"mtp_use_dedicated_embeddings": True}, "mtp_use_dedicated_embeddings"),
        ({"mtp": {"num_hidden_layers": 1, "layer_types": ["linear_attention"]}}, "mtp.layer_types"),
        (
            {"mtp": {"num_hidden_layers": 1, "mtp_use_hidden_state_from_layer": 3}},
            "mtp.mtp_use_hidden_state_from_layer",
        ),
        ({"mtp": {"num_hidden_layers": 1, "rope_theta": 123.0}}, "mtp.rope_theta"),
    ],
)
def test_mtp_settings_the_loader_cannot_honour_are_refused_by_name(fields: dict, named: str):
    """An MTP layer with its own embeddings, of GDN kind, fed another layer's hidden state or with its own rope theta
    is refused at start with the field named, not served as the trunk's kind of MTP layer."""
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        parse_config(text_config("base", mtp_num_hidden_layers=1, **fields))


def test_the_real_configs_mtp_settings_parse():
    """The real config's `mtp` object (a QSA layer, the trunk's hidden state and rope theta) is taken."""
    assert parse_config(real_text()).mtp_num_hidden_layers == 1


@pytest.mark.parametrize("value", [2, "one", -1])
def test_an_mtp_objects_layer_count_is_refused_by_its_own_name(value: object) -> None:
    """A bad `mtp.num_hidden_layers` (no top-level mtp_num_hidden_layers) is refused naming `mtp.num_hidden_layers`."""
    text = text_config("base", mtp={"num_hidden_layers": value})
    text.pop("mtp_num_hidden_layers", None)
    with pytest.raises(ConfigError) as refused:
        parse_config(text)
    assert "mtp.num_hidden_layers" in str(refused.value), str(refused.value)


def test_a_bad_torch_dtype_is_refused_by_its_own_name() -> None:
    """A config whose dtype is given as `torch_dtype` (the older spelling) is refused naming `torch_dtype`."""
    text = text_config("base", torch_dtype="int8")
    text.pop("dtype", None)
    with pytest.raises(ConfigError) as refused:
        parse_config(text)
    assert "torch_dtype" in str(refused.value), str(refused.value)
