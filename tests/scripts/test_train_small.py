"""Tests for scripts/train_small.py: it learns, and what it saves is the model our reference forward serves."""

from __future__ import annotations

import array
import json
import random
from pathlib import Path

import pytest
import torch
import train_small
from make_checkpoint import hf_model, hf_text_config
from tiny_tokenizer import build_tokenizer
from transformers import Qwen4ExpForCausalLM

from model.flashnext import single_lane_batch
from model.layers import ForwardBatch, Segment
from model.parallel import TensorParallel
from model.weights import load_model
from tests.tiny import ties_to_lower_index

VOCAB = 320
CYCLE = 24  # the corpus repeats one random cycle of this many tokens: token t fixes t+1 and t+2
MICRO = {
    "model_type": "qwen4_exp_text",
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "full_attention_interval": 2,
    "hc_count": 4,
    "hc_lowrank": 8,
    "ple_layer_ids": [1],
    "heads_per_ngram": 4,
    "ngram_vocab_size_base": 101,
    "split_ngram_parts": 4,
    "indexer_n_heads": 2,
    "indexer_kv_heads": 1,
    "indexer_head_dim": 16,
    "indexer_budget": 8,
    "indexer_compress_ratio": 4,
    "output_gate_type": "sigmoid",
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    "max_position_embeddings": 1024,
    "mtp_num_hidden_layers": 1,
}


def write_bin(path: Path, ids: list[int]) -> None:
    path.write_bytes(array.array("H", ids).tobytes())


