"""The sampling parameters as vLLM's SamplingParams, its v1 sampler and its OpenAI routes read them."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from kernels.sample import sample_row_reference
from server.protocol import ChatCompletionRequest, parse_request
from server.sampling import SamplingParamError, sample_token
from tests.server.test_tool_calls_api import SHIPPED, http

ASK = [{"role": "user", "content": "Name a color."}]
SEEDS = range(64)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(SHIPPED)


def drawn(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> set[int]:
    """The ids `sample_token` and the kernels' plain-PyTorch reference draw over many seeds (they must agree)."""
    host = {sample_token(logits, temperature, top_k, top_p, min_p, seed, 11) for seed in SEEDS}
    reference = {sample_row_reference(logits, temperature, top_k, top_p, min_p, seed, 11) for seed in SEEDS}
    assert host == reference
    return host


def submitted(tok: Any, **fields: Any) -> Any:
    """The engine request a chat with these fields becomes (through the HTTP route and a scripted engine)."""
    client, engine = http(tok, "Blue.")
    response = client.post("/v1/chat/completions", json={"messages": ASK, **fields})
    assert response.status_code == 200, response.text
    return engine.submitted[0]


def test_min_p_cuts_before_top_p_measures_its_mass():
    """min_p cuts before top_p, as vLLM's v1 sampler orders them, so top_p's mass is over min_p's survivors only."""
    # p = [.4, .3, .2, .1]: min_p .6 keeps {0, 1}, renormalized [.57, .43]; top_p .5 then keeps id 0 alone
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    assert drawn(logits, 1.0, 0, 0.5, 0.6) == {0}


def test_top_k_keeps_every_id_tied_with_the_kth_logit():
    """vLLM's top_k masks only logits below the k-th largest value, so ids tied with it stay candidates."""
    logits = torch.tensor([2.0, 2.0, 2.0, 0.0])
    assert drawn(logits, 1.0, 1, 1.0, 0.0) == {0, 1, 2}


def test_a_temperature_below_0_01_is_raised_to_0_01():
    """A temperature in (0, 0.01) is raised to 0.01, as vLLM's SamplingParams does (_MAX_TEMP)."""
    body = parse_request(ChatCompletionRequest, {"messages": ASK, "temperature": 0.001})
    assert body.sampling_params().temperature == 0.01


def test_min_tokens_holds_back_eos_even_with_ignore_eos(tokenizer):
    """Before min_tokens the EOS ids are ruled out even with ignore_eos, as vLLM's all_stop_token_ids holds them."""
    request = submitted(tokenizer, ignore_eos=True, min_tokens=3, max_tokens=8)
    assert 0 in request.draw.suppress_ids  # the route's EOS id


def test_a_logit_bias_beyond_100_is_clamped_not_refused(tokenizer):
    """vLLM's SamplingParams.from_optional clamps each logit_bias value to [-100, 100]; it does not refuse it."""
    request = submitted(tokenizer, logit_bias={"5": 150, "6": -250.5})
    assert request.draw.logit_bias == ((5, 100.0), (6, -100.0))


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_an_overflowing_temperature_with_top_k_is_a_parameter_error_not_an_index_error(top_k):
    """Logits that overflow at temperature 0.5 (NaN probabilities) with top_k set: sample_token raises
    SamplingParamError (as with top_k 0, and as the kernel gives -1) and the kernel's reference gives -1; top_k_kept
    now keeps 0 of them, and mass[0] raises IndexError, which _draw_row does not catch."""
    row = torch.tensor([3e38, 1.0, 0.0, -1.0])
    with pytest.raises(SamplingParamError):
        sample_token(row, 0.5, 0, 1.0, 0.0, 1, 2)  # top_k off: refused as a parameter error
    with pytest.raises(SamplingParamError):
        sample_token(row, 0.5, top_k, 1.0, 0.0, 1, 2)
    assert sample_row_reference(row, 0.5, top_k, 1.0, 0.0, 1, 2) == -1
