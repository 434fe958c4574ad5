"""scripts/messages_check.py passes against a served tiny model, and fails where the Messages API and the chat
disagree."""

from __future__ import annotations

import json

import httpx
import messages_check

from tests.server.live import serve, tiny_chat_checkpoint


def test_the_messages_check_passes_against_a_server(tmp_path, monkeypatch, capsys):
    with serve(tiny_chat_checkpoint(tmp_path / "tiny")) as live:
        monkeypatch.setattr("sys.argv", ["messages_check.py", "--base-url", live.v1])
        assert messages_check.main() == 0
    assert capsys.readouterr().out.count("PASS messages:") == 3


def test_the_messages_check_fails_where_the_message_and_the_chat_differ(monkeypatch, capsys):
    use = {"type": "tool_use", "id": "toolu_1", "name": "sort", "input": {"items": [2, 1]}}
    stream = [{"type": "content_block_delta", "delta": {"type": "text_delta", "text": "Hi"}}, {"type": "message_stop"}]
    answers = {
        "/messages": {"content": [{"type": "text", "text": "Hi"}, use], "stop_reason": "end_turn"},
        "/chat/completions": {"choices": [{"message": {"content": "Hello"}}]},
    }

    def post(base: str, path: str, body: dict) -> httpx.Response:
        if body.get("stream"):
            return httpx.Response(200, text="".join(f"data: {json.dumps(event)}\n\n" for event in stream))
        return httpx.Response(200, json=answers[path])

    monkeypatch.setattr(messages_check, "post", post)
    monkeypatch.setattr("sys.argv", ["messages_check.py"])
    assert messages_check.main() == 1
    out = capsys.readouterr().out
    assert "FAIL messages: greedy message = chat" in out and "PASS messages: forced tool_use" in out
