"""On the kernel path a round draws every row's token in one batched call (`sample_rows`), and each equals the
token `sample_token` draws for that row alone (its logit bias added), greedy and sampled, inside verify windows too."""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import torch
from make_checkpoint import make_checkpoint

import kernels.sample
from model.weights import load_model
from rankwire.header import DrawSpec
from server.runner import ModelRunner
from server.sampling import sample_token
from tests.server import engine_harness
from tests.tiny import KERNEL_TEXT, text_config


def test_a_round_draws_once_and_every_row_equals_its_draw_alone(tmp_path, monkeypatch) -> None:
    model = load_model(
        make_checkpoint(text_config("base", **KERNEL_TEXT), tmp_path, fmt="bf16"), "cpu", "bfloat16", kernels="on"
    )
    batched, rows = [], []
    sample_rows, draw = kernels.sample.sample_rows, ModelRunner._draw

    def counted(logits: torch.Tensor, *columns: torch.Tensor) -> torch.Tensor:
        batched.append(logits.shape[0])
        return sample_rows(logits, *columns)

    def checked(self: ModelRunner, plan_rows, logits: torch.Tensor, drawn: torch.Tensor, penalties):
        tokens, refusals = draw(self, plan_rows, logits, drawn, penalties)
        keys = [(r.draw, r.start + len(r.token_ids) + i) for r in plan_rows if r.draw for i in range(len(r.drafts) + 1)]
        for i, ((s, position), token) in enumerate(zip(keys, tokens, strict=True)):
            row = logits[i].float().clone()
            for biased, bias in s.logit_bias:  # the request's logit bias, added in fp32
                row[biased] = row[biased] + torch.tensor(bias, dtype=torch.float32)
            alone = sample_token(row, s.temperature, s.top_k, s.top_p, s.min_p, s.seed, position)
            unbiased = sample_token(logits[i], s.temperature, s.top_k, s.top_p, s.min_p, s.seed, position)
            rows.append((s.temperature, token, alone, bool(s.logit_bias) and unbiased != token))
        return tokens, refusals

    monkeypatch.setattr(kernels.sample, "sample_rows", counted)
    monkeypatch.setattr(ModelRunner, "_draw", checked)
    draws = [
        DrawSpec(0.0, 0, 1.0, 0.0, 0),
        DrawSpec(0.9, 8, 0.9, 0.0, 1234),
        DrawSpec(0.0, 0, 1.0, 0.0, 5, ((9, 3.5), (40, -100.0))),
        DrawSpec(0.9, 0, 1.0, 0.0, 6, ((3, 2.0), (17, 4.25))),
    ]
    prompts = [[7, 19, 5, 33], [8, 13, 21], [40, 2, 9], [11, 3]]
    engine_harness.run(model, prompts, 4, draws, depth=2, budget=16)
    assert batched and max(batched) > 1  # one call per round, with every row of the round
    assert len(rows) == sum(batched)
    assert {t for t, *_ in rows} == {0.0, 0.9}
    assert all(token == alone for _, token, alone, _ in rows)
    assert any(moved for *_, moved in rows)  # a logit bias changed some row's draw


def test_mtp_drafts_take_torchs_argmax_in_one_launch_left_on_the_device(monkeypatch) -> None:
    """On the kernel path a drafting step's argmax is one `argmax_tokens` launch, a tensor (no copy to the host):
    each row's first maximum, and torch's argmax for a row without a finite maximum, as the reference path."""
    from server import runner

    launches, real = [], kernels.sample.argmax_tokens
    monkeypatch.setattr(kernels.sample, "argmax_tokens", lambda x: launches.append(x.shape[0]) or real(x))
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(4)).bfloat16()
    logits[1, [40, 3]] = 9.0  # a tie: the lower id
    logits[2, [30, 7]] = float("nan")  # torch's argmax: the first NaN
    logits[3] = float("-inf")
    expected = torch.argmax(logits.float(), dim=-1)
    drawn = runner._argmaxes(logits, True)
    assert isinstance(drawn, torch.Tensor) and torch.equal(drawn, expected) and launches == [4]
    assert drawn.tolist()[1:] == [3, 7, 0]
    launches.clear()
    assert torch.equal(runner._argmaxes(logits, False), expected) and not launches
