"""The HTTP side's own options, spelled as vLLM's serve flags: CORS, a proxy's root path, TLS, uvicorn's logs, the
API's docs pages, and what those flags set of the answers (request ids in a header, usage in every stream, tokens
spelled as ids, how tool calls are read, /load's count); refused at start naming the flag."""

from __future__ import annotations

import argparse
import json
import ssl
from dataclasses import dataclass

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
CERT_REQS = (ssl.CERT_NONE, ssl.CERT_OPTIONAL, ssl.CERT_REQUIRED)  # 0, 1, 2, as uvicorn and vLLM take them


@dataclass(frozen=True, slots=True)
class HttpOptions:
    """How the HTTP side serves and answers, beyond each request's own fields (sent to a front-end process with its
    settings)."""

    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    root_path: str = ""  # the path prefix a proxy serves the API under; requests with or without it are routed
    docs: bool = True  # /docs, /redoc and /openapi.json
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0
    log_level: str = "warning"
    access_log: bool = True
    request_id_headers: bool = False  # each answer's X-Request-Id header
    force_include_usage: bool = False  # usage at the end of every stream, asked for or not
    tokens_as_ids: bool = False  # logprobs' tokens spelled "token_id:ID" unless a request says otherwise
    tool_call_parser: str = "auto"  # how a <tool_call> block is read (server.tool_calls.tool_call_parser)
    load_tracking: bool = False  # /load counts the generation requests in flight

    @property
    def scheme(self) -> str:
        """http, or https where a certificate is given."""
        return "https" if self.ssl_certfile else "http"

    def uvicorn_settings(self) -> dict[str, object]:
        """uvicorn.Config's keyword arguments for these options."""
        return {
            "log_level": self.log_level,
            "access_log": self.access_log,
            "ssl_keyfile": self.ssl_keyfile,
            "ssl_certfile": self.ssl_certfile,
            "ssl_ca_certs": self.ssl_ca_certs,
            "ssl_cert_reqs": self.ssl_cert_reqs,
        }


DEFAULT_HTTP = HttpOptions()  # the flags' defaults


def api_key_refusal(key: str) -> str | None:
    """Why an API key cannot serve (None: it can): a key no HTTP header carries as given would refuse every client."""
    if not key.strip():
        return "must not be empty (an empty key would turn authentication off)"
    if key != key.strip() or not all(" " <= char <= "~" for char in key):
        return "must be printable ASCII without spaces at either end: an HTTP header cannot carry it as given"
    return None


def add_http_flags(parser: argparse.ArgumentParser) -> None:
    """The HTTP server's flags, in a group of their own in --help."""
    group = parser.add_argument_group("HTTP server", "as vLLM's flags of the same names")
    for name, what in (
        ("origins", "the origins whose pages"),
        ("methods", "the HTTP methods that pages of other origins"),
        ("headers", "the request headers that pages of other origins"),
    ):
        group.add_argument(
            f"--allowed-{name}",
            default='["*"]',
            metavar="JSON",
            help=f'{what} may call the API with (CORS), a JSON list of strings (default ["*"]: any)',
        )
    group.add_argument(
        "--allow-credentials",
        action="store_true",
        help="let browsers send cookies and credentials (CORS) (default: off)",
    )
    group.add_argument(
        "--root-path",
        default="",
        help="the path prefix a proxy serves the API under, e.g. /llm; requests are routed with it or without it "
        "(default: none; / is none too)",
    )
    group.add_argument(
        "--ssl-keyfile",
        default=None,
        help="the TLS private key's file, where --ssl-certfile holds no key (default: none)",
    )
    group.add_argument(
        "--ssl-certfile", default=None, help="the TLS certificate chain's file: serve HTTPS (default: none, plain HTTP)"
    )
    group.add_argument(
        "--ssl-ca-certs",
        default=None,
        help="CA certificates to verify clients' certificates by (with --ssl-cert-reqs 1 or 2) (default: none)",
    )
    group.add_argument(
        "--ssl-cert-reqs",
        type=int,
        choices=CERT_REQS,
        default=0,
        help="client certificates: 0 none, 1 optional, 2 required (needs --ssl-ca-certs) (default 0)",
    )
    group.add_argument(
        "--uvicorn-log-level",
        choices=UVICORN_LOG_LEVELS,
        default="warning",
        help="uvicorn's log level; info and below log each request (default warning; vLLM's is info)",
    )
    group.add_argument(
        "--disable-uvicorn-access-log",
        action="store_true",
        help="no log line per request at any log level (default: off)",
    )
    group.add_argument(
        "--disable-fastapi-docs", action="store_true", help="no /docs, /redoc or /openapi.json pages (default: off)"
    )
    group.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="answer with an X-Request-Id header: the request's own, or the id its response carries (default: off)",
    )
    group.add_argument(
        "--enable-force-include-usage",
        action="store_true",
        help="end every stream with its usage, as stream_options.include_usage asks (default: off)",
    )
    group.add_argument(
        "--enable-server-load-tracking",
        action="store_true",
        help="GET /load counts the generation requests in flight, from their arrival to their answer's end; without "
        "it /load answers 0 (default: off)",
    )
    group.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help="spell logprobs' tokens as \"token_id:ID\" unless a request's return_tokens_as_token_ids says otherwise "
        "(default: off)",
    )


