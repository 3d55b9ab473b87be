"""The orchestrator against real Redis, a real scheduler server and real cell-daemon processes.

Cells are ``daemon_main`` subprocesses that register over gRPC and run a real role process
(``sleep``) that is swapped on every switch; the orchestrator (in this process, ticked by the
test) carries switches out through ``DaemonActuator`` -> ``CellDaemon.SetRole``. The
``ServicesActuator`` path (gateway DrainEngine with KV migration, trainer AddReplica/ReleaseReplica)
runs against a real gateway, engine and trainer service here only for a rollback that waits for a
restarting trainer; the live stack's tests (tests/e2e) drive it whole.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from services.common.errors import Unavailable
from services.common.metrics import REGISTRY
from services.scheduler.actuators import DaemonActuator
from services.scheduler.client import CellDaemonClient
from services.scheduler.jobs import ExecState, JobState, Mode
from services.common.roles import CellRole
from services.scheduler.orchestrator import Orchestrator
from tests.service.scheduler_support import InProcess, Proc, in_process_scheduler, job_spec, start_daemon, wait_until

SLEEP = "sleep 3600"


@pytest.fixture
def sched(redis_url: str) -> Iterator[InProcess]:
    with in_process_scheduler(redis_url) as s:
        yield s


@pytest.fixture
def daemons(sched: InProcess, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[dict[str, Proc]]:
    """core (TRAIN) + c1, c2 in the role (and heartbeat interval) of ``request.param`` (default idle)."""
    role, beat = getattr(request, "param", ("idle", "0.2"))
    procs = {"core": start_daemon(sched.server.address, tmp_path, "core", "--role", "train", "--is-core",
                                 "--train-command", SLEEP)}
    for cid in ("c1", "c2"):
        procs[cid] = start_daemon(sched.server.address, tmp_path, cid, "--role", role, "--kv-capacity-tokens", "4000",
                                 "--rollout-command", SLEEP, "--train-command", SLEEP, "--heartbeat-interval-s", beat)
    keys = sched.state.keys
    wait_until(lambda: all(sched.state.r.hexists(keys.cell(c), "inflight") for c in procs),
               what="3 cells registered and heartbeating")
    yield procs
    for p in procs.values():
        p.terminate()


def roles(s: InProcess) -> dict[str, CellRole]:
    return {i.cell.cell_id: i.cell.role for i in s.client.list_cells()}


def daemon_role(p: Proc) -> CellRole:
    with CellDaemonClient(p.address, timeout_s=10) as c:
        return c.get_role()[1]


def tick(orch: Orchestrator) -> None:
    assert orch.tick()
    assert orch.wait_switches(30.0)


def switch_count(frm: str, to: str) -> float:
    return REGISTRY.get_sample_value("gyre_scheduler_switch_seconds_count", {"from_role": frm, "to_role": to}) or 0.0


def test_colocate_pool_alternates_through_real_daemons(sched: InProcess, daemons: dict[str, Proc]) -> None:
    s = sched
    orch = Orchestrator(s.state, DaemonActuator(), instance_id="t", metrics_event_interval_s=0.0)
    before = switch_count("rollout", "train")
    s.client.submit_job(job_spec(num_steps=2, groups_per_step=1, group_size=2, mode=Mode.COLOCATE))
    tick(orch)  # admit, enqueue step 0, idle cells -> ROLLOUT
    assert roles(s) == {"core": CellRole.TRAIN, "c1": CellRole.ROLLOUT, "c2": CellRole.ROLLOUT}
    assert daemon_role(daemons["c1"]) is CellRole.ROLLOUT

    lease = s.client.lease("h", job_id="j1")
    assert lease is not None
    tick(orch)  # an execution runs: nobody moves
    assert roles(s)["c1"] is CellRole.ROLLOUT
    s.client.complete(lease.execution_id, lease.lease_token, ExecState.FINISHED)
    last = s.client.lease("h", job_id="j1")
    assert last is not None
    s.client.complete(last.execution_id, last.lease_token, ExecState.FINISHED)
    tick(orch)  # step rolled out: the pool joins training
    assert roles(s) == {"core": CellRole.TRAIN, "c1": CellRole.TRAIN, "c2": CellRole.TRAIN}
    assert daemon_role(daemons["c2"]) is CellRole.TRAIN

    s.client.report_training("j1", 0, "published", 1)
    tick(orch)  # step 1 opens: back to ROLLOUT
    assert roles(s) == {"core": CellRole.TRAIN, "c1": CellRole.ROLLOUT, "c2": CellRole.ROLLOUT}

    log = s.state.switch_log()
    assert [e.kind for e in log] == ["switch_finished"] * 6
    assert all(e.attrs["cell_id"] in ("c1", "c2") for e in log)  # the core never moved
    assert all(int(e.attrs["duration_ms"]) >= 0 for e in log)
    assert switch_count("rollout", "train") - before == 2
    kinds = [e.kind for e in s.client.watch("j1", follow=False)]
    assert kinds.count("switch_started") == 6 and kinds.count("switch_finished") == 6 and "metrics" in kinds


@pytest.mark.parametrize("daemons", [("rollout", "3600")], indirect=True)
def test_elastic_never_interrupts_a_busy_cell(sched: InProcess, daemons: dict[str, Proc]) -> None:
    """Without a gateway nothing can migrate, so a busy rollout cell must stay until it is empty."""
    s = sched
    orch = Orchestrator(s.state, DaemonActuator(), instance_id="t", metrics_event_interval_s=3600)
    s.client.submit_job(job_spec(num_steps=1, groups_per_step=4, group_size=1, mode=Mode.ELASTIC,
                                 staleness_bound=1, execution_kv_tokens=1000))
    tick(orch)
    leases = [s.client.lease("h", job_id="j1") for _ in range(4)]
    assert all(leases)
    # the engines report their load: c1 hosts three executions, c2 one
    s.client.cell_heartbeat("c1", role=CellRole.ROLLOUT, inflight=3, kv_used_tokens=3000, kv_capacity_tokens=4000)
    s.client.cell_heartbeat("c2", role=CellRole.ROLLOUT, inflight=1, kv_used_tokens=1000, kv_capacity_tokens=4000)
    first = leases[0]
    assert first is not None
    s.client.complete(first.execution_id, first.lease_token, ExecState.FINISHED)
    s.client.cell_heartbeat("c1", role=CellRole.ROLLOUT, inflight=2, kv_used_tokens=2000, kv_capacity_tokens=4000)
    tick(orch)  # the policy frees c2 by migrating its execution to c1; no gateway -> refused, rolled back
    assert roles(s)["c2"] is CellRole.ROLLOUT and daemon_role(daemons["c2"]) is CellRole.ROLLOUT
    back = s.state.switch_log()[-1]
    assert back.kind == "switch_rolled_back" and "refusing to interrupt" in back.attrs["error"]

    s.client.cell_heartbeat("c2", role=CellRole.ROLLOUT, inflight=0, kv_used_tokens=0, kv_capacity_tokens=4000)
    tick(orch)  # c2 is empty now: it leaves without interrupting anything
    assert roles(s) == {"core": CellRole.TRAIN, "c1": CellRole.ROLLOUT, "c2": CellRole.TRAIN}
    assert daemon_role(daemons["c2"]) is CellRole.TRAIN and daemon_role(daemons["core"]) is CellRole.TRAIN
    assert s.client.get_job("j1").state is JobState.RUNNING


def test_recovery_rolls_back_switches_it_cannot_finish(sched: InProcess) -> None:
    """A switch left in flight by a dead scheduler whose cell is gone too is rolled back, with the error."""
    s = sched
    s.client.submit_job(job_spec(num_steps=1, groups_per_step=1, group_size=1, mode=Mode.ELASTIC, staleness_bound=1,
                                 cell_ids=("gone", "stale")))
    for cid in ("gone", "stale"):
        s.client.register_cell(cell_id=cid, address="127.0.0.1:1", role=CellRole.ROLLOUT)  # nothing listens there
    s.state.begin_switch(cell_id="gone", from_role=CellRole.ROLLOUT, to_role=CellRole.TRAIN, job_id="j1")
    s.state.begin_switch(cell_id="stale", from_role=CellRole.ROLLOUT, to_role=CellRole.TRAIN, job_id="j1")
    s.state.r.hset(s.state.keys.cell("stale"), "switch_started_ms", 1000)  # this one started long ago
    # nothing answers at the cell's address: restoring it is given up after restore_timeout_s
    orch = Orchestrator(s.state, DaemonActuator(timeout_s=5), instance_id="restarted", switch_timeout_s=60,
                        restore_timeout_s=0.5, metrics_event_interval_s=3600)
    orch.recover_switches()
    assert orch.wait_switches(30)
    log = {e.attrs["cell_id"]: e for e in s.state.switch_log()}
    assert log["stale"].kind == "switch_rolled_back" and "no progress" in log["stale"].attrs["error"]
    assert log["gone"].kind == "switch_rolled_back" and "also failed" in log["gone"].attrs["error"]
    assert roles(s) == {"gone": CellRole.ROLLOUT, "stale": CellRole.ROLLOUT} and s.state.pending_switches() == []


class _MigratesThenCannotJoin:
    """The services actuator's course when the job ends mid-switch: the drain moved two requests
    (reported through ``on_migrated``), then the trainer refused the replica."""

    def switch(self, cell: object, from_role: CellRole, to_role: CellRole, *, switch_id: str, job: object,
               migrate_to: object, on_migrated: Callable[[Mapping[str, str]], None] | None = None) -> None:
        if switch_id.endswith("-rollback"):
            return None
        assert on_migrated is not None
        on_migrated({"migrated": "2", "targets": "c2", "transports": '{"ucx": 2}'})
        raise Unavailable("the trainer job is stopping; no new replicas")


def test_a_migration_is_on_record_even_when_its_switch_fails_later(sched: InProcess) -> None:
    s = sched
    s.client.submit_job(job_spec(num_steps=1, groups_per_step=1, group_size=1, mode=Mode.ELASTIC,
                                 cell_ids=("c1", "c2")))
    s.client.register_cell(cell_id="c1", address="127.0.0.1:1", role=CellRole.ROLLOUT)
    s.state.begin_switch(cell_id="c1", from_role=CellRole.ROLLOUT, to_role=CellRole.TRAIN, job_id="j1")
    orch = Orchestrator(s.state, _MigratesThenCannotJoin(), instance_id="t", switch_timeout_s=60,
                        metrics_event_interval_s=3600)
    orch.recover_switches()
    assert orch.wait_switches(30)
    events = list(s.client.watch("j1", follow=False))
    moved = [e for e in events if e.kind == "migration"]
    assert len(moved) == 1 and moved[0].attrs["migrated"] == "2" and moved[0].attrs["cell_id"] == "c1"
    (ended,) = [e for e in s.state.switch_log() if e.attrs.get("cell_id") == "c1"]
    assert ended.kind == "switch_rolled_back" and "no new replicas" in ended.attrs["error"]


class _TrainerRestarting:
    """The services actuator's course when the trainer is killed mid-switch: the drain took the
    engine out of routing, the replica's AddReplica lost its trainer, and the rollback (release at
    the trainer, then the engine back into routing) finds no trainer until ``down_for`` tries have
    failed (its supervisor restarts it). Records the cell's registry role at each rollback try."""

    def __init__(self, state: object, down_for: int) -> None:
        self.state, self.down_for = state, down_for
        self.rollbacks: list[CellRole] = []
        self.asked = threading.Event()

    def switch(self, cell: object, from_role: CellRole, to_role: CellRole, *, switch_id: str, job: object,
               migrate_to: object, on_migrated: Callable[[Mapping[str, str]], None] | None = None) -> None:
        if not switch_id.endswith("-rollback"):
            raise Unavailable("Stream removed (Socket closed)")
        self.rollbacks.append(self.state.list_cells(["c1"])[0].role)  # type: ignore[attr-defined]
        if len(self.rollbacks) >= 2:
            self.asked.set()
        if len(self.rollbacks) <= self.down_for:
            raise Unavailable("failed to connect to all addresses")
        return None


