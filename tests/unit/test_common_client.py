"""The typed-client base (``services.common.client.GrpcClient``) against a real gRPC server.

The server is grpc's standard health service on port 0, made flaky on demand: its ``Check``
aborts with a chosen status for the next N calls. A tiny client over it exercises what every
Gyre client inherits: domain errors, bounded retries of idempotent calls on UNAVAILABLE,
server streams, close and the context manager. Last, the typed clients import without torch.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.common import client as client_module
from services.common import errors
from services.common.client import GrpcClient

ROOT = Path(__file__).resolve().parents[2]
SERVING = health_pb2.HealthCheckResponse.SERVING


class FlakyHealth(health.HealthServicer):
    """The standard health servicer; ``fail(n, code)`` makes the next ``n`` Checks abort with ``code``."""

    def __init__(self) -> None:
        super().__init__()
        self.checks = 0
        self._failures = 0
        self._code = grpc.StatusCode.UNAVAILABLE

    def fail(self, n: int, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        self._failures, self._code = n, code

    def Check(self, request: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802 (grpc's name)
        self.checks += 1
        if self._failures > 0:
            self._failures -= 1
            context.abort(self._code, f"flaky: {self._code.name}")
        return super().Check(request, context)


class HealthClient(GrpcClient):
    def __init__(self, address: str, **options: Any) -> None:
        super().__init__(address, timeout_s=5.0, **options)
        self._stub = health_pb2_grpc.HealthStub(self._channel)

    def check(self, service: str = "", *, idempotent: bool = True) -> int:
        req = health_pb2.HealthCheckRequest(service=service)
        return int(self._call(self._stub.Check, req, idempotent=idempotent).status)

    def watch(self, timeout_s: float) -> Iterator[int]:
        for r in self._stream(self._stub.Watch, health_pb2.HealthCheckRequest(service=""), timeout_s):
            yield int(r.status)


class Lost(errors.Unavailable):
    pass


class LostClient(HealthClient):
    unavailable = Lost


@pytest.fixture
def server() -> Iterator[tuple[str, FlakyHealth]]:
    servicer = FlakyHealth()
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    yield f"127.0.0.1:{port}", servicer
    srv.stop(None)


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.events.append((event, fields))


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    recorder = Recorder()
    monkeypatch.setattr(client_module, "log", recorder)
    return recorder


def test_success_and_not_found_is_the_domain_error(server: tuple[str, FlakyHealth]) -> None:
    address, _ = server
    with HealthClient(address) as c:
        assert c.check() == SERVING
        with pytest.raises(errors.NotFound) as info:
            c.check("no-such-service")
    assert isinstance(info.value, LookupError)
    assert str(info.value) == "NOT_FOUND"  # the server sent no details: the code's name


@pytest.mark.parametrize(("code", "cls"), [
    (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidArgument),
    (grpc.StatusCode.FAILED_PRECONDITION, errors.FailedPrecondition),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.ResourceExhausted),
    (grpc.StatusCode.UNAVAILABLE, errors.Unavailable),
])
def test_status_codes_map_to_domain_errors_with_the_message(server: tuple[str, FlakyHealth], code: grpc.StatusCode,
                                                            cls: type[errors.GyreError]) -> None:
    address, servicer = server
    servicer.fail(1, code)
    with HealthClient(address) as c, pytest.raises(cls, match=f"flaky: {code.name}"):
        c.check()


def test_a_code_without_a_domain_class_is_a_gyre_error_carrying_it(server: tuple[str, FlakyHealth]) -> None:
    address, servicer = server
    servicer.fail(1, grpc.StatusCode.INTERNAL)
    with HealthClient(address) as c, pytest.raises(errors.GyreError) as info:
        c.check()
    assert type(info.value) is errors.GyreError
    assert info.value.code == grpc.StatusCode.INTERNAL
    assert "INTERNAL" in str(info.value)


def test_a_subclass_names_the_error_unavailable_becomes(server: tuple[str, FlakyHealth]) -> None:
    address, servicer = server
    servicer.fail(1)
    with LostClient(address) as c, pytest.raises(Lost):
        c.check()


def test_idempotent_call_retries_unavailable_then_succeeds(server: tuple[str, FlakyHealth], log: Recorder) -> None:
    address, servicer = server
    servicer.fail(2)
    with HealthClient(address, retries=3, backoff_s=0.01) as c:
        assert c.check() == SERVING
    assert servicer.checks == 3
    assert [e for e, _ in log.events] == ["call unavailable; retrying"] * 2
    assert [f["attempt"] for _, f in log.events] == [1, 2]
    assert log.events[0][1]["method"] == "/grpc.health.v1.Health/Check"
    assert all(0 < f["delay_s"] <= 0.02 for _, f in log.events)


def test_retries_are_bounded(server: tuple[str, FlakyHealth], log: Recorder) -> None:
    address, servicer = server
    servicer.fail(10)
    with HealthClient(address, retries=2, backoff_s=0.01) as c, pytest.raises(errors.Unavailable):
        c.check()
    assert servicer.checks == 3
    assert len(log.events) == 2


def test_only_unavailable_on_idempotent_calls_is_retried(server: tuple[str, FlakyHealth], log: Recorder) -> None:
    address, servicer = server
    with HealthClient(address, retries=3, backoff_s=0.01) as c:
        servicer.fail(1)
        with pytest.raises(errors.Unavailable):
            c.check(idempotent=False)
        assert servicer.checks == 1
        servicer.fail(1, grpc.StatusCode.FAILED_PRECONDITION)
        with pytest.raises(errors.FailedPrecondition):
            c.check()
        assert servicer.checks == 2
    assert log.events == []


def test_no_retries_by_default(server: tuple[str, FlakyHealth]) -> None:
    address, servicer = server
    servicer.fail(1)
    with HealthClient(address) as c, pytest.raises(errors.Unavailable):
        c.check()
    assert servicer.checks == 1


def test_server_stream_failure_is_a_domain_error(server: tuple[str, FlakyHealth]) -> None:
    address, _ = server
    seen: list[int] = []
    with HealthClient(address) as c, pytest.raises(errors.DeadlineExceeded):
        for status in c.watch(timeout_s=0.3):  # Watch never ends by itself: the deadline ends it
            seen.append(status)
    assert seen == [SERVING]


def test_close_and_context_manager_close_the_channel(server: tuple[str, FlakyHealth]) -> None:
    address, _ = server
    with HealthClient(address) as c:
        assert c.check() == SERVING
    with pytest.raises(ValueError, match="closed channel"):
        c.check()
    other = HealthClient(address)
    assert other.check() == SERVING
    other.close()
    other.close()  # closing twice is harmless
    with pytest.raises(ValueError, match="closed channel"):
        other.check()


def test_bad_retry_options_are_refused() -> None:
    with pytest.raises(ValueError, match="retries"):
        GrpcClient("127.0.0.1:1", timeout_s=1.0, retries=-1)


def test_typed_clients_import_no_torch() -> None:
    code = ("import sys\n"
            "import services.common.client, services.trainer.client, services.scheduler.client, "
            "services.reward.client, services.rollout.client, services.trajectory.client\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'sglang') if m in sys.modules)\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


class SlowFront:
    """A TCP front for ``target`` that holds each accepted connection ``delay_s`` before relaying
    it: a peer whose TLS handshake and HTTP/2 settings come late (a loaded host)."""

    def __init__(self, target: str, delay_s: float) -> None:
        import socket
        import threading

        self.target, self.delay_s = target, delay_s
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            self.accepted += 1
            host, port = self.target.rsplit(":", 1)

            def relay(a: socket.socket, b: socket.socket) -> None:
                try:
                    while data := a.recv(65536):
                        b.sendall(data)
                except OSError:
                    pass
                finally:
                    for s in (a, b):
                        try:
                            s.shutdown(socket.SHUT_RDWR)
                        except OSError:
                            pass

            def start(conn: socket.socket = conn) -> None:
                threading.Event().wait(self.delay_s)  # the slow peer (a fault, not a wait for a result)
                up = socket.create_connection((host, int(port)))
                threading.Thread(target=relay, args=(conn, up), daemon=True).start()
                relay(up, conn)

            threading.Thread(target=start, daemon=True).start()

    def close(self) -> None:
        self.sock.close()


def test_a_peer_slow_to_answer_a_connection_still_gets_the_call(server: tuple[str, FlakyHealth]) -> None:
    """A connection attempt gets gRPC's 20 s, not the 200 ms reconnect backoff: channels set
    ``grpc.min_reconnect_backoff_ms``, which gRPC core reads as the minimum connect timeout, and at
    200 ms a handshake slower than that failed the call UNAVAILABLE (seen on a loaded CI host)."""
    address, servicer = server
    front = SlowFront(address, delay_s=1.5)
    try:
        with HealthClient(front.address) as c:
            assert c.check(idempotent=False) == SERVING  # one attempt, no client retry
        assert front.accepted == 1 and servicer.checks == 1
    finally:
        front.close()
