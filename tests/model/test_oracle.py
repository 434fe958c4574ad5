"""The reference forward against transformers' Qwen4ExpForCausalLM on tiny random models (fp32)."""

from __future__ import annotations

import pytest
import torch

from model.flashnext import single_lane_batch
from model.layers import ForwardBatch, Segment
from model.weights import load_model
from tests.tiny import VARIANTS, checkpoint, hf_model, ties_to_lower_index


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def prompt(length: int, vocab: int, eos: int, seed: int = 3) -> torch.Tensor:
    ids = torch.randint(6, vocab, (length,), generator=torch.Generator().manual_seed(seed))
    ids[length // 3] = eos  # an EOS inside the prompt resets the n-gram context
    ids[length // 2] = eos
    return ids


@pytest.mark.parametrize("variant", VARIANTS)
def test_whole_prompt_logits_match_transformers(variant, tmp_path):
    hf = hf_model(variant)
    ours = load_model(checkpoint(tmp_path / variant, variant), dtype="float32")
    cfg = ours.cfg
    length = 3 * cfg.indexer_budget + 5  # well past the budget: sparse selection happens
    ids = prompt(length, cfg.vocab_size, cfg.eos_token_id)
    with torch.no_grad(), ties_to_lower_index():
        expected = hf(ids[None]).logits[0]
    got = ours(single_lane_batch(ours.new_lane(), ids, 0)).logits
    assert relative_error(got, expected) <= 1e-5


@pytest.mark.parametrize("chunks", [[1] * 29, [5, 1, 7, 16], [2, 3, 24], [28, 1]])
def test_incremental_chunks_match_whole_prompt(chunks, tmp_path):
    ours = load_model(checkpoint(tmp_path / "m"), dtype="float32")
    ids = prompt(sum(chunks), ours.cfg.vocab_size, ours.cfg.eos_token_id)
    whole = ours(single_lane_batch(ours.new_lane(), ids, 0)).logits
    lane, start, pieces = ours.new_lane(), 0, []
    for size in chunks:
        pieces.append(ours(single_lane_batch(lane, ids[start : start + size], start)).logits)
        start += size
    assert lane.length == sum(chunks)
    assert torch.equal(torch.cat(pieces), whole)  # bit for bit, stronger than the 1e-5 asked


def test_two_lanes_in_one_batch_equal_each_alone(tmp_path):
    ours = load_model(checkpoint(tmp_path / "m"), dtype="float32")
    a = prompt(13, ours.cfg.vocab_size, ours.cfg.eos_token_id, seed=1)
    b = prompt(21, ours.cfg.vocab_size, ours.cfg.eos_token_id, seed=2)
    alone_a = ours(single_lane_batch(ours.new_lane(), a, 0)).logits
    alone_b = ours(single_lane_batch(ours.new_lane(), b, 0)).logits
    lane_a, lane_b = ours.new_lane(), ours.new_lane()
    batch = ForwardBatch(
        token_ids=torch.cat((a, b)),
        positions=torch.cat((torch.arange(13), torch.arange(21))),
        segments=[Segment(lane_a, 0, 13), Segment(lane_b, 13, 21)],
    )
    both = ours(batch).logits
    assert torch.equal(both[:13], alone_a) and torch.equal(both[13:], alone_b)


def test_a_segment_must_continue_its_lane(tmp_path):
    ours = load_model(checkpoint(tmp_path / "m"), dtype="float32")
    lane = ours.new_lane()
    ours(single_lane_batch(lane, torch.tensor([7, 8, 9]), 0))
    with pytest.raises(ValueError, match="starts at position 5 but its lane holds 3 tokens"):
        ours(single_lane_batch(lane, torch.tensor([10]), 5))


def test_a_prompt_chunk_without_logit_rows_gives_no_logits(tmp_path):
    ours = load_model(checkpoint(tmp_path / "m"), dtype="float32")
    lane = ours.new_lane()
    out = ours(single_lane_batch(lane, torch.tensor([7, 8, 9]), 0), logit_rows=torch.tensor([], dtype=torch.long))
    assert out.logits.shape == (0, ours.cfg.vocab_size) and lane.length == 3