def test_a_rollback_waits_for_a_restarting_service_and_restores_the_role(sched: InProcess) -> None:
    """A switch fails because the trainer was killed, and its rollback finds no trainer either: the
    rollback is tried again until the trainer is back, the cell SWITCHING meanwhile (never ROLLOUT
    while its engine is out of routing: no decision would bring it back), then ROLLOUT again."""
    s = sched
    s.client.submit_job(job_spec(num_steps=1, groups_per_step=1, group_size=1, mode=Mode.ELASTIC, cell_ids=("c1",)))
    s.client.register_cell(cell_id="c1", address="127.0.0.1:1", role=CellRole.ROLLOUT)
    s.state.begin_switch(cell_id="c1", from_role=CellRole.ROLLOUT, to_role=CellRole.TRAIN, job_id="j1")
    actuator = _TrainerRestarting(s.state, down_for=3)
    orch = Orchestrator(s.state, actuator, instance_id="t", switch_timeout_s=600, restore_timeout_s=600,
                        metrics_event_interval_s=3600)
    orch.recover_switches()
    assert orch.wait_switches(60)
    assert actuator.rollbacks == [CellRole.SWITCHING] * 4
    (ended,) = [e for e in s.state.switch_log() if e.attrs.get("cell_id") == "c1"]
    assert ended.kind == "switch_rolled_back" and "Socket closed" in ended.attrs["error"]
    assert "also failed" not in ended.attrs["error"]
    assert roles(s) == {"c1": CellRole.ROLLOUT} and s.state.pending_switches() == []


