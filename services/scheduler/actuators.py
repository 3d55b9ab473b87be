"""Implementations of the orchestrator's ``CellActuator`` seam (how a role switch is carried out).

``ServicesActuator`` - the deployment path, through the other services::

    ROLLOUT -> TRAIN   gateway.DrainEngine(cell)      in-flight requests migrate (with KV) to the
                                                      remaining engines; the engine leaves routing
                       trainer.AddReplica(cell)       a replica starts there and joins the running step
    TRAIN -> ROLLOUT   trainer.ReleaseReplica(cell)   the replica leaves now (gradient hand-off) and exits
                       gateway.RegisterEngine(cell)   the engine (at the cell's address) is routable again

A cell whose daemon ``hosts_replica`` (its ``train_command`` is set: the replica runs on the cell's
own host, as it must when cells are separate machines) is switched through its daemon as well:
ROLLOUT -> TRAIN drains, then the daemon starts the replica and the trainer only waits for it to join
(``AddReplica(hosted)``); TRAIN -> ROLLOUT releases it at the trainer, then the daemon stops it
(SIGTERM: it hands off its gradient and exits).

``DaemonActuator`` - each cell runs a ``CellDaemon`` (``cell_daemon.py``) that owns the cell's role
process. A busy ROLLOUT cell is drained through the gateway first (when one is configured; without
one a busy cell is refused, since nothing could migrate its work), then the daemon switches.

Both are idempotent per switch id (the trainer and the daemon take it as an idempotency key; a
drain of an engine that is already gone is a no-op), as the orchestrator requires: after a crash
it carries the same switch out again.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence

from services.common.errors import AlreadyExists, FailedPrecondition, NotFound, Unavailable
from services.common.logging import get_logger
from services.rollout.client import GatewayClient
from services.scheduler.client import CellDaemonClient, TrainerMembershipClient
from services.scheduler.jobs import CellRecord, JobStatus
from services.common.roles import CellRole

log = get_logger(__name__)


def _drain(gateway: GatewayClient, cell: CellRecord) -> dict[str, str]:
    """Drain the cell's engine through the gateway; the migrations made, as event attributes."""
    try:
        reports = gateway.drain_engine(cell.cell_id)
    except NotFound:  # already drained and deregistered (a repeated switch)
        return {}
    failed = [r for r in reports if not r.ok]
    if failed:
        raise Unavailable(f"draining {cell.cell_id}: {len(failed)} of {len(reports)} requests failed to migrate")
    log.info("engine drained", cell_id=cell.cell_id, migrated=len(reports))
    if not reports:
        return {}
    transports: dict[str, int] = {}
    for r in reports:
        transports[r.transport] = transports.get(r.transport, 0) + 1
    return {"migrated": str(len(reports)), "transports": json.dumps(transports, sort_keys=True),
            "targets": ",".join(sorted({r.target_cell_id for r in reports})),
            "kv_tokens": str(sum(r.kv_tokens for r in reports)), "bytes": str(sum(r.bytes for r in reports)),
            "max_duration_ms": str(int(max(r.duration_s for r in reports) * 1000))}


