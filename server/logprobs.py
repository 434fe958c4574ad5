"""The API's logprobs shapes: OpenAI's chat `logprobs.content` and the legacy completions `logprobs` object."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from server.engine import TokenLogprob

# JSON has no -inf: a token the model rules out entirely is given this instead, as vLLM gives it
LOWEST_LOGPROB = -9999.0


def token_text(tokenizer: Any | None) -> Callable[[int], str]:
    """A token id's text alone (vLLM's "token_id:ID" where there is no tokenizer to decode it)."""
    if tokenizer is None:
        return lambda token: f"token_id:{token}"
    return lambda token: tokenizer.decode([token])


def _value(logprob: float) -> float:
    """A logprob JSON can carry."""
    return max(logprob, LOWEST_LOGPROB)


def chat_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[TokenLogprob], text: Callable[[int], str]
) -> dict[str, list[dict[str, Any]]]:
    """Chat's `choices[i].logprobs`: each token's text, logprob and UTF-8 bytes, with its `top_logprobs`."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        spelled = text(token)
        return {"token": spelled, "logprob": _value(logprob), "bytes": list(spelled.encode("utf-8"))}

    return {
        "content": [
            {**entry(token, lp.logprob), "top_logprobs": [entry(top, value) for top, value in lp.top]}
            for token, lp in zip(token_ids, logprobs, strict=True)
        ]
    }


def completion_logprobs(
    token_ids: Sequence[int], logprobs: Sequence[TokenLogprob], text: Callable[[int], str], offset: int = 0
) -> dict[str, list[Any]]:
    """A text completion's `choices[i].logprobs`: tokens, their logprobs, each one's most likely tokens with the
    drawn one among them (OpenAI's "up to logprobs + 1"), and each token's character offset from `offset`."""
    spelled = [text(token) for token in token_ids]
    offsets = []
    for piece in spelled:
        offsets.append(offset)
        offset += len(piece)
    return {
        "tokens": spelled,
        "token_logprobs": [_value(lp.logprob) for lp in logprobs],
        "top_logprobs": [
            {**{text(top): _value(value) for top, value in lp.top}, piece: _value(lp.logprob)}
            for piece, lp in zip(spelled, logprobs, strict=True)
        ],
        "text_offset": offsets,
    }
