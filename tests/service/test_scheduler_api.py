"""The scheduler's gRPC API on a real server (port 0) and a real Redis: jobs, leases, events, cells."""

from __future__ import annotations

import threading
import time

import pytest

from protos.gyre.v1 import scheduler_pb2 as pb
from services.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from services.scheduler.costs import StepProgress
from services.scheduler.jobs import ExecState, JobState, Mode
from services.common.roles import CellRole
from services.scheduler.orchestrator import Orchestrator
from tests.service.scheduler_support import InProcess, in_process_scheduler, job_spec
from tests.support.waiting import wait_until


class NoActuator:
    """These tests register no cells, so no switch is ever carried out."""

    def switch(self, *args: object, **kw: object) -> None:
        raise AssertionError("no switch expected")


@pytest.fixture
def sched(redis_url: str) -> InProcess:
    with in_process_scheduler(redis_url, lease_ttl_s=0.5) as s:
        yield s  # type: ignore[misc]


def orchestrator(s: InProcess) -> Orchestrator:
    return Orchestrator(s.state, NoActuator(), instance_id="test", metrics_event_interval_s=3600)


def drain_step(s: InProcess, job_id: str, n: int) -> list[str]:
    ids = []
    for _ in range(n):
        lease = s.client.lease("w", job_id=job_id)
        assert lease is not None
        s.client.complete(lease.execution_id, lease.lease_token, ExecState.FINISHED)
        ids.append(lease.execution_id)
    return ids


def test_job_runs_through_steps_with_leases_training_reports_and_events(sched: InProcess) -> None:
    s = sched
    job = s.client.submit_job(job_spec(num_steps=2))
    assert job.state is JobState.PENDING and job.spec == job_spec(num_steps=2)
    orch = orchestrator(s)
    assert orch.tick()
    job = s.client.get_job("j1")
    assert job.state is JobState.RUNNING and job.enqueued_steps == 1 and job.queued == 4

    lease = s.client.lease("harness-1", wait_s=1.0)
    assert lease is not None and lease.payload in (b"task-a", b"task-b") and lease.attempt == 1
    s.client.heartbeat(lease.execution_id, lease.lease_token)
    first = s.client.complete(lease.execution_id, lease.lease_token, ExecState.FINISHED)
    again = s.client.complete(lease.execution_id, lease.lease_token, ExecState.FINISHED)
    assert not first.duplicate and again.duplicate and again.state is ExecState.FINISHED
    with pytest.raises(FailedPrecondition):
        s.client.complete(lease.execution_id, "forged-token", ExecState.FINISHED)
    with pytest.raises(FailedPrecondition, match="executions ended"):
        s.client.report_training("j1", 0, "published", 1)
    drain_step(s, "j1", 3)
    assert s.client.lease("w", job_id="j1") is None  # colocate: step 1 waits for version 1

    s.client.report_training("j1", 0, "started")
    for bad, why in (({"a b": 1.0}, "metric name 'a b' must be"), ({"loss": float("nan")}, "metric 'loss' is nan")):
        with pytest.raises(InvalidArgument, match=why):  # nothing applied: the step is still open
            s.client.report_training("j1", 0, "published", 1, metrics=bad)
    job, dup = s.client.report_training("j1", 0, "published", 1,
                                        metrics={"loss": 0.5, "staleness_8+": 0.0, "entropy": 1.25})
    assert not dup and job.weight_version == 1 and job.current_step == 1
    orch.tick()
    assert s.client.get_job("j1").queued == 4
    drain_step(s, "j1", 4)
    job, _ = s.client.report_training("j1", 1, "published", 2)
    assert job.state is JobState.COMPLETED

    events = list(s.client.watch("j1", follow=False))
    kinds = [e.kind for e in events]
    assert kinds[:3] == ["job_submitted", "job_state", "step_started"]
    assert kinds.count("execution_completed") == 8 and kinds.count("step_trained") == 2
    assert kinds.count("group_done") == 4 and kinds[-1] == "job_state"
    trained = [e.attrs for e in events if e.kind == "step_trained"]
    assert trained[0]["trainer.loss"] == "0.5" and trained[0]["trainer.staleness_8+"] == "0.0"
    assert not any(k.startswith("trainer.") for k in trained[1])  # step 1 reported no figures
    # resuming from an event id yields exactly the rest
    tail = list(s.client.watch("j1", after_event_id=events[5].event_id, follow=False))
    assert [e.event_id for e in tail] == [e.event_id for e in events[6:]]


