"""Typed clients of the scheduler (``SchedulerClient``) and of a cell daemon (``CellDaemonClient``).

They speak domain types (``JobSpec``, ``JobStatus``, ``Lease``, ``Event``...) and raise the domain
errors of ``services.common.errors`` carrying the server's message, so callers never see protos.

    with SchedulerClient("127.0.0.1:50070") as sched:
        job = sched.submit_job(spec)
        lease = sched.lease("harness-1", wait_s=5.0)
        sched.heartbeat(lease.execution_id, lease.lease_token)
        sched.complete(lease.execution_id, lease.lease_token, ExecState.FINISHED)
        for event in sched.watch(job.job_id, follow=True): ...
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from protos.gyre.v1 import scheduler_pb2, scheduler_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from services.common.client import GrpcClient
from services.scheduler.api import CellInfo
from services.scheduler.convert import (
    JOB_STATE_TO_PB,
    ROLE_FROM_PB,
    ROLE_TO_PB,
    STATUS_FROM_PB,
    STATUS_TO_PB,
    cell_from_proto,
    event_from_proto,
    execution_from_proto,
    job_from_proto,
    lease_from_proto,
    spec_to_proto,
)
from services.common.roles import CellRole
from services.scheduler.jobs import (CellRecord, Event, ExecState, ExecutionRecord, JobSpec, JobState, JobStatus,
                                     Lease)
from services.scheduler.state import CompleteResult

pb = scheduler_pb2

_PHASES = {"started": pb.TRAINING_PHASE_STARTED, "published": pb.TRAINING_PHASE_PUBLISHED}


class SchedulerClient(GrpcClient):
    """All scheduler services (Scheduler, Harnesses, Cells) over one channel; thread-safe."""

    def __init__(self, address: str, *, timeout_s: float = 30.0, max_message_mb: int = 64) -> None:
        super().__init__(address, timeout_s=timeout_s, max_message_mb=max_message_mb)
        self._sched = scheduler_pb2_grpc.SchedulerStub(self._channel)
        self._harnesses = scheduler_pb2_grpc.HarnessesStub(self._channel)
        self._cells = scheduler_pb2_grpc.CellsStub(self._channel)

    # -- jobs
    def submit_job(self, spec: JobSpec | scheduler_pb2.JobSpec) -> JobStatus:
        """Submit a job; a proto spec may leave ``job_id`` empty (the scheduler names it)."""
        p = spec if isinstance(spec, scheduler_pb2.JobSpec) else spec_to_proto(spec)
        return job_from_proto(self._call(self._sched.SubmitJob, pb.SubmitJobRequest(spec=p)).job)

    def get_job(self, job_id: str) -> JobStatus:
        return job_from_proto(self._call(self._sched.GetJob, pb.GetJobRequest(job_id=job_id)).job)

    def list_jobs(self, states: Sequence[JobState] = (), *, page_size: int = 0,
                  page_token: str = "") -> tuple[list[JobStatus], str]:
        req = pb.ListJobsRequest(states=[JOB_STATE_TO_PB[s] for s in states], page_size=page_size,
                                 page_token=page_token)
        res = self._call(self._sched.ListJobs, req)
        return [job_from_proto(j) for j in res.jobs], res.next_page_token

    def cancel_job(self, job_id: str, reason: str = "") -> tuple[JobStatus, int]:
        res = self._call(self._sched.CancelJob, pb.CancelJobRequest(job_id=job_id, reason=reason))
        return job_from_proto(res.job), res.dropped_queued

    def watch(self, job_id: str, *, after_event_id: str = "", follow: bool = True,
              timeout_s: float | None = None) -> Iterator[Event]:
        """The job's events in order; resume with the last ``event_id`` seen."""
        req = pb.WatchJobRequest(job_id=job_id, after_event_id=after_event_id, follow=follow)
        for e in self._stream(self._sched.WatchJob, req, timeout_s):
            yield event_from_proto(e)

    def report_training(self, job_id: str, step: int, phase: str, weight_version: int = 0, *,
                        trained_tokens: float = 0.0, compute_s: float = 0.0, world_size: int = 0,
                        metrics: Mapping[str, float] | None = None) -> tuple[JobStatus, bool]:
        """Trainer progress: ``phase`` 'started' or 'published' (with ``weight_version`` = step + 1 and
        what the update measured: tokens trained, the core's compute seconds, the world size, and
        the step's ``metrics`` for the job's event log)."""
        if phase not in _PHASES:
            raise ValueError(f"phase {phase!r} must be 'started' or 'published'")
        req = pb.ReportTrainingRequest(job_id=job_id, step=step, phase=_PHASES[phase], weight_version=weight_version,
                                       trained_tokens=trained_tokens, compute_s=compute_s, world_size=world_size,
                                       metrics=dict(metrics or {}))
        res = self._call(self._sched.ReportTraining, req)
        return job_from_proto(res.job), res.duplicate

    def get_execution(self, execution_id: str) -> ExecutionRecord:
        res = self._call(self._sched.GetExecution, pb.GetExecutionRequest(execution_id=execution_id))
        return execution_from_proto(res.execution)

    def list_cells(self) -> list[CellInfo]:
        res = self._call(self._sched.ListCells, pb.ListCellsRequest())
        return [CellInfo(cell_from_proto(c), c.heartbeat_age_s, c.alive) for c in res.cells]

    def cordon_cell(self, cell_id: str, *, cordoned: bool = True, reason: str = "") -> CellRecord:
        """Take ``cell_id`` out of rollout (or, ``cordoned=False``, give it back)."""
        res = self._call(self._sched.CordonCell, pb.CordonCellRequest(cell_id=cell_id, cordoned=cordoned,
                                                                      reason=reason))
        return cell_from_proto(res.cell)

    # -- harnesses
    def lease(self, harness_id: str, *, job_id: str = "", wait_s: float = 0.0, harness: str = "",
              request_id: str = "") -> Lease | None:
        """An execution of ``job_id`` (or of any running job run by ``harness`` harnesses:
        "builtin", "external"; "" any), waiting up to ``wait_s``; None when there was none.
        ``request_id``: send the same one when retrying after an error (see the proto)."""
        req = pb.LeaseExecutionRequest(harness_id=harness_id, job_id=job_id, wait_s=wait_s, harness=harness,
                                       request_id=request_id)
        res = self._call(self._harnesses.LeaseExecution, req, self.timeout_s + wait_s)
        return lease_from_proto(res.lease) if res.leased else None

    def heartbeat(self, execution_id: str, lease_token: str) -> tuple[float, float, bool]:
        """Extend a lease: (deadline_s, lease_expires_s, job_cancelled)."""
        res = self._call(self._harnesses.Heartbeat, pb.HeartbeatRequest(execution_id=execution_id,
                                                                      lease_token=lease_token))
        return res.deadline_s, res.lease_expires_s, res.cancelled

    def complete(self, execution_id: str, lease_token: str, status: ExecState, reason: str = "") -> CompleteResult:
        req = pb.CompleteLeaseRequest(execution_id=execution_id, lease_token=lease_token,
                                          status=STATUS_TO_PB[status], reason=reason)
        res = self._call(self._harnesses.CompleteExecution, req)
        state = STATUS_FROM_PB.get(res.status, ExecState.FAILED) if res.duplicate else status
        return CompleteResult(state, res.duplicate, res.done_in_step)

    def mint_session(self, execution_id: str, lease_token: str, *, agent_id: str, role: str) -> tuple[str, str]:
        """A session (token, base URL) for another agent of a leased execution (a sub-agent, a summary)."""
        res = self._call(self._harnesses.MintSession, pb.MintSessionRequest(
            execution_id=execution_id, lease_token=lease_token, agent_id=agent_id, role=role))
        return res.session_token, res.session_base_url

    def release_harness(self, harness_id: str, reason: str = "") -> list[str]:
        """Give up every lease ``harness_id`` holds (call it when starting under a stable id)."""
        res = self._call(self._harnesses.ReleaseHarness, pb.ReleaseHarnessRequest(harness_id=harness_id, reason=reason))
        return list(res.execution_ids)

    # -- cells
    def register_cell(self, *, cell_id: str, address: str, role: CellRole, host: str = "", is_core: bool = False,
                      kv_capacity_tokens: int = 0, num_accelerators: int = 1, engine_address: str = "",
                      hosts_replica: bool = False) -> bool:
        req = pb.RegisterCellRequest(cell_id=cell_id, address=address, host=host, role=ROLE_TO_PB[role],
                                     is_core=is_core, kv_capacity_tokens=kv_capacity_tokens,
                                     num_accelerators=num_accelerators, engine_address=engine_address,
                                     hosts_replica=hosts_replica)
        return bool(self._call(self._cells.RegisterCell, req).created)

    def cell_heartbeat(self, cell_id: str, *, role: CellRole, inflight: int = 0, kv_used_tokens: int = 0,
                       kv_capacity_tokens: int = 0, weight_version: int = 0) -> tuple[CellRole, CellRole | None]:
        """Report load; returns (registry role, target of the switch in flight or None)."""
        req = pb.CellHeartbeatRequest(cell_id=cell_id, inflight=inflight, kv_used_tokens=kv_used_tokens,
                                      kv_capacity_tokens=kv_capacity_tokens, weight_version=weight_version,
                                      role=ROLE_TO_PB[role])
        res = self._call(self._cells.CellHeartbeat, req)
        return ROLE_FROM_PB[res.assigned_role], (ROLE_FROM_PB[res.switching_to] if res.switching_to else None)

    def deregister_cell(self, cell_id: str) -> CellRole:
        res = self._call(self._cells.DeregisterCell, pb.DeregisterCellRequest(cell_id=cell_id))
        return ROLE_FROM_PB[res.role]


