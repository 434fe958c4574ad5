"""The MTP layer against its description (model.md §4.9), with transformers' decoder layer as the layer oracle."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from make_checkpoint import hf_model as make_hf_model
from make_checkpoint import hf_text_config

from model.flashnext import single_lane_batch
from model.layers import ForwardBatch, Segment
from model.weights import TensorIndex, load_model
from tests.tiny import checkpoint, text_config, ties_to_lower_index

PROMPT = torch.tensor([7, 19, 5, 33, 2, 91, 5, 44, 8, 13, 21, 60, 17, 3, 99, 12, 40, 41, 42, 5, 6, 70, 71])


def zc_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + weight)


def oracle_mtp_logits(path, hidden: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
    """MTP logits for rows (wide state of t, token t+1) at positions 0..T-1, from the checkpoint's tensors."""
    text = text_config()
    index = TensorIndex(path)
    t = {name: index.get(name).float() for name in index.files}
    layer_cfg = {k: v for k, v in text.items() if k not in ("layer_types", "ple_layer_ids")}
    layer_cfg.update(num_hidden_layers=1, full_attention_interval=1)
    donor = make_hf_model(layer_cfg, seed=0)
    state = {f"model.{n[len('mtp.') :]}": v for n, v in t.items() if n.startswith(("mtp.layers.", "mtp.hyper"))}
    missing, unexpected = donor.load_state_dict(state, strict=False)
    assert not unexpected and all(
        m.startswith(("model.embed_tokens", "lm_head", "model.layers.0.ple")) for m in missing
    )
    d, hc = text["hidden_size"], text["hc_count"]
    u = F.linear(
        zc_norm(t["model.embed_tokens.weight"][next_tokens], t["mtp.pre_fc_norm_embedding.weight"]),
        t["mtp.fc_embedding.weight"],
    )
    streams = zc_norm(hidden, t["mtp.pre_fc_norm_hidden.weight"]).unflatten(-1, (hc, d))  # one RMS over all streams
    wide = (F.linear(streams, t["mtp.fc_hidden.weight"]) + u[:, None, :]).flatten(-2)[None]
    seq = wide.shape[1]
    cos_sin = donor.model.rotary_emb(wide, torch.arange(seq)[None])
    mask = torch.full((seq, seq), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.no_grad(), ties_to_lower_index():
        out = donor.model.layers[0](wide, position_embeddings=cos_sin, attention_mask=mask, conv_mask=None, cache=None)
        mixed = donor.model.hyper_connection_mixer(out)
    return F.linear(mixed[0], t["lm_head.weight"])


def mtp_rows(lane, tokens: torch.Tensor, start: int) -> ForwardBatch:
    return ForwardBatch(tokens, torch.arange(start, start + tokens.shape[0]), [Segment(lane, 0, tokens.shape[0])])


def test_mtp_logits_match_the_layer_oracle(tmp_path):
    path = checkpoint(tmp_path / "m")
    ours = load_model(path, dtype="float32")
    assert hf_text_config(text_config()).indexer_budget < PROMPT.shape[0]  # sparse selection in the MTP layer too
    lane = ours.new_lane()
    hidden = ours(single_lane_batch(lane, PROMPT, 0)).hidden
    got, _ = ours.mtp_forward(mtp_rows(lane, PROMPT[1:], 0), hidden[:-1])
    expected = oracle_mtp_logits(path, hidden[:-1], PROMPT[1:])
    assert ((got - expected).norm() / expected.norm()).item() <= 1e-5
    assert lane.mtp_length == PROMPT.shape[0] - 1


def test_mtp_rows_in_chunks_and_rewrites_equal_one_pass(tmp_path):
    ours = load_model(checkpoint(tmp_path / "m"), dtype="float32")
    lane = ours.new_lane()
    hidden = ours(single_lane_batch(lane, PROMPT, 0)).hidden[:-1]
    tokens = PROMPT[1:]
    whole, whole_wide = ours.mtp_forward(mtp_rows(ours.new_lane(), tokens, 0), hidden)
    split = ours.new_lane()
    first, _ = ours.mtp_forward(mtp_rows(split, tokens[:9], 0), hidden[:9])
    # a chained draft writes at positions 9 and 10, then is rejected and rewritten by the real rows
    ours.mtp_forward(mtp_rows(split, torch.tensor([1, 2]), 9), whole_wide[8:10])
    second, _ = ours.mtp_forward(mtp_rows(split, tokens[9:], 9), hidden[9:])
    assert torch.equal(torch.cat((first, second)), whole)
    picked, picked_wide = ours.mtp_forward(mtp_rows(ours.new_lane(), tokens, 0), hidden, torch.tensor([5, 0]))
    assert torch.equal(picked, whole[[5, 0]]) and torch.equal(picked_wide, whole_wide)