def test_watch_follows_until_the_job_ends(sched: InProcess) -> None:
    s = sched
    s.client.submit_job(job_spec(num_steps=1, groups_per_step=1, group_size=1))
    orchestrator(s).tick()
    seen: list[str] = []
    t = threading.Thread(target=lambda: seen.extend(e.kind for e in s.client.watch("j1", timeout_s=30)))
    t.start()
    drain_step(s, "j1", 1)
    s.client.report_training("j1", 0, "published", 1)
    t.join(30)
    assert not t.is_alive() and seen[-2:] == ["step_trained", "job_state"]


def test_expired_lease_is_requeued_and_the_old_token_fenced(sched: InProcess) -> None:
    s = sched
    s.client.submit_job(job_spec(num_steps=1, groups_per_step=1, group_size=1))
    orch = orchestrator(s)
    orch.tick()
    first = s.client.lease("w1")
    assert first is not None and first.lease_ttl_s == pytest.approx(0.5)
    time.sleep(0.7)  # no heartbeat: the lease expires
    orch.tick()
    assert s.client.get_execution(first.execution_id).state is ExecState.QUEUED
    second = s.client.lease("w2", wait_s=2.0)
    assert second is not None and second.execution_id == first.execution_id and second.attempt == 2
    with pytest.raises(FailedPrecondition, match="not the current one"):
        s.client.heartbeat(first.execution_id, first.lease_token)
    with pytest.raises(FailedPrecondition):
        s.client.complete(first.execution_id, first.lease_token, ExecState.FINISHED)
    s.client.complete(second.execution_id, second.lease_token, ExecState.TIMEOUT, "deadline")
    job = s.client.get_job("j1")
    assert job.totals == {"finished": 0, "timeout": 1, "failed": 0, "requeued": 1} and job.done_in_step == 1


def test_last_expired_lease_is_scored_as_timeout_once_the_reward_service_answers(sched: InProcess) -> None:
    s = sched
    s.client.submit_job(job_spec(num_steps=1, groups_per_step=1, group_size=1, max_attempts=1))
    calls: list[dict[str, object]] = []
    reward_up = threading.Event()

    def score(**kw: object) -> None:  # the reward service's Score, down until reward_up is set
        if not reward_up.is_set():
            raise Unavailable("reward service unavailable")
        calls.append(kw)

    orch = Orchestrator(s.state, NoActuator(), instance_id="test", metrics_event_interval_s=3600,
                        timeout_scorer=score)
    orch.tick()
    lease = s.client.lease("w1")
    assert lease is not None
    time.sleep(0.7)  # no heartbeat on the only allowed attempt
    orch.tick()
    ex = s.client.get_execution(lease.execution_id)
    assert ex.state is ExecState.TIMEOUT and "last allowed attempt" in ex.reason

    def settle() -> None:  # the outbox is sent off the tick
        wait_until(lambda: orch._scoring is not None and orch._scoring.done(), 10, "the outbox to be sent")
        orch._scoring = None

    settle()
    assert calls == [] and len(s.state.unscored_timeouts()) == 1  # kept while the reward service is down
    reward_up.set()
    orch.tick()
    settle()
    assert calls == [dict(job_id="j1", execution_id=lease.execution_id, step=0, group_id=lease.group_id,
                          timeout_policy="partial")]
    assert s.state.unscored_timeouts() == []
    orch.tick()
    assert orch._scoring is None and len(calls) == 1  # acknowledged: never sent again


