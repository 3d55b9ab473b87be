"""SchedulerState on a real redis-server: leases, fencing, re-queue, steps, cells, switches, events.

Time comes from a settable clock (the state layer takes the caller's clock), so lease expiry is
exercised without sleeping.
"""

from __future__ import annotations

import pytest
import redis

from services.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from services.scheduler.jobs import ExecState, JobSpec, JobState, Mode, TaskSource
from services.common.roles import CellRole
from services.scheduler.state import SchedulerState


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def st(redis_url: str, clock: Clock) -> SchedulerState:
    return SchedulerState(redis.Redis.from_url(redis_url), clock=clock)


def spec(job_id: str = "j1", **kw: object) -> JobSpec:
    base: dict[str, object] = dict(job_id=job_id, model="tiny", tasks=TaskSource(payloads=(b"t0", b"t1")),
                                   num_steps=2, groups_per_step=2, group_size=2, mode=Mode.ELASTIC,
                                   staleness_bound=1, execution_timeout_s=100.0, max_attempts=2)
    base.update(kw)
    return JobSpec(**base)  # type: ignore[arg-type]


def running_job(st: SchedulerState, s: JobSpec | None = None) -> JobSpec:
    s = s or spec()
    st.submit_job(s)
    st.set_job_state(s.job_id, JobState.PENDING, JobState.RUNNING)
    return s


def test_submit_get_and_duplicate(st: SchedulerState) -> None:
    job = st.submit_job(spec())
    assert job.state is JobState.PENDING and job.spec == spec()
    with pytest.raises(AlreadyExists):
        st.submit_job(spec())
    with pytest.raises(NotFound):
        st.get_job("nope")
    assert st.active_job_ids() == ["j1"]


def test_lease_takes_lowest_step_and_complete_is_idempotent(st: SchedulerState) -> None:
    s = running_job(st)
    assert st.enqueue_step(s, 0, [b"a", b"b"]) == 4
    assert st.enqueue_step(s, 0, [b"a", b"b"]) == 0  # already enqueued: no duplicates
    assert st.enqueue_step(s, 1, [b"c", b"d"]) == 4
    leases = [st.lease(["j1"], "w", 10.0) for _ in range(4)]
    assert all(lz is not None and lz.step == 0 for lz in leases)
    lz = leases[0]
    assert lz is not None and lz.payload in (b"a", b"b") and lz.attempt == 1
    assert st.get_job("j1").running == 4 and st.get_job("j1").queued == 4

    res = st.complete(lz.execution_id, lz.lease_token, ExecState.FINISHED)
    assert not res.duplicate and res.done_in_step == 1
    again = st.complete(lz.execution_id, lz.lease_token, ExecState.FINISHED)
    assert again.duplicate and again.state is ExecState.FINISHED
    with pytest.raises(FailedPrecondition):
        st.complete(lz.execution_id, "other-token", ExecState.FINISHED)
    job = st.get_job("j1")
    assert job.done_in_step == 1 and job.totals["finished"] == 1 and job.running == 3


def test_expired_lease_requeues_and_fences_the_old_holder(st: SchedulerState, clock: Clock) -> None:
    s = running_job(st, spec(groups_per_step=1, group_size=1))
    st.enqueue_step(s, 0, [b"x"])
    first = st.lease(["j1"], "w1", 5.0)
    assert first is not None
    clock.t += 4
    st.heartbeat(first.execution_id, first.lease_token, 5.0)  # extends to t+4+5
    clock.t += 4.5
    assert st.reap_expired() == []
    clock.t += 1
    assert st.reap_expired() == [(first.execution_id, "requeued")]
    assert st.execution(first.execution_id).state is ExecState.QUEUED
    # the holder is alive after all: its heartbeat reclaims the lease (nobody else took it)
    st.heartbeat(first.execution_id, first.lease_token, 5.0)
    assert st.execution(first.execution_id).state is ExecState.LEASED
    assert st.lease(["j1"], "w2", 5.0) is None
    clock.t += 6
    st.reap_expired()
    second = st.lease(["j1"], "w2", 5.0)
    assert second is not None and second.execution_id == first.execution_id and second.attempt == 2
    with pytest.raises(FailedPrecondition, match="not the current one"):
        st.heartbeat(first.execution_id, first.lease_token, 5.0)
    with pytest.raises(FailedPrecondition):
        st.complete(first.execution_id, first.lease_token, ExecState.FINISHED)
    assert not st.complete(second.execution_id, second.lease_token, ExecState.TIMEOUT).duplicate
    assert st.get_job("j1").totals == {"finished": 0, "timeout": 1, "failed": 0, "requeued": 2}


