"""The OpenAI-compatible HTTP front end: routes, auth, response shapes and SSE streaming."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import tomllib
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic_core import from_json
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from server.bad_words import BadWords, bad_word_ids
from server.engine import ContextLengthError, EngineStopped, check_context
from server.generation import THINK_TAGS, Generation, Outcome, StreamEnd, interleaved
from server.handle import EngineHandle
from server.http_options import DEFAULT_HTTP, HttpOptions
from server.logprobs import (
    chat_logprobs,
    completion_logprobs,
    echoed_logprobs,
    joined,
    prompt_logprobs,
    token_bytes,
    token_text,
)
from server.messages import (
    CountTokensRequest,
    MessagesRequest,
    MessageStream,
    as_messages_error,
    message_object,
    new_message_id,
)
from server.messages import error_body as messages_error_body
from server.protocol import (
    MAX_REQUEST_ID,
    NO_DEFAULTS,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingDefaults,
    SamplingParams,
    StreamOptions,
    parse_request,
    token_sha,
)
from server.responses import (
    ResponsesRequest,
    ResponseStream,
    as_responses_error,
    new_response_id,
    response_object,
)
from server.textout import prompt_opens_thinking
from server.tokenizer import single_token_id, template_reads
from server.tool_calls import CODER_OPENING, ForcedCalls, ToolCallCut, coder_calls, hermes_call, tool_call_parser

PUBLIC_PATHS = ("/health", "/ping", "/load", "/metrics", "/version")
# the routes whose requests /load counts (vLLM's: those that generate)
GENERATION_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/invocations")
# message ends a chat's prompt pass keeps states at: each costs a render of the messages up to it, so all of them
# would cost the square of a long conversation's length
MESSAGE_KEEPS = 4
# the fields of a chat request that shape its rendered prompt: /tokenize checks them as the chat route does
CHAT_RENDERING_FIELDS = (
    "chat_template_kwargs", "add_generation_prompt", "continue_final_message", "chat_template", "documents", "tools",
    "tool_choice", "reasoning_effort",
)  # fmt: skip


@dataclass(slots=True)
class ServerState:
    """What the routes need: the engine (in this process or another), the tokenizer and the model's limits."""

    engine: EngineHandle
    tokenizer: Any | None
    model_name: str
    context: int
    vocab_size: int
    eos_ids: tuple[int, ...]
    api_key: str | tuple[str, ...] | None = None  # one key or several, any of which a request may give
    sampling_defaults: SamplingDefaults = NO_DEFAULTS  # what a request's unset sampling fields take
    http: HttpOptions = DEFAULT_HTTP  # the HTTP side's options from the serve flags (server/http_options.py)
    aliases: tuple[str, ...] = ()  # other names requests may give the model (answers carry `model_name`)


def route_path(scope: Scope) -> str:
    """The path the app routes by: the request's, less the root path where it begins with it (as Starlette routes)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root + "/") else path


class RequireApiKey:
    """Refuses HTTP requests outside PUBLIC_PATHS without `Authorization: Bearer KEY` or (as Anthropic's clients send
    it) `x-api-key: KEY`; the Messages API's refusal in Anthropic's shape. Plain ASGI, not Starlette's
    `BaseHTTPMiddleware`, behind which a route never sees its client disconnect (so an abandoned request would run on
    to its last token)."""

    def __init__(self, app: ASGIApp, keys: str | tuple[str, ...]) -> None:
        self.app = app
        self.keys = [key.encode() for key in ((keys,) if isinstance(keys, str) else keys)]

    def _allows(self, headers: list[tuple[bytes, bytes]]) -> bool:
        """Whether either header holds one of the keys (each compared in constant time)."""
        given = dict(headers)
        bearer, plain = given.get(b"authorization", b""), given.get(b"x-api-key", b"")
        found = [hmac.compare_digest(bearer, b"Bearer " + key) | hmac.compare_digest(plain, key) for key in self.keys]
        return any(found)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and (path := route_path(scope)) not in PUBLIC_PATHS
            and not self._allows(scope["headers"])
        ):
            error = ApiError(
                "missing or wrong API key", status=401, type="authentication_error", code="invalid_api_key"
            )
            body = messages_error_body(error) if path.startswith("/v1/messages") else error.body()
            await JSONResponse(body, status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)


class RequestIdHeader:
    """vLLM's --enable-request-id-headers: every answer carries an X-Request-Id header, the id a chat's or text
    completion's response carries (which its route leaves in the request's state), else the request's own, else a
    new one. Plain ASGI, as `RequireApiKey` is."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                given = scope.get("state", {}).get("request_id") or Headers(scope=scope).get("x-request-id")
                header = (b"x-request-id", (given or uuid.uuid4().hex).encode("latin-1"))
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        await self.app(scope, receive, send_with_id)


@dataclass(slots=True)
class InFlight:
    """The generation requests in flight, which /load reports."""

    count: int = 0


class LoadCount:
    """vLLM's --enable-server-load-tracking: each generation request counted in flight from its arrival until its
    answer's last byte (a stream's end) or its client leaving. Plain ASGI, as `RequireApiKey` is."""

    def __init__(self, app: ASGIApp, load: InFlight) -> None:
        self.app, self.load = app, load

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or route_path(scope) not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        self.load.count += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.count -= 1


def usage(prompt: int, completion: int, cached: int | None = None) -> dict[str, Any]:
    """OpenAI's usage object; the cached prompt tokens' details where `cached` is given."""
    counts: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": completion}
    counts["total_tokens"] = prompt + completion
    if cached is not None:
        counts["prompt_tokens_details"] = {"cached_tokens": cached}
    return counts


def server_version() -> str:
    """flashnext's version, as installed or, run from a checkout not installed, as its pyproject.toml gives it."""
    try:
        return package_version("flashnext")
    except PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        return tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["version"]


