"""The base of Gyre's typed gRPC clients: one channel, deadlines, domain errors, retries, close.

A service's client derives from ``GrpcClient``, builds its stubs on ``self._channel`` and sends
every unary (or client-streaming) call through ``_call``, every server stream it reads to the end
through ``_stream``; callers then see domain errors (``services.common.errors``), never
``grpc.RpcError``:

    class TrajectoryClient(GrpcClient):
        def __init__(self, address: str, *, max_message_mb: int = 256, timeout_s: float = 60.0) -> None:
            super().__init__(address, timeout_s=timeout_s, max_message_mb=max_message_mb)
            self._stub = trajectory_pb2_grpc.TrajectoryStub(self._channel)

        def step_plan(self, job_id: str, step: int) -> StepPlan:
            return plan_from_proto(self._call(self._stub.GetStepPlan, StepRef(job_id=job_id, step=step)))

Retries are opt-in and narrow: with ``retries`` > 0, a call marked ``idempotent=True`` that fails
UNAVAILABLE is tried again after a capped exponential backoff with jitter, each attempt logged;
each attempt has its own deadline. Nothing else is retried (a deadline, a refusal or a stream
cannot be replayed safely here).

Lifecycle: the channel opens on construction (it connects lazily, on the first call); the client
is thread-safe; ``close()`` (or leaving a ``with`` block) closes the channel and cancels calls
still on it. Light to import: grpc only, no torch.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any, Self

import grpc

from services.common import errors
from services.common.logging import get_logger
from services.common.security import Security, open_channel

log = get_logger(__name__)


class GrpcClient:
    """One channel to ``address`` with a default deadline, domain errors and optional retries."""

    unavailable: type[errors.GyreError] = errors.Unavailable
    """The domain error UNAVAILABLE becomes (a subclass may name a finer one)."""

    def __init__(self, address: str, *, timeout_s: float, max_message_mb: int = 256,
                 security: Security | None = None, retries: int = 0, backoff_s: float = 0.1,
                 max_backoff_s: float = 5.0) -> None:
        if retries < 0 or backoff_s < 0 or max_backoff_s < 0:
            raise ValueError(f"retries, backoff_s and max_backoff_s must be >= 0, got {retries}, {backoff_s}, "
                             f"{max_backoff_s}")
        self.address = address
        self.timeout_s = timeout_s
        """Deadline of a call that names none, seconds."""
        self.retries = retries
        """Extra attempts of an idempotent call that failed UNAVAILABLE (0 = none)."""
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._channel = open_channel(address, security=security, max_message_mb=max_message_mb)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _error(self, exc: grpc.RpcError) -> errors.GyreError:
        return errors.from_rpc_error(exc, unavailable=self.unavailable)

    def _call(self, method: Any, request: Any, timeout_s: float | None = None, *, idempotent: bool = False) -> Any:
        """``method(request)`` with a deadline (``timeout_s``, else the client's); failures raise domain errors."""
        attempts = 1 + (self.retries if idempotent else 0)
        for attempt in range(1, attempts + 1):
            try:
                return method(request, timeout=timeout_s or self.timeout_s)
            except grpc.RpcError as exc:
                if attempt == attempts or exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise self._error(exc) from None
                delay_s = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
                log.warning("call unavailable; retrying", address=self.address, method=_name(method),
                            attempt=attempt, attempts=attempts, delay_s=round(delay_s, 3), error=exc.details())
                time.sleep(delay_s)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _stream(self, method: Any, request: Any, timeout_s: float | None) -> Iterator[Any]:
        """The messages of a server stream (``timeout_s`` None = no deadline); failures raise domain errors."""
        try:
            yield from method(request, timeout=timeout_s)
        except grpc.RpcError as exc:
            raise self._error(exc) from None


def _name(method: Any) -> str:
    """The RPC's full name ('/gyre.v1.Trainer/GetStatus') for logs; grpc keeps it private."""
    name = getattr(method, "_method", None)
    return name.decode() if isinstance(name, bytes) else str(name or method)
