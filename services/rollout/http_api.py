"""What the gateway's two HTTP servers share (``http_server.py``: a thread per connection;
``http_async.py``: asyncio): credentials, routes, body limits, error bodies in each API's own
shape, the 503 of a connection over the cap, TLS and the open-files limit. No sockets here: each
server moves the bytes its own way and calls these to decide what to answer.
"""

from __future__ import annotations

import json
import resource
import ssl
from collections.abc import Callable, Iterator
from http import HTTPStatus
from typing import Any

from prometheus_client import Counter

from services.common.errors import GyreError, InvalidArgument, NotFound, ResourceExhausted
from services.common.logging import get_logger
from services.common.metrics import REGISTRY
from services.rollout import anthropic_http as anthropic
from services.rollout.openai_http import OpenAIEndpoint, SessionEnded

log = get_logger(__name__)
CONN_REFUSED = Counter("gyre_gateway_http_refused_connections_total",
                       "HTTP connections refused because max_connections were open.", registry=REGISTRY)

_CODES = {400: "invalid_request", 404: "not_found", 408: "request_timeout", 410: "session_ended",
          413: "request_too_large", 409: "aborted", 503: "service_unavailable", 504: "timeout"}
_STATUS = {"INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "OUT_OF_RANGE": 400, "NOT_FOUND": 404,
           "RESOURCE_EXHAUSTED": 413, "UNAVAILABLE": 503, "ABORTED": 409, "DEADLINE_EXCEEDED": 504}

Call = Callable[[dict[str, Any], Any], tuple[dict[str, Any] | None, Iterator[bytes] | None]]


def _refusal() -> bytes:
    body = json.dumps({"error": {"message": "too many open connections; retry later", "type": "service_unavailable",
                                 "param": None, "code": "service_unavailable"}}).encode()
    return (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)


REFUSAL = _refusal()  # the whole answer to a connection beyond max_connections


def tls_context(cert_file: str, key_file: str) -> ssl.SSLContext | None:
    """The server side of TLS (1.2 or later) with this certificate chain; None without one."""
    if not cert_file:
        return None
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.minimum_version = ssl.TLSVersion.TLSv1_2
    tls.load_cert_chain(cert_file, key_file)
    return tls


def raise_open_files_limit() -> int:
    """Lift this process's open-files soft limit to its hard limit (a socket per connection:
    10,000 connections need more than the usual 1,024); returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= want:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError) as exc:  # deliberate: serve with the limit we have
        log.warning("could not raise the open-files limit", soft=soft, hard=hard, error=str(exc))
        return soft
    return want


def is_anthropic(path: str) -> bool:
    """A Messages API route: errors take that API's shape."""
    return path.split("?")[0].rstrip("/").endswith("/v1/messages")


def deny(auth: Any, headers: Any, path: str) -> tuple[int, dict[str, Any]] | None:
    """None when the caller may call the model, else the (status, body) refusing it. With tokens
    configured, callers must send ``Authorization: Bearer <token>`` (or ``x-api-key``) holding a
    harness (or internal) credential; ``auth`` is a ``services.common.security.Security``."""
    if not auth.auth_token and not auth.tokens:
        return None
    given = (headers.get("Authorization") or "").removeprefix("Bearer ").strip() or \
        (headers.get("x-api-key") or "").strip()  # (Anthropic clients send x-api-key)
    role = auth.role_of(given)
    if role in ("harness", "internal"):
        return None
    if role is not None:  # a valid operator credential: not for model calls
        message = f"a {role} credential may not call the model endpoint: it needs a harness credential"
        if is_anthropic(path):
            return 403, anthropic.error_body(403, message)
        return 403, {"error": {"message": message, "type": "permission_error", "param": None,
                               "code": "permission_denied"}}
    if is_anthropic(path):
        return 401, anthropic.error_body(401, "missing or wrong API key")
    return 401, {"error": {"message": "missing or wrong bearer token", "type": "authentication_error",
                           "param": None, "code": "invalid_api_key"}}


def resolve(endpoint: OpenAIEndpoint, path: str, headers: Any) -> tuple[str, Any]:
    """(route, the call's Gyre headers): a session URL's prefix is resolved (a Redis lookup:
    blocks) and stripped. Raises for an unknown (404) or ended (410) session."""
    route = path.split("?")[0].rstrip("/")
    if not route.startswith("/s/"):
        return route, headers
    token, _, rest = route[3:].partition("/")
    return "/" + rest, endpoint.session_headers(token, headers)


def is_session(path: str) -> bool:
    """A session URL (``resolve`` asks Redis)."""
    return path.startswith("/s/")


def is_models(route: str) -> bool:
    return route in ("/v1/models", "/models")


def post_call(endpoint: OpenAIEndpoint, route: str, path: str) -> Call:
    """The endpoint method serving ``POST route``; NotFound for any other route."""
    call = {"/v1/chat/completions": endpoint.chat, "/v1/completions": endpoint.completion,
            "/v1/messages": endpoint.messages, "/v1/responses": endpoint.responses}.get(route)
    if call is None:
        raise NotFound(f"no route POST {path}")
    return call


def too_large(length: int, limit: int) -> ResourceExhausted:
    return ResourceExhausted(f"request body of {length} bytes exceeds the limit of {limit} bytes")


def parse_body(raw: bytes) -> dict[str, Any]:
    """A request body: a JSON object (an empty body is ``{}``)."""
    try:
        body = json.loads(raw or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidArgument("request body must be a JSON object")
    return body


def error_payload(exc: BaseException, path: str) -> tuple[int, dict[str, Any]]:
    """A failure as (status, body) in the route's API shape: 400 bad input, 404 unknown route /
    model / session, 410 an ended session, 413 too large, 503 no engine, 500 anything else."""
    if isinstance(exc, SessionEnded):
        status = 410
    elif isinstance(exc, GyreError):
        status = _STATUS.get(exc.code.name, 500)
    elif isinstance(exc, ValueError):
        status = 400
    elif isinstance(exc, TimeoutError):
        status = 408
    else:
        status = 500
        log.error("http endpoint failed", exc_info=exc)
    message = str(exc) or HTTPStatus(status).phrase
    if is_anthropic(path):
        return status, anthropic.error_body(status, message)
    kind = {400: "invalid_request_error", 404: "not_found_error", 410: "invalid_request_error",
            413: "request_too_large", 503: "service_unavailable"}.get(status, "server_error")
    return status, {"error": {"message": message, "type": kind, "param": None, "code": _CODES.get(status, "server_error")}}


def stream_error(exc: BaseException, path: str) -> bytes:
    """A failure after a stream's status line went out: one SSE event in the API's shape."""
    if is_anthropic(path):
        return f"event: error\ndata: {json.dumps(anthropic.error_body(500, str(exc)))}\n\n".encode()
    err = {"error": {"message": str(exc), "type": type(exc).__name__, "param": None, "code": "server_error"}}
    return f"data: {json.dumps(err)}\n\n".encode()
