"""OpenAI's Responses API (POST /v1/responses), a text subset: a request becomes an equivalent chat completions body,
and a chat's reasoning, content and tool calls become a Response object or its stream of events.

Output items come in this order: a reasoning item where there is reasoning, a message where there is content or no
call, then one function_call item per call. A stream adds the reasoning and the message as their first text comes,
keeps the message open until the end (text may follow a call) and sends the calls' items last, so it ends with the
same items, ids and texts, in the same order, as the whole response.
Nothing is stored: a response cannot be fetched or continued later (`store` is echoed as false, as vLLM does without
its store).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import Field, PlainValidator, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from server.generation import StreamEnd
from server.protocol import (
    MAX_TOOLS,
    TOOL_NAME_PATTERN,
    ApiError,
    CalledFunction,
    NullAsAbsentModel,
    StrictModel,
    distinct_tool_names,
    not_supported,
    offered_tool,
    refusing_unless_harmless,
    renamed,
    without_nulls,
)
from server.tool_calls import ToolCall

# Values of fields we cannot honour that mean the same as leaving the field out (JSON null always does); any other
# value of such a field is refused.
_HARMLESS: dict[str, Any] = {"background": False, "include": [], "top_logprobs": 0}
# Output items' id prefixes, by item type
_ID_PREFIXES = {"reasoning": "rs", "message": "msg", "function_call": "fc"}


# The chat fields a Responses request's errors may name, by the Responses field each comes from (a message's place
# among the chat's messages is not its place in `input`: the error names `input` whole)
CHAT_FIELDS_AS_RESPONSES = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "reasoning_effort": "reasoning.effort",
    "response_format": "text.format",
    "response_format.json_schema": "text.format",  # a Responses format is the chat's json_schema, flattened
    "tools.*.function": "tools.*",  # and a tool the chat's function
}


def as_responses_error(exc: ApiError) -> ApiError:
    """A chat-side error of a Responses request, naming the Responses field it comes from."""
    return renamed(exc, CHAT_FIELDS_AS_RESPONSES)


def new_response_id() -> str:
    """A fresh response id, as OpenAI writes them."""
    return f"resp_{uuid.uuid4().hex}"


def _new_item_id(kind: str) -> str:
    """A fresh id for an output item of this type."""
    return f"{_ID_PREFIXES[kind]}_{uuid.uuid4().hex}"


def _refuse_other_types(*supported: str, noun: str) -> Callable[[Any], Any]:
    """A before-validator of a `type` field that refuses any other type's name as not supported yet."""

    def check(value: Any) -> Any:
        if isinstance(value, str) and value not in supported:
            only = " and ".join(map(repr, supported))
            raise not_supported(f"{noun} of type {value!r} are not supported yet; only {only}")
        return value

    return check


class ContentPart(NullAsAbsentModel):
    """A text part of an input message's content."""

    type: Literal["input_text", "output_text"]
    text: str

    _supported_type = field_validator("type", mode="before")(
        _refuse_other_types("input_text", "output_text", noun="content parts")
    )


class InputMessage(NullAsAbsentModel):
    """A message of the input: its content a text or a list of text parts (joined with newlines)."""

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: list[ContentPart]

    @field_validator("content", mode="before")
    @classmethod
    def _text_as_one_part(cls, value: Any) -> Any:
        return [{"type": "input_text", "text": value}] if isinstance(value, str) else value

    def add_to(self, messages: list[dict[str, Any]]) -> None:
        """Append the message as a chat message; an assistant's joins the turn its reasoning item opened."""
        text = "\n".join(part.text for part in self.content)
        if self.role == "assistant" and messages and _opened_by_reasoning(messages[-1]):
            messages[-1]["content"] = text
        else:
            messages.append({"role": self.role, "content": text})


class FunctionCallItem(CalledFunction):
    """A call an earlier answer made, its arguments a JSON object's text."""

    type: Literal["function_call"]
    call_id: str

    _drop_nulls = model_validator(mode="before")(without_nulls)

    def add_to(self, messages: list[dict[str, Any]]) -> None:
        """Add the call to the last chat message where that is the assistant's, else to a new assistant message."""
        if not messages or messages[-1]["role"] != "assistant":
            messages.append({"role": "assistant", "content": ""})
        function = {"name": self.name, "arguments": self.arguments}
        messages[-1].setdefault("tool_calls", []).append({"id": self.call_id, "type": "function", "function": function})


