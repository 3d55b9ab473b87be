"""Proto <-> domain conversions of the trajectory service, shared by the servicer and the client.

``PackedBatch`` arrays travel as raw little-endian bytes (``np.frombuffer``; ``trainable`` as
uint8), not packed repeated fields: decoding a batch is a view, not a per-element loop.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from protos.gyre.v1 import common_pb2, trajectory_pb2
from services.common.errors import InvalidArgument
from services.trajectory.packing import DTYPES, PackedBatch
from services.trajectory.records import Outcome, PromptDelta, Status, TitoCall
from services.common.roles import AgentRole
from services.trajectory.steps import StepPlan

_WIRE_DTYPES = {**DTYPES, "trainable": np.uint8}


def _ids(values: Any) -> np.ndarray:
    # np.array reads a repeated scalar field through the buffer protocol (~250x faster than iterating)
    return np.array(values, dtype=np.int64)


def record_from_proto(rec: common_pb2.TitoRecord) -> TitoCall:
    """Domain record from a TitoRecord; ValueError (INVALID_ARGUMENT) naming the record when malformed."""
    ctx = rec.context
    delta = None
    if rec.HasField("delta"):
        if len(rec.prompt_ids):
            raise InvalidArgument(f"record {ctx.call_id!r} of execution {ctx.execution_id!r} sets both prompt_ids "
                                  "and delta; send one of them")
        d = rec.delta
        delta = PromptDelta(d.base_call_id, int(d.shared_prefix_len), _ids(d.new_ids))
    try:
        role = AgentRole.parse(int(ctx.role))
    except ValueError:
        raise InvalidArgument(f"record {ctx.call_id!r} of execution {ctx.execution_id!r}: role {ctx.role} is not "
                              "ROLE_MAIN, ROLE_SUBAGENT or ROLE_SUMMARY") from None
    return TitoCall(
        execution_id=ctx.execution_id, call_id=ctx.call_id, agent_id=ctx.agent_id, role=role,
        output_ids=_ids(rec.output_ids),
        output_logprobs=np.array(rec.output_logprobs, dtype=np.float32),
        weight_version=int(rec.weight_version),
        prompt_ids=None if delta is not None else _ids(rec.prompt_ids), delta=delta, job_id=ctx.job_id,
        finished_at_s=rec.finished_at_s, finish_reason=rec.finish_reason, attempt=max(int(ctx.attempt), 0),
        output_forced=np.array(rec.output_forced, dtype=bool) if len(rec.output_forced) else None,
        output_policy_logprobs=(np.array(rec.output_policy_logprobs, dtype=np.float32)
                                if len(rec.output_policy_logprobs) else None))


def record_to_proto(call: TitoCall) -> common_pb2.TitoRecord:
    rec = common_pb2.TitoRecord(
        context=common_pb2.CallContext(job_id=call.job_id, execution_id=call.execution_id, call_id=call.call_id,
                                       agent_id=call.agent_id, role=int(call.role),  # type: ignore[arg-type]
                                       attempt=call.attempt),
        output_ids=call.output_ids.tolist(), output_logprobs=call.output_logprobs.tolist(),
        weight_version=call.weight_version, finished_at_s=call.finished_at_s, finish_reason=call.finish_reason)
    if call.output_forced is not None and call.output_policy_logprobs is not None:
        rec.output_forced.extend(call.output_forced.tolist())
        rec.output_policy_logprobs.extend(call.output_policy_logprobs.tolist())
    if call.prompt_ids is not None:
        rec.prompt_ids.extend(call.prompt_ids.tolist())
    else:
        assert call.delta is not None
        rec.delta.base_call_id = call.delta.base_call_id
        rec.delta.shared_prefix_len = call.delta.shared_prefix_len
        rec.delta.new_ids.extend(call.delta.new_ids.tolist())
    return rec


def outcome_from_proto(msg: common_pb2.ExecutionOutcome) -> Outcome:
    try:
        status = Status.parse(int(msg.status))
    except ValueError:
        raise InvalidArgument(f"execution {msg.execution_id!r}: status must be FINISHED, TIMEOUT or FAILED") from None
    return Outcome(execution_id=msg.execution_id, group_id=msg.group_id, status=status,
                   reward=float(msg.reward) if msg.has_reward else None, excluded=msg.excluded, step=int(msg.step),
                   job_id=msg.job_id)


def outcome_to_proto(o: Outcome) -> common_pb2.ExecutionOutcome:
    return common_pb2.ExecutionOutcome(
        job_id=o.job_id, execution_id=o.execution_id, group_id=o.group_id, status=int(o.status),  # type: ignore[arg-type]
        reward=o.reward or 0.0, has_reward=o.reward is not None, excluded=o.excluded, step=o.step)


def to_proto(batch: PackedBatch, *, job_id: str = "", batch_id: str = "", step_num_executions: int = 0,
             context_tokens: int = 0) -> trajectory_pb2.PackedBatch:
    """A PackedBatch message; arrays as raw little-endian bytes (trainable as uint8)."""
    arrays = {name: np.ascontiguousarray(getattr(batch, name), dtype=np.dtype(dt).newbyteorder("<")).tobytes()
              for name, dt in _WIRE_DTYPES.items()}
    return trajectory_pb2.PackedBatch(
        job_id=job_id, step=batch.step, batch_id=batch_id, num_tokens=len(batch), execution_ids=batch.execution_ids,
        step_num_executions=step_num_executions, context_tokens=context_tokens,
        piece_starts=np.ascontiguousarray(batch.piece_starts, dtype="<i8").tobytes(), **arrays)


def from_proto(msg: trajectory_pb2.PackedBatch) -> PackedBatch:
    """The PackedBatch of a message (arrays are read-only views of the message bytes)."""
    n = int(msg.num_tokens)
    arrays: dict[str, np.ndarray] = {}
    for name, dt in _WIRE_DTYPES.items():
        arr = np.frombuffer(getattr(msg, name), dtype=np.dtype(dt).newbyteorder("<"))
        if len(arr) != n:
            raise InvalidArgument(f"PackedBatch {msg.batch_id!r}: {name} holds {len(arr)} values, num_tokens is {n}")
        arrays[name] = arr.astype(DTYPES[name], copy=False)
    if len(msg.piece_starts) % 8:
        raise InvalidArgument(f"PackedBatch {msg.batch_id!r}: piece_starts is not a whole number of int64 values")
    pieces = np.frombuffer(msg.piece_starts, dtype="<i8").astype(np.int64, copy=False)
    return PackedBatch(**arrays, execution_ids=tuple(msg.execution_ids), step=int(msg.step), piece_starts=pieces)


def plan_to_proto(p: StepPlan) -> trajectory_pb2.StepPlan:
    return trajectory_pb2.StepPlan(
        job_id=p.job_id, step=p.step, num_executions=p.num_executions, num_completed=p.num_completed,
        num_trained=p.num_trained, num_micro_batches=p.num_micro_batches, num_acked=p.num_acked, sealed=p.sealed,
        done=p.done, token_budget=p.token_budget, num_tokens=p.num_tokens, context_tokens=p.context_tokens,
        group_size=p.group_size, acked_tokens=p.acked_tokens)


def plan_from_proto(m: trajectory_pb2.StepPlan) -> StepPlan:
    return StepPlan(m.job_id, m.step, m.num_executions, m.num_completed, m.num_trained, m.num_micro_batches,
                    m.num_acked, m.sealed, m.done, m.token_budget, m.num_tokens, m.context_tokens, m.group_size,
                    m.acked_tokens)
