"""Checkpoint formats: layouts, shards, NVFP4/FP8 mixed precision, MTP presence, and refusals naming the tensor."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from make_checkpoint import write_safetensors

from model.flashnext import FlashNextModel, single_lane_batch
from model.weights import CheckpointError, TensorIndex, load_model
from tests.tiny import checkpoint, hf_model, text_config, ties_to_lower_index

PROMPT = torch.tensor([7, 19, 5, 33, 2, 91, 5, 44, 8, 13, 21, 60, 17, 3, 99, 12, 40, 41, 42, 5, 6])


def tensors_of(path: Path) -> dict[str, torch.Tensor]:
    index = TensorIndex(path)
    return {name: index.get(name) for name in index.files}


def rewrite(src: Path, dst: Path, tensors: dict[str, torch.Tensor], shards: int = 1) -> Path:
    """Copy a checkpoint folder with other tensors."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    write_safetensors(tensors, dst, shards)
    return dst


def logits(model: FlashNextModel) -> torch.Tensor:
    return model(single_lane_batch(model.new_lane(), PROMPT, 0)).logits


def greedy(model: FlashNextModel, steps: int) -> list[int]:
    lane = model.new_lane()
    last = model(single_lane_batch(lane, PROMPT, 0)).logits[-1]
    out = []
    for _ in range(steps):
        out.append(int(last.argmax()))
        last = model(single_lane_batch(lane, torch.tensor(out[-1:]), lane.length)).logits[0]
    return out


def hf_with_our_weights(ours: FlashNextModel):
    """transformers' model holding our loaded (dequantized) weights, fp32."""
    hf = hf_model("base")
    state = {}
    for name, param in ours.named_parameters():
        state[name if name.startswith("lm_head") else f"model.{name}"] = param.float()
    for i, layer in enumerate(ours.layers):
        bank = layer.mlp.experts
        experts = [bank.expert(e, torch.float32) for e in range(ours.cfg.num_experts)]
        state[f"model.layers.{i}.mlp.experts.gate_up_proj"] = torch.stack([gu for gu, _ in experts])
        state[f"model.layers.{i}.mlp.experts.down_proj"] = torch.stack([dn for _, dn in experts])
        if layer.ple is not None:
            table = layer.ple.ple_embedding.ngram_embedding
            rows = torch.arange(table.weight.shape[0])
            state[f"model.layers.{i}.ple.ple_embedding.ngram_embedding.weight"] = table.lookup(rows, torch.float32)
    state = {k: v for k, v in state.items() if not k.startswith("model.mtp.")}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all("ngram_heads" in m or "layer_multipliers" in m for m in missing), missing
    return hf


