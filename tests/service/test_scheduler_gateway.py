"""Elastic consolidation through the real rollout gateway: the scheduler frees a busy ROLLOUT cell by
draining its engine (the in-flight request migrates with its KV), then the cell daemon switches to
TRAIN, and the harness's model call finishes without noticing.

Engines and the gateway are the rollout service's real servers (tiny random model, in this
process); cell daemons are real subprocesses that read their engine's load (GetLoad) and report it
to a real scheduler server; the orchestrator is ticked by the test.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from services.rollout.calls import CallMeta
from services.rollout.engine import SamplingParams
from services.scheduler.actuators import DaemonActuator
from services.scheduler.client import CellDaemonClient
from services.scheduler.jobs import ExecState, Mode
from services.common.roles import CellRole
from services.scheduler.orchestrator import Orchestrator
from tests.service.scheduler_support import InProcess, Proc, in_process_scheduler, job_spec, start_daemon, wait_until
from tests.support.rollout_cluster import LocalEngine, LocalGateway, start_engine, start_gateway

torch.set_num_threads(1)
PROMPT = np.random.default_rng(0).integers(0, 512, 48).astype(np.int32)
LONG = 900  # tokens: the call must still run when the scheduler consolidates


@pytest.fixture
def cluster(redis_url: str, tmp_path: Path) -> Iterator[tuple[InProcess, LocalGateway, dict[str, LocalEngine],
                                                              dict[str, Proc]]]:
    engines = {c: start_engine(c) for c in ("c1", "c2")}
    gw = start_gateway()
    client = gw.client()
    for e in engines.values():
        client.register_engine(e.cell_id, e.address)
    with in_process_scheduler(redis_url) as s:
        daemons = {"core": start_daemon(s.server.address, tmp_path, "core", "--role", "train", "--is-core")}
        for cid, e in engines.items():
            daemons[cid] = start_daemon(s.server.address, tmp_path, cid, "--role", "rollout", "--engine-address",
                                      e.address, "--train-command", "sleep 3600", "--heartbeat-interval-s", "0.1")
        wait_until(lambda: len(s.client.list_cells()) == 3, 30, "cells registered")
        try:
            yield s, gw, engines, daemons
        finally:
            for p in daemons.values():
                p.terminate()
    gw.stop()
    for e in engines.values():
        e.stop()


def test_consolidation_migrates_the_busy_cells_call_and_nothing_is_interrupted(
        cluster: tuple[InProcess, LocalGateway, dict[str, LocalEngine], dict[str, Proc]]) -> None:
    s, gw, engines, daemons = cluster
    capacity = {i.cell.cell_id: i.cell.kv_capacity_tokens for i in s.client.list_cells()}["c1"]
    assert capacity > 0  # reported by the engine through the daemon
    s.client.submit_job(job_spec(num_steps=1, groups_per_step=3, group_size=1, mode=Mode.ELASTIC,
                                 staleness_bound=1, execution_kv_tokens=capacity // 4))
    orch = Orchestrator(s.state, DaemonActuator(gateway_address=gw.address), instance_id="t",
                        metrics_event_interval_s=3600)
    assert orch.tick()
    leases = [s.client.lease("harness", job_id="j1") for _ in range(3)]
    assert all(leases)

    results: dict[str, Any] = {}
    gateway = gw.client()

    def call(execution_id: str) -> None:  # one long model call of this execution
        meta = CallMeta(execution_id=execution_id, call_id="c0")
        results[execution_id] = gateway.generate(meta, PROMPT, SamplingParams(temperature=0.0, max_new_tokens=LONG))

    threads = [threading.Thread(target=call, args=(lz.execution_id,)) for lz in leases[:2] if lz]
    for t in threads:
        t.start()
    # one call on each engine, as the daemons report it to the scheduler
    wait_until(lambda: all(i.cell.inflight == 1 for i in s.client.list_cells() if not i.cell.is_core), 20,
               "each rollout cell to host one call")
    done = leases[2]
    assert done is not None
    s.client.complete(done.execution_id, done.lease_token, ExecState.FINISHED)  # a group is ready to train

    actions = orch.step_job(s.state.get_job("j1"))  # the policy frees one cell, migrating its call
    assert len(actions) == 1 and actions[0].to_role is CellRole.TRAIN and actions[0].migrate_to
    freed, target = actions[0].cell_id, actions[0].migrate_to[0]
    assert orch.wait_switches(60)
    for t in threads:
        t.join(120)

    assert all(len(r.output_ids) == LONG and r.finish_reason == "length" for r in results.values())
    assert sum(r.num_migrations for r in results.values()) == 1  # the freed cell's call moved, once
    assert {r.cell_id for r in results.values()} == {target}  # both calls finished on the remaining engine
    roles = {i.cell.cell_id: i.cell.role for i in s.client.list_cells()}
    assert roles[freed] is CellRole.TRAIN and roles[target] is CellRole.ROLLOUT and roles["core"] is CellRole.TRAIN
    with CellDaemonClient(daemons[freed].address, timeout_s=10) as daemon:
        assert daemon.get_role()[1] is CellRole.TRAIN
    assert [e.cell_id for e in gateway.list_engines()] == [target]  # drained and deregistered
    [switch] = s.state.switch_log()
    assert switch.kind == "switch_finished" and switch.attrs["cell_id"] == freed
