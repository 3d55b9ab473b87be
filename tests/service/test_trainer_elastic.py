"""Elastic data parallelism with real processes: the update does not depend on who took part.

A core trainer (in this process, real gRPC server + TCPStore) runs 4 steps of a synthetic job;
replica *processes* (``python -m services.trainer.main --replica``) join and leave:

    step 0: core alone                                  world 1
    step 1: replica A (started by AddReplica) joins     world 2
            before any micro-batch is handed out
    step 2: replica B (started by "its cell daemon":     world 3
            here the test; AddReplica(hosted) only
            waits for it) joins mid-step (after 2 batches)
    step 3: B is SIGTERMed mid-step: it hands its       world 1 (+ B's hand-off,
            gradient sum to the core and exits; A is        + A's batches retrained
            SIGKILLed mid-step: the core sees its process   by the core)
            gone, evicts it at once and trains again the
            micro-batches A had taken (their gradients
            died with it)
    step 4: replica C (started by "its cell daemon", on  world 1 (+ C's batch
            what could be another host: the core knows     retrained by the core)
            nothing of its process) takes a batch and is
            SIGKILLed: its heartbeats stop, the core
            evicts it after replica_silence_s (6 s), not
            member_timeout_s (120 s)

The store-backed synthetic queue's hold/release keys make the join points deterministic. The
weights and metrics after every step must equal (fp32 tolerance) a single-process run of the
same steps.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from protos.gyre.v1 import trainer_pb2_grpc
from services.common.errors import FailedPrecondition
from services.common.server import build_server
from services.trainer.client import TrainerClient
from services.trainer.core import CoreTrainer
from services.trainer.handoff import SharedHandoff
from services.trainer.job import TrainerJob
from services.trainer.main import TRAINER_SERVICE
from services.trainer.metrics import HANDOFFS
from services.trainer.servicer import TrainerServicer
from services.trainer.spawn import ReplicaProcesses
from tests.support.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
SOURCE = "synthetic:seed=3,executions=12,tokens=45,depth=1,branching=2,context=6,generated=6,root=10"
STEPS = 5


def _job(job_id: str) -> TrainerJob:
    return TrainerJob(job_id=job_id, model="tiny", source=SOURCE, num_steps=STEPS, seed=7, attention="sdpa")


def _reference() -> tuple[list[dict[str, torch.Tensor]], list[dict[str, float]]]:
    core = CoreTrainer()
    core.weights.keep = STEPS + 1
    core.start(_job("ref"), background=False)
    metrics = [core.run_step().metrics for _ in range(STEPS)]
    return [core.weights.get(v) for v in range(1, STEPS + 1)], metrics


def _count(store, key: str) -> int:
    return int(store.add(key, 0))


def _replica_process(cell_id: str, replica_id: str, core: str, logs: Path) -> subprocess.Popen[bytes]:
    """A replica as a cell daemon starts it (the core does not know its process)."""
    return subprocess.Popen(
        [sys.executable, "-m", "services.trainer.main", "--replica", "--core", core, "--cell-id", cell_id,
         "--replica-id", replica_id, "--replica-threads", "1", "--log-json", "false"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=open(logs / f"{replica_id}.log", "wb"),
        stderr=subprocess.STDOUT)


@pytest.mark.timeout(300)
def test_update_is_independent_of_replicas_and_join_time(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    ref_weights, ref_metrics = _reference()

    published: dict[int, dict[str, float]] = {}  # what the scheduler is told each update measured
    core = CoreTrainer(member_timeout_s=120.0, replica_silence_s=6.0,
                       reporter=lambda job, step, phase, version, measured=None, metrics=None:
                       published.setdefault(step, dict(measured or {})) if phase == "published" else None)
    core.weights.keep = STEPS + 1
    servicer = TrainerServicer(core)
    server = build_server("trainer", [(trainer_pb2_grpc.add_TrainerServicer_to_server, servicer)],
                          service_names=[TRAINER_SERVICE]).start()
    address = f"127.0.0.1:{server.port}"
    # one warm replica process: cell-a's AddReplica gets it (imports done) instead of a cold start
    replicas = ReplicaProcesses(address, log_dir=str(tmp_path), extra_args=("--replica-threads", "1", "--log-json",
                                                                            "false"), warm=1)
    warm = replicas.warm_pids()
    assert len(warm) == 1
    servicer.replicas = replicas
    client = TrainerClient(address)
    store = dist.TCPStore("127.0.0.1", core.store_port, is_master=False)  # our own connection
    prefix = "gyre/elastic/synthetic"
    store.set(f"{prefix}/hold/1", "0")
    store.set(f"{prefix}/hold/2", "2")
    store.set(f"{prefix}/hold/3", "3")
    store.set(f"{prefix}/hold/4", "0")
    b_proc: subprocess.Popen[bytes] | None = None
    c_proc: subprocess.Popen[bytes] | None = None
    try:
        client.start_job(_job("elastic"))
        assert client.wait_step(0, timeout_s=60).finished

        # Step 1: A joins while the core waits at the hold, before any micro-batch.
        wait_until(lambda: _count(store, f"{prefix}/waiting/1") >= 1, 90, "core to block in step 1")
        added = client.add_replica("cell-a", switch_id="sw1", wait_s=120)
        assert added.step == 1 and added.pid == warm[0]  # the warm process took the cell
        assert replicas.warm_pids() == []  # the pool's one process is busy (it comes back when A ends)
        wait_until(lambda: _count(store, f"{prefix}/waiting/1") >= 2, 90, "replica A to block in step 1")
        store.set(f"{prefix}/release/1", "1")
        r1 = client.wait_step(1, timeout_s=90)
        assert r1.finished and r1.metrics["world_size"] == 2

        # Step 2: core and A take 2 batches and block; B joins mid-step.
        wait_until(lambda: _count(store, f"{prefix}/waiting/2") >= 2, 90, "core and A to block in step 2")
        b_proc = _replica_process("cell-b", "rep-b", address, tmp_path)
        hosted = client.add_replica("cell-b", switch_id="sw2", wait_s=60, hosted=True)
        assert (hosted.replica_id, hosted.step) == ("rep-b", 2)
        with pytest.raises(FailedPrecondition, match="no replica of cell 'cell-z' joined"):
            client.add_replica("cell-z", switch_id="sw3", wait_s=0.2, hosted=True)
        wait_until(lambda: _count(store, f"{prefix}/waiting/2") >= 3, 90, "replica B to block in step 2")
        store.set(f"{prefix}/release/2", "1")
        r2 = client.wait_step(2, timeout_s=90)
        assert r2.finished and r2.metrics["world_size"] == 3
        assert _count(store, f"{prefix}/acked/2/rep-b") >= 1

        # Step 3: B is told to go mid-step (it hands its gradient sum off and exits); A dies.
        wait_until(lambda: _count(store, f"{prefix}/waiting/3") >= 3, 90, "three consumers to block in step 3")
        a_replica = replicas.get("cell-a")
        # what A took: trained (a gradient that dies with it) and the batch it is blocked on
        a_took = [x for x in store.get(f"{prefix}/taken/3/{a_replica.replica_id}").decode().split(",") if x]
        assert a_took
        a_replica.proc.kill()
        assert replicas.wait_exit("cell-a", 60)
        # B's stop flag is set while it is blocked on a batch (the signal interrupts its wait): once
        # released, it gives that batch's forward up at once and hands the batch back unacknowledged
        b_proc.send_signal(signal.SIGTERM)
        store.set(f"{prefix}/release/3", "1")
        r3 = client.wait_step(3, timeout_s=60)  # A's death is seen at once: no member_timeout_s wait
        assert r3.finished and r3.metrics["world_size"] == 1 and r3.metrics["handed_off"] == 1
        assert r3.metrics["evicted"] == 1 and r3.metrics["retrained"] == len(a_took)
        assert b_proc.wait(timeout=60) == 0
        b_log = (tmp_path / "rep-b.log").read_text()
        assert "micro-batch given up mid-forward; handed back" in b_log and "batch_id=3/" in b_log

        # Step 4: C joins, takes a batch and dies; only its silence tells the core.
        wait_until(lambda: _count(store, f"{prefix}/waiting/4") >= 1, 90, "core to block in step 4")
        c_proc = _replica_process("cell-c", "rep-c", address, tmp_path)
        assert client.add_replica("cell-c", switch_id="sw4", wait_s=60, hosted=True).step == 4
        wait_until(lambda: _count(store, f"{prefix}/waiting/4") >= 2, 90, "replica C to take a batch in step 4")
        c_proc.kill()
        c_proc.wait(timeout=30)
        store.set(f"{prefix}/release/4", "1")
        r4 = client.wait_step(4, timeout_s=60)  # within member_timeout_s (120 s): C's silence evicted it
        assert r4.finished and r4.metrics["world_size"] == 1
        assert r4.metrics["evicted"] == 1 and r4.metrics["retrained"] == 1  # the batch C was blocked on

        for step, (ref_m, report) in enumerate(zip(ref_metrics, (None, r1, r2, r3, r4))):
            got_m = core.wait_step(step, 1).metrics  # type: ignore[union-attr]
            for key in ("loss", "pg_loss", "entropy", "clip_frac", "tokens", "micro_batches", "weight_sum"):
                assert got_m[key] == pytest.approx(ref_m[key], rel=1e-5, abs=1e-6), (step, key)
            assert got_m["grad_norm"] == pytest.approx(ref_m["grad_norm"], rel=1e-4), step
            # the cost sample: every participant's tokens over the longest share any of them computed
            sample = published[step]
            assert sample["tokens"] == got_m["tokens"] and sample["world_size"] == got_m["world_size"], step
            assert sample["compute_s"] == max(got_m["compute_s"], got_m["compute_s_max"]) > 0, step
            got_w = core.weights.get(step + 1)
            for name, ref_t in ref_weights[step].items():
                torch.testing.assert_close(got_w[name], ref_t, rtol=1e-5, atol=1e-6, msg=f"step {step} {name}")
    finally:
        for proc in (b_proc, c_proc):
            if proc is not None and proc.poll() is None:
                proc.kill()
        replicas.stop_all()
        client.close()
        core.stop()
        server.stop(0)


@dataclass
class _Pool:
    replicas: ReplicaProcesses
    client: TrainerClient
    store: Any
    prefix: str
    pid: int  # the pool's one process


@contextmanager
def _pool_core(tmp_path: Path, job_id: str, handoff: SharedHandoff | None = None,
               hold: str = "0") -> Iterator[_Pool]:
    """A core with a pool of one warm replica process, running a 2-step job whose core blocks in
    step 1 (the synthetic queue's hold) until the test is done; everything stopped afterwards."""
    torch.set_num_threads(1)
    core = CoreTrainer(member_timeout_s=120.0, replica_silence_s=6.0)
    servicer = TrainerServicer(core, handoff=handoff)
    server = build_server("trainer", [(trainer_pb2_grpc.add_TrainerServicer_to_server, servicer)],
                          service_names=[TRAINER_SERVICE]).start()
    address = f"127.0.0.1:{server.port}"
    replicas = ReplicaProcesses(address, log_dir=str(tmp_path), extra_args=("--replica-threads", "1", "--log-json",
                                                                            "false"), warm=1)
    servicer.replicas = replicas
    client = TrainerClient(address)
    store = dist.TCPStore("127.0.0.1", core.store_port, is_master=False)
    prefix = f"gyre/{job_id}/synthetic"
    store.set(f"{prefix}/hold/1", hold)
    try:
        assert replicas.wait_ready(120), "the pool process did not warm up"
        [pid] = replicas.warm_pids()
        client.start_job(TrainerJob(job_id=job_id, model="tiny", source=SOURCE, num_steps=2, seed=7,
                                    attention="sdpa"))
        assert client.wait_step(0, timeout_s=60).finished
        wait_until(lambda: _count(store, f"{prefix}/waiting/1") >= 1, 90, "core to block in step 1")
        yield _Pool(replicas, client, store, prefix, pid)
    finally:
        replicas.stop_all()
        client.close()
        core.stop()
        server.stop(0)


@pytest.mark.timeout(300)
def test_a_released_replica_process_goes_back_to_the_pool(tmp_path: Path) -> None:
    """The core's pool of replica processes: a cell given back (ReleaseReplica) frees its process,
    which waits for the next cell instead of exiting, so the next AddReplica (another cell, the same
    job) gets it ready: no process start on any later switch. Its step completes with both.

    The pool's processes run on the core's host, so the released replica hands its gradient sum
    over through the core's shared-memory folder (the main test above streams B's, a replica a
    cell daemon started), and leaves no file there."""
    shm = SharedHandoff(tmp_path)
    via_shm = HANDOFFS.labels(via="shared_memory")
    before = via_shm._value.get()
    with _pool_core(tmp_path, "pool", handoff=shm, hold="0,2") as pool:
        replicas, client, store, prefix, pid = pool.replicas, pool.client, pool.store, pool.prefix, pool.pid
        a = client.add_replica("cell-a", switch_id="s1", wait_s=120)
        assert (a.pid, a.step) == (pid, 1)
        wait_until(lambda: _count(store, f"{prefix}/waiting/1") >= 2, 90, "replica A to block in step 1")
        # the first gate opens: the core and A train one batch each and block at the second one
        store.set(f"{prefix}/release/1", "1")
        wait_until(lambda: _count(store, f"{prefix}/waiting/1") >= 4, 90, "core and A at the second gate")
        assert _count(store, f"{prefix}/acked/1/{a.replica_id}") == 1
        # the cell is given back while A waits in the store (the test hook's gate, where no signal
        # handler runs): once the gate opens, A gives that batch's forward up, hands it back and
        # hands the gradient of the one it trained off
        signalled = threading.Event()
        terminate = replicas.terminate
        replicas.terminate = lambda cell: (terminate(cell), signalled.set())  # type: ignore[method-assign]
        out: dict[str, object] = {}
        releasing = threading.Thread(target=lambda: out.setdefault(
            "r", client.release_replica(cell_id="cell-a", wait_s=60)))
        releasing.start()
        assert signalled.wait(60)
        store.set(f"{prefix}/release/1/1", "1")
        releasing.join(90)
        released = out["r"]
        assert released.released and released.replica_id == a.replica_id  # type: ignore[attr-defined]
        # left (its cell is given back), and its process is free again, not gone
        assert replicas.alive(a.replica_id) is False and pid in replicas.warm_pids()
        assert replicas.get("cell-a").proc.poll() is None

        b = client.add_replica("cell-b", switch_id="s2", wait_s=120)
        assert (b.pid, b.step) == (pid, 1) and b.replica_id != a.replica_id  # the same process, a new replica
        r1 = client.wait_step(1, timeout_s=90)
        assert r1.finished and r1.metrics["handed_off"] == 1
        assert via_shm._value.get() == before + 1  # A's sum came through shared memory
        assert [p.name for p in shm.dir.iterdir()] == [".token"]
        # the job's end releases B too: its process is back in the pool, again not gone
        wait_until(lambda: replicas.alive(b.replica_id) is False, 90, "replica B to end with the job")
        assert pid in replicas.warm_pids()
        log = (tmp_path / "replica-warm.log").read_text()
        assert log.count("warm replica assigned") == 2
        assert "micro-batch given up mid-forward; handed back" in log
    assert replicas.warm_pids() == []
    shm.close()


@pytest.mark.timeout(300)
def test_a_cell_given_back_before_its_pool_process_made_the_replica_is_released(tmp_path: Path) -> None:
    """The core hands a pool process a cell and gives it back at once (a short switch back), while
    the process has not yet read the cell's line (here: stopped with SIGSTOP until both are sent).
    The release, ordered after the hand-over on the process's stdin, still reaches that replica:
    it leaves without joining the running step and the process is back in the pool. (A release by
    signal came before the line was read and was lost: the replica joined the step and the switch
    waited for it.)"""
    with _pool_core(tmp_path, "pool-early") as pool:
        replicas, pid = pool.replicas, pool.pid
        try:
            os.kill(pid, signal.SIGSTOP)
            spawned = replicas.start("cell-a", "s1")
            assert spawned.pooled and spawned.proc.pid == pid
            replicas.terminate("cell-a")
            os.kill(pid, signal.SIGCONT)
            assert replicas.wait_exit("cell-a", 60), "the released replica did not leave"
            assert pid in replicas.warm_pids()  # back in the pool, not gone
            assert not [r for r in pool.client.status().replicas if r.replica_id == spawned.replica_id]  # never joined
            assert _count(pool.store, f"{pool.prefix}/waiting/1") == 1  # only the core waits in step 1
        finally:
            os.kill(pid, signal.SIGCONT)
            pool.store.set(f"{pool.prefix}/release/1", "1")


@pytest.mark.timeout(300)
def test_a_replica_gone_after_the_seal_costs_seconds_not_the_collective_timeout() -> None:
    """A replica that reported done, was sealed into the step and then went away before reaching
    the all-reduce (its host died: heartbeats stop): the core calls the reduce off after
    replica_silence_s, evicts it and publishes the same update as alone, instead of waiting in the
    process group's setup for collective_timeout_s (600 s) and failing the job."""
    torch.set_num_threads(1)
    ref_weights, _ = _reference()
    core = CoreTrainer(member_timeout_s=120.0, replica_silence_s=2.0)
    core.weights.keep = STEPS + 1
    servicer = TrainerServicer(core)
    server = build_server("trainer", [(trainer_pb2_grpc.add_TrainerServicer_to_server, servicer)],
                          service_names=[TRAINER_SERVICE]).start()
    client = TrainerClient(f"127.0.0.1:{server.port}")
    store = dist.TCPStore("127.0.0.1", core.store_port, is_master=False)
    prefix = "gyre/ghost/synthetic"
    store.set(f"{prefix}/hold/1", "0")
    try:
        client.start_job(_job("ghost"))
        assert client.wait_step(0, timeout_s=60).finished
        wait_until(lambda: _count(store, f"{prefix}/waiting/1") >= 1, 90, "core to block in step 1")
        ticket, _, _ = client.join_step("ghost-1", "cell-g")
        assert ticket.step == 1
        sealed: dict[str, object] = {}
        waiting = threading.Thread(target=lambda: sealed.setdefault("seal", client.await_reduce("ghost-1", 1)))
        waiting.start()  # done (it trained nothing) and alive until the seal...
        store.set(f"{prefix}/release/1", "1")
        while waiting.is_alive():
            client.replica_alive("ghost-1")
            waiting.join(0.2)
        seal = sealed["seal"]
        assert (seal.rank, seal.world_size) == (1, 2)  # type: ignore[attr-defined]
        t0 = time.monotonic()  # ...then silent, never arriving at the all-reduce
        r1 = client.wait_step(1, timeout_s=60)
        assert time.monotonic() - t0 < 30
        assert r1.finished and r1.metrics["world_size"] == 1 and r1.metrics["evicted"] == 1
        for name, ref_t in ref_weights[1].items():  # the update the core makes alone
            torch.testing.assert_close(core.weights.get(2)[name], ref_t, rtol=1e-5, atol=1e-6, msg=name)
        assert client.wait_step(2, timeout_s=60).finished  # the job goes on
    finally:
        client.close()
        core.stop()
        server.stop(0)
