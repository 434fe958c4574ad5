"""Tool calls in generated content: <tool_call> blocks, parsed whole or as the text streams, whose inner text is read
as Hermes/Qwen JSON (`hermes_call`) or as Qwen3-Coder's XML (`coder_calls`), as vLLM's parsers of those names read
them; and the calls of a forced tool choice, whose content a grammar made JSON (`ForcedCalls`).

Rules, the same for both paths (streamed pieces joined = the whole text parsed):
- A block runs from `<tool_call>` to the first `</tool_call>` after it. It parses when its inner text is a call as
  the block reader reads it; it then becomes a ToolCall and leaves the content.
- Hermes: the inner text, stripped, is a JSON object with a non-empty string "name" and "arguments" (or, where it has
  none, "parameters", as the forced calls' form and Llama's name them) that is a JSON object, a string holding a JSON
  object, or absent ({}).
- Qwen3-Coder: the inner text is one or more functions with only whitespace between them (and a `<tool_call>` left
  open before the next function, as a reply that leaves out a block's end tag writes it); each is `<function=NAME>`,
  then parameters `<parameter=KEY>VALUE</parameter>` with only whitespace between them, then `</function>` (or the
  end), and each is a call of its own, as vLLM reads every function of a block. A value runs to an end tag that only
  whitespace and another parameter or the function's end follow (an end tag followed by anything else is the value's
  own text); where its end tag is left out, to a `<parameter=` that begins a line or to the function's end. A value
  loses one leading and one trailing newline and is read by its parameter's JSON Schema type (`type`, or else the
  first of `anyOf`/`oneOf`; "null" aside): "null" or "None" is null where the type is not a string or takes null; an
  integer or number (an integral number as an integer) or a boolean (any case) where the text spells one; an object or
  array as JSON where it is one; anything else (an unknown parameter, a value that does not read as its type) stays
  text. A `</tool_call>` inside a value still ends the block, as for Hermes, and a bare `<function=...>` with no
  `<tool_call>` around it stays content (vLLM reads one where the reply holds no `<tool_call>` at all, which a stream
  cannot know when the tag comes).
- A block that fails to parse is kept verbatim (tags included) as content, in place. An unclosed block at the end (its
  end tag cut by a stop string, or never written) is a call when its text parses, as vLLM's Hermes parser takes it,
  else content.
- Content is the text outside parsed blocks, kept verbatim, except that once any block has parsed, the runs of text
  between parsed blocks (or between one and either end of the text) that hold only whitespace are dropped: a reply
  with only calls has content "", and text before the first block keeps its trailing newline.
"""

from __future__ import annotations

import json
import math
import re
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


# a block's inner text -> its calls (each function's name and arguments), or None where it holds none
BlockReader = Callable[[str], "list[tuple[str, dict[str, Any]]] | None"]


def hermes_call(inner: str) -> list[tuple[str, dict[str, Any]]] | None:
    """A Hermes block's call: a JSON object with "name" and "arguments"."""
    obj = json.loads(inner.strip())
    if not isinstance(obj, dict) or not isinstance(name := obj.get("name"), str) or not name:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = json.loads(args)
    return [(name, args)] if isinstance(args, dict) else None


FUNCTION, FUNCTION_END = "<function=", "</function>"
CODER_OPENING = (START, FUNCTION)  # how a Qwen3-Coder call's block opens
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
INTEGER = re.compile(r"[+-]?\d+")
NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")  # one way to match each text: linear time
JSON_KINDS = {"object": dict, "array": list}
NULLS = ("null", "none")  # JSON's, and Python's, which templates that render values as strings write


def _no_constant(name: str) -> Any:
    """json.loads' hook for NaN and the infinities, which no call's arguments may hold."""
    raise ValueError(f"{name} is not JSON")


def _kind(schema: dict[str, Any]) -> tuple[str, bool]:
    """A parameter schema's type (its first besides "null", from `type` or else `anyOf`/`oneOf`; "string" where it
    names none) and whether it takes null."""
    kinds = schema.get("type")
    options = schema.get("anyOf", schema.get("oneOf"))
    if kinds is None and isinstance(options, list):
        kinds = [option.get("type") for option in options if isinstance(option, dict)]
    named = [kind for kind in (kinds if isinstance(kinds, list) else [kinds]) if isinstance(kind, str)]
    return next((kind for kind in named if kind != "null"), "string"), "null" in named


