"""Tool calls in generated content: Hermes/Qwen-style <tool_call> JSON blocks, parsed whole or as the text streams;
and the calls of a forced tool choice, whose content a grammar made JSON (`ForcedCalls`).

Rules, the same for both paths (streamed pieces joined = the whole text parsed):
- A block runs from `<tool_call>` to the first `</tool_call>` after it. It parses when its inner text, stripped, is a
  JSON object with a non-empty string "name" and "arguments" that is a JSON object, a string holding a JSON object,
  or absent ({}); it then becomes a ToolCall and leaves the content.
- A block that fails to parse is kept verbatim (tags included) as content, in place. An unclosed block at the end (its
  end tag cut by a stop string, or never written) is a call when its text parses, as vLLM's Hermes parser takes it,
  else content.
- Content is the text outside parsed blocks, kept verbatim, except that once any block has parsed, the runs of text
  between parsed blocks (or between one and either end of the text) that hold only whitespace are dropped: a reply
  with only calls has content "", and text before the first block keeps its trailing newline.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from server.textout import partial_len

START = "<tool_call>"
END = "</tool_call>"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call: `arguments` is the arguments object as a JSON string (OpenAI's wire format)."""

    id: str
    name: str
    arguments: str

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        """The call as an OpenAI `tool_calls` entry; `index` (first key) for streamed deltas."""
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def new_call_id() -> str:
    """A fresh call id, as vLLM makes them."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _parse_block(inner: str, make_id: Callable[[], str]) -> ToolCall | None:
    """The call a block's inner text holds, or None when it is not one."""
    try:
        obj = json.loads(inner.strip())
        if not isinstance(obj, dict) or not isinstance(name := obj.get("name"), str) or not name:
            return None
        args = obj.get("arguments", {})
        if isinstance(args, str):
            args = json.loads(args)
        if not isinstance(args, dict):
            return None
        arguments = json.dumps(args, ensure_ascii=False, allow_nan=False)
        (name + arguments).encode()  # a lone surrogate escape ("\ud83d") would fail the response's UTF-8
    except (ValueError, RecursionError):  # bad JSON, NaN or Infinity, not UTF-8, nesting too deep
        return None
    return ToolCall(make_id(), name, arguments)


def parse_tool_calls(
    text: str, make_id: Callable[[], str] = new_call_id, parallel: bool = True
) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole reply, by the module's rules (only the first call unless `parallel`, OpenAI's
    parallel_tool_calls); without a parsed block the content is `text`."""
    runs, calls, pos = [""], [], 0
    while (start := text.find(START, pos)) >= 0 and (end := text.find(END, start + len(START))) >= 0:
        call = _parse_block(text[start + len(START) : end], make_id)
        if call is None:
            runs[-1] += text[pos : end + len(END)]
        else:
            runs[-1] += text[pos:start]
            calls.append(call)
            runs.append("")
        pos = end + len(END)
    if (start := text.find(START, pos)) >= 0 and (call := _parse_block(text[start + len(START) :], make_id)):
        runs[-1] += text[pos:start]  # an unclosed last block that parses
        calls.append(call)
        runs.append("")
        pos = len(text)
    if not calls:
        return text, []
    runs[-1] += text[pos:]
    return "".join(run for run in runs if run.strip()), calls if parallel else calls[:1]


class ToolCallStream:
    """Split streamed content into text and tool calls, by the module's rules, as parse_tool_calls would."""

    __slots__ = ("_block", "_called", "_held", "_live", "_make_id", "_scan")

    def __init__(self, make_id: Callable[[], str] = new_call_id) -> None:
        """`make_id` gives each parsed call its id, in order."""
        self._make_id = make_id
        self._held = ""  # unsent text of the current run: its whitespace while it has nothing else, a tag's start
        self._block: str | None = None  # inner text of the open block; None outside one
        self._scan = 0  # where in the block the end tag may start
        self._live = False  # the current run has non-whitespace text (sent at once)
        self._called = False  # a block has parsed

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """(content delta, calls completed); text that may be a tag's start or a dropped run is held back."""
        content: list[str] = []
        calls: list[ToolCall] = []
        while text:
            if self._block is None:
                text, self._held = self._held + text, ""
                at = text.find(START)
                cut = at if at >= 0 else len(text) - partial_len(text, (START,))
                if self._live or text[:cut].strip():
                    content.append(text[:cut])
                    self._live = True
                else:
                    self._held = text[:cut]
                if at < 0:
                    self._held += text[cut:]
                    break
                text, self._block = text[at + len(START) :], ""
            else:
                block = self._block + text
                at = block.find(END, self._scan)
                if at < 0:
                    self._block, self._scan = block, max(0, len(block) - len(END) + 1)
                    break
                text = block[at + len(END) :]
                call = _parse_block(block[:at], self._make_id)
                if call is None:
                    content.append(self._held + START + block[: at + len(END)])
                    self._live = True
                else:
                    calls.append(call)
                    self._live, self._called = False, True
                self._held, self._block, self._scan = "", None, 0
        return "".join(content), calls

    def flush(self) -> tuple[str, list[ToolCall]]:
        """(held-back content, calls) for when the reply ends: an unclosed block's call where its text parses."""
        call = None if self._block is None else _parse_block(self._block, self._make_id)
        if call is not None:
            self._held, self._block, self._scan = "", None, 0
            return "", [call]
        held = self._held if self._block is None else self._held + START + self._block
        self._held, self._block, self._scan = "", None, 0
        return (held if self._live or held.strip() or not self._called else ""), []


