"""Redis restarts under running services (append-only persistence): the scheduler's queue, leases
and cell registry and the trajectory service's records and outcomes are intact afterwards, and
both processes carry on without being restarted -- the scheduler's orchestrator included (it
re-queues a lease that expired across the restart). Nothing is lost or done twice.

    scheduler (process) --\\
                           >-- redis-server (AOF)  <- SIGTERM + start again, same port and dir
    trajectory (process) --/
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from services.common.errors import GyreError
from services.scheduler.client import SchedulerClient
from services.scheduler.jobs import ExecState
from services.common.roles import CellRole
from services.trajectory.client import TrajectoryClient
from services.trajectory.records import Outcome, Status, TitoCall
from tests.service.scheduler_support import job_spec, wait_until
from tests.support.redis_server import RedisServer
from tests.support.service_process import ServiceProcess, stop_all
from tests.unit.trajectory_reference import random_execution

JOB = "j1"
LEASE_TTL_S = 4.0


@pytest.fixture
def services(redis_server: RedisServer, tmp_path: Path) -> Iterator[dict[str, ServiceProcess]]:
    procs = {
        "scheduler": ServiceProcess.start("scheduler", "services.scheduler.main", tmp_path, [
            "--redis-url", redis_server.url, "--actuator", "daemon", "--tick-interval-s", "0.1",
            "--leader-ttl-s", "1.0", "--lease-ttl-s", str(LEASE_TTL_S), "--grace-s", "1"]),
        "trajectory": ServiceProcess.start("trajectory", "services.trajectory.main", tmp_path, [
            "--redis-url", redis_server.url, "--spool-dir", str(tmp_path / "spool"), "--grace-s", "1"]),
    }
    try:
        for p in procs.values():
            p.wait_ready(timeout_s=60)
        yield procs
    finally:
        stop_all(list(procs.values()))


def _records(eid: str, seed: int) -> list[TitoCall]:
    calls = random_execution(np.random.default_rng(seed), 6, 7, execution_id=eid, max_new=5)
    return [TitoCall(**{**c.__dict__, "job_id": JOB}) for c in calls]


def test_redis_restart_keeps_queue_leases_registry_and_records(services: dict[str, ServiceProcess],
                                                               redis_server: RedisServer) -> None:
    sched, traj = services["scheduler"], services["trajectory"]
    pids = {name: p.pid for name, p in services.items()}
    client = SchedulerClient(sched.address, timeout_s=30)
    beats: _Heartbeats | None = None
    tclient = TrajectoryClient(traj.address, timeout_s=30)
    try:
        # -- before: a job with 4 executions, 2 leased (one harness then vanishes), 2 cells, records
        client.register_cell(cell_id="core", address="127.0.0.1:1", role=CellRole.TRAIN, is_core=True)
        client.register_cell(cell_id="c1", address="127.0.0.1:2", role=CellRole.ROLLOUT, kv_capacity_tokens=4096)
        client.submit_job(job_spec(JOB, num_steps=1, groups_per_step=2, group_size=2))
        kept = client.lease("harness-a", job_id=JOB, wait_s=10)
        lost = client.lease("harness-b", job_id=JOB, wait_s=10)  # harness-b never heartbeats again
        assert kept is not None and lost is not None
        tclient.ingest(_records("x1", 1))
        tclient.ingest(_records("x2", 2))
        tclient.open_step(JOB, 0, num_executions=4, group_size=2)
        dup, _plan = tclient.complete_execution(Outcome("x1", "g0", Status.FINISHED, 1.0, step=0, job_id=JOB))
        assert not dup
        beats = _Heartbeats(sched.address, kept.execution_id, kept.lease_token)  # harness-a stays alive
        cells_before = sorted((i.cell.cell_id, i.cell.role, i.cell.is_core) for i in client.list_cells())
        job_before = client.get_job(JOB)
        stats_before = {e: tclient.execution_stats(e, job_id=JOB) for e in ("x1", "x2")}
        plan_before = tclient.step_plan(JOB, 0)

        # -- Redis restarts (SIGTERM flushes the AOF; same port and data dir)
        redis_server.restart()
        assert any(redis_server.data_dir.rglob("*.aof*")), "Redis must be running with appendonly"

        # -- after: same processes, reconnected by themselves; nothing lost
        assert {name: p.pid for name, p in services.items()} == pids and all(p.alive() for p in services.values())
        n = len(beats.results)
        wait_until(lambda: beats.results[n:].count("ok") >= 2, 20, "heartbeats after the restart")
        assert sorted((i.cell.cell_id, i.cell.role, i.cell.is_core) for i in client.list_cells()) == cells_before
        job_after = client.get_job(JOB)
        assert (job_after.queued, job_after.running, job_after.totals) == (
            job_before.queued, job_before.running, job_before.totals) == (2, 2, job_before.totals)
        for eid, stats in stats_before.items():
            assert tclient.execution_stats(eid, job_id=JOB) == stats
        assert tclient.step_plan(JOB, 0) == plan_before
        dup, _plan = tclient.complete_execution(Outcome("x1", "g0", Status.FINISHED, 1.0, step=0, job_id=JOB))
        assert dup, "the outcome recorded before the restart must still be there"
        assert tclient.ingest(_records("x3", 3)).accepted == 6

        # The orchestrator survived too: harness-b's lease expires and is re-queued (attempt 2).
        wait_until(lambda: client.get_execution(lost.execution_id).state is ExecState.QUEUED,
                   LEASE_TTL_S + 20, "the expired lease to be re-queued")
        leased = []
        while (lz := client.lease("harness-c", job_id=JOB, wait_s=2)) is not None:
            leased.append(lz)
        assert sorted(lz.execution_id for lz in leased) == sorted(
            {f"{JOB}.s0.g{g}.e{e}" for g in range(2) for e in range(2)} - {kept.execution_id})
        assert next(lz for lz in leased if lz.execution_id == lost.execution_id).attempt == 2
        beats.stop()
        assert beats.results[-1] == "ok", beats.results
        for lz in [kept, *leased]:
            assert not client.complete(lz.execution_id, lz.lease_token, ExecState.FINISHED).duplicate
        job = client.get_job(JOB)
        assert job.done_in_step == 4 and job.queued == 0 and job.running == 0
        assert job.totals == {"finished": 4, "timeout": 0, "failed": 0, "requeued": 1}
    finally:
        client.close()
        tclient.close()
        if beats is not None:
            beats.stop()


class _Heartbeats:
    """A live harness: heartbeats its lease every 0.3 s in a thread, recording each outcome."""

    def __init__(self, address: str, execution_id: str, token: str) -> None:
        self.results: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(address, execution_id, token), daemon=True)
        self._thread.start()

    def _run(self, address: str, execution_id: str, token: str) -> None:
        with SchedulerClient(address, timeout_s=10) as c:
            while not self._stop.wait(0.3):
                try:
                    c.heartbeat(execution_id, token)
                    self.results.append("ok")
                except GyreError as exc:  # a heartbeat may fail while Redis is down; the next one counts
                    self.results.append(f"{exc.code.name}: {exc}")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
