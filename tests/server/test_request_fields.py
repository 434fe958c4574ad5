"""Request fields read as vLLM reads them: /tokenize's switches, and the field a context refusal names."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from server.app import ServerState, build_app
from tests.server.test_tool_calls_api import SHIPPED, Answering


@pytest.fixture(scope="module")
def tokenize_client() -> TestClient:
    tok = AutoTokenizer.from_pretrained(SHIPPED)
    return TestClient(build_app(ServerState(Answering(tok, "hi"), tok, "m", 64, len(tok), (0,))))


@pytest.mark.parametrize("value", ["", [], {}, 0])
def test_tokenize_return_token_strs_that_is_no_bool_nor_null_is_refused(tokenize_client, value):
    """return_token_strs null reads as false, yet "", [], {} or 0 is no bool: a 400, as before and as 1 or "yes"."""
    response = tokenize_client.post("/tokenize", json={"prompt": "ab", "return_token_strs": value})
    assert response.status_code == 400, response.text


def test_a_context_error_names_max_completion_tokens_where_it_wins(tokenize_client):
    """With max_tokens 5 and max_completion_tokens 100000 (which wins), the context error names
    max_completion_tokens, the field whose value it reports, not max_tokens."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "max_completion_tokens": 100_000}
    response = tokenize_client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "100000" in error["message"], error
    assert error["param"] == "max_completion_tokens", error