def test_a_rollback_still_waiting_when_the_orchestrator_stops_is_left_to_recovery(sched: InProcess) -> None:
    """The scheduler stops (a restart, a leader change) while a rollback waits for the trainer: the
    switch stays in flight in Redis, for the next leader's recovery to carry out, not ended with
    the cell in a role it does not serve."""
    s = sched
    s.client.submit_job(job_spec(num_steps=1, groups_per_step=1, group_size=1, mode=Mode.ELASTIC, cell_ids=("c1",)))
    s.client.register_cell(cell_id="c1", address="127.0.0.1:1", role=CellRole.ROLLOUT)
    s.state.begin_switch(cell_id="c1", from_role=CellRole.ROLLOUT, to_role=CellRole.TRAIN, job_id="j1")
    actuator = _TrainerRestarting(s.state, down_for=10**6)
    orch = Orchestrator(s.state, actuator, instance_id="t", switch_timeout_s=600, restore_timeout_s=600,
                        metrics_event_interval_s=3600)
    orch.recover_switches()
    assert actuator.asked.wait(60)
    orch.stop(timeout_s=30)
    assert orch.switches_in_flight() == 0
    assert [c.cell_id for c in s.state.pending_switches()] == ["c1"] and roles(s) == {"c1": CellRole.SWITCHING}
    assert not [e for e in s.state.switch_log() if e.attrs.get("cell_id") == "c1"]