def test_released_nvfp4_layout_continues_like_transformers_on_dequantized_weights(tmp_path):
    path = checkpoint(tmp_path / "nvfp4", fmt="nvfp4")
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen4_exp" and "text_config" in config
    assert len(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    assert len(list(path.glob("model-*.safetensors"))) == 2
    names = TensorIndex(path).files
    assert "model.language_model.layers.0.mlp.experts.3.gate_proj.weight_scale_2" in names
    ours = load_model(path, dtype="float32")
    assert ours.layers[0].mlp.experts.nvfp4["gate_up_packed"].dtype == torch.uint8
    assert ours.layers[0].ple.ple_embedding.ngram_embedding.weight.dtype == torch.float8_e4m3fn
    hf = hf_with_our_weights(ours)
    with torch.no_grad(), ties_to_lower_index():
        expected_logits = hf(PROMPT[None]).logits[0]
        expected = hf.generate(PROMPT[None], max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, len(PROMPT) :]
    got = logits(ours)
    assert ((got - expected_logits).norm() / expected_logits.norm()).item() <= 1e-5
    assert greedy(ours, 16) == expected.tolist()


def test_fused_and_per_expert_layouts_and_shards_load_the_same(tmp_path):
    per_expert = checkpoint(tmp_path / "per_expert")
    tensors = tensors_of(per_expert)
    cfg = text_config()
    fused = {}
    for name, tensor in tensors.items():
        if ".mlp.experts." not in name or name.startswith("mtp."):
            fused[name] = tensor
    for layer in range(cfg["num_hidden_layers"]):
        base = f"model.layers.{layer}.mlp.experts"
        e = range(cfg["num_experts"])
        gate_up = [
            torch.cat((tensors[f"{base}.{i}.gate_proj.weight"], tensors[f"{base}.{i}.up_proj.weight"])) for i in e
        ]
        fused[f"{base}.gate_up_proj"] = torch.stack(gate_up)
        fused[f"{base}.down_proj"] = torch.stack([tensors[f"{base}.{i}.down_proj.weight"] for i in e])
    fused_path = rewrite(per_expert, tmp_path / "fused", fused, shards=3)
    assert (fused_path / "model.safetensors.index.json").is_file()
    assert torch.equal(logits(load_model(fused_path, dtype="float32")), logits(load_model(per_expert, dtype="float32")))


def test_a_checkpoint_without_mtp_turns_drafting_off(tmp_path, caplog):
    path = checkpoint(tmp_path / "m", with_mtp=False)
    cfg = json.loads((path / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level(logging.WARNING):
        model = load_model(path, dtype="float32")
    assert model.mtp is None
    assert "drafting is off" in caplog.text


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return checkpoint(tmp_path_factory.mktemp("good") / "m")


def refused(good: Path, tmp_path: Path, change, match: str) -> None:
    tensors = tensors_of(good)
    change(tensors)
    path = rewrite(good, tmp_path / "bad", tensors)
    with pytest.raises(CheckpointError, match=match):
        load_model(path, dtype="float32")


def test_missing_tensor_is_named(good, tmp_path):
    key = "model.layers.1.self_attn.q_proj.weight"
    refused(good, tmp_path, lambda t: t.pop(key), f"missing tensor {key}")


def test_missing_expert_is_named(good, tmp_path):
    key = "model.layers.2.mlp.experts.5.up_proj.weight"
    refused(good, tmp_path, lambda t: t.pop(key), f"missing tensor {key}")


def test_wrong_shape_is_named(good, tmp_path):
    key = "model.layers.0.linear_attn.out_proj.weight"
    refused(good, tmp_path, lambda t: t.update({key: t[key][:, :-1]}), rf"tensor {key}: shape \[32, 47\], expected")


def test_an_ngram_table_shard_of_another_width_is_named(good, tmp_path):
    table = "model.layers.0.ple.ple_embedding.ngram_embedding"

    def widen_one(tensors: dict[str, torch.Tensor]) -> None:
        shard = tensors[f"{table}.shard_1.weight"]
        tensors[f"{table}.shard_1.weight"] = torch.cat([shard, shard[:, :1]], dim=1)

    refused(good, tmp_path, widen_one, rf"tensor {table}\.shard_1\.weight: shape")


def test_wrong_dtype_is_named(good, tmp_path):
    key = "lm_head.weight"
    refused(good, tmp_path, lambda t: t.update({key: t[key].to(torch.int32)}), f"tensor {key}: dtype torch.int32")


def test_wrong_hash_constants_are_named(good, tmp_path):
    key = "model.layers.0.ple.ple_embedding.ngram_heads_vocab_sizes"
    refused(good, tmp_path, lambda t: t.update({key: t[key] + 2}), f"tensor {key}")


def test_unknown_quant_algo_is_named(good, tmp_path):
    path = shutil.copytree(good, tmp_path / "q")
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "modelopt",
        "quant_algo": "MIXED_PRECISION",
        "quantized_layers": {"model.layers.0.mlp.experts": {"quant_algo": "INT3"}},
    }
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"quantized_layers\['model.layers.0.mlp.experts'\].quant_algo"):
        load_model(path, dtype="float32")


def test_an_unreadable_hf_quant_config_is_named(tmp_path):
    path = checkpoint(tmp_path / "nvfp4", fmt="nvfp4")
    (path / "hf_quant_config.json").write_text('{"quantization": ')
    with pytest.raises(CheckpointError, match=r"hf_quant_config\.json: not a JSON object"):
        load_model(path, dtype="float32")
    (path / "hf_quant_config.json").write_text('{"quantization": "NVFP4"}')
    with pytest.raises(CheckpointError, match=r"hf_quant_config\.json quantization: expected an object"):
        load_model(path, dtype="float32")


def test_nvfp4_scale_dtype_is_checked(tmp_path):
    path = checkpoint(tmp_path / "nvfp4", fmt="nvfp4")
    key = "model.language_model.layers.1.mlp.experts.2.down_proj.weight_scale"
    tensors = tensors_of(path)
    tensors[key] = tensors[key].float()
    bad = rewrite(path, tmp_path / "bad", tensors, shards=2)
    with pytest.raises(CheckpointError, match=f"tensor {key}: dtype torch.float32, expected float8_e4m3fn"):
        load_model(bad, dtype="float32")


@pytest.mark.parametrize(
    "key",
    [
        "model.language_model.layers.1.mlp.experts.2.down_proj.weight_scale_2",
        "model.language_model.layers.0.ple.ple_embedding.ngram_embedding.weight_scale",
    ],
)
def test_a_per_tensor_scale_that_is_not_one_value_is_named(tmp_path, key):
    path = checkpoint(tmp_path / "nvfp4", fmt="nvfp4")
    tensors = tensors_of(path)
    tensors[key] = tensors[key].reshape(1).repeat(2)
    bad = rewrite(path, tmp_path / "bad", tensors, shards=2)
    with pytest.raises(CheckpointError, match=rf"tensor {key}: shape \[2\], expected a single value"):
        load_model(bad, dtype="float32")


def test_the_ngram_table_in_host_memory_gives_the_same_logits(good):
    on_device = load_model(good, dtype="float32")
    on_host = load_model(good, dtype="float32", ngram_table="host")
    assert on_host.layers[0].ple.ple_embedding.ngram_embedding.weight.device.type == "cpu"
    assert torch.equal(logits(on_host), logits(on_device))
    with pytest.raises(ValueError, match="--ngram-table"):
        load_model(good, dtype="float32", ngram_table="disk")


def test_loading_draws_no_progress_bars_into_a_log_that_is_not_a_terminal(good, capsys, monkeypatch):
    """Bars are for terminals: docker logs and files get no carriage returns or cursor moves from them."""
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    load_model(good, dtype="float32")
    assert "loading weights" not in capsys.readouterr().err


@pytest.mark.parametrize("shards", [1, 2])
def test_a_truncated_safetensors_file_is_named(good, tmp_path, shards):
    """An interrupted download: the refusal names the file, with or without an index."""
    path = rewrite(good, tmp_path / "cut", tensors_of(good), shards)
    cut = sorted(path.glob("*.safetensors"))[-1]
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=f"{cut.name}: not a readable safetensors file"):
        load_model(path, dtype="float32")


def test_an_index_naming_the_wrong_file_is_named(good, tmp_path):
    path = rewrite(good, tmp_path / "moved", tensors_of(good), shards=2)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    key = "model.layers.0.linear_attn.out_proj.weight"
    index["weight_map"][key] = next(f for f in set(index["weight_map"].values()) if f != index["weight_map"][key])
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"tensor {key}: not in {index['weight_map'][key]}"):
        load_model(path, dtype="float32")
    (path / "model.safetensors.index.json").write_text("{cut short")
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: not a JSON object with a weight_map"):
        load_model(path, dtype="float32")


def test_loading_builds_the_model_without_random_init_or_torch_dynamo(good):
    """A fresh process loads a checkpoint without importing torch._dynamo (which drawing a random embedding table on
    the meta device imports, the slowest step of a start on CPU), and the table is the checkpoint's."""
    probe = "import sys; from model.weights import load_model; load_model(sys.argv[1])"
    probe += "; print('torch._dynamo' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe, str(good)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False"]
    model = load_model(good)
    assert torch.equal(model.embed_tokens.weight, TensorIndex(good).get("model.embed_tokens.weight").float())
    assert not model.embed_tokens.weight.requires_grad