def _typed(value: str, schema: Any) -> Any:
    """A Qwen3-Coder parameter's text as its schema (None: a parameter the tool does not list) reads it."""
    if not isinstance(schema, dict):
        return value
    kind, nullable = _kind(schema)
    word = value.strip()
    if word.lower() in NULLS and (nullable or kind != "string"):
        return None
    if kind == "integer" and INTEGER.fullmatch(word):
        return int(word)
    if kind == "number" and NUMBER.fullmatch(word) and math.isfinite(number := float(word)):
        return int(number) if number.is_integer() else number
    if kind == "boolean" and word.lower() in ("true", "false"):
        return word.lower() == "true"
    if kind in JSON_KINDS:
        try:
            read = json.loads(word, parse_constant=_no_constant)
        except ValueError:
            return value
        return read if isinstance(read, JSON_KINDS[kind]) else value
    return value


def _parameter_value(text: str) -> str:
    """A parameter's value: its text less one leading and one trailing newline."""
    text = text[1:] if text.startswith("\n") else text
    return text[:-1] if text.endswith("\n") else text


def _value_end(body: str, start: int) -> tuple[int, int]:
    """(where a parameter's value from `start` ends, where the text after it begins): at an end tag that only
    whitespace and another parameter or the function's end follow (one that anything else follows is the value's own
    text), else before a parameter that begins a line (its end tag left out), else at the function's end or the
    text's."""
    at = start
    while True:
        close = body.find(PARAMETER_END, at)
        next_line, function_end = body.find("\n" + PARAMETER, at), body.find(FUNCTION_END, at)
        cut = min((p for p in (next_line + 1 if next_line >= 0 else -1, function_end) if p >= 0), default=-1)
        if close >= 0 and (cut < 0 or close < cut):
            after = close + len(PARAMETER_END)
            rest = body[after:].lstrip()
            if not rest or rest.startswith((PARAMETER, FUNCTION_END)):
                return close, after
            at = after
        elif cut >= 0:  # the end tag left out: the value stops before the next parameter or the function's end
            return cut, cut
        else:
            return len(body), len(body)


def _between_functions(body: str, pos: int) -> int:
    """Where the next function may begin after one ends at `pos`: past whitespace and any `<tool_call>` left open."""
    while True:
        at = len(body) - len(body[pos:].lstrip())
        if not body.startswith(START, at):
            return at
        pos = at + len(START)


def coder_calls(parameters: dict[str, Any]) -> BlockReader:
    """The block reader of Qwen3-Coder's XML calls, reading each value by its parameter's schema in `parameters` (each
    offered function's name -> its parameters' JSON Schema)."""
    schemas = {}
    for name, schema in parameters.items():
        properties = schema.get("properties") if isinstance(schema, dict) else None
        schemas[name] = properties if isinstance(properties, dict) else {}

    def function(body: str, start: int) -> tuple[str, dict[str, Any], int] | None:
        """The function that begins at `start` (name, arguments, where it ends), or None where none does."""
        head = body.find(">", start)
        if not body.startswith(FUNCTION, start) or head < 0 or not (name := body[start + len(FUNCTION) : head].strip()):
            return None
        properties, args, pos = schemas.get(name, {}), {}, head + 1
        while (at := len(body) - len(body[pos:].lstrip())) < len(body) and not body.startswith(FUNCTION_END, at):
            key_end = body.find(">", at)
            if not body.startswith(PARAMETER, at) or key_end < 0:
                return None
            if not (key := body[at + len(PARAMETER) : key_end].strip()):
                return None
            stop, pos = _value_end(body, key_end + 1)
            args[key] = _typed(_parameter_value(body[key_end + 1 : stop]), properties.get(key))
        return name, args, min(len(body), at + len(FUNCTION_END))

    def read(inner: str) -> list[tuple[str, dict[str, Any]]] | None:
        calls, pos = [], len(inner) - len(inner.lstrip())
        while pos < len(inner):
            if (found := function(inner, pos)) is None:
                return None
            calls.append(found[:2])
            pos = _between_functions(inner, found[2])
        return calls or None

    return read


TOOL_CALL_PARSERS = ("auto", "hermes", "qwen3_coder")  # --tool-call-parser's choices


def tool_call_parser(choice: str, tokenizer: Any | None) -> str:
    """The parser --tool-call-parser names; auto: qwen3_coder where the chat template writes calls as
    `<function=NAME>` (Qwen3-Coder's and the Flash Next templates' form), else hermes."""
    if choice != "auto":
        return choice
    template = getattr(tokenizer, "chat_template", None)
    named = template.values() if isinstance(template, dict) else [template]  # a dict: templates by name
    return "qwen3_coder" if any(isinstance(text, str) and FUNCTION in text for text in named) else "hermes"