def test_list_cancel_and_lease_wait(sched: InProcess) -> None:
    s = sched
    for i in range(5):
        s.client.submit_job(job_spec(f"j{i}", cell_ids=(f"c{i}",)))
    with pytest.raises(AlreadyExists):
        s.client.submit_job(job_spec("j0"))
    orchestrator(s).tick()  # disjoint cells: all admitted
    page, token = s.client.list_jobs(page_size=2)
    assert [j.job_id for j in page] == ["j0", "j1"] and token
    rest, token2 = s.client.list_jobs(page_size=10, page_token=token)
    assert [j.job_id for j in rest] == ["j2", "j3", "j4"] and token2 == ""
    lease = s.client.lease("w", job_id="j3")
    assert lease is not None
    job, dropped = s.client.cancel_job("j3", "operator")
    assert job.state is JobState.CANCELLED and dropped == 3
    assert s.client.heartbeat(lease.execution_id, lease.lease_token)[2] is True
    with pytest.raises(FailedPrecondition, match="cancelled"):
        s.client.lease("w", job_id="j3")
    cancelled, _ = s.client.list_jobs([JobState.CANCELLED])
    assert [j.job_id for j in cancelled] == ["j3"]
    # long-poll: an empty queue answers after wait_s with no lease
    for j in ("j0", "j1", "j2", "j4"):
        s.client.cancel_job(j)
    t0 = time.monotonic()
    assert s.client.lease("w", wait_s=0.3) is None
    assert time.monotonic() - t0 >= 0.25


def test_submit_without_id_and_with_generator(sched: InProcess) -> None:
    p = pb.JobSpec(model="tiny", num_steps=1, groups_per_step=3, group_size=1, mode=pb.SCHEDULING_MODE_ELASTIC,
                   staleness_bound=1)
    p.tasks.generator.name = "numbered"
    job = sched.client.submit_job(p)
    assert job.job_id.startswith("job-") and job.spec.tasks.generator == "numbered"
    orchestrator(sched).tick()
    lease = sched.client.lease("w", job_id=job.job_id)
    assert lease is not None and b'"group": 0' in lease.payload


def test_cells_register_heartbeat_list_deregister(sched: InProcess) -> None:
    c = sched.client
    assert c.register_cell(cell_id="core", address="127.0.0.1:1", role=CellRole.TRAIN, is_core=True)
    assert c.register_cell(cell_id="c1", address="127.0.0.1:2", role=CellRole.IDLE, kv_capacity_tokens=4096)
    assert not c.register_cell(cell_id="c1", address="127.0.0.1:2", role=CellRole.ROLLOUT, kv_capacity_tokens=4096)
    assert c.cell_heartbeat("c1", role=CellRole.ROLLOUT, inflight=2, kv_used_tokens=100,
                            kv_capacity_tokens=4096) == (CellRole.ROLLOUT, None)
    cells = {i.cell.cell_id: i for i in c.list_cells()}
    assert cells["c1"].cell.inflight == 2 and cells["c1"].alive and cells["core"].cell.is_core
    cordoned = c.cordon_cell("c1", reason="host maintenance")
    assert cordoned.cordoned and cordoned.cordon_reason == "host maintenance"
    # its daemon restarting (registering again) keeps the operator's cordon
    assert not c.register_cell(cell_id="c1", address="127.0.0.1:3", role=CellRole.ROLLOUT, kv_capacity_tokens=4096)
    assert {i.cell.cell_id: i.cell.cordon_reason for i in c.list_cells()} == {"core": "", "c1": "host maintenance"}
    assert not c.cordon_cell("c1", cordoned=False).cordoned
    with pytest.raises(FailedPrecondition, match="core cell"):
        c.cordon_cell("core")
    assert c.deregister_cell("c1") is CellRole.ROLLOUT
    with pytest.raises(NotFound, match="RegisterCell"):
        c.cell_heartbeat("c1", role=CellRole.ROLLOUT)


def test_admission_never_overlaps_running_jobs_cells(sched: InProcess) -> None:
    s = sched
    orch = orchestrator(s)
    s.client.submit_job(job_spec("c", cell_ids=("x",)))
    orch.tick()
    s.client.submit_job(job_spec("a"))  # wants every cell: waits for "c"
    s.client.submit_job(job_spec("b", cell_ids=("y",)))  # disjoint from "c": runs now
    orch.tick()
    assert [s.client.get_job(j).state for j in "abc"] == [JobState.PENDING, JobState.RUNNING, JobState.RUNNING]
    s.client.cancel_job("c")
    orch.tick()  # "a" is older than "b" but "b" holds a cell: "a" still waits
    assert s.client.get_job("a").state is JobState.PENDING
    s.client.cancel_job("b")
    orch.tick()
    assert s.client.get_job("a").state is JobState.RUNNING


