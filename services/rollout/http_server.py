"""The gateway's HTTP server: the routes of ``OpenAIEndpoint`` (``openai_http.py``: OpenAI chat /
completions / Responses, Anthropic Messages) over stdlib ``http.server``, one thread per
connection (at most ``max_connections``; more get 503), TLS when configured, per-role bearer
tokens, session base URLs (``/s/<token>/v1/...``), request body limits, SSE streaming, and errors
in each API's own shape (400 bad input, 401 / 403 credentials, 404 unknown route / model /
session, 410 an ended session, 413 too large, 503 no engine).

The translation between the APIs and a gateway call lives in ``openai_http.py``; this module only
moves bytes and maps failures to statuses.
"""

from __future__ import annotations

import json
import ssl
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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

_CODES = {400: "invalid_request", 404: "not_found", 410: "session_ended", 413: "request_too_large", 409: "aborted",
          503: "service_unavailable", 504: "timeout"}
_STATUS = {"INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "OUT_OF_RANGE": 400, "NOT_FOUND": 404,
           "RESOURCE_EXHAUSTED": 413, "UNAVAILABLE": 503, "ABORTED": 409, "DEADLINE_EXCEEDED": 504}


class _Limited(ThreadingHTTPServer):
    """A thread per connection, at most ``max_connections`` at once (more get 503 and are closed);
    TLS when given a context (the handshake runs in the connection's thread)."""

    daemon_threads = True
    request_queue_size = 4096  # the listen backlog (socketserver's default of 5 resets bursts of connections)

    def __init__(self, address: tuple[str, int], handler: Any, *, max_connections: int,
                 tls: ssl.SSLContext | None) -> None:
        super().__init__(address, handler)
        self.slots = threading.BoundedSemaphore(max_connections)
        self.active = 0
        self.idle = threading.Condition()
        if tls is not None:
            self.socket = tls.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            CONN_REFUSED.inc()
            try:
                body = json.dumps({"error": {"message": "too many open connections; retry later",
                                             "type": "service_unavailable", "param": None,
                                             "code": "service_unavailable"}}).encode()
                request.settimeout(1.0)
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        with self.idle:
            self.active += 1
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()
            with self.idle:
                self.active -= 1
                self.idle.notify_all()