def truncated(prompt_ids: list[int], keep: int | None, context: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens, -1 standing for the context's (the same list
    where it is no longer)."""
    keep = context if keep == -1 else keep
    return prompt_ids[-keep:] if keep is not None and len(prompt_ids) > keep else prompt_ids


def choices_usage(prompts: list[list[int]], completions: list[list[int]], cached: list[int]) -> dict[str, Any]:
    """Usage of a request's choices, as many a prompt in prompt order: each prompt once, every choice's tokens, and
    for each prompt the most of its tokens one of its choices resumed."""
    per_prompt = len(completions) // len(prompts)
    resumed = sum(max(cached[at : at + per_prompt]) for at in range(0, len(cached), per_prompt))
    return usage(sum(map(len, prompts)), sum(map(len, completions)), resumed)


def new_app(options: HttpOptions, **settings) -> FastAPI:
    """A FastAPI app with the options' docs pages and root path (its middleware comes later: `add_cors`)."""
    docs = {} if options.docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(**docs, **settings)
    app.root_path = options.root_path  # as vLLM sets it: routed with the prefix or without it
    return app


def add_cors(app: FastAPI, options: HttpOptions) -> None:
    """CORS as the app's outermost middleware, so that every answer, a refused API key's too, carries its headers
    and a browser's preflight is answered before any key is asked for."""
    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(options.allowed_origins),
        allow_methods=list(options.allowed_methods),
        allow_headers=list(options.allowed_headers),
        allow_credentials=options.allow_credentials,
    )