def test_late_completion_after_requeue_is_accepted_once(st: SchedulerState, clock: Clock) -> None:
    s = running_job(st, spec(groups_per_step=1, group_size=1))
    st.enqueue_step(s, 0, [b"x"])
    lz = st.lease(["j1"], "w1", 1.0)
    assert lz is not None
    clock.t += 2
    st.reap_expired()
    st.complete(lz.execution_id, lz.lease_token, ExecState.FINISHED)
    assert st.lease(["j1"], "w2", 1.0) is None  # it left the queue
    assert st.get_job("j1").done_in_step == 1


def test_max_attempts_ends_as_timeout_into_the_score_outbox(st: SchedulerState, clock: Clock) -> None:
    s = running_job(st, spec(groups_per_step=1, group_size=1, max_attempts=2))
    st.enqueue_step(s, 0, [b"x"])
    for outcome in ("requeued", "timeout"):
        lz = st.lease(["j1"], "w", 1.0)
        assert lz is not None
        assert st.unscored_timeouts() == []
        clock.t += 2
        assert st.reap_expired() == [(lz.execution_id, outcome)]
    job = st.get_job("j1")
    assert job.done_in_step == 1 and job.groups_done_in_step == 1 and job.totals["timeout"] == 1
    kinds = [e.kind for e in st.read_events("j1")]
    assert kinds.count("execution_requeued") == 1 and kinds[-2:] == ["group_done", "step_rollouts_done"]
    # waits for the reward service until acknowledged; reaping again adds nothing
    assert st.unscored_timeouts() == [(lz.execution_id, "j1", 0, lz.group_id)]
    assert st.reap_expired() == []
    st.ack_scored(lz.execution_id)
    assert st.unscored_timeouts() == []


def test_training_reports_advance_steps_and_complete_the_job(st: SchedulerState) -> None:
    s = running_job(st, spec(groups_per_step=1, group_size=1, num_steps=1))
    st.enqueue_step(s, 0, [b"x"])
    lz = st.lease(["j1"], "w", 10.0)
    assert lz is not None
    with pytest.raises(FailedPrecondition, match="0 of 1 executions ended"):
        st.report_training("j1", 0, "published", 1)
    with pytest.raises(InvalidArgument):
        st.report_training("j1", 0, "published", 7)
    with pytest.raises(FailedPrecondition, match="cannot be trained yet"):
        st.report_training("j1", 3, "started", 0)
    st.complete(lz.execution_id, lz.lease_token, ExecState.FINISHED)
    assert st.report_training("j1", 0, "started", 0)
    assert st.get_job("j1").training_step == 0
    assert st.report_training("j1", 0, "published", 1)
    assert not st.report_training("j1", 0, "published", 1)  # repeat: no-op
    job = st.get_job("j1")
    assert job.state is JobState.COMPLETED and job.weight_version == 1 and job.current_step == 1
    assert st.active_job_ids() == []


def test_cancel_drops_queue_and_tells_leaseholders(st: SchedulerState) -> None:
    s = running_job(st)
    st.enqueue_step(s, 0, [b"a", b"b"])
    lz = st.lease(["j1"], "w", 10.0)
    assert lz is not None
    assert st.cancel_job("j1") == 3
    assert st.heartbeat(lz.execution_id, lz.lease_token, 10.0)[2] is True
    assert st.lease(["j1"], "w", 10.0) is None
    assert st.enqueue_step(s, 1, [b"a", b"b"]) == 0  # a cancelled job gets no more work
    with pytest.raises(FailedPrecondition):
        st.set_job_state("j1", JobState.PENDING, JobState.RUNNING)
    assert st.get_job("j1").state is JobState.CANCELLED and st.cancel_job("j1") == 0


