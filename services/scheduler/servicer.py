"""gRPC adapters of the scheduler: proto in -> domain types -> ``SchedulerApi`` -> proto out.

Serves ``Scheduler`` (clients, trainer), ``Harnesses`` (harnesses) and ``Cells`` (cells); the
``CellDaemon`` servicer is for a cell's daemon process. Errors
are raised as domain exceptions; the common server interceptor maps them to status codes.
Conversions live in ``convert.py`` (shared with the client).
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from protos.gyre.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.common.errors import InvalidArgument
from services.common.server import Registration
from services.scheduler.api import CellInfo, SchedulerApi
from services.scheduler.cell_daemon import CellDaemon
from services.scheduler.convert import (
    JOB_STATE_FROM_PB,
    ROLE_FROM_PB,
    ROLE_TO_PB,
    STATUS_FROM_PB,
    STATUS_TO_PB,
    cell_to_proto,
    enum_value,
    event_to_proto,
    execution_to_proto,
    job_to_proto,
    lease_to_proto,
    spec_from_proto,
)

pb = scheduler_pb2


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self, api: SchedulerApi) -> None:
        self.api = api

    def SubmitJob(self, request: pb.SubmitJobRequest, context: grpc.ServicerContext) -> pb.SubmitJobResponse:
        if not request.HasField("spec"):
            raise InvalidArgument("spec is required")
        spec = spec_from_proto(request.spec, self.api.new_job_id())
        return pb.SubmitJobResponse(job=job_to_proto(self.api.submit_job(spec)))

    def GetJob(self, request: pb.GetJobRequest, context: grpc.ServicerContext) -> pb.GetJobResponse:
        return pb.GetJobResponse(job=job_to_proto(self.api.get_job(request.job_id)))

    def ListJobs(self, request: pb.ListJobsRequest, context: grpc.ServicerContext) -> pb.ListJobsResponse:
        states = [enum_value(JOB_STATE_FROM_PB, s, "states entry", "a JobState other than UNSPECIFIED")
                  for s in request.states]
        jobs, token = self.api.list_jobs(states, request.page_size, request.page_token)  # type: ignore[arg-type]
        return pb.ListJobsResponse(jobs=[job_to_proto(j) for j in jobs], next_page_token=token)

    def CancelJob(self, request: pb.CancelJobRequest, context: grpc.ServicerContext) -> pb.CancelJobResponse:
        job, dropped = self.api.cancel_job(request.job_id, request.reason)
        return pb.CancelJobResponse(job=job_to_proto(job), dropped_queued=dropped)

    def WatchJob(self, request: pb.WatchJobRequest, context: grpc.ServicerContext) -> Iterator[pb.JobEvent]:
        for e in self.api.watch(request.job_id, request.after_event_id, request.follow, context.is_active):
            yield event_to_proto(e)

    def ListCells(self, request: pb.ListCellsRequest, context: grpc.ServicerContext) -> pb.ListCellsResponse:
        return pb.ListCellsResponse(cells=[_cell_info(c) for c in self.api.list_cells()])

    def CordonCell(self, request: pb.CordonCellRequest, context: grpc.ServicerContext) -> pb.CordonCellResponse:
        cell = self.api.cordon_cell(request.cell_id, request.cordoned, request.reason)
        return pb.CordonCellResponse(cell=cell_to_proto(cell))

    def GetExecution(self, request: pb.GetExecutionRequest,
                     context: grpc.ServicerContext) -> pb.GetExecutionResponse:
        return pb.GetExecutionResponse(execution=execution_to_proto(self.api.get_execution(request.execution_id)))

    def ReportTraining(self, request: pb.ReportTrainingRequest,
                       context: grpc.ServicerContext) -> pb.ReportTrainingResponse:
        phase = enum_value({pb.TRAINING_PHASE_STARTED: "started", pb.TRAINING_PHASE_PUBLISHED: "published"},
                      request.phase, "phase", "STARTED or PUBLISHED")
        job, dup = self.api.report_training(request.job_id, request.step, phase,  # type: ignore[arg-type]
                                            request.weight_version, trained_tokens=request.trained_tokens,
                                            compute_s=request.compute_s, world_size=request.world_size,
                                            metrics=dict(request.metrics))
        return pb.ReportTrainingResponse(job=job_to_proto(job), duplicate=dup)


def _cell_info(info: CellInfo) -> scheduler_pb2.Cell:
    p = cell_to_proto(info.cell, info.heartbeat_age_s, info.alive)
    return p


class HarnessesServicer(scheduler_pb2_grpc.HarnessesServicer):
    def __init__(self, api: SchedulerApi) -> None:
        self.api = api

    def LeaseExecution(self, request: pb.LeaseExecutionRequest,
                       context: grpc.ServicerContext) -> pb.LeaseExecutionResponse:
        lease = self.api.lease(request.harness_id, request.job_id, request.wait_s, harness=request.harness,
                               request_id=request.request_id)
        if lease is None:
            return pb.LeaseExecutionResponse(leased=False)
        return pb.LeaseExecutionResponse(leased=True, lease=lease_to_proto(lease, self.api.job_spec(lease.job_id)))

    def Heartbeat(self, request: pb.HeartbeatRequest, context: grpc.ServicerContext) -> pb.HeartbeatResponse:
        deadline, expires, cancelled = self.api.heartbeat(request.execution_id, request.lease_token)
        return pb.HeartbeatResponse(deadline_s=deadline, lease_expires_s=expires, cancelled=cancelled)

    def CompleteExecution(self, request: pb.CompleteLeaseRequest,
                          context: grpc.ServicerContext) -> pb.CompleteLeaseResponse:
        status = enum_value(STATUS_FROM_PB, request.status, "status", "FINISHED, TIMEOUT or FAILED")
        res = self.api.complete(request.execution_id, request.lease_token, status, request.reason)  # type: ignore[arg-type]
        return pb.CompleteLeaseResponse(status=STATUS_TO_PB.get(res.state, common_pb2.EXECUTION_STATUS_FAILED),
                                            duplicate=res.duplicate, done_in_step=res.done_in_step)


    def MintSession(self, request: pb.MintSessionRequest, context: grpc.ServicerContext) -> pb.MintSessionResponse:
        token, url = self.api.mint_session(request.execution_id, request.lease_token, request.agent_id, request.role)
        return pb.MintSessionResponse(session_token=token, session_base_url=url)

    def ReleaseHarness(self, request: pb.ReleaseHarnessRequest,
                       context: grpc.ServicerContext) -> pb.ReleaseHarnessResponse:
        return pb.ReleaseHarnessResponse(execution_ids=self.api.release_harness(request.harness_id, request.reason))


class CellsServicer(scheduler_pb2_grpc.CellsServicer):
    def __init__(self, api: SchedulerApi) -> None:
        self.api = api

    def RegisterCell(self, request: pb.RegisterCellRequest, context: grpc.ServicerContext) -> pb.RegisterCellResponse:
        role = enum_value(ROLE_FROM_PB, request.role, "role", "ROLLOUT, TRAIN or UNSPECIFIED (idle)")
        cell, created = self.api.register_cell(
            cell_id=request.cell_id, address=request.address, host=request.host, role=role,  # type: ignore[arg-type]
            is_core=request.is_core, kv_capacity_tokens=request.kv_capacity_tokens,
            num_accelerators=request.num_accelerators, engine_address=request.engine_address,
            hosts_replica=request.hosts_replica)
        return pb.RegisterCellResponse(cell=cell_to_proto(cell), created=created)

    def CellHeartbeat(self, request: pb.CellHeartbeatRequest,
                      context: grpc.ServicerContext) -> pb.CellHeartbeatResponse:
        role = enum_value(ROLE_FROM_PB, request.role, "role", "ROLLOUT, TRAIN or UNSPECIFIED (idle)")
        assigned, to = self.api.cell_heartbeat(
            cell_id=request.cell_id, inflight=request.inflight, kv_used_tokens=request.kv_used_tokens,
            kv_capacity_tokens=request.kv_capacity_tokens, weight_version=request.weight_version,
            role=role)  # type: ignore[arg-type]
        return pb.CellHeartbeatResponse(assigned_role=ROLE_TO_PB[assigned],
                                        switching_to=ROLE_TO_PB[to] if to else common_pb2.CELL_ROLE_UNSPECIFIED)

    def DeregisterCell(self, request: pb.DeregisterCellRequest,
                       context: grpc.ServicerContext) -> pb.DeregisterCellResponse:
        return pb.DeregisterCellResponse(role=ROLE_TO_PB[self.api.deregister_cell(request.cell_id)])


def registrations(api: SchedulerApi) -> list[Registration]:
    """(add_*_to_server, servicer) pairs for ``build_server``."""
    return [(scheduler_pb2_grpc.add_SchedulerServicer_to_server, SchedulerServicer(api)),
            (scheduler_pb2_grpc.add_HarnessesServicer_to_server, HarnessesServicer(api)),
            (scheduler_pb2_grpc.add_CellsServicer_to_server, CellsServicer(api))]


SERVICE_NAMES = [scheduler_pb2.DESCRIPTOR.services_by_name[n].full_name for n in ("Scheduler", "Harnesses", "Cells")]


class CellDaemonServicer(scheduler_pb2_grpc.CellDaemonServicer):
    """Served by a cell's daemon process (``daemon_main.py``), not by the scheduler."""

    def __init__(self, daemon: CellDaemon) -> None:
        self.daemon = daemon

    def SetRole(self, request: pb.SetRoleRequest, context: grpc.ServicerContext) -> pb.SetRoleResponse:
        if request.cell_id != self.daemon.cell_id:
            raise InvalidArgument(f"this daemon serves cell {self.daemon.cell_id!r}, not {request.cell_id!r}")
        role = enum_value(ROLE_FROM_PB, request.role, "role", "ROLLOUT or TRAIN")
        now, took = self.daemon.set_role(role, request.switch_id, job_id=request.job_id,  # type: ignore[arg-type]
                                        step=request.step, weight_version=request.weight_version)
        return pb.SetRoleResponse(role=ROLE_TO_PB[now], duration_s=took)

    def GetRole(self, request: pb.GetRoleRequest, context: grpc.ServicerContext) -> pb.GetRoleResponse:
        return pb.GetRoleResponse(cell_id=self.daemon.cell_id, role=ROLE_TO_PB[self.daemon.role],
                                  last_switch_id=self.daemon.last_switch_id)


DAEMON_SERVICE_NAMES = [scheduler_pb2.DESCRIPTOR.services_by_name["CellDaemon"].full_name]
