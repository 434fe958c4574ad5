"""Request bodies of the OpenAI-compatible API, their 400 errors, and the sampling parameters they carry."""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from server.grammar import GrammarError
from server.guide_spec import GuideSpec
from server.tool_guides import named_call_guide, required_calls_guide

MAX_STOP_STRINGS = 8
# OpenAI's and vLLM's seed range, a signed 64-bit integer; a draw takes the seed modulo 2**64
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1
# The round header carries top_k in 32 bits; any top_k of the vocabulary's size or more keeps every token.
MAX_TOP_K = 2**31 - 1
# OpenAI's logit_bias range; and the most token ids one request may bias (each crosses the control link every round).
MAX_ABS_LOGIT_BIAS = 100.0  # a bias beyond it is clamped to it, as vLLM clamps
MIN_TEMPERATURE = 0.01  # a temperature above 0 and below it is raised to it, as vLLM raises it
MAX_LOGIT_BIAS_IDS = 1024
# The repetition penalty's range: a logit divided or multiplied by it stays finite in fp32 (vLLM takes any value > 0,
# and a tiny one there overflows the logits)
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
# The most ids vLLM's allowed_token_ids may list here (they travel in every round's header)
MAX_ALLOWED_IDS = 1024
# The most words vLLM's bad_words may list here (each is looked for behind every draw row of the request)
MAX_BAD_WORDS = 128
# OpenAI's largest top_logprobs (vLLM's default max_logprobs too)
MAX_LOGPROBS = 20
# The most choices one request may ask for (each is a request of its own to the engine)
MAX_CHOICES = 128
# The most prompts one text completion request may batch, and the most sequences (prompts times n) it may ask for
MAX_BATCH_PROMPTS = 256
MAX_SEQUENCES = 1024
# OpenAI's rule for a function's name; and the most tools one request may offer
TOOL_NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
MAX_TOOLS = 128
# The most documents (retrieved texts, for templates that render them) one chat may give
MAX_DOCUMENTS = 128
# The longest request id taken (a body's request_id or an X-Request-Id header): it comes back in every chunk
MAX_REQUEST_ID = 256
# Longest offending value, written as JSON, that an error message quotes back to the client.
_MAX_QUOTED_CHARS = 60
# Values of fields we cannot honour yet that mean the same as leaving the field out (JSON null always does); any
# value of an unhonoured field not named here is refused.
_HARMLESS: dict[str, Any] = {
    # vLLM's sampling and output extensions
    "disable_any_whitespace": False,
    "spaces_between_special_tokens": True,
    "use_beam_search": False,
    "logits_processors": [],
    # chat only: OpenAI's tools before `tools`
    "functions": [],
    "function_call": "none",
}
_NO_VALUE = object()  # the harmless value of a field that has none
# Arguments of the template call itself, which the server sets: not template variables.
TEMPLATE_CALL_ARGS = frozenset(
    {"conversation", "conversations", "messages", "add_generation_prompt", "continue_final_message", "tokenize",
     "tools", "documents", "chat_template", "padding", "truncation", "max_length", "return_tensors", "return_dict",
     "tokenizer_kwargs", "return_assistant_tokens_mask", "sanitize_control_tokens"}
)  # fmt: skip

RequestT = TypeVar("RequestT", bound=BaseModel)


def floored_temperature(temperature: float) -> float:
    """A sampling temperature as drawn: one above 0 and below MIN_TEMPERATURE is raised to it (vLLM's floor)."""
    return max(temperature, MIN_TEMPERATURE) if temperature else temperature


