"""The names of 0.x keep working after the renames (the cell agent is the cell daemon, the Worker API
is the Harnesses API, ``worker_id`` is ``harness_id``), on live processes and real gRPC:

- the scheduler serves ``Worker`` beside ``Harnesses``, ``ReleaseWorker`` included;
- a lease a 0.x scheduler wrote (its holder under ``worker_id`` in Redis) is shown and released;
- a cell daemon serves ``CellAgent`` beside ``CellDaemon``, and ``CellDaemonClient`` falls back to
  ``CellAgent`` against a daemon that serves only that;
- a daemon configured only through ``GYRE_CELL_AGENT_*`` starts as configured and logs a warning.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from protos.gyre.v1 import scheduler_pb2 as pb
from protos.gyre.v1 import scheduler_pb2_grpc as pbg
from services.common.roles import CellRole
from services.common.server import build_server
from services.scheduler.cell_daemon import CellDaemon
from services.scheduler.client import CellDaemonClient
from services.scheduler.orchestrator import Orchestrator
from services.scheduler.servicer import CellDaemonServicer
from tests.service.scheduler_support import in_process_scheduler, job_spec, start_daemon
from tests.support.waiting import wait_until


class _NoSwitch:
    def switch(self, *args: object, **kw: object) -> None:
        raise AssertionError("no switch expected")


def test_the_former_worker_service_leases_and_releases_like_harnesses(redis_url: str) -> None:
    with in_process_scheduler(redis_url, lease_ttl_s=300.0) as s:
        s.client.submit_job(job_spec(num_steps=1, groups_per_step=1, group_size=3))
        Orchestrator(s.state, _NoSwitch(), instance_id="t", metrics_event_interval_s=3600).tick()
        with grpc.insecure_channel(s.server.address) as channel:
            former, current = pbg.WorkerStub(channel), pbg.HarnessesStub(channel)
            old = former.LeaseExecution(pb.LeaseExecutionRequest(harness_id="old-harness"), timeout=10)
            new = current.LeaseExecution(pb.LeaseExecutionRequest(harness_id="new-harness"), timeout=10)
            assert old.leased and new.leased and old.lease.execution_id != new.lease.execution_id
            assert s.client.get_execution(old.lease.execution_id).harness_id == "old-harness"
            released = former.ReleaseWorker(pb.ReleaseHarnessRequest(harness_id="old-harness"), timeout=10)
            assert list(released.execution_ids) == [old.lease.execution_id]
            released = current.ReleaseHarness(pb.ReleaseHarnessRequest(harness_id="new-harness"), timeout=10)
            assert list(released.execution_ids) == [new.lease.execution_id]
            with pytest.raises(grpc.RpcError) as bad:
                former.ReleaseWorker(pb.ReleaseHarnessRequest(), timeout=10)
            assert bad.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "harness_id is required" in (bad.value.details() or "")


def test_a_lease_a_former_scheduler_wrote_is_still_shown_and_released(redis_url: str) -> None:
    """An upgrade in place: Redis holds a lease whose holder a 0.x scheduler wrote as ``worker_id``."""
    with in_process_scheduler(redis_url, lease_ttl_s=300.0) as s:
        s.client.submit_job(job_spec(num_steps=1, groups_per_step=1, group_size=2))
        Orchestrator(s.state, _NoSwitch(), instance_id="t", metrics_event_interval_s=3600).tick()
        lease = s.client.lease("host-a:harness")
        assert lease is not None
        key = s.state.keys.execution(lease.execution_id)
        s.state.r.hdel(key, "harness_id")
        s.state.r.hset(key, "worker_id", "host-a:harness")
        assert s.client.get_execution(lease.execution_id).harness_id == "host-a:harness"
        assert s.client.release_harness("host-b:harness") == []
        assert s.client.release_harness("host-a:harness") == [lease.execution_id]
        again = s.client.lease("host-c:harness")  # the other execution; the released one re-queues on a tick
        assert again is not None and s.state.r.hget(s.state.keys.execution(again.execution_id), "worker_id") is None


def test_a_cell_daemon_answers_under_its_former_name(redis_url: str, tmp_path: Path) -> None:
    with in_process_scheduler(redis_url) as s:
        daemon = start_daemon(s.server.address, tmp_path, "c1", "--role", "idle")
        try:
            with grpc.insecure_channel(daemon.address) as channel:
                assert pbg.CellAgentStub(channel).GetRole(pb.GetRoleRequest(), timeout=10).cell_id == "c1"
                assert pbg.CellDaemonStub(channel).GetRole(pb.GetRoleRequest(), timeout=10).cell_id == "c1"
        finally:
            daemon.terminate()


def test_the_daemon_client_falls_back_to_a_former_daemon() -> None:
    """A new scheduler switching a cell whose daemon is still of 0.x (it serves only ``CellAgent``)."""
    cell = CellDaemon(cell_id="old", role=CellRole.IDLE, commands={}).start()
    name = pb.DESCRIPTOR.services_by_name["CellAgent"].full_name
    server = build_server("former-daemon", [(pbg.add_CellAgentServicer_to_server, CellDaemonServicer(cell))],
                          service_names=[name])
    server.start()
    try:
        with grpc.insecure_channel(server.address) as channel:  # the new name is not served there
            with pytest.raises(grpc.RpcError) as missing:
                pbg.CellDaemonStub(channel).GetRole(pb.GetRoleRequest(), timeout=10)
            assert missing.value.code() is grpc.StatusCode.UNIMPLEMENTED
        with CellDaemonClient(server.address, timeout_s=10) as client:
            assert client.get_role()[:2] == ("old", CellRole.IDLE)
            assert client.set_role(cell_id="old", role=CellRole.TRAIN, switch_id="sw-1")[0] is CellRole.TRAIN
        assert cell.role is CellRole.TRAIN and cell.last_switch_id == "sw-1"
    finally:
        server.stop(0)
        cell.stop()


def test_a_daemon_configured_under_the_former_names_starts_as_configured(
        redis_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "gyre.toml"
    config.write_text('[cell-agent]\nkv_capacity_tokens = 4321\n')
    monkeypatch.setenv("GYRE_CELL_AGENT_NUM_ACCELERATORS", "3")
    with in_process_scheduler(redis_url) as s:
        daemon = start_daemon(s.server.address, tmp_path, "c7", "--role", "idle", "--config", str(config))
        try:
            def registered() -> bool:
                return any(c.cell.cell_id == "c7" for c in s.client.list_cells())

            wait_until(registered, 30, "the daemon to register its cell")
            cell = next(c.cell for c in s.client.list_cells() if c.cell.cell_id == "c7")
            assert (cell.kv_capacity_tokens, cell.num_accelerators) == (4321, 3)
        finally:
            daemon.terminate()
        log = daemon.log_path.read_text()
        assert "GYRE_CELL_AGENT_NUM_ACCELERATORS is read as GYRE_CELL_DAEMON_NUM_ACCELERATORS" in log
        assert "section [cell-agent]" in log


def test_the_former_actuator_name_means_the_daemon_actuator() -> None:
    from services.common.config import load_config
    from services.scheduler.config import SchedulerConfig

    assert load_config(SchedulerConfig, argv=["--actuator", "agent"]).actuator == "daemon"
    assert load_config(SchedulerConfig, argv=["--actuator", "daemon"]).actuator == "daemon"
    with pytest.raises(ValueError, match="actuator"):
        load_config(SchedulerConfig, argv=["--actuator", "robot"])