def test_cells_and_switch_lifecycle(st: SchedulerState, clock: Clock) -> None:
    running_job(st)
    st.register_cell(cell_id="core", address="a:1", host="h", role=CellRole.TRAIN, is_core=True,
                     kv_capacity_tokens=0)
    assert st.register_cell(cell_id="c1", address="a:2", host="h", role=CellRole.ROLLOUT, is_core=False,
                            kv_capacity_tokens=1000)
    with pytest.raises(InvalidArgument):
        st.register_cell(cell_id="c2", address="a:3", host="h", role=CellRole.ROLLOUT, is_core=True,
                         kv_capacity_tokens=1)
    assert st.cell_heartbeat("c1", inflight=3, kv_used_tokens=500, kv_capacity_tokens=1000, weight_version=0,
                             reported_role=CellRole.ROLLOUT) == (CellRole.ROLLOUT, None)
    with pytest.raises(FailedPrecondition, match="core cell"):
        st.begin_switch(cell_id="core", from_role=CellRole.TRAIN, to_role=CellRole.ROLLOUT, job_id="j1")
    with pytest.raises(FailedPrecondition, match="not train"):
        st.begin_switch(cell_id="c1", from_role=CellRole.TRAIN, to_role=CellRole.ROLLOUT, job_id="j1")
    sid = st.begin_switch(cell_id="c1", from_role=CellRole.ROLLOUT, to_role=CellRole.TRAIN, job_id="j1",
                          reason="consolidate", migrate_to=("c9",))
    cell = st.get_cell("c1")
    assert cell.role is CellRole.SWITCHING and cell.switch_to is CellRole.TRAIN and cell.switch_id == sid
    assert [c.cell_id for c in st.pending_switches()] == ["c1"]
    with pytest.raises(FailedPrecondition):
        st.deregister_cell("c1")
    # a cell re-registering mid-switch keeps the switch (recovery settles it)
    st.register_cell(cell_id="c1", address="a:2", host="h", role=CellRole.ROLLOUT, is_core=False,
                     kv_capacity_tokens=1000)
    assert st.get_cell("c1").role is CellRole.SWITCHING
    clock.t += 8.5
    assert st.end_switch(cell_id="c1", switch_id=sid, job_id="j1", done=True) == pytest.approx(8.5)
    assert st.end_switch(cell_id="c1", switch_id=sid, job_id="j1", done=True) == 0.0  # repeat
    assert st.get_cell("c1").role is CellRole.TRAIN and st.pending_switches() == []
    sid2 = st.begin_switch(cell_id="c1", from_role=CellRole.TRAIN, to_role=CellRole.ROLLOUT, job_id="j1")
    st.end_switch(cell_id="c1", switch_id=sid2, job_id="j1", done=False, error="trainer unreachable")
    assert st.get_cell("c1").role is CellRole.TRAIN
    log = st.switch_log()
    assert [e.kind for e in log] == ["switch_finished", "switch_rolled_back"]
    assert log[0].attrs["duration_ms"] == "8500" and log[1].attrs["error"] == "trainer unreachable"
    assert st.deregister_cell("c1") is CellRole.TRAIN
    assert [c.cell_id for c in st.list_cells()] == ["core"]


def test_events_resume_from_an_id(st: SchedulerState) -> None:
    s = running_job(st)
    st.enqueue_step(s, 0, [b"a", b"b"])
    events = st.read_events("j1")
    assert [e.kind for e in events] == ["job_submitted", "job_state", "step_started"]
    after = st.read_events("j1", events[1].event_id)
    assert [e.kind for e in after] == ["step_started"] and after[0].attrs["executions"] == "4"
    assert st.read_events("j1", events[-1].event_id, block_ms=10) == []


def test_leader_lease(st: SchedulerState, clock: Clock) -> None:
    assert st.acquire_leader("a", 5.0)
    assert st.acquire_leader("a", 5.0)
    assert not st.acquire_leader("b", 5.0)
    st.release_leader("a")
    assert st.acquire_leader("b", 5.0)


def test_grace_extends_leases_after_a_leader_change(st: SchedulerState, clock: Clock) -> None:
    s = running_job(st, spec(groups_per_step=1, group_size=2))
    st.enqueue_step(s, 0, [b"x"])
    a = st.lease(["j1"], "w", 1.0)
    clock.t += 5
    b = st.lease(["j1"], "w", 30.0)
    assert a is not None and b is not None
    assert st.grace_leases(10.0) == 1  # only the lease expiring sooner than 10 s from now
    clock.t += 9
    assert st.reap_expired() == []
    clock.t += 2
    assert st.reap_expired() == [(a.execution_id, "requeued")]
    assert st.execution(b.execution_id).state is ExecState.LEASED