def test_the_services_rollback_puts_the_engine_back_once_the_killed_trainer_is_back(sched: InProcess) -> None:
    """The ``ServicesActuator`` path with a real gateway, engine and trainer service: the trainer is
    down (killed; its supervisor restarts it) when a ROLLOUT -> TRAIN switch runs. The drain takes
    the engine out of routing, AddReplica fails, and so does the rollback's ReleaseReplica. The cell
    stays SWITCHING (the policy does not count it as serving) until the trainer answers again; then
    the rollback puts the engine back into routing and the cell is ROLLOUT. (Before, the switch
    ended at once with the cell registered ROLLOUT and its engine out of routing, for good.)"""
    from protos.gyre.v1 import trainer_pb2_grpc
    from services.common.server import build_server, free_port
    from services.rollout.client import GatewayClient
    from services.scheduler.actuators import ServicesActuator
    from services.trainer.core import CoreTrainer
    from services.trainer.main import TRAINER_SERVICE
    from services.trainer.servicer import TrainerServicer
    from tests.support.rollout_cluster import start_engine, start_gateway

    s = sched
    tried = threading.Event()

    class Watched(ServicesActuator):  # the real actuator; the test only sees a rollback fail
        def switch(self, cell: Any, from_role: CellRole, to_role: CellRole, **kw: Any) -> dict[str, str]:
            try:
                return super().switch(cell, from_role, to_role, **kw)
            except Unavailable:
                if kw["switch_id"].endswith("-rollback"):
                    tried.set()
                raise

    engine, gw = start_engine("c1"), start_gateway()
    gateway = GatewayClient(gw.address, timeout_s=30)
    port = free_port()
    actuator = Watched(gateway_address=gw.address, trainer_address=f"127.0.0.1:{port}", timeout_s=5)
    trainer = None
    try:
        gateway.register_engine("c1", engine.address)
        s.client.submit_job(job_spec(num_steps=1, groups_per_step=1, group_size=1, mode=Mode.ELASTIC,
                                     cell_ids=("c1",)))
        s.client.register_cell(cell_id="c1", address="127.0.0.1:1", role=CellRole.ROLLOUT)
        s.state.begin_switch(cell_id="c1", from_role=CellRole.ROLLOUT, to_role=CellRole.TRAIN, job_id="j1")
        orch = Orchestrator(s.state, actuator, instance_id="t", switch_timeout_s=600, restore_timeout_s=600,
                            metrics_event_interval_s=3600)
        orch.recover_switches()
        assert tried.wait(60), "the rollback never ran"
        assert roles(s) == {"c1": CellRole.SWITCHING}
        assert [e.cell_id for e in gateway.list_engines() if e.state == "ready"] == []
        trainer = build_server("trainer", [(trainer_pb2_grpc.add_TrainerServicer_to_server,
                                            TrainerServicer(CoreTrainer()))],
                               service_names=[TRAINER_SERVICE], port=port).start()  # restarted, no job yet
        assert orch.wait_switches(60)
        assert roles(s) == {"c1": CellRole.ROLLOUT} and s.state.pending_switches() == []
        assert [(e.cell_id, e.state) for e in gateway.list_engines()] == [("c1", "ready")]
        (ended,) = [e for e in s.state.switch_log() if e.attrs.get("cell_id") == "c1"]
        assert ended.kind == "switch_rolled_back" and "also failed" not in ended.attrs["error"]
    finally:
        actuator.close()
        gateway.close()
        if trainer is not None:
            trainer.stop(0)
        gw.stop()
        engine.stop()