class FunctionCallOutputItem(NullAsAbsentModel):
    """What a called function returned: a text, or text parts (joined with newlines, as a message's are)."""

    type: Literal["function_call_output"]
    call_id: str
    output: list[ContentPart]

    @field_validator("output", mode="before")
    @classmethod
    def _text_as_one_part(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [{"type": "input_text", "text": value}]
        if not isinstance(value, list):
            raise PydanticCustomError("output_type", "must be a string or a list of text parts")
        return value

    def add_to(self, messages: list[dict[str, Any]]) -> None:
        """Append the output as a chat tool message."""
        text = "\n".join(part.text for part in self.output)
        messages.append({"role": "tool", "content": text, "tool_call_id": self.call_id})


class ReasoningPart(NullAsAbsentModel):
    """A text part of a reasoning item: of its content, or of its summary."""

    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(NullAsAbsentModel):
    """An earlier answer's reasoning: its text (its content's, else its summary's) opens the assistant turn that the
    calls or the message after it join, as the chat's `reasoning_content` (which templates render as they choose);
    dropped where nothing joins it."""

    type: Literal["reasoning"]
    content: list[ReasoningPart] = Field(default_factory=list)
    summary: list[ReasoningPart] = Field(default_factory=list)
    encrypted_content: str | None = None

    @field_validator("encrypted_content")
    @classmethod
    def _nothing_encrypted(cls, value: str) -> str:
        raise not_supported("encrypted reasoning is not supported yet: nothing here encrypts it")

    def add_to(self, messages: list[dict[str, Any]]) -> None:
        """Open an assistant turn with the reasoning's text."""
        text = "\n".join(part.text for part in self.content or self.summary)
        messages.append({"role": "assistant", "content": "", "reasoning_content": text})


def _opened_by_reasoning(message: dict[str, Any]) -> bool:
    """Whether a chat message is an assistant turn a reasoning item opened that nothing has joined yet."""
    return (
        message["role"] == "assistant"
        and "reasoning_content" in message
        and not message["content"]
        and ("tool_calls" not in message)
    )


_INPUT_ITEMS: dict[str, type[StrictModel]] = {
    "message": InputMessage,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}


def _input_item(value: Any) -> Any:
    """One input item, validated as the item its type names (a message where it names none); errors name the item's
    own fields, as a union's would not."""
    if not isinstance(value, dict):
        raise PydanticCustomError("input_item", "must be an object (a message or another input item)")
    kind = value.get("type")
    kind = "message" if kind is None else kind
    if not isinstance(kind, str) or kind not in _INPUT_ITEMS:
        raise not_supported(f"input items of type {kind!r} are not supported yet")
    return _INPUT_ITEMS[kind].model_validate(value)


InputItem = Annotated[
    InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningItem, PlainValidator(_input_item)
]


class FunctionTool(NullAsAbsentModel):
    """A function the model may call, given flat as the Responses API gives it (its type checked before the rest)."""

    type: Literal["function"]
    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    _supported_type = field_validator("type", mode="before")(_refuse_other_types("function", noun="tools"))

    def for_chat(self) -> dict[str, Any]:
        """The tool as a chat request offers it."""
        function = self.model_dump(include={"name", "description", "parameters"}, exclude_none=True)
        return {"type": "function", "function": function}


class NamedFunction(NullAsAbsentModel):
    """A `tool_choice` forcing a call of one offered function."""

    type: Literal["function"]
    name: str


class ReasoningConfig(NullAsAbsentModel):
    """`reasoning`: how hard to think; a summary may be asked for and is not written."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class TextFormat(NullAsAbsentModel):
    """`text.format`: plain text, any JSON object, or a named JSON Schema's instance (the chat's response_format)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    _supported_type = field_validator("type", mode="before")(
        _refuse_other_types("text", "json_object", "json_schema", noun="text formats")
    )

    def echoed(self) -> dict[str, Any]:
        """The format as a Response object gives it back."""
        return self.model_dump(by_alias=True, exclude_none=True)

    def for_chat(self) -> dict[str, Any] | None:
        """The chat's response_format (None for text); a schema's fields are checked there."""
        if self.type != "json_schema":
            return None if self.type == "text" else {"type": self.type}
        named = {"name": self.name, "schema": self.schema_, "description": self.description, "strict": self.strict}
        return {"type": "json_schema", "json_schema": named}


class TextConfig(NullAsAbsentModel):
    """`text`: the output's format (a verbosity is taken and ignored)."""

    format: TextFormat | None = None


