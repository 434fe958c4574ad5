"""Edges of the sixty-first session's mends (helper-136's review of them): a disagreeing spelling named, a checkpoint
among the API keys refused beside --model, the bench's key sent as a key, Responses errors that keep a schema's
property names and the values as sent, constants no UTF-8 encoder writes raw, uniqueItems' raw non-ASCII values,
and a Qwen3-Coder value without its end tag stopping at its function's end."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from model.shipped import SHIPPED_MODEL
from server.app import ServerState, build_app
from server.cli import build_parser
from server.guide_spec import compiled
from tests.server.test_tool_calls_api import SHIPPED, Answering

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(SHIPPED)


def _responses(tokenizer: Any) -> TestClient:
    return TestClient(build_app(ServerState(Answering(tokenizer, "hi"), tokenizer, "m", 4096, len(tokenizer), (0,))))


def _accepts(grammar: Any, data: bytes) -> bool:
    state = grammar.feed(grammar.initial, data)
    return state is not None and grammar.accepts(state)


def _last_error_line(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    return lines[-1] if lines else ""


# --- the command line ------------------------------------------------------------------------------------------------


def test_three_spellings_of_one_setting_are_refused_naming_two_that_disagree(capsys):
    """server/vllm_flags.py apply_vllm_flags: with three spellings given, the refusal names the first two, which may
    agree ("--tp 1 and -tp 1: one setting under two names") while the one that disagrees goes unnamed."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--tp", "1", "-tp", "1", "--tensor-parallel-size", "2"])
    line = _last_error_line(capsys)
    assert "--tensor-parallel-size 2" in line, line


def test_a_checkpoint_swallowed_by_api_key_is_refused_beside_model_flag(capsys):
    """`serve --api-key k CKPT --model CKPT` was refused ("give the checkpoint once") before --api-key took several
    values; now CKPT silently becomes an API key, because the checkpoint-among-the-keys check (server/vllm_flags.py)
    runs only while the model is the shipped default, after --model replaced it."""
    shipped = str(SHIPPED_MODEL)
    with pytest.raises(SystemExit):
        args = build_parser().parse_args(["serve", "--api-key", "k", shipped, "--model", shipped])
        pytest.fail(f"accepted, the checkpoint taken as an API key: {args.api_key}")


def test_bench_frontend_sends_the_api_key_itself_not_the_list(monkeypatch):
    """scripts/bench_frontend.py builds `Bearer {args.serve.api_key}`: --api-key is now a list, so its clients send
    "Bearer ['k']" and every request of phase B is refused 401."""
    spec = importlib.util.spec_from_file_location("bench_frontend_review", ROOT / "scripts" / "bench_frontend.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    seen: list[dict[str, str]] = []

    class Client:
        def __init__(self, *_args, headers=None, **_kwargs) -> None:
            seen.append(dict(headers or {}))

        async def __aenter__(self):
            return self

        async def __aexit__(self, *_exc) -> None:
            return None

    monkeypatch.setattr(bench.httpx, "AsyncClient", Client)
    args = bench.parse_args(["--api-key", "k"])
    asyncio.run(bench.run_clients("http://127.0.0.1:1", [], args))
    assert seen == [{"Authorization": "Bearer k"}]


# --- Responses errors ------------------------------------------------------------------------------------------------


def test_a_responses_error_keeps_a_schema_property_named_like_a_chat_field(tokenizer):
    """server/protocol.py renamed: every chat field of one word with "_" is rewritten anywhere in the message, so a
    schema property the client named max_tokens is reported as /properties/max_output_tokens (7e98603 kept it)."""
    schema = {"type": "object", "properties": {"max_tokens": {"type": "integer", "minimum": 5, "maximum": 1}}}
    text = {"format": {"type": "json_schema", "name": "x", "schema": schema}}
    reply = _responses(tokenizer).post("/v1/responses", json={"input": "hi", "text": text})
    error = reply.json()["error"]
    assert reply.status_code == 400, error
    assert "/properties/max_tokens/" in error["message"], error["message"]


def test_a_responses_error_quotes_a_sent_value_as_sent(tokenizer):
    """The same rewrite changes the quoted value: logit_bias {"max_tokens": 5} is quoted as {"max_output_tokens": 5}."""
    reply = _responses(tokenizer).post("/v1/responses", json={"input": "hi", "logit_bias": {"max_tokens": 5}})
    error = reply.json()["error"]
    assert reply.status_code == 400, error
    assert "max_output_tokens" not in error["message"], error["message"]


def test_a_responses_named_tool_choice_without_tools_is_quoted_as_sent(tokenizer):
    """server/responses.py _choice_of_given_tools checks a named choice only where tools are offered; without tools
    the chat's check refuses it quoting the chat's nested form {"type": "function", "function": {"name": "g"}}, a
    value the client never sent (Messages' check covers this case)."""
    reply = _responses(tokenizer).post("/v1/responses", json={"input": "hi", "tool_choice": {"type": "function",
                                                                                            "name": "g"}})  # fmt: skip
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == "tool_choice", error
    assert '"function": {' not in error["message"], error["message"]


# --- guides ----------------------------------------------------------------------------------------------------------


def test_an_enum_holding_a_lone_surrogate_escape_is_no_unicode_error():
    """A constant is also written with its non-ASCII characters as they are where UTF-8 can write them: an enum
    holding a lone surrogate escape (valid JSON) compiles, written escaped only."""
    compiled("json", '{"enum": ["\\ud800", "a"]}')


def test_a_unique_items_enum_takes_raw_non_ascii_as_any_enum_does():
    """Constants are now taken raw or escaped (as xgrammar writes them), but `_listed_values` (uniqueItems' items)
    still lays out only json.dumps' escaped text: ["é"] raw is refused where the same enum without uniqueItems
    takes it."""
    plain = compiled("json", json.dumps({"type": "array", "items": {"enum": ["é", "a"]}}))
    unique = compiled("json", json.dumps({"type": "array", "uniqueItems": True, "items": {"enum": ["é", "a"]}}))
    raw = json.dumps(["é"], ensure_ascii=False).encode()
    assert _accepts(plain, raw)
    assert _accepts(unique, raw)


# --- Qwen3-Coder blocks ----------------------------------------------------------------------------------------------


def test_a_value_without_its_end_tag_ends_at_its_functions_end_before_the_next_functions_parameter():
    """server/tool_calls.py _value_end looks for a `<parameter=` that begins a line before it looks for `</function>`:
    in a block of two functions whose first value leaves out `</parameter>`, that value runs over `</function>` and
    the next function's head, and the second function's parameter becomes the first's; two calls come back as one."""
    from server.tool_calls import coder_calls

    read = coder_calls(
        {"f": {"properties": {"x": {"type": "integer"}}}, "g": {"properties": {"y": {"type": "string"}}}}
    )
    inner = "\n<function=f>\n<parameter=x>\n1\n</function>\n<function=g>\n<parameter=y>\nz\n</parameter>\n</function>\n"
    assert read(inner) == [("f", {"x": 1}), ("g", {"y": "z"})]
