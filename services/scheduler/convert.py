"""Proto <-> domain conversions of the scheduler's messages (used by servicer.py and client.py).

Conversions from protos validate: a bad value raises ``InvalidArgument`` with the field's name.
"""

from __future__ import annotations

from dataclasses import asdict, fields

from protos.gyre.v1 import common_pb2, scheduler_pb2
from services.common.errors import InvalidArgument
from services.common.roles import CellRole
from services.scheduler.jobs import (
    Algorithm,
    Evaluation,
    eval_job_id,
    lease_temperature,
    CellRecord,
    Event,
    ExecState,
    ExecutionRecord,
    JobSpec,
    JobState,
    JobStatus,
    Lease,
    Mode,
    TaskSource,
    TimeoutPolicy,
)

pb = scheduler_pb2

MODE_TO_PB = {Mode.COLOCATE: pb.SCHEDULING_MODE_COLOCATE, Mode.ASYNC: pb.SCHEDULING_MODE_ASYNC,
              Mode.ELASTIC: pb.SCHEDULING_MODE_ELASTIC}
MODE_FROM_PB = {v: k for k, v in MODE_TO_PB.items()}
TIMEOUT_TO_PB = {TimeoutPolicy.PARTIAL: pb.TIMEOUT_POLICY_PARTIAL, TimeoutPolicy.ZERO: pb.TIMEOUT_POLICY_ZERO,
                 TimeoutPolicy.EXCLUDE: pb.TIMEOUT_POLICY_EXCLUDE}
TIMEOUT_FROM_PB = {**{v: k for k, v in TIMEOUT_TO_PB.items()}, pb.TIMEOUT_POLICY_UNSPECIFIED: TimeoutPolicy.PARTIAL}
JOB_STATE_TO_PB = {s: getattr(pb, f"JOB_STATE_{s.name}") for s in JobState}
JOB_STATE_FROM_PB = {v: k for k, v in JOB_STATE_TO_PB.items()}
EXEC_STATE_TO_PB = {s: getattr(pb, f"EXECUTION_STATE_{s.name}") for s in ExecState}
STATUS_FROM_PB = {common_pb2.EXECUTION_STATUS_FINISHED: ExecState.FINISHED,
                  common_pb2.EXECUTION_STATUS_TIMEOUT: ExecState.TIMEOUT,
                  common_pb2.EXECUTION_STATUS_FAILED: ExecState.FAILED}
STATUS_TO_PB = {v: k for k, v in STATUS_FROM_PB.items()}
# common.proto has no IDLE role (yet): an idle cell is CELL_ROLE_UNSPECIFIED on the wire.
_IDLE_PB = getattr(common_pb2, "CELL_ROLE_IDLE", common_pb2.CELL_ROLE_UNSPECIFIED)
ROLE_TO_PB = {CellRole.ROLLOUT: common_pb2.CELL_ROLE_ROLLOUT, CellRole.TRAIN: common_pb2.CELL_ROLE_TRAIN,
              CellRole.SWITCHING: common_pb2.CELL_ROLE_SWITCHING, CellRole.IDLE: _IDLE_PB}
ROLE_FROM_PB = {**{v: k for k, v in ROLE_TO_PB.items()}, common_pb2.CELL_ROLE_UNSPECIFIED: CellRole.IDLE}


def enum_value(table: dict, value: int, what: str, known: str) -> object:
    try:
        return table[value]
    except KeyError:
        raise InvalidArgument(f"{what} {value} is not valid; expected {known}") from None


def spec_from_proto(p: scheduler_pb2.JobSpec, job_id: str) -> JobSpec:
    """Validate and convert a JobSpec (``job_id`` fills an empty ``p.job_id``); ValueError if bad."""
    if p.mode == pb.SCHEDULING_MODE_UNSPECIFIED:
        raise InvalidArgument("spec.mode is required: colocate, async or elastic")
    which = p.tasks.WhichOneof("source")
    if which == "payloads":
        tasks = TaskSource(payloads=tuple(p.tasks.payloads.payloads))
    elif which == "generator":
        tasks = TaskSource(generator=p.tasks.generator.name, params=tuple(sorted(p.tasks.generator.params.items())))
    else:
        raise InvalidArgument("spec.tasks is required: explicit payloads or a generator name")
    try:
        return JobSpec(
            job_id=p.job_id or job_id,
            model=p.model,
            tasks=tasks,
            num_steps=p.num_steps,
            groups_per_step=p.groups_per_step,
            group_size=p.group_size,
            mode=enum_value(MODE_FROM_PB, p.mode, "spec.mode", "colocate, async or elastic"),  # type: ignore[arg-type]
            staleness_bound=p.staleness_bound,
            timeout_policy=enum_value(TIMEOUT_FROM_PB, p.timeout_policy, "spec.timeout_policy",  # type: ignore[arg-type]
                                 "partial, zero or exclude"),
            execution_timeout_s=p.execution_timeout_s or 3600.0,
            cell_ids=tuple(p.cell_ids),
            algorithm=algorithm_from_proto(p.algorithm) if p.HasField("algorithm") else Algorithm(),
            evaluation=Evaluation(tasks=p.evaluation.tasks, every=p.evaluation.every, greedy=not p.evaluation.sampled),
            scorer=p.scorer, harness=p.harness or "builtin", seed=p.seed, shards=p.shards or 1,
            max_attempts=p.max_attempts or 3,
            async_rollout_cells=p.async_rollout_cells if p.HasField("async_rollout_cells") else None,
            min_rollout_cells=p.min_rollout_cells if p.HasField("min_rollout_cells") else 1,
            consolidate_threshold=p.consolidate_threshold if p.HasField("consolidate_threshold") else 1.0,
            execution_kv_tokens=p.execution_kv_tokens if p.HasField("execution_kv_tokens") else None,
            rollout_batches=p.rollout_batches,
        )
    except ValueError as exc:
        raise InvalidArgument(f"invalid job spec: {exc}") from None


