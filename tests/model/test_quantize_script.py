"""Tests for scripts/quantize_nvfp4.py on a tiny random transformers checkpoint, text-only and full layouts."""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.quant import (
    dequantize_fp8_block,
    dequantize_fp8_per_tensor,
    dequantize_nvfp4,
    nvfp4_scale_2,
    quantize_fp8_block,
    quantize_fp8_per_tensor,
    quantize_nvfp4,
)

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "quantize_nvfp4.py"
TRUNK = "model.language_model."
EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
TABLE = "model.layers.0.ple.ple_embedding.ngram_embedding"
LAYERS, EXPERTS, TABLE_SHARDS = 4, 8, 4
Converted = tuple[Path, Path, dict[str, torch.Tensor]]  # (source folder, converted folder, source tensors)


def load_script() -> ModuleType:
    """Import the script by path so the test does not touch sys.path."""
    spec = importlib.util.spec_from_file_location("quantize_nvfp4", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


quantize_script = load_script()


def tiny_text_config() -> object:
    from transformers import Qwen4ExpTextConfig

    return Qwen4ExpTextConfig(
        vocab_size=300,
        hidden_size=32,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=6,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=EXPERTS,
        num_experts_per_tok=2,
        full_attention_interval=2,
        hc_count=2,
        hc_lowrank=8,
        ple_layer_ids=[1],
        heads_per_ngram=2,
        ngram_vocab_size_base=31,
        split_ngram_parts=TABLE_SHARDS,
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=8,
        indexer_budget=4,
        indexer_compress_ratio=2,
        eos_token_id=5,
        output_gate_type="sigmoid",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        max_position_embeddings=512,
    )


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Converted:
    """A tiny random text-only checkpoint as transformers saves it, and its conversion into two shards."""
    from transformers import Qwen4ExpForCausalLM

    src, dst = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("dst")
    torch.manual_seed(0)
    Qwen4ExpForCausalLM(tiny_text_config()).save_pretrained(src)
    quantize_script.convert_checkpoint(src, dst, shards=2)
    return src, dst, load_file(src / "model.safetensors")


def load_all(folder: Path) -> dict[str, torch.Tensor]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    out: dict[str, torch.Tensor] = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors = load_file(folder / file)
        assert not out.keys() & tensors.keys(), f"{file} repeats keys of another shard"
        out |= tensors
    return out


def test_source_has_the_layout_the_brief_assumes(converted: Converted) -> None:
    _, _, orig = converted
    assert sum(bool(EXPERT.match(k)) for k in orig) == LAYERS * EXPERTS * 3
    assert sum(k.startswith(TABLE + ".shard_") for k in orig) == TABLE_SHARDS


def test_shards_and_index_cover_every_key(converted: Converted) -> None:
    _, dst, _ = converted
    files = sorted(p.name for p in dst.glob("*.safetensors"))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    seen: dict[str, str] = {}
    total = 0
    for file in files:
        tensors = load_file(dst / file)
        assert tensors, f"{file} is empty"
        assert not seen.keys() & tensors.keys(), f"{file} repeats keys of another shard"
        seen |= dict.fromkeys(tensors, file)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    assert index["weight_map"] == seen
    assert index["metadata"]["total_size"] == total
    assert (dst / "generation_config.json").read_text() == (converted[0] / "generation_config.json").read_text()


def test_config_is_the_full_quantized_layout(converted: Converted) -> None:
    from transformers import AutoConfig

    _, dst, _ = converted
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["model_type"] == "qwen4_exp" and cfg["architectures"] == ["Qwen4ExpForConditionalGeneration"]
    assert cfg["text_config"]["model_type"] == "qwen4_exp_text" and cfg["tie_word_embeddings"] is False
    parsed = AutoConfig.from_pretrained(dst)
    assert type(parsed).__name__ == "Qwen4ExpConfig"
    assert parsed.text_config.num_experts == EXPERTS and parsed.text_config.hidden_size == 32
    q = cfg["quantization_config"]
    assert q["quant_method"] == "modelopt" and q["quant_algo"] == "MIXED_PRECISION"
    expect = {f"{TRUNK}layers.{i}.mlp.experts": {"quant_algo": "NVFP4", "group_size": 16} for i in range(LAYERS)}
    expect[f"{TRUNK}layers.0.ple.ple_embedding.ngram_embedding"] = {"quant_algo": "FP8"}
    assert q["quantized_layers"] == expect
    assert q["ignore"][:2] == ["lm_head", "model.language_model.embed_tokens"]
    assert f"{TRUNK}layers.1.self_attn*" in q["ignore"] and f"{TRUNK}layers.0.mlp.gate" in q["ignore"]
    for pattern in q["ignore"]:
        assert not any(fnmatch.fnmatchcase(m, pattern) for m in expect), pattern
    hf = json.loads((dst / "hf_quant_config.json").read_text())
    assert hf["producer"] == {"name": "modelopt", "version": "flashnext"}
    assert hf["quantization"] == {
        "quant_algo": "MIXED_PRECISION",
        "exclude_modules": q["ignore"],
        "quantized_layers": expect,
    }


def shared_scale_2(weights: dict[str, torch.Tensor], key: str) -> torch.Tensor | None:
    """The global scale an expert's gate or up projection shares with the other (None for down)."""
    pair = {"gate_proj": "up_proj", "up_proj": "gate_proj"}
    proj = next((p for p in pair if f".{p}." in key), None)
    return None if proj is None else nvfp4_scale_2(weights[key], weights[key.replace(proj, pair[proj])])


def test_experts_are_nvfp4_grid_projections(converted: Converted) -> None:
    """Each expert projection is its NVFP4 grid image; gate and up share one global scale (ModelOpt's export, which
    vLLM's fused MoE reads as one), down has its own."""
    _, dst, orig = converted
    out = load_all(dst)
    assert not any(k.endswith("input_scale") for k in out)
    for key, w in orig.items():
        if not (m := EXPERT.match(key)):
            continue
        prefix = f"{TRUNK}layers.{m[1]}.mlp.experts.{m[2]}.{m[3]}"
        packed, scale, scale_2 = out[f"{prefix}.weight"], out[f"{prefix}.weight_scale"], out[f"{prefix}.weight_scale_2"]
        assert packed.dtype == torch.uint8 and packed.shape == (w.shape[0], w.shape[1] // 2)
        assert scale.dtype == torch.float8_e4m3fn and scale.shape == (w.shape[0], w.shape[1] // 16)
        assert scale_2.dtype == torch.float32 and scale_2.dim() == 0
        dq = dequantize_nvfp4(packed, scale, scale_2)
        assert torch.equal(dq, dequantize_nvfp4(*quantize_nvfp4(w, shared_scale_2(orig, key)))), prefix
        assert (dq - w).abs().max() <= w.abs().max() / 6  # at most half the top grid step of the global scale


def test_ngram_table_is_fp8_per_tensor(converted: Converted) -> None:
    _, dst, orig = converted
    out = load_all(dst)
    new = TRUNK + TABLE.removeprefix("model.")
    table = torch.cat([orig[f"{TABLE}.shard_{i}.weight"] for i in range(TABLE_SHARDS)])
    shards = [out[f"{new}.shard_{i}.weight"] for i in range(TABLE_SHARDS)]
    assert all(s.dtype == torch.float8_e4m3fn and s.shape == (64, 8) for s in shards)
    scale = out[f"{new}.weight_scale"]
    assert scale.dtype == torch.float32 and scale.dim() == 0
    assert [k for k in out if k.startswith(new) and "scale" in k] == [f"{new}.weight_scale"]
    q, expect_scale = quantize_fp8_per_tensor(table)
    assert scale.item() == expect_scale.item()
    assert torch.equal(torch.cat(shards).view(torch.uint8), q.view(torch.uint8))
    dq = dequantize_fp8_per_tensor(torch.cat(shards), scale)
    assert ((dq - table).abs() <= (table.abs() * 2**-4 + scale * 2**-10) * (1 + 1e-6)).all()


def test_other_tensors_are_bf16_copies(converted: Converted) -> None:
    _, dst, orig = converted
    out = load_all(dst)
    copied = 0
    for key, w in orig.items():
        if EXPERT.match(key) or key.startswith(TABLE + ".shard_"):
            continue
        new = key if key.startswith("lm_head.") else TRUNK + key.removeprefix("model.")
        if w.is_floating_point():
            assert out[new].dtype == torch.bfloat16 and torch.equal(out[new], w.bfloat16()), new
        else:
            assert out[new].dtype == w.dtype and torch.equal(out[new], w), new
        copied += 1
    assert copied == len(out) - LAYERS * EXPERTS * 3 * 3 - TABLE_SHARDS - 1
    assert out["lm_head.weight"].dtype == torch.bfloat16 and out[f"{TRUNK}embed_tokens.weight"].shape == (300, 32)
    assert out[f"{TRUNK}layers.0.ple.ple_embedding.ngram_heads_offsets"].dtype == torch.int64


def test_full_layout_fused_experts_and_mtp(converted: Converted, tmp_path: Path) -> None:
    src, _, orig = converted
    g = torch.Generator().manual_seed(1)
    tensors: dict[str, torch.Tensor] = {}
    for key, w in orig.items():
        if not EXPERT.match(key):
            tensors[key if key.startswith("lm_head.") else TRUNK + key.removeprefix("model.")] = w.bfloat16()
    for layer in range(LAYERS):
        e = [
            [orig[f"model.layers.{layer}.mlp.experts.{i}.{p}.weight"] for i in range(EXPERTS)]
            for p in ("gate_proj", "up_proj", "down_proj")
        ]
        tensors[f"{TRUNK}layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([gw, uw]) for gw, uw in zip(e[0], e[1], strict=True)]
        ).bfloat16()
        tensors[f"{TRUNK}layers.{layer}.mlp.experts.down_proj"] = torch.stack(e[2]).bfloat16()
    mtp_gate_up, mtp_down = torch.randn(EXPERTS, 64, 32, generator=g), torch.randn(EXPERTS, 32, 200, generator=g)
    tensors["mtp.layers.0.mlp.experts.gate_up_proj"] = mtp_gate_up
    tensors["mtp.layers.0.mlp.experts.down_proj"] = mtp_down
    tensors["mtp.fc_embedding.weight"] = torch.randn(32, 32, generator=g)
    table = TRUNK + TABLE.removeprefix("model.")
    big = [torch.randn(6000, 8, generator=g).bfloat16() for _ in range(TABLE_SHARDS)]  # spread over output files
    tensors |= {f"{table}.shard_{i}.weight": w for i, w in enumerate(big)}
    names = sorted(tensors)
    halves = {"model-a.safetensors": names[::2], "model-b.safetensors": names[1::2]}
    full = tmp_path / "full"
    full.mkdir()
    for file, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, full / file)
    weight_map = {k: f for f, keys in halves.items() for k in keys}
    (full / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    text = json.loads((src / "config.json").read_text())
    cfg = {
        "model_type": "qwen4_exp",
        "architectures": ["Qwen4ExpForConditionalGeneration"],
        "image_token_id": 7,
        "text_config": text,
    }
    (full / "config.json").write_text(json.dumps(cfg))
    dst = tmp_path / "dst"
    quantize_script.convert_checkpoint(full, dst, shards=3)

    assert len(list(dst.glob("model-*-of-00003.safetensors"))) == 3
    out = load_all(dst)
    for layer in range(LAYERS):
        for i in range(EXPERTS):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                prefix = f"{TRUNK}layers.{layer}.mlp.experts.{i}.{proj}"
                key = f"model.layers.{layer}.mlp.experts.{i}.{proj}.weight"
                bf16 = {
                    k: v.bfloat16() for k, v in orig.items() if k.startswith(f"model.layers.{layer}.mlp.experts.{i}.")
                }
                got = (out[f"{prefix}.weight"], out[f"{prefix}.weight_scale"], out[f"{prefix}.weight_scale_2"])
                want = quantize_nvfp4(bf16[key], shared_scale_2(bf16, key))
                assert torch.equal(dequantize_nvfp4(*got), dequantize_nvfp4(*want)), prefix
    for i in range(EXPERTS):
        parts = {"gate_proj": mtp_gate_up[i, :32], "up_proj": mtp_gate_up[i, 32:], "down_proj": mtp_down[i]}
        for proj, w in parts.items():
            prefix = f"mtp.layers.0.mlp.experts.{i}.{proj}"
            q, scale_inv = out[f"{prefix}.weight"], out[f"{prefix}.weight_scale_inv"]
            assert q.dtype == torch.float8_e4m3fn and scale_inv.dtype == torch.float32
            assert scale_inv.shape == ((1, 2) if proj == "down_proj" else (1, 1))
            assert torch.equal(dequantize_fp8_block(q, scale_inv), dequantize_fp8_block(*quantize_fp8_block(w)))
    assert not any(k.startswith("mtp.layers.0.mlp.experts.") and k.endswith("_proj") for k in out)
    assert out["mtp.fc_embedding.weight"].dtype == torch.bfloat16
    files = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    assert len({files[f"{table}.shard_{i}.weight"] for i in range(TABLE_SHARDS)}) > 1
    q, scale = quantize_fp8_per_tensor(torch.cat(big))
    assert out[f"{table}.weight_scale"].item() == scale.item()
    got = torch.cat([out[f"{table}.shard_{i}.weight"] for i in range(TABLE_SHARDS)])
    assert torch.equal(got.view(torch.uint8), q.view(torch.uint8))

    cfg_out = json.loads((dst / "config.json").read_text())
    assert cfg_out["image_token_id"] == 7 and cfg_out["text_config"]["hidden_size"] == 32
    layers = cfg_out["quantization_config"]["quantized_layers"]
    assert layers["mtp.layers.0.mlp.experts"] == {"quant_algo": "FP8_PB_WO", "group_size": 128}
    assert list(layers)[-1] == "mtp.layers.0.mlp.experts"
    assert "mtp.fc_embedding" in cfg_out["quantization_config"]["ignore"]
    hf = json.loads((dst / "hf_quant_config.json").read_text())["quantization"]["quantized_layers"]
    assert hf["mtp.layers.0.mlp.experts"] == {"quant_algo": "FP8_BLOCK_SCALES", "group_size": 128}
    assert hf[f"{TRUNK}layers.3.mlp.experts"] == {"quant_algo": "NVFP4", "group_size": 16}


def test_refusals(converted: Converted, tmp_path: Path) -> None:
    src = converted[0]
    with pytest.raises(ValueError, match="shards must be >= 1"):
        quantize_script.convert_checkpoint(src, tmp_path / "out", shards=0)
    with pytest.raises(ValueError, match="dst must differ from src"):
        quantize_script.convert_checkpoint(src, src)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((src / "config.json").read_text())
    save_file({"model.layers.0.mlp.experts.0.up_proj.weight": torch.ones(32, 24)}, bad / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.language_model\.layers\.0\.mlp\.experts\.0\.up_proj: weight: in=24"):
        quantize_script.convert_checkpoint(bad, tmp_path / "bad_out")
    (bad / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"neither model\.safetensors nor model\.safetensors\.index\.json"):
        quantize_script.convert_checkpoint(bad, tmp_path / "bad_out")


def test_cli_prints_a_line_per_shard(converted: Converted, tmp_path: Path) -> None:
    src = converted[0]
    run = subprocess.run(
        [sys.executable, str(SCRIPT), str(src), str(tmp_path / "cli"), "--shards", "3"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    )
    lines = [line for line in (run.stdout + run.stderr).splitlines() if "-of-00003.safetensors" in line]
    assert [line.split()[0] for line in lines] == ["[1/3]", "[2/3]", "[3/3]"]
    assert json.loads((tmp_path / "cli" / "config.json").read_text())["model_type"] == "qwen4_exp"
    assert len(load_all(tmp_path / "cli")) == len(load_all(converted[1]))


def convert_one_expert(tmp_path: Path) -> tuple[dict[str, torch.Tensor], dict, tuple[torch.Tensor, ...]]:
    """scripts/quantize_nvfp4.py on a source holding one expert whose gate and up differ in amax: (output tensors,
    config.json, (gate, up, down))."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    g = torch.Generator().manual_seed(0)
    gate = torch.randn(32, 64, generator=g)
    up = torch.randn(32, 64, generator=g) * 4.0  # a different amax, as real gate/up pairs have
    down = torch.randn(64, 32, generator=g)
    base = "model.layers.0.mlp.experts.0"
    save_file(
        {f"{base}.gate_proj.weight": gate, f"{base}.up_proj.weight": up, f"{base}.down_proj.weight": down},
        src / "model.safetensors",
    )
    (src / "config.json").write_text(json.dumps({"model_type": "qwen4_exp_text"}))
    quantize_script.convert_checkpoint(src, dst, shards=1)
    return load_all(dst), json.loads((dst / "config.json").read_text()), (gate, up, down)


def test_script_gate_and_up_share_weight_scale_2(tmp_path: Path) -> None:
    """One weight_scale_2 per expert for gate_proj and up_proj (the larger amax), as ModelOpt fuses them; vLLM's
    fused MoE keeps one global scale for both."""
    out, _, (gate, up, _) = convert_one_expert(tmp_path)
    prefix = f"{TRUNK}layers.0.mlp.experts.0"
    s_gate, s_up = out[f"{prefix}.gate_proj.weight_scale_2"], out[f"{prefix}.up_proj.weight_scale_2"]
    # What vLLM computes for this expert: w13's global scale is gate's (it warns "w1_weight_scale_2 must match
    # w3_weight_scale_2"), so the up rows come out scaled by s_gate / s_up.
    vllm_up = dequantize_nvfp4(out[f"{prefix}.up_proj.weight"], out[f"{prefix}.up_proj.weight_scale"], s_gate)
    rel = ((vllm_up - up).norm() / up.norm()).item()
    assert s_gate.item() == s_up.item(), (
        f"gate weight_scale_2 {s_gate.item():.6g} != up {s_up.item():.6g}; vLLM's reading of up is off by "
        f"relative error {rel:.3f}"
    )
    expected = torch.maximum(gate.abs().amax(), up.abs().amax()) / (6 * 448)
    assert torch.allclose(s_up, expected, rtol=1e-6)
