"""server/logprobs.py: a token's text and bytes, and the JSON-safe values of the API's logprobs shapes."""

from __future__ import annotations

import math

import pytest
from transformers import AutoTokenizer

from model.shipped import SHIPPED_MODEL
from server.engine import TokenLogprob
from server.logprobs import LOWEST_LOGPROB, chat_logprobs, completion_logprobs, token_bytes, token_text


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(SHIPPED_MODEL))


def test_a_byte_level_tokens_bytes_are_its_own_where_its_text_is_a_replacement_character(tokenizer) -> None:
    """Characters cut between tokens (an emoji, CJK): each token's bytes are the bytes it holds, so a client can join
    them, as OpenAI's bytes field is for; the text of such a token alone is U+FFFD."""
    text = "Fish 🐟 and 日本語 with Ġ in it"
    ids = tokenizer.encode(text, add_special_tokens=False)
    spell = token_text(tokenizer)
    raw = token_bytes(tokenizer, spell)
    assert b"".join(bytes(raw(token)) for token in ids) == text.encode()
    cut = [token for token in ids if spell(token) == "\ufffd"]
    assert cut and all(bytes(raw(token)) != "\ufffd".encode() for token in cut)


def test_without_a_tokenizer_a_token_is_spelled_as_vllm_spells_it() -> None:
    spell = token_text(None)
    assert spell(42) == "token_id:42" and token_bytes(None, spell)(42) == list(b"token_id:42")


def test_values_json_cannot_carry_become_the_lowest_logprob() -> None:
    lps = [TokenLogprob(-math.inf, ((3, -math.inf), (4, math.nan))), TokenLogprob(-0.5, ((5, -0.25),))]
    spell = token_text(None)
    chat = chat_logprobs([3, 5], lps, spell, token_bytes(None, spell))["content"]
    assert [e["logprob"] for e in chat] == [LOWEST_LOGPROB, -0.5]
    assert [t["logprob"] for t in chat[0]["top_logprobs"]] == [LOWEST_LOGPROB, LOWEST_LOGPROB]
    legacy = completion_logprobs([3, 5], lps, spell, offset=7)
    assert legacy["token_logprobs"] == [LOWEST_LOGPROB, -0.5]
    assert legacy["text_offset"] == [7, 7 + len("token_id:3")]
    assert legacy["top_logprobs"][1] == {"token_id:5": -0.5}  # the drawn token, among the most likely


def test_an_id_past_the_tokenizers_vocabulary_has_its_texts_bytes(tokenizer) -> None:
    """A model's vocabulary may be wider than its tokenizer's (padding rows): such an id has no spelling; its bytes
    are its text's, as for any token the byte alphabet does not spell, not a failure."""
    spell = token_text(tokenizer)
    past = len(tokenizer) + 5
    assert token_bytes(tokenizer, spell)(past) == list(spell(past).encode())
    entry = chat_logprobs([past], [TokenLogprob(-1.0)], spell, token_bytes(tokenizer, spell))["content"][0]
    assert entry["bytes"] == list(spell(past).encode())
