"""The gateway's asynchronous HTTP server (``http_server = "async"``, the default): the routes of
``OpenAIEndpoint`` over one asyncio event loop (aiohttp's low-level server), so an idle or
streaming connection costs a socket and a few KiB, not a thread. A drop-in for ``OpenAIServer``
(``http_server.py``, ``http_server = "threads"``): the same constructor, ``start()``,
``stop(grace_s)``, ``base_url``, ``port``, ``scheme``, and the same answers (``http_api.py``).

    event loop thread (all sockets)           worker pool (http_workers threads)
    accept -> cap check -> parse request ---> endpoint.chat(body, headers)   (blocks: generation)
    json response  <------------------------- (result JSON, or an SSE iterator)
    SSE: write chunk <- next(iterator) <----- one next() per chunk, in the pool
    client gone -> iterator.close() --------> the gateway cancels the engine request

Limits: at most ``max_connections`` open (one more is answered 503 and closed, counted in
``gyre_gateway_http_refused_connections_total``); a connection that sends no complete request
for ``idle_timeout_s`` (idle keep-alive, a trickled request line, a stalled TLS handshake) is
closed, as is one whose body stalls or whose stream is not read for that long; request bodies
over ``max_body_bytes`` get 413. Lifecycle: __init__ binds -> start() serves on its own thread
-> stop(grace_s) stops accepting, closes idle connections, lets in-flight requests (streams
too) finish for up to ``grace_s``, then cancels what is left.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, cast

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from services.common.errors import NotFound, ResourceExhausted
from services.common.logging import get_logger
from services.rollout import http_api
from services.rollout.http_api import CONN_REFUSED
from services.rollout.openai_http import OpenAIEndpoint

log = get_logger(__name__)
_PARSE_IN_POOL = 1 << 20  # bodies larger than this are parsed off the event loop


class AsyncOpenAIServer:
    """The asyncio HTTP server around an ``OpenAIEndpoint``. Lifecycle: start() -> stop(grace_s).

    ``workers`` threads run the endpoint's blocking calls (a non-streaming call holds one for its
    whole generation, a stream one per wait for its next chunk); more calls wait their turn."""

    def __init__(self, endpoint: OpenAIEndpoint, *, host: str = "127.0.0.1", port: int = 0,
                 max_body_bytes: int = 64 << 20, auth_token: str = "", idle_timeout_s: float = 60.0,
                 max_connections: int = 4096, tls_cert_file: str = "", tls_key_file: str = "",
                 tokens: tuple[tuple[str, str], ...] = (), workers: int = 1024) -> None:
        from services.common.security import Security

        self.endpoint = endpoint
        self.max_body_bytes = max_body_bytes
        self.idle_timeout_s = idle_timeout_s
        self.max_connections = max_connections
        self.auth = Security(auth_token=auth_token, tokens=tokens)
        self.tls = http_api.tls_context(tls_cert_file, tls_key_file)
        self.scheme = "https" if self.tls is not None else "http"
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.create_server((host, port), family=family, backlog=4096)
        self.host, self.port = str(self._sock.getsockname()[0]), int(self._sock.getsockname()[1])
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="openai-http")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="openai-http-loop", daemon=True)
        self._server: _Server | None = None
        self._listener: asyncio.Server | None = None
        self._requests: set[asyncio.Task[Any]] = set()  # handlers running now (a stop cancels the late ones)

    @property
    def base_url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}/v1"

    @property
    def open_connections(self) -> int:
        return len(self._server.connections) if self._server is not None else 0

    def start(self) -> "AsyncOpenAIServer":
        http_api.raise_open_files_limit()  # a socket per connection: 10,000 need more than 1,024
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result()
        return self

    async def _serve(self) -> None:
        self._server = _Server(self._handle, max_connections=self.max_connections, loop=self._loop,
                               keepalive_timeout=self.idle_timeout_s, max_line_size=65536, max_field_size=65536,
                               access_log=None)
        self._listener = await self._loop.create_server(
            self._server, sock=self._sock, ssl=self.tls, backlog=4096,
            ssl_handshake_timeout=self.idle_timeout_s if self.tls is not None else None)

    def stop(self, grace_s: float = 0.0) -> None:
        if not self._thread.is_alive():
            self._sock.close()
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(grace_s), self._loop).result(timeout=grace_s + 30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self.pool.shutdown(wait=False)  # calls still running finish on their own (daemon threads)

    async def _shutdown(self, grace_s: float) -> None:
        assert self._listener is not None and self._server is not None
        self._listener.close()  # no new connections
        self._server.pre_shutdown()  # idle connections close now, busy ones after their response
        try:
            async with asyncio.timeout(grace_s + 1.0):
                await self._server.shutdown(grace_s)  # in-flight requests get the grace period
        except TimeoutError:
            pass
        for conn in self._server.connections:  # past the grace: cancel what is left
            conn.force_close()
        for task in self._requests:
            task.cancel()
        if self._requests:  # their cleanup runs (an abandoned stream's close cancels its engine request)
            await asyncio.wait(list(self._requests), timeout=5.0)

    # -- requests ----------------------------------------------------------------------------
    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None
        self._requests.add(task)
        try:
            return await self._answer(request)
        finally:
            self._requests.discard(task)

    async def _answer(self, request: web.BaseRequest) -> web.StreamResponse:
        path = request.raw_path
        denied = http_api.deny(self.auth, request.headers, path)
        if denied is not None:
            return _json(*denied, close=True)
        loop = asyncio.get_running_loop()
        try:
            if http_api.is_session(path):  # a Redis lookup: off the loop
                route, headers = await loop.run_in_executor(self.pool, http_api.resolve, self.endpoint, path,
                                                            request.headers)
            else:
                route, headers = http_api.resolve(self.endpoint, path, request.headers)
            if request.method == "GET":
                if not http_api.is_models(route):
                    raise NotFound(f"no route GET {path}")
                return _json(200, self.endpoint.models())
            if request.method != "POST":
                return _json(501, {"error": {"message": f"unsupported method {request.method}",
                                             "type": "invalid_request_error", "param": None,
                                             "code": "unsupported_method"}}, close=True)
            call = http_api.post_call(self.endpoint, route, path)
            raw = await self._read_body(request)
            body = await loop.run_in_executor(self.pool, http_api.parse_body, raw) if len(raw) > _PARSE_IN_POOL \
                else http_api.parse_body(raw)
            data, stream = await loop.run_in_executor(self.pool, _call, call, body, headers)
        except Exception as exc:  # deliberate: every failure becomes an error in the API's shape
            # a body left unread (too large to drain) or stalled makes the connection unusable
            close = isinstance(exc, TimeoutError) or isinstance(exc, ResourceExhausted) and not request.content.is_eof()
            return _json(*http_api.error_payload(exc, path), close=close)
        if stream is None:
            assert data is not None
            return web.Response(body=data, content_type="application/json")
        return await self._stream(request, path, stream)

    async def _read_body(self, request: web.BaseRequest) -> bytes:
        """The whole body, at most ``max_body_bytes``; each read waits at most ``idle_timeout_s``."""
        limit = self.max_body_bytes
        length = request.content_length
        if length is not None and length > limit:
            if length <= 4 * limit:  # read it, so the client sees the 413 instead of a broken pipe
                while await self._chunk(request):
                    pass
            raise http_api.too_large(length, limit)
        raw = bytearray()
        while chunk := await self._chunk(request):
            raw += chunk
            if len(raw) > limit:  # a chunked body without a length
                raise http_api.too_large(len(raw), limit)
        return bytes(raw)

    async def _chunk(self, request: web.BaseRequest) -> bytes:
        async with asyncio.timeout(self.idle_timeout_s):
            return await request.content.readany()

    async def _stream(self, request: web.BaseRequest, path: str, stream: Iterator[bytes]) -> web.StreamResponse:
        """SSE: each chunk is pulled from the endpoint's iterator in the pool and written here. A
        client that leaves (or stops reading for ``idle_timeout_s``) closes the iterator, which
        cancels the engine-side request."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        resp.force_close()
        pending: Future[bytes | None] | None = None
        finished = False
        try:
            await resp.prepare(request)
            while True:
                transport = request.transport
                if transport is None or transport.is_closing():
                    raise ConnectionResetError("the client closed the connection")
                pending = self.pool.submit(next, stream, None)  # type: ignore[arg-type]
                chunk = await asyncio.wrap_future(pending)
                if chunk is None:
                    finished = True
                    break
                async with asyncio.timeout(self.idle_timeout_s):
                    await resp.write(chunk)
            await resp.write_eof()
        except (ConnectionError, TimeoutError):
            log.info("openai stream client went away")
            request.protocol.force_close()
        except Exception as exc:  # deliberate: report in-band, the status line is already sent
            finished = True  # the iterator raised: it is over
            try:
                await resp.write(http_api.stream_error(exc, path))
                await resp.write_eof()
            except ConnectionError:
                pass
        finally:
            if not finished:
                self._close_later(stream, pending)
        return resp

    def _close_later(self, stream: Iterator[bytes], pending: Future[Any] | None) -> None:
        """Close the iterator once its current ``next()`` (if any) returns: the close runs the
        gateway's cancel, a blocking call, so never on the event loop."""
        close = getattr(stream, "close", None)
        if close is None:
            return

        def run(_: Any = None) -> None:
            try:
                close()
            except Exception as exc:  # deliberate: a failed cancel is logged, the connection is gone anyway
                log.warning("closing an abandoned stream failed", error=str(exc))

        if pending is not None and not pending.done():
            pending.add_done_callback(run)  # runs in the worker that finishes it
            return
        try:
            self.pool.submit(run)
        except RuntimeError:  # the pool is shut down (stopping): a thread of its own
            threading.Thread(target=run, name="openai-http-close", daemon=True).start()


