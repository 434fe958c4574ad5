"""The API's logprobs shapes: OpenAI's chat `logprobs.content` and the legacy completions `logprobs` object."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Any

from server.engine import PromptLogprob, TokenLogprob

# JSON has no -inf: a token the model rules out entirely is given this instead, as vLLM gives it
LOWEST_LOGPROB = -9999.0


def token_text(tokenizer: Any | None) -> Callable[[int], str]:
    """A token id's text alone (vLLM's "token_id:ID" where there is no tokenizer to decode it), remembered."""
    if tokenizer is None:
        return lambda token: f"token_id:{token}"
    return functools.lru_cache(maxsize=1 << 16)(lambda token: tokenizer.decode([token]))


def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's spelling of bytes as characters, inverted: printable Latin-1 bytes stand for themselves, and
    the others, in byte order, for the characters from U+0100 on."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [byte for byte in range(256) if byte not in kept]
    return {chr(byte): byte for byte in kept} | {chr(256 + i): byte for i, byte in enumerate(moved)}


def token_bytes(tokenizer: Any | None, text: Callable[[int], str]) -> Callable[[int], list[int]]:
    """A token id's own bytes: from a byte-level BPE token's spelling (a token that ends mid-character has the bytes
    it holds, where its decoded text has U+FFFD), else the UTF-8 of its text."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if type(decoder).__name__ != "ByteLevel":
        return lambda token: list(text(token).encode())
    chars = _byte_level_chars()

    @functools.lru_cache(maxsize=1 << 16)
    def raw(token: int) -> tuple[int, ...]:
        spelled = tokenizer.convert_ids_to_tokens(token)
        if spelled is not None and all(char in chars for char in spelled):
            return tuple(chars[char] for char in spelled)
        return tuple(text(token).encode())  # an added token outside the byte alphabet, or an id past the tokenizer's

    return lambda token: list(raw(token))


def _value(logprob: float) -> float:
    """A logprob JSON can carry (-inf, or a NaN no draw lets through, as LOWEST_LOGPROB)."""
    return logprob if logprob > LOWEST_LOGPROB else LOWEST_LOGPROB


def chat_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[TokenLogprob],
    text: Callable[[int], str],
    raw: Callable[[int], list[int]],
) -> dict[str, list[dict[str, Any]]]:
    """Chat's `choices[i].logprobs`: each token's text, logprob and bytes, with its `top_logprobs`."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        return {"token": text(token), "logprob": _value(logprob), "bytes": raw(token)}

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


def prompt_logprobs(
    entries: Sequence[PromptLogprob], most: int, text: Callable[[int], str]
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: None for the first prompt token, then each token's entry by id (its logprob, rank and
    text), and the `most` most likely ids' (their ranks 1, 2, ...), one entry for an id that is both."""

    def entry(logprob: float, rank: int, token: int) -> dict[str, Any]:
        return {"logprob": _value(logprob), "rank": rank, "decoded_token": text(token)}

    return [None] + [
        {
            str(lp.token): entry(lp.logprob, lp.rank, lp.token),
            **{str(top): entry(value, rank, top) for rank, (top, value) in enumerate(lp.top[:most], 1)},
        }
        for lp in entries
    ]


def echoed_logprobs(
    prompt_ids: Sequence[int], entries: Sequence[PromptLogprob], most: int, text: Callable[[int], str]
) -> dict[str, list[Any]]:
    """An echoed prompt's part of a text completion's legacy `logprobs`: its tokens, their logprobs and most likely
    tokens (null for the first token, which has none), and their offsets from 0."""
    spelled = [text(token) for token in prompt_ids]
    return {
        "tokens": spelled,
        "token_logprobs": [None] + [_value(entry.logprob) for entry in entries],
        "top_logprobs": [None]
        + [
            {**{text(top): _value(value) for top, value in entry.top[:most]}, piece: _value(entry.logprob)}
            for piece, entry in zip(spelled[1:], entries, strict=True)
        ],
        "text_offset": list(accumulate(map(len, spelled[:-1]), initial=0)),
    }


def joined(first: dict[str, list[Any]], then: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """Two legacy `logprobs` objects, one after the other."""
    return {key: first[key] + then[key] for key in first}