def test_staleness_bound_and_rollout_batches_gate_step_enqueueing(sched: InProcess) -> None:
    s = sched
    orch = orchestrator(s)
    # bound 1: step 1's rollouts may overlap step 0 (weights version 0 is 1 behind step 1)
    s.client.submit_job(job_spec("free", num_steps=3, groups_per_step=1, group_size=1, mode=Mode.ELASTIC,
                                 staleness_bound=1, cell_ids=("a",)))
    # one-step-off: step 1 waits until every rollout of step 0 ended
    s.client.submit_job(job_spec("batched", num_steps=3, groups_per_step=1, group_size=1, mode=Mode.ELASTIC,
                                 staleness_bound=1, rollout_batches=True, cell_ids=("b",)))
    orch.tick()
    assert s.client.get_job("free").enqueued_steps == 2 and s.client.get_job("batched").enqueued_steps == 1
    drain_step(s, "batched", 1)
    orch.tick()
    assert s.client.get_job("batched").enqueued_steps == 2  # step 2 needs version 1 anyway
    drain_step(s, "free", 2)
    orch.tick()
    assert s.client.get_job("free").enqueued_steps == 2
    s.client.report_training("free", 0, "published", 1)
    orch.tick()
    assert s.client.get_job("free").enqueued_steps == 3


def test_a_retried_lease_request_gets_the_same_lease(sched: InProcess) -> None:
    """A lease whose answer was lost (the scheduler died after leasing) is given again to the same
    request, not stranded until it expires while the retry takes a second execution."""
    s = sched
    s.client.submit_job(job_spec(num_steps=1, groups_per_step=1, group_size=2))
    orchestrator(s).tick()
    first = s.client.lease("w1", request_id="req-1")
    again = s.client.lease("w1", request_id="req-1")
    assert first is not None and again is not None
    assert (again.execution_id, again.lease_token, again.attempt) == (first.execution_id, first.lease_token, 1)
    assert s.client.lease("w2", request_id="req-1") is not None  # another worker's: not w1's lease
    assert s.client.get_job("j1").running == 2
    s.client.complete(first.execution_id, first.lease_token, ExecState.FINISHED)
    assert s.client.lease("w1", request_id="req-1") is None  # that lease ended: a fresh lease (none left)
    with pytest.raises(InvalidArgument, match="request_id"):
        s.client.lease("w1", request_id="r" * 129)


def test_a_restarted_harness_releases_its_predecessors_leases(redis_url: str) -> None:
    """A harness restarted under a stable id gives up what its dead predecessor held: those
    executions run again now, not after their lease TTL (300 s here); others' leases stay."""
    with in_process_scheduler(redis_url, lease_ttl_s=300.0) as s:
        s.client.submit_job(job_spec(num_steps=1, groups_per_step=1, group_size=3))
        orch = orchestrator(s)
        orch.tick()
        held = [s.client.lease("host-a:harness") for _ in range(2)]
        other = s.client.lease("host-b:harness")
        assert all(held) and other is not None
        assert s.client.release_harness("nobody") == []
        released = s.client.release_harness("host-a:harness", reason="restarted")
        assert sorted(released) == sorted(x.execution_id for x in held if x)
        orch.tick()  # the reaper re-queues them
        assert [s.client.get_execution(e).state for e in sorted(released)] == [ExecState.QUEUED] * 2
        assert s.client.get_execution(other.execution_id).state is ExecState.LEASED
        again = [s.client.lease("host-a:harness") for _ in range(2)]
        assert sorted(x.execution_id for x in again if x) == sorted(released)
        assert all(x is not None and x.attempt == 2 for x in again)
        first = held[0]
        assert first is not None
        with pytest.raises(FailedPrecondition, match="not the current one"):  # its token was the dead process's
            s.client.complete(first.execution_id, first.lease_token, ExecState.FINISHED)
        # given up for good: neither a leader takeover's grace nor the old token's heartbeat revives it
        other_lease = s.client.lease("host-c:harness")
        assert other_lease is None  # nothing queued: the released ones are leased again above
        assert s.client.release_harness("host-b:harness") == [other.execution_id]
        assert orchestrator(s).tick()  # a new instance takes the lead: grace for every lease but the released
        with pytest.raises(FailedPrecondition, match="not the current one"):
            s.client.heartbeat(other.execution_id, other.lease_token)
        assert s.client.get_execution(other.execution_id).state is ExecState.QUEUED
        with pytest.raises(InvalidArgument, match="harness_id is required"):
            s.client.release_harness("")