def make_data(folder: Path) -> dict:
    """Tokenizer, manifest, repetitive bins (runs of one cycle, each ended by eos) and the micro config."""
    specials = build_tokenizer(folder / "tokenizer", VOCAB)
    eos = specials["<|endoftext|>"]
    rng = random.Random(0)
    cycle = rng.sample(range(VOCAB - 32), CYCLE)
    for name, size in (("train", 40_000), ("eval_code", 6_000), ("eval_chat", 6_000)):
        ids: list[int] = []
        while len(ids) < size:
            first, length = rng.randrange(CYCLE), rng.randrange(20, 60)
            ids += [cycle[(first + i) % CYCLE] for i in range(length)] + [eos]
        write_bin(folder / f"{name}.bin", ids)
    (folder / "manifest.json").write_text(json.dumps({"vocab_size": VOCAB, "eos_token_id": eos}))
    text = {**MICRO, "eos_token_id": eos}
    (folder / "micro.json").write_text(json.dumps(text))
    return text


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One 30-step training run of the micro config: (model rounded to the saved BF16 values, report, out, data)."""
    data = tmp_path_factory.mktemp("data")
    make_data(data)
    out = tmp_path_factory.mktemp("run")
    args = ["--data", str(data), "--config", str(data / "micro.json"), "--out", str(out), "--device", "cpu"]
    args += ["--steps", "30", "--seq", "64", "--batch", "8", "--lr", "5e-3"]
    model, report = train_small.run(train_small.parse_args(args))
    return model.to(torch.bfloat16).float().eval(), report, out, data


def eval_prompt(data: Path, length: int) -> torch.Tensor:
    return train_small.read_tokens(data / "eval_chat.bin")[:length].long()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_training_lowers_the_trunk_and_mtp_losses(trained):
    _, report, out, _ = trained
    first = report["loss_curve"][0]
    assert report["steps"] == 30 and report["loss_curve"][-1]["step"] == 30
    for split in ("code", "chat"):
        figures = report["eval"][split]
        assert figures["trunk_loss"] < 0.5 * first["trunk_loss"]
        assert figures["mtp_loss"] < 0.5 * first["mtp_loss"]
        assert figures["trunk_accuracy"] > 0.8 and figures["mtp_accuracy"] > 0.8
    assert json.loads((out / "train_report.json").read_text())["eval"] == report["eval"]


def test_served_model_predicts_t1_and_mtp_predicts_t2(trained):
    _, _, out, data = trained
    ours = load_model(out / "bf16", dtype="float32")
    tokens = eval_prompt(data, 60)
    lane = ours.new_lane()
    forward = ours(single_lane_batch(lane, tokens[:-1], 0))
    rows = ForwardBatch(tokens[1:-1], torch.arange(58), [Segment(lane, 0, 58)])
    drafts, _ = ours.mtp_forward(rows, forward.hidden[:-1])
    assert (forward.logits.argmax(-1) == tokens[1:]).float().mean() > 0.8
    assert (drafts.argmax(-1) == tokens[2:]).float().mean() > 0.8


def test_served_model_equals_the_trained_trunk_and_mtp(trained):
    model, _, out, data = trained
    ours = load_model(out / "bf16", dtype="float32")
    tokens = eval_prompt(data, 41)
    assert tokens.shape[0] > MICRO["indexer_budget"] + 3  # the QSA layers select sparsely
    forward = ours(single_lane_batch(ours.new_lane(), tokens, 0))
    with torch.no_grad():
        trunk = model.trunk(input_ids=tokens[None], use_cache=False).logits[0]
        assert relative(model.pre_mixer[0], forward.hidden) < 1e-4
        hidden = forward.hidden[:-1]
        mtp = model.trunk.lm_head(model.mtp(hidden[None], model.trunk.model.embed_tokens(tokens[None, 1:])))[0]
    assert relative(forward.logits, trunk) < 1e-4
    rows = ForwardBatch(tokens[1:], torch.arange(40), [Segment(ours.new_lane(), 0, 40)])
    served, _ = ours.mtp_forward(rows, hidden)
    assert relative(served, mtp) < 1e-4


def test_vectorised_indexer_equals_transformers_loop():
    text = {**MICRO, "eos_token_id": VOCAB - 5}
    looped = hf_model(text, seed=3)
    looped.set_attn_implementation("sdpa")
    looped.set_experts_implementation("eager")
    vectorised = Qwen4ExpForCausalLM(hf_text_config(text)).eval()
    vectorised.load_state_dict(looped.state_dict())
    train_small.use_training_kernels(vectorised)
    tokens = torch.randint(0, VOCAB, (2, 37), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), ties_to_lower_index():
        expected = looped(input_ids=tokens, use_cache=False).logits
        got = vectorised(input_ids=tokens, use_cache=False).logits
    assert relative(got, expected) < 1e-5


def test_nvfp4_folder_loads_generates_and_splits_at_tp2(trained):
    _, report, out, data = trained
    folder = out / "nvfp4"
    assert sorted(report["nvfp4_files"]) == sorted(p.name for p in folder.iterdir())
    assert len(report["nvfp4_files"]) <= 8 and max(report["nvfp4_files"].values()) <= train_small.FILE_LIMIT
    quantized, bf16 = load_model(folder, dtype="float32"), load_model(out / "bf16", dtype="float32")
    prompt = eval_prompt(data, 30)
    lanes = quantized.new_lane(), bf16.new_lane()
    last = [m(single_lane_batch(lane, prompt, 0)).logits for m, lane in zip((quantized, bf16), lanes, strict=True)]
    print(f"NVFP4 vs BF16 prompt logits: relative difference {relative(last[0], last[1]):.4f}")
    assert relative(last[0], last[1]) < 0.3
    tokens = [int(last[0][-1].argmax())]
    for _ in range(7):
        logits = quantized(single_lane_batch(lanes[0], torch.tensor(tokens[-1:]), lanes[0].length)).logits
        tokens.append(int(logits[-1].argmax()))
    assert len(tokens) == 8 and all(0 <= t < VOCAB for t in tokens)
    for rank in (0, 1):
        assert load_model(folder, dtype="float32", tp=TensorParallel(rank, 2)).plan.local_heads == 2


def test_refuses_an_eos_that_is_not_the_data_s(tmp_path):
    text = make_data(tmp_path)
    with pytest.raises(ValueError, match="eos_token_id"):
        train_small.check_data(tmp_path, {**text, "eos_token_id": text["eos_token_id"] + 1})


def test_lr_schedule_warms_up_then_ends_at_its_floor():
    budget = train_small.Budget(steps=100, seconds=60.0)
    assert budget.progress(50, 10.0) == 0.5 and budget.progress(10, 45.0) == 0.75 and budget.progress(200, 0.0) == 1.0
    assert train_small.lr_scale(0.0) == 0.0 and train_small.lr_scale(train_small.WARMUP) == 1.0
    assert train_small.lr_scale(1.0) == pytest.approx(train_small.MIN_LR)
