"""Anthropic's Messages API (POST /v1/messages and /v1/messages/count_tokens), as vLLM serves it: a request becomes an
equivalent chat completions body, and a chat's reasoning, content and tool calls become a Message of thinking, text
and tool_use blocks, or its stream of events.

Blocks come in this order: a thinking block where there is reasoning, a text block where there is text (or where
nothing else came), then one tool_use block per call. A stream opens the thinking and the text blocks as their first
text comes and sends each tool_use block whole at the end, so it ends with the blocks of the whole message, in the
same order.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import Field, PlainValidator, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from server.generation import StreamEnd
from server.protocol import (
    MAX_TOOLS,
    TOOL_NAME_PATTERN,
    ApiError,
    NullAsAbsentModel,
    distinct_tool_names,
    not_supported,
    offered_tool,
    renamed,
)
from server.tool_calls import ToolCall

# Anthropic's error types, by HTTP status (any other 5xx is an api_error)
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
# The chat fields a Messages request's errors may name, by the Messages field each comes from
CHAT_FIELDS_AS_MESSAGES = {
    "stop": "stop_sequences",
    "response_format": "output_config.format",
    "chat_template_kwargs": "thinking",
    "user": "metadata.user_id",
    "reasoning_effort": "output_config.effort",
    "tools.*.function.parameters": "tools.*.input_schema",  # a Messages tool is the chat's function, flattened
    "tools.*.function": "tools.*",
}
STOP_REASONS = {"tool_calls": "tool_use"}  # any other end: max_tokens, end_turn or stop_sequence
# Claude Code's first system block: its client's version and a hash that changes with every request, which the model
# need not read and which would make every prompt's start new to the prompt cache (vLLM leaves it out too)
CLIENT_BILLING_MARK = "x-anthropic-billing-header:"


def as_messages_error(exc: ApiError) -> ApiError:
    """A chat-side error of a Messages request, naming the Messages field it comes from."""
    return renamed(exc, CHAT_FIELDS_AS_MESSAGES)


def error_body(exc: ApiError) -> dict[str, Any]:
    """Anthropic's error object: {"type": "error", "error": {"type", "message"}} (the field at fault leads the
    message)."""
    kind = ERROR_TYPES.get(exc.status, "api_error" if exc.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def new_message_id() -> str:
    """A fresh message id, as Anthropic writes them."""
    return f"msg_{uuid.uuid4().hex}"


def tool_use_id(call: ToolCall) -> str:
    """A call's id as Anthropic writes a tool_use block's."""
    return f"toolu_{call.id.rsplit('-', 1)[-1]}"


class TextBlock(NullAsAbsentModel):
    """A text block (its cache_control and citations are taken and change nothing)."""

    type: Literal["text"]
    text: str


class ToolUseBlock(NullAsAbsentModel):
    """An earlier assistant turn's call of a tool."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


def _text_block(value: Any) -> Any:
    """A text block of a tool result's content; a block of another type is refused by name."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind != "text":
        raise not_supported(f"content blocks of type {kind!r} are not taken in a tool result; this model reads text")
    return TextBlock.model_validate(value)


class ToolResultBlock(NullAsAbsentModel):
    """A user turn's answer to a call: its text, or text blocks joined with newlines; an error's text is marked as
    one, so the model reads that the call failed."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False

    @field_validator("content", mode="before")
    @classmethod
    def _text_blocks(cls, value: Any) -> Any:
        return [_text_block(block) for block in value] if isinstance(value, list) else value

    def text(self) -> str:
        """The result's text, after "Error: " where the call failed."""
        text = self.content if isinstance(self.content, str) else "\n".join(block.text for block in self.content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(NullAsAbsentModel):
    """An earlier assistant turn's thinking (its signature taken and not checked)."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(NullAsAbsentModel):
    """Thinking another server encrypted: nothing this model can read, so it is left out of the prompt."""

    type: Literal["redacted_thinking"]
    data: str


_BLOCKS = {
    "text": TextBlock,
    "tool_use": ToolUseBlock,
    "tool_result": ToolResultBlock,
    "thinking": ThinkingBlock,
    "redacted_thinking": RedactedThinkingBlock,
}
_ROLE_BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "thinking", "redacted_thinking", "tool_use")}


def _block(value: Any) -> Any:
    """One content block, validated as the block its type names; errors name the block's own fields."""
    if not isinstance(value, dict):
        raise PydanticCustomError("content_block", "must be an object with a type")
    kind = value.get("type")
    if kind not in _BLOCKS:
        raise not_supported(f"content blocks of type {kind!r} are not taken; this model reads text")
    return _BLOCKS[kind].model_validate(value)


Block = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock, PlainValidator(_block)
]


