"""Tensor parallel 2 on CPU (gloo): each rank holds half the weights; both ranks end with identical bits."""

from __future__ import annotations

import hashlib
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from model.config import load_config
from model.flashnext import single_lane_batch
from model.layers import ForwardBatch, Segment
from model.parallel import TensorParallel
from model.weights import load_model
from server.ranks import free_port
from tests.tiny import checkpoint, hf_model, ties_to_lower_index

PROMPT = torch.tensor([7, 19, 5, 33, 2, 91, 5, 44, 8, 13, 21, 60, 17, 3, 99, 12, 40, 41, 42, 5, 6, 70])
EDGES = ([1e8, 1.0, -1e8, 3.0], [1.0, 1e8, 1.0, -3e-8])  # per rank: sums that lose the small term, or cancel


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def rank_main(rank: int, port: int, path: str, steps: int, results) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    try:
        model = load_model(path, dtype="float32", tp=TensorParallel(rank, 2))
        lane = model.new_lane()
        out = model(single_lane_batch(lane, PROMPT, 0))
        tokens, last = [], out.logits[-1]
        for _ in range(steps):
            tokens.append(int(last.argmax()))
            last = model(single_lane_batch(lane, torch.tensor(tokens[-1:]), lane.length)).logits[0]
        mtp, _ = model.mtp_forward(
            ForwardBatch(PROMPT[1:], torch.arange(len(PROMPT) - 1), [Segment(lane, 0, len(PROMPT) - 1)]),
            out.hidden[:-1],
        )
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        results[rank] = (digest(out.hidden), digest(out.logits), digest(mtp), tokens, out.logits, shapes)
    finally:
        dist.destroy_process_group()


def run_two_ranks(path: str, steps: int) -> dict:
    results = mp.Manager().dict()
    mp.start_processes(rank_main, args=(free_port(), path, steps, results), nprocs=2, start_method="spawn")
    return dict(results)


@pytest.mark.parametrize("variant", ["base", "gqa12-hc4"])
def test_two_ranks_hold_identical_bits_and_match_transformers(variant, tmp_path):
    path = checkpoint(tmp_path / variant, variant, fmt="nvfp4" if variant == "base" else "fp32")
    results = run_two_ranks(str(path), 12)
    (h0, l0, m0, t0, logits, shapes0), (h1, l1, m1, t1, _, shapes1) = results[0], results[1]
    assert (h0, l0, m0, t0) == (h1, l1, m1, t1)  # hidden states, logits and MTP logits: the same bits on both
    whole = load_model(path, dtype="float32")
    expected_logits = whole(single_lane_batch(whole.new_lane(), PROMPT, 0)).logits
    assert ((logits - expected_logits).norm() / expected_logits.norm()).item() <= 1e-5
    hf = hf_model(variant) if variant != "base" else None
    if hf is not None:
        with torch.no_grad(), ties_to_lower_index():
            expected = hf.generate(PROMPT[None], max_new_tokens=12, min_new_tokens=12, do_sample=False)
        assert t0 == expected[0, len(PROMPT) :].tolist()
    full = {n: tuple(p.shape) for n, p in whole.named_parameters()}
    assert shapes0["lm_head.weight"][0] * 2 == full["lm_head.weight"][0]
    assert (
        shapes0["layers.0.linear_attn.in_proj_qkv.weight"][0] * 2 == full["layers.0.linear_attn.in_proj_qkv.weight"][0]
    )
    table = (
        "layers.0.ple.ple_embedding.ngram_embedding.weight"
        if variant == "base"
        else "layers.1.ple.ple_embedding.ngram_embedding.weight"
    )
    assert shapes0[table][0] + shapes1[table][0] <= full[table][0]  # each rank holds only its heads' rows
    assert {n: s for n, s in shapes0.items() if n != table} == {n: s for n, s in shapes1.items() if n != table}


def count_rank_main(rank: int, port: int, path: str, results) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    try:
        tp = TensorParallel(rank, 2)
        model = load_model(path, dtype="bfloat16", tp=tp)
        before = (dict(tp.counts.calls), dict(tp.counts.bytes))
        model(single_lane_batch(model.new_lane(), PROMPT[:1], 0))
        results[rank] = (before, dict(tp.counts.calls), dict(tp.counts.bytes))
    finally:
        dist.destroy_process_group()


