"""A small streaming client for /v1/chat/completions and /v1/completions: one SSE reader keeps ids, sha and times."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT = 600.0


class StreamError(RuntimeError):
    """The server refused the request, sent an error, or broke off the stream."""


@dataclass
class StreamResult:
    """What one streamed completion returned, with perf_counter times of each piece that carried output."""

    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    reasoning: str = ""
    token_sha: str | None = None
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    started: float = 0.0
    piece_times: list[float] = field(default_factory=list)
    piece_tokens: list[int] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        """Seconds from sending the request to the first piece."""
        return self.piece_times[0] - self.started if self.piece_times else None

    @property
    def tokens(self) -> int:
        """Completion tokens: the streamed ids, else the usage count."""
        if self.token_ids:
            return len(self.token_ids)
        return int((self.usage or {}).get("completion_tokens", 0))

    def is_short(self, asked: int) -> bool:
        """Whether it ended before the `asked` tokens (a stop or a server cap): its figures are of a shorter run."""
        return self.finish_reason != "length" or self.tokens != asked

    @property
    def decode_tok_s(self) -> float | None:
        """Decode speed: (tokens - 1) over the time from the first piece to the last."""
        if self.tokens < 2 or len(self.piece_times) < 2 or self.piece_times[-1] <= self.piece_times[0]:
            return None
        return (self.tokens - 1) / (self.piece_times[-1] - self.piece_times[0])

    @property
    def token_gaps(self) -> list[float]:
        """Inter-token latencies: each piece after the first spreads its gap over the token ids it carried."""
        gaps: list[float] = []
        for before, now, count in zip(self.piece_times[:-1], self.piece_times[1:], self.piece_tokens[1:], strict=True):
            if count:
                gaps += [(now - before) / count] * count
        return gaps


def float_list(text: str) -> list[float]:
    """Parse a comma-separated list of floats (an argparse type)."""
    return [float(item) for item in text.split(",") if item.strip()]


def int_list(text: str) -> list[int]:
    """Parse a comma-separated list of integers (an argparse type)."""
    return [int(item) for item in text.split(",") if item.strip()]


def token_sha(token_ids: list[int]) -> str:
    """SHA-256 hex of the token ids joined by commas, as the server computes token_sha."""
    return hashlib.sha256(",".join(str(t) for t in token_ids).encode()).hexdigest()


def headers(api_key: str | None) -> dict[str, str]:
    """Request headers, with a bearer token when an API key is given."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def open_client(timeout: float = DEFAULT_TIMEOUT, connections: int | None = None) -> httpx.Client:
    """An HTTP client for streams; making one loads TLS certificates (milliseconds), so make it before the clock.
    `connections`: requests it keeps in flight at once (httpx's default pool holds 100)."""
    limits = httpx.Limits() if connections is None else httpx.Limits(max_connections=connections)
    return httpx.Client(timeout=timeout, trust_env=False, limits=limits)


def resolve_model(base_url: str, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT) -> str:
    """The first model id that GET /v1/models lists."""
    try:
        with open_client(timeout) as client:
            response = client.get(f"{base_url.rstrip('/')}/v1/models", headers=headers(api_key))
    except httpx.HTTPError as exc:
        raise StreamError(f"GET /v1/models: {exc!r}") from exc
    if response.status_code != 200:
        raise StreamError(f"GET /v1/models: HTTP {response.status_code}: {response.text}")
    models = response.json().get("data") or []
    if not models:
        raise StreamError("GET /v1/models lists no model")
    return str(models[0]["id"])


def bench_fields(
    model: str, max_tokens: int, temperature: float, seed: int | None, top_k: int, top_p: float
) -> dict[str, Any]:
    """Fields of every benchmark request: ignore_eos, token ids on; top_k, top_p and seed only when sampling."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    if temperature > 0:
        body.update(top_k=top_k, top_p=top_p, seed=seed)
    return body


def chat_body(
    model: str,
    prompt: str,
    max_tokens: int,
    temperature: float,
    seed: int | None = None,
    top_k: int = 0,
    top_p: float = 1.0,
    thinking: bool = False,
) -> dict[str, Any]:
    """A benchmark chat request: one user message, with the thinking switch of the chat template."""
    return {
        **bench_fields(model, max_tokens, temperature, seed, top_k, top_p),
        "messages": [{"role": "user", "content": prompt}],
        "chat_template_kwargs": {"enable_thinking": thinking},
    }


def completion_body(
    model: str,
    prompt_ids: list[int],
    max_tokens: int,
    temperature: float,
    seed: int | None = None,
    top_k: int = 0,
    top_p: float = 1.0,
) -> dict[str, Any]:
    """A benchmark text-completion request whose prompt is token ids (no tokenizer needed on the server)."""
    return {**bench_fields(model, max_tokens, temperature, seed, top_k, top_p), "prompt": prompt_ids}


def _read_chunk(chunk: dict[str, Any], result: StreamResult) -> None:
    """Fold one parsed chunk into the result, stamping a piece time when it carries output."""
    if "error" in chunk:
        raise StreamError(f"server error in stream: {chunk['error']}")
    if chunk.get("token_sha"):
        result.token_sha = str(chunk["token_sha"])
    if chunk.get("usage"):
        result.usage = chunk["usage"]
    carried, count = False, 0
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        ids = choice.get("token_ids") or []
        text = (delta.get("content") or "") + (choice.get("text") or "")
        result.token_ids.extend(int(t) for t in ids)
        result.text += text
        result.reasoning += delta.get("reasoning_content") or ""
        carried = carried or bool(ids or text or delta.get("reasoning_content"))
        count += len(ids)
        if choice.get("finish_reason"):
            result.finish_reason = str(choice["finish_reason"])
    if carried:
        result.piece_times.append(time.perf_counter())
        result.piece_tokens.append(count)


def stream_chat(
    base_url: str,
    body: dict[str, Any],
    api_key: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    client: httpx.Client | None = None,
) -> StreamResult:
    """Stream body from /v1/chat/completions (on client, else on a client of its own)."""
    return _stream(f"{base_url.rstrip('/')}/v1/chat/completions", body, api_key, timeout, client)


def stream_completion(
    base_url: str,
    body: dict[str, Any],
    api_key: str | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    client: httpx.Client | None = None,
) -> StreamResult:
    """Stream body from /v1/completions (on client, else on a client of its own)."""
    return _stream(f"{base_url.rstrip('/')}/v1/completions", body, api_key, timeout, client)


def _stream(
    url: str, body: dict[str, Any], api_key: str | None, timeout: float, client: httpx.Client | None = None
) -> StreamResult:
    """POST body to url as a stream with usage and read its SSE chunks until [DONE]."""
    if client is None:
        with open_client(timeout) as own:
            return _stream(url, body, api_key, timeout, own)
    request = {**body, "stream": True, "stream_options": {"include_usage": True}}
    result = StreamResult()
    try:
        result.started = time.perf_counter()
        with client.stream("POST", url, json=request, headers=headers(api_key)) as response:
            if response.status_code != 200:
                raise StreamError(f"HTTP {response.status_code}: {response.read().decode(errors='replace')}")
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:") :].strip()
                if payload == "[DONE]":
                    return result
                try:
                    chunk = json.loads(payload)
                except json.JSONDecodeError as exc:
                    raise StreamError(f"malformed SSE data: {payload[:200]!r}") from exc
                _read_chunk(chunk, result)
    except httpx.HTTPError as exc:
        raise StreamError(f"POST {url}: {exc!r}") from exc
    raise StreamError("the stream ended before [DONE]")
