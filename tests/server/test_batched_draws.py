"""On the kernel path a round draws every row's token in one batched call (`sample_rows`), and each equals the
token `sample_token` draws for that row alone, greedy and sampled, inside verify windows too."""

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
from tests.tiny import text_config

# three layers (GDN, QSA, GDN): two GDN layers, at three quarters of four layers' interpreter time
TEXT = {"linear_key_head_dim": 16, "linear_value_head_dim": 16, "indexer_budget": 4, "num_hidden_layers": 3}


def test_a_round_draws_once_and_every_row_equals_its_draw_alone(tmp_path, monkeypatch) -> None:
    model = load_model(
        make_checkpoint(text_config("base", **TEXT), tmp_path, fmt="bf16"), "cpu", "bfloat16", kernels="on"
    )
    batched, rows = [], []
    sample_rows, draw = kernels.sample.sample_rows, ModelRunner._draw

    def counted(logits: torch.Tensor, *columns: torch.Tensor) -> torch.Tensor:
        batched.append(logits.shape[0])
        return sample_rows(logits, *columns)

    def checked(self: ModelRunner, plan_rows, logits: torch.Tensor) -> list[int]:
        tokens = draw(self, plan_rows, logits)
        keys = [(r.draw, r.start + len(r.token_ids) + i) for r in plan_rows if r.draw for i in range(len(r.drafts) + 1)]
        for i, ((s, position), token) in enumerate(zip(keys, tokens, strict=True)):
            alone = sample_token(logits[i], s.temperature, s.top_k, s.top_p, s.min_p, s.seed, position)
            rows.append((s.temperature, token, alone))
        return tokens

    monkeypatch.setattr(kernels.sample, "sample_rows", counted)
    monkeypatch.setattr(ModelRunner, "_draw", checked)
    draws = [DrawSpec(0.0, 0, 1.0, 0.0, 0), DrawSpec(0.9, 8, 0.9, 0.0, 1234)]
    engine_harness.run(model, [[7, 19, 5, 33], [8, 13, 21]], 4, draws, depth=2, budget=16)
    assert batched and max(batched) > 1  # one call per round, with every row of the round
    assert len(rows) == sum(batched)
    assert {t for t, _, _ in rows} == {0.0, 0.9}
    assert all(token == alone for _, token, alone in rows)