_ALGORITHM_UNSET_IS_DEFAULT = ("learning_rate", "clip_high", "max_grad_norm", "temperature", "loss_aggregation",
                               "advantage_eps", "kl_reference", "kl_estimator", "lr_schedule")
_ALGORITHM_OPTIONAL = ("dual_clip", "lr_min_ratio", "adam_beta1", "adam_beta2", "adam_eps")


def algorithm_from_proto(p: scheduler_pb2.Algorithm) -> Algorithm:
    """Proto3 has no "unset" for scalars: a zero that is never a valid choice reads as the default."""
    values = {f: getattr(p, f) for f in (x.name for x in fields(Algorithm))}
    for name in _ALGORITHM_UNSET_IS_DEFAULT:
        if not values[name]:
            del values[name]
    for name in _ALGORITHM_OPTIONAL:  # fields with presence: absent (an older client) = the default
        if not p.HasField(name):
            del values[name]
    return Algorithm(**values)


def spec_to_proto(s: JobSpec) -> scheduler_pb2.JobSpec:
    p = pb.JobSpec(job_id=s.job_id, model=s.model, num_steps=s.num_steps, groups_per_step=s.groups_per_step,
                   group_size=s.group_size, mode=MODE_TO_PB[s.mode], staleness_bound=s.staleness_bound,
                   timeout_policy=TIMEOUT_TO_PB[s.timeout_policy], execution_timeout_s=s.execution_timeout_s,
                   cell_ids=list(s.cell_ids), max_attempts=s.max_attempts,
                   min_rollout_cells=s.min_rollout_cells, consolidate_threshold=s.consolidate_threshold,
                   rollout_batches=s.rollout_batches, algorithm=pb.Algorithm(**asdict(s.algorithm)),
                   evaluation=pb.Evaluation(tasks=s.evaluation.tasks, every=s.evaluation.every,
                                            sampled=not s.evaluation.greedy),
                   scorer=s.scorer, harness=s.harness, seed=s.seed, shards=s.shards)
    if s.tasks.payloads:
        p.tasks.payloads.payloads.extend(s.tasks.payloads)
    else:
        p.tasks.generator.name = s.tasks.generator
        p.tasks.generator.params.update(dict(s.tasks.params))
    if s.async_rollout_cells is not None:
        p.async_rollout_cells = s.async_rollout_cells
    if s.execution_kv_tokens is not None:
        p.execution_kv_tokens = s.execution_kv_tokens
    return p


def job_to_proto(j: JobStatus) -> scheduler_pb2.Job:
    return pb.Job(
        spec=spec_to_proto(j.spec), state=JOB_STATE_TO_PB[j.state], current_step=j.current_step,
        weight_version=j.weight_version, enqueued_steps=j.enqueued_steps, training_step=j.training_step,
        done_in_step=j.done_in_step, groups_done_in_step=j.groups_done_in_step, step_size=j.spec.step_size,
        queued=j.queued, running=j.running, finished_total=j.totals.get("finished", 0),
        timeout_total=j.totals.get("timeout", 0), failed_total=j.totals.get("failed", 0),
        requeued_total=j.totals.get("requeued", 0), created_at_s=j.created_s, updated_at_s=j.updated_s,
        message=j.message)


def event_to_proto(e: Event) -> scheduler_pb2.JobEvent:
    return pb.JobEvent(event_id=e.event_id, kind=e.kind, job_id=e.job_id, ts_s=e.ts_s, attrs=dict(e.attrs))


def lease_to_proto(lz: Lease, job: JobSpec) -> scheduler_pb2.ExecutionLease:
    return pb.ExecutionLease(
        execution_id=lz.execution_id, job_id=lz.job_id, step=lz.step, group_id=lz.group_id, task_payload=lz.payload,
        lease_token=lz.lease_token, attempt=lz.attempt, deadline_s=lz.deadline_s, lease_ttl_s=lz.lease_ttl_s,
        lease_expires_s=lz.lease_expires_s, model=job.model, timeout_policy=TIMEOUT_TO_PB[job.timeout_policy],
        evaluation=lz.evaluation, greedy=lz.evaluation and job.evaluation.greedy,
        record_job_id=eval_job_id(lz.job_id) if lz.evaluation else lz.job_id,
        temperature=lease_temperature(lz.evaluation, job),
        session_token=lz.session_token, session_base_url=lz.session_base_url)


