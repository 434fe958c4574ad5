"""The HTTP server's own options, as vLLM's flags spell them (CORS, a proxy's root path, TLS, uvicorn's access log,
the docs pages), and SageMaker's /ping and /invocations."""

from __future__ import annotations

import asyncio
import json
import logging
import ssl

import httpx
import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from server.app import ServerState, build_app
from server.cli import build_parser, main
from server.engine import Update
from server.http_options import DEFAULT_HTTP, http_options
from tests.server.live import serve, tiny_chat_checkpoint
from tests.server.test_tool_calls_api import SHIPPED, Answering

ASK = [{"role": "user", "content": "What colour is the sky?"}]
PREFLIGHT = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}


class Healthy(Answering):
    """The scripted engine, with the stats /health and /ping report."""

    async def stats(self) -> dict:
        return {"lanes_busy": 0}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(SHIPPED)


def options(*flags: str):
    return http_options(build_parser().parse_args(["serve", *flags]))


def client(tokenizer, *flags: str, api_key: str | tuple[str, ...] | None = None) -> TestClient:
    engine = Healthy(tokenizer, "Blue.")
    state = ServerState(engine, tokenizer, "m", 4096, len(tokenizer), (0,), api_key, http=options(*flags))
    return TestClient(build_app(state))


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> dict[str, str]:
    """A CA; a certificate it signed for 127.0.0.1 with its key, plain and encrypted; and a client's certificate it
    signed, with its key: as files."""
    trustme = pytest.importorskip("trustme")  # a test extra; the GPU machine's suite has none
    serialization = pytest.importorskip("cryptography.hazmat.primitives.serialization")
    folder = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    server, client = ca.issue_cert("127.0.0.1"), ca.issue_cert("client@example.org")
    files = {name: folder / f"{name}.pem" for name in ("ca", "cert", "key", "locked", "client")}
    ca.cert_pem.write_to_path(str(files["ca"]))
    server.cert_chain_pems[0].write_to_path(str(files["cert"]))
    server.private_key_pem.write_to_path(str(files["key"]))
    client.private_key_and_cert_chain_pem.write_to_path(str(files["client"]))
    key = serialization.load_pem_private_key(server.private_key_pem.bytes(), password=None)
    files["locked"].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                          serialization.BestAvailableEncryption(b"pass phrase"))
    )  # fmt: skip
    return {name: str(path) for name, path in files.items()}


