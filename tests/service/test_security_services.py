"""Transport security and bearer tokens on real service processes (not an echo server):

- trajectory with a token (from env, as a deployment passes secrets): calls without it or with a
  wrong one are UNAUTHENTICATED and write nothing; health stays public for probes; the typed
  client works once this process's security carries the token.
- an engine cell and the gateway with mTLS + token, certificates made by openssl: a harness
  with a CA-signed certificate and the token generates through the gateway (so the gateway's own
  hop to the engine is mTLS + token too); no certificate, a self-signed one, plaintext, a server
  the client's CA did not sign, or a missing token are all refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2

from protos.gyre.v1 import rollout_pb2, rollout_pb2_grpc, trajectory_pb2, trajectory_pb2_grpc
from services.common import security
from services.common.errors import NotFound
from services.common.security import Security, open_channel
from services.rollout.calls import CallMeta
from services.rollout.client import GatewayClient
from services.rollout.engine import SamplingParams
from services.trajectory.client import TrajectoryClient
from services.trajectory.records import TitoCall
from services.trajectory.wire import record_to_proto
from tests.support.pki import make_pki
from tests.support.redis_server import RedisServer
from tests.support.service_process import ServiceProcess, health, stop_all

torch.set_num_threads(1)
TOKEN = "gyre-test-token-7f3a"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _as_process(sec: Security) -> Iterator[None]:
    security.configure(sec)
    try:
        yield
    finally:
        security.configure(Security())


# -- bearer token on the trajectory service -----------------------------------------------------
@pytest.fixture(scope="module")
def trajectory(tmp_path_factory: pytest.TempPathFactory, _session_redis: RedisServer) -> Iterator[ServiceProcess]:
    work = tmp_path_factory.mktemp("traj")
    proc = ServiceProcess.start("trajectory", "services.trajectory.main", work,
                                ["--redis-url", _session_redis.url, "--spool-dir", str(work / "spool")],
                                env={"GYRE_TRAJECTORY_AUTH_TOKEN": TOKEN})
    try:
        yield proc.wait_ready(timeout_s=60)  # health needs no token: container probes work unchanged
    finally:
        stop_all([proc])


def _call(eid: str) -> TitoCall:
    return TitoCall(execution_id=eid, call_id="c0", agent_id="main", role="main", job_id="job-sec",
                    prompt_ids=np.arange(1, 9, dtype=np.int32),
                    output_ids=np.array([9, 10, 11], dtype=np.int32),
                    output_logprobs=np.array([-0.1, -0.2, -0.3], dtype=np.float32), weight_version=0)


def test_trajectory_refuses_calls_without_the_token_and_writes_nothing(trajectory: ServiceProcess) -> None:
    record = trajectory_pb2.GetExecutionStatsRequest(job_id="job-sec", execution_id="ex-denied")
    for sec in (Security(), Security(auth_token="not-the-token")):
        with open_channel(trajectory.address, security=sec) as ch:
            stub = trajectory_pb2_grpc.TrajectoryStub(ch)
            with pytest.raises(grpc.RpcError) as info:
                stub.GetExecutionStats(record, timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "bearer token" in info.value.details()
            # A client stream (ingest) is refused too, and nothing reaches the store.
            with pytest.raises(grpc.RpcError) as info:
                stub.IngestRecords(iter([record_to_proto(_call("ex-denied"))]), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    for _ in _as_process(Security(auth_token=TOKEN)):
        with TrajectoryClient(trajectory.address, timeout_s=10) as client:
            try:
                stats = client.execution_stats("ex-denied", job_id="job-sec")
            except NotFound:
                pass  # the refused ingest wrote nothing
            else:
                assert stats.num_calls == 0


def test_trajectory_accepts_the_typed_client_with_the_process_token(trajectory: ServiceProcess) -> None:
    assert health(trajectory.address) == health_pb2.HealthCheckResponse.SERVING
    for _ in _as_process(Security(auth_token=TOKEN)):
        with TrajectoryClient(trajectory.address, timeout_s=10) as client:
            summary = client.ingest([_call("ex-ok")])
            assert summary.accepted == 1
            assert client.execution_stats("ex-ok", job_id="job-sec").num_calls == 1


# -- mTLS + token on an engine cell and the gateway ----------------------------------------------
def _tls_flags(pki: Path) -> list[str]:
    p = lambda n: str(pki / n)  # noqa: E731
    return ["--tls-cert-file", p("node.pem"), "--tls-key-file", p("node.key"), "--tls-client-ca-file", p("ca.pem"),
            "--tls-ca-file", p("ca.pem")]


def _harness(pki: Path, *, cert: str | None = "client", token: str = TOKEN, ca: str = "ca.pem") -> Security:
    if cert is None:
        return Security(tls_ca_file=str(pki / ca), auth_token=token)
    return Security(tls_ca_file=str(pki / ca), tls_cert_file=str(pki / f"{cert}.pem"),
                    tls_key_file=str(pki / f"{cert}.key"), auth_token=token)


@pytest.fixture(scope="module")
def mtls(tmp_path_factory: pytest.TempPathFactory, pki: Path) -> Iterator[dict[str, ServiceProcess]]:
    work = tmp_path_factory.mktemp("mtls")
    env = {"GYRE_ENGINE_AUTH_TOKEN": TOKEN, "GYRE_GATEWAY_AUTH_TOKEN": TOKEN}
    good = _harness(pki)
    procs: list[ServiceProcess] = []
    try:
        engine = ServiceProcess.start(
            "engine", "services.rollout.engine_main", work,
            ["--cell-id", "cell-1", "--model", "random-tiny", "--torch-threads", "1", "--max-batch-size", "4",
             "--max-workers", "16", "--kv-transports", "tcp", *_tls_flags(pki)], env=env)
        procs.append(engine)
        engine.wait_ready(timeout_s=120, security=good)
        gateway = ServiceProcess.start(
            "gateway", "services.rollout.gateway_main", work,
            ["--engine-addresses", f"cell-1={engine.address}", "--probe-interval-s", "0.5", *_tls_flags(pki)],
            env=env)
        procs.append(gateway)
        gateway.wait_ready(timeout_s=120, security=good)
        yield {"engine": engine, "gateway": gateway}
    finally:
        stop_all(procs)


def test_harness_with_cert_and_token_generates_through_the_mtls_gateway(mtls: dict[str, ServiceProcess],
                                                                        pki: Path) -> None:
    for _ in _as_process(_harness(pki)):
        client = GatewayClient(f"localhost:{mtls['gateway'].port}", timeout_s=60)
        try:
            engines = client.list_engines()
            assert [e.cell_id for e in engines] == ["cell-1"]
            result = client.generate(CallMeta(execution_id="ex-tls", call_id="c1"),
                                     np.arange(1, 17, dtype=np.int32), SamplingParams(temperature=0.0,
                                                                                       max_new_tokens=4))
            assert len(result.output_ids) == 4
        finally:
            client.close()


@pytest.mark.parametrize(("case", "expected"), [
    ("no client certificate", grpc.StatusCode.UNAVAILABLE),
    ("self-signed client certificate", grpc.StatusCode.UNAVAILABLE),
    ("server not signed by the client's CA", grpc.StatusCode.UNAVAILABLE),
    ("right certificate, no token", grpc.StatusCode.UNAUTHENTICATED),
    ("right certificate, wrong token", grpc.StatusCode.UNAUTHENTICATED),
])
def test_mtls_gateway_refuses(mtls: dict[str, ServiceProcess], pki: Path, case: str,
                              expected: grpc.StatusCode) -> None:
    sec = {
        "no client certificate": _harness(pki, cert=None),
        "self-signed client certificate": _harness(pki, cert="rogue"),
        "server not signed by the client's CA": _harness(pki, ca="rogue.pem"),
        "right certificate, no token": _harness(pki, token=""),
        "right certificate, wrong token": _harness(pki, token="wrong"),
    }[case]
    with open_channel(f"localhost:{mtls['gateway'].port}", security=sec) as ch:
        with pytest.raises(grpc.RpcError) as info:
            rollout_pb2_grpc.GatewayStub(ch).ListEngines(rollout_pb2.ListEnginesRequest(), timeout=10)
    assert info.value.code() == expected, f"{case}: {info.value.code()} {info.value.details()}"


def test_engine_behind_the_gateway_enforces_the_token_too(mtls: dict[str, ServiceProcess], pki: Path) -> None:
    """The gateway's generate succeeded above, so its own hop to the engine carried cert and token."""
    with open_channel(f"localhost:{mtls['engine'].port}", security=_harness(pki, token="")) as ch:
        with pytest.raises(grpc.RpcError) as info:
            rollout_pb2_grpc.EngineStub(ch).GetLoad(rollout_pb2.GetLoadRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_mtls_gateway_refuses_plaintext(mtls: dict[str, ServiceProcess]) -> None:
    with grpc.insecure_channel(mtls["gateway"].address) as ch:
        with pytest.raises(grpc.RpcError) as info:
            rollout_pb2_grpc.GatewayStub(ch).ListEngines(rollout_pb2.ListEnginesRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert health(mtls["gateway"].address) == health_pb2.HealthCheckResponse.UNKNOWN  # plaintext probe: no answer
