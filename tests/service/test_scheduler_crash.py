"""Crash tests: kill -9 a real scheduler process mid-switch and mid-lease, restart it, check state.

The scheduler runs as a subprocess (``services.scheduler.main``, daemon actuator); cells are real
cell-daemon processes; harnesses are this test, over gRPC. Redis is the real one of the fixture.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.common.errors import FailedPrecondition, GyreError
from services.scheduler.client import CellDaemonClient, SchedulerClient
from services.scheduler.jobs import ExecState, JobState, Mode
from services.common.roles import CellRole
from tests.service.scheduler_support import Proc, job_spec, start_daemon, start_scheduler, wait_until


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    yield started
    for p in reversed(started):
        p.terminate()


def test_kill_mid_switch_then_restart_completes_the_switch_once(redis_url: str, tmp_path: Path,
                                                                procs: list[Proc]) -> None:
    sched = start_scheduler(redis_url, tmp_path)
    procs.append(sched)
    procs.append(start_daemon(sched.address, tmp_path, "core", "--role", "train", "--is-core"))
    # the switch takes 3 s on this cell, long enough to kill the scheduler in the middle of it
    c1 = start_daemon(sched.address, tmp_path, "c1", "--role", "rollout", "--switch-delay-s", "3",
                     "--rollout-command", "sleep 3600", "--train-command", "sleep 3600")
    procs.append(c1)
    client = SchedulerClient(sched.address, timeout_s=10)
    client.submit_job(job_spec(num_steps=2, groups_per_step=1, group_size=1, mode=Mode.COLOCATE))
    lease = client.lease("h", job_id="j1", wait_s=10)
    assert lease is not None
    client.complete(lease.execution_id, lease.lease_token, ExecState.FINISHED)

    def switching() -> bool:
        return any(i.cell.cell_id == "c1" and i.cell.role is CellRole.SWITCHING for i in client.list_cells())

    wait_until(switching, 20, "c1 to start switching")
    sched.kill()
    client.close()

    # Redis holds the switch in flight, with where it came from and where it goes
    from services.common.redis_store import connect
    from services.scheduler.state import SchedulerState

    state = SchedulerState(connect(redis_url))
    [pending] = state.pending_switches()
    assert (pending.cell_id, pending.switch_from, pending.switch_to) == ("c1", CellRole.ROLLOUT, CellRole.TRAIN)

    sched2 = start_scheduler(redis_url, tmp_path, name="scheduler-2")
    procs.append(sched2)
    wait_until(lambda: state.get_cell("c1").role is CellRole.TRAIN, 30, "the restarted scheduler to finish the switch")
    finished = [e for e in state.switch_log() if e.attrs["cell_id"] == "c1"]
    assert [e.kind for e in finished] == ["switch_finished"]
    assert finished[0].attrs["switch_id"] == pending.switch_id and int(finished[0].attrs["duration_ms"]) > 0
    assert state.pending_switches() == []
    with CellDaemonClient(c1.address, timeout_s=10) as daemon:
        _cell, role, last = daemon.get_role()
    assert role is CellRole.TRAIN and last == pending.switch_id  # the daemon switched exactly once
    # the job carries on: the update publishes, the restarted scheduler opens step 1 and the pool returns
    with SchedulerClient(sched2.address, timeout_s=10) as c2:
        c2.report_training("j1", 0, "published", 1)
        wait_until(lambda: state.get_cell("c1").role is CellRole.ROLLOUT, 30, "c1 back to rollout")
        assert c2.get_job("j1").enqueued_steps == 2


def test_kill_mid_lease_loses_no_lease_and_completes_each_execution_once(redis_url: str, tmp_path: Path,
                                                                         procs: list[Proc]) -> None:
    sched = start_scheduler(redis_url, tmp_path, "--lease-ttl-s", "2")
    procs.append(sched)
    client = SchedulerClient(sched.address, timeout_s=5)
    client.submit_job(job_spec(num_steps=1, groups_per_step=1, group_size=3))
    alive = client.lease("harness-a", job_id="j1", wait_s=10)
    dead = client.lease("harness-b", job_id="j1", wait_s=10)  # this harness dies: no heartbeats
    assert alive is not None and dead is not None

    stop = threading.Event()
    beats: list[str] = []

    def heartbeat_loop() -> None:  # harness A keeps its lease, riding out the scheduler's death
        with SchedulerClient(sched.address, timeout_s=2) as c:
            while not stop.wait(0.3):
                try:
                    c.heartbeat(alive.execution_id, alive.lease_token)
                    beats.append("ok")
                except GyreError as exc:
                    beats.append(type(exc).__name__)

    t = threading.Thread(target=heartbeat_loop)
    t.start()
    try:
        wait_until(lambda: "ok" in beats, 10, "a heartbeat")
        sched.kill()
        wait_until(lambda: beats[-1] != "ok", 10, "heartbeats to fail while the scheduler is down")
        port = sched.port
        sched2 = start_scheduler(redis_url, tmp_path, "--lease-ttl-s", "2", "--port", str(port), name="scheduler-2")
        procs.append(sched2)
        n = len(beats)
        wait_until(lambda: beats[n:].count("ok") >= 3, 20, "heartbeats to the restarted scheduler")

        with SchedulerClient(sched2.address, timeout_s=10) as c:
            # B's lease expires and its execution goes to harness C (attempt 2); B is fenced off
            got = [c.lease("harness-c", job_id="j1", wait_s=15) for _ in range(2)]  # the queued one and B's
            [again] = [g for g in got if g is not None and g.execution_id == dead.execution_id]
            assert again.attempt == 2
            with pytest.raises(FailedPrecondition):
                c.complete(dead.execution_id, dead.lease_token, ExecState.FINISHED)
            for g in got:
                assert g is not None
                c.complete(g.execution_id, g.lease_token, ExecState.FINISHED)
            stop.set()
            t.join()
            assert c.get_execution(alive.execution_id).state is ExecState.LEASED  # still A's
            res = c.complete(alive.execution_id, alive.lease_token, ExecState.FINISHED)
            assert not res.duplicate and res.done_in_step == 3
            assert c.complete(alive.execution_id, alive.lease_token, ExecState.FINISHED).duplicate
            job = c.get_job("j1")
            assert job.done_in_step == 3 and job.running == 0 and job.queued == 0
            assert job.totals == {"finished": 3, "timeout": 0, "failed": 0, "requeued": 1}
            assert job.state is JobState.RUNNING
            finished = [e for e in c.watch("j1", follow=False) if e.kind == "execution_completed"]
            assert sorted(e.attrs["execution_id"] for e in finished) == sorted(
                f"j1.s0.g0.e{i}" for i in range(3))  # each exactly once
    finally:
        stop.set()
        t.join()
        client.close()