def execution_to_proto(x: ExecutionRecord) -> scheduler_pb2.Execution:
    return pb.Execution(execution_id=x.execution_id, job_id=x.job_id, step=x.step, group_id=x.group_id,
                        state=EXEC_STATE_TO_PB[x.state], attempt=x.attempt, harness_id=x.harness_id,
                        deadline_s=x.deadline_s, lease_expires_s=x.lease_expires_s, reason=x.reason)


def cell_to_proto(c: CellRecord, age_s: float = 0.0, alive: bool = True) -> scheduler_pb2.Cell:
    p = pb.Cell(cell_id=c.cell_id, address=c.address, host=c.host, role=ROLE_TO_PB[c.role], is_core=c.is_core,
                kv_capacity_tokens=c.kv_capacity_tokens, kv_used_tokens=c.kv_used_tokens, inflight=c.inflight,
                weight_version=c.weight_version, heartbeat_age_s=age_s, alive=alive,
                reported_role=ROLE_TO_PB[c.reported_role] if c.reported_role else common_pb2.CELL_ROLE_UNSPECIFIED,
                last_switch_s=c.last_switch_s, num_accelerators=c.num_accelerators,
                engine_address=c.engine_address, hosts_replica=c.hosts_replica, cordoned=c.cordoned,
                cordon_reason=c.cordon_reason)
    if c.role is CellRole.SWITCHING and c.switch_from and c.switch_to:
        p.switch.CopyFrom(pb.CellSwitch(switch_id=c.switch_id, from_role=ROLE_TO_PB[c.switch_from],
                                        to_role=ROLE_TO_PB[c.switch_to], started_at_s=c.switch_started_s,
                                        job_id=c.switch_job_id))
    return p


EXEC_STATE_FROM_PB = {v: k for k, v in EXEC_STATE_TO_PB.items()}


def job_from_proto(p: scheduler_pb2.Job) -> JobStatus:
    return JobStatus(
        spec=spec_from_proto(p.spec, p.spec.job_id), state=JOB_STATE_FROM_PB[p.state], created_s=p.created_at_s,
        updated_s=p.updated_at_s, current_step=p.current_step, weight_version=p.weight_version,
        enqueued_steps=p.enqueued_steps, training_step=p.training_step, done_in_step=p.done_in_step,
        groups_done_in_step=p.groups_done_in_step, queued=p.queued, running=p.running,
        totals={"finished": p.finished_total, "timeout": p.timeout_total, "failed": p.failed_total,
                "requeued": p.requeued_total},
        message=p.message)


def event_from_proto(p: scheduler_pb2.JobEvent) -> Event:
    return Event(event_id=p.event_id, kind=p.kind, ts_s=p.ts_s, job_id=p.job_id, attrs=dict(p.attrs))


def lease_from_proto(p: scheduler_pb2.ExecutionLease) -> Lease:
    return Lease(execution_id=p.execution_id, job_id=p.job_id, step=p.step, group_id=p.group_id,
                 payload=p.task_payload, lease_token=p.lease_token, attempt=p.attempt, deadline_s=p.deadline_s,
                 lease_ttl_s=p.lease_ttl_s, lease_expires_s=p.lease_expires_s, evaluation=p.evaluation,
                 greedy=p.greedy, record_job_id=p.record_job_id or p.job_id,
                 temperature=p.temperature if p.HasField("temperature") else None, model=p.model,
                 session_token=p.session_token, session_base_url=p.session_base_url)


def execution_from_proto(p: scheduler_pb2.Execution) -> ExecutionRecord:
    return ExecutionRecord(execution_id=p.execution_id, job_id=p.job_id, step=p.step, group_id=p.group_id,
                           state=EXEC_STATE_FROM_PB[p.state], attempt=p.attempt, harness_id=p.harness_id,
                           deadline_s=p.deadline_s, lease_expires_s=p.lease_expires_s, reason=p.reason)


def cell_from_proto(p: scheduler_pb2.Cell) -> CellRecord:
    sw = p.switch if p.HasField("switch") else None
    return CellRecord(
        cell_id=p.cell_id, address=p.address, host=p.host, role=ROLE_FROM_PB[p.role], is_core=p.is_core,
        kv_capacity_tokens=p.kv_capacity_tokens, kv_used_tokens=p.kv_used_tokens, inflight=p.inflight,
        weight_version=p.weight_version, heartbeat_s=0.0, registered_s=0.0,
        reported_role=ROLE_FROM_PB[p.reported_role] if p.reported_role else None,
        switch_id=sw.switch_id if sw else "", switch_from=ROLE_FROM_PB[sw.from_role] if sw else None,
        switch_to=ROLE_FROM_PB[sw.to_role] if sw else None, switch_started_s=sw.started_at_s if sw else 0.0,
        switch_job_id=sw.job_id if sw else "", last_switch_s=p.last_switch_s,
        num_accelerators=p.num_accelerators, engine_address=p.engine_address, hosts_replica=p.hosts_replica,
        cordon_reason=(p.cordon_reason or "cordoned") if p.cordoned else "")
