"""NVIDIA ModelOpt's quantization configs as ModelOpt exports them and vLLM reads them: per-projection
`quantized_layers` keys, W4A16_NVFP4, single-format configs with wildcard exclusions, lower-case algorithms."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from model.weights import load_model
from tests.tiny import checkpoint

TRUNK = "model.language_model."


@pytest.fixture(scope="module")
def nvfp4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint in NVIDIA's released NVFP4 layout, as scripts/make_checkpoint.py writes it."""
    return checkpoint(tmp_path_factory.mktemp("nvfp4") / "m", fmt="nvfp4")


def with_quant_config(src: Path, dst: Path, edit) -> Path:
    """A copy of `src` whose config.json quantization_config and hf_quant_config.json quantization are `edit`ed."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = edit(cfg["quantization_config"])
    (dst / "config.json").write_text(json.dumps(cfg))
    hf = json.loads((dst / "hf_quant_config.json").read_text())
    hf["quantization"] = edit(hf["quantization"])
    (dst / "hf_quant_config.json").write_text(json.dumps(hf))
    return dst


def expert_banks(model) -> list[torch.Tensor]:
    """Each layer's packed NVFP4 gate-up codes, as loaded."""
    return [layer.mlp.experts.nvfp4["gate_up_packed"] for layer in model.layers]


def assert_same_experts(path: Path, nvfp4: Path) -> None:
    """The checkpoint at `path` loads the NVFP4 experts the released-layout one at `nvfp4` loads."""
    got, want = expert_banks(load_model(path, dtype="float32")), expert_banks(load_model(nvfp4, dtype="float32"))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_per_projection_quantized_layers_keys_load_as_nvfp4(nvfp4: Path, tmp_path: Path) -> None:
    """quantized_layers keyed per expert projection (ModelOpt's per-module export, which vLLM also resolves) loads."""
    num_experts = json.loads((nvfp4 / "config.json").read_text())["text_config"]["num_experts"]

    def per_projection(q: dict) -> dict:
        layers = {}
        for module, spec in q["quantized_layers"].items():
            if module.endswith(".mlp.experts") and spec["quant_algo"] == "NVFP4":
                for e in range(num_experts):
                    for proj in ("gate_proj", "up_proj", "down_proj"):
                        layers[f"{module}.{e}.{proj}"] = spec
            else:
                layers[module] = spec
        return dict(q, quantized_layers=layers)

    path = with_quant_config(nvfp4, tmp_path / "per_proj", per_projection)
    assert_same_experts(path, nvfp4)


def test_w4a16_nvfp4_quant_algo_loads_as_nvfp4(nvfp4: Path, tmp_path: Path) -> None:
    """A ModelOpt layer quant_algo "W4A16_NVFP4" (same packing, weight-only; vLLM reads it) loads as NVFP4 experts."""

    def w4a16(q: dict) -> dict:
        layers = {
            m: dict(s, quant_algo="W4A16_NVFP4") if s["quant_algo"] == "NVFP4" else s
            for m, s in q["quantized_layers"].items()
        }
        return dict(q, quantized_layers=layers)

    path = with_quant_config(nvfp4, tmp_path / "w4a16", w4a16)
    assert_same_experts(path, nvfp4)


def test_single_format_nvfp4_config_with_exclude_wildcards_loads(nvfp4: Path, tmp_path: Path) -> None:
    """ModelOpt's single-format export (quant_algo NVFP4, group_size 16, wildcard exclude_modules) loads its experts."""
    from make_checkpoint import write_safetensors

    from model.quant import dequantize_fp8_block, dequantize_fp8_per_tensor
    from model.weights import TensorIndex

    index = TensorIndex(nvfp4)
    tensors = {name: index.get(name) for name in index.files}
    table = f"{TRUNK}layers.0.ple.ple_embedding.ngram_embedding"
    scale = tensors.pop(f"{table}.weight_scale")
    for name in [n for n in tensors if n.startswith(f"{table}.shard_")]:  # the table back to BF16
        tensors[name] = dequantize_fp8_per_tensor(tensors[name], scale, torch.bfloat16)
    for name in [n for n in tensors if n.startswith("mtp.") and n.endswith(".weight_scale_inv")]:  # MTP experts too
        weight = name.removesuffix("_scale_inv")
        tensors[weight] = dequantize_fp8_block(tensors[weight], tensors.pop(name), torch.bfloat16)
    path = tmp_path / "single"
    shutil.copytree(nvfp4, path, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    write_safetensors(tensors, path, 2)
    cfg = json.loads((path / "config.json").read_text())
    exclude = [
        *cfg["quantization_config"]["ignore"],
        f"{TRUNK}layers.0.ple.ple_embedding*",
        "mtp.layers.0.mlp.experts*",
    ]
    single = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": sorted(exclude)}
    cfg["quantization_config"] = {"quant_method": "modelopt", **single}
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "hf_quant_config.json").write_text(
        json.dumps({"producer": {"name": "modelopt", "version": "0.39"}, "quantization": single})
    )
    assert_same_experts(path, nvfp4)


def test_lowercase_quant_algo_is_read(nvfp4: Path, tmp_path: Path) -> None:
    """quant_algo is matched case-insensitively (ModelOpt may emit "fp8_pb_wo"/"nvfp4"; vLLM upper-cases it)."""

    def lower(q: dict) -> dict:
        layers = {m: dict(s, quant_algo=s["quant_algo"].lower()) for m, s in q["quantized_layers"].items()}
        return dict(q, quantized_layers=layers)

    path = with_quant_config(nvfp4, tmp_path / "lower", lower)
    want = load_model(nvfp4, dtype="float32")
    got = load_model(path, dtype="float32")
    assert all(torch.equal(a, b) for a, b in zip(expert_banks(got), expert_banks(want), strict=True))
    assert torch.equal(got.mtp.layers[0].mlp.experts.gate_up_proj, want.mtp.layers[0].mlp.experts.gate_up_proj)