def _json_strings(flag: str, text: str) -> tuple[str, ...]:
    """A flag's JSON list of strings."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{flag}: not valid JSON ({exc}); expected a list of strings, e.g. '[\"*\"]'") from exc
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ValueError(f"{flag}: expected a JSON list of strings, e.g. '[\"*\"]', got {text!r}")
    return tuple(value)


class EncryptedKey(Exception):
    """A TLS key that needs a pass phrase."""


def _no_pass_phrase() -> str:
    """OpenSSL's ask for a key's pass phrase: refused here, where it would otherwise prompt on the terminal."""
    raise EncryptedKey


def _check_tls(keyfile: str | None, certfile: str | None, ca_certs: str | None, cert_reqs: int) -> None:
    """Load the TLS files as the server will, so that a missing or bad one is refused now, naming its flag."""
    if certfile is None:
        for flag, given in (("--ssl-keyfile", keyfile), ("--ssl-ca-certs", ca_certs), ("--ssl-cert-reqs", cert_reqs)):
            if given:
                raise ValueError(f"{flag}: needs --ssl-certfile (TLS is served only with a certificate)")
        return
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(certfile, keyfile, password=_no_pass_phrase)
    except EncryptedKey:
        flag = "--ssl-keyfile" if keyfile else "--ssl-certfile"
        raise ValueError(f"{flag}: the key is encrypted; give it decrypted (no pass phrase is taken)") from None
    except (OSError, ssl.SSLError) as exc:
        flags = "--ssl-certfile" + (" and --ssl-keyfile" if keyfile else "")
        raise ValueError(f"{flags}: cannot load a certificate and its key: {exc}") from exc
    if cert_reqs != ssl.CERT_NONE and ca_certs is None:
        raise ValueError(f"--ssl-cert-reqs {cert_reqs}: needs --ssl-ca-certs to verify clients' certificates by")
    if cert_reqs == ssl.CERT_NONE and ca_certs is not None:
        raise ValueError(
            "--ssl-ca-certs: verifies nothing under --ssl-cert-reqs 0 (no client certificate is asked for)"
        )
    if ca_certs is not None:
        try:
            context.load_verify_locations(ca_certs)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"--ssl-ca-certs: cannot load CA certificates: {exc}") from exc


def http_options(args: argparse.Namespace) -> HttpOptions:
    """The serve flags' HTTP options; ValueError names the flag at fault."""
    root = "" if args.root_path == "/" else args.root_path
    if root and (not root.startswith("/") or root.endswith("/")):
        raise ValueError(f"--root-path: expected a path that starts with / and does not end with one, got {root!r}")
    _check_tls(args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs, args.ssl_cert_reqs)
    return HttpOptions(
        allowed_origins=_json_strings("--allowed-origins", args.allowed_origins),
        allowed_methods=tuple(method.upper() for method in _json_strings("--allowed-methods", args.allowed_methods)),
        allowed_headers=_json_strings("--allowed-headers", args.allowed_headers),
        allow_credentials=args.allow_credentials,
        root_path=root,
        docs=not args.disable_fastapi_docs,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        request_id_headers=args.enable_request_id_headers,
        force_include_usage=args.enable_force_include_usage,
        tokens_as_ids=args.return_tokens_as_token_ids,
        tool_call_parser=args.tool_call_parser,
        load_tracking=args.enable_server_load_tracking,
    )
