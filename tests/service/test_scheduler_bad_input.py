"""Bad input to every scheduler RPC gets the right status and a clear message (real server, real Redis).

Raw stubs are used so that malformed requests reach the server exactly as a foreign client would
send them. A hypothesis test throws arbitrary job specs and ids at the API: the answer is always
OK or a precise client-error status, never INTERNAL.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos.gyre.v1 import common_pb2, scheduler_pb2 as pb, scheduler_pb2_grpc as pbg
from services.scheduler.jobs import ExecState
from services.common.roles import CellRole
from services.scheduler.orchestrator import Orchestrator
from tests.service.scheduler_support import InProcess, in_process_scheduler, job_spec

C = grpc.StatusCode


class Stubs:
    def __init__(self, channel: grpc.Channel) -> None:
        self.sched = pbg.SchedulerStub(channel)
        self.harnesses = pbg.HarnessesStub(channel)
        self.cells = pbg.CellsStub(channel)


@pytest.fixture(scope="module")
def env(_session_redis: object) -> Iterator[tuple[InProcess, Stubs, dict[str, str]]]:
    """One server for the module: a running job with a lease, a completed job, a switching cell."""
    import redis

    url = _session_redis.url  # type: ignore[attr-defined]
    redis.Redis.from_url(url).flushall()
    with in_process_scheduler(url) as s:
        s.client.submit_job(job_spec("live", num_steps=1, groups_per_step=1, group_size=2, cell_ids=("y",)))
        s.client.submit_job(job_spec("done", num_steps=1, groups_per_step=1, group_size=1, cell_ids=("x",)))
        Orchestrator(s.state, None, instance_id="t").tick()  # type: ignore[arg-type]
        stale = s.client.lease("w", job_id="live")
        lease = s.client.lease("w", job_id="live")
        d = s.client.lease("w", job_id="done")
        assert stale and lease and d
        s.client.complete(d.execution_id, d.lease_token, ExecState.FINISHED)
        s.client.report_training("done", 0, "published", 1)
        s.client.register_cell(cell_id="sw", address="127.0.0.1:9", role=CellRole.ROLLOUT)
        s.state.begin_switch(cell_id="sw", from_role=CellRole.ROLLOUT, to_role=CellRole.TRAIN, job_id="live")
        # make `stale` stale: expire it by hand (ttl 0) and lease it again
        s.state.heartbeat(stale.execution_id, stale.lease_token, 0.0)
        s.state.reap_expired()
        relet = s.client.lease("w2", job_id="live")
        assert relet and relet.execution_id == stale.execution_id
        ids = {"exec": lease.execution_id, "token": lease.lease_token, "stale_exec": stale.execution_id,
               "stale_token": stale.lease_token}
        with grpc.insecure_channel(s.server.address) as ch:
            yield s, Stubs(ch), ids


def spec(**kw: object) -> pb.JobSpec:
    p = pb.JobSpec(model="tiny", num_steps=1, groups_per_step=1, group_size=1, mode=pb.SCHEDULING_MODE_ELASTIC,
                   staleness_bound=1)
    p.tasks.payloads.payloads.append(b"t")
    for k, v in kw.items():
        if k == "tasks":
            p.ClearField("tasks")
            if v is not None:
                p.tasks.CopyFrom(v)  # type: ignore[arg-type]
        elif isinstance(v, list):
            getattr(p, k).extend(v)
        elif isinstance(v, (pb.Algorithm, pb.Evaluation)):
            getattr(p, k).CopyFrom(v)
        else:
            setattr(p, k, v)
    return p


def gen(name: str, **params: str) -> pb.TaskSource:
    t = pb.TaskSource()
    t.generator.name = name
    t.generator.params.update(params)
    return t


Case = tuple[str, Callable[[Stubs, dict[str, str]], object], grpc.StatusCode, str]

CASES: list[Case] = [
    # Scheduler
    ("submit/no spec", lambda s, i: s.sched.SubmitJob(pb.SubmitJobRequest()), C.INVALID_ARGUMENT, "spec is required"),
    ("submit/no mode", lambda s, i: s.sched.SubmitJob(pb.SubmitJobRequest(spec=spec(mode=0))), C.INVALID_ARGUMENT,
     "mode is required"),
    ("submit/bad mode", lambda s, i: s.sched.SubmitJob(pb.SubmitJobRequest(spec=spec(mode=9))), C.INVALID_ARGUMENT,
     "spec.mode"),
    ("submit/no tasks", lambda s, i: s.sched.SubmitJob(pb.SubmitJobRequest(spec=spec(tasks=None))),
     C.INVALID_ARGUMENT, "spec.tasks is required"),
    ("submit/empty payloads", lambda s, i: s.sched.SubmitJob(pb.SubmitJobRequest(spec=spec(tasks=pb.TaskSource(
        payloads=pb.TaskPayloads())))), C.INVALID_ARGUMENT, "exactly one of"),
    ("submit/huge payload", lambda s, i: s.sched.SubmitJob(pb.SubmitJobRequest(spec=spec(tasks=pb.TaskSource(
        payloads=pb.TaskPayloads(payloads=[b"x" * 70_000]))))), C.INVALID_ARGUMENT, "blob spool"),
    ("submit/unknown generator", lambda s, i: s.sched.SubmitJob(pb.SubmitJobRequest(spec=spec(tasks=gen("nope")))),
     C.INVALID_ARGUMENT, "unknown task generator"),
    ("submit/bad generator params", lambda s, i: s.sched.SubmitJob(pb.SubmitJobRequest(
        spec=spec(tasks=gen("xlong-v1", num_modules="x")))), C.INVALID_ARGUMENT, "xlong-v1"),
    ("submit/bad job id", lambda s, i: s.sched.SubmitJob(pb.SubmitJobRequest(spec=spec(job_id="a b"))),
     C.INVALID_ARGUMENT, "job_id"),
    ("submit/no model", lambda s, i: s.sched.SubmitJob(pb.SubmitJobRequest(spec=spec(model=" "))),
     C.INVALID_ARGUMENT, "model"),
    ("submit/zero steps", lambda s, i: s.sched.SubmitJob(pb.SubmitJobRequest(spec=spec(num_steps=0))),
     C.INVALID_ARGUMENT, "num_steps"),
    ("submit/zero group", lambda s, i: s.sched.SubmitJob(pb.SubmitJobRequest(spec=spec(group_size=0))),
     C.INVALID_ARGUMENT, "group_size"),
    ("submit/step too big", lambda s, i: s.sched.SubmitJob(pb.SubmitJobRequest(
        spec=spec(groups_per_step=1000, group_size=1000))), C.INVALID_ARGUMENT, "exceeds"),
    ("submit/colocate stale", lambda s, i: s.sched.SubmitJob(pb.SubmitJobRequest(
        spec=spec(mode=pb.SCHEDULING_MODE_COLOCATE))), C.INVALID_ARGUMENT, "colocate"),
    ("submit/async no split", lambda s, i: s.sched.SubmitJob(pb.SubmitJobRequest(
        spec=spec(mode=pb.SCHEDULING_MODE_ASYNC))), C.INVALID_ARGUMENT, "async_rollout_cells"),
    ("submit/bad threshold", lambda s, i: s.sched.SubmitJob(pb.SubmitJobRequest(
        spec=spec(consolidate_threshold=1.5))), C.INVALID_ARGUMENT, "consolidate_threshold"),
    ("submit/negative timeout", lambda s, i: s.sched.SubmitJob(pb.SubmitJobRequest(
        spec=spec(execution_timeout_s=-1.0))), C.INVALID_ARGUMENT, "execution_timeout_s"),
    ("submit/bad timeout policy", lambda s, i: s.sched.SubmitJob(pb.SubmitJobRequest(spec=spec(timeout_policy=7))),
     C.INVALID_ARGUMENT, "timeout_policy"),
    ("submit/duplicate cells", lambda s, i: s.sched.SubmitJob(pb.SubmitJobRequest(spec=spec(cell_ids=["a", "a"]))),
     C.INVALID_ARGUMENT, "more than once"),
    ("submit/model does not resolve", lambda s, i: s.sched.SubmitJob(pb.SubmitJobRequest(
        spec=spec(model="/no/such/checkpoint"))), C.INVALID_ARGUMENT, "does not resolve"),
    ("submit/unknown scorer", lambda s, i: s.sched.SubmitJob(pb.SubmitJobRequest(spec=spec(scorer="builtin:nope"))),
     C.INVALID_ARGUMENT, "nope"),
    ("submit/scorer shape", lambda s, i: s.sched.SubmitJob(pb.SubmitJobRequest(spec=spec(scorer="magic"))),
     C.INVALID_ARGUMENT, "scorer"),
    ("submit/bad harness", lambda s, i: s.sched.SubmitJob(pb.SubmitJobRequest(spec=spec(harness="robot"))),
     C.INVALID_ARGUMENT, "harness"),
    ("submit/eval without held-out tasks", lambda s, i: s.sched.SubmitJob(pb.SubmitJobRequest(
        spec=spec(tasks=gen("numbered"), evaluation=pb.Evaluation(tasks=4)))), C.INVALID_ARGUMENT, "held-out"),
    ("submit/bad learning rate", lambda s, i: s.sched.SubmitJob(pb.SubmitJobRequest(
        spec=spec(algorithm=pb.Algorithm(learning_rate=-1.0)))), C.INVALID_ARGUMENT, "learning_rate"),
    ("submit/bad aggregation", lambda s, i: s.sched.SubmitJob(pb.SubmitJobRequest(
        spec=spec(algorithm=pb.Algorithm(loss_aggregation="sum")))), C.INVALID_ARGUMENT, "loss_aggregation"),
    ("submit/long id", lambda s, i: s.sched.SubmitJob(pb.SubmitJobRequest(spec=spec(job_id="j" * 62))),
     C.INVALID_ARGUMENT, "-eval"),
    ("submit/taken id", lambda s, i: s.sched.SubmitJob(pb.SubmitJobRequest(spec=spec(job_id="live"))),
     C.ALREADY_EXISTS, "already exists"),
    ("get/empty", lambda s, i: s.sched.GetJob(pb.GetJobRequest()), C.INVALID_ARGUMENT, "job_id is required"),
    ("get/bad", lambda s, i: s.sched.GetJob(pb.GetJobRequest(job_id="../x")), C.INVALID_ARGUMENT, "job_id"),
    ("get/unknown", lambda s, i: s.sched.GetJob(pb.GetJobRequest(job_id="nope")), C.NOT_FOUND, "does not exist"),
    ("list/page size", lambda s, i: s.sched.ListJobs(pb.ListJobsRequest(page_size=5000)), C.INVALID_ARGUMENT,
     "page_size"),
    ("list/token", lambda s, i: s.sched.ListJobs(pb.ListJobsRequest(page_token="zz")), C.INVALID_ARGUMENT,
     "page_token"),
    ("list/state", lambda s, i: s.sched.ListJobs(pb.ListJobsRequest(states=[0])), C.INVALID_ARGUMENT, "states"),
    ("cancel/unknown", lambda s, i: s.sched.CancelJob(pb.CancelJobRequest(job_id="nope")), C.NOT_FOUND, "nope"),
    ("cancel/ended", lambda s, i: s.sched.CancelJob(pb.CancelJobRequest(job_id="done")), C.FAILED_PRECONDITION,
     "already ended"),
    ("watch/unknown", lambda s, i: list(s.sched.WatchJob(pb.WatchJobRequest(job_id="nope"))), C.NOT_FOUND, "nope"),
    ("watch/bad id", lambda s, i: list(s.sched.WatchJob(pb.WatchJobRequest(job_id="live", after_event_id="x"))),
     C.INVALID_ARGUMENT, "event id"),
    ("execution/empty", lambda s, i: s.sched.GetExecution(pb.GetExecutionRequest()), C.INVALID_ARGUMENT,
     "execution_id is required"),
    ("execution/unknown", lambda s, i: s.sched.GetExecution(pb.GetExecutionRequest(execution_id="e")), C.NOT_FOUND,
     "does not exist"),
    ("training/no phase", lambda s, i: s.sched.ReportTraining(pb.ReportTrainingRequest(job_id="live")),
     C.INVALID_ARGUMENT, "phase"),
    ("training/unknown", lambda s, i: s.sched.ReportTraining(pb.ReportTrainingRequest(
        job_id="nope", phase=pb.TRAINING_PHASE_STARTED)), C.NOT_FOUND, "nope"),
    ("training/negative step", lambda s, i: s.sched.ReportTraining(pb.ReportTrainingRequest(
        job_id="live", step=-1, phase=pb.TRAINING_PHASE_STARTED)), C.INVALID_ARGUMENT, "step"),
    ("training/wrong version", lambda s, i: s.sched.ReportTraining(pb.ReportTrainingRequest(
        job_id="live", phase=pb.TRAINING_PHASE_PUBLISHED, weight_version=5)), C.INVALID_ARGUMENT, "weight_version 1"),
    ("training/future step", lambda s, i: s.sched.ReportTraining(pb.ReportTrainingRequest(
        job_id="live", step=3, phase=pb.TRAINING_PHASE_STARTED)), C.FAILED_PRECONDITION, "cannot be trained yet"),
    ("training/unfinished", lambda s, i: s.sched.ReportTraining(pb.ReportTrainingRequest(
        job_id="live", step=0, phase=pb.TRAINING_PHASE_PUBLISHED, weight_version=1)), C.FAILED_PRECONDITION,
     "0 of 2 executions ended"),
    # Worker
    ("lease/no harness", lambda s, i: s.harnesses.LeaseExecution(pb.LeaseExecutionRequest()), C.INVALID_ARGUMENT,
     "harness_id is required"),
    ("lease/bad wait", lambda s, i: s.harnesses.LeaseExecution(pb.LeaseExecutionRequest(harness_id="w", wait_s=99)),
     C.INVALID_ARGUMENT, "wait_s"),
    ("lease/unknown job", lambda s, i: s.harnesses.LeaseExecution(pb.LeaseExecutionRequest(harness_id="w",
                                                                                         job_id="nope")),
     C.NOT_FOUND, "nope"),
    ("lease/ended job", lambda s, i: s.harnesses.LeaseExecution(pb.LeaseExecutionRequest(harness_id="w",
                                                                                       job_id="done")),
     C.FAILED_PRECONDITION, "completed"),
    ("mint/no execution", lambda s, i: s.harnesses.MintSession(pb.MintSessionRequest(lease_token="t", agent_id="a",
                                                                                   role="main")),
     C.INVALID_ARGUMENT, "execution_id is required"),
    ("mint/no agent", lambda s, i: s.harnesses.MintSession(pb.MintSessionRequest(
        execution_id=i["exec"], lease_token=i["token"], role="subagent")), C.INVALID_ARGUMENT, "agent_id is required"),
    ("mint/bad role", lambda s, i: s.harnesses.MintSession(pb.MintSessionRequest(
        execution_id=i["exec"], lease_token=i["token"], agent_id="a", role="boss")), C.INVALID_ARGUMENT, "role"),
    ("mint/unknown", lambda s, i: s.harnesses.MintSession(pb.MintSessionRequest(
        execution_id="e", lease_token="t", agent_id="a", role="main")), C.NOT_FOUND, "does not exist"),
    ("mint/stale", lambda s, i: s.harnesses.MintSession(pb.MintSessionRequest(
        execution_id=i["stale_exec"], lease_token=i["stale_token"], agent_id="a", role="summary")),
     C.FAILED_PRECONDITION, "not leased with this lease token"),
    ("release/no harness", lambda s, i: s.harnesses.ReleaseHarness(pb.ReleaseHarnessRequest()), C.INVALID_ARGUMENT,
     "harness_id is required"),
    ("release/long harness id", lambda s, i: s.harnesses.ReleaseHarness(pb.ReleaseHarnessRequest(harness_id="w" * 300)),
     C.INVALID_ARGUMENT, "harness_id"),
    ("heartbeat/no token", lambda s, i: s.harnesses.Heartbeat(pb.HeartbeatRequest(execution_id=i["exec"])),
     C.INVALID_ARGUMENT, "lease_token is required"),
    ("heartbeat/unknown", lambda s, i: s.harnesses.Heartbeat(pb.HeartbeatRequest(execution_id="e", lease_token="t")),
     C.NOT_FOUND, "does not exist"),
    ("heartbeat/stale", lambda s, i: s.harnesses.Heartbeat(pb.HeartbeatRequest(
        execution_id=i["stale_exec"], lease_token=i["stale_token"])), C.FAILED_PRECONDITION, "not the current one"),
    ("complete/no status", lambda s, i: s.harnesses.CompleteExecution(pb.CompleteLeaseRequest(
        execution_id=i["exec"], lease_token=i["token"])), C.INVALID_ARGUMENT, "status"),
    ("complete/no id", lambda s, i: s.harnesses.CompleteExecution(pb.CompleteLeaseRequest(
        lease_token="t", status=common_pb2.EXECUTION_STATUS_FINISHED)), C.INVALID_ARGUMENT, "execution_id"),
    ("complete/unknown", lambda s, i: s.harnesses.CompleteExecution(pb.CompleteLeaseRequest(
        execution_id="e", lease_token="t", status=common_pb2.EXECUTION_STATUS_FINISHED)), C.NOT_FOUND,
     "does not exist"),
    ("complete/stale", lambda s, i: s.harnesses.CompleteExecution(pb.CompleteLeaseRequest(
        execution_id=i["stale_exec"], lease_token=i["stale_token"], status=common_pb2.EXECUTION_STATUS_FINISHED)),
     C.FAILED_PRECONDITION, "not the current one"),
    # Cells
    ("register/no id", lambda s, i: s.cells.RegisterCell(pb.RegisterCellRequest(address="h:1")), C.INVALID_ARGUMENT,
     "cell_id is required"),
    ("register/no port", lambda s, i: s.cells.RegisterCell(pb.RegisterCellRequest(cell_id="c", address="h")),
     C.INVALID_ARGUMENT, "host:port"),
    ("register/core rollout", lambda s, i: s.cells.RegisterCell(pb.RegisterCellRequest(
        cell_id="c", address="h:1", is_core=True, role=common_pb2.CELL_ROLE_ROLLOUT)), C.INVALID_ARGUMENT,
     "must register as train"),
    ("register/switching", lambda s, i: s.cells.RegisterCell(pb.RegisterCellRequest(
        cell_id="c", address="h:1", role=common_pb2.CELL_ROLE_SWITCHING)), C.INVALID_ARGUMENT, "not switching"),
    ("register/negative kv", lambda s, i: s.cells.RegisterCell(pb.RegisterCellRequest(
        cell_id="c", address="h:1", kv_capacity_tokens=-5)), C.INVALID_ARGUMENT, "kv_capacity_tokens"),
    ("cell heartbeat/unknown", lambda s, i: s.cells.CellHeartbeat(pb.CellHeartbeatRequest(cell_id="zz")),
     C.NOT_FOUND, "RegisterCell"),
    ("cell heartbeat/negative", lambda s, i: s.cells.CellHeartbeat(pb.CellHeartbeatRequest(cell_id="sw",
                                                                                          inflight=-1)),
     C.INVALID_ARGUMENT, ">= 0"),
    ("cell heartbeat/switching", lambda s, i: s.cells.CellHeartbeat(pb.CellHeartbeatRequest(
        cell_id="sw", role=common_pb2.CELL_ROLE_SWITCHING)), C.INVALID_ARGUMENT, "not switching"),
    ("cordon/no id", lambda s, i: s.sched.CordonCell(pb.CordonCellRequest(cordoned=True)), C.INVALID_ARGUMENT,
     "cell_id is required"),
    ("cordon/unknown", lambda s, i: s.sched.CordonCell(pb.CordonCellRequest(cell_id="zz", cordoned=True)),
     C.NOT_FOUND, "not registered"),
    ("cordon/long reason", lambda s, i: s.sched.CordonCell(pb.CordonCellRequest(cell_id="sw", cordoned=True,
                                                                                reason="x" * 600)),
     C.INVALID_ARGUMENT, "reason is longer"),
    ("deregister/unknown", lambda s, i: s.cells.DeregisterCell(pb.DeregisterCellRequest(cell_id="zz")), C.NOT_FOUND,
     "not registered"),
    ("deregister/switching", lambda s, i: s.cells.DeregisterCell(pb.DeregisterCellRequest(cell_id="sw")),
     C.FAILED_PRECONDITION, "switching"),
]


@pytest.mark.parametrize("name,call,code,message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_a_precise_status(env: tuple[InProcess, Stubs, dict[str, str]], name: str,
                                         call: Callable[[Stubs, dict[str, str]], object], code: grpc.StatusCode,
                                         message: str) -> None:
    _s, stubs, ids = env
    with pytest.raises(grpc.RpcError) as info:
        call(stubs, ids)
    assert info.value.code() == code, info.value.details()
    assert message in info.value.details()


def test_every_rpc_has_a_bad_input_case() -> None:
    covered = {name.split("/")[0] for name, *_ in CASES}
    assert covered >= {"submit", "get", "list", "cancel", "watch", "execution", "training", "lease", "heartbeat",
                       "complete", "register", "cell heartbeat", "deregister", "release", "cordon", "mint"}


CLIENT_ERRORS = {C.INVALID_ARGUMENT, C.NOT_FOUND, C.ALREADY_EXISTS, C.FAILED_PRECONDITION}
text = st.text(max_size=80)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(job_id=st.one_of(st.just(""), st.from_regex(r"[A-Za-z0-9_-]{1,70}", fullmatch=True), text),
       model=text, num_steps=st.integers(-3, 2_000_000), groups=st.integers(-2, 400), size=st.integers(-2, 400),
       mode=st.integers(0, 4), staleness=st.integers(-2, 20), policy=st.integers(0, 4),
       timeout=st.floats(allow_nan=True, allow_infinity=True), attempts=st.integers(-1, 200),
       payloads=st.lists(st.binary(max_size=64), max_size=3), threshold=st.one_of(st.none(), st.floats(-1, 2)),
       cells=st.lists(st.from_regex(r"[a-c]{1,2}", fullmatch=True), max_size=3))
def test_arbitrary_specs_get_ok_or_a_client_error(env: tuple[InProcess, Stubs, dict[str, str]], job_id: str,
                                                  model: str, num_steps: int, groups: int, size: int, mode: int,
                                                  staleness: int, policy: int, timeout: float, attempts: int,
                                                  payloads: list[bytes], threshold: float | None,
                                                  cells: list[str]) -> None:
    _s, stubs, _ids = env
    p = pb.JobSpec(job_id=job_id, model=model, num_steps=num_steps, groups_per_step=groups, group_size=size,
                   mode=mode, staleness_bound=staleness, timeout_policy=policy, execution_timeout_s=timeout,
                   max_attempts=attempts, cell_ids=cells)
    p.tasks.payloads.payloads.extend(payloads)
    if threshold is not None:
        p.consolidate_threshold = threshold
    try:
        job = stubs.sched.SubmitJob(pb.SubmitJobRequest(spec=p)).job
    except grpc.RpcError as exc:
        assert exc.code() in CLIENT_ERRORS, (exc.code(), exc.details())
        assert exc.details()
        return
    got = stubs.sched.GetJob(pb.GetJobRequest(job_id=job.spec.job_id)).job
    assert got.spec == job.spec and got.spec.num_steps == num_steps


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(a=text, b=text)
def test_arbitrary_ids_get_a_client_error(env: tuple[InProcess, Stubs, dict[str, str]], a: str, b: str) -> None:
    _s, stubs, _ids = env
    calls = [lambda: stubs.sched.GetJob(pb.GetJobRequest(job_id=a)),
             lambda: stubs.sched.GetExecution(pb.GetExecutionRequest(execution_id=a)),
             lambda: stubs.harnesses.Heartbeat(pb.HeartbeatRequest(execution_id=a, lease_token=b)),
             lambda: stubs.cells.CellHeartbeat(pb.CellHeartbeatRequest(cell_id=a)),
             lambda: list(stubs.sched.WatchJob(pb.WatchJobRequest(job_id="live", after_event_id=a)))]
    for call in calls:
        try:
            call()
        except grpc.RpcError as exc:
            assert exc.code() in CLIENT_ERRORS, (exc.code(), exc.details())