def test_one_row_counts_a_combine_after_every_mixer_and_moe_on_both_ranks(tmp_path):
    path = checkpoint(tmp_path / "base", "base")
    results = mp.Manager().dict()
    mp.start_processes(count_rank_main, args=(free_port(), str(path), results), nprocs=2, start_method="spawn")
    cfg = load_config(path)
    (before, calls, sent), other = results[0], results[1]
    assert (before, calls, sent) == other  # both ranks count the same collectives
    assert before == ({"combine": 0, "gather": 0}, {"combine": 0, "gather": 0})
    assert calls["combine"] == 2 * cfg.num_hidden_layers  # one after the mixer, one after the MoE, per layer
    assert sent["combine"] == calls["combine"] * cfg.hidden_size * 4  # bf16 model, fp32 partials, one peer
    assert calls["gather"] == len(cfg.ple_layers) + 1  # each PLE layer's n-gram heads, then the logits


def exact_rank_main(rank: int, port: int, results) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    try:
        tp, out = TensorParallel(rank, 2), {}
        for dtype in (torch.float32, torch.bfloat16):
            for rows, width in ((1, 2560), (7, 33), (64, 256)):
                gen = torch.Generator().manual_seed(1000 * rank + rows)
                scale = 10.0 ** torch.randint(-8, 9, (rows, width), generator=gen)  # magnitudes 1e-8 to 1e8
                partial = (torch.randn(rows, width, generator=gen) * scale).to(dtype)
                partial[0, :4] = torch.tensor(EDGES[rank])
                kept = partial.clone()
                fast, ordered = tp.combine(partial), tp.combine_ordered(partial)
                both = [torch.empty_like(partial, dtype=torch.float32) for _ in range(2)]
                dist.all_gather(both, partial.float())
                rounded = int(((both[0] + both[1]).double() != both[0].double() + both[1].double()).sum())
                out[f"{dtype}-{rows}x{width}"] = (
                    digest(fast),
                    digest(ordered),
                    fast.dtype == dtype,
                    torch.equal(partial.view(torch.uint8), kept.view(torch.uint8)),
                    rounded,
                )
        results[rank] = out
    finally:
        dist.destroy_process_group()


def reduce_rank_main(rank: int, port: int, results) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    try:
        tp = TensorParallel(rank, 2)
        gen = torch.Generator().manual_seed(rank)
        partial = (torch.randn(7, 33, generator=gen) * 1e4).to(torch.bfloat16)
        wide = partial.float()  # the bf16 values in fp32, as the kernels store a partial for the reduction
        total = tp.reduce(wide)
        into = torch.full((9, 66), float("nan"))
        gathered = tp.gather(wide, out=into[:7])  # a graph's shared logits buffer
        results[rank] = (
            digest(total),
            digest(gathered),
            torch.equal(gathered, tp.gather(wide)) and gathered.data_ptr() == into.data_ptr(),
            total.data_ptr() == wide.data_ptr(),  # summed in place, no copy
            total.dtype == torch.float32,
            torch.equal(total.to(torch.bfloat16), tp.combine(partial)),  # rounded once by the consumer: combine's
            torch.equal(tp.reduce(partial).to(torch.bfloat16), tp.combine(partial)),  # a bf16 partial is upcast
            tp.counts.calls["combine"],
        )
    finally:
        dist.destroy_process_group()


def test_reduce_sums_fp32_partials_in_place_and_leaves_the_rounding_to_the_consumer():
    results = mp.Manager().dict()
    mp.start_processes(reduce_rank_main, args=(free_port(), results), nprocs=2, start_method="spawn")
    assert results[0] == results[1]
    _, _, gathered_into, in_place, fp32, rounds_like_combine, upcasts, calls = results[0]
    assert gathered_into and in_place and fp32 and rounds_like_combine and upcasts
    assert calls == 4  # every reduce and combine counts
    partial = torch.ones(2, 3, dtype=torch.bfloat16)
    assert TensorParallel().reduce(partial) is partial  # one rank
    into = torch.zeros(3, 3, dtype=torch.bfloat16)
    gathered = TensorParallel().gather(partial, out=into[:2])
    assert gathered.data_ptr() == into.data_ptr() and torch.equal(into[:2], partial)


def test_world_two_all_reduce_gives_the_ordered_sums_bits_on_both_ranks():
    results = mp.Manager().dict()
    mp.start_processes(exact_rank_main, args=(free_port(), results), nprocs=2, start_method="spawn")
    assert results[0] == results[1]  # both ranks end with the same bits
    for case, (fast, ordered, same_dtype, untouched, rounded) in results[0].items():
        assert fast == ordered, case  # all_reduce equals gather + sum in rank order, bit for bit
        assert same_dtype and untouched, case  # rounded once to the input dtype; the caller's partial is kept
        assert rounded > 0, case  # the fp32 sums round: the inputs do exercise the addition's rounding