@pytest.mark.parametrize("daemons", [("rollout", "3600")], indirect=True)
def test_no_switch_before_the_jobs_trainer_is_started(sched: InProcess, daemons: dict[str, Proc]) -> None:
    """An operator's cordon while the job controller still prepares the job (trainer not started):
    the cell is not moved to TRAIN yet (it would find no trainer job and be rolled back, its drain
    wasted); it stays cordoned, taking no new work, until the controller marks the job prepared."""
    from services.scheduler.controller import JobController

    s = sched
    controller = JobController(s.state, trainer=None, trajectory=None, reward=None, trajectory_address="",
                               scheduler_address="", checkpoint_root="")
    orch = Orchestrator(s.state, DaemonActuator(), instance_id="t", metrics_event_interval_s=3600,
                        controller=controller)
    s.client.submit_job(job_spec(num_steps=1, groups_per_step=2, group_size=1, mode=Mode.ELASTIC))
    s.client.cordon_cell("c2", reason="maintenance")
    for _ in range(3):
        assert orch.tick()
        assert orch.wait_switches(30.0)
    assert s.client.get_job("j1").state is JobState.RUNNING and not controller.ready(s.client.get_job("j1"))
    assert roles(s) == {"core": CellRole.TRAIN, "c1": CellRole.ROLLOUT, "c2": CellRole.ROLLOUT}
    assert not [e for e in s.state.switch_log() if e.attrs.get("cell_id") == "c2"]


