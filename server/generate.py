"""Offline generation for one prompt with the reference forward (the `flashnext generate` command)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.flashnext import FlashNextModel, single_lane_batch
from server.sampling import sample_token


@dataclass(frozen=True, slots=True)
class GenerateParams:
    """What to draw and when to stop."""

    max_tokens: int
    temperature: float
    seed: int
    eos_ids: tuple[int, ...]
    ignore_eos: bool = False
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0


def generate(model: FlashNextModel, prompt_ids: list[int], params: GenerateParams) -> list[int]:
    """Fill a lane with the prompt, then draw token by token; each draw is keyed by (seed, its position)."""
    lane = model.new_lane()
    ids = torch.tensor(prompt_ids, device=model.device)
    logits = model(single_lane_batch(lane, ids, 0), logit_rows=torch.tensor([len(prompt_ids) - 1])).logits[0]
    tokens: list[int] = []
    while True:
        token = sample_token(
            logits, params.temperature, params.top_k, params.top_p, params.min_p, params.seed, lane.length
        )
        tokens.append(token)
        if len(tokens) >= params.max_tokens or (token in params.eos_ids and not params.ignore_eos):
            return tokens
        step = single_lane_batch(lane, torch.tensor([token], device=model.device), lane.length)
        logits = model(step).logits[0]
