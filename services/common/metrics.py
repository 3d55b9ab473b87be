"""Prometheus metrics: one registry per process, served on the service's ``metrics_port``.

Every gRPC server records request counts, latencies and errors through the interceptor in
``services.common.server``; services add their own metrics with ``registry=REGISTRY`` and a
``gyre_<svc>_`` name prefix.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

REGISTRY = CollectorRegistry(auto_describe=True)

RPC_REQUESTS = Counter(
    "gyre_rpc_requests_total",
    "gRPC requests handled, by service method and status code.",
    ["method", "code"],
    registry=REGISTRY,
)
RPC_LATENCY = Histogram(
    "gyre_rpc_latency_seconds",
    "gRPC handler latency (for streams: until the handler returns).",
    ["method"],
    registry=REGISTRY,
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)


def start_metrics_server(port: int, host: str = "127.0.0.1") -> int:
    """Serve ``/metrics`` for REGISTRY on ``port`` (0 = any free port); returns the bound port."""
    server, _thread = start_http_server(port, addr=host, registry=REGISTRY)
    return int(server.server_port)
