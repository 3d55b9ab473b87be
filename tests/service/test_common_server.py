"""Server bootstrap: health gating, reflection, graceful SIGTERM in a real process."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.common.server import build_server, wait_for_ready
from tests.support.waiting import wait_until


def _health(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_health_is_not_serving_until_ready() -> None:
    server = build_server("t", [], service_names=["gyre.v1.Fake"]).start()
    try:
        assert _health(server.address) == health_pb2.HealthCheckResponse.NOT_SERVING
        server.set_serving(True)
        assert _health(server.address) == health_pb2.HealthCheckResponse.SERVING
        assert _health(server.address, "gyre.v1.Fake") == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop(0)


def test_reflection_lists_services() -> None:
    server = build_server("t", [], service_names=["gyre.v1.Fake"]).start()
    try:
        with grpc.insecure_channel(server.address) as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            names = {s.name for r in responses for s in r.list_services_response.service}
        assert {"gyre.v1.Fake", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names
    finally:
        server.stop(0)


def test_sigterm_stops_gracefully(tmp_path: Path) -> None:
    port_file = tmp_path / "port"
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.bare_server", str(port_file)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def port_written() -> bool:
            if port_file.exists() and port_file.read_text():
                return True
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            return False

        wait_until(port_written, 30, "the server to write its port")
        wait_for_ready(f"127.0.0.1:{port_file.read_text()}", timeout_s=10)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "handing off" in out
    assert '"event": "stopped"' in err and '"signal": "SIGTERM"' in err


def test_port_in_use_is_a_clear_error() -> None:
    first = build_server("t", [], service_names=[]).start()
    try:
        try:
            build_server("t2", [], service_names=[], port=first.port)
        except ValueError as exc:
            assert "cannot bind" in str(exc)
        else:  # pragma: no cover - some kernels allow it with SO_REUSEPORT; we disable that
            raise AssertionError("binding a used port must fail")
    finally:
        first.stop(0)