def fresh_seed() -> int:
    """A random 63-bit seed for a request that did not bring one."""
    return secrets.randbits(63)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How the engine draws and stops one request's tokens (top_k 0 means off, max_tokens None means the context),
    and which prompt states it may resume."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    draft: bool = True
    include_stop_str_in_output: bool = False  # a stop string's text, or a stop token's, ends the output
    cache_salt: str | None = None  # prompt states are resumed only from requests with the same salt
    priority: int = 0  # vLLM's: under --scheduling-policy priority, lower values are admitted first
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs in id order, none of them 0
    logprobs: int | None = None  # each token's logprob and that many of the most likely; None: no logprobs
    min_tokens: int = 0  # no stop token is drawn before this many tokens, nor a stop string found in their text
    repetition_penalty: float = 1.0  # vLLM's: on every id of the prompt and the output so far
    frequency_penalty: float = 0.0  # OpenAI's: on the output's ids, times how often each occurs
    presence_penalty: float = 0.0  # OpenAI's: on each id the output holds
    allowed_token_ids: tuple[int, ...] = ()  # vLLM's: the only ids it may draw, in id order (none: any)
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and that many of the most likely
    skip_special_tokens: bool = True  # vLLM's: special tokens (other than a stop token) give no text
    guide: GuideSpec | None = None  # the grammar the output follows (structured outputs)
    bad_words: tuple[str, ...] = ()  # vLLM's: words the output may not hold


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """What a request that leaves a field out gets (None: the API's own default); `max_tokens_cap` bounds every
    request's max_tokens, asked for or not."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None
    max_tokens_cap: int | None = None

    def given(self) -> dict[str, float | int]:
        """The values set, by name, for the start's log line."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


NO_DEFAULTS = SamplingDefaults()


def clamped_bias(bias: float) -> float:
    """A logit bias within [-100, 100]."""
    return max(-MAX_ABS_LOGIT_BIAS, min(MAX_ABS_LOGIT_BIAS, float(bias)))


class ApiError(Exception):
    """An error answered to the client with an HTTP status and OpenAI's error body."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        """The JSON body: {"error": {"message", "type", "param", "code"}}."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def renamed_path(path: str, names: dict[str, str]) -> str | None:
    """A chat field's path as the API it came from names it (`names`: chat field to that API's), or None. A name
    without a dot stands for the whole field (its inner path is the chat's own: "messages.3" is just "input"); one
    with dots, `*` standing for any index, for a part of a field whose inner path is the same in both."""
    parts = path.split(".")
    for key in sorted(names, key=lambda k: -k.count(".")):  # the most specific first
        pattern = key.split(".")
        if len(pattern) > len(parts) or not all(p in ("*", q) for p, q in zip(pattern, parts, strict=False)):
            continue
        if len(pattern) == 1:
            return names[key]
        indices = iter(q for p, q in zip(pattern, parts, strict=False) if p == "*")
        head = ".".join(next(indices) if p == "*" else p for p in names[key].split("."))
        return ".".join([head, *parts[len(pattern) :]])
    return None


def renamed(exc: ApiError, names: dict[str, str]) -> ApiError:
    """An error of an equivalent chat request, naming the fields of the API it came from (`names`, as
    `renamed_path` reads them): its param, and the chat fields of one word its message speaks of."""
    name = renamed_path(exc.param, names) if exc.param else None
    message = exc.message
    if name is not None and message.startswith(exc.param):
        message = name + message[len(exc.param) :]
    head, got, quoted = message.partition(" (got ")  # the value as sent is quoted as it was
    for chat, api in names.items():
        if "." not in chat and "_" in chat:  # a field's own name, which no plain word spells, not a pointer's or quoted
            head = re.sub(rf"(?<![/\w'\"]){chat}(?![/\w'\"])", api, head)
    message = head + got + quoted
    if name is None and message == exc.message:
        return exc
    return ApiError(message, status=exc.status, type=exc.type, param=name or exc.param, code=exc.code)


def offered_tool(name: str | None, offered: list[str]) -> None:
    """Refuse a tool choice that names no offered tool (a validation error listing the tools)."""
    if name not in offered:
        names = ", ".join(map(repr, offered))
        raise PydanticCustomError("tool_choice", f"names no offered tool; the tools are {names}")


def not_supported(message: str) -> PydanticCustomError:
    """A validation error for a feature the server refuses rather than silently ignores."""
    return PydanticCustomError("not_supported", message)


def refusing_unless_harmless(harmless_values: dict[str, Any]) -> Callable[[Any, ValidationInfo], Any]:
    """A field validator that refuses a field we cannot honour unless its value means the same as leaving it out
    (`harmless_values` by field name, of the same JSON type: no 1 for true, though 1 for 1.0)."""

    def refuse_unless_harmless(value: Any, info: ValidationInfo) -> Any:
        if value is None:  # JSON null, where no model validator dropped it
            return value
        harmless = harmless_values.get(info.field_name, _NO_VALUE)
        same_type = type(value) is type(harmless) or (type(harmless) is float and type(value) is int)
        if not same_type or value != harmless:
            raise not_supported("not supported yet")
        return value

    return refuse_unless_harmless


