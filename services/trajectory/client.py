"""Typed client of the trajectory service (gateway, harnesses, reward, scheduler, trainer replicas).

Speaks domain types (``TitoCall``, ``Outcome``, ``PackedBatch``, ``StepPlan``) or protos, and
raises domain errors (``services.common.errors``) carrying the server's message.

    client = TrajectoryClient("127.0.0.1:50051")
    client.ingest(records)                      # TitoCall or TitoRecord, full or delta prompts
    client.complete_execution(outcome)          # Outcome or ExecutionOutcome
    client.open_step("job", 3, num_executions=64, group_size=8)
    for item in client.stream_batches("job", 3, consumer_id="replica-0"):
        train(item.batch)                       # services.trajectory.packing.PackedBatch
        client.ack("job", 3, item.batch_id, "replica-0")

``ingest(..., delta_encode=True)`` delta-encodes full prompts with a per-client ``DeltaEncoder``
before sending (call ``forget(execution_id)`` when an execution ends to free its trie).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from protos.gyre.v1 import common_pb2, trajectory_pb2, trajectory_pb2_grpc
from services.common import errors
from services.common.client import GrpcClient
from services.trajectory.packing import PackedBatch
from services.trajectory.records import DeltaEncoder, IngestSummary, Outcome, TitoCall
from services.trajectory.steps import StepPlan
from services.trajectory.wire import from_proto, outcome_to_proto, plan_from_proto, record_to_proto


@dataclass(frozen=True)
class StreamedBatch:
    """A micro-batch handed to this consumer: ack it with ``batch_id`` once its gradient is accumulated."""

    batch: PackedBatch
    batch_id: str
    job_id: str
    step: int
    step_num_executions: int  # the loss-weight denominator of the step
    context_tokens: int


@dataclass(frozen=True)
class ExecutionStats:
    paths: int
    naive_tokens: int
    tree_tokens: int
    trainable_tokens: int
    num_calls: int
    unique_tokens: int
    complete: bool
    packed: bool
    status: str = ""  # finished | timeout | failed once its outcome is in
    reward: float | None = None


class BatchStream:
    """Iterator of ``StreamedBatch``; ``cancel()`` (any thread) ends it and returns unacked batches."""

    def __init__(self, call: Any) -> None:
        self._call = call

    def __iter__(self) -> Iterator[StreamedBatch]:
        try:
            for msg in self._call:
                yield StreamedBatch(from_proto(msg), msg.batch_id, msg.job_id, msg.step, msg.step_num_executions,
                                    msg.context_tokens)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.CANCELLED and self._call.cancelled():
                return
            raise errors.from_rpc_error(exc) from None

    def cancel(self) -> None:
        self._call.cancel()


class TrajectoryClient(GrpcClient):
    """Client of the ``Trajectory`` service; thread-safe (one channel, a locked delta encoder)."""

    def __init__(self, address: str, *, max_message_mb: int = 256, timeout_s: float = 60.0,
                 encoder_tokens: int = 0) -> None:
        super().__init__(address, timeout_s=timeout_s, max_message_mb=max_message_mb)
        self._stub = trajectory_pb2_grpc.TrajectoryStub(self._channel)
        self._encoder = DeltaEncoder(max_tokens=encoder_tokens)  # 0: unbounded (forget ends executions)
        self._encoder_lock = threading.Lock()

    # ----------------------------------------------------------------- producers
    def ingest(self, records: Iterable[TitoCall | common_pb2.TitoRecord], *, delta_encode: bool = False,
               timeout_s: float | None = None) -> IngestSummary:
        """Send records (one client stream); ``delta_encode`` turns full prompts into deltas first.
        Safe to retry after a failure: resent records are recognised by call id."""
        def messages() -> Iterator[common_pb2.TitoRecord]:
            for r in records:
                if isinstance(r, common_pb2.TitoRecord):
                    yield r
                    continue
                if delta_encode:
                    with self._encoder_lock:
                        r = self._encoder.encode_call(r)
                yield record_to_proto(r)

        s = self._call(self._stub.IngestRecords, messages(), timeout_s)
        return IngestSummary(s.accepted, s.duplicates, s.new_tokens, s.record_tokens, s.executions)

    def forget(self, execution_id: str) -> None:
        """Drop the client-side delta-encoding state of an ended execution."""
        with self._encoder_lock:
            self._encoder.forget(execution_id)

    def encoding(self) -> tuple[list[str], int]:
        """(executions the delta encoder holds state for, tokens it holds)."""
        with self._encoder_lock:
            return self._encoder.executions(), self._encoder.tokens

    def complete_execution(self, outcome: Outcome | common_pb2.ExecutionOutcome) -> tuple[bool, StepPlan]:
        """Report an execution's end; returns (was a duplicate, plan of its step)."""
        msg = outcome if isinstance(outcome, common_pb2.ExecutionOutcome) else outcome_to_proto(outcome)
        r = self._call(self._stub.CompleteExecution, msg)
        return r.duplicate, plan_from_proto(r.plan)

    def execution_stats(self, execution_id: str, *, job_id: str = "", max_paths: int = 0) -> ExecutionStats:
        r = self._call(self._stub.GetExecutionStats, trajectory_pb2.GetExecutionStatsRequest(
            job_id=job_id, execution_id=execution_id, max_paths=max_paths))
        status = common_pb2.ExecutionStatus.Name(r.status).removeprefix("EXECUTION_STATUS_").lower() if r.status else ""
        return ExecutionStats(r.paths, r.naive_tokens, r.tree_tokens, r.trainable_tokens, r.num_calls,
                              r.unique_tokens, r.complete, r.packed, status, r.reward if r.has_reward else None)

    # ----------------------------------------------------------------- steps
    def open_step(self, job_id: str, step: int, *, num_executions: int = 0, group_size: int = 0,
                  token_budget: int = 0, normalize_advantages: bool = False, advantage_eps: float = 0.0) -> StepPlan:
        return plan_from_proto(self._call(self._stub.OpenStep, trajectory_pb2.OpenStepRequest(
            job_id=job_id, step=step, num_executions=num_executions, group_size=group_size,
            token_budget=token_budget, normalize_advantages=normalize_advantages, advantage_eps=advantage_eps)))

    def close_step(self, job_id: str, step: int) -> StepPlan:
        return plan_from_proto(self._call(self._stub.CloseStep, trajectory_pb2.StepRef(job_id=job_id, step=step)))

    def step_plan(self, job_id: str, step: int, *, timeout_s: float | None = None) -> StepPlan:
        return plan_from_proto(self._call(self._stub.GetStepPlan, trajectory_pb2.StepRef(job_id=job_id, step=step),
                                          timeout_s))

    # ----------------------------------------------------------------- trainer replicas
    def stream_batches(self, job_id: str, step: int, consumer_id: str, *, token_budget: int = 0) -> BatchStream:
        """The step's micro-batches for this consumer until the step is consumed (see trajectory.proto)."""
        call = self._stub.StreamBatches(trajectory_pb2.StreamBatchesRequest(
            job_id=job_id, step=step, token_budget=token_budget, consumer_id=consumer_id))
        return BatchStream(call)

    def settle_step(self, job_id: str, step: int, *, reopen: Iterable[str] = ()) -> tuple[int, StepPlan]:
        """Reopen the batches acknowledged by the ``reopen`` consumers (their gradients were lost),
        or with none mark the step final (its payloads may be collected). (reopened, plan)."""
        r = self._call(self._stub.SettleStep, trajectory_pb2.SettleStepRequest(
            job_id=job_id, step=step, reopen_consumer_ids=list(reopen)))
        return int(r.reopened), plan_from_proto(r.plan)

    def ack(self, job_id: str, step: int, batch_id: str, consumer_id: str) -> tuple[bool, StepPlan]:
        """Acknowledge a batch; (True, plan) when this call acknowledged it, (False, plan) for a resend.
        FailedPrecondition: the batch was re-handed to another consumer -- discard its result."""
        r = self._call(self._stub.AckBatch, trajectory_pb2.AckBatchRequest(
            job_id=job_id, step=step, batch_id=batch_id, consumer_id=consumer_id))
        return r.acknowledged, plan_from_proto(r.plan)