def build_app(state: ServerState) -> FastAPI:
    """The FastAPI app over an engine that delivers on the app's loop from startup to shutdown."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.engine.attach(asyncio.get_running_loop())
        yield
        state.engine.detach()

    app = new_app(state.http, title="flashnext", lifespan=lifespan)
    spell = token_text(state.tokenizer)  # a token's text in logprobs
    spell_bytes = token_bytes(state.tokenizer, spell)  # and its bytes
    as_id = token_text(None)  # a token's "token_id:ID" spelling
    calls_as = tool_call_parser(state.http.tool_call_parser, state.tokenizer)  # how <tool_call> blocks are read

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def no_route(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        """A route or method that does not exist (404, 405): OpenAI's error body, its headers (Allow) kept."""
        error = ApiError(str(exc.detail), status=exc.status_code, type="invalid_request_error")
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(ClientDisconnect)
    async def client_left(_: Request, __: ClientDisconnect) -> Response:
        """A client that leaves while sending its body: nothing started, and no one to answer (nor a traceback)."""
        return Response(status_code=499)

    load = InFlight()  # counted where tracked
    if state.http.load_tracking:  # added first: inside the key's check, so a refused request is no load
        app.add_middleware(LoadCount, load=load)
    if state.api_key:
        app.add_middleware(RequireApiKey, keys=state.api_key)
    if state.http.request_id_headers:  # outside the key's check: a refusal carries the header too
        app.add_middleware(RequestIdHeader)
    add_cors(app, state.http)  # added last: outermost

    def check_model(name: Any) -> None:
        """Refuse a model name that is no string (400) or names another model (404); null or none means this one."""
        if name is not None and not isinstance(name, str):
            raise ApiError(f"model: expected a string, got {json.dumps(name)[:60]}", param="model")
        if name is not None and name != state.model_name and name not in state.aliases:
            served = ", ".join(repr(served) for served in (state.model_name, *state.aliases))
            raise ApiError(
                f"model: {name!r} is not served here; this server serves {served}",
                status=404,
                param="model",
                code="model_not_found",
            )

    def request_id(request: Request, body: ChatCompletionRequest | CompletionRequest) -> str:
        """The id a chat's or text completion's response carries after its prefix, as vLLM takes it: the X-Request-Id
        header, else the body's request_id, else a new one; left in the request's state for `RequestIdHeader`."""
        given = request.headers.get("x-request-id")
        if given and len(given) > MAX_REQUEST_ID:
            raise ApiError(f"X-Request-Id: longer than {MAX_REQUEST_ID} characters", param="X-Request-Id")
        request.state.request_id = given or body.request_id or uuid.uuid4().hex
        return request.state.request_id

    def spelled_as(body: ChatCompletionRequest | CompletionRequest) -> Callable[[int], str]:
        """How the output's logprobs spell a token: as "token_id:ID" where the request's return_tokens_as_token_ids,
        or else --return-tokens-as-token-ids, asks for it (its bytes stay the token's own, `spell_bytes`)."""
        as_ids = body.return_tokens_as_token_ids
        return as_id if (as_ids if as_ids is not None else state.http.tokens_as_ids) else spell

    def need_tokenizer(param: str) -> Any:
        if state.tokenizer is None:
            raise ApiError(f"{param}: this model has no tokenizer; send token ids to /v1/completions", param=param)
        return state.tokenizer

    def render_chat(body: ChatCompletionRequest) -> str:
        tokenizer = need_tokenizer("messages")
        for field in ("tools", "documents"):
            if getattr(body, field) and not template_reads(tokenizer, field):
                raise ApiError(f"{field}: this model's chat template does not render {field}, so it would never see "
                               "them", param=field)  # fmt: skip
        messages = [m.for_template() for m in body.messages]
        try:
            return tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                tokenize=False,
                **body.template_kwargs(),
            )
        except Exception as exc:
            param = blamed(tokenizer, body, messages)
            raise ApiError(f"{param}: the chat template refused this request: {exc}", param=param) from exc

    def blamed(tokenizer: Any, body: ChatCompletionRequest, messages: list[dict[str, Any]]) -> str:
        """The request field a template's refusal comes from: the first of the messages, the tools, the documents,
        the turn switches and chat_template_kwargs whose addition makes the render fail."""
        kwargs = body.template_kwargs()
        offered = {name: kwargs.pop(name) for name in ("tools", "documents") if name in kwargs}
        turn = {"add_generation_prompt": body.add_generation_prompt,
                "continue_final_message": body.continue_final_message}  # fmt: skip
        switch = "continue_final_message" if body.continue_final_message else "add_generation_prompt"
        given: dict[str, Any] = {}
        steps = [("messages", {}), *((name, {name: value}) for name, value in offered.items()), (switch, turn),
                 ("chat_template_kwargs", kwargs)]  # fmt: skip
        for param, added in steps:
            given |= added
            try:
                tokenizer.apply_chat_template(messages, tokenize=False, **({"add_generation_prompt": True} | given))
            except Exception:
                return param
        return "chat_template_kwargs"  # a refusal the renders here do not repeat: the switches together

    def message_ends(body: ChatCompletionRequest, prompt_ids: list[int]) -> tuple[int, ...]:
        """Token positions where each of the last MESSAGE_KEEPS messages before the final one ends (prompt cache
        boundaries: a conversation's next turn resumes from the latest; the cache's grid covers earlier prefixes),
        each found by rendering the messages up to it."""
        ends = []
        for i in range(max(1, len(body.messages) - MESSAGE_KEEPS), len(body.messages)):
            part = [m.for_template() for m in body.messages[:i]]
            try:
                text = state.tokenizer.apply_chat_template(part, tokenize=False, **body.template_kwargs())
            except Exception:
                continue
            ids = state.tokenizer(text, add_special_tokens=False)["input_ids"]
            if ids == prompt_ids[: len(ids)]:
                ends.append(len(ids))
        return tuple(ends)

    def check_prompt(prompt_ids: list[int], param: str) -> None:
        """Refuse an empty prompt, an id outside the vocabulary, or a prompt that leaves no room in the context."""
        if not prompt_ids:
            raise ApiError(f"{param}: the prompt is empty", param=param)
        bad = [t for t in prompt_ids if t >= state.vocab_size]
        if bad:
            raise ApiError(
                f"{param}: token id {bad[0]} is outside the vocabulary (size {state.vocab_size})", param=param
            )
        if len(prompt_ids) >= state.context:
            raise ApiError(
                f"{param}: the prompt has {len(prompt_ids)} tokens; this model's context is {state.context}",
                param=param,
                code="context_length_exceeded",
            )

    def output_limit(asked: int | None, room: int) -> int:
        """The most tokens a choice may have: its max_tokens, else the sampling defaults' (within the prompt's
        room), else the room; at most the defaults' cap either way, as vLLM takes them."""
        defaults = state.sampling_defaults
        limit = asked if asked is not None else min(defaults.max_tokens or room, room)
        return limit if defaults.max_tokens_cap is None else min(limit, defaults.max_tokens_cap)

    def start(
        prompts: list[list[int]], body, thinking_open: bool | None, keep_at: tuple[int, ...] = ()
    ) -> list[Generation]:
        """Submit checked prompts with the body's sampling parameters, each once for each of its `n` choices (in
        prompt order); nothing is submitted unless every prompt passes."""
        params = body.sampling_params(state.sampling_defaults)
        if params.priority and not state.engine.priority_scheduling:  # as vLLM refuses it
            raise ApiError("priority: needs --scheduling-policy priority; under fcfs it must be 0", param="priority")
        if params.stop and state.tokenizer is None:  # matched in the text, which only a tokenizer makes
            raise ApiError("stop: this model has no tokenizer to match stop strings; send stop_token_ids", param="stop")
        for field, ids in (
            ("logit_bias", [int(key) for key in body.logit_bias or {}]),
            ("stop_token_ids", params.stop_token_ids),
            ("allowed_token_ids", params.allowed_token_ids),
        ):
            outside = [token for token in ids if token >= state.vocab_size]  # a logit bias of 0 included
            if outside:
                raise ApiError(
                    f"{field}: token id {outside[0]} is outside the vocabulary (size {state.vocab_size})", param=field
                )
        stops = set(params.stop_token_ids) | set(state.eos_ids)  # what min_tokens holds back, ignore_eos or not
        if params.min_tokens and params.allowed_token_ids and stops.issuperset(params.allowed_token_ids):
            raise ApiError(
                "allowed_token_ids: every allowed id is a stop token, which min_tokens rules out: nothing is left to "
                "draw",
                param="allowed_token_ids",
            )
        params = guided(body, params, thinking_open)
        bad_words = checked_bad_words(params)
        asked_by = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"  # the one that counts
        generations: list[Generation] = []
        # a coder call opened inside a think block ends it, where the answer's calls are read in that form
        coder = calls_as == "qwen3_coder" and isinstance(body, ChatCompletionRequest) and body.parses_tool_calls()
        for prompt_ids in prompts:
            limit = output_limit(params.max_tokens, state.context - len(prompt_ids))
            if params.min_tokens > limit:
                raise ApiError(
                    f"min_tokens: {params.min_tokens} is more than the {limit} tokens this request may have (its "
                    "max_tokens, the server's default or cap, or the context's room after the prompt)",
                    param="min_tokens",
                )
            group = [
                Generation(
                    state.engine,
                    state.tokenizer,
                    prompt_ids,
                    params,
                    limit,
                    state.eos_ids,
                    thinking_open,
                    keep_at,
                    choice,
                    bad_words,
                    call_opening=CODER_OPENING if coder else None,
                )
                for choice in range(body.n)
            ]
            try:
                check_context(group[0].request, state.context, asked_by)
            except ContextLengthError as exc:
                raise ApiError(str(exc), param=asked_by, code="context_length_exceeded") from exc
            generations += group
        try:
            for generation in generations:
                generation.submit()
        except EngineStopped as exc:
            for generation in generations:
                generation.abort()
            raise ApiError(str(exc), status=503, type="server_error") from exc
        return generations

    def call_cut(body: ChatCompletionRequest) -> ToolCallCut | ForcedCalls | None:
        """What cuts an answer's calls from its content, streamed or whole (None: its content has none): a forced
        tool choice's, else the tool-call blocks where tools are offered with tool_choice 'auto'."""
        if body.forces_calls():
            return ForcedCalls(body.forced_tool())
        if not body.parses_tool_calls():
            return None
        offered = {tool.function.name: tool.function.parameters for tool in body.tools}
        return ToolCallCut(body.parallel_tool_calls, read=hermes_call if calls_as == "hermes" else coder_calls(offered))

    def checked_bad_words(params: SamplingParams) -> BadWords:
        """The request's bad words in tokens; refused where they cannot be honoured (as vLLM refuses ids past the
        vocabulary), or where with allowed_token_ids they could leave no id to draw."""
        if not params.bad_words:
            return ()
        if state.tokenizer is None:
            raise ApiError("bad_words: this model has no tokenizer to spell them in tokens", param="bad_words")
        if params.allowed_token_ids:
            raise ApiError("bad_words: not with allowed_token_ids, which they could leave with no id to draw",
                           param="bad_words")  # fmt: skip
        words = bad_word_ids(state.tokenizer, params.bad_words)
        outside = [token for word in words for token in word if token >= state.vocab_size]
        if outside:
            raise ApiError(f"bad_words: token id {outside[0]} is outside the vocabulary (size {state.vocab_size})",
                           param="bad_words")  # fmt: skip
        return words

    def guided(body, params: SamplingParams, thinking_open: bool | None) -> SamplingParams:
        """The parameters with their guide placed after the think block the answer opens in, if any; a guide the
        server cannot honour for this request is refused, naming the field."""
        if params.guide is None:
            return params
        field = body.guides_given()[0][0]
        if state.tokenizer is None:
            raise ApiError(f"{field}: guided decoding needs the model's tokenizer, which is missing", param=field)
        if params.min_tokens:
            raise ApiError("min_tokens: not with guided decoding, whose grammar says where the output ends",
                           param="min_tokens")  # fmt: skip
        for name in ("allowed_token_ids", "bad_words"):  # what these leave and the grammar could share no id
            if getattr(params, name):
                raise ApiError(f"{name}: not with guided decoding, whose grammar says which ids may come next",
                               param=name)  # fmt: skip
        if params.ignore_eos and not params.stop_token_ids:
            raise ApiError("ignore_eos: a guided output ends with a stop token when its grammar is complete; give "
                           "stop_token_ids or leave ignore_eos out", param="ignore_eos")  # fmt: skip
        if not thinking_open:
            return params
        think_end = single_token_id(state.tokenizer, THINK_TAGS[1])
        if think_end is None:
            raise ApiError(f"{field}: the answer opens inside a think block, and no one token of this tokenizer ends "
                           f"it ({THINK_TAGS[1]!r}), after which the guide would start", param=field)  # fmt: skip
        return replace(params, guide=params.guide.after(think_end))

    def thinking_open(body: ChatCompletionRequest, text: str) -> bool:
        """Whether the answer starts inside a think block: as the rendered prompt ends where the template opens the
        answer's turn; as the message it continues ends where it continues one (no earlier message counts)."""
        if body.add_generation_prompt:
            return prompt_opens_thinking(text)
        last = body.messages[-1]
        return body.continue_final_message and last.role == "assistant" and prompt_opens_thinking(last.content)

    def chat_prompt(body: ChatCompletionRequest) -> tuple[str, list[int], tuple[int, ...]]:
        """The rendered chat, its checked token ids and where each message ends (prompt cache boundaries)."""
        text = render_chat(body)
        prompt_ids = state.tokenizer(text, add_special_tokens=False)["input_ids"]
        kept = truncated(prompt_ids, body.truncate_prompt_tokens, state.context)
        check_prompt(kept, "messages")  # first: message_ends renders every prefix of the messages
        # a truncated prompt's message ends are not where the full render's are
        return text, kept, message_ends(body, kept) if state.engine.cache_enabled and kept is prompt_ids else ()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        # checked on a worker thread, as a guide's grammar compiles there (a large schema's compile is long): a long
        # check, rendering or tokenizing would hold the event loop and every stream on it
        body = await asyncio.to_thread(parse_request, ChatCompletionRequest, await request.body())
        check_model(body.model)
        rid = request_id(request, body)
        text, prompt_ids, keep_at = await asyncio.to_thread(chat_prompt, body)
        generations = start([prompt_ids], body, thinking_open(body, text), keep_at)
        if body.stream:
            return sse(await started(chat_chunks(generations, body, rid)))
        outcomes = await wait(request, generations)

        def choice(index: int, outcome: Outcome) -> dict[str, Any]:
            message: dict[str, Any] = {
                "role": "assistant",
                "content": body.echoed() + outcome.content,
                "reasoning_content": (body.include_reasoning and outcome.reasoning) or None,
                "reasoning": (body.include_reasoning and outcome.reasoning) or None,
            }
            finish_reason = outcome.finish_reason
            if (cut := call_cut(body)) is not None:  # as vLLM answers calls: content null when only calls came
                content, calls = cut.take(outcome.content, last=True)
                message["tool_calls"] = [call.to_openai() for call in calls]
                finish_reason = cut.finish(finish_reason)
                message["content"] = (body.echoed() + content) or (None if calls else "")
            return {
                "index": index,
                "message": message,
                "finish_reason": finish_reason,
                "stop_reason": outcome.stop_reason,
                "logprobs": (
                    chat_logprobs(outcome.token_ids, outcome.logprobs, spelled_as(body), spell_bytes)
                    if body.logprobs
                    else None
                ),
            }

        choices = await shaped(choice, outcomes, body.logprobs or body.prompt_logprobs is not None)
        response = respond(f"chatcmpl-{rid}", "chat.completion", choices, outcomes, [prompt_ids], body.return_token_ids)
        if body.prompt_logprobs is not None:  # where vLLM puts them for a chat: the top level
            response["prompt_logprobs"] = prompt_logprobs(outcomes[0].prompt_logprobs, body.prompt_logprobs, spell)
        return response

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await asyncio.to_thread(parse_request, CompletionRequest, await request.body())  # as a chat's
        check_model(body.model)
        rid = request_id(request, body)
        # tokenized (and decoded for echo) on a worker thread, as a chat is rendered
        prompts, echoed = await asyncio.to_thread(completion_prompts, body)
        generations = start(prompts, body, None)
        if body.stream:
            return sse(await started(completion_chunks(generations, body, echoed, rid)))
        outcomes = await wait(request, generations)
        if body.echoes_only():  # the token drawn after the prompt pass is no part of an answer of the prompt alone
            outcomes = [
                Outcome(finish_reason="length", prompt_logprobs=o.prompt_logprobs, cached_tokens=o.cached_tokens)
                for o in outcomes
            ]

        token_spelling = spelled_as(body)

        def choice(index: int, outcome: Outcome) -> dict[str, Any]:
            logprobs, prompt_ids = None, prompts[index // body.n]  # choices in prompt order, n a prompt
            if body.logprobs is not None and body.echo:  # the prompt's tokens first, the first of them without one
                echoed_part = echoed_logprobs(prompt_ids, outcome.prompt_logprobs, body.logprobs, token_spelling)
                offset = sum(map(len, echoed_part["tokens"]))  # offsets run on through the tokens' own texts
                answer = completion_logprobs(outcome.token_ids, outcome.logprobs, token_spelling, offset)
                logprobs = joined(echoed_part, answer)
            elif body.logprobs is not None:
                logprobs = completion_logprobs(outcome.token_ids, outcome.logprobs, token_spelling)
            return {
                "index": index,
                "text": echoed[index // body.n] + outcome.content,
                "finish_reason": outcome.finish_reason,
                "stop_reason": outcome.stop_reason,
                "logprobs": logprobs,
            } | prompt_part(outcome)

        def prompt_part(outcome: Outcome) -> dict[str, Any]:
            if body.prompt_logprobs is None:
                return {}
            return {"prompt_logprobs": prompt_logprobs(outcome.prompt_logprobs, body.prompt_logprobs, spell)}

        choices = await shaped(choice, outcomes, body.logprobs is not None or body.prompt_logprobs is not None)
        return respond(f"cmpl-{rid}", "text_completion", choices, outcomes, prompts, body.return_token_ids)

    def completion_prompts(body: CompletionRequest) -> tuple[list[list[int]], list[str]]:
        """Each prompt's checked token ids, and the text echo puts before its choices (the prompt's text; a prompt of
        ids decoded, where a tokenizer can)."""
        prompts, echoed = [], []
        for number, prompt in enumerate(body.prompt):
            param = "prompt" if len(body.prompt) == 1 else f"prompt.{number}"
            if isinstance(prompt, str):
                prompt_ids = need_tokenizer(param)(prompt, add_special_tokens=False)["input_ids"]
            else:
                prompt_ids = list(prompt)
            kept = truncated(prompt_ids, body.truncate_prompt_tokens, state.context)
            check_prompt(kept, param)
            prompts.append(kept)
            if not body.echo:
                echoed.append("")
            elif isinstance(prompt, str) and kept is prompt_ids:
                echoed.append(prompt)
            else:
                echoed.append(state.tokenizer.decode(kept) if state.tokenizer is not None else "")
        return prompts, echoed

    async def shaped(choice, outcomes: list[Outcome], with_logprobs: bool) -> list[dict[str, Any]]:
        """Each outcome's choice; with logprobs on a worker thread (a long answer's take a while to spell out)."""

        def choices() -> list[dict[str, Any]]:
            return [choice(index, outcome) for index, outcome in enumerate(outcomes)]

        return await asyncio.to_thread(choices) if with_logprobs else choices()

    def respond(
        response_id: str, kind, choices, outcomes: list[Outcome], prompts: list[list[int]], with_ids: bool
    ) -> dict[str, Any]:
        """The response object of the prompts' choices (as many a prompt, in prompt order); with several choices each
        carries its own token_sha (the top level's is choice 0's)."""
        response = {
            "id": response_id,
            "object": kind,
            "created": int(time.time()),
            "model": state.model_name,
            "choices": choices,
            "usage": choices_usage(prompts, [o.token_ids for o in outcomes], [o.cached_tokens for o in outcomes]),
            "token_sha": token_sha(outcomes[0].token_ids),
        }
        per_prompt = len(outcomes) // len(prompts)
        for index, (choice, outcome) in enumerate(zip(choices, outcomes, strict=True)):
            if len(outcomes) > 1:
                choice["token_sha"] = token_sha(outcome.token_ids)
            if with_ids:  # where vLLM puts the prompt's ids: a chat response's top level, a text completion's choice
                choice["token_ids"] = outcome.token_ids
                (response if kind == "chat.completion" else choice)["prompt_token_ids"] = prompts[index // per_prompt]
        return response

    async def wait(request: Request, generations: list[Generation]) -> list[Outcome]:
        """Collect every choice's non-streamed result; if the client goes away first or one choice fails, every
        choice is aborted and every collection still waiting is cancelled (an abort's last update may never come)."""
        tasks = [asyncio.ensure_future(generation.collect()) for generation in generations]
        try:
            while True:
                done, pending = await asyncio.wait(tasks, timeout=0.5, return_when=asyncio.FIRST_EXCEPTION)
                for task in done:
                    task.result()  # raises the first failure
                if not pending:
                    return [task.result() for task in tasks]
                if await request.is_disconnected():
                    raise ApiError("the client disconnected", status=499)
        finally:
            for generation in generations:
                generation.abort()
            waiting = [task for task in tasks if not task.done()]
            for task in waiting:
                task.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)

    async def stream(
        generations: list[Generation],
        per_prompt: int,
        frame,
        options: StreamOptions | None,
        opening: dict[str, Any] | None = None,
    ) -> AsyncGenerator[dict[str, Any], None]:
        """SSE events of the choices (`per_prompt` a prompt, in prompt order): each choice's first
        `frame(index, None)` chunk (with the `opening` fields), then
        `frame(index, piece)` chunks as pieces come, with `"usage": null` when usage comes last, as OpenAI sends them
        (or, with vLLM's continuous_usage_stats, the usage of the chunk's choice so far); then usage and [DONE]; the
        engine is told when the client leaves."""
        tokens: list[list[int]] = [[] for _ in generations]
        include_usage = state.http.force_include_usage or bool(options and options.include_usage)
        continuous = include_usage and bool(options and options.continuous_usage_stats)

        def usage_so_far(index: int) -> dict[str, Any]:
            if not continuous:
                return {"usage": None} if include_usage else {}
            # vLLM's per-chunk usage has no cached count (the final chunk's has)
            return {"usage": usage(len(generations[index].prompt_ids), len(tokens[index]))}

        try:
            for index in range(len(generations)):
                yield {**frame(index, None), **(opening or {}), **usage_so_far(index)}
            async for index, piece in interleaved(generations):
                tokens[index] += piece.token_ids
                chunk = {**frame(index, piece), **usage_so_far(index)}
                if piece.finish_reason is not None:
                    chunk["token_sha"] = token_sha(tokens[index])
                yield chunk
            if include_usage:
                cached = [generation.request.cached for generation in generations]
                yield {
                    **frame(0, None),
                    "choices": [],
                    "usage": choices_usage([g.prompt_ids for g in generations[::per_prompt]], tokens, cached),
                    "token_sha": token_sha(tokens[0]),
                }
        except ApiError as exc:
            yield exc.body()
        finally:
            for generation in generations:
                generation.abort()

    async def rendered_as_chat(
        chat_body: dict[str, Any], rename: Callable[[ApiError], ApiError]
    ) -> tuple[ChatCompletionRequest, str, list[int], tuple[int, ...]]:
        """Another API's request as its equivalent chat, checked and rendered: (the chat, its prompt's text, ids and
        keep points); each error renamed by `rename` after the field it comes from."""
        try:
            chat = await asyncio.to_thread(parse_request, ChatCompletionRequest, chat_body)
            return chat, *await asyncio.to_thread(chat_prompt, chat)
        except ApiError as exc:
            raise rename(exc) from exc

    async def started_as_chat(
        chat_body: dict[str, Any], rename: Callable[[ApiError], ApiError]
    ) -> tuple[ChatCompletionRequest, list[int], Generation]:
        """Another API's request run as its equivalent chat: checked, rendered, and its one generation started."""
        chat, text, prompt_ids, keep_at = await rendered_as_chat(chat_body, rename)
        try:
            (generation,) = start([prompt_ids], chat, thinking_open(chat, text), keep_at)
        except ApiError as exc:
            raise rename(exc) from exc
        return chat, prompt_ids, generation

    @app.post("/v1/responses")
    async def responses(request: Request):
        """OpenAI's Responses API, a text subset, answered as the equivalent chat (tools and reasoning included)."""
        body = await asyncio.to_thread(parse_request, ResponsesRequest, await request.body())  # as a chat's
        check_model(body.model)
        chat, prompt_ids, generation = await started_as_chat(body.chat_body(), as_responses_error)
        draw, defaults = generation.request.draw, state.sampling_defaults  # the response echoes what it drew with
        shaped = defaults.max_tokens is not None or defaults.max_tokens_cap is not None  # the limit is the server's
        most = generation.request.max_tokens if shaped else body.max_output_tokens
        body = body.model_copy(update={"temperature": draw.temperature, "top_p": draw.top_p, "max_output_tokens": most})
        response_id, created = new_response_id(), int(time.time())
        if body.stream:
            writer = ResponseStream(response_id, created, state.model_name, body)
            return typed_sse(await started(typed_events(generation, chat, writer)))
        (outcome,) = await wait(request, [generation])
        content, calls = outcome.content, []
        if (cut := call_cut(chat)) is not None:
            content, calls = cut.take(outcome.content, last=True)
        return response_object(
            response_id=response_id,
            created=created,
            model=state.model_name,
            request=body,
            reasoning=outcome.reasoning,
            content=content,
            calls=calls,
            finish_reason=outcome.finish_reason,
            input_tokens=len(prompt_ids),
            output_tokens=len(outcome.token_ids),
            cached_tokens=outcome.cached_tokens,
            reasoning_tokens=outcome.reasoning_tokens,
        )

    @app.post("/v1/messages")
    async def messages(request: Request):
        """Anthropic's Messages API, answered as the equivalent chat (tools, thinking and prefill included); errors
        come in Anthropic's shape."""
        try:
            body = await asyncio.to_thread(parse_request, MessagesRequest, await request.body())
            check_model(body.model)
            chat, prompt_ids, generation = await started_as_chat(body.chat_body(), as_messages_error)
            message_id = new_message_id()
            if body.stream:
                writer = MessageStream(message_id, state.model_name, len(prompt_ids))
                return typed_sse(await started(typed_events(generation, chat, writer)))
            (outcome,) = await wait(request, [generation])
        except ApiError as exc:
            return JSONResponse(messages_error_body(exc), status_code=exc.status)
        content, calls = outcome.content, []
        if (cut := call_cut(chat)) is not None:
            content, calls = cut.take(outcome.content, last=True)
        counts = (len(prompt_ids), len(outcome.token_ids), outcome.cached_tokens, outcome.reasoning_tokens)
        end = StreamEnd(outcome.finish_reason or "stop", outcome.stop_reason, *counts)
        reasoning = outcome.reasoning if chat.include_reasoning else ""
        return message_object(message_id, state.model_name, reasoning, content, calls, end)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(request: Request):
        """Anthropic's count of a Messages request's prompt tokens, as its chat template renders them."""
        try:
            body = await asyncio.to_thread(parse_request, CountTokensRequest, await request.body())
            check_model(body.model)
            _, _, prompt_ids, _ = await rendered_as_chat(body.chat_body(), as_messages_error)
        except ApiError as exc:
            return JSONResponse(messages_error_body(exc), status_code=exc.status)
        return {"input_tokens": len(prompt_ids)}

    @app.get("/v1/responses/{response_id}")
    @app.delete("/v1/responses/{response_id}")
    @app.post("/v1/responses/{response_id}/cancel")
    @app.get("/v1/responses/{response_id}/input_items")
    async def stored_response(response_id: str):
        """OpenAI's retrieve, delete and cancel of a stored response, and the list of its input items: nothing is
        stored here, so none is found."""
        raise ApiError(
            f"response_id: {response_id!r} is not stored; this server keeps no responses (store is false)",
            status=404,
            param="response_id",
            code="not_found",
        )

    async def typed_events(
        generation: Generation, chat: ChatCompletionRequest, writer: ResponseStream | MessageStream
    ) -> AsyncGenerator[dict[str, Any], None]:
        """A Responses or Messages stream's events as its generation's pieces come; an error event where it fails;
        the engine is told when the client leaves."""
        cut = call_cut(chat)
        tokens, reasoning_tokens, finish_reason, stop_reason = 0, 0, "stop", None
        try:
            for event in writer.opening():
                yield event
            async for piece in generation.pieces():
                tokens += len(piece.token_ids)
                reasoning_tokens += piece.reasoning_tokens
                content, calls = piece.content, []
                if cut is not None:
                    content, calls = cut.take(piece.content, piece.finish_reason is not None)
                for event in writer.feed(piece.reasoning if chat.include_reasoning else "", content, calls):
                    yield event
                finish_reason = piece.finish_reason or finish_reason
                stop_reason = piece.stop_reason if piece.stop_reason is not None else stop_reason
            counts = (len(generation.prompt_ids), tokens, generation.request.cached, reasoning_tokens)
            for event in writer.closing(StreamEnd(finish_reason, stop_reason, *counts)):
                yield event
        except ApiError as exc:
            for event in writer.failure(exc):
                yield event
        finally:
            generation.abort()

    def chat_chunks(
        generations: list[Generation], body: ChatCompletionRequest, rid: str
    ) -> AsyncGenerator[dict[str, Any], None]:
        created, chunk_id = int(time.time()), f"chatcmpl-{rid}"
        token_spelling = spelled_as(body)
        with_logprobs, with_ids = generations[0].request.draw.logprobs is not None, body.return_token_ids
        # each choice's tool-call blocks, cut from its content as they close
        cuts = [cut for _ in generations if (cut := call_cut(body)) is not None] or None  # one a choice, or none

        def frame(index: int, piece) -> dict[str, Any]:
            delta: dict[str, Any] = {"role": "assistant", "content": body.echoed()} if piece is None else {}
            choice: dict[str, Any] = {
                "index": index,
                "delta": delta,
                "finish_reason": None,
                "stop_reason": None,
                "logprobs": None,
            }
            if piece is not None:
                content, calls = piece.content, []
                if cuts is not None:
                    content, calls = cuts[index].deltas(piece.content, piece.finish_reason is not None)
                reasoning = piece.reasoning if body.include_reasoning else ""
                if content or not (reasoning or calls):
                    delta["content"] = content
                if reasoning:
                    delta["reasoning_content"] = delta["reasoning"] = reasoning
                if calls:
                    delta["tool_calls"] = calls
                finish_reason = piece.finish_reason if cuts is None else cuts[index].finish(piece.finish_reason)
                choice.update(finish_reason=finish_reason, stop_reason=piece.stop_reason)
                if with_logprobs:
                    choice["logprobs"] = chat_logprobs(piece.token_ids, piece.logprobs, token_spelling, spell_bytes)
                if with_ids:
                    choice["token_ids"] = piece.token_ids
            return {
                "id": chunk_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": state.model_name,
                "choices": [choice],
            }

        opening = {"prompt_token_ids": generations[0].prompt_ids} if with_ids else None  # vLLM puts them on top
        return stream(generations, body.n, frame, body.stream_options, opening)

    def completion_chunks(
        generations: list[Generation], body: CompletionRequest, echoed: list[str], rid: str
    ) -> AsyncGenerator[dict[str, Any], None]:
        created, chunk_id = int(time.time()), f"cmpl-{rid}"
        token_spelling = spelled_as(body)
        with_logprobs, with_ids = generations[0].request.draw.logprobs is not None, body.return_token_ids
        spelled = [0] * len(generations)  # each choice's characters of token text sent: its next text_offset
        # with logprobs the echoed prompt waits for its logprobs, which come with each choice's first piece
        echo_later = [body.echo and with_logprobs] * len(generations)

        def frame(index: int, piece) -> dict[str, Any]:
            choice: dict[str, Any] = {
                "index": index,
                # a choice's first chunk echoes its prompt
                "text": echoed[index // body.n] if piece is None and not echo_later[index] else "",
                "finish_reason": None,
                "stop_reason": None,
                "logprobs": None,
            }
            if piece is None and with_ids:  # a choice's first chunk (the usage chunk's choices are replaced)
                choice["prompt_token_ids"] = generations[index].prompt_ids
            if piece is not None:
                choice.update(text=piece.content, finish_reason=piece.finish_reason, stop_reason=piece.stop_reason)
                if with_logprobs:
                    echo_part = None
                    if echo_later[index]:  # the prompt's tokens first, as the non-streamed echo gives them
                        choice["text"], echo_later[index] = echoed[index // body.n] + piece.content, False
                        prompt = generations[index].prompt_ids
                        if len(piece.prompt_logprobs) == len(prompt) - 1:  # none if it ended before its first token
                            echo_part = echoed_logprobs(prompt, piece.prompt_logprobs, body.logprobs, token_spelling)
                            spelled[index] = sum(map(len, echo_part["tokens"]))
                    logprobs = completion_logprobs(piece.token_ids, piece.logprobs, token_spelling, spelled[index])
                    spelled[index] += sum(map(len, logprobs["tokens"]))
                    choice["logprobs"] = logprobs if echo_part is None else joined(echo_part, logprobs)
                if with_ids:
                    choice["token_ids"] = piece.token_ids
            return {
                "id": chunk_id,
                "object": "text_completion",
                "created": created,
                "model": state.model_name,
                "choices": [choice],
            }

        return stream(generations, body.n, frame, body.stream_options)

    def model_card(name: str) -> dict[str, Any]:
        """The served model under one of its names, as /v1/models lists it, with vLLM's max_model_len."""
        return {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "flashnext",
            "max_model_len": state.context,
        }

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(name) for name in (state.model_name, *state.aliases)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        """OpenAI's retrieve of one model (a name may hold slashes, as a Hugging Face repo's does)."""
        check_model(name)
        return model_card(name)

    @app.get("/version")
    async def version():
        return {"version": server_version()}

    @app.get("/health")
    @app.get("/ping")  # SageMaker's health check
    @app.post("/ping")
    async def health():
        try:
            stats = await state.engine.stats()
        except EngineStopped as exc:
            raise ApiError(str(exc), status=503, type="server_error") from exc
        return {"status": "ok", "model": state.model_name, "context": state.context, **stats}

    @app.post("/invocations")
    async def invocations(request: Request):
        """SageMaker's one inference route: a body with messages is a chat, one with a prompt a text completion."""
        body = await json_body(request)  # the request keeps its bytes: the route taking it reads them again
        if "messages" in body:
            return await chat(request)
        if "prompt" in body:
            return await completions(request)
        raise ApiError("the body needs messages (a chat) or prompt (a text completion)", param="messages")

    @app.get("/load")
    async def server_load():
        """vLLM's: the generation requests in flight (0 unless --enable-server-load-tracking)."""
        return {"server_load": load.count}

    @app.get("/metrics")
    async def metrics():
        try:
            text = await state.engine.metrics()
        except EngineStopped as exc:
            raise ApiError(str(exc), status=503, type="server_error") from exc
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await json_body(request)
        check_model(body.get("model"))
        spelled = body.get("return_token_strs")
        spelled = False if spelled is None else spelled  # vLLM's Optional[bool]: null is false
        if not isinstance(spelled, bool):
            raise ApiError("return_token_strs: expected true or false", param="return_token_strs")
        ids = await asyncio.to_thread(tokenize_body, body)  # on a worker thread, as the completion routes tokenize
        strs = state.tokenizer.convert_ids_to_tokens(ids) if spelled else None  # vLLM's token_strs
        return {"tokens": ids, "count": len(ids), "max_model_len": state.context, "token_strs": strs}

    def tokenize_body(body: dict[str, Any]) -> list[int]:
        """The token ids of a /tokenize body's chat or prompt."""
        tokenizer = need_tokenizer("prompt")
        if "messages" in body:
            rendering = {key: body[key] for key in CHAT_RENDERING_FIELDS if key in body}
            chat = parse_request(ChatCompletionRequest, {"messages": body["messages"], **rendering})
            ids = tokenizer(render_chat(chat), add_special_tokens=False)["input_ids"]
        elif isinstance(body.get("prompt"), str):
            special = body.get("add_special_tokens", False)
            if not isinstance(special, bool):
                raise ApiError("add_special_tokens: expected true or false", param="add_special_tokens")
            ids = tokenizer(body["prompt"], add_special_tokens=special)["input_ids"]
        else:
            raise ApiError("prompt: expected a string (or send messages)", param="prompt")
        return ids

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await json_body(request)
        check_model(body.get("model"))
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < state.vocab_size for t in ids
        ):
            raise ApiError(f"tokens: expected a list of token ids in [0, {state.vocab_size})", param="tokens")
        return {"prompt": need_tokenizer("tokens").decode(ids)}

    return app


async def json_body(request: Request) -> dict[str, Any]:
    """The body as a JSON object, read by the completion routes' parser: no NaN, and no lone surrogate escape, which
    Python's json module takes as text that no tokenizer can encode."""
    try:
        body = from_json(await request.body(), allow_inf_nan=False)
    except ValueError as exc:
        raise ApiError(f"the body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError("the body must be a JSON object")
    return body


async def started(events: AsyncGenerator[dict[str, Any], None]) -> AsyncIterator[dict[str, Any]]:
    """The events with the first already taken: their generator has begun, so its `finally` (which tells the engine
    to stop) runs even where the client leaves before the response's first byte and the rest is never asked for."""
    first = await anext(events)

    async def chained() -> AsyncIterator[dict[str, Any]]:
        yield first
        async for event in events:
            yield event

    return chained()


def typed_sse(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    """Server-sent events as OpenAI's Responses API sends them: each event's type on an `event:` line, then its JSON
    (no [DONE]: the last event says the response ended)."""

    async def lines() -> AsyncIterator[str]:
        async for event in events:
            yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream")


def sse(events: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    """Server-sent events, one JSON object per `data:` line, closed by [DONE]."""

    async def lines() -> AsyncIterator[str]:
        async for event in events:
            yield f"data: {json.dumps(event)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(lines(), media_type="text/event-stream")
