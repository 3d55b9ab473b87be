"""gRPC server bootstrap shared by every Gyre service.

``build_server`` wires a servicer set into a ``grpc.server`` with:
- standard health checking (``grpc.health.v1``): NOT_SERVING until ``set_serving(True)``;
- server reflection for the service names given plus health and reflection;
- an interceptor that logs each failed call, counts requests/latency in Prometheus, and maps
  domain errors (``services.common.errors``, ``ValueError``) to status codes, so a bad request
  gets a clear status and never kills the process;
- message size limits.

``serve`` blocks until SIGTERM/SIGINT, then shuts down gracefully:

    SIGTERM -> health NOT_SERVING -> on_shutdown() (hand off / finish in-flight work)
            -> server.stop(grace_s) (in-flight RPCs get grace_s to finish) -> return

Lifecycle of ``GyreServer``: built (not started) -> start() -> set_serving(True) -> stop().
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from services.common import security
from services.common.errors import status_for
from services.common.logging import get_logger
from services.common.metrics import RPC_LATENCY, RPC_REQUESTS

log = get_logger(__name__)

Registration = tuple[Callable[[Any, grpc.Server], None], Any]


class GyreServer:
    """A built gRPC server plus its health servicer and bound port."""

    def __init__(self, name: str, server: grpc.Server, port: int, health_servicer: health.HealthServicer,
                 service_names: Sequence[str]) -> None:
        self.name = name
        self.server = server
        self.port = port
        self.health = health_servicer
        self.service_names = tuple(service_names)
        self.info: dict[str, str] = {}  # extra endpoints (e.g. "http": an HTTP base URL), for the port file
        self._stopped = threading.Event()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "GyreServer":
        self.server.start()
        return self

    def set_serving(self, serving: bool) -> None:
        """Flip health for the overall server ("") and every named service."""
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for svc in ("", *self.service_names):
            self.health.set(svc, status)

    def stop(self, grace_s: float = 5.0) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.set_serving(False)
        self.server.stop(grace_s).wait()

    def wait(self, timeout_s: float | None = None) -> bool:
        return self._stopped.wait(timeout_s)


def build_server(
    name: str,
    registrations: Sequence[Registration],
    *,
    service_names: Sequence[str],
    host: str = "127.0.0.1",
    port: int = 0,
    max_message_mb: int = 256,
    max_workers: int = 64,
    credentials: grpc.ServerCredentials | None = None,
    interceptors: Sequence[grpc.ServerInterceptor] = (),
) -> GyreServer:
    """Build (not start) a server for ``registrations``; ``port=0`` binds a free port."""
    limit = max_message_mb * 1024 * 1024
    sec = security.current()
    credentials = credentials or sec.server_credentials()
    interceptors = [*sec.interceptors(), *interceptors]
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=f"{name}-rpc"),
        interceptors=[*interceptors, ErrorMappingInterceptor(name)],
        options=[
            ("grpc.max_send_message_length", limit),
            ("grpc.max_receive_message_length", limit),
            ("grpc.so_reuseport", 0),
        ],
        maximum_concurrent_rpcs=None,
    )
    for add, servicer in registrations:
        add(servicer, server)
    health_servicer = health.HealthServicer(experimental_non_blocking=True)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    target = f"{host}:{port}"
    try:
        bound = server.add_secure_port(target, credentials) if credentials else server.add_insecure_port(target)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise ValueError(f"{name}: cannot bind {target}: the port is in use or the host is not local")
    gs = GyreServer(name, server, bound, health_servicer, service_names)
    gs.set_serving(False)
    return gs


def serve(server: GyreServer, *, grace_s: float, on_shutdown: Callable[[], None] | None = None) -> None:
    """Block until SIGTERM/SIGINT, then stop gracefully (see module docstring)."""
    stop_requested = threading.Event()

    def handler(signum: int, _frame: Any) -> None:
        log.info("shutdown requested", service=server.name, signal=signal.Signals(signum).name)
        stop_requested.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    while not stop_requested.wait(0.5):
        if server.wait(0):
            return
    server.set_serving(False)
    if on_shutdown is not None:
        try:
            on_shutdown()
        except Exception:  # deliberate: a failed hand-off must not prevent the stop
            log.exception("on_shutdown failed", service=server.name)
    server.stop(grace_s)
    log.info("stopped", service=server.name)


class ErrorMappingInterceptor(grpc.ServerInterceptor):
    """Counts and times every RPC and turns domain exceptions into status codes."""

    def __init__(self, service: str) -> None:
        self.service = service

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        method = details.method
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(handler.unary_unary, method), handler.request_deserializer,
                handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(handler.unary_stream, method), handler.request_deserializer,
                handler.response_serializer)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                self._unary(handler.stream_unary, method), handler.request_deserializer,
                handler.response_serializer)
        return grpc.stream_stream_rpc_method_handler(
            self._stream(handler.stream_stream, method), handler.request_deserializer,
            handler.response_serializer)

    def _unary(self, fn: Callable[[Any, Any], Any], method: str) -> Callable[[Any, Any], Any]:
        def wrapper(request: Any, context: grpc.ServicerContext) -> Any:
            start = time.perf_counter()
            try:
                response = fn(request, context)
            except BaseException as exc:  # noqa: BLE001 - mapped below, never swallowed
                self._fail(exc, context, method, start)
            self._done(context, method, start)
            return response

        return wrapper

    def _stream(self, fn: Callable[[Any, Any], Iterator[Any]], method: str) -> Callable[[Any, Any], Iterator[Any]]:
        def wrapper(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            start = time.perf_counter()
            try:
                yield from fn(request, context)
            except GeneratorExit:
                raise
            except BaseException as exc:  # noqa: BLE001
                self._fail(exc, context, method, start)
            self._done(context, method, start)

        return wrapper

    def _done(self, context: grpc.ServicerContext, method: str, start: float) -> None:
        code = context.code() or grpc.StatusCode.OK
        RPC_REQUESTS.labels(method, code.name).inc()
        RPC_LATENCY.labels(method).observe(time.perf_counter() - start)

    def _fail(self, exc: BaseException, context: grpc.ServicerContext, method: str, start: float) -> None:
        already = context.code()
        if already is not None and already != grpc.StatusCode.OK:
            # The handler aborted on purpose; keep its status.
            RPC_REQUESTS.labels(method, already.name).inc()
            RPC_LATENCY.labels(method).observe(time.perf_counter() - start)
            raise exc
        code = status_for(exc)
        RPC_LATENCY.labels(method).observe(time.perf_counter() - start)
        if code is None:
            RPC_REQUESTS.labels(method, grpc.StatusCode.INTERNAL.name).inc()
            log.error("rpc failed", service=self.service, method=method, exc_info=exc)
            context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {type(exc).__name__}: {exc}")
            return None  # abort raises; unreachable
        RPC_REQUESTS.labels(method, code.name).inc()
        log.info("rpc rejected", service=self.service, method=method, code=code.name, error=str(exc))
        context.abort(code, str(exc) or type(exc).__name__)


def wait_for_ready(address: str, *, timeout_s: float = 30.0, service: str = "") -> None:
    """Block until ``address`` answers health SERVING for ``service``; raise TimeoutError otherwise."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    with security.open_channel(address) as channel:  # TLS when this process is configured for it
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError as exc:
                last = exc
            time.sleep(0.1)
    raise TimeoutError(f"{address} did not become healthy within {timeout_s:.0f}s (last error: {last})")