def test_metrics_events_carry_the_gateways_usage_of_the_job(sched: InProcess) -> None:
    """A real gateway over a real engine: the calls a job makes through it reach the job's 'metrics'
    events (what `gyre watch` and the report show); a gateway that does not answer costs nothing."""
    import numpy as np

    from services.jobwatch import JobView, usage_line
    from services.rollout.calls import CallMeta
    from services.rollout.client import GatewayClient
    from services.rollout.engine import SamplingParams
    from tests.support.rollout_cluster import start_engine, start_gateway

    engine, gw = start_engine("cell-u"), start_gateway()
    client = GatewayClient(gw.address, timeout_s=60)
    asker = GatewayClient(gw.address, timeout_s=60)  # the scheduler's own client: open to the end
    try:
        client.register_engine("cell-u", engine.address)

        def usage(job_id: str) -> dict | None:
            import dataclasses

            u = asker.job_usage([job_id], timeout_s=5).get(job_id)
            return dataclasses.asdict(u) if u is not None else None

        orch = Orchestrator(sched.state, DaemonActuator(), instance_id="t", metrics_event_interval_s=0.0, usage=usage)
        sched.client.submit_job(job_spec(num_steps=1, groups_per_step=1, group_size=2, mode=Mode.COLOCATE))
        assert orch.tick()  # no call yet: a metrics event without usage
        prompt = np.arange(3, 300, dtype=np.int32)
        params = SamplingParams(temperature=0.0, max_new_tokens=8)
        first = client.generate(CallMeta(job_id="j1", execution_id="e1", agent_id="a", call_id="c1"), prompt, params)
        grown = np.concatenate([prompt, first.output_ids, np.arange(5, 25, dtype=np.int32)])
        client.generate(CallMeta(job_id="j1", execution_id="e1", agent_id="a", call_id="c2"), grown, params)
        assert orch.tick()
        view = JobView("j1")
        for ev in sched.client.watch("j1", follow=False):
            view.add(ev)
        metrics = [e for e in sched.client.watch("j1", follow=False) if e.kind == "metrics"]
        assert "calls" not in metrics[0].attrs and metrics[-1].attrs["calls"] == "2"
        u = view.usage()
        assert u is not None and u["calls"] == 2 and u["prompt_tokens"] == len(prompt) + len(grown)
        assert u["output_tokens"] == 16 and u["max_context"] == u["last_context"] == len(grown) + 8
        assert u["cached_tokens"] >= len(prompt) - 128 and 0 < u["reuse"] < 1
        assert "2 calls" in usage_line(u) and "reused from prefix caches" in usage_line(u)
    finally:
        client.close()
        gw.stop()
        engine.stop()
    # the gateway is gone: metrics events go on without its figures, the tick does not fail
    n = len([e for e in sched.client.watch("j1", follow=False) if e.kind == "metrics"])
    assert orch.tick()
    metrics = [e for e in sched.client.watch("j1", follow=False) if e.kind == "metrics"]
    assert len(metrics) == n + 1 and "calls" not in metrics[-1].attrs
    asker.close()
