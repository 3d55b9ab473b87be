"""gRPC adapter of the trajectory service: proto -> domain (``wire``) -> ``TrajectoryApi`` -> proto.

Errors are raised as domain errors (``services.common.errors``) / ``ValueError`` and mapped to
status codes by the common server interceptor. ``to_proto``/``from_proto`` (PackedBatch, arrays
as raw little-endian bytes, see trajectory.proto) live in ``wire`` and are re-exported here.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import grpc

from protos.gyre.v1 import common_pb2, trajectory_pb2, trajectory_pb2_grpc
from services.common.errors import InvalidArgument
from services.trajectory.api import ExecutionView, TrajectoryApi
from services.trajectory.records import TitoCall
from services.trajectory.wire import from_proto, outcome_from_proto, plan_to_proto, record_from_proto, to_proto

SERVICE_NAME = trajectory_pb2.DESCRIPTOR.services_by_name["Trajectory"].full_name
__all__ = ["SERVICE_NAME", "TrajectoryServicer", "from_proto", "to_proto"]


def stats_to_proto(v: ExecutionView) -> trajectory_pb2.ExecutionStats:
    return trajectory_pb2.ExecutionStats(
        job_id=v.job_id, execution_id=v.execution_id, paths=v.stats.paths, naive_tokens=v.stats.naive_tokens,
        tree_tokens=v.stats.tree_tokens, trainable_tokens=v.stats.trainable_tokens, num_calls=v.num_calls,
        unique_tokens=v.unique_tokens, complete=v.complete, packed=v.packed,
        status=common_pb2.ExecutionStatus.Name(int(v.outcome.status)) if v.outcome is not None
        else "EXECUTION_STATUS_UNSPECIFIED",
        reward=(v.outcome.reward or 0.0) if v.outcome is not None else 0.0,
        has_reward=v.outcome is not None and v.outcome.reward is not None)


@dataclass(frozen=True)
class _Records:
    """Iterates domain records from a request stream (conversion errors surface while ingesting)."""

    stream: Iterable[common_pb2.TitoRecord]

    def __iter__(self) -> Iterator[TitoCall]:
        for rec in self.stream:
            yield record_from_proto(rec)


# ----------------------------------------------------------------------------- servicer
class TrajectoryServicer(trajectory_pb2_grpc.TrajectoryServicer):
    def __init__(self, api: TrajectoryApi) -> None:
        self.api = api

    def IngestRecords(self, request_iterator: Iterable[common_pb2.TitoRecord],
                      context: grpc.ServicerContext) -> trajectory_pb2.IngestSummary:
        s = self.api.ingest(_Records(request_iterator))
        return trajectory_pb2.IngestSummary(accepted=s.accepted, duplicates=s.duplicates, new_tokens=s.new_tokens,
                                            record_tokens=s.record_tokens, executions=s.executions)

    def CompleteExecution(self, request: common_pb2.ExecutionOutcome,
                          context: grpc.ServicerContext) -> trajectory_pb2.CompleteExecutionResponse:
        duplicate, plan = self.api.complete(outcome_from_proto(request))
        return trajectory_pb2.CompleteExecutionResponse(duplicate=duplicate, plan=plan_to_proto(plan))

    def GetExecutionStats(self, request: trajectory_pb2.GetExecutionStatsRequest,
                          context: grpc.ServicerContext) -> trajectory_pb2.ExecutionStats:
        if not request.execution_id:
            raise InvalidArgument("execution_id is required")
        if request.max_paths < 0:
            raise InvalidArgument(f"max_paths {request.max_paths} must be >= 0 (0 = the configured cap)")
        return stats_to_proto(self.api.execution_stats(request.job_id, request.execution_id, request.max_paths))

    def OpenStep(self, request: trajectory_pb2.OpenStepRequest, context: grpc.ServicerContext) -> trajectory_pb2.StepPlan:
        return plan_to_proto(self.api.open_step(
            request.job_id, request.step, num_executions=request.num_executions, group_size=request.group_size,
            token_budget=request.token_budget, normalize_advantages=request.normalize_advantages,
            advantage_eps=request.advantage_eps))

    def CloseStep(self, request: trajectory_pb2.StepRef, context: grpc.ServicerContext) -> trajectory_pb2.StepPlan:
        return plan_to_proto(self.api.close_step(request.job_id, request.step))

    def GetStepPlan(self, request: trajectory_pb2.StepRef, context: grpc.ServicerContext) -> trajectory_pb2.StepPlan:
        return plan_to_proto(self.api.plan(request.job_id, request.step))

    def StreamBatches(self, request: trajectory_pb2.StreamBatchesRequest,
                      context: grpc.ServicerContext) -> Iterator[trajectory_pb2.PackedBatch]:
        batches = self.api.stream(request.job_id, request.step, request.consumer_id, request.token_budget,
                                   is_active=context.is_active)
        try:
            for meta, batch, denom in batches:
                yield to_proto(batch, job_id=request.job_id, batch_id=meta.batch_id, step_num_executions=denom,
                               context_tokens=meta.context_tokens)
        finally:
            batches.close()  # returns this consumer's unacknowledged batches when its stream ends

    def SettleStep(self, request: trajectory_pb2.SettleStepRequest,
                   context: grpc.ServicerContext) -> trajectory_pb2.SettleStepResponse:
        if request.step < 0:
            raise InvalidArgument(f"step {request.step} must be >= 0")
        if any(not c or len(c) > 256 for c in request.reopen_consumer_ids):
            raise InvalidArgument("reopen_consumer_ids must be non-empty ids of at most 256 characters")
        n, plan = self.api.settle(request.job_id, request.step, request.reopen_consumer_ids)
        return trajectory_pb2.SettleStepResponse(reopened=n, plan=plan_to_proto(plan))

    def AckBatch(self, request: trajectory_pb2.AckBatchRequest,
                 context: grpc.ServicerContext) -> trajectory_pb2.AckBatchResponse:
        if not request.batch_id or not request.consumer_id:
            raise InvalidArgument("batch_id and consumer_id are required")
        fresh, plan = self.api.ack(request.job_id, request.step, request.batch_id, request.consumer_id)
        return trajectory_pb2.AckBatchResponse(acknowledged=fresh, plan=plan_to_proto(plan))