def local_address_towards(host: str, port: int = 9) -> str:
    """The address of this machine's interface that traffic to ``host`` leaves from (no packet is
    sent: connecting a UDP socket only picks the route)."""
    import socket

    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        return str(s.getsockname()[0])


def _peer_host(peer: str) -> str:
    """Host part of ``host:port``, ``[v6]:port`` or a ``redis://user:pw@host:port/db`` URL."""
    from urllib.parse import urlsplit

    if "://" in peer:
        return urlsplit(peer).hostname or ""
    host = peer.rsplit(":", 1)[0] if ":" in peer else peer
    return host.strip("[]")


def advertised_host(bind_host: str, advertise: str = "", *, towards: str = "") -> str:
    """The host other machines dial for a server bound to ``bind_host``.

    ``advertise`` when set; the bind host when it is a concrete address; for a wildcard bind
    (0.0.0.0, ::), the address of the interface that reaches ``towards`` (a peer this process talks
    to: its scheduler, Redis...), so a multi-host deployment needs no per-host setting; 127.0.0.1
    only when nothing better is known.
    """
    if advertise:
        return advertise
    if bind_host not in ("0.0.0.0", "::", ""):
        return bind_host
    peer = _peer_host(towards) if towards else ""
    if peer:
        try:
            return local_address_towards(peer)
        except OSError:  # no route yet (the peer's network is not up): the safe local default
            pass
    return "127.0.0.1"


def free_port(host: str = "127.0.0.1") -> int:
    """A currently free TCP port on ``host`` (for processes that must be told a port up front)."""
    import socket

    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
