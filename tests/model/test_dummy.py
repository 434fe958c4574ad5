"""`--load-format dummy`: random weights of the config's shapes and formats, the same replicated bits on every rank."""

from __future__ import annotations

import json

import torch

from model.config import parse_config
from model.dummy import fill_dummy, size_refusal
from model.flashnext import single_lane_batch
from model.parallel import TensorParallel
from model.weights import load_model
from tests.tiny import text_config


def test_dummy_weights_have_the_released_formats_and_give_finite_logits(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(text_config()))
    model = load_model(tmp_path, dtype="float32", load_format="dummy")
    bank = model.layers[0].mlp.experts.nvfp4
    assert bank["gate_up_packed"].dtype == torch.uint8 and bank["down_scale"].dtype == torch.float8_e4m3fn
    assert model.layers[0].ple.ple_embedding.ngram_embedding.weight.dtype == torch.float8_e4m3fn
    logits = model(single_lane_batch(model.new_lane(), torch.tensor([7, 8, 9, 5, 11]), 0)).logits
    assert torch.isfinite(logits).all() and logits.std() > 0
    again = load_model(tmp_path, dtype="float32", load_format="dummy")
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)  # seeded: every load makes the same weights


def test_ranks_make_the_same_replicated_weights_and_their_own_shards(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(text_config()))
    ranks = [load_model(tmp_path, dtype="float32", tp=TensorParallel(r, 2), load_format="dummy") for r in (0, 1)]
    replicated = (
        "embed_tokens.weight",
        "layers.0.mlp.gate.weight",
        "hyper_connection_mixer.input_mix_weight_up.weight",
    )
    for name in replicated:
        assert torch.equal(ranks[0].get_parameter(name), ranks[1].get_parameter(name))
    full = load_model(tmp_path, dtype="float32", load_format="dummy")
    assert ranks[0].lm_head.weight.shape[0] * 2 == full.lm_head.weight.shape[0]


def test_no_dense_copy_of_the_experts_or_the_table_is_drawn(tmp_path, monkeypatch):
    import model.dummy as dummy

    config = text_config() | {"ngram_vocab_size_base": 20011, "num_experts": 64}  # table and experts the largest
    (tmp_path / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(dummy, "TABLE_CHUNK_ROWS", 1024)
    largest = {"draw": 0}
    randn = torch.randn

    def recording_randn(*shape, **kwargs):
        out = randn(*shape, **kwargs)
        largest["draw"] = max(largest["draw"], out.numel())
        return out

    monkeypatch.setattr(dummy.torch, "randn", recording_randn)
    model = load_model(tmp_path, dtype="float32", load_format="dummy")
    table = next(layer.ple for layer in model.layers if layer.ple is not None).ple_embedding.ngram_embedding.weight
    dense_experts = model.layers[0].mlp.experts.nvfp4["gate_up_packed"].numel() * 2  # two FP4 codes a byte
    assert table.dtype == torch.float8_e4m3fn and torch.isfinite(table.float()).all() and table.float().std() > 0
    assert largest["draw"] <= max(1024 * table.shape[1], model.lm_head.weight.numel())
    assert largest["draw"] < min(table.numel(), dense_experts) / 4


def test_loading_leaves_experts_and_table_unallocated_until_they_are_filled(tmp_path, monkeypatch):
    import model.weights as weights
    from model.moe import ExpertBank
    from model.ple import NGramTable

    (tmp_path / "config.json").write_text(json.dumps(text_config()))
    seen = []

    def inspecting_fill(model, *args, **kwargs):
        for module in model.modules():
            if isinstance(module, (ExpertBank, NGramTable)):
                seen.extend(p.is_meta for p in module.parameters(recurse=False))
        return fill_dummy(model, *args, **kwargs)

    monkeypatch.setattr(weights, "fill_dummy", inspecting_fill)
    model = load_model(tmp_path, dtype="float32", load_format="dummy")
    assert seen and all(seen)  # a dense real-shape copy of these would not fit on a GPU
    assert not any(p.is_meta for p in model.parameters())


def test_dummy_weights_past_the_machines_memory_are_refused_naming_the_setting(monkeypatch):
    """A rank's share of the weights at 4 bits each, at the least, against the machine's memory: refused above it
    (a config that overflowed a size or had millions of layers ended in a traceback or a hang), halved at --tp 2."""
    import model.dummy

    cfg = parse_config(text_config())
    need = sum(cfg.parameter_counts().values()) // 2
    cpu = torch.device("cpu")
    monkeypatch.setattr(model.dummy, "machine_memory_bytes", lambda device: need)
    assert size_refusal(cfg, 1, cpu) is None
    monkeypatch.setattr(model.dummy, "machine_memory_bytes", lambda device: need - 1)
    refusal = size_refusal(cfg, 1, cpu)
    assert refusal is not None and refusal.startswith("--load-format dummy: ") and "--tp 1" in refusal
    assert size_refusal(cfg, 2, cpu) is None
    monkeypatch.undo()
    assert size_refusal(cfg, 1, cpu) is None  # the tiny model fits this machine
    huge = parse_config(text_config(hc_count=10**9))  # its streams overflowed a storage size
    assert size_refusal(huge, 2, cpu) is not None