def test_the_flags_defaults_are_the_options_defaults():
    """What a server built without flags (the tests' apps) gets is what `serve` gets: any origin, method and header
    (as vLLM's), no credentials, no root path, docs on, plain HTTP; a root path of / is none, methods are upper case."""
    assert options() == DEFAULT_HTTP == options("--root-path", "/")
    defaults = DEFAULT_HTTP
    assert (defaults.allowed_origins, defaults.allow_credentials, defaults.scheme) == (("*",), False, "http")
    assert options("--allowed-methods", '["get", "Post"]').allowed_methods == ("GET", "POST")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--allowed-origins", "*"], "--allowed-origins: not valid JSON"),
        (["--allowed-methods", '"GET"'], "--allowed-methods: expected a JSON list of strings"),
        (["--allowed-headers", "[1]"], "--allowed-headers: expected a JSON list of strings"),
        (["--root-path", "llm"], "--root-path: expected a path that starts with /"),
        (["--root-path", "/llm/"], "--root-path: expected a path that starts with / and does not end with one"),
        (["--ssl-keyfile", "{key}"], "--ssl-keyfile: needs --ssl-certfile"),
        (["--ssl-cert-reqs", "1"], "--ssl-cert-reqs: needs --ssl-certfile"),
        (["--ssl-certfile", "{ca}/missing.pem"], "--ssl-certfile: cannot load a certificate and its key"),
        (["--ssl-certfile", "{cert}", "--ssl-keyfile", "{ca}"], "--ssl-certfile and --ssl-keyfile: cannot load"),
        (["--ssl-certfile", "{cert}", "--ssl-keyfile", "{key}", "--ssl-cert-reqs", "2"], "--ssl-cert-reqs 2: needs "
         "--ssl-ca-certs"),
        (["--ssl-certfile", "{cert}", "--ssl-keyfile", "{key}", "--ssl-cert-reqs", "1"], "--ssl-cert-reqs 1: needs "
         "--ssl-ca-certs"),
        (["--ssl-certfile", "{cert}", "--ssl-keyfile", "{key}", "--ssl-ca-certs", "{ca}"], "--ssl-ca-certs: verifies "
         "nothing under --ssl-cert-reqs 0"),
        (["--ssl-certfile", "{cert}", "--ssl-keyfile", "{locked}"], "--ssl-keyfile: the key is encrypted"),
        (["--ssl-certfile", "{cert}", "--ssl-keyfile", "{key}", "--ssl-ca-certs", "{key}", "--ssl-cert-reqs", "2"],
         "--ssl-ca-certs: cannot load CA certificates"),
    ],
)  # fmt: skip
def test_bad_http_flags_are_refused_by_name_before_the_model_loads(capsys, monkeypatch, tls, flags, message):
    import server.serve

    monkeypatch.setattr(server.serve, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert main(["serve", *(flag.format(**tls) for flag in flags)]) == 2
    assert message in capsys.readouterr().err


def test_a_browsers_preflight_is_answered_before_the_key_and_a_refusal_carries_cors_headers(tokenizer):
    http = client(tokenizer, api_key="sekrit")
    preflight = http.options("/v1/chat/completions", headers={**PREFLIGHT, "Access-Control-Request-Headers": "x"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "*"
    refused = http.post("/v1/chat/completions", json={"messages": ASK}, headers={"Origin": "https://app.example"})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"


def test_any_of_several_api_keys_is_taken_in_either_header(tokenizer):
    """vLLM's --api-key KEY [KEY ...]: a request with any of the keys is served, as a bearer or as x-api-key."""
    http = client(tokenizer, api_key=("first", "second"))
    for key in ("first", "second"):
        assert http.get("/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
        assert http.get("/v1/models", headers={"x-api-key": key}).status_code == 200
    for headers in ({"Authorization": "Bearer third"}, {"x-api-key": "firstsecond"}, {}):
        assert http.get("/v1/models", headers=headers).status_code == 401


def test_only_the_allowed_origins_are_answered_as_cors(tokenizer):
    http = client(tokenizer, "--allowed-origins", '["https://app.example"]', "--allow-credentials")
    allowed = http.get("/v1/models", headers={"Origin": "https://app.example"})
    assert allowed.headers["access-control-allow-origin"] == "https://app.example"
    assert allowed.headers["access-control-allow-credentials"] == "true"
    assert "access-control-allow-origin" not in http.get("/v1/models", headers={"Origin": "https://x.example"}).headers
    assert http.options("/v1/models", headers={**PREFLIGHT, "Origin": "https://x.example"}).status_code == 400


def test_a_root_path_routes_with_its_prefix_or_without_and_keeps_the_public_paths_public(tokenizer):
    http = client(tokenizer, "--root-path", "/llm", api_key="sekrit")
    key = {"Authorization": "Bearer sekrit"}
    assert [http.get(path, headers=key).status_code for path in ("/llm/v1/models", "/v1/models")] == [200, 200]
    assert [http.get(path).status_code for path in ("/llm/health", "/health", "/llm/ping")] == [200, 200, 200]
    assert http.get("/llm/v1/models").status_code == 401
    assert http.post("/llm/v1/messages", json={}).json()["type"] == "error"  # Anthropic's shape under the prefix


@pytest.mark.parametrize(("flags", "status"), [((), 200), (("--disable-fastapi-docs",), 404)])
def test_the_docs_pages_are_served_unless_disabled(tokenizer, flags, status):
    http = client(tokenizer, *flags)
    assert [http.get(path).status_code for path in ("/docs", "/redoc", "/openapi.json")] == [status] * 3


def test_ping_answers_as_health_without_the_key(tokenizer):
    http = client(tokenizer, api_key="sekrit")
    health = http.get("/health").json()
    assert http.get("/ping").json() == health == http.post("/ping").json() and health["status"] == "ok"


def test_invocations_serve_a_chat_or_a_text_completion_by_the_bodys_fields(tokenizer):
    http = client(tokenizer, api_key="sekrit")
    key = {"Authorization": "Bearer sekrit"}
    chat = {"messages": ASK, "max_tokens": 8, "chat_template_kwargs": {"enable_thinking": False}}
    invoked = http.post("/invocations", json=chat, headers=key).json()
    direct = http.post("/v1/chat/completions", json=chat, headers=key).json()
    assert invoked["object"] == "chat.completion" and invoked["choices"] == direct["choices"]
    assert invoked["choices"][0]["message"]["content"] == "Blue."
    text = http.post("/invocations", json={"prompt": "The sky is", "max_tokens": 8}, headers=key).json()
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == "Blue."
    streamed = http.post("/invocations", json={**chat, "stream": True}, headers=key)
    assert streamed.headers["content-type"].startswith("text/event-stream") and "data: [DONE]" in streamed.text
    both = http.post("/invocations", json={**chat, "prompt": "The sky is"}, headers=key).json()
    assert both["object"] == "chat.completion"  # as vLLM, which tries a chat first
    neither = http.post("/invocations", json={"input": "hi"}, headers=key)
    assert neither.status_code == 400 and neither.json()["error"]["param"] == "messages"
    bad = http.post("/invocations", json={**chat, "temperature": -1}, headers=key)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
    assert http.post("/invocations", json=chat).status_code == 401


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_chat_checkpoint(tmp_path_factory.mktemp("http-options") / "tiny-chat")


class Records(logging.Handler):
    """The records a logger emits."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_tls_is_served_with_the_certificate_given_and_asks_for_the_clients_where_told(checkpoint, tls):
    flags = ["--ssl-certfile", tls["cert"], "--ssl-keyfile", tls["key"], "--ssl-ca-certs", tls["ca"]]
    with serve(checkpoint, *flags, "--ssl-cert-reqs", "2") as live:
        trusted = ssl.create_default_context(cafile=tls["ca"])
        with pytest.raises(httpx.TransportError):  # no client certificate
            httpx.post(f"{live.v1}/completions", json={"prompt": "Hi", "max_tokens": 2}, verify=trusted)
        trusted.load_cert_chain(tls["client"])
        answer = httpx.post(f"{live.v1}/completions", json={"prompt": "Hi", "max_tokens": 2}, verify=trusted)
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the CA
            httpx.get(f"{live.url}/health")
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    ("flags", "logged"),
    [((), False), (("--uvicorn-log-level", "info"), True),
     (("--uvicorn-log-level", "info", "--disable-uvicorn-access-log"), None)],
)  # fmt: skip
def test_each_request_is_logged_at_info_unless_disabled(checkpoint, flags, logged):
    """Not at the default level (warning); at info, unless the access log is disabled, which leaves its logger
    without handlers (uvicorn then logs no request at all)."""
    access, records = logging.getLogger("uvicorn.access"), Records()
    with serve(checkpoint, *flags) as live:
        if logged is None:
            assert not access.hasHandlers()
            return
        access.addHandler(records)
        try:
            httpx.post(f"{live.v1}/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        finally:
            access.removeHandler(records)
    assert any("POST /v1/completions" in record.getMessage() for record in records.records) == logged


def test_a_response_carries_the_request_id_it_was_given_or_a_new_one(tokenizer):
    http = client(tokenizer)
    chat = {"messages": ASK, "max_tokens": 8}
    assert http.post("/v1/chat/completions", json=chat, headers={"X-Request-Id": "abc"}).json()["id"] == "chatcmpl-abc"
    text = {"prompt": "The sky is", "max_tokens": 8, "request_id": "from-body"}
    assert http.post("/v1/completions", json=text).json()["id"] == "cmpl-from-body"
    assert http.post("/v1/completions", json=text, headers={"X-Request-Id": "h"}).json()["id"] == "cmpl-h"
    made = {http.post("/v1/chat/completions", json=chat).json()["id"] for _ in range(2)}
    assert len(made) == 2 and all(len(rid) == len("chatcmpl-") + 32 for rid in made)
    streamed = http.post("/v1/chat/completions", json={**chat, "stream": True}, headers={"X-Request-Id": "s"}).text
    ids = {json.loads(line[6:])["id"] for line in streamed.splitlines() if line.startswith("data: {")}
    assert ids == {"chatcmpl-s"}
    assert "x-request-id" not in http.get("/health").headers  # only with --enable-request-id-headers


@pytest.mark.parametrize(
    ("fields", "headers", "param"),
    [({"request_id": "é"}, {}, "request_id"), ({"request_id": ""}, {}, "request_id"),
     ({}, {"X-Request-Id": "x" * 257}, "X-Request-Id")],
)  # fmt: skip
def test_a_request_id_that_cannot_come_back_is_refused_by_name(tokenizer, fields, headers, param):
    answer = client(tokenizer).post("/v1/chat/completions", json={"messages": ASK, **fields}, headers=headers)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text


def test_request_id_headers_carry_the_responses_id_on_every_answer(tokenizer):
    http = client(tokenizer, "--enable-request-id-headers", api_key="sekrit")
    key = {"Authorization": "Bearer sekrit"}
    body = {"messages": ASK, "max_tokens": 8, "request_id": "mine"}
    whole = http.post("/v1/chat/completions", json=body, headers=key)
    assert whole.headers["x-request-id"] == "mine" and whole.json()["id"] == "chatcmpl-mine"
    made = http.post("/v1/completions", json={"prompt": "The sky is", "stream": True}, headers=key)
    assert f"cmpl-{made.headers['x-request-id']}" in made.text
    assert http.get("/health", headers={"X-Request-Id": "probe"}).headers["x-request-id"] == "probe"
    refused = http.post("/v1/chat/completions", json=body, headers={"X-Request-Id": "r"})
    assert refused.status_code == 401 and refused.headers["x-request-id"] == "r"


def stream_usage(http: TestClient, **fields) -> list:
    """The usage of each chunk of a streamed chat that has one."""
    text = http.post("/v1/chat/completions", json={"messages": ASK, "stream": True, **fields}).text
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    return [chunk["usage"] for chunk in chunks if "usage" in chunk]


def test_forced_usage_ends_every_stream_with_it(tokenizer):
    plain, forced = client(tokenizer), client(tokenizer, "--enable-force-include-usage")
    assert stream_usage(plain) == []
    for fields in ({}, {"stream_options": {"include_usage": False}}):
        usages = stream_usage(forced, **fields)
        assert usages[-1]["completion_tokens"] == len(tokenizer("Blue.")["input_ids"]) and usages[0] is None
    continuous = stream_usage(forced, stream_options={"continuous_usage_stats": True})
    assert (
        all(u is not None for u in continuous)
        and continuous[-1]["completion_tokens"] > continuous[0]["completion_tokens"]
    )


def test_logprobs_spell_tokens_as_ids_where_the_flag_or_the_request_asks(checkpoint):
    ask = {"messages": ASK, "max_tokens": 4, "temperature": 0, "logprobs": True, "top_logprobs": 2,
           "return_token_ids": True, "ignore_eos": True}  # fmt: skip
    text = {"prompt": "Hi there", "max_tokens": 3, "temperature": 0, "logprobs": 1, "echo": True, "ignore_eos": True}
    with serve(checkpoint, "--return-tokens-as-token-ids") as live:
        by_flag = httpx.post(f"{live.v1}/chat/completions", json=ask, timeout=120).json()["choices"][0]
        by_text = httpx.post(f"{live.v1}/chat/completions", json={**ask, "return_tokens_as_token_ids": False},
                             timeout=120).json()["choices"][0]  # fmt: skip
        echoed = httpx.post(f"{live.v1}/completions", json=text, timeout=120).json()["choices"][0]["logprobs"]
    with serve(checkpoint) as live:
        asked = httpx.post(f"{live.v1}/chat/completions", json={**ask, "return_tokens_as_token_ids": True},
                           timeout=120).json()["choices"][0]  # fmt: skip
        plain = httpx.post(f"{live.v1}/chat/completions", json=ask, timeout=120).json()["choices"][0]
    content = by_flag["logprobs"]["content"]
    assert [entry["token"] for entry in content] == [f"token_id:{token}" for token in by_flag["token_ids"]]
    spelled = plain["logprobs"]["content"]
    assert [entry["bytes"] for entry in content] == [entry["bytes"] for entry in spelled]  # the tokens' own bytes
    assert all(top["token"].startswith("token_id:") for entry in content for top in entry["top_logprobs"])
    assert asked["logprobs"] == by_flag["logprobs"]
    assert by_text["logprobs"] == plain["logprobs"] and not plain["logprobs"]["content"][0]["token"].startswith("tok")
    assert len(echoed["tokens"]) > 3 and all(token.startswith("token_id:") for token in echoed["tokens"])
    assert echoed["text_offset"] == [sum(map(len, echoed["tokens"][:at])) for at in range(len(echoed["tokens"]))]


async def asgi_call(app, method: str, path: str, body: dict | None = None) -> list[dict]:
    """One request straight to the ASGI app (its client stays until the answer ends): the messages it sent."""
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": json.dumps(body or {}).encode(), "more_body": False}]

    async def receive() -> dict:
        if messages:
            return messages.pop()
        await asyncio.Event().wait()  # a client that never leaves
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    headers = [(b"content-type", b"application/json")]
    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "root_path": "",
             "query_string": b"", "headers": headers, "http_version": "1.1", "scheme": "http"}  # fmt: skip
    await app(scope, receive, send)
    return sent


@pytest.mark.parametrize("tracking", [True, False])
def test_load_counts_the_generation_requests_in_flight_until_their_answers_end(tokenizer, tracking):
    engine = Answering(tokenizer, "Blue.")
    held = []
    engine.submit = held.append  # each request waits until the test ends it
    flags = ["--enable-server-load-tracking"] if tracking else []
    state = ServerState(engine, tokenizer, "m", 4096, len(tokenizer), (0,), http=options(*flags))
    app = build_app(state)

    async def load() -> int:
        answer = await asgi_call(app, "GET", "/load")
        return json.loads(answer[-1]["body"])["server_load"]

    async def main() -> list[int]:
        seen = [await load()]
        chat = {"messages": ASK, "max_tokens": 4, "stream": True}
        streams = [asyncio.create_task(asgi_call(app, "POST", "/v1/chat/completions", chat)) for _ in range(2)]
        text = asyncio.create_task(asgi_call(app, "POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 4}))
        async with asyncio.timeout(60):  # a request that never reaches the engine fails the test, not hangs it
            while len(held) < 3:
                await asyncio.sleep(0.01)
        seen.append(await load())
        for request in held:
            request.sink(Update((), "length"))
        await asyncio.gather(*streams, text)
        seen.append(await load())
        return seen

    assert asyncio.run(main()) == ([0, 3, 0] if tracking else [0, 0, 0])