class CellDaemonClient(GrpcClient):
    """Client of one cell's ``CellDaemon`` (what the daemon actuator calls)."""

    def __init__(self, address: str, *, timeout_s: float = 600.0) -> None:
        super().__init__(address, timeout_s=timeout_s, max_message_mb=64)
        self._stub: Any = scheduler_pb2_grpc.CellDaemonStub(self._channel)

    def _call_daemon(self, method: str, req: Any) -> Any:
        return self._call(getattr(self._stub, method), req)

    def set_role(self, *, cell_id: str, role: CellRole, switch_id: str, job_id: str = "", step: int = 0,
                 weight_version: int = 0) -> tuple[CellRole, float]:
        """Change the cell's role (idempotent per switch_id): (role now, seconds the change took)."""
        req = pb.SetRoleRequest(cell_id=cell_id, role=ROLE_TO_PB[role], switch_id=switch_id, job_id=job_id,
                                step=step, weight_version=weight_version)
        res = self._call_daemon("SetRole", req)
        return ROLE_FROM_PB[res.role], res.duration_s

    def get_role(self) -> tuple[str, CellRole, str]:
        res = self._call_daemon("GetRole", pb.GetRoleRequest())
        return res.cell_id, ROLE_FROM_PB[res.role], res.last_switch_id


