"""Replica groups (HSDP): freed cells join a sharded job's running step as groups of its shape.

A core trainer group of 2 ranks (this process is rank 0, real gRPC server + TCPStore) runs 4 steps
of a synthetic job; replica processes (``python -m services.trainer.main --replica``, started by
AddReplica) each form a group of 2 ranks and join:

    step 0: a replica on a cell that cannot hold the group    world 1; the replica leaves,
            (its device is CUDA on a host without one)           one sentence in its log
    step 1: replica group A joins before any micro-batch      world 2 (each rank all-reduces
                                                                 its shards with A's same rank)
    step 2: A stays                                            world 2, in the process groups
                                                                 kept from step 1
    step 3: A's rank 1 is SIGKILLed mid-step                   world 1; A evicted, its
                                                                 micro-batches trained again
    step 4: replica group B joins, trains, is given back       world 1 + B's hand-off (its
            (SIGTERM) mid-step                                   gradient sums, whole, added to
                                                                 the core group's shards)

The store-backed synthetic queue's hold/release keys make the join points deterministic. Every
step's metrics and the final weights must equal (fp32 tolerance) one process training every
micro-batch of the same steps.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from protos.gyre.v1 import trainer_pb2_grpc
from services.common.server import build_server
from services.trainer.client import TrainerClient
from services.trainer.core import CoreTrainer
from services.trainer.job import TrainerJob
from services.trainer.main import TRAINER_SERVICE
from services.trainer.servicer import TrainerServicer
from services.trainer.spawn import ReplicaProcesses
from tests.support.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
SOURCE = "synthetic:seed=3,executions=12,tokens=45,depth=1,branching=2,context=6,generated=6,root=10"
STEPS = 5
PREFIX = "gyre/hsdp/synthetic"  # the store-backed queue of job "hsdp"


def _job(job_id: str, shards: int) -> TrainerJob:
    return TrainerJob(job_id=job_id, model="tiny", source=SOURCE, num_steps=STEPS, seed=7, attention="sdpa",
                      shards=shards)


def _reference() -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:
    core = CoreTrainer()
    try:
        core.start(_job("ref", 1), background=False)
        metrics = [core.run_step().metrics for _ in range(STEPS)]
        return metrics, core.weights.get(-1)
    finally:
        core.stop()


def _count(store, key: str) -> int:
    return int(store.add(key, 0))


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False).stdout
    return [int(x) for x in out.split()]


@pytest.mark.timeout(420)
def test_replica_groups_join_leave_and_die_mid_step_and_the_update_is_unchanged(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    ref_metrics, ref_weights = _reference()

    core = CoreTrainer(member_timeout_s=120.0, replica_silence_s=10.0, rank_log_dir=str(tmp_path / "core"))
    servicer = TrainerServicer(core)
    server = build_server("trainer", [(trainer_pb2_grpc.add_TrainerServicer_to_server, servicer)],
                          service_names=[TRAINER_SERVICE]).start()
    address = f"127.0.0.1:{server.port}"
    replicas = ReplicaProcesses(address, log_dir=str(tmp_path), extra_args=("--replica-threads", "1"), warm=0)
    servicer.replicas = replicas
    client = TrainerClient(address)
    store = dist.TCPStore("127.0.0.1", core.store_port, is_master=False)  # our own connection
    for step, hold in enumerate(("0", "0", "0", "4", "0,4")):
        store.set(f"{PREFIX}/hold/{step}", hold)
    misfit: subprocess.Popen[bytes] | None = None
    try:
        client.start_job(_job("hsdp", 2))

        # Step 0: a cell whose devices cannot hold a group of 2 ranks: one sentence, the step goes on.
        wait_until(lambda: _count(store, f"{PREFIX}/waiting/0") >= 1, 120, "the core group to block in step 0")
        log0 = tmp_path / "misfit.log"
        misfit = subprocess.Popen(
            [sys.executable, "-m", "services.trainer.main", "--replica", "--core", address, "--cell-id", "cell-x",
             "--replica-id", "rep-x", "--replica-device", "cuda", "--log-json", "false"],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=open(log0, "wb"), stderr=subprocess.STDOUT)
        assert misfit.wait(timeout=120) != 0
        assert ("this cell cannot hold a replica group of job 'hsdp': a group of 2 ranks from cuda needs 2 CUDA "
                "devices; this host has 0") in log0.read_text()
        store.set(f"{PREFIX}/release/0", "1")
        r0 = client.wait_step(0, timeout_s=120)
        assert r0.finished and r0.metrics["world_size"] == 1

        # Step 1: group A joins while the core group waits at the hold, before any micro-batch.
        wait_until(lambda: _count(store, f"{PREFIX}/waiting/1") >= 1, 120, "the core group to block in step 1")
        a = client.add_replica("cell-a", switch_id="sw1", wait_s=180)
        assert a.step == 1
        wait_until(lambda: _count(store, f"{PREFIX}/waiting/1") >= 2, 180, "replica group A to block in step 1")
        status = client.status()
        assert [r.alive for r in status.group] == [True, True]
        store.set(f"{PREFIX}/release/1", "1")
        r1 = client.wait_step(1, timeout_s=180)
        assert r1.finished and r1.metrics["world_size"] == 2
        assert _count(store, f"{PREFIX}/acked/1/{a.replica_id}") >= 1  # A trained a share

        assert r1.metrics["process_group_built"] == 1

        # Step 2: A stays; the step's all-reduce runs in the process groups kept from step 1.
        wait_until(lambda: _count(store, f"{PREFIX}/waiting/2") >= 2, 180, "both groups to block in step 2")
        store.set(f"{PREFIX}/release/2", "1")
        r2 = client.wait_step(2, timeout_s=180)
        assert r2.finished and r2.metrics["world_size"] == 2 and r2.metrics["process_group_built"] == 0

        # Step 3: both groups take batches and block at index 4; A's rank 1 dies.
        wait_until(lambda: _count(store, f"{PREFIX}/waiting/3") >= 2, 180, "both groups to block in step 3")
        a_ranks = _children(replicas.get("cell-a").proc.pid)
        assert len(a_ranks) == 1, a_ranks  # A's rank 1 (its rank 0 is the replica process)
        os.kill(a_ranks[0], signal.SIGKILL)
        store.set(f"{PREFIX}/release/3", "1")
        assert replicas.wait_exit("cell-a", 120)
        r3 = client.wait_step(3, timeout_s=180)
        assert r3.finished and r3.metrics["world_size"] == 1
        assert r3.metrics["evicted"] == 1 and r3.metrics["retrained"] >= 1

        # Step 4: group B joins, trains, and is given back mid-step: its gradient sums are handed off.
        wait_until(lambda: _count(store, f"{PREFIX}/waiting/4") >= 1, 120, "the core group to block in step 4")
        b = client.add_replica("cell-b", switch_id="sw2", wait_s=180)
        assert b.step == 4
        wait_until(lambda: _count(store, f"{PREFIX}/waiting/4") >= 2, 180, "replica group B to block in step 4")
        store.set(f"{PREFIX}/release/4", "1")
        wait_until(lambda: _count(store, f"{PREFIX}/waiting/4") >= 4, 180, "both groups to block again in step 4")
        replicas.get("cell-b").proc.send_signal(signal.SIGTERM)
        store.set(f"{PREFIX}/release/4/1", "1")
        assert replicas.wait_exit("cell-b", 120)
        r4 = client.wait_step(4, timeout_s=180)
        assert r4.finished and r4.metrics["world_size"] == 1 and r4.metrics["handed_off"] == 1
        assert r4.metrics["evicted"] == 0 and _count(store, f"{PREFIX}/acked/4/{b.replica_id}") >= 1
        assert replicas.get("cell-b").proc.returncode == 0

        for step, report in enumerate((r0, r1, r2, r3, r4)):
            for key in ("loss", "pg_loss", "entropy", "tokens", "micro_batches", "weight_sum"):
                assert report.metrics[key] == pytest.approx(ref_metrics[step][key], rel=1e-5, abs=1e-6), (step, key)
            assert report.metrics["grad_norm"] == pytest.approx(ref_metrics[step]["grad_norm"], rel=1e-4), step
        got = core.weights.get(-1)
        for name, ref_t in ref_weights.items():
            torch.testing.assert_close(got[name], ref_t, rtol=1e-5, atol=1e-6, msg=name)
        assert core.wait(120) and core.status()["phase"] == "done", core.status()["error"]
    finally:
        if misfit is not None and misfit.poll() is None:
            misfit.kill()
        replicas.stop_all()
        client.close()
        core.stop()
        server.stop(0)
