"""Write a tiny Flash Next checkpoint: transformers-initialised trunk weights plus an MTP layer, BF16/FP32 or NVFP4.

python scripts/make_checkpoint.py configs/tiny/base.json OUT --format nvfp4 --tokenizer
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

from quantize_nvfp4 import convert_checkpoint
from tiny_tokenizer import build_tokenizer

HF_ONLY_KEYS = ("model_type", "mtp_num_hidden_layers")


def hf_text_config(text: dict[str, Any]):
    """transformers' Qwen4ExpTextConfig for one of our text config dicts."""
    from transformers import Qwen4ExpTextConfig

    return Qwen4ExpTextConfig(**{k: v for k, v in text.items() if k not in HF_ONLY_KEYS})


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Give every parameter a random value, norms and the PLE conv included (transformers zeroes those)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            if name.endswith("A_log"):
                param.copy_(torch.rand(param.shape, generator=gen) * 3.0 - 2.0)
            elif "norm" in name or name.endswith("dt_bias"):
                param.add_(noise * 0.2)
            elif name.endswith("ple.conv1d.weight"):
                param.copy_(noise * 0.3)
            else:
                param.copy_(noise * 0.15)


def hf_model(text: dict[str, Any], seed: int = 0):
    """A transformers Qwen4ExpForCausalLM with random weights, fp32, eager attention (the test oracle)."""
    from transformers import Qwen4ExpForCausalLM

    torch.manual_seed(seed)
    model = Qwen4ExpForCausalLM(hf_text_config(text)).float().eval()
    model.config._attn_implementation = "eager"
    randomize(model, seed + 1)
    return model


def mtp_tensors(text: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """Random MTP weights: fc/norms, one QSA+MoE layer and a mixer, named as the released checkpoints name them."""
    one_layer = {k: v for k, v in text.items() if k not in ("layer_types", "ple_layer_ids")}
    one_layer.update(num_hidden_layers=1, full_attention_interval=1)
    donor = hf_model(one_layer, seed)
    tensors = {}
    for name, tensor in donor.model.state_dict().items():
        if name.startswith("layers.0.") or name.startswith("hyper_connection_mixer."):
            tensors[f"mtp.{name}"] = tensor
    d, wide = text["hidden_size"], text["hidden_size"] * text["hc_count"]
    gen = torch.Generator().manual_seed(seed + 7)
    tensors["mtp.fc_embedding.weight"] = torch.randn(d, d, generator=gen) * 0.15
    tensors["mtp.fc_hidden.weight"] = torch.randn(d, d, generator=gen) * 0.15
    tensors["mtp.pre_fc_norm_embedding.weight"] = torch.randn(d, generator=gen) * 0.2
    tensors["mtp.pre_fc_norm_hidden.weight"] = torch.randn(wide, generator=gen) * 0.2
    return tensors


def write_safetensors(tensors: dict[str, torch.Tensor], out: Path, shards: int) -> None:
    """One file, or `shards` files with a model.safetensors.index.json."""
    names = sorted(tensors)
    if shards <= 1:
        save_file({n: tensors[n].contiguous() for n in names}, out / "model.safetensors")
        return
    weight_map, per = {}, -(-len(names) // shards)
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i * per : (i + 1) * per]
        save_file({n: tensors[n].contiguous() for n in part}, out / file)
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_generation_config(out: Path, specials: dict[str, int]) -> None:
    """generation_config.json: stop at <|im_end|> (a chat turn's end) and at <|endoftext|> (a document's end)."""
    eos = [specials[t] for t in ("<|im_end|>", "<|endoftext|>") if t in specials]
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "pad_token_id": None}, indent=2))


def make_checkpoint(
    text: dict[str, Any],
    out: Path,
    *,
    fmt: str = "bf16",
    layout: str = "text",
    seed: int = 0,
    with_mtp: bool = True,
    tokenizer: bool = False,
    shards: int = 1,
) -> Path:
    """Write a checkpoint folder; `fmt` is bf16, fp32 or nvfp4 (always the released layout)."""
    text = dict(text)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer:
        specials = build_tokenizer(out, text["vocab_size"])
        text["eos_token_id"] = specials["<|endoftext|>"]
        write_generation_config(out, specials)
    if fmt == "nvfp4":
        with tempfile.TemporaryDirectory() as tmp:
            src = make_checkpoint(text, Path(tmp), fmt="bf16", seed=seed, with_mtp=with_mtp)
            convert_checkpoint(src, out, shards=max(shards, 2))
        return out
    if fmt not in ("bf16", "fp32"):
        raise ValueError(f"--format: unknown value {fmt!r}; expected bf16, fp32 or nvfp4")
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
    model = hf_model(text, seed)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        with safe_open(Path(tmp) / "model.safetensors", "pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    if with_mtp:
        tensors.update(mtp_tensors(text, seed + 100))
    tensors = {n: t.to(dtype) if t.is_floating_point() else t for n, t in tensors.items()}
    config: dict[str, Any] = {**text, "dtype": "bfloat16" if fmt == "bf16" else "float32"}
    config["mtp_num_hidden_layers"] = 1 if with_mtp else 0
    config.setdefault("model_type", "qwen4_exp_text")
    if layout == "released":
        tensors = {_released_name(n): t for n, t in tensors.items()}
        config = {
            "architectures": ["Qwen4ExpForConditionalGeneration"],
            "model_type": "qwen4_exp",
            "text_config": config,
            "tie_word_embeddings": False,
        }
    elif layout == "text":
        config["architectures"] = ["Qwen4ExpForCausalLM"]
    else:
        raise ValueError(f"--layout: unknown value {layout!r}; expected text or released")
    write_safetensors(tensors, out, shards)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _released_name(name: str) -> str:
    if name.startswith("model."):
        return "model.language_model." + name[len("model.") :]
    return name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", type=Path, help="a text config JSON (configs/tiny/*.json)")
    parser.add_argument("out", type=Path, help="the checkpoint folder to write")
    parser.add_argument("--format", default="bf16", choices=("bf16", "fp32", "nvfp4"), help="weights (default bf16)")
    parser.add_argument("--layout", default="text", choices=("text", "released"), help="key layout (default text)")
    parser.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    parser.add_argument("--shards", type=int, default=1, help="safetensors files (default 1; nvfp4 writes >= 2)")
    parser.add_argument("--no-mtp", action="store_true", help="leave out the MTP layer")
    parser.add_argument("--tokenizer", action="store_true", help="write a byte-level BPE tokenizer and chat template")
    args = parser.parse_args()
    if args.out.exists():
        shutil.rmtree(args.out)
    text = json.loads(args.config.read_text())
    make_checkpoint(
        text,
        args.out,
        fmt=args.format,
        layout=args.layout,
        seed=args.seed,
        with_mtp=not args.no_mtp,
        tokenizer=args.tokenizer,
        shards=args.shards,
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