_refuse_unless_harmless = refusing_unless_harmless(_HARMLESS)


class StrictModel(BaseModel):
    """JSON types taken as they are (no "0.5" for a number, no 1 for a bool); unknown fields ignored."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


def without_nulls(data: Any) -> Any:
    """A JSON object's fields less those given as null, which means the same as leaving them out."""
    return {key: value for key, value in data.items() if value is not None} if isinstance(data, dict) else data


class NullAsAbsentModel(StrictModel):
    """A StrictModel whose fields given as JSON null read as not given."""

    _drop_nulls = model_validator(mode="before")(without_nulls)


class StreamOptions(StrictModel):
    """`stream_options`: whether the last streamed chunk carries usage, and (vLLM's) every chunk, usage so far; as
    vLLM reads them, include_usage left out is true and null is false."""

    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class ChatTemplateKwargs(StrictModel):
    """`chat_template_kwargs`: the known switches are checked, any other key goes to the template as given."""

    model_config = ConfigDict(extra="allow")

    enable_thinking: bool | None = None
    reasoning_effort: Literal["low", "medium", "high", "xhigh"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _template_variables_only(cls, data: Any) -> Any:
        taken = sorted(TEMPLATE_CALL_ARGS & set(data)) if isinstance(data, dict) else []
        if taken:
            raise PydanticCustomError(
                "template_call_arg", f"{taken[0]!r} is an argument of the template call, which the server sets"
            )
        return data


class FunctionSpec(StrictModel):
    """A function a tool offers: its name, what it does, and its parameters' JSON schema."""

    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


def distinct_tool_names(names: list[str]) -> None:
    """Refuse two offered tools of one name: a call of it could mean either."""
    twice = next((name for name in names if names.count(name) > 1), None)
    if twice is not None:
        raise PydanticCustomError("tools", f"two tools are named {twice!r}")


class ToolSpec(StrictModel):
    """One entry of `tools`: a function the model may call (type "function" where none is given, as vLLM takes it)."""

    type: Literal["function"] = "function"
    function: FunctionSpec


class CalledFunction(StrictModel):
    """A function an earlier assistant turn called, with its arguments as a JSON object's text."""

    name: str
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _json_object(cls, value: str) -> str:
        try:
            parsed = json.loads(value)
            json.dumps(parsed, ensure_ascii=False).encode()  # no lone surrogate escape, which no tokenizer encodes
        except RecursionError:
            raise PydanticCustomError("arguments", "must be a JSON object's text nested less deeply") from None
        except ValueError as exc:
            raise PydanticCustomError("arguments", f"must be a JSON object's text in UTF-8: {exc}") from None
        if not isinstance(parsed, dict):
            raise PydanticCustomError("arguments", "must be a JSON object's text")
        return value


class AssistantToolCall(StrictModel):
    """One call of a tool in an earlier assistant turn, as the responses give it."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction

    def for_template(self) -> dict[str, Any]:
        """The call as chat templates take it: the arguments as an object, as vLLM passes them."""
        function = {"name": self.function.name, "arguments": json.loads(self.function.arguments)}
        return {"type": self.type, "function": function} | ({} if self.id is None else {"id": self.id})


# the content parts read as text, as vLLM reads them (the Responses API's spellings and a replayed refusal too), and
# the key of each that holds its text
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


class ChatMessage(StrictModel):
    """One chat turn; a list of text parts is joined into one string with newlines."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str = Field(None, validate_default=True)  # an assistant's may be left out (as null: its calls alone)
    name: str | None = None
    # an earlier answer's reasoning, as the responses give it (either spelling), for templates that render it
    reasoning_content: str | None = None
    reasoning: str | None = None
    # an assistant turn's calls of tools, and a tool turn's answer to one of them
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ChatMessage:
        if None not in (self.reasoning, self.reasoning_content) and self.reasoning != self.reasoning_content:
            raise PydanticCustomError("conflict", "reasoning and reasoning_content differ; send one of them")
        if self.tool_calls and self.role != "assistant":
            raise PydanticCustomError("conflict", f"tool_calls belong to an assistant message, not a {self.role!r} one")
        return self

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template takes it: role, content, and the name, reasoning (as
        `reasoning_content`, the name Qwen's templates read), tool calls and tool call id where given."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.name is not None:
            message["name"] = self.name
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message

    @field_validator("content", mode="before")
    @classmethod
    def _join_text_parts(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:
            role = info.data.get("role")
            if role == "assistant":
                return ""
            raise PydanticCustomError("missing", f"required: a {role!r} message needs its content")
        if not isinstance(value, list):
            return value
        texts = []
        for index, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind not in TEXT_PARTS:
                raise PydanticCustomError(
                    "content_part",
                    f"part {index} has type {kind!r}; only text content parts ({', '.join(TEXT_PARTS)}) are supported",
                )
            if not isinstance(part.get(TEXT_PARTS[kind]), str):
                raise PydanticCustomError("content_part", f"{kind} part {index} needs a string {TEXT_PARTS[kind]!r}")
            texts.append(part[TEXT_PARTS[kind]])
        return "\n".join(texts)


class JsonSchemaFormat(NullAsAbsentModel):
    """`response_format.json_schema`: OpenAI's named schema the answer follows."""

    name: str = Field(pattern=TOOL_NAME_PATTERN)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(NullAsAbsentModel):
    """`response_format`: plain text, any JSON object, or a JSON Schema's instance (OpenAI's three types)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise PydanticCustomError("conflict", "json_schema is given exactly when type is 'json_schema'")
        return self

    def guide(self) -> GuideSpec | None:
        """The guide it asks for (None: text)."""
        if self.type == "text":
            return None
        schema = self.json_schema.schema_ if self.json_schema is not None else None
        return GuideSpec("json", "" if self.type == "json_object" else json.dumps(schema if schema else {}))


class StructuredOutputs(NullAsAbsentModel):
    """vLLM's `structured_outputs`: one of a JSON Schema, any JSON object, a regular expression, a choice or an EBNF
    grammar."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    structural_tag: Any = None
    whitespace_pattern: Any = None
    disable_any_whitespace: Any = None
    disable_fallback: bool = False  # there is one backend here, so nothing to fall back to
    disable_additional_properties: bool = False  # a schema's object takes no other keys here either way

    _check_unhonoured = field_validator("structural_tag", "whitespace_pattern", "disable_any_whitespace")(
        _refuse_unless_harmless
    )

    @field_validator("json_")
    @classmethod
    def _schema(cls, value: dict[str, Any] | str) -> dict[str, Any] | str:
        _json_guide(value)
        return value

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        self.guide()
        return self

    def guide(self) -> GuideSpec:
        """The one guide it gives."""
        given = [
            guide
            for guide in (
                _json_guide(self.json_) if self.json_ is not None else None,
                GuideSpec("json", "") if self.json_object else None,
                GuideSpec("regex", self.regex) if self.regex is not None else None,
                GuideSpec("choice", json.dumps(self.choice)) if self.choice is not None else None,
                GuideSpec("grammar", self.grammar) if self.grammar is not None else None,
            )
            if guide is not None
        ]
        if len(given) != 1:
            raise PydanticCustomError(
                "conflict", f"give exactly one of json, json_object, regex, choice and grammar, not {len(given)}"
            )
        return given[0]


def _json_guide(schema: dict[str, Any] | str) -> GuideSpec:
    """A JSON Schema's guide, the schema given as an object or as its JSON text (vLLM takes either)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise PydanticCustomError(
                "guide", "a schema given as text must be JSON: {error}", {"error": str(exc)}
            ) from None
    if not isinstance(schema, dict):
        raise PydanticCustomError("guide", "a schema must be a JSON object")
    return GuideSpec("json", json.dumps(schema))


class _SamplingRequest(NullAsAbsentModel):
    """Fields shared by chat and text completions; JSON null reads as 'not given'."""

    default_max_tokens: ClassVar[int | None] = None

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    stop: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    draft: bool = True
    cache_salt: str | None = Field(None, min_length=1)
    priority: int = 0  # vLLM's: lower is admitted sooner under --scheduling-policy priority; 0 under fcfs
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    user: str | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS_IDS)
    include_stop_str_in_output: bool = False
    response_format: ResponseFormat | None = None
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    min_tokens: int = Field(0, ge=0)
    bad_words: list[str] | None = Field(None, max_length=MAX_BAD_WORDS)
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, min_length=1, max_length=MAX_ALLOWED_IDS)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: Any = None
    use_beam_search: Any = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM's: keep only the prompt's last that many tokens (-1: as many as the context holds)
    truncate_prompt_tokens: int | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    guided_whitespace_pattern: Any = None
    guided_decoding_backend: str | None = None  # vLLM's choice of backend: there is one here
    # the response's id, less its prefix: printable ASCII, as an X-Request-Id header may carry it back
    request_id: str | None = Field(None, min_length=1, max_length=MAX_REQUEST_ID, pattern=r"^[\x20-\x7e]+$")
    return_tokens_as_token_ids: bool | None = None  # logprobs' tokens as "token_id:ID" (None: as the server's flag)
    structured_outputs: StructuredOutputs | None = None
    structural_tag: Any = None
    logits_processors: Any = None

    _check_unhonoured = field_validator(
        "spaces_between_special_tokens", "use_beam_search", "guided_whitespace_pattern",
        "structural_tag", "logits_processors",
    )(_refuse_unless_harmless)  # fmt: skip

    @field_validator("guided_json")
    @classmethod
    def _schema(cls, value: dict[str, Any] | str) -> dict[str, Any] | str:
        _json_guide(value)
        return value

    @field_validator("bad_words")
    @classmethod
    def _words_with_text(cls, value: list[str]) -> list[str]:
        """Each word holds more than the leading characters vLLM strips (str.lstrip's), or it spells no token."""
        empty = next((index for index, word in enumerate(value) if not word.lstrip()), None)
        if empty is not None:
            raise PydanticCustomError("bad_words", f"word {empty} is empty once its leading spaces are stripped")
        return value

    @model_validator(mode="after")
    def _one_guide_that_compiles(self) -> _SamplingRequest:
        """At most one of the guiding fields, and its grammar compiles (a bad schema is the request's fault)."""
        given = self.guides_given()
        if len(given) > 1:
            raise PydanticCustomError(
                "conflict", f"give one way to guide the output, not {' and '.join(field for field, _ in given)}",
                {"param": given[1][0]},
            )  # fmt: skip
        for field, guide in [*self.guide_parts(), *given]:  # each part alone first: its error names its own field
            try:
                guide.grammar()
            except GrammarError as exc:
                # the detail goes in last, as a context value: braces in a schema's keys are not filled in then
                context = {"param": field, "detail": f"{exc.where}: {exc}"}
                raise PydanticCustomError("guide", "{detail}", context) from None
        return self

    def guide_parts(self) -> list[tuple[str, GuideSpec]]:
        """Parts of a guide from fields of their own, each checked alone (a forced tool choice's tools)."""
        return []

    def guides_given(self) -> list[tuple[str, GuideSpec]]:
        """Each field that guides the output, with the guide it gives."""
        given = [
            ("response_format", self.response_format.guide() if self.response_format is not None else None),
            ("structured_outputs", self.structured_outputs.guide() if self.structured_outputs is not None else None),
            ("guided_json", _json_guide(self.guided_json) if self.guided_json is not None else None),
            ("guided_regex", GuideSpec("regex", self.guided_regex) if self.guided_regex is not None else None),
            ("guided_choice", GuideSpec("choice", json.dumps(self.guided_choice)) if self.guided_choice else None),
            ("guided_grammar", GuideSpec("grammar", self.guided_grammar) if self.guided_grammar is not None else None),
        ]
        return [(field, guide) for field, guide in given if guide is not None] + self.more_guides()

    def more_guides(self) -> list[tuple[str, GuideSpec]]:
        """Guides of a route's own fields (a chat's forced tool choice)."""
        return []

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _kept_tokens(cls, value: int | None) -> int | None:
        if value is not None and value != -1 and value < 1:
            raise PydanticCustomError("truncate", "must be -1 (as many as the context holds) or >= 1")
        return value

    @field_validator("min_tokens")
    @classmethod
    def _at_most_max_tokens(cls, value: int, info: ValidationInfo) -> int:
        most = info.data.get("max_completion_tokens")
        most = info.data.get("max_tokens") if most is None else most  # 0: a text completion's echo of the prompt alone
        if most is not None and value > most:
            raise PydanticCustomError("conflict", f"must be at most max_tokens ({most})")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _one_stop_string(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("prompt_logprobs")
    @classmethod
    def _not_streamed(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("stream"):
            raise not_supported("prompt_logprobs in a stream are not supported yet")
        return value

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value: StreamOptions, info: ValidationInfo) -> StreamOptions:
        if info.data.get("stream") is not True:
            raise PydanticCustomError("conflict", "only allowed when stream is true")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _biases_by_token_id(cls, value: dict[str, float]) -> dict[str, float]:
        ids = [int(key) if key.isascii() and key.isdigit() else None for key in value]
        if None in ids:
            bad = next(key for key, token in zip(value, ids, strict=True) if token is None)
            raise PydanticCustomError("logit_bias", f"keys are token ids written in decimal, got {bad!r}")
        if len(set(ids)) != len(ids):
            raise PydanticCustomError("logit_bias", "a token id is given twice")
        return value

    def sampling_params(self, defaults: SamplingDefaults = NO_DEFAULTS) -> SamplingParams:
        """The engine's view of this request, its unset sampling fields taken from `defaults` where they give one
        (max_tokens, where the request has none, stays None: its default depends on the prompt's room)."""
        given = self.model_fields_set

        def chosen(name: str) -> Any:
            """The request's value where given, else the default's where it has one, else the field's own."""
            value = getattr(defaults, name)
            return getattr(self, name) if name in given or value is None else value

        return SamplingParams(
            temperature=floored_temperature(chosen("temperature")),
            top_p=chosen("top_p"),
            top_k=min(max(chosen("top_k"), 0), MAX_TOP_K),
            min_p=chosen("min_p"),
            seed=None if self.seed == -1 else self.seed,  # vLLM's -1: a fresh seed
            max_tokens=self.max_completion_tokens or self.max_tokens or self.default_max_tokens,
            stop=tuple(self.stop),
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            draft=self.draft,
            include_stop_str_in_output=self.include_stop_str_in_output,
            cache_salt=self.cache_salt,
            priority=self.priority,
            logit_bias=tuple(sorted((int(k), clamped_bias(v)) for k, v in (self.logit_bias or {}).items() if v != 0)),
            logprobs=self.logprobs_count(),
            min_tokens=self.min_tokens,
            repetition_penalty=chosen("repetition_penalty"),
            frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty,
            allowed_token_ids=tuple(sorted(set(self.allowed_token_ids or ()))),
            prompt_logprobs=self.prompt_logprobs_count(),
            skip_special_tokens=self.skip_special_tokens,
            guide=next((guide for _, guide in self.guides_given()), None),
            bad_words=tuple(self.bad_words or ()),
        )

    def logprobs_count(self) -> int | None:
        """How many of the most likely tokens to give with each token's logprob; None: no logprobs."""
        return None

    def prompt_logprobs_count(self) -> int | None:
        """How many of the most likely tokens to give with each prompt token's logprob; None: none."""
        return self.prompt_logprobs


class ChatCompletionRequest(_SamplingRequest):
    """Body of POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    chat_template_kwargs: ChatTemplateKwargs = Field(default_factory=ChatTemplateKwargs)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolSpec] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    # vLLM's: the answer opens with the last message's text where that is the assistant's (the turn it continues)
    echo: bool = False
    # vLLM's: open an assistant turn after the messages, or leave the last message open for the answer to continue
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: Any = None
    documents: list[dict[str, str]] | None = Field(None, max_length=MAX_DOCUMENTS)  # for templates that render them
    functions: Any = None
    function_call: Any = None
    include_reasoning: bool = True  # vLLM's: false leaves the thinking text out of the answer
    reasoning_effort: Literal["none", "low", "medium", "high", "xhigh"] | None = None

    _check_chat_unhonoured = field_validator(
        "chat_template", "functions", "function_call",
    )(_refuse_unless_harmless)  # fmt: skip

    @field_validator("top_logprobs")
    @classmethod
    def _top_with_logprobs(cls, value: int, info: ValidationInfo) -> int:
        """A top_logprobs above 0 needs logprobs (0, vLLM's default, asks for nothing)."""
        if value and info.data.get("logprobs") is not True:
            raise PydanticCustomError("conflict", "needs logprobs: true")
        return value

    @field_validator("continue_final_message")
    @classmethod
    def _not_with_a_new_turn(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("add_generation_prompt", True):
            raise PydanticCustomError("conflict", "needs add_generation_prompt false: the answer cannot both continue "
                                      "the last message and open a new turn")  # fmt: skip
        return value

    def echoed(self) -> str:
        """What vLLM's echo puts before the answer: the last message's text where it is the assistant's."""
        last = self.messages[-1]
        return last.content if self.echo and last.role == "assistant" else ""

    @field_validator("tools")
    @classmethod
    def _distinct_names(cls, value: list[ToolSpec]) -> list[ToolSpec]:
        distinct_tool_names([tool.function.name for tool in value])
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_of_given_tools(cls, value: Any, info: ValidationInfo) -> Any:
        """'none', 'auto', 'required' or {"type": "function", "function": {"name": ...}} naming an offered tool."""
        named = isinstance(value, dict) and value.get("type") == "function"
        if value not in ("none", "auto", "required") and not named:
            raise PydanticCustomError("tool_choice", "must be 'none', 'auto', 'required' or a named function")
        if value != "none" and not info.data.get("tools"):
            raise PydanticCustomError("conflict", "needs tools")
        if named:
            function = value.get("function")
            offered_tool(function.get("name") if isinstance(function, dict) else None,
                         [tool.function.name for tool in info.data["tools"]])  # fmt: skip
        return value

    def forced_tool(self) -> str | None:
        """The function a named tool_choice forces; None for any other choice."""
        return self.tool_choice["function"]["name"] if isinstance(self.tool_choice, dict) else None

    def forces_calls(self) -> bool:
        """Whether tool_choice forces calls ('required' or a named function): the answer is guided to them."""
        return self.tool_choice == "required" or self.forced_tool() is not None

    def guide_parts(self) -> list[tuple[str, GuideSpec]]:
        """The parameters of each tool a forced choice may call, by the tool's field."""
        if not self.forces_calls():
            return []
        named = self.forced_tool()
        return [
            (f"tools.{index}.function.parameters", named_call_guide(tool.function.parameters))
            for index, tool in enumerate(self.tools)
            if named in (None, tool.function.name)
        ]

    def more_guides(self) -> list[tuple[str, GuideSpec]]:
        """A forced tool choice's guide, in vLLM's forms: a named function's arguments (its parameters' schema), or
        for 'required' a list of {"name", "parameters"} objects, one of the tools' each (at most one without
        parallel_tool_calls)."""
        if not self.forces_calls():
            return []
        schemas = {tool.function.name: tool.function.parameters for tool in self.tools}
        if (name := self.forced_tool()) is not None:
            return [("tool_choice", named_call_guide(schemas[name]))]
        return [("tool_choice", required_calls_guide(list(schemas.items()), self.parallel_tool_calls))]

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def parses_tool_calls(self) -> bool:
        """Whether the answer's tool-call blocks become `tool_calls`: tools offered and tool_choice 'auto' (the
        default with tools); with 'none' the tools are still shown to the template, as vLLM does, and not parsed."""
        return bool(self.tools) and self.tool_choice in (None, "auto")

    def template_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for the chat template: the offered tools, the given switches and pass-through keys, and
        OpenAI's top-level reasoning_effort, thinking at that effort ("none": no thinking; chat_template_kwargs' own
        keys win)."""
        kwargs = self.chat_template_kwargs.model_dump(exclude_none=True)
        if self.tools:
            kwargs["tools"] = [tool.model_dump(exclude_none=True) for tool in self.tools]
        if self.documents:
            kwargs["documents"] = self.documents
        if self.reasoning_effort is not None:
            kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
            if self.reasoning_effort != "none":
                kwargs.setdefault("reasoning_effort", self.reasoning_effort)
        return kwargs


class CompletionRequest(_SamplingRequest):
    """Body of POST /v1/completions; `prompt` ends as a batch of prompts (one where one was sent), each a text or a
    list of token ids."""

    default_max_tokens: ClassVar[int | None] = 16  # OpenAI's and vLLM's default for text completions

    prompt: list[str | list[int]]
    echo: bool = False
    max_tokens: int | None = Field(None, ge=0)  # 0 with echo: the prompt alone (with its logprobs where asked)
    suffix: str | None = None
    best_of: int = Field(1, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("prompt", mode="before")
    @classmethod
    def _batch_of_prompts(cls, value: Any) -> Any:
        """One prompt (a text or token ids) or a batch of them, as OpenAI takes them: all texts or all id lists."""
        batch = isinstance(value, list) and bool(value) and all(isinstance(item, str | list) for item in value)
        prompts = value if batch else [value]
        if len(prompts) > MAX_BATCH_PROMPTS:
            raise PydanticCustomError("batch", f"a batch holds at most {MAX_BATCH_PROMPTS} prompts, got {len(prompts)}")
        if len({type(item) for item in prompts}) > 1:
            raise PydanticCustomError("batch", "a batch's prompts must all be texts or all be lists of token ids")
        for number, prompt in enumerate(prompts):
            where = f"prompt {number} " if batch else ""
            if not isinstance(prompt, str | list):
                raise PydanticCustomError("prompt_type", "must be a string or a list of token ids")
            if not prompt:
                raise PydanticCustomError("empty_prompt", f"{where}must not be empty")
            for index, token in enumerate(prompt if isinstance(prompt, list) else ()):
                if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                    raise PydanticCustomError(
                        "token_id", f"{where}token ids must be integers >= 0; item {index} is {json.dumps(token)}"
                    )
        return prompts

    @model_validator(mode="after")
    def _sequences_within_bounds(self) -> CompletionRequest:
        """Each of n choices of each prompt is a request of its own to the engine."""
        if len(self.prompt) * self.n > MAX_SEQUENCES:
            raise PydanticCustomError(
                "conflict",
                f"{self.n} choices for each of {len(self.prompt)} prompts are {len(self.prompt) * self.n} sequences; "
                f"a request may ask for at most {MAX_SEQUENCES}",
                {"param": "n"},
            )
        return self

    @model_validator(mode="after")
    def _no_tokens_only_to_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and (not self.echo or self.stream):
            raise PydanticCustomError(
                "conflict", "0 is taken only with echo, not streamed (the prompt alone comes back)",
                {"param": "max_tokens"},
            )  # fmt: skip
        return self

    def echoes_only(self) -> bool:
        """vLLM's echo with max_tokens 0: the prompt alone comes back, its logprobs where asked."""
        return self.max_tokens == 0

    def sampling_params(self, defaults: SamplingDefaults = NO_DEFAULTS) -> SamplingParams:
        """The engine's view; the prompt alone still takes one draw (its logprobs come from the prompt pass)."""
        params = super().sampling_params(defaults)
        return replace(params, max_tokens=1, min_tokens=0) if self.echoes_only() else params

    def logprobs_count(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_count(self) -> int | None:
        """vLLM's prompt_logprobs, else with echo the legacy logprobs count: the echoed prompt has logprobs too."""
        return self.prompt_logprobs if self.prompt_logprobs is not None or not self.echo else self.logprobs

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str) -> str:
        if value:
            raise not_supported("not supported yet")
        return value

    @field_validator("best_of")
    @classmethod
    def _one_candidate(cls, value: int, info: ValidationInfo) -> int:
        if value > 1:
            raise not_supported("best_of above 1 is not supported yet")
        if value < info.data.get("n", 1):  # vLLM's and OpenAI's rule: best_of candidates give the n choices
            raise PydanticCustomError("conflict", "must be at least n")
        return value


def validation_error_to_api_error(exc: ValidationError) -> ApiError:
    """A 400 naming the first bad field by its dotted path, saying what was wrong and quoting a short bad value."""
    error = exc.errors(include_url=False)[0]
    # a whole-body check names its field in its context
    param = ".".join(str(part) for part in error["loc"]) or error.get("ctx", {}).get("param")
    message = f"{param or 'request body'}: {error['msg']}"
    if error["loc"] and error["type"] != "missing":
        quoted = json.dumps(error["input"], default=repr, skipkeys=True)
        if len(quoted) <= _MAX_QUOTED_CHARS:
            message += f" (got {quoted})"
    code = "unsupported_parameter" if error["type"] == "not_supported" else None
    return ApiError(message, param=param, code=code)


def parse_request(model: type[RequestT], body: bytes | str | dict[str, Any]) -> RequestT:
    """Validate a request body, raw JSON or already decoded, raising ApiError on bad input."""
    try:
        return model.model_validate(body) if isinstance(body, dict) else model.model_validate_json(body)
    except ValidationError as exc:
        raise validation_error_to_api_error(exc) from None


def token_sha(token_ids: list[int]) -> str:
    """SHA-256 hex of the ids written in decimal and joined by commas ("17,4,99")."""
    return hashlib.sha256(",".join(str(token) for token in token_ids).encode()).hexdigest()