class ServicesActuator:
    def __init__(self, *, gateway_address: str, trainer_address: str, timeout_s: float = 600.0) -> None:
        if not gateway_address or not trainer_address:
            raise ValueError("the 'services' actuator needs gateway_address and trainer_address "
                             "(or use actuator = 'daemon')")
        self.gateway = GatewayClient(gateway_address, timeout_s=timeout_s)
        self.trainer = TrainerMembershipClient(trainer_address, timeout_s=timeout_s)
        self.timeout_s = timeout_s

    def switch(self, cell: CellRecord, from_role: CellRole, to_role: CellRole, *, switch_id: str, job: JobStatus,
               migrate_to: Sequence[CellRecord],
               on_migrated: Callable[[Mapping[str, str]], None] | None = None) -> dict[str, str]:
        """Carry the switch out; returns event attributes: the drain's migrations, and ``phases``
        (JSON seconds per phase: drain, release, daemon, replica_join, engine_resume)."""
        info: dict[str, str] = {}
        phases: dict[str, float] = {}
        t = time.perf_counter()

        def lap(name: str) -> None:
            nonlocal t
            now = time.perf_counter()
            phases[name] = round(now - t, 4)
            t = now

        if from_role is CellRole.ROLLOUT:
            info = _drain(self.gateway, cell)  # its requests migrate (KV over UCX) before it leaves
            if info and on_migrated is not None:
                on_migrated(info)
            lap("drain")
        elif from_role is CellRole.TRAIN:
            # a hosted replica is only released here: its daemon stops it below (and waits for it)
            wait_s = 0.0 if cell.hosts_replica else self.timeout_s
            try:
                released = self.trainer.release_replica(cell.cell_id, wait_s=wait_s) or cell.hosts_replica
            except (NotFound, FailedPrecondition):  # no replica (or no job: a restarted trainer) there
                released = True
            if not released:
                raise Unavailable(f"the trainer did not release {cell.cell_id} within {self.timeout_s:.0f}s")
            lap("release")  # the replica handed its gradient off and left
        if cell.hosts_replica:
            with CellDaemonClient(cell.address, timeout_s=self.timeout_s) as daemon:
                role, took = daemon.set_role(cell_id=cell.cell_id, role=to_role, switch_id=switch_id,
                                            job_id=job.job_id, step=job.current_step,
                                            weight_version=job.weight_version)
            if role is not to_role:
                raise Unavailable(f"daemon of {cell.cell_id} reports {role.value} after switching to {to_role.value}")
            log.info("daemon switched", cell_id=cell.cell_id, to_role=to_role.value, daemon_s=round(took, 3))
            lap("daemon")
        if to_role is CellRole.TRAIN:
            self.trainer.add_replica(cell.cell_id, switch_id=switch_id, wait_s=min(self.timeout_s, 120.0),
                                     hosted=cell.hosts_replica)
            lap("replica_join")  # replica process (warm or cold) in the step, weights loaded
        elif to_role is CellRole.ROLLOUT:
            try:
                # "": the engine the gateway knew for this cell before the drain (the cell's
                # registered address is its daemon's, not its engine's)
                self.gateway.register_engine(cell.cell_id, "")
            except AlreadyExists:
                pass
            lap("engine_resume")  # the gateway routes to its engine again
        info["phases"] = json.dumps(phases, sort_keys=True)
        return info

    def close(self) -> None:
        self.gateway.close()
        self.trainer.close()


class DaemonActuator:
    def __init__(self, *, gateway_address: str = "", timeout_s: float = 600.0) -> None:
        self.gateway = GatewayClient(gateway_address, timeout_s=timeout_s) if gateway_address else None
        self.timeout_s = timeout_s

    def switch(self, cell: CellRecord, from_role: CellRole, to_role: CellRole, *, switch_id: str, job: JobStatus,
               migrate_to: Sequence[CellRecord],
               on_migrated: Callable[[Mapping[str, str]], None] | None = None) -> dict[str, str]:
        info: dict[str, str] = {}
        if from_role is CellRole.ROLLOUT:
            if self.gateway is not None:
                info = _drain(self.gateway, cell)
                if info and on_migrated is not None:
                    on_migrated(info)
            elif cell.inflight > 0 and job.running > 0:  # a stale count once the job runs nothing
                raise FailedPrecondition(f"{cell.cell_id} hosts {cell.inflight} executions and no gateway is "
                                         f"configured to migrate them; refusing to interrupt them")
        with CellDaemonClient(cell.address, timeout_s=self.timeout_s) as daemon:
            role, took = daemon.set_role(cell_id=cell.cell_id, role=to_role, switch_id=switch_id, job_id=job.job_id,
                                        step=job.current_step, weight_version=job.weight_version)
        if role is not to_role:
            raise Unavailable(f"daemon of {cell.cell_id} reports {role.value} after switching to {to_role.value}")
        log.info("daemon switched", cell_id=cell.cell_id, to_role=to_role.value, daemon_s=round(took, 3))
        return info

    def close(self) -> None:
        if self.gateway is not None:
            self.gateway.close()
