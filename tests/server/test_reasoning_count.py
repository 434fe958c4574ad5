"""The reasoning-token count where a call ends the think block: the tokens before the tag of the call that ended it,
however the tag is spelled in tokens and however the tokens are grouped into updates."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import AutoTokenizer

from server.engine import Update
from tests.server.test_chat_parts_and_reasoning import CODER_CALL_OF, REASONING, coder_response, reasoning_tokens
from tests.server.test_generation import RecordingEngine
from tests.server.test_tool_calls_api import SHIPPED


@pytest.fixture(scope="module")
def split_tok() -> Any:
    """The shipped tokenizer as it is: <tool_call> is five tokens ('<', 'to', 'ol', '_call', '>')."""
    tok = AutoTokenizer.from_pretrained(SHIPPED)
    assert len(tok("<tool_call>", add_special_tokens=False)["input_ids"]) > 1
    return tok


@pytest.fixture(scope="module")
def one_tok() -> Any:
    """The shipped tokenizer with <tool_call> and </tool_call> one token each, as in Qwen's vocabulary."""
    tok = AutoTokenizer.from_pretrained(SHIPPED)
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    return tok


class AnsweringIds(RecordingEngine):
    """Answers every request with the given token ids, `per_update` an update, then stops."""

    def __init__(self, ids: list[int], per_update: int) -> None:
        super().__init__()
        self.ids, self.per_update = ids, per_update

    def submit(self, request) -> None:
        super().submit(request)
        cuts = list(range(0, len(self.ids), self.per_update))
        for k, at in enumerate(cuts):
            request.sink(Update(tuple(self.ids[at : at + self.per_update]), "stop" if k == len(cuts) - 1 else None))


def reasoning_tokens_of_ids(tok: Any, ids: list[int], per_update: int) -> tuple[int, list[str]]:
    """(reasoning_tokens, output item types) of a /v1/responses answer made of `ids`."""
    response = coder_response(tok, AnsweringIds(ids, per_update))
    return response["usage"]["output_tokens_details"]["reasoning_tokens"], [item["type"] for item in response["output"]]


@pytest.mark.parametrize("per_update", [1, 500])
def test_reasoning_tokens_end_at_a_calls_tag_that_is_several_tokens(split_tok, per_update):
    """With a tokenizer where <tool_call> is several tokens, a call ending the think block still ends the count at
    its tag: the reasoning tokens are those before the tag, not every token of the output."""
    answer = REASONING + CODER_CALL_OF.format(city="Paris")
    ids = split_tok(answer, add_special_tokens=False)["input_ids"]
    before = split_tok(REASONING, add_special_tokens=False)["input_ids"]
    assert ids[: len(before)] == before and split_tok.decode(ids[len(before)]) == "<"  # the tag's first token
    assert reasoning_tokens(split_tok, answer, per_update) == len(before)


@pytest.mark.parametrize("calls", [1, 2])
@pytest.mark.parametrize("per_update", [1, 3, 500])
def test_a_tag_spelled_in_pieces_inside_the_reasoning_does_not_move_the_count_off_the_calls_tag(
    split_tok, one_tok, per_update, calls
):
    """Reasoning that mentions <tool_call> spelled in several tokens (not the one tag token), then a call whose tag
    is the one token: the reasoning tokens are those before the call's tag token (not all of them, nor those before
    a later call's tag)."""
    mention = split_tok("Use <tool_call> maybe.\n", add_special_tokens=False)["input_ids"]  # ids valid in one_tok too
    tag = one_tok.convert_tokens_to_ids("<tool_call>")
    assert tag not in mention and one_tok.decode(mention) == "Use <tool_call> maybe.\n"
    answer = "\n".join(CODER_CALL_OF.format(city=city) for city in ("Paris", "Rome")[:calls])
    ids = mention + one_tok(answer, add_special_tokens=False)["input_ids"]
    assert ids[len(mention)] == tag
    counted, items = reasoning_tokens_of_ids(one_tok, ids, per_update)
    assert items == ["reasoning"] + ["function_call"] * calls, items
    assert counted == len(mention)
