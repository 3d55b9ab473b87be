"""TLS, mTLS and bearer tokens on the shared server bootstrap, with certificates made by openssl."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.common import security
from services.common.security import Security, open_channel
from services.common.server import GyreServer, build_server


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
             "-subj", "/CN=gyre-test-ca", cwd=d)
    for name in ("server", "client", "rogue"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=d)
        (d / f"{name}.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
        if name == "rogue":  # self-signed: not from our CA
            _openssl("x509", "-req", "-in", "rogue.csr", "-signkey", "rogue.key", "-out", "rogue.pem", "-days", "1",
                     "-extfile", "rogue.ext", cwd=d)
        else:
            _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                     "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext", cwd=d)
    return d


def _echo_registration() -> tuple:
    handler = grpc.method_handlers_generic_handler(
        "test.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(lambda req, _ctx: req)})
    return (lambda _servicer, server: server.add_generic_rpc_handlers((handler,)), None)


def _serve(sec: Security) -> Iterator[GyreServer]:
    security.configure(sec)
    try:
        server = build_server("sec", [_echo_registration()], service_names=["test.Echo"]).start()
    finally:
        security.configure(Security())
    server.set_serving(True)
    yield server
    server.stop(0)


def _echo(channel: grpc.Channel) -> bytes:
    call = channel.unary_unary("/test.Echo/Echo", request_serializer=None, response_deserializer=None)
    return call(b"ping", timeout=5)


def test_bearer_token_required() -> None:
    for server in _serve(Security(auth_token="s3cret")):
        with grpc.insecure_channel(server.address) as ch:
            with pytest.raises(grpc.RpcError) as info:
                _echo(ch)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "bearer token" in info.value.details()
        with open_channel(server.address, security=Security(auth_token="wrong")) as ch:
            with pytest.raises(grpc.RpcError) as info:
                _echo(ch)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with open_channel(server.address, security=Security(auth_token="s3cret")) as ch:
            assert _echo(ch) == b"ping"


def test_mtls_refuses_clients_without_the_right_cert(pki: Path) -> None:
    p = lambda n: str(pki / n)  # noqa: E731
    server_sec = Security(tls_cert_file=p("server.pem"), tls_key_file=p("server.key"),
                          tls_client_ca_file=p("ca.pem"), auth_token="t")
    for server in _serve(server_sec):
        address = f"localhost:{server.port}"
        good = Security(tls_ca_file=p("ca.pem"), tls_cert_file=p("client.pem"), tls_key_file=p("client.key"),
                        auth_token="t")
        with open_channel(address, security=good) as ch:
            assert _echo(ch) == b"ping"
        for bad in (Security(tls_ca_file=p("ca.pem"), auth_token="t"),  # no client cert
                    Security(tls_ca_file=p("ca.pem"), tls_cert_file=p("rogue.pem"), tls_key_file=p("rogue.key"),
                             auth_token="t")):
            with open_channel(address, security=bad) as ch:
                with pytest.raises(grpc.RpcError) as info:
                    _echo(ch)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        with grpc.insecure_channel(address) as ch:  # plaintext to a TLS port
            with pytest.raises(grpc.RpcError):
                _echo(ch)


def test_half_configured_tls_is_a_clear_error(pki: Path) -> None:
    with pytest.raises(ValueError, match="both tls_cert_file and tls_key_file"):
        Security(tls_cert_file=str(pki / "server.pem"))
    with pytest.raises(ValueError, match="not a readable file"):
        Security(tls_ca_file="/nonexistent.pem")
