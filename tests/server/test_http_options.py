"""The HTTP server's own options, as vLLM's flags spell them (CORS, a proxy's root path, TLS, uvicorn's access log,
the docs pages), and SageMaker's /ping and /invocations."""

from __future__ import annotations

import logging
import ssl

import httpx
import pytest
import trustme
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from server.app import ServerState, build_app
from server.cli import build_parser, main
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


def client(tokenizer, *flags: str, api_key: str | None = None) -> TestClient:
    engine = Healthy(tokenizer, "Blue.")
    state = ServerState(engine, tokenizer, "m", 4096, len(tokenizer), (0,), api_key, http=options(*flags))
    return TestClient(build_app(state))


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> dict[str, str]:
    """A CA, and a certificate it signed for 127.0.0.1 with its key, as files."""
    folder = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1")
    files = {"ca": folder / "ca.pem", "cert": folder / "cert.pem", "key": folder / "key.pem"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    issued.cert_chain_pems[0].write_to_path(str(files["cert"]))
    issued.private_key_pem.write_to_path(str(files["key"]))
    return {name: str(path) for name, path in files.items()}


def test_the_defaults_are_vllms():
    """Any origin, method and header, no credentials, no root path, docs on, plain HTTP."""
    assert options() == DEFAULT_HTTP
    defaults = DEFAULT_HTTP
    assert (defaults.allowed_origins, defaults.allow_credentials, defaults.scheme) == (("*",), False, "http")


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
        (["--ssl-certfile", "{cert}", "--ssl-keyfile", "{key}", "--ssl-ca-certs", "{key}"], "--ssl-ca-certs: cannot "
         "load CA certificates"),
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


@pytest.mark.parametrize("access_log", [True, False])
def test_tls_is_served_with_the_certificate_given_and_each_request_logged_unless_disabled(checkpoint, tls, access_log):
    flags = ["--ssl-certfile", tls["cert"], "--ssl-keyfile", tls["key"], "--uvicorn-log-level", "info"]
    access = logging.getLogger("uvicorn.access")
    records = Records()
    with serve(checkpoint, *flags, *([] if access_log else ["--disable-uvicorn-access-log"])) as live:
        assert live.url.startswith("https://")
        assert access.hasHandlers() == access_log  # uvicorn logs a request only where its logger has a handler
        if access_log:
            access.addHandler(records)
        try:
            trusted = ssl.create_default_context(cafile=tls["ca"])
            answer = httpx.post(f"{live.v1}/completions", json={"prompt": "Hi", "max_tokens": 2}, verify=trusted)
            with pytest.raises(httpx.ConnectError):  # a client that does not trust the CA is refused
                httpx.get(f"{live.url}/health")
        finally:
            access.removeHandler(records)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2
    logged = [record.getMessage() for record in records.records]
    assert any("POST /v1/completions" in line for line in logged) == access_log, logged