def _parse_block(inner: str, make_id: Callable[[], str], read: BlockReader) -> list[ToolCall] | None:
    """The calls a block's inner text holds, as `read` reads it, or None when it holds none."""
    try:
        found = read(inner)
        if not found:
            return None
        written = [(name, json.dumps(args, ensure_ascii=False, allow_nan=False)) for name, args in found]
        for name, arguments in written:
            (name + arguments).encode()  # a lone surrogate escape ("\ud83d") would fail the response's UTF-8
    except (ValueError, RecursionError):  # bad JSON, NaN or Infinity, not UTF-8, nesting too deep
        return None
    return [ToolCall(make_id(), name, arguments) for name, arguments in written]


def parse_tool_calls(
    text: str, make_id: Callable[[], str] = new_call_id, parallel: bool = True, read: BlockReader = hermes_call
) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole reply, by the module's rules (only the first call unless `parallel`, OpenAI's
    parallel_tool_calls); without a parsed block the content is `text`."""
    runs, calls, pos = [""], [], 0
    while (start := text.find(START, pos)) >= 0 and (end := text.find(END, start + len(START))) >= 0:
        found = _parse_block(text[start + len(START) : end], make_id, read)
        if found is None:
            runs[-1] += text[pos : end + len(END)]
        else:
            runs[-1] += text[pos:start]
            calls += found
            runs.append("")
        pos = end + len(END)
    if (start := text.find(START, pos)) >= 0 and (found := _parse_block(text[start + len(START) :], make_id, read)):
        runs[-1] += text[pos:start]  # an unclosed last block that parses
        calls += found
        runs.append("")
        pos = len(text)
    if not calls:
        return text, []
    runs[-1] += text[pos:]
    return "".join(run for run in runs if run.strip()), calls if parallel else calls[:1]


class ToolCallStream:
    """Split streamed content into text and tool calls, by the module's rules, as parse_tool_calls would."""

    __slots__ = ("_block", "_called", "_held", "_live", "_make_id", "_read", "_scan")

    def __init__(self, make_id: Callable[[], str] = new_call_id, read: BlockReader = hermes_call) -> None:
        """`make_id` gives each parsed call its id, in order; `read` reads a block's call."""
        self._make_id, self._read = make_id, read
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
                found = _parse_block(block[:at], self._make_id, self._read)
                if found is None:
                    content.append(self._held + START + block[: at + len(END)])
                    self._live = True
                else:
                    calls += found
                    self._live, self._called = False, True
                self._held, self._block, self._scan = "", None, 0
        return "".join(content), calls

    def flush(self) -> tuple[str, list[ToolCall]]:
        """(held-back content, calls) for when the reply ends: an unclosed block's call where its text parses."""
        found = None if self._block is None else _parse_block(self._block, self._make_id, self._read)
        if found is not None:
            self._held, self._block, self._scan = "", None, 0
            return "", found
        held = self._held if self._block is None else self._held + START + self._block
        self._held, self._block, self._scan = "", None, 0
        return (held if self._live or held.strip() or not self._called else ""), []


def whole_call_deltas(calls: list[ToolCall], sent: int) -> list[dict[str, Any]]:
    """A piece's calls as streamed `tool_calls` entries, each whole and indexed among its choice's calls (`sent`
    handed out so far, these included)."""
    first = sent - len(calls)
    return [call.to_openai(first + k) for k, call in enumerate(calls)]


class ToolCallCut:
    """One choice's streamed content cut into text and calls as its pieces come, only the first call kept unless
    parallel calls are allowed (OpenAI's parallel_tool_calls)."""

    __slots__ = ("_parallel", "_stream", "sent")

    def __init__(
        self, parallel: bool, make_id: Callable[[], str] = new_call_id, read: BlockReader = hermes_call
    ) -> None:
        self._stream = ToolCallStream(make_id, read)
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

    def deltas(self, text: str, last: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content delta, `tool_calls` deltas) of the next piece's text for a streamed chat: each call whole."""
        content, calls = self.take(text, last)
        return content, whole_call_deltas(calls, self.sent)

    def finish(self, reason: str | None) -> str | None:
        """The choice's finish_reason: "tool_calls" once a call was handed out (vLLM's Hermes parser's)."""
        return "tool_calls" if reason is not None and self.sent else reason


