"""A harness process disappears (SIGKILL) holding a lease, after preserving part of its workspace:

- attempts left: its lease expires, the execution is re-queued (attempt 2) and done once by
  another harness; the dead harness's token is fenced off; reward scores it once and its outcome
  reaches trajectory once.
- last attempt: the execution ends as a timeout; the scheduler has the reward service score it
  from its preserved workspace under the job's timeout policy (partial), which reports its
  outcome to trajectory, so its step completes.

    scheduler, reward, trajectory: real processes on one Redis
    vanishing harness (process): lease -> submit workspace (1/4 parts) -> heartbeat ... SIGKILL
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from services.common.errors import FailedPrecondition, NotFound
from services.reward.client import RewardClient
from services.reward.scorers import ScorerSpec
from services.scheduler.client import SchedulerClient
from services.scheduler.jobs import ExecState, TimeoutPolicy
from services.trajectory.client import TrajectoryClient
from services.trajectory.records import TitoCall
from services.common.roles import AgentRole
from tests.service.scheduler_support import job_spec, wait_until
from tests.support.harness_scorer import PARTS
from tests.support.service_process import ServiceProcess, kill_group, spawn, stop_all

REPO = Path(__file__).resolve().parents[2]

JOB = "jh"
LEASE_TTL_S = 2.0
SCORER = ScorerSpec(kind="entry_point", target="tests.support.harness_scorer:fraction_done")


@pytest.fixture
def stack(tmp_path: Path, redis_url: str) -> Iterator[dict[str, ServiceProcess]]:
    common = ["--redis-url", redis_url, "--spool-dir", str(tmp_path / "spool"), "--grace-s", "1"]
    procs: dict[str, ServiceProcess] = {}
    try:
        procs["trajectory"] = ServiceProcess.start("trajectory", "services.trajectory.main", tmp_path, common)
        procs["trajectory"].wait_ready(timeout_s=60)
        procs["reward"] = ServiceProcess.start("reward", "services.reward.main", tmp_path, [
            *common, "--trajectory-address", procs["trajectory"].address, "--scorer-workers", "1", "--scorer-allowlist",
            "entry_point:tests.support.harness_scorer:fraction_done", "--scorer-paths", str(REPO / "tests")])
        procs["reward"].wait_ready(timeout_s=60)
        procs["scheduler"] = ServiceProcess.start("scheduler", "services.scheduler.main", tmp_path, [
            *common, "--actuator", "daemon", "--tick-interval-s", "0.1", "--leader-ttl-s", "1.0",
            "--lease-ttl-s", str(LEASE_TTL_S), "--reward-address", procs["reward"].address])
        for p in procs.values():
            p.wait_ready(timeout_s=60)
        yield procs
    finally:
        stop_all(list(procs.values()))


def _prepare(stack: dict[str, ServiceProcess], *, group_size: int, max_attempts: int) -> None:
    with SchedulerClient(stack["scheduler"].address) as sched, RewardClient(stack["reward"].address) as rew, \
            TrajectoryClient(stack["trajectory"].address) as traj:
        sched.submit_job(job_spec(JOB, num_steps=1, groups_per_step=1, group_size=group_size,
                                  max_attempts=max_attempts, timeout_policy=TimeoutPolicy.PARTIAL))
        rew.configure_job(JOB, SCORER, timeout_policy="partial")
        traj.open_step(JOB, 0, num_executions=group_size, group_size=group_size)
        for e in range(group_size):  # the executions' model calls, as the gateway would have recorded them
            eid = f"{JOB}.s0.g0.e{e}"
            traj.ingest([TitoCall(eid, "c0", "main", AgentRole.MAIN, np.array([5, 6, 7]), np.full(3, -0.5), 0,
                                  prompt_ids=np.arange(1, 9), job_id=JOB)])


def _vanishing_harness(stack: dict[str, ServiceProcess], tmp_path: Path) -> dict:
    """Start the harness, wait until it leased and preserved its workspace, SIGKILL it."""
    out = tmp_path / "lease.json"
    log = tmp_path / "harness.log"
    proc = spawn("tests.support.vanishing_harness",
                 [stack["scheduler"].address, stack["reward"].address, JOB, str(out)], log)
    try:
        wait_until(lambda: out.exists() or proc.poll() is not None, 60, "the harness to lease")
        assert out.exists(), log.read_text()
    finally:
        kill_group(proc)
    return dict(json.loads(out.read_text()))


def _finish(sched: SchedulerClient, rew: RewardClient, lease: object) -> None:
    """What a live harness does at the end: full workspace, score, complete."""
    eid = lease.execution_id  # type: ignore[attr-defined]
    rew.submit_workspace(JOB, eid, {f"part-{i}.txt": b"done\n" for i in range(1, PARTS + 1)}, task_id="t")
    scored = rew.score(JOB, eid, "finished", group_id=lease.group_id, step=lease.step, task_id="t")  # type: ignore[attr-defined]
    assert not scored.duplicate and scored.reward == 1.0 and scored.outcome_reported
    assert not sched.complete(eid, lease.lease_token, ExecState.FINISHED).duplicate  # type: ignore[attr-defined]


def test_vanished_harness_execution_is_requeued_and_done_once(stack: dict[str, ServiceProcess],
                                                              tmp_path: Path) -> None:
    _prepare(stack, group_size=2, max_attempts=3)
    dead = _vanishing_harness(stack, tmp_path)
    with SchedulerClient(stack["scheduler"].address, timeout_s=30) as sched, \
            RewardClient(stack["reward"].address) as rew, TrajectoryClient(stack["trajectory"].address) as traj:
        first = sched.lease("harness-2", job_id=JOB, wait_s=10)  # the other execution of the group
        assert first is not None and first.execution_id != dead["execution_id"]
        _finish(sched, rew, first)
        again = sched.lease("harness-2", job_id=JOB, wait_s=LEASE_TTL_S + 20)  # after the dead lease expires
        assert again is not None and again.execution_id == dead["execution_id"] and again.attempt == 2
        with pytest.raises(FailedPrecondition):  # the vanished harness's token is fenced off
            sched.complete(dead["execution_id"], dead["lease_token"], ExecState.FINISHED)
        _finish(sched, rew, again)

        assert rew.score(JOB, again.execution_id, "finished").duplicate  # scored exactly once
        job = sched.get_job(JOB)
        assert job.totals == {"finished": 2, "timeout": 0, "failed": 0, "requeued": 1}
        completed = [e.attrs["execution_id"] for e in sched.watch(JOB, follow=False) if e.kind == "execution_completed"]
        assert sorted(completed) == sorted({first.execution_id, again.execution_id})
        plan = traj.step_plan(JOB, 0)
        assert plan.num_completed == 2 and plan.sealed


def test_vanished_harness_on_its_last_attempt_is_scored_partially(stack: dict[str, ServiceProcess],
                                                                  tmp_path: Path) -> None:
    _prepare(stack, group_size=1, max_attempts=1)
    dead = _vanishing_harness(stack, tmp_path)
    eid = dead["execution_id"]
    with SchedulerClient(stack["scheduler"].address, timeout_s=30) as sched, \
            RewardClient(stack["reward"].address) as rew, TrajectoryClient(stack["trajectory"].address) as traj:
        wait_until(lambda: sched.get_execution(eid).state.terminal, LEASE_TTL_S + 20, "the lease to expire")

        def scored() -> object:
            try:
                return rew.get_score(eid)
            except NotFound:
                return None

        def reported() -> bool:  # the score is stored first, then its outcome goes to trajectory
            s = scored()
            return s is not None and s.outcome_reported  # type: ignore[attr-defined]

        wait_until(reported, 30, "the execution to be scored from its preserved workspace and reported")
        score = rew.get_score(eid)
        assert score.status == "timeout" and score.timeout_policy == "partial"
        assert score.reward == pytest.approx(1 / PARTS)  # the one part the harness had preserved
        assert score.outcome_reported
        execution = sched.get_execution(eid)
        assert execution.state is ExecState.TIMEOUT and "last allowed attempt" in execution.reason
        assert sched.get_job(JOB).totals == {"finished": 0, "timeout": 1, "failed": 0, "requeued": 0}
        plan = traj.step_plan(JOB, 0)
        assert plan.num_completed == 1 and plan.sealed
        assert rew.score(JOB, eid, "timeout").duplicate  # scored exactly once