class ToolCallCut:
    """One choice's streamed content cut into text and calls as its pieces come, only the first call kept unless
    parallel calls are allowed (OpenAI's parallel_tool_calls)."""

    __slots__ = ("_parallel", "_stream", "sent")

    def __init__(self, parallel: bool, make_id: Callable[[], str] = new_call_id) -> None:
        self._stream = ToolCallStream(make_id)
        self._parallel = parallel
        self.sent = 0  # calls handed out so far

    def take(self, text: str, last: bool) -> tuple[str, list[ToolCall]]:
        """(content delta, calls) of the next piece's text; `last`: the reply ends with it."""
        content, calls = self._stream.feed(text)
        if last:
            tail, closed = self._stream.flush()
            content, calls = content + tail, calls + closed
        if not self._parallel:
            calls = calls[: max(0, 1 - self.sent)]
        self.sent += len(calls)
        return content, calls

    def finish(self, reason: str | None) -> str | None:
        """The choice's finish_reason: "tool_calls" once a call was handed out (vLLM's Hermes parser's)."""
        return "tool_calls" if reason is not None and self.sent else reason


class ForcedCalls:
    """One choice's calls where tool_choice forced them (vLLM's forms, which guided decoding keeps the content to): a
    named function's arguments object, or "required"'s JSON list of {"name", "parameters"} objects. The content is
    held back and becomes the calls when the reply ends; content that does not parse (a reply cut by its length)
    stays content."""

    __slots__ = ("_held", "_make_id", "_named", "sent")

    def __init__(self, named: str | None, make_id: Callable[[], str] = new_call_id) -> None:
        """`named`: the forced function's name, or None for "required"."""
        self._named, self._make_id = named, make_id
        self._held: list[str] = []
        self.sent = 0

    def take(self, text: str, last: bool) -> tuple[str, list[ToolCall]]:
        """(content delta, calls): nothing until the last piece, then the calls, or the content if it does not parse."""
        self._held.append(text)
        if not last:
            return "", []
        content = "".join(self._held)
        calls = self._calls(content)
        self.sent += len(calls)
        return ("", calls) if calls else (content, [])

    def finish(self, reason: str | None) -> str | None:
        """The choice's finish_reason as vLLM gives it: "tool_calls" for "required"'s calls that ended well, the
        engine's reason otherwise (a named choice's "stop", as OpenAI's; "length" stays "length")."""
        return "tool_calls" if reason == "stop" and self.sent and self._named is None else reason

    def _calls(self, content: str) -> list[ToolCall]:
        """The calls the content holds; none where it is not the forced form."""
        try:
            value = json.loads(content)
        except (ValueError, RecursionError):
            return []
        if self._named is not None:
            pairs = [(self._named, value)]
        elif isinstance(value, list) and all(isinstance(item, dict) for item in value):
            pairs = [(item.get("name"), item.get("parameters")) for item in value]
        else:
            return []
        if not all(isinstance(name, str) and isinstance(args, dict) for name, args in pairs):
            return []
        return [ToolCall(self._make_id(), name, json.dumps(args, ensure_ascii=False)) for name, args in pairs]
