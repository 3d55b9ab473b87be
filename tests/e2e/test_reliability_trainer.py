"""The trainer core process is SIGKILLed during a step and during a checkpoint write, restarted,
and the job started again: it resumes from the last complete checkpoint and its final weights are
bit-for-bit those of an uninterrupted run -- no step lost, none applied twice.

    trainer (process) --step--> publish v+1 --> checkpoint step-(s+1) (tmp dir, fsync, rename)
        ^ kill -9 while "training"              ^ kill -9 while the tmp dir exists
    restart + StartJob(same job) --> resumes at the newest COMPLETE checkpoint

(tests/unit/test_trainer_checkpoint.py covers a save killed in a helper process and an exact
in-process resume; this is the service itself, killed and restarted as an operator would see it.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from services.trainer import checkpoint as ckpt
from services.trainer.client import TrainerClient
from services.trainer.job import TrainerJob
from services.trajectory.client import TrajectoryClient
from services.trajectory.records import Outcome, Status, TitoCall
from services.common.roles import AgentRole
from tests.service.scheduler_support import wait_until
from tests.support.service_process import ServiceProcess, stop_all

NUM_STEPS = 6
SOURCE = "synthetic:seed=7,executions=8,tokens=160,depth=2,branching=2"
MODEL = "tiny:layers=2,hidden=128"  # a checkpoint write lasts long enough to be hit


def _job(checkpoint_dir: str = "", job_id: str = "kill-e2e", shards: int = 1) -> TrainerJob:
    return TrainerJob(job_id=job_id, model=MODEL, source=SOURCE, num_steps=NUM_STEPS, seed=3,
                      checkpoint_dir=checkpoint_dir, checkpoint_every=1, checkpoint_keep=2, shards=shards)


@pytest.fixture
def trainer(tmp_path: Path) -> Iterator[ServiceProcess]:
    proc = ServiceProcess.start("trainer", "services.trainer.main", tmp_path,
                                ["--grace-s", "1", "--replica-log-dir", str(tmp_path / "logs")])
    try:
        yield proc.wait_ready(timeout_s=120)
    finally:
        stop_all([proc])


def _torn(root: Path) -> set[Path]:
    return set(root.glob(".tmp-step-*"))


def _kill_during(trainer: ServiceProcess, client: TrainerClient, root: Path, where: str,
                 timeout_s: float = 120) -> set[Path]:
    """SIGKILL the trainer while it trains a step (``where='step'``) or writes a checkpoint (a new
    tmp dir appeared); returns the tmp dirs that appeared since the call."""
    before = _torn(root)

    def in_phase() -> bool:
        if where == "checkpoint":
            return bool(_torn(root) - before)
        status = client.status()
        return status.phase == "training" and status.step >= 1

    try:
        wait_until(in_phase, timeout_s, f"the trainer in its {where} phase", poll_s=0.001)
    except AssertionError as exc:
        raise AssertionError(f"{exc}:\n{trainer.tail()}") from None
    trainer.kill()
    return _torn(root) - before


def _resume(trainer: ServiceProcess, root: Path, shards: int) -> tuple[TrainerClient, int]:
    """Restart the process and the job; it must resume at the newest complete checkpoint."""
    latest = ckpt.latest_checkpoint(root)
    assert latest is not None, "a kill after the first step leaves a complete checkpoint"
    expected = ckpt.load_checkpoint(latest, restore_rng=False).step
    trainer.restart()
    client = TrainerClient(trainer.address, timeout_s=60)
    started = client.start_job(_job(str(root), shards=shards))
    assert (started.step, started.weight_version) == (expected, expected), "resume from the last good checkpoint"
    return client, expected


@pytest.mark.parametrize("shards", [1, 2])
def test_trainer_killed_mid_step_and_mid_checkpoint_resumes_exactly(trainer: ServiceProcess, tmp_path: Path,
                                                                    shards: int) -> None:
    """Also a sharded group (2 ranks: the service and the rank process it starts; its DCP
    checkpoints), against an uninterrupted run of the same group."""
    root = tmp_path / "ck"
    client = TrainerClient(trainer.address, timeout_s=60)
    client.start_job(_job(str(root), shards=shards))

    _kill_during(trainer, client, root, "step")
    client.close()
    client, resumed_at = _resume(trainer, root, shards)
    assert resumed_at < NUM_STEPS

    # Kill inside a save: the half-written tmp dir stays behind and is never taken for a checkpoint.
    for _attempt in range(NUM_STEPS):
        torn = _kill_during(trainer, client, root, "checkpoint")
        client.close()
        if torn:
            break
        client, _ = _resume(trainer, root, shards)  # the save finished before the kill landed: try the next one
    else:
        pytest.fail("no kill landed inside a checkpoint write")
    torn_step = max(int(p.name.split("-")[2]) for p in torn)  # .tmp-step-000004-<pid>
    client, resumed_at = _resume(trainer, root, shards)
    assert resumed_at == torn_step - 1, "resumed from the checkpoint before the torn save"

    report = client.wait_step(NUM_STEPS - 1, timeout_s=180)
    assert report.finished and report.weight_version == NUM_STEPS  # one version per step: none applied twice
    wait_until(lambda: client.status().phase == "done", 60, "the job to end (last checkpoint written)")
    assert client.status().weight_version == NUM_STEPS
    version, weights = client.get_weights(-1)
    assert version == NUM_STEPS

    # The same job uninterrupted (same seed and data; no checkpoints), in the same warm process.
    client.start_job(_job(job_id="kill-e2e-reference", shards=shards))
    wait_until(lambda: client.status().phase == "done", 120, "the reference run")
    _version, reference = client.get_weights(-1)
    client.close()
    assert weights.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(weights[name], tensor), f"{name} differs from the uninterrupted run"
    assert ckpt.latest_checkpoint(root) == root / f"step-{NUM_STEPS:06d}"


# -- with the production source (the trajectory service's work queue) ---------------------------
JOB = "kill-traj"


def _execution(rng: np.random.Generator, eid: str) -> list[TitoCall]:
    """A trunk call, a continuation and a retry branching inside the first output (version 0)."""
    prompt, out1, out2, out3 = (rng.integers(0, 512, n) for n in (12, 6, 5, 5))
    lp = lambda n: np.full(n, -np.log(512.0), np.float32) + rng.normal(0, 0.05, n).astype(np.float32)  # noqa: E731
    second = np.concatenate([prompt, out1, rng.integers(0, 512, 4)])
    retry = np.concatenate([prompt, out1[:3]])
    return [TitoCall(eid, f"{eid}-c{i}", "main", AgentRole.MAIN, out, lp(len(out)), 0, prompt_ids=p, job_id=JOB)
            for i, (p, out) in enumerate([(prompt, out1), (second, out2), (retry, out3)])]


@pytest.mark.parametrize("shards", [1, 2])
def test_trainer_killed_mid_step_retrains_the_whole_step_from_trajectory(tmp_path: Path, redis_url: str,
                                                                         shards: int) -> None:
    traj = ServiceProcess.start("trajectory", "services.trajectory.main", tmp_path, [
        "--redis-url", redis_url, "--spool-dir", str(tmp_path / "spool"), "--token-budget", "32",
        "--stream-poll-s", "0.05", "--batch-lease-s", "5", "--grace-s", "1"])
    trainer = ServiceProcess.start("trainer", "services.trainer.main", tmp_path, ["--grace-s", "1"])
    procs = [traj, trainer]
    try:
        for p in procs:
            p.wait_ready(timeout_s=120)
        tc = TrajectoryClient(traj.address, timeout_s=30)
        rng = np.random.default_rng(0)
        tc.open_step(JOB, 0, num_executions=8, group_size=2)
        for i in range(8):
            tc.ingest(_execution(rng, f"e{i}"))
            tc.complete_execution(Outcome(f"e{i}", f"g{i // 2}", Status.FINISHED, float(i % 2), step=0, job_id=JOB))
        planned = tc.close_step(JOB, 0)
        job = TrainerJob(job_id=JOB, model="tiny", source="trajectory", num_steps=1, trajectory_address=traj.address,
                         checkpoint_dir=str(tmp_path / "ck"), shards=shards)
        with TrainerClient(trainer.address, timeout_s=60) as client:
            client.start_job(job)
            try:  # kill right after the first acknowledged batch
                wait_until(lambda: tc.step_plan(JOB, 0).num_acked >= 1, 120, "the first acknowledged batch", poll_s=0)
            except AssertionError as exc:
                raise AssertionError(f"{exc}:\n{trainer.tail()}") from None
            trainer.kill()
        at_kill = tc.step_plan(JOB, 0)
        if at_kill.num_acked == at_kill.num_micro_batches:
            pytest.skip("the kill landed after the step consumed every batch; nothing to check")
        trainer.restart()
        with TrainerClient(trainer.address, timeout_s=60) as client:
            client.start_job(job)
            report = client.wait_step(0, timeout_s=120)
        assert report.finished
        assert report.metrics["tokens"] == planned.num_tokens, (
            f"the resumed step trained {report.metrics['tokens']:.0f} of the step's {planned.num_tokens} tokens")
    finally:
        stop_all(procs)