class ForcedCalls:
    """One choice's calls where tool_choice forced them (vLLM's forms, which guided decoding keeps the content to).
    A named function's answer is its arguments: the call carries the text as it comes (streamed as arguments deltas,
    the first with the call's id and name; a reply cut by its length gives the arguments written so far, as vLLM's).
    "required"'s answer is a JSON list of {"name", "parameters"} objects: each becomes a call as it closes; text that
    is not such an item (a list cut by its length inside one) stays content."""

    __slots__ = ("_arguments", "_call_id", "_items", "_make_id", "_named", "sent")

    def __init__(self, named: str | None, make_id: Callable[[], str] = new_call_id) -> None:
        """`named`: the forced function's name, or None for "required"."""
        self._named, self._make_id = named, make_id
        self._arguments: list[str] = []  # a named call's text so far
        self._call_id: str | None = None  # a named call's id, once it is opened
        self._items = ListItems()
        self.sent = 0  # calls handed out so far

    def take(self, text: str, last: bool) -> tuple[str, list[ToolCall]]:
        """(content delta, whole calls) of the next piece's text: a named call once the reply ends, each of
        "required"'s calls as its item closes; `last`: the reply ends with this piece."""
        if self._named is not None:
            self._arguments.append(text)
            if not last:
                return "", []
            self.sent = 1
            return "", [ToolCall(self._named_id(), self._named, "".join(self._arguments))]
        calls, content = [], ""
        for part, is_item in self._items.feed(text):
            call = self._call(part) if is_item else None
            if call is None:
                content += part
            else:
                calls.append(call)
        if last:
            content += self._items.rest()
        self.sent += len(calls)
        return content, calls

    def deltas(self, text: str, last: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content delta, `tool_calls` deltas) of the next piece's text for a streamed chat: a named call's
        arguments as they come, the first delta with its index, id, type and name; "required"'s calls whole."""
        if self._named is None:
            content, calls = self.take(text, last)
            return content, whole_call_deltas(calls, self.sent)
        if not text and not (last and self._call_id is None):
            return "", []
        if self._call_id is not None:
            return "", [{"index": 0, "function": {"arguments": text}}]
        self.sent = 1
        return "", [ToolCall(self._named_id(), self._named, text).to_openai(0)]

    def finish(self, reason: str | None) -> str | None:
        """The choice's finish_reason as vLLM gives it: "tool_calls" for "required"'s calls that ended well, the
        engine's reason otherwise (a named choice's "stop", as OpenAI's; "length" stays "length")."""
        return "tool_calls" if reason == "stop" and self.sent and self._named is None else reason

    def _named_id(self) -> str:
        """The named call's id, made the first time it is asked for."""
        if self._call_id is None:
            self._call_id = self._make_id()
        return self._call_id

    def _call(self, item: str) -> ToolCall | None:
        """The call one of "required"'s items holds; None where it is not one."""
        try:
            value = json.loads(item)
        except (ValueError, RecursionError):
            return None
        if not isinstance(value, dict):
            return None
        name, args = value.get("name"), value.get("parameters")
        if not isinstance(name, str) or not isinstance(args, dict):
            return None
        return ToolCall(self._make_id(), name, json.dumps(args, ensure_ascii=False))


class ListItems:
    """The items of a JSON list, each as it closes (an object or a list at its closing bracket, any other value at the
    comma or bracket after it), from the list's text in pieces, in order with any text outside the list (a reply
    that is no list); the list's brackets and the commas and whitespace between items are dropped."""

    __slots__ = ("_depth", "_escaped", "_item", "_quoted")

    def __init__(self) -> None:
        self._depth = 0  # brackets open outside strings, the list's own included
        self._quoted = self._escaped = False
        self._item: list[str] = []  # the open item's text

    def feed(self, text: str) -> list[tuple[str, bool]]:
        """The items that close in this piece of text and the text outside the list, in order: (text, is an item)."""
        parts: list[tuple[str, bool]] = []
        for char in text:
            if self._quoted:
                self._item.append(char)
                self._quoted = self._escaped or char != '"'
                self._escaped = not self._escaped and char == "\\"
            elif self._depth == 0 and char == "[":
                self._depth = 1
            elif self._depth == 0:
                outside = parts.pop()[0] if parts and not parts[-1][1] else ""
                parts.append((outside + char, False))
            elif self._depth == 1 and (char in ",]" or (char in " \t\n\r" and not self._item)):
                if self._item:
                    parts.append(("".join(self._item).rstrip(), True))
                    self._item = []
                self._depth -= char == "]"
            else:
                self._item.append(char)
                self._quoted = char == '"'
                self._depth += (char in "[{") - (char in "]}")
                if self._depth == 1 and char in "]}":
                    parts.append(("".join(self._item), True))
                    self._item = []
        return parts

    def rest(self) -> str:
        """The open item's text (a list cut inside an item)."""
        return "".join(self._item)