class ResponsesRequest(NullAsAbsentModel):
    """Body of POST /v1/responses; a text `input` is read as one user message."""

    model: str | None = None
    input: list[InputItem] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)  # None: the server's default, which the response echoes
    top_p: float | None = Field(None, gt=0, le=1)
    # sampling extensions the chat takes too (vLLM's and OpenAI chat's), checked there
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    priority: int | None = None  # vLLM's, as the chat takes it
    # vLLM's further Responses fields, each the chat's own and checked there
    cache_salt: Any = None
    stop: Any = None
    repetition_penalty: Any = None
    logit_bias: Any = None
    ignore_eos: Any = None
    structured_outputs: Any = None
    stream: bool = False
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction = "auto"
    parallel_tool_calls: bool = True
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    store: bool = True  # taken; nothing is stored
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        None, max_length=16
    )  # OpenAI's limits: 16 pairs, keys of up to 64 characters, values of up to 512
    user: str | None = None
    truncation: Literal["disabled"] = "disabled"
    previous_response_id: Any = None
    conversation: Any = None
    background: Any = None
    include: Any = None
    prompt: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None

    _check_unhonoured = field_validator(
        "previous_response_id", "conversation", "background", "include", "prompt", "top_logprobs", "max_tool_calls"
    )(refusing_unless_harmless(_HARMLESS))

    @field_validator("input", mode="before")
    @classmethod
    def _text_as_user_message(cls, value: Any) -> Any:
        if isinstance(value, str):
            if not value:
                raise PydanticCustomError("empty_input", "must not be empty")
            return [{"role": "user", "content": value}]
        if not isinstance(value, list):
            raise PydanticCustomError("input_type", "must be a string or a list of input items")
        return value

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, value: list[FunctionTool]) -> list[FunctionTool]:
        distinct_tool_names([tool.name for tool in value])
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_types(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("type") != "function":
            raise not_supported(f"tool choices of type {value.get('type')!r} are not supported yet")
        if isinstance(value, dict) and not isinstance(value.get("name"), str):
            raise PydanticCustomError("tool_choice", "a function choice needs the function's name")
        if not isinstance(value, dict) and value not in ("none", "auto", "required"):
            raise PydanticCustomError("tool_choice", "must be 'none', 'auto', 'required' or a function to call")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_of_given_tools(cls, value: Any, info: ValidationInfo) -> Any:
        """A named function among the tools, checked here so that an error quotes the choice as it was sent."""
        if "tools" not in info.data:  # refused already
            return value
        offered = [tool.name for tool in info.data["tools"] or []]
        if isinstance(value, NamedFunction) and not offered:
            raise PydanticCustomError("conflict", "needs tools")
        if isinstance(value, NamedFunction):
            offered_tool(value.name, offered)
        return value

    @field_validator("truncation", mode="before")
    @classmethod
    def _no_truncation(cls, value: Any) -> Any:
        if value == "auto":
            raise not_supported("'auto' is not supported yet; an input longer than the context is refused")
        return value

    def chat_tool_choice(self) -> Any:
        """The chat's tool_choice: a named function as the chat names one."""
        if isinstance(self.tool_choice, NamedFunction):
            return {"type": "function", "function": {"name": self.tool_choice.name}}
        return self.tool_choice

    def chat_body(self) -> dict[str, Any]:
        """The body of the equivalent chat completions request (instructions first, as a system message)."""
        messages = [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        for item in self.input:
            item.add_to(messages)
        messages = [m for m in messages if not _opened_by_reasoning(m)]  # reasoning that nothing joined
        effort = self.reasoning and self.reasoning.effort
        body = {
            "messages": messages,
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "priority": self.priority,
            "cache_salt": self.cache_salt,
            "stop": self.stop,
            "repetition_penalty": self.repetition_penalty,
            "logit_bias": self.logit_bias,
            "ignore_eos": self.ignore_eos,
            "structured_outputs": self.structured_outputs,
            "tools": [tool.for_chat() for tool in self.tools] if self.tools else None,
            "tool_choice": self.chat_tool_choice() if self.tools or self.tool_choice != "auto" else None,
            "parallel_tool_calls": self.parallel_tool_calls,
            "reasoning_effort": "low" if effort == "minimal" else effort,  # chat has no "minimal"
            "user": self.user,
            "response_format": self.text.format.for_chat() if self.text and self.text.format else None,
        }
        return {key: value for key, value in body.items() if value is not None}


def _reasoning_text(text: str) -> dict[str, Any]:
    """A reasoning item's text part."""
    return {"type": "reasoning_text", "text": text}


def _output_text(text: str) -> dict[str, Any]:
    """A message's text part."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_item(parts: list[dict[str, Any]], status: str) -> dict[str, Any]:
    """A reasoning item, less its id."""
    return {"type": "reasoning", "summary": [], "content": parts, "status": status}


def _message_item(parts: list[dict[str, Any]], status: str) -> dict[str, Any]:
    """An assistant message item, less its id."""
    return {"type": "message", "role": "assistant", "status": status, "content": parts}


def _call_item(call: ToolCall, arguments: str, status: str) -> dict[str, Any]:
    """A function_call item, less its id."""
    return {"type": "function_call", "call_id": call.id, "name": call.name, "arguments": arguments, "status": status}


def _response(response_id: str, created: int, model: str, request: ResponsesRequest, status: str) -> dict[str, Any]:
    """A Response object without output or usage, with the request's settings echoed."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "model": model,
        "output": [],
        "parallel_tool_calls": request.parallel_tool_calls,
        "reasoning": request.reasoning and request.reasoning.model_dump(),
        "store": False,
        "temperature": request.temperature,
        "text": {"format": request.text.format.echoed() if request.text and request.text.format else {"type": "text"}},
        "tool_choice": (
            request.tool_choice.model_dump() if isinstance(request.tool_choice, NamedFunction) else request.tool_choice
        ),
        "tools": [tool.model_dump() for tool in request.tools or ()],
        "top_p": request.top_p,
        "truncation": "disabled",
        "usage": None,
        "user": request.user,
        "metadata": request.metadata or {},
    }


def response_object(
    *,
    response_id: str,
    created: int,
    model: str,
    request: ResponsesRequest,
    reasoning: str,
    content: str,
    calls: list[ToolCall],
    finish_reason: str,
    input_tokens: int,
    output_tokens: int,
    cached_tokens: int,
    item_ids: list[str] | None = None,
    reasoning_tokens: int = 0,
) -> dict[str, Any]:
    """OpenAI's Response object of a finished generation; `item_ids` are the output items' ids, in order."""
    items = [_reasoning_item([_reasoning_text(reasoning)], "completed")] if reasoning else []
    if content or not calls:
        items.append(_message_item([_output_text(content)], "completed"))
    items += [_call_item(call, call.arguments, "completed") for call in calls]
    ids = item_ids if item_ids is not None else [_new_item_id(item["type"]) for item in items]
    cut = finish_reason == "length"
    response = _response(response_id, created, model, request, "incomplete" if cut else "completed")
    response["incomplete_details"] = {"reason": "max_output_tokens"} if cut else None
    response["output"] = [{"id": item_id, **item} for item, item_id in zip(items, ids, strict=True)]
    response["usage"] = {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }
    return response


class ResponseStream:
    """A generation's pieces as OpenAI's stream events, numbered from 0: the reasoning item, then the message item,
    then the function calls' items (each call's events at the end, so the order never depends on how the tokens
    came in pieces)."""

    __slots__ = (
        "_calls",
        "_content",
        "_created",
        "_message_id",
        "_model",
        "_order",
        "_reasoning",
        "_reasoning_id",
        "_reasoning_open",
        "_request",
        "_response_id",
        "_sequence",
    )

    def __init__(self, response_id: str, created: int, model: str, request: ResponsesRequest) -> None:
        """A stream of the response with this id, created then, of this model, answering this request."""
        self._response_id, self._created, self._model, self._request = response_id, created, model, request
        self._sequence = 0
        self._order: list[str] = []  # the output items' ids, as added: an item's output_index is its place here
        self._reasoning, self._reasoning_id, self._reasoning_open = "", None, False
        self._content, self._message_id = "", None
        self._calls: list[ToolCall] = []  # the calls so far, whose items come after the message's

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """The next event, of this type, with these fields."""
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _added(self, kind: str, item: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """(the new item's id, its output_item.added event) for an item of this type, placed after those before."""
        item_id = _new_item_id(kind)
        self._order.append(item_id)
        return item_id, self._event(
            "response.output_item.added", output_index=len(self._order) - 1, item={"id": item_id, **item}
        )

    def _part_event(self, kind: str, item_id: str, **fields: Any) -> dict[str, Any]:
        """An event of an item's only content part."""
        return self._event(kind, item_id=item_id, output_index=self._order.index(item_id), content_index=0, **fields)

    def opening(self) -> list[dict[str, Any]]:
        """response.created and response.in_progress, each with the response so far (no output yet)."""
        response = _response(self._response_id, self._created, self._model, self._request, "in_progress")
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def feed(self, reasoning: str, content: str, calls: list[ToolCall]) -> list[dict[str, Any]]:
        """The events of a piece's new reasoning text, then its new content text, then its calls (each whole)."""
        events = []
        if reasoning:
            if self._reasoning_id is None:
                self._reasoning_id, added = self._added("reasoning", _reasoning_item([], "in_progress"))
                self._reasoning_open = True
                part = _reasoning_text("")
                events += [added, self._part_event("response.content_part.added", self._reasoning_id, part=part)]
            self._reasoning += reasoning
            events.append(self._part_event("response.reasoning_text.delta", self._reasoning_id, delta=reasoning))
        if content:
            events += self._close_reasoning()
            if self._message_id is None:
                events += self._open_message()
            self._content += content
            events.append(self._part_event("response.output_text.delta", self._message_id, delta=content, logprobs=[]))
        self._calls += calls  # their items follow the message's, as in response_object: sent at the end
        return events

    def _open_message(self) -> list[dict[str, Any]]:
        """The message item's added events."""
        self._message_id, added = self._added("message", _message_item([], "in_progress"))
        return [added, self._part_event("response.content_part.added", self._message_id, part=_output_text(""))]

    def _close_reasoning(self) -> list[dict[str, Any]]:
        """The reasoning item's done events, where it is open."""
        if not self._reasoning_open:
            return []
        self._reasoning_open = False
        part, item_id = _reasoning_text(self._reasoning), self._reasoning_id
        return [
            self._part_event("response.reasoning_text.done", item_id, text=self._reasoning),
            self._part_event("response.content_part.done", item_id, part=part),
            self._event(
                "response.output_item.done",
                output_index=self._order.index(item_id),
                item={"id": item_id, **_reasoning_item([part], "completed")},
            ),
        ]

    def failure(self, error: ApiError) -> list[dict[str, Any]]:
        """The events that end a stream whose generation failed: the error, then response.failed (whose error code
        is OpenAI's server_error, or invalid_prompt where the request was at fault)."""
        response = _response(self._response_id, self._created, self._model, self._request, "failed")
        code = "server_error" if error.status >= 500 else "invalid_prompt"
        response["error"] = {"code": code, "message": error.message}
        return [
            self._event("error", code=error.code, message=error.message, param=error.param),
            self._event("response.failed", response=response),
        ]

    def closing(self, end: StreamEnd) -> list[dict[str, Any]]:
        """The open items' done events (an empty message's added ones first where nothing came), then
        response.completed, or response.incomplete where the tokens ran out, with the whole response."""
        events = self._close_reasoning()
        if self._message_id is None and not self._calls:
            events += self._open_message()
        if self._message_id is not None:
            part = _output_text(self._content)
            events += [
                self._part_event("response.output_text.done", self._message_id, text=self._content, logprobs=[]),
                self._part_event("response.content_part.done", self._message_id, part=part),
                self._event(
                    "response.output_item.done",
                    output_index=self._order.index(self._message_id),
                    item={"id": self._message_id, **_message_item([part], "completed")},
                ),
            ]
        for call in self._calls:
            item_id, added = self._added("function_call", _call_item(call, "", "in_progress"))
            where = {"item_id": item_id, "output_index": len(self._order) - 1}
            events += [
                added,
                self._event("response.function_call_arguments.delta", **where, delta=call.arguments),
                self._event("response.function_call_arguments.done", **where, arguments=call.arguments),
                self._event(
                    "response.output_item.done",
                    output_index=where["output_index"],
                    item={"id": item_id, **_call_item(call, call.arguments, "completed")},
                ),
            ]
        response = response_object(
            response_id=self._response_id,
            created=self._created,
            model=self._model,
            request=self._request,
            reasoning=self._reasoning,
            content=self._content,
            calls=self._calls,
            finish_reason=end.finish_reason,
            input_tokens=end.input_tokens,
            output_tokens=end.output_tokens,
            cached_tokens=end.cached_tokens,
            item_ids=self._order,
            reasoning_tokens=end.reasoning_tokens,
        )
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        return [*events, self._event(kind, response=response)]