def _call(call: http_api.Call, body: dict[str, Any], headers: Any) -> tuple[bytes | None, Iterator[bytes] | None]:
    """Run an endpoint call (in the pool); a whole response is serialized there too."""
    result, stream = call(body, headers)
    return (json.dumps(result).encode() if stream is None else None), stream


def _json(status: int, payload: Any, *, close: bool = False) -> web.Response:
    resp = web.Response(status=status, body=json.dumps(payload).encode(), content_type="application/json")
    if close:
        resp.force_close()
    return resp


class _Server(web.Server):
    """aiohttp's low-level server with a connection cap."""

    def __init__(self, handler: Any, *, max_connections: int, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self.max_connections = max_connections

    def __call__(self) -> RequestHandler:
        return _Connection(self, loop=self._loop, **self._kwargs)


class _Connection(RequestHandler):
    """One connection; beyond the cap it is answered 503 and closed (its request unread: the
    write side is shut first so the answer is not lost to a reset, then closed within 1 s)."""

    _refused: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        manager = cast(_Server, self._manager)
        if len(manager._connections) < manager.max_connections:
            super().connection_made(transport)
            return
        CONN_REFUSED.inc()
        t = self._refused = cast(asyncio.Transport, transport)
        t.write(http_api.REFUSAL)
        if t.can_write_eof():
            t.write_eof()
        self._loop.call_later(1.0, t.close)

    def data_received(self, data: bytes) -> None:
        if self._refused is None:
            super().data_received(data)

    def eof_received(self) -> None:
        if self._refused is not None:
            self._refused.close()
            return
        super().eof_received()

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._refused is None:
            super().connection_lost(exc)
