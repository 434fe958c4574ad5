"""Anthropic's Messages API against a running server: greedy text equal to the chat's, the stream equal to the whole
message, and a greedy forced tool_use whose input follows the tool's schema (at most 8 items, so it closes within
its tokens). One PASS or FAIL line a check; exit 1 on any FAIL.

python3 scripts/messages_check.py --base-url http://127.0.0.1:8000/v1
"""

from __future__ import annotations

import argparse
import json
import sys

import httpx

ASK = [{"role": "user", "content": "Write a sorting function."}]
OFF = {"thinking": {"type": "disabled"}}
TOOL = {
    "name": "sort",
    "input_schema": {
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"type": "integer"}, "maxItems": 8}},
        "required": ["items"],
    },
}


def post(base: str, path: str, body: dict) -> httpx.Response:
    """A POST that must answer 200."""
    response = httpx.post(f"{base}{path}", json=body, timeout=300)
    response.raise_for_status()
    return response


def checks(base: str) -> list[tuple[str, bool, str]]:
    """(name, passed, detail) of each check."""
    greedy = {"messages": ASK, "max_tokens": 24, "temperature": 0, **OFF}
    message = post(base, "/messages", greedy).json()
    chat = post(base, "/chat/completions", {"messages": ASK, "max_tokens": 24, "temperature": 0,
                "chat_template_kwargs": {"enable_thinking": False}}).json()  # fmt: skip
    text = "".join(block.get("text", "") for block in message["content"])
    lines = post(base, "/messages", {**greedy, "stream": True}).text.splitlines()
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    streamed = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    forced = post(base, "/messages", {"messages": ASK, "max_tokens": 96, "tools": [TOOL], **OFF, "temperature": 0,
                  "tool_choice": {"type": "tool", "name": "sort"}}).json()  # fmt: skip
    uses = [block for block in forced["content"] if block["type"] == "tool_use"]
    return [
        ("greedy message = chat", text == chat["choices"][0]["message"]["content"], message["stop_reason"]),
        ("streamed = whole", streamed == text and events[-1]["type"] == "message_stop", f"{len(events)} events"),
        (
            "forced tool_use follows the schema",
            bool(uses) and all(all(isinstance(i, int) for i in use["input"].get("items", [None])) for use in uses),
            f"stop_reason {forced['stop_reason']}: {json.dumps(uses)[:160]}",
        ),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    results = checks(parser.parse_args().base_url)
    for name, passed, detail in results:
        print(f"{'PASS' if passed else 'FAIL'} messages: {name} ({detail})")
    return 0 if all(passed for _, passed, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
