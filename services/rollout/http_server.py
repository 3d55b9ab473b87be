"""The gateway's HTTP server: the routes of ``OpenAIEndpoint`` (``openai_http.py``: OpenAI chat /
completions / Responses, Anthropic Messages) over stdlib ``http.server``, one thread per
connection (at most ``max_connections``; more get 503), TLS when configured, per-role bearer
tokens, session base URLs (``/s/<token>/v1/...``), request body limits, SSE streaming, and errors
in each API's own shape (400 bad input, 401 / 403 credentials, 404 unknown route / model /
session, 410 an ended session, 413 too large, 503 no engine).

The translation between the APIs and a gateway call lives in ``openai_http.py``; this module only
moves bytes; what to answer (auth, routes, limits, error bodies) is ``http_api.py``, shared with
the asyncio server ``http_async.py`` (the gateway's default, ``http_server = "async"``); this one
is ``http_server = "threads"``, the baseline and fallback.
"""

from __future__ import annotations

import json
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from services.common.errors import InvalidArgument, NotFound
from services.common.logging import get_logger
from services.rollout import http_api
from services.rollout.http_api import CONN_REFUSED
from services.rollout.openai_http import OpenAIEndpoint

log = get_logger(__name__)


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
                request.settimeout(1.0)
                request.sendall(http_api.REFUSAL)
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
        tls = http_api.tls_context(tls_cert_file, tls_key_file)
        handler = type("Handler", (_Handler,), {"server_ref": self, "timeout": idle_timeout_s})
        self.httpd = _Limited((host, port), handler, max_connections=max_connections, tls=tls)
        self.scheme = "https" if tls is not None else "http"
        self.port = int(self.httpd.server_address[1])
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="openai-http", daemon=True)

    @property
    def base_url(self) -> str:
        return f"{self.scheme}://{self.httpd.server_address[0]!s}:{self.port}/v1"

    def start(self) -> "OpenAIServer":
        http_api.raise_open_files_limit()
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
        denied = http_api.deny(self.server_ref.auth, self.headers, self.path)
        if denied is None:
            return True
        self.close_connection = True
        self._json(*denied)
        return False

    def do_GET(self) -> None:
        if not self._authorized():
            return
        try:
            route, _ = http_api.resolve(self.server_ref.endpoint, self.path, self.headers)
        except Exception as exc:  # deliberate: an unknown or ended session is a 404 / 410
            self._error(exc)
            return
        if http_api.is_models(route):
            self._json(200, self.server_ref.endpoint.models())
        else:
            self._error(NotFound(f"no route GET {self.path}"))

    def do_POST(self) -> None:
        if not self._authorized():
            return
        try:
            try:
                route, headers = http_api.resolve(self.server_ref.endpoint, self.path, self.headers)
                handler = http_api.post_call(self.server_ref.endpoint, route, self.path)
            except Exception:
                self._drain_body()
                raise
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
            self.wfile.write(http_api.stream_error(exc, self.path))
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()  # a client that left cancels the engine-side request

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
            raise http_api.too_large(length, self.server_ref.max_body_bytes)
        return http_api.parse_body(self.rfile.read(length) if length else b"")

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
        self._json(*http_api.error_payload(exc, self.path))