class OpenAIServer:
    """The HTTP server around an ``OpenAIEndpoint``. Lifecycle: start() -> stop(grace_s).

    Connections idle (or trickling a request) past ``idle_timeout_s`` are closed; at most
    ``max_connections`` are served at once; TLS with ``tls_cert_file``/``tls_key_file``; stop()
    refuses new connections and lets in-flight requests finish for up to ``grace_s``."""

    def __init__(self, endpoint: OpenAIEndpoint, *, host: str = "127.0.0.1", port: int = 0,
                 max_body_bytes: int = 64 << 20, auth_token: str = "", idle_timeout_s: float = 60.0,
                 max_connections: int = 4096, tls_cert_file: str = "", tls_key_file: str = "",
                 tokens: tuple[tuple[str, str], ...] = ()) -> None:
        from services.common.security import Security

        self.endpoint = endpoint
        self.max_body_bytes = max_body_bytes
        # the one shared token, or per-role tokens (harness and internal ones are admitted)
        self.auth = Security(auth_token=auth_token, tokens=tokens)
        tls = None
        if tls_cert_file:
            tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            tls.minimum_version = ssl.TLSVersion.TLSv1_2
            tls.load_cert_chain(tls_cert_file, tls_key_file)
        handler = type("Handler", (_Handler,), {"server_ref": self, "timeout": idle_timeout_s})
        self.httpd = _Limited((host, port), handler, max_connections=max_connections, tls=tls)
        self.scheme = "https" if tls is not None else "http"
        self.port = int(self.httpd.server_address[1])
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="openai-http", daemon=True)

    @property
    def base_url(self) -> str:
        return f"{self.scheme}://{self.httpd.server_address[0]!s}:{self.port}/v1"

    def start(self) -> "OpenAIServer":
        self._thread.start()
        return self

    def stop(self, grace_s: float = 0.0) -> None:
        self.httpd.shutdown()  # no new connections
        deadline = time.monotonic() + grace_s
        with self.httpd.idle:
            while self.httpd.active and time.monotonic() < deadline:
                self.httpd.idle.wait(min(0.5, max(0.0, deadline - time.monotonic())))
        self.httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_ref: OpenAIServer

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        log.debug("http", request=format % args)

    def handle(self) -> None:
        try:
            super().handle()
        except (TimeoutError, ssl.SSLError, ConnectionError) as exc:  # idle past the timeout, a bad handshake
            log.debug("http connection closed", reason=type(exc).__name__)

    def _authorized(self) -> bool:
        """With tokens configured, callers must send ``Authorization: Bearer <token>`` (or
        ``x-api-key``) holding a harness (or internal) credential."""
        auth = self.server_ref.auth
        if not auth.auth_token and not auth.tokens:
            return True
        given = (self.headers.get("Authorization") or "").removeprefix("Bearer ").strip() or \
            (self.headers.get("x-api-key") or "").strip()  # (Anthropic clients send x-api-key)
        role = auth.role_of(given)
        if role in ("harness", "internal"):
            return True
        if role is not None:  # a valid operator credential: not for model calls
            self.close_connection = True
            message = f"a {role} credential may not call the model endpoint: it needs a harness credential"
            if self._anthropic():
                self._json(403, anthropic.error_body(403, message))
            else:
                self._json(403, {"error": {"message": message, "type": "permission_error", "param": None,
                                           "code": "permission_denied"}})
            return False
        self.close_connection = True
        if self._anthropic():
            self._json(401, anthropic.error_body(401, "missing or wrong API key"))
        else:
            self._json(401, {"error": {"message": "missing or wrong bearer token", "type": "authentication_error",
                                       "param": None, "code": "invalid_api_key"}})
        return False

    def _anthropic(self) -> bool:
        """A Messages API route: errors take that API's shape."""
        return self.path.split("?")[0].rstrip("/").endswith("/v1/messages")

    def _route(self) -> tuple[str, Any]:
        """(route, the call's Gyre headers): a session URL's prefix is resolved and stripped."""
        route = self.path.split("?")[0].rstrip("/")
        if not route.startswith("/s/"):
            return route, self.headers
        token, _, rest = route[3:].partition("/")
        return "/" + rest, self.server_ref.endpoint.session_headers(token, self.headers)

    def do_GET(self) -> None:
        if not self._authorized():
            return
        try:
            route, _ = self._route()
        except Exception as exc:  # deliberate: an unknown or ended session is a 404 / 410
            self._error(exc)
            return
        if route in ("/v1/models", "/models"):
            self._json(200, self.server_ref.endpoint.models())
        else:
            self._error(NotFound(f"no route GET {self.path}"))

    def do_POST(self) -> None:
        if not self._authorized():
            return
        ep = self.server_ref.endpoint
        try:
            try:
                route, headers = self._route()
            except Exception:
                self._drain_body()
                raise
            handler = {"/v1/chat/completions": ep.chat, "/v1/completions": ep.completion,
                       "/v1/messages": ep.messages, "/v1/responses": ep.responses}.get(route)
            if handler is None:
                self._drain_body()
                raise NotFound(f"no route POST {self.path}")
            body = self._body()
            result, stream = handler(body, headers)
        except Exception as exc:  # deliberate: every failure becomes an OpenAI-style error
            self._error(exc)
            return
        if stream is None:
            self._json(200, result)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        try:
            for chunk in stream:
                self.wfile.write(chunk)
                self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            log.info("openai stream client went away")
        except Exception as exc:  # deliberate: report in-band, the status line is already sent
            if self._anthropic():
                self.wfile.write(f"event: error\ndata: {json.dumps(anthropic.error_body(500, str(exc)))}\n\n".encode())
                return
            err = {"error": {"message": str(exc), "type": type(exc).__name__, "param": None, "code": "server_error"}}
            self.wfile.write(f"data: {json.dumps(err)}\n\n".encode())

    def _drain_body(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if 0 < length <= self.server_ref.max_body_bytes:
            self.rfile.read(length)
        else:
            self.close_connection = True

    def _discard(self, length: int) -> None:
        while length > 0:
            got = self.rfile.read(min(length, 1 << 20))
            if not got:
                break
            length -= len(got)

    def _body(self) -> dict[str, Any]:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise InvalidArgument("bad Content-Length") from None
        if length > self.server_ref.max_body_bytes:
            if length <= 4 * self.server_ref.max_body_bytes:
                self._discard(length)  # read it, so the client sees the 413 instead of a broken pipe
            else:
                self.close_connection = True  # the unread body makes the connection unusable
            raise ResourceExhausted(f"request body of {length} bytes exceeds the limit of "
                                    f"{self.server_ref.max_body_bytes} bytes")
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InvalidArgument(f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise InvalidArgument("request body must be a JSON object")
        return body

    def _json(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)

    def _error(self, exc: BaseException) -> None:
        if isinstance(exc, SessionEnded):
            status = 410
        elif isinstance(exc, GyreError):
            status = _STATUS.get(exc.code.name, 500)
        elif isinstance(exc, ValueError):
            status = 400
        else:
            status = 500
            log.error("http endpoint failed", exc_info=exc)
        message = str(exc) or HTTPStatus(status).phrase
        if self._anthropic():
            self._json(status, anthropic.error_body(status, message))
            return
        kind = {400: "invalid_request_error", 404: "not_found_error", 410: "invalid_request_error",
                413: "request_too_large", 503: "service_unavailable"}.get(status, "server_error")
        self._json(status, {"error": {"message": message, "type": kind, "param": None,
                                      "code": _CODES.get(status, "server_error")}})