class MessageParam(NullAsAbsentModel):
    """One turn: its content a text or a list of blocks."""

    role: Literal["user", "assistant"]
    content: list[Block]

    @field_validator("content", mode="before")
    @classmethod
    def _text_as_one_block(cls, value: Any) -> Any:
        return [{"type": "text", "text": value}] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _blocks_of_its_role(self) -> MessageParam:
        for index, block in enumerate(self.content):
            if block.type not in _ROLE_BLOCKS[self.role]:
                raise PydanticCustomError(
                    "content_block", f"content.{index}: a {block.type} block belongs to no {self.role} turn"
                )
        return self

    def add_to(self, messages: list[dict[str, Any]]) -> None:
        """Append the turn as chat messages: a user's tool results each a tool message (before its text), an
        assistant's thinking as its reasoning and its tool_use blocks as its tool calls."""
        text = "\n".join(block.text for block in self.content if isinstance(block, TextBlock))
        if self.role == "user":
            for block in self.content:
                if isinstance(block, ToolResultBlock):
                    messages.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text()})
            if text or not any(isinstance(block, ToolResultBlock) for block in self.content):
                messages.append({"role": "user", "content": text})
            return
        message: dict[str, Any] = {"role": "assistant", "content": text}
        thinking = "\n".join(block.thinking for block in self.content if isinstance(block, ThinkingBlock))
        if thinking:
            message["reasoning_content"] = thinking
        calls = [
            {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": json.dumps(block.input)}}
            for block in self.content
            if isinstance(block, ToolUseBlock)
        ]
        if calls:
            message["tool_calls"] = calls
        messages.append(message)


class CustomTool(NullAsAbsentModel):
    """A tool the model may call, its input an object of `input_schema` (Anthropic's server tools are not taken)."""

    type: Literal["custom"] = "custom"
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None

    @field_validator("type", mode="before")
    @classmethod
    def _custom_only(cls, value: Any) -> Any:
        if value != "custom":
            raise not_supported(f"tools of type {value!r} (Anthropic's server tools) are not taken; only custom ones")
        return value

    def for_chat(self) -> dict[str, Any]:
        """The tool as a chat request offers it."""
        function = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        if self.strict is not None:
            function["strict"] = self.strict
        return {"type": "function", "function": function}


class ToolChoice(NullAsAbsentModel):
    """`tool_choice`: auto, any (a call is required), a named tool, or none."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise PydanticCustomError("tool_choice", "a name goes with type 'tool', and only with it")
        return self

    def for_chat(self) -> Any:
        """The chat's tool_choice."""
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class ThinkingConfig(NullAsAbsentModel):
    """`thinking`: on (enabled, or adaptive: this model thinks whenever it is on) or off. Its budget_tokens is taken
    and not enforced (a think block ends when the model ends it, within max_tokens); display "omitted" leaves the
    thinking out of the answer."""

    type: Literal["enabled", "adaptive", "disabled"]
    budget_tokens: int | None = Field(None, ge=1)
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(NullAsAbsentModel):
    """`output_config.format`: the answer is a JSON Schema's instance."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(NullAsAbsentModel):
    """`output_config`: the answer's format, and the effort the chat template is asked to think at (max as xhigh,
    this server's highest)."""

    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class Metadata(NullAsAbsentModel):
    """`metadata`: the end user's id."""

    user_id: str | None = None


class CountTokensRequest(NullAsAbsentModel):
    """Body of POST /v1/messages/count_tokens: what shapes a Messages request's prompt."""

    model: str | None = None
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[CustomTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None

    @field_validator("tool_choice")
    @classmethod
    def _choice_of_given_tools(cls, value: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        """A choice other than none needs tools, and a named one names one of them (checked here, as the chat checks
        its own, so that an error quotes the choice as it was sent)."""
        if "tools" not in info.data:  # refused already
            return value
        offered = [tool.name for tool in info.data["tools"] or []]
        if value is not None and value.type != "none" and not offered:
            raise PydanticCustomError("conflict", "needs tools")
        if value is not None and value.type == "tool":
            offered_tool(value.name, offered)
        return value

    @field_validator("messages")
    @classmethod
    def _turns_merged(cls, value: list[MessageParam]) -> list[MessageParam]:
        """Consecutive turns of one role as one turn, as Anthropic combines them; a last assistant turn (a prefill,
        which the answer continues) holds text only."""
        turns: list[MessageParam] = []
        for turn in value:
            if turns and turns[-1].role == turn.role:
                turns[-1] = MessageParam.model_construct(role=turn.role, content=[*turns[-1].content, *turn.content])
            else:
                turns.append(turn)
        last = turns[-1]
        if last.role == "assistant" and any(block.type not in ("text", "redacted_thinking") for block in last.content):
            raise PydanticCustomError(
                "prefill", "a last assistant turn is continued as a prefill: it may hold text only, not thinking or "
                "tool_use (a tool_use needs its tool_result in a user turn after it)",
            )  # fmt: skip
        return turns

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, value: list[CustomTool]) -> list[CustomTool]:
        distinct_tool_names([tool.name for tool in value])
        return value

    def chat_body(self) -> dict[str, Any]:
        """The body of the equivalent chat completions request: the system text first, a last assistant turn left
        open for the answer to continue (Anthropic's prefill)."""
        system = (
            self.system
            if isinstance(self.system, str)
            else "\n".join(block.text for block in self.system or () if not block.text.startswith(CLIENT_BILLING_MARK))
        )
        messages = [{"role": "system", "content": system}] if system else []
        for message in self.messages:
            message.add_to(messages)
        prefill = self.messages[-1].role == "assistant"
        body: dict[str, Any] = {"messages": messages}
        if prefill:
            body |= {"add_generation_prompt": False, "continue_final_message": True}
        if self.tools:
            body["tools"] = [tool.for_chat() for tool in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice.for_chat()
            body["parallel_tool_calls"] = not self.tool_choice.disable_parallel_tool_use
        if self.thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": self.thinking.type != "disabled"}
            body["include_reasoning"] = self.thinking.display != "omitted"
        effort = (self.output_config or OutputConfig()).effort
        if effort is not None:
            body["reasoning_effort"] = "xhigh" if effort == "max" else effort
        return body


class MessagesRequest(CountTokensRequest):
    """Body of POST /v1/messages."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None  # None: the server's default
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None  # vLLM's extension, as its chat takes it
    metadata: Metadata | None = None

    def chat_body(self) -> dict[str, Any]:
        """The body of the equivalent chat completions request."""
        body = super().chat_body() | {"max_tokens": self.max_tokens}
        sampling = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed}
        body |= {name: value for name, value in sampling.items() if value is not None}
        if self.stop_sequences:
            body["stop"] = self.stop_sequences
        if self.metadata is not None and self.metadata.user_id is not None:
            body["user"] = self.metadata.user_id
        config = self.output_config or OutputConfig()
        if config.format is not None:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": config.format.schema_},
            }
        return body


def _stop(end: StreamEnd, calls: list[ToolCall]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished answer: max_tokens where the tokens ran out, even inside a call."""
    if end.finish_reason == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if end.finish_reason in STOP_REASONS:
        return STOP_REASONS[end.finish_reason], None
    if isinstance(end.stop_reason, str):
        return "stop_sequence", end.stop_reason
    return "end_turn", None


def _call_input(call: ToolCall) -> dict[str, Any]:
    """A call's arguments as a tool_use block's input: the object written, or none where the tokens ran out before it
    closed (a forced call keeps what it wrote, which a stream's input_json_delta gives)."""
    try:
        arguments = json.loads(call.arguments)
    except (ValueError, RecursionError):  # not JSON (yet), or nested deeper than Python reads
        return {}
    return arguments if isinstance(arguments, dict) else {}


def _tool_use(call: ToolCall, input_: dict[str, Any] | None = None) -> dict[str, Any]:
    """A call's tool_use block, with its input (the parsed arguments where none is given)."""
    return {
        "type": "tool_use",
        "id": tool_use_id(call),
        "name": call.name,
        "input": _call_input(call) if input_ is None else input_,
    }


def _usage(end: StreamEnd) -> dict[str, int]:
    """Anthropic's usage: the prompt's tokens less those resumed, and those resumed as read from the cache."""
    return {
        "input_tokens": end.input_tokens - end.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": end.cached_tokens,
        "output_tokens": end.output_tokens,
    }


def _message(message_id: str, model: str, content: list[dict[str, Any]]) -> dict[str, Any]:
    """A Message object without its end."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": None,
        "stop_sequence": None,
    }


def message_object(
    message_id: str, model: str, reasoning: str, content: str, calls: list[ToolCall], end: StreamEnd
) -> dict[str, Any]:
    """Anthropic's Message of a finished generation."""
    blocks = [{"type": "thinking", "thinking": reasoning, "signature": ""}] if reasoning else []
    if content or not (reasoning or calls):
        blocks.append({"type": "text", "text": content})
    blocks += [_tool_use(call) for call in calls]
    stop_reason, stop_sequence = _stop(end, calls)
    return _message(message_id, model, blocks) | {
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(end),
    }


class MessageStream:
    """A generation's pieces as Anthropic's stream events: message_start, each block's start, deltas and stop (the
    thinking block, the text block, then each tool_use block whole), message_delta with the end, message_stop."""

    __slots__ = ("_calls", "_input_tokens", "_message_id", "_model", "_open", "_opened", "_text_at")

    def __init__(self, message_id: str, model: str, input_tokens: int) -> None:
        """A stream of the message with this id, of this model, after a prompt of this many tokens."""
        self._message_id, self._model, self._input_tokens = message_id, model, input_tokens
        self._opened = 0  # blocks opened so far: the next one's index
        self._open: str | None = None  # the type of the block open now
        self._text_at: int | None = None  # the text block's index, once opened
        self._calls: list[ToolCall] = []

    def opening(self) -> list[dict[str, Any]]:
        """message_start, with the message so far (no content yet)."""
        usage = {"input_tokens": self._input_tokens, "output_tokens": 0}
        return [{"type": "message_start", "message": _message(self._message_id, self._model, []) | {"usage": usage}}]

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        """Close the open block, then start this one."""
        events = self._close()
        self._open, index = block["type"], self._opened
        self._opened += 1
        if block["type"] == "text":
            self._text_at = index
        return [*events, {"type": "content_block_start", "index": index, "content_block": block}]

    def _close(self) -> list[dict[str, Any]]:
        """The open block's stop event, where one is open."""
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": self._opened - 1}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        """A delta of the open block."""
        return {"type": "content_block_delta", "index": self._opened - 1, "delta": delta}

    def feed(self, reasoning: str, content: str, calls: list[ToolCall]) -> list[dict[str, Any]]:
        """The events of a piece's new reasoning text, then its new text, then its calls (sent at the end)."""
        events = []
        if reasoning and self._text_at is None:  # thinking after the text began cannot come: the splitter ends it
            if self._open != "thinking":
                events += self._start({"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": reasoning}))
        if content:
            if self._open != "text":
                events += self._start({"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": content}))
        self._calls += calls
        return events

    def failure(self, error: ApiError) -> list[dict[str, Any]]:
        """The event that ends a stream whose generation failed: Anthropic's error event."""
        return [error_body(error)]

    def closing(self, end: StreamEnd) -> list[dict[str, Any]]:
        """The open block's stop (an empty text block first where nothing came), each call's tool_use block,
        message_delta with the stop reason and usage, then message_stop."""
        events = []
        if self._opened == 0 and not self._calls:
            events += self._start({"type": "text", "text": ""})
        for call in self._calls:
            events += self._start(_tool_use(call, {}))
            events.append(self._delta({"type": "input_json_delta", "partial_json": call.arguments}))
        events += self._close()
        stop_reason, stop_sequence = _stop(end, self._calls)
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        return [*events, {"type": "message_delta", "delta": delta, "usage": _usage(end)}, {"type": "message_stop"}]