class TrainerMembershipClient(GrpcClient):
    """The two trainer RPCs the orchestrator needs (AddReplica / ReleaseReplica), without the
    trainer client's job and replica types, so the scheduler speaks plain ids and flags."""

    def __init__(self, address: str, *, timeout_s: float = 600.0) -> None:
        super().__init__(address, timeout_s=timeout_s, max_message_mb=64)
        self._stub = trainer_pb2_grpc.TrainerStub(self._channel)

    def add_replica(self, cell_id: str, *, switch_id: str, wait_s: float, hosted: bool = False) -> str:
        """Start a trainer replica on ``cell_id`` that joins the running step (``hosted``: the cell's
        daemon starts it; only wait for it to join); returns its replica id."""
        req = trainer_pb2.AddReplicaRequest(cell_id=cell_id, switch_id=switch_id, wait_s=wait_s, hosted=hosted)
        return str(self._call(self._stub.AddReplica, req, wait_s + 30.0).replica_id)

    def release_replica(self, cell_id: str, *, wait_s: float) -> bool:
        """Give the cell back after its step's update; True once the replica is gone."""
        req = trainer_pb2.ReleaseReplicaRequest(cell_id=cell_id, wait_s=wait_s)
        return bool(self._call(self._stub.ReleaseReplica, req, wait_s + 30.0).released)
