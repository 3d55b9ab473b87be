"""Hypothesis-generated bad input on every RPC of trajectory, reward, trainer and rollout (engine and
gateway), each a real process (the scheduler has its own: tests/service/test_scheduler_bad_input.py).

Requests are built from the proto descriptors (tests/support/proto_fuzz.py): wrong types for the
field's meaning, huge sizes, out-of-vocabulary and negative ids, unknown ids, NaN, empty fields,
unknown enum values -- mixed with ids that exist so validation past "not found" is reached.
For every request:

- the answer is OK or a precise status (never INTERNAL/UNKNOWN), with a clear message;
- the process stays up and SERVING;
- a refused request changes nothing: Redis (every key's dump), the blob spools and each
  service's observable state are exactly as before.

Examples are derandomized (the same ones every run) so CI is reproducible; set
GYRE_FUZZ_RANDOM=1 for fresh ones and GYRE_FUZZ_EXAMPLES=N for more.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import redis
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor
from grpc_health.v1 import health_pb2
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from protos.gyre.v1 import reward_pb2, rollout_pb2, trainer_pb2, trajectory_pb2
from services.reward.client import RewardClient
from services.reward.scorers import ScorerSpec
from services.trajectory.client import TrajectoryClient
from services.trajectory.records import TitoCall
from services.common.roles import AgentRole
from tests.support.proto_fuzz import st_message
from tests.support.redis_server import RedisServer
from tests.support.service_process import ServiceProcess, health, stop_all
from tests.support.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]

C = grpc.StatusCode
JOB, EXEC, CELL = "fz-job", "fz-ex", "cell-fz"
KNOWN = (JOB, EXEC, CELL, "c0", "main", "0")
CALL_TIMEOUT_S = 1.0
EXAMPLES = int(os.environ.get("GYRE_FUZZ_EXAMPLES", "10"))
RANDOM = os.environ.get("GYRE_FUZZ_RANDOM") == "1"

SERVICES: dict[str, Any] = {
    "trajectory": trajectory_pb2.DESCRIPTOR.services_by_name["Trajectory"],
    "reward": reward_pb2.DESCRIPTOR.services_by_name["Reward"],
    "trainer": trainer_pb2.DESCRIPTOR.services_by_name["Trainer"],
    "engine": rollout_pb2.DESCRIPTOR.services_by_name["Engine"],
    "gateway": rollout_pb2.DESCRIPTOR.services_by_name["Gateway"],
}
METHODS = [(svc, m.name) for svc, desc in SERVICES.items() for m in desc.methods]
# Precise answers to bad input. DEADLINE_EXCEEDED: our 1 s deadline on a call that legitimately
# waits (a long-poll, a stream, a generation); the service must still be fine afterwards.
ALLOWED = {C.OK, C.INVALID_ARGUMENT, C.NOT_FOUND, C.FAILED_PRECONDITION, C.ALREADY_EXISTS, C.OUT_OF_RANGE,
           C.RESOURCE_EXHAUSTED, C.ABORTED, C.DEADLINE_EXCEEDED}
# Calls that dial an address taken from the request: an unreachable one is UNAVAILABLE.
DIALS = {("engine", "MigrateOut"), ("gateway", "RegisterEngine")}
# Wait/timeout fields: a huge value must be refused or capped, never overflow into INTERNAL.
WAITS = [("trainer", "WaitStep", "timeout_s"), ("trainer", "GetWeights", "wait_s"), ("trainer", "AddReplica", "wait_s"),
         ("trainer", "ReleaseReplica", "wait_s"), ("engine", "Attach", "wait_s"), ("engine", "Drain", "wait_s")]
# Bugs found here that their owners have yet to fix. The fuzz test tolerates exactly this symptom
# on these RPCs (and checks everything else); test_huge_wait_is_refused_not_overflowed tracks it
# as a strict xfail, so a fix fails the mark and gets it removed.
OVERFLOW = "OverflowError: timestamp out of range"
KNOWN_OVERFLOWS: set[tuple[str, str]] = set()  # waits past threading.TIMEOUT_MAX map to INVALID_ARGUMENT (status_for)


@dataclass
class Cluster:
    procs: dict[str, ServiceProcess]
    redis: redis.Redis
    spools: list[Path]
    channels: dict[str, grpc.Channel]

    def call(self, svc: str, method: MethodDescriptor, request: Any) -> tuple[grpc.StatusCode, str]:
        """Send ``request`` (a list of messages for client streams); (status, details)."""
        path = f"/{method.containing_service.full_name}/{method.name}"
        ch = self.channels[svc]
        ser, de = (lambda m: m.SerializeToString()), (lambda b: b)
        try:
            if method.client_streaming and method.server_streaming:
                raise AssertionError("no bidi RPCs expected")
            if method.client_streaming:
                ch.stream_unary(path, ser, de)(iter(request), timeout=CALL_TIMEOUT_S)
            elif method.server_streaming:
                stream = ch.unary_stream(path, ser, de)(request, timeout=CALL_TIMEOUT_S)
                for i, _ in enumerate(stream):
                    if i >= 20:
                        stream.cancel()
                        break
            else:
                ch.unary_unary(path, ser, de)(request, timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as exc:
            if exc.code() == C.CANCELLED:  # we cancelled a stream after enough messages
                return C.OK, ""
            return exc.code(), exc.details() or ""
        return C.OK, ""

    def state(self, svc: str) -> Any:
        """What a refused request must leave unchanged."""
        if svc in ("trajectory", "reward"):
            keys = sorted(self.redis.scan_iter(count=1000))
            files = sorted((str(p.relative_to(s)), p.stat().st_size) for s in self.spools for p in s.rglob("*")
                           if p.is_file())
            return {k: self.redis.dump(k) for k in keys}, files
        ch = self.channels[svc]
        if svc == "engine":
            load = ch.unary_unary("/gyre.v1.Engine/GetLoad", lambda m: m.SerializeToString(),
                                  rollout_pb2.EngineLoad.FromString)(rollout_pb2.GetLoadRequest(), timeout=10)
            return load.weight_version, load.draining, load.active, load.kv_tokens
        if svc == "gateway":
            res = ch.unary_unary("/gyre.v1.Gateway/ListEngines", lambda m: m.SerializeToString(),
                                 rollout_pb2.ListEnginesResponse.FromString)(rollout_pb2.ListEnginesRequest(), timeout=10)
            return sorted((e.cell_id, e.address) for e in res.engines)
        status = ch.unary_unary("/gyre.v1.Trainer/GetStatus", lambda m: m.SerializeToString(),
                                trainer_pb2.TrainerStatus.FromString)(trainer_pb2.GetStatusRequest(), timeout=10)
        return status.job_id, status.phase, status.step, status.weight_version, len(status.replicas)

    def reset_gateway(self) -> None:
        """Register the engine again (which also undoes a drain), as the scheduler would."""
        req = rollout_pb2.RegisterEngineRequest(cell_id=CELL, address=self.procs["engine"].address)
        self.channels["gateway"].unary_unary("/gyre.v1.Gateway/RegisterEngine", lambda m: m.SerializeToString(),
                                             lambda b: b)(req, timeout=10)

    def settle(self) -> None:
        """Let generations cut off by our deadline end before the next example measures state."""
        with contextlib.suppress(AssertionError):  # a cap, not a failure: what is left, the next example sees
            wait_until(lambda: self.state("engine")[2] == 0, 10, "cut-off generations to end")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    work = tmp_path_factory.mktemp("fuzz")
    rs = RedisServer(work / "redis").start()
    spools = [work / "spool-trajectory", work / "spool-reward"]
    procs: dict[str, ServiceProcess] = {}
    channels: dict[str, grpc.Channel] = {}
    try:
        base = ["--redis-url", rs.url, "--grace-s", "1"]
        procs["trajectory"] = ServiceProcess.start("trajectory", "services.trajectory.main", work,
                                                   [*base, "--spool-dir", str(spools[0]), "--vocab-size", "512"])
        procs["trainer"] = ServiceProcess.start("trainer", "services.trainer.main", work,
                                                [*base, "--replica-log-dir", str(work / "logs")])
        procs["engine"] = ServiceProcess.start("engine", "services.rollout.engine_main", work, [
            *base, "--cell-id", CELL, "--model", "random-tiny", "--torch-threads", "1", "--max-batch-size", "4",
            "--max-workers", "32", "--max-context-tokens", "256", "--kv-transports", "tcp", "--attach-wait-s", "1"])
        procs["trajectory"].wait_ready(timeout_s=60)
        procs["reward"] = ServiceProcess.start("reward", "services.reward.main", work, [
            *base, "--spool-dir", str(spools[1]), "--scorer-workers", "1", "--scorer-timeout-s", "2",
            "--trajectory-address", procs["trajectory"].address, "--scorer-allowlist",
            "entry_point:tests.support.harness_scorer:fraction_done", "--scorer-paths", str(REPO / "tests")])
        procs["engine"].wait_ready(timeout_s=120)
        # No trajectory address: TITO forwarding is asynchronous and would blur the state checks.
        procs["gateway"] = ServiceProcess.start("gateway", "services.rollout.gateway_main", work, [
            *base, "--engine-addresses", f"{CELL}={procs['engine'].address}", "--attach-wait-s", "1",
            "--max-recoveries", "1", "--probe-interval-s", "0.5"])
        for p in procs.values():
            p.wait_ready(timeout_s=120)
        channels = {name: grpc.insecure_channel(p.address, options=[("grpc.max_send_message_length", 64 << 20),
                                                                      ("grpc.max_receive_message_length", 64 << 20)])
                    for name, p in procs.items()}
        # Ids that exist, so requests get past "not found".
        with TrajectoryClient(procs["trajectory"].address) as traj:
            traj.ingest([TitoCall(EXEC, "c0", "main", AgentRole.MAIN, np.array([5, 6, 7]), np.full(3, -0.5), 0,
                                  prompt_ids=np.arange(1, 9), job_id=JOB)])
            traj.open_step(JOB, 0, num_executions=2, group_size=2)
        with RewardClient(procs["reward"].address) as rew:
            rew.configure_job(JOB, ScorerSpec(kind="entry_point", target="tests.support.harness_scorer:fraction_done"))
            rew.submit_workspace(JOB, EXEC, {"part-1.txt": b"done\n"}, task_id="t")
        yield Cluster(procs, redis.Redis.from_url(rs.url), spools, channels)
    finally:
        for ch in channels.values():
            ch.close()
        stop_all(list(procs.values()), timeout_s=5)  # a fuzzed long-poll may hold a process (KNOWN_BUGS)
        rs.stop()


def _method(svc: str, name: str) -> MethodDescriptor:
    return SERVICES[svc].methods_by_name[name]


def _requests(method: MethodDescriptor) -> st.SearchStrategy[Any]:
    one = st_message(method.input_type, KNOWN)
    return st.lists(one, max_size=3) if method.client_streaming else one


@pytest.mark.parametrize(("svc", "name"), METHODS, ids=[f"{s}.{n}" for s, n in METHODS])
def test_bad_input_gets_a_precise_status_and_changes_nothing(cluster: Cluster, svc: str, name: str) -> None:
    method = _method(svc, name)
    seen: dict[str, int] = {}

    # No shrinking: each call is a real RPC (long-polls cost the whole deadline); the failing
    # request is printed as generated.
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=not RANDOM, database=None,
              phases=(Phase.explicit, Phase.generate), suppress_health_check=list(HealthCheck))
    @given(request=_requests(method))
    def check(request: Any) -> None:
        cluster.settle()
        if svc == "gateway":  # an earlier example may have drained or deregistered the engine
            cluster.reset_gateway()
        before = cluster.state(svc)
        code, details = cluster.call(svc, method, request)
        seen[code.name] = seen.get(code.name, 0) + 1
        proc = cluster.procs[svc]
        assert proc.alive(), f"{svc} died on {name}:\n{proc.tail()}"
        assert health(proc.address) == health_pb2.HealthCheckResponse.SERVING, f"{svc} stopped serving"
        allowed = ALLOWED | ({C.UNAVAILABLE} if (svc, name) in DIALS else set())
        if code == C.INTERNAL and OVERFLOW in details and (svc, name) in KNOWN_OVERFLOWS:
            return  # tracked by test_huge_wait_is_refused_not_overflowed
        assert code in allowed, f"{svc}.{name} answered {code.name}: {details}"
        if code in (C.OK, C.DEADLINE_EXCEEDED):
            return
        assert details.strip() and "internal error" not in details and "Traceback" not in details, details
        cluster.settle()
        assert cluster.state(svc) == before, f"refused {svc}.{name} ({code.name}: {details}) changed state"

    check()
    assert sum(seen.values()) >= 1, seen


def _wait_params() -> list[Any]:
    out = []
    for svc, name, field in WAITS:
        marks = []
        if (svc, name) in KNOWN_OVERFLOWS:
            marks = [pytest.mark.xfail(strict=True, reason=f"known bug: {field}=1e10 or inf -> INTERNAL {OVERFLOW}")]
        out.append(pytest.param(svc, name, field, id=f"{svc}.{name}.{field}", marks=marks))
    return out


@pytest.mark.parametrize(("svc", "name", "field"), _wait_params())
def test_huge_wait_is_refused_not_overflowed(cluster: Cluster, svc: str, name: str, field: str) -> None:
    method = _method(svc, name)
    for huge in (1e10, float("inf")):  # past threading.TIMEOUT_MAX (~9.2e9 s)
        request = message_factory.GetMessageClass(method.input_type)()
        setattr(request, field, huge)
        for f in method.input_type.fields:  # ids, so the wait is reached rather than "id required"
            if f.type == f.TYPE_STRING and not f.is_repeated:
                setattr(request, f.name, {"job_id": JOB, "cell_id": CELL}.get(f.name, "fz-unknown"))
        code, details = cluster.call(svc, method, request)
        assert code in ALLOWED, f"{svc}.{name}({field}={huge}) answered {code.name}: {details}"
        assert cluster.procs[svc].alive()


def test_start_job_with_a_bad_device_is_invalid_argument(cluster: Cluster) -> None:
    method = _method("trainer", "StartJob")
    request = trainer_pb2.StartJobRequest()
    request.job.job_id, request.job.source, request.job.device = "fz-dev", "synthetic", "fz-job"
    code, details = cluster.call("trainer", method, request)
    assert code == C.INVALID_ARGUMENT, f"{code.name}: {details}"
    assert cluster.state("trainer")[1] in ("idle", "failed"), "a refused job must not start"
