"""A crash costs no job: SIGKILL of one process of a live `gyre up` stack while a job runs.

The stack's supervisor (services/supervisor.py, started by `gyre up`) starts the process again
with its own command on its own address; the job goes on and completes. Checked each time: the
job completes with every step published once and in order (final weight version = steps), every
execution of every step ended exactly once, no TITO record of the job was refused by trajectory
(an execution leased again after a crash starts over: its records supersede the earlier
attempt's), and the killed process was restarted and serves again: the restarted cell daemon's cell switches
again while the job runs (`gyre cordon` of it, or of the other cell, makes the policy move it),
the restarted harness gave up its predecessor's leases at once, the restarted scheduler took its
own leadership back. A joined trainer replica (a freed cell's process, started by the trainer core, not
supervised) is evicted at once and the core trains again the micro-batches it had taken, so the
step's update is whole (tests/service/test_trainer_elastic.py checks it equals a single process's).
Everything goes through the `gyre` command and the scheduler's API.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.cli import gyre
from tests.support.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
JOB = ["--groups_per_step", "2", "--group_size", "2", "--execution_timeout_s", "120",
       "--tasks.params.num_modules", "3", "--tasks.params.long_pct", "0", "--evaluation.tasks", "0"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    data = tmp_path_factory.mktemp("crash-stack")
    # trajectory keeps consumed steps' records, so the test can count every execution's records
    gyre(data, "up", "--engines", "2", "--harness-concurrency", "4", env={"GYRE_TRAJECTORY_COLLECT_DONE_STEPS": "false"})
    try:
        yield data
    finally:
        subprocess.run([PY, "-m", "services.cli", "--data-dir", str(data), "down"], cwd=REPO, capture_output=True,
                       timeout=120)


def _state(data: Path) -> dict:
    return json.loads((data / "run" / "state.json").read_text())


def _pid(data: Path, victim: str) -> int:
    state = _state(data)
    return int(state["redis"]["pid"] if victim == "redis" else state["services"][victim]["pid"])


def _until_running(data: Path, job_id: str, timeout_s: float = 120.0) -> None:
    from services.scheduler.client import SchedulerClient

    with SchedulerClient(_state(data)["services"]["scheduler"]["address"]) as c:
        wait_until(lambda: c.get_job(job_id).running != 0, timeout_s, "an execution of the job to start")


def _records_match_calls(data: Path, job_id: str, executions: set[str]) -> None:
    """Every model call of each ended execution's final attempt (the harness's "execution ended"
    line counts them) is one TITO record in trajectory: none lost, none doubled."""
    from services.trajectory.client import TrajectoryClient

    calls: dict[str, int] = {}
    for line in (data / "logs" / "harness.log").read_text(errors="replace").splitlines():
        if '"execution ended"' in line and job_id in line:
            rec = json.loads(line)
            if rec.get("execution_id") in executions and isinstance(rec.get("calls"), dict):
                calls[rec["execution_id"]] = sum(int(v) for v in rec["calls"].values())  # the last attempt's
    assert set(calls) == executions, sorted(executions - set(calls))
    with TrajectoryClient(_state(data)["services"]["trajectory"]["address"]) as trajectory:
        got = {eid: trajectory.execution_stats(eid, job_id=job_id).num_calls for eid in sorted(executions)}
    assert got == calls, {e: (got[e], calls[e]) for e in executions if got[e] != calls[e]}


def _trainer(data: Path):  # noqa: ANN202 - lazy import
    from services.trainer.client import TrainerClient

    return TrainerClient(_state(data)["services"]["trainer"]["address"])


def _pid_of_replica(replica_id: str) -> int | None:
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--replica-id" in argv and argv[argv.index(b"--replica-id") + 1:][:1] == [replica_id.encode()]:
            return int(proc.name)
    return None


def _joined_replica(data: Path, watch_done: Callable[[], bool]) -> tuple[str, int]:
    """(replica id, pid) of a trainer replica taking part in a step (the elastic policy moves a
    freed cell to training once the step's rollout work shrinks), returned SIGSTOPped before the
    step's all-reduce: still training its share, or done and waiting for the core to seal the step.
    Killed there, the core evicts it (at the seal, or by calling the reduce off) and trains its share
    again. The process is frozen first and the step read again, so that it cannot finish the step
    between the look and the kill (a replica killed between steps is nobody's member to evict)."""
    with _trainer(data) as trainer:
        while not watch_done():
            status = trainer.status()
            for r in status.replicas:
                # the core's own replicas (warm ones too) carry their pid; a cell daemon's: by argv
                busy = not (r.left or r.evicted) and r.step == status.step and status.phase == "training"
                pid = (r.pid or _pid_of_replica(r.replica_id)) if busy else None
                if pid is None:
                    continue
                try:
                    os.kill(pid, signal.SIGSTOP)
                except ProcessLookupError:
                    continue
                again = trainer.status()
                if again.phase == "training" and again.step == status.step and any(
                        x.replica_id == r.replica_id and x.step == again.step and not (x.left or x.evicted)
                        for x in again.replicas):
                    return r.replica_id, pid
                os.kill(pid, signal.SIGCONT)  # the step moved on meanwhile: look again
            time.sleep(0.05)
    raise AssertionError("the job ended before any trainer replica joined a step")


def _restarted(data: Path, victim: str, before: int, timeout_s: float = 180.0) -> dict:
    """The status once the supervisor has ``victim`` running again under a new pid, and serving
    (an AssertionError with the last status after ``timeout_s``)."""
    status: dict = {}

    def back() -> bool:
        nonlocal status
        status = json.loads(gyre(data, "status", "--json").stdout)
        if victim == "redis":
            return _pid(data, "redis") != before
        svc = status["services"][victim]
        return svc["pid"] != before and svc["restarts"] >= 1 and svc["alive"] and (svc["serving"] or not svc["address"])

    try:
        wait_until(back, timeout_s, f"{victim} running again under a new pid, and serving", poll_s=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {status}") from None
    return status


def _cells(data: Path) -> dict[str, dict]:
    return {c["cell_id"]: c for c in json.loads(gyre(data, "cells", "--json").stdout)}


def _cordon_a_rollout_cell(data: Path) -> str:
    """Cordon a cell that rolls out now (waiting for the job's policy to give it one)."""
    rolling = wait_until(lambda: [c for c, v in _cells(data).items() if v["role"] == "rollout" and not v["core"]],
                         120, "a cell to roll out for the job", poll_s=0.2)
    gyre(data, "cordon", rolling[0], "--reason", "crash test: a replica for this cell")
    return rolling[0]


def _switches_again(data: Path, before: int, job_id: str) -> None:
    """Once cell-1's daemon is back, make the policy switch cell-1, whatever role it holds: rolling
    out, it is cordoned (drained to training); training, the other cell is cordoned (cell-1 must come
    back to roll out). Waits until the registry shows cell-1 in its new role. The policy moves cells
    only for a running job: should the test's job end first (its last step may be training by the
    time the daemon is back), a second job is submitted to drive the switch, and waited for."""
    from services.scheduler.client import SchedulerClient

    _restarted(data, "cell-1", before)
    deadline = time.monotonic() + 120  # the switch below gets what this wait leaves (a second job: 120 s anew)

    def settled() -> str | None:  # a switch from before the kill
        role = _cells(data)["cell-1"]["role"]
        return None if role == "switching" else role

    role = wait_until(settled, 120, "cell-1 to end its switch from before the kill", poll_s=0.2)
    cordon, target = ("cell-1", "train") if role == "rollout" else ("cell-2", "rollout")
    gyre(data, "cordon", cordon, "--reason", "crash test: switch cell-1 again")
    extra = ""
    with SchedulerClient(_state(data)["services"]["scheduler"]["address"]) as sched:
        while _cells(data)["cell-1"]["role"] != target:
            if not extra and sched.get_job(job_id).state.terminal:
                extra = gyre(data, "submit", str(REPO / "deploy" / "config" / "job.toml"), *JOB,
                             "--num_steps", "2").stdout.strip().splitlines()[-1]
                deadline = time.monotonic() + 120
            assert time.monotonic() < deadline, (f"cell-1 did not switch from {role} to {target}", _cells(data),
                                                 _switch_log(data))
            time.sleep(0.2)
    if extra:  # let it end before the next test's job
        gyre(data, "uncordon", cordon)
        watch = subprocess.run([PY, "-m", "services.cli", "--data-dir", str(data), "watch", extra, "--json"], cwd=REPO,
                               capture_output=True, text=True, timeout=600)
        assert json.loads(watch.stdout.splitlines()[-1])["state"] == "completed", watch.stdout[-2000:]


def _switch_log(data: Path, last: int = 12) -> list[str]:
    """The scheduler's last switch, cordon and refusal lines (why a cell did not move)."""
    keep = ("switch", "cordon", "refused", "drain")
    lines = [line for line in (data / "logs" / "scheduler.log").read_text(errors="replace").splitlines()
             if line.startswith("{") and any(k in json.loads(line).get("event", "") for k in keep)]
    return [line[:400] for line in lines[-last:]]


# when to kill: "leased" once executions of the first step run, "trained" right after step 0 is
# published, "joined" once a replica (a freed cell's trainer process) takes part in a step
VICTIMS = [("engine-1", "leased"), ("cell-1", "leased"), ("gateway", "leased"), ("reward", "leased"),
           ("trajectory", "leased"), ("harness", "leased"), ("trainer", "trained"), ("scheduler", "trained"),
           ("redis", "trained"), ("replica", "joined")]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("victim,moment", VICTIMS, ids=[v for v, _ in VICTIMS])
def test_sigkill_of_one_process_mid_job_costs_nothing(stack: Path, victim: str, moment: str) -> None:
    # 8 executions a step give the elastic policy a tail to move a cell to training in (4 do not),
    # and a replica takes seconds to start: more steps, so that it joins one before the job ends
    # (the cell's job is longer too: it must still run while the restarted cell switches)
    groups, steps = {"joined": (4, 6)}.get(moment, (4, 8) if victim == "cell-1" else (2, 3))
    job_id = gyre(stack, "submit", str(REPO / "deploy" / "config" / "job.toml"), *JOB,
                  "--groups_per_step", str(groups), "--num_steps", str(steps)).stdout.strip().splitlines()[-1]
    before = _pid(stack, victim) if victim != "replica" else 0
    watch = subprocess.Popen([PY, "-m", "services.cli", "--data-dir", str(stack), "watch", job_id, "--json"], cwd=REPO,
                             stdout=subprocess.PIPE, text=True)
    assert watch.stdout is not None
    events: list[dict] = []
    try:
        for line in watch.stdout:
            events.append(json.loads(line))
            k = events[-1]["kind"]
            if (moment in ("leased", "joined") and k == "step_started") or (moment == "trained"
                                                                             and k == "step_trained"):
                break
        if moment == "leased":  # kill while executions of the step are in flight
            _until_running(stack, job_id)
        if moment == "joined":
            # an operator cordons a rollout cell: the policy moves it to training, where the trainer
            # core starts its replica, which joins the running step (no waiting for the policy to
            # free a cell on its own)
            _cordon_a_rollout_cell(stack)
            replica_id, before = _joined_replica(stack, lambda: watch.poll() is not None)
        os.kill(before, signal.SIGKILL)
        if victim == "cell-1":
            _switches_again(stack, before, job_id)
        events += [json.loads(line) for line in watch.stdout]
        assert watch.wait(timeout=700) == 0, events[-3:]
    finally:
        if watch.poll() is None:
            watch.kill()
        if victim in ("cell-1", "replica"):
            for cell in ("cell-1", "cell-2"):
                gyre(stack, "uncordon", cell)
    last = events[-1]
    assert last["kind"] == "end" and last["state"] == "completed" and last["weight_version"] == steps, last
    assert [int(e["step"]) for e in events if e["kind"] == "step_trained"] == list(range(steps))
    ended = [e["execution_id"] for e in events if e["kind"] == "execution_completed" and not e.get("evaluation")]
    assert len(ended) == len(set(ended)) == steps * groups * 2, sorted(ended)
    assert all(e["status"] in ("finished", "timeout", "failed") for e in events if e["kind"] == "execution_completed")
    # every TITO record reached trajectory: none of this job's was refused (a conflict with an
    # earlier attempt's record, a delta against a call it never got, one that came too late)
    refused = [line for line in (stack / "logs" / "trajectory.log").read_text(errors="replace").splitlines()
               if "IngestRecords" in line and "rpc rejected" in line and job_id in line]
    assert not refused, refused[:3]
    _records_match_calls(stack, job_id, {e["execution_id"] for e in events if e["kind"] == "execution_completed"
                                         and e["status"] == "finished" and not e.get("evaluation")})
    if victim == "replica":  # not a supervised process: the core evicts it and trains its share again
        with _trainer(stack) as trainer:
            reports = [trainer.wait_step(s, timeout_s=10) for s in range(steps)]
        assert sum(r.metrics["evicted"] for r in reports) >= 1, [dict(r.metrics) for r in reports]
        with _trainer(stack) as trainer:  # the killed process is nobody's replica any more
            assert not [r for r in trainer.status().replicas if r.replica_id == replica_id and r.pid == before]
        assert _pid_of_replica(replica_id) is None
        return
    # the job may end before the supervisor has the process serving again (a model load): wait for that
    status = _restarted(stack, victim, before)
    assert status["failed"] == {}
    scheduler_log = [json.loads(line) for line in (stack / "logs" / "scheduler.log").read_text(errors="replace")
                     .splitlines() if line.startswith("{")]
    if victim == "cell-1":
        assert not [c for c in json.loads(gyre(stack, "cells", "--json").stdout) if c["cordoned"]]
    if victim == "harness":  # the restarted harness (same harness id) gave up what its predecessor held
        released = [r for r in scheduler_log if r.get("event") == "harness leases released"]
        assert released and any(job_id in e for r in released for e in r["executions"]), released
    if victim == "scheduler":  # the restarted scheduler is the same instance: it led again without a lock wait
        leading = [r["instance_id"] for r in scheduler_log if r.get("event") == "leading"]
        assert len(leading) >= 2 and len(set(leading)) == 1, leading
