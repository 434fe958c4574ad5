"""The reference forward in bf16 against transformers' qwen4_exp in bf16: the causal convs and the routed experts'
sum add in fp32 and round once, as transformers does (the fp32 comparisons are in test_oracle.py)."""

from __future__ import annotations

import torch
from make_checkpoint import hf_model, make_checkpoint

from model.flashnext import single_lane_batch
from model.ops import causal_conv
from model.weights import load_model
from tests.tiny import text_config, ties_to_lower_index


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp32."""
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def hf_bf16(text: dict):
    """transformers' model in bf16 as `from_pretrained(dtype=torch.bfloat16)` gives it: the rotary inv_freq stays
    fp32 (it is made with an explicit float dtype), which `.to(torch.bfloat16)` alone would cast."""
    hf = hf_model(text).to(torch.bfloat16)
    rotary = hf.model.rotary_emb
    rotary.inv_freq = rotary.compute_default_rope_parameters(hf.config)[0]
    return hf


def ours_bf16(tmp_path, text: dict):
    """The reference forward of the same weights, stored and computed in bf16."""
    return load_model(make_checkpoint(text, tmp_path / "m", fmt="bf16", with_mtp=False), dtype="bfloat16")


def test_bf16_causal_conv_rounds_once_like_transformers():
    """A bf16 causal conv (GDN and PLE) sums its taps in fp32 and rounds once, as transformers' conv1d does."""
    from transformers.models.qwen4_exp.modeling_qwen4_exp import causal_conv1d_fn

    gen = torch.Generator().manual_seed(0)
    seq, channels, kernel = 20, 64, 4
    x = torch.randn(seq, channels, generator=gen).bfloat16()
    weight = (torch.randn(channels, 1, kernel, generator=gen) * 0.5).bfloat16()
    ours, _ = causal_conv(x, torch.zeros(kernel - 1, channels, dtype=torch.bfloat16), weight)
    oracle = causal_conv1d_fn(x.T[None], weight.squeeze(1))[0].T
    mismatched = (ours != oracle).float().mean().item()
    assert mismatched == 0.0, f"{mismatched:.0%} of the bf16 conv outputs differ from transformers'"


def test_bf16_gdn_and_ple_layers_match_transformers(tmp_path):
    """In bf16 the reference's GDN layer and PLE layer give transformers' values (conv summed in fp32)."""
    text = text_config("base")
    hf, ours = hf_bf16(text), ours_bf16(tmp_path, text)
    seq, cfg = 29, ours.cfg
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(seq, cfg.hidden_size, generator=gen).bfloat16()
    wide = torch.randn(seq, cfg.wide_size, generator=gen).bfloat16()
    ids = torch.randint(6, cfg.vocab_size, (seq,), generator=gen)
    with torch.no_grad():
        gdn = ours.layers[0].linear_attn
        tail, state = gdn.new_state(torch.bfloat16, torch.device("cpu"))
        got_gdn = gdn(x, tail, state)[0]
        want_gdn = hf.model.layers[0].linear_attn(x[None])[0]
        lane = ours.new_lane()
        got_ple, _ = ours.layers[0].ple(wide, lane.ngram_history, ids, lane.ple_conv[0])
        want_ple = hf.model.layers[0].ple(wide[None], ids[None], None)[0]
    assert relative_error(got_gdn, want_gdn) <= 1e-3
    assert relative_error(got_ple, want_ple) <= 1e-3


def test_bf16_moe_sums_ten_experts_like_transformers(tmp_path):
    """In bf16 the routed experts' weighted outputs (top 10, as the real model) are summed in fp32 and rounded
    once, as transformers does, not rounded to bf16 after every expert."""
    text = text_config("no-ple", num_experts=16, num_experts_per_tok=10)
    hf, ours = hf_bf16(text), ours_bf16(tmp_path, text)
    x = torch.randn(16, ours.cfg.hidden_size, generator=torch.Generator().manual_seed(1)).bfloat16()
    with torch.no_grad():
        want = hf.model.layers[0].mlp(x[None])[0]
        got = torch.cat([ours.layers[0].mlp(x[t : t + 1]) for t in range(x.shape[0])])  # the reference's row by row
    mismatched = (got != want).float().mean().item()
    assert mismatched <= 0.01, f"{mismatched:.0%} of the bf16 MoE outputs differ from transformers'"


def test_bf16_whole_prompt_logits_match_transformers(tmp_path):
    """A bf16 reference forward over a prompt past the QSA budget gives transformers' bf16 logits and greedy tokens."""
    text = text_config("base", num_experts_per_tok=3)
    hf, ours = hf_bf16(text), ours_bf16(tmp_path, text)
    cfg = ours.cfg
    ids = torch.randint(6, cfg.vocab_size, (3 * cfg.indexer_budget + 5,), generator=torch.Generator().manual_seed(3))
    ids[len(ids) // 3] = cfg.eos_token_id
    with torch.no_grad(), ties_to_lower_index():
        want = hf(ids[None]).logits[0].float()
    got = ours(single_lane_batch(ours.new_lane(), ids, 0)).logits.float()
    assert relative_error(got, want) <= 1e-2
    assert torch.equal(got.argmax(-1), want.argmax(-1))