def test_a_published_update_reports_what_it_measured_and_elastic_weighs_it(sched: InProcess) -> None:
    """ReportTraining carries the update's tokens, compute seconds and world size; the scheduler
    keeps them once per step (a retried report adds nothing), logs them on step_trained, and an
    elastic job's view costs its switches with them (services/scheduler/costs.py)."""
    s = sched
    s.client.submit_job(job_spec(num_steps=3, mode=Mode.ELASTIC, staleness_bound=1))
    orch = orchestrator(s)
    orch.tick()
    assert orch.costs(s.client.get_job("j1"), 3) is None  # nothing measured yet: decide without costs
    drain_step(s, "j1", 4)
    for bad, match in (({"trained_tokens": -1.0, "compute_s": 1.0, "world_size": 1}, "finite and >= 0"),
                       ({"trained_tokens": float("nan"), "compute_s": 1.0, "world_size": 1}, "finite and >= 0"),
                       ({"trained_tokens": 1.0, "compute_s": 1.0, "world_size": -2}, "world_size is -2")):
        with pytest.raises(InvalidArgument, match=match):
            s.client.report_training("j1", 0, "published", 1, **bad)  # type: ignore[arg-type]
    assert s.client.get_job("j1").weight_version == 0  # a refused report changes nothing
    measured = {"trained_tokens": 12_000.0, "compute_s": 6.0, "world_size": 2}
    job, dup = s.client.report_training("j1", 0, "published", 1, **measured)  # type: ignore[arg-type]
    assert not dup and job.weight_version == 1
    _, dup = s.client.report_training("j1", 0, "published", 1, trained_tokens=99.0, compute_s=1.0, world_size=1)
    assert dup
    assert [(x.step, x.tokens, x.compute_s, x.world_size) for x in s.state.train_samples("j1", 1)] == [
        (0, 12_000.0, 6.0, 2)]
    trained = [e for e in s.client.watch("j1", follow=False) if e.kind == "step_trained"]
    assert trained[0].attrs["trained_tokens"] == "12000" and trained[0].attrs["world_size"] == "2"
    orch.tick()
    costs = orch.costs(s.client.get_job("j1"), 3)
    assert costs is not None and costs.rate(2) == pytest.approx(2000.0)
    assert costs.rate(1) == pytest.approx(1000.0)  # no world of 1 measured: extrapolated linearly
    assert "measured: 1 updates" in costs.basis
    ended = s.client.get_job("j1").done_in_step / 4
    assert costs.train_left_tokens == pytest.approx(12_000.0 * ended)  # no count to ask: the coarse estimate
    asked: list[tuple[str, int]] = []

    def progress(job_id: str, step: int) -> StepProgress:
        asked.append((job_id, step))
        return StepProgress(packed_tokens=12_000, trained_tokens=9_000, sealed=True)

    counted = Orchestrator(s.state, NoActuator(), instance_id="test", metrics_event_interval_s=3600,
                           step_progress=progress).costs(s.client.get_job("j1"), 3)
    assert counted is not None and counted.train_left_tokens == pytest.approx(3_000.0)
    assert asked == [("j1", s.client.get_job("j1").current_step)]
    s.client.submit_job(job_spec("j2", num_steps=1))
    assert orch.costs(s.client.get_job("j2"), 3) is None  # colocate weighs nothing
