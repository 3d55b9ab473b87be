"""The scheduler's state in Redis: the one module that owns its key layout.

Everything the scheduler knows lives here, so a restarted scheduler rebuilds its whole view
from Redis. Multi-key transitions are Lua scripts (``lua.py``), hence atomic: a process killed at
any instant leaves a state that is before or after each transition.

Key layout (prefix ``gyre:sched:``)::

    jobs                      ZSET  job_id -> created_ms            (ListJobs order)
    active                    SET   job ids pending or running      (orchestrator's work list)
    job:{job}                 HASH  spec JSON, state, current_step, weight_version, enqueued_steps,
                                    training_step, done:{step}, groups_done:{step}, gdone:{step}:{group},
                                    n_{status}, n_requeued, created_ms, updated_ms, message
    job:{job}:queue           ZSET  execution_id -> step            (lowest step leased first)
    job:{job}:running         SET   leased execution ids
    job:{job}:events          STREAM  the job's event log (WatchJob reads it; ids resume a watch)
    exec:{execution}          HASH  job_id, step, group_id, payload, state, attempt, token,
                                    lease_expires_ms, deadline_ms, harness_id, completion_token, ...
                                    (expires ``retention_s`` after it ends)
    leases                    ZSET  execution_id -> lease_expires_ms (all jobs; the reaper's index)
    score_outbox              HASH  execution_id -> {job_id, step, group_id} JSON: executions whose
                                    last lease expired, ended as timeouts, not yet scored by the
                                    reward service (removed once it acknowledged the score)
    cells                     SET   cell ids
    cell:{cell}               HASH  address, host, role, is_core, kv_*, inflight, weight_version,
                                    heartbeat_ms, switch_{id,from,to,started_ms,job_id}, last_switch_*,
                                    cordon_reason (set: an operator cordoned it; kept across RegisterCell)
    switches                  ZSET  cell_id -> switch_started_ms    (switches in flight)
    switch_log                STREAM  every finished / rolled-back switch with its duration
    leader                    STRING  instance id of the orchestrating scheduler (PX lease)
    controlled                SET   jobs the job controller prepared and has not wound down yet

    The job hash also holds the job controller's progress: ctl_prepared, ctl_trainer_starts,
    training_done, hold_completion, eval_size:{round}, eval_done:{round}, eval_n_{status}:{round},
    eval_result:{round} (JSON); and train:{step} = "tokens compute_s world_size", what each
    published update measured (the elastic policy's cost model, ``costs.py``).

Lease fencing: each lease gets a fresh random token; Heartbeat/CompleteExecution must present
the execution's current token. An expired lease is re-queued keeping its token, so the original
holder may still heartbeat (reclaim) or complete it until someone else leases it; after that the
old token is stale and refused. Completion is idempotent for the token that completed it.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from services.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from services.common.redis_store import Keys as _NsKeys
from services.common.roles import CellRole
from services.scheduler import lua
from services.scheduler.costs import RECENT, SwitchSample, TrainSample
from services.scheduler.jobs import (
    CellRecord,
    Event,
    ExecState,
    ExecutionRecord,
    JobSpec,
    JobState,
    JobStatus,
    Lease,
    eval_job_id,
)

TERMINAL_EXEC = (ExecState.FINISHED, ExecState.TIMEOUT, ExecState.FAILED)


class Keys:
    """Key names of the scheduler (see the module docstring for the layout)."""

    def __init__(self, namespace: str = "sched") -> None:
        self.namespace = namespace
        self._ns = _NsKeys(namespace)
        self.jobs = self._ns.key("jobs")
        self.active = self._ns.key("active")
        self.leases = self._ns.key("leases")
        self.score_outbox = self._ns.key("score_outbox")
        self.cells = self._ns.key("cells")
        self.switches = self._ns.key("switches")
        self.switch_log = self._ns.key("switch_log")
        self.leader = self._ns.key("leader")
        self.controlled = self._ns.key("controlled")
        self.job_prefix = self._ns.key("job", "")
        self.exec_prefix = self._ns.key("exec", "")
        self.cell_prefix = self._ns.key("cell", "")

    def job(self, job_id: str) -> str:
        return self.job_prefix + job_id

    def queue(self, job_id: str) -> str:
        return self.job_prefix + job_id + ":queue"

    def running(self, job_id: str) -> str:
        return self.job_prefix + job_id + ":running"

    def events(self, job_id: str) -> str:
        return self.job_prefix + job_id + ":events"

    def execution(self, execution_id: str) -> str:
        return self.exec_prefix + execution_id

    def cell(self, cell_id: str) -> str:
        return self.cell_prefix + cell_id

    def lease_request(self, request_id: str) -> str:
        return self._ns.key("lease_req", request_id)

    def session(self, token: str) -> str:
        return self._ns.key("session", token)

    @property
    def gateway_http(self) -> str:
        return self._ns.key("gateway_http")


def execution_id(job_id: str, step: int, group: int, index: int) -> str:
    """Stable, human-readable execution id: ``{job}.s{step}.g{group}.e{index}``."""
    return f"{job_id}.s{step}.g{group}.e{index}"


def eval_execution_id(job_id: str, round_: int, index: int) -> str:
    """Id of the ``index``-th held-out execution of evaluation round ``round_``: ``{job}.v{round}.t{index}``."""
    return f"{job_id}.v{round_}.t{index}"


_EXEC_ID_RE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_-]{0,63})\.(?:s\d+\.g\d+\.e\d+|v\d+\.t\d+)$")


def job_of_execution(execution_id_: str) -> str | None:
    """The job id inside an execution id (job ids contain no '.'), or None if it is not one of ours."""
    m = _EXEC_ID_RE.match(execution_id_)
    return m.group(1) if m else None


def group_id(step: int, group: int) -> str:
    return f"s{step}.g{group}"


@dataclass(frozen=True)
class CompleteResult:
    state: ExecState  # the execution's final state
    duplicate: bool  # True when this token had already completed it (idempotent repeat)
    done_in_step: int  # executions of its step that have ended (-1 on a duplicate)


def _s(v: bytes | str | None, default: str = "") -> str:
    if v is None:
        return default
    return v.decode() if isinstance(v, bytes) else str(v)


def _holder(h: Mapping[bytes, bytes]) -> str:
    """The harness id an execution hash names."""
    return _s(h.get(b"harness_id"))


def _i(v: bytes | str | int | None, default: int = 0) -> int:
    if v is None or v == b"" or v == "":
        return default
    return int(v)


class SchedulerState:
    """Typed operations on the scheduler's Redis state. Thread-safe (redis-py pools connections).

    ``clock`` returns seconds since the epoch; every timestamp written comes from it.
    """

    def __init__(self, client: redis.Redis, *, clock: Callable[[], float] = time.time,
                 event_maxlen: int = 100_000, retention_s: float = 86_400.0, namespace: str = "sched") -> None:
        self.r: Any = client  # redis-py's reply types are too loose to check usefully
        self.keys = Keys(namespace)
        self.clock = clock
        self.event_maxlen = event_maxlen
        self.retention_ms = int(retention_s * 1000)
        self._scripts = {name: client.register_script(getattr(lua, name)) for name in (
            "SUBMIT_JOB", "SET_JOB_STATE", "ENQUEUE_STEP", "ENQUEUE_EVAL", "LEASE", "HEARTBEAT", "COMPLETE", "REAP", "GRACE_LEASES", "RELEASE_HARNESS",
            "CANCEL_JOB", "REPORT_TRAINING", "REGISTER_CELL", "CELL_HEARTBEAT", "DEREGISTER_CELL",
            "BEGIN_SWITCH", "END_SWITCH", "CORDON_CELL", "JOB_SNAPSHOT", "ACQUIRE_LEADER", "RELEASE_LEADER")}

    def now_ms(self) -> int:
        return int(self.clock() * 1000)

    def _run(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        return self._scripts[name](keys=list(keys), args=list(args))

    # ---------------------------------------------------------------- jobs

    def submit_job(self, spec: JobSpec) -> JobStatus:
        k, jid = self.keys, spec.job_id
        fields: list[object] = [
            "spec", spec.to_json(), "state", JobState.PENDING.value, "current_step", 0, "weight_version", 0,
            "enqueued_steps", 0, "training_step", -1, "num_steps", spec.num_steps,
            "group_size", spec.group_size, "groups_per_step", spec.groups_per_step,
            "execution_timeout_ms", int(spec.execution_timeout_s * 1000), "max_attempts", spec.max_attempts,
            "message", "", "hold_completion", 1 if spec.evaluation.after_steps(spec.num_steps) else 0,
            "harness", spec.harness,
        ]
        res = self._run("SUBMIT_JOB", [k.job(jid), k.jobs, k.events(jid), k.active],
                        [jid, self.now_ms(), self.event_maxlen, *fields])
        if res[0] == -1:
            raise AlreadyExists(f"job {jid!r} already exists; pick another job_id or leave it empty")
        return self.get_job(jid)

    def get_job(self, job_id: str) -> JobStatus:
        k = self.keys
        raw = self._run("JOB_SNAPSHOT", [k.job(job_id), k.queue(job_id), k.running(job_id)], [])
        if not raw:
            raise NotFound(f"job {job_id!r} does not exist")
        (state, spec, created, updated, cur, ver, enq, tstep, done, gdone, n_fin, n_to, n_fail, n_rq, msg,
         queued, running) = raw
        return JobStatus(
            spec=JobSpec.from_json(spec), state=JobState(_s(state)), created_s=_i(created) / 1000,
            updated_s=_i(updated) / 1000, current_step=_i(cur), weight_version=_i(ver), enqueued_steps=_i(enq),
            training_step=_i(tstep, -1), done_in_step=_i(done), groups_done_in_step=_i(gdone),
            queued=int(queued), running=int(running),
            totals={"finished": _i(n_fin), "timeout": _i(n_to), "failed": _i(n_fail), "requeued": _i(n_rq)},
            message=_s(msg),
        )

    def job_harnesses(self, job_ids: Sequence[str]) -> list[str]:
        """Who runs each job's executions ("builtin" or "external"), in the order given."""
        pipe = self.r.pipeline(transaction=False)
        for jid in job_ids:
            pipe.hget(self.keys.job(jid), "harness")
        return [_s(h, "builtin") for h in pipe.execute()]

    def job_exists(self, job_id: str) -> bool:
        return bool(self.r.exists(self.keys.job(job_id)))

    def list_jobs(self, *, states: Iterable[JobState] = (), offset: int = 0, limit: int = 100) -> list[JobStatus]:
        """Jobs in submission order; ``states`` filters (scans the index when given)."""
        wanted = set(states)
        out: list[JobStatus] = []
        pos = offset
        while len(out) < limit:
            ids = self.r.zrange(self.keys.jobs, pos, pos + max(limit, 100) - 1)
            if not ids:
                break
            pos += len(ids)
            for jid in ids:
                try:
                    job = self.get_job(_s(jid))
                except NotFound:  # deleted between index read and fetch
                    continue
                if not wanted or job.state in wanted:
                    out.append(job)
                    if len(out) == limit:
                        break
        return out

    def active_job_ids(self) -> list[str]:
        """Pending and running jobs, oldest first."""
        ids = [_s(j) for j in self.r.smembers(self.keys.active)]
        if not ids:
            return []
        created = self.r.zmscore(self.keys.jobs, ids)
        return [j for _, j in sorted(zip((c or 0.0 for c in created), ids))]

    def set_job_state(self, job_id: str, from_state: JobState, to_state: JobState, message: str = "") -> bool:
        """Move a job from ``from_state`` to ``to_state``; False if it was already there."""
        res = self._run("SET_JOB_STATE", [self.keys.job(job_id), self.keys.events(job_id), self.keys.active],
                        [from_state.value, to_state.value, self.now_ms(), self.event_maxlen, message, job_id])
        if res[0] == -1:
            raise NotFound(f"job {job_id!r} does not exist")
        if res[0] == -2:
            raise FailedPrecondition(f"job {job_id!r} is {_s(res[1])}, not {from_state.value}")
        return res[0] == 1

    def cancel_job(self, job_id: str, message: str = "cancelled by client") -> int:
        """Cancel a job; drops its queued executions (returned count). Leased ones learn it on heartbeat."""
        k = self.keys
        res = self._run("CANCEL_JOB", [k.job(job_id), k.queue(job_id), k.running(job_id), k.events(job_id), k.active],
                        [self.now_ms(), self.event_maxlen, k.exec_prefix, self.retention_ms, message, job_id])
        if res[0] == -1:
            raise NotFound(f"job {job_id!r} does not exist")
        if res[0] == -2:
            raise FailedPrecondition(f"job {job_id!r} already ended ({_s(res[1])}); nothing to cancel")
        return int(res[1]) if res[0] == 1 else 0

    def enqueue_step(self, spec: JobSpec, step: int, group_payloads: Sequence[bytes]) -> int:
        """Enqueue step ``step`` (one payload per group) iff it is the job's next step; returns count."""
        if len(group_payloads) != spec.groups_per_step:
            raise ValueError(f"step needs {spec.groups_per_step} group payloads, got {len(group_payloads)}")
        args: list[object] = [step, self.keys.exec_prefix, self.now_ms(), self.event_maxlen, spec.job_id]
        for g, payload in enumerate(group_payloads):
            for e in range(spec.group_size):
                args += [execution_id(spec.job_id, step, g, e), group_id(step, g), payload]
        k = self.keys
        res = self._run("ENQUEUE_STEP", [k.job(spec.job_id), k.queue(spec.job_id), k.events(spec.job_id)], args)
        if res[0] == -1:
            raise NotFound(f"job {spec.job_id!r} does not exist")
        return int(res[1]) if res[0] == 1 else 0

    def enqueue_evaluation(self, spec: JobSpec, round_: int, after_step: int, weight_version: int,
                           payloads: Sequence[bytes]) -> int:
        """Enqueue evaluation round ``round_`` (one execution per payload) once; returns how many
        were enqueued now (0 when the round already was)."""
        args: list[object] = [round_, self.keys.exec_prefix, self.now_ms(), self.event_maxlen, spec.job_id,
                              after_step, weight_version]
        for i, payload in enumerate(payloads):
            args += [eval_execution_id(spec.job_id, round_, i), payload]
        k = self.keys
        res = self._run("ENQUEUE_EVAL", [k.job(spec.job_id), k.queue(spec.job_id), k.events(spec.job_id)], args)
        if res[0] == -1:
            raise NotFound(f"job {spec.job_id!r} does not exist")
        return int(res[1]) if res[0] == 1 else 0

    def mark_controlled(self, job_id: str) -> None:
        """The job controller prepared this job (it winds it down once the job ends)."""
        self.r.sadd(self.keys.controlled, job_id)

    def controlled_jobs(self) -> list[str]:
        return sorted(_s(j) for j in self.r.smembers(self.keys.controlled))

    def forget_controlled(self, job_id: str) -> None:
        self.r.srem(self.keys.controlled, job_id)

    def incr_controller_counter(self, job_id: str, name: str) -> int:
        assert name.startswith("ctl_"), name
        return int(self.r.hincrby(self.keys.job(job_id), name, 1))

    def controller_fields(self, job_id: str) -> dict[str, str]:
        """The job hash's fields the job controller reads (eval_*, training_done, ctl_*)."""
        h = self.r.hgetall(self.keys.job(job_id))
        return {_s(key): _s(v) for key, v in h.items()
                if _s(key).startswith(("eval_", "ctl_", "training_done", "hold_completion"))}

    def set_controller_field(self, job_id: str, name: str, value: str, *, only_new: bool = False) -> bool:
        """Record controller progress in the job hash (``only_new``: keep an existing value)."""
        assert name.startswith(("ctl_", "eval_result:")), name
        if only_new:
            return bool(self.r.hsetnx(self.keys.job(job_id), name, value))
        self.r.hset(self.keys.job(job_id), name, value)
        return True

    def train_samples(self, job_id: str, before_step: int, count: int = RECENT) -> list[TrainSample]:
        """What the updates of the ``count`` steps before ``before_step`` measured, oldest first."""
        steps = list(range(max(0, before_step - count), before_step))
        if not steps:
            return []
        out = []
        for step, raw in zip(steps, self.r.hmget(self.keys.job(job_id), [f"train:{s}" for s in steps])):
            if raw:
                tokens, compute_s, world = _s(raw).split()
                out.append(TrainSample(step=step, tokens=float(tokens), compute_s=float(compute_s),
                                       world_size=int(world)))
        return out

    def switch_samples(self, count: int = 4 * RECENT) -> list[SwitchSample]:
        """Durations of the last finished switches (any job: they are the cells' costs), oldest first."""
        out = []
        for _eid, f in reversed(self.r.xrevrange(self.keys.switch_log, count=count)):
            way = (_s(f.get(b"from")), _s(f.get(b"to")))
            if _s(f.get(b"outcome")) != "done" or way not in (("rollout", "train"), ("train", "rollout")):
                continue  # a first assignment (from idle) or a rollback times something else
            out.append(SwitchSample(to_train=way[1] == "train", seconds=_i(f.get(b"duration_ms")) / 1000))
        return out

    def done_in_step(self, job_id: str, step: int) -> int:
        """Executions of ``step`` that ended (any status)."""
        return _i(self.r.hget(self.keys.job(job_id), f"done:{step}"))

    def report_training(self, job_id: str, step: int, phase: str, weight_version: int,
                        measured: TrainSample | None = None, metrics: Mapping[str, float] | None = None) -> bool:
        """Trainer progress: ``started`` a step's update or ``published`` its weights (with what the
        update ``measured``, kept as ``train:{step}``, and its ``metrics``, on the step_trained event
        as ``trainer.<name>``). False on a repeat."""
        if phase not in ("started", "published"):
            raise InvalidArgument(f"training phase {phase!r} must be 'started' or 'published'")
        if phase == "published" and weight_version != step + 1:
            raise InvalidArgument(
                f"publishing step {step} must produce weight_version {step + 1}, not {weight_version}")
        k = self.keys
        res = self._run("REPORT_TRAINING", [k.job(job_id), k.events(job_id), k.active],
                        [step, phase, weight_version, self.now_ms(), self.event_maxlen, job_id,
                         *((f"{measured.tokens:.0f}", f"{measured.compute_s:.4f}", measured.world_size)
                           if measured else ("0", "0", 0)),
                         *(x for name, value in sorted((metrics or {}).items())
                           for x in (f"trainer.{name}", repr(float(value))))])
        code = res[0]
        if code == -1:
            raise NotFound(f"job {job_id!r} does not exist")
        if code == -2:
            raise FailedPrecondition(f"job {job_id!r} is {_s(res[1])}; it takes no training reports")
        if code == -3:
            raise FailedPrecondition(f"job {job_id!r} is at step {int(res[1])}; step {step} cannot be trained yet")
        if code == -4:
            raise FailedPrecondition(
                f"step {step} of job {job_id!r} has {int(res[1])} of {int(res[2])} executions ended; "
                f"its update cannot be published before all end")
        return code == 1

    # ---------------------------------------------------------------- executions

    def lease(self, job_ids: Sequence[str], harness_id: str, ttl_s: float, *, strict: bool = False,
              request_id: str = "") -> Lease | None:
        """Lease the lowest-step queued execution of the first job in ``job_ids`` that has one.

        ``strict``: raise NotFound for a job that does not exist and FailedPrecondition for one that
        ended (a pending job just has nothing to lease yet). ``request_id``: a retried request gets
        the lease its first attempt took, while that is still leased to ``harness_id``.
        """
        k = self.keys
        if request_id:
            prior = self._prior_lease(request_id, harness_id, ttl_s)
            if prior is not None:
                return prior
        for jid in job_ids:
            token = secrets.token_hex(12)
            now = self.now_ms()
            res = self._run("LEASE", [k.job(jid), k.queue(jid), k.running(jid), k.leases],
                            [k.exec_prefix, now, int(ttl_s * 1000), token, harness_id,
                             k.lease_request(request_id) if request_id else ""])
            if res[0] != 1:
                if strict and res[0] == -1:
                    raise NotFound(f"job {jid!r} does not exist")
                if strict and _s(res[1]) in ("completed", "cancelled", "failed"):
                    raise FailedPrecondition(f"job {jid!r} is {_s(res[1])}; it has no more executions")
                continue
            _, eid, attempt, deadline, expires, step, gid, payload, round_ = res
            return Lease(execution_id=_s(eid), job_id=jid, step=_i(step), group_id=_s(gid),
                         payload=bytes(payload or b""), lease_token=token, attempt=int(attempt),
                         deadline_s=int(deadline) / 1000, lease_ttl_s=ttl_s, lease_expires_s=int(expires) / 1000,
                         evaluation=bool(_s(round_)))
        return None

    def _prior_lease(self, request_id: str, harness_id: str, ttl_s: float) -> Lease | None:
        eid = self.r.get(self.keys.lease_request(request_id))
        if eid is None:
            return None
        h = self.r.hgetall(self.keys.execution(_s(eid)))
        if _s(h.get(b"state")) != "leased" or _holder(h) != harness_id:
            return None  # it ended, expired or went to someone else since: lease afresh
        jid = _s(h.get(b"job_id")) or self._exec_job(_s(eid))
        return Lease(execution_id=_s(eid), job_id=jid, step=_i(h.get(b"step")), group_id=_s(h.get(b"group_id")),
                     payload=bytes(h.get(b"payload") or b""), lease_token=_s(h.get(b"token")),
                     attempt=_i(h.get(b"attempt")), deadline_s=_i(h.get(b"deadline_ms")) / 1000, lease_ttl_s=ttl_s,
                     lease_expires_s=_i(h.get(b"lease_expires_ms")) / 1000, evaluation=bool(_s(h.get(b"eval_round"))))

    def _exec_job(self, execution_id_: str) -> str:
        parsed = job_of_execution(execution_id_)
        if parsed is not None:
            return parsed
        jid = self.r.hget(self.keys.execution(execution_id_), "job_id")
        if jid is None:
            raise NotFound(f"execution {execution_id_!r} does not exist (or ended longer ago than retention)")
        return _s(jid)

    def heartbeat(self, execution_id_: str, token: str, ttl_s: float) -> tuple[float, float, bool]:
        """Extend a lease; returns (deadline_s, lease_expires_s, job_cancelled)."""
        jid = self._exec_job(execution_id_)
        k = self.keys
        res = self._run("HEARTBEAT", [k.execution(execution_id_), k.leases, k.running(jid), k.queue(jid), k.job(jid)],
                        [token, self.now_ms(), int(ttl_s * 1000), execution_id_])
        self._check_exec(res, execution_id_, "heartbeat")
        return int(res[1]) / 1000, int(res[2]) / 1000, bool(res[3])

    def complete(self, execution_id_: str, token: str, status: ExecState, reason: str = "") -> CompleteResult:
        if status not in TERMINAL_EXEC:
            raise InvalidArgument(f"status {status.value!r} is not an end status (finished, timeout or failed)")
        jid = self._exec_job(execution_id_)
        k = self.keys
        res = self._run("COMPLETE", [k.execution(execution_id_), k.leases, k.running(jid), k.queue(jid), k.job(jid),
                                     k.events(jid)],
                        [token, status.value, self.now_ms(), self.retention_ms, self.event_maxlen, execution_id_,
                         reason])
        if res[0] == 2:
            return CompleteResult(ExecState(_s(res[1])), duplicate=True, done_in_step=-1)
        self._check_exec(res, execution_id_, "completion")
        return CompleteResult(status, duplicate=False, done_in_step=int(res[2]))

    @staticmethod
    def _check_exec(res: Any, execution_id_: str, what: str) -> None:
        if res[0] == -1:
            raise NotFound(f"execution {execution_id_!r} does not exist")
        if res[0] in (-2, -3):
            raise FailedPrecondition(
                f"{what} of execution {execution_id_!r} refused: the lease token is not the current one "
                f"(the lease expired and the execution was leased again, or it already ended); state is {_s(res[1])}")

    def reap_expired(self, limit: int = 1000) -> list[tuple[str, str]]:
        """Re-queue expired leases, or end them as timeouts after max_attempts (into the score
        outbox); returns (execution_id, outcome)."""
        k = self.keys
        res = self._run("REAP", [k.leases, k.score_outbox], [self.now_ms(), limit, k.exec_prefix, k.job_prefix,
                                                              self.retention_ms, self.event_maxlen])
        return [(_s(res[i]), _s(res[i + 1])) for i in range(0, len(res), 2)]

    def unscored_timeouts(self, limit: int = 100) -> list[tuple[str, str, int, str]]:
        """Executions whose last lease expired and that the reward service has not scored yet:
        (execution_id, job_id, step, group_id), oldest-first order not guaranteed. An evaluation
        execution's job id is the one it is scored under (``eval_job_id``)."""
        out = []
        for eid, raw in self.r.hscan_iter(self.keys.score_outbox, count=limit):
            info = json.loads(raw)
            job = str(info["job_id"])
            out.append((_s(eid), eval_job_id(job) if info.get("evaluation") else job, int(info["step"]),
                        str(info.get("group_id") or "")))
            if len(out) >= limit:
                break
        return out

    def ack_scored(self, execution_id_: str) -> None:
        """The reward service holds the score of ``execution_id_``: drop it from the outbox."""
        self.r.hdel(self.keys.score_outbox, execution_id_)

    def grace_leases(self, ttl_s: float) -> int:
        """Extend every lease to expire no sooner than ``ttl_s`` from now (after a leader change)."""
        until = self.now_ms() + int(ttl_s * 1000)
        return int(self._run("GRACE_LEASES", [self.keys.leases], [until, self.keys.exec_prefix]))

    def current_lease(self, execution_id_: str, token: str) -> tuple[str, int, bool]:
        """(job_id, attempt, evaluation) of the execution while ``token`` holds its lease; else
        NotFound / FailedPrecondition."""
        st, tok, attempt, jid, round_ = self.r.hmget(self.keys.execution(execution_id_), "state", "token", "attempt",
                                                     "job_id", "eval_round")
        if st is None:
            raise NotFound(f"execution {execution_id_!r} does not exist (or ended longer ago than retention)")
        if _s(st) != "leased" or _s(tok) != token:
            raise FailedPrecondition(f"execution {execution_id_!r} is not leased with this lease token (it ended, "
                                     f"or its lease expired and it was leased again); state is {_s(st)}")
        return _s(jid), _i(attempt), bool(_s(round_))

    def release_harness(self, harness_id: str) -> list[str]:
        """End every lease ``harness_id`` holds now (a restarted harness's predecessor died holding
        them); the reaper re-queues them on its next pass. Returns their execution ids."""
        return [_s(e) for e in self._run("RELEASE_HARNESS", [self.keys.leases],
                                         [self.keys.exec_prefix, harness_id, self.now_ms()])]

    def execution(self, execution_id_: str) -> ExecutionRecord:
        h = self.r.hgetall(self.keys.execution(execution_id_))
        if not h:
            raise NotFound(f"execution {execution_id_!r} does not exist")
        return ExecutionRecord(
            execution_id=execution_id_, job_id=_s(h.get(b"job_id")), step=_i(h.get(b"step")),
            group_id=_s(h.get(b"group_id")), state=ExecState(_s(h.get(b"state"))), attempt=_i(h.get(b"attempt")),
            harness_id=_holder(h), deadline_s=_i(h.get(b"deadline_ms")) / 1000,
            lease_expires_s=_i(h.get(b"lease_expires_ms")) / 1000, reason=_s(h.get(b"reason")))

    # ---------------------------------------------------------------- cells

    def register_cell(self, *, cell_id: str, address: str, host: str, role: CellRole, is_core: bool,
                      kv_capacity_tokens: int, num_accelerators: int = 1, engine_address: str = "",
                      hosts_replica: bool = False) -> bool:
        """Register (or re-register) a cell; True when it is new."""
        if role not in (CellRole.ROLLOUT, CellRole.TRAIN, CellRole.IDLE):
            raise InvalidArgument(f"a cell registers as rollout, train or idle, not {role.value}")
        if is_core and role is not CellRole.TRAIN:
            raise InvalidArgument("the core cell holds the authoritative weights and must register as train")
        res = self._run("REGISTER_CELL", [self.keys.cell(cell_id), self.keys.cells],
                        [cell_id, self.now_ms(), role.value, "address", address, "host", host,
                         "is_core", int(is_core), "kv_capacity_tokens", kv_capacity_tokens,
                         "num_accelerators", num_accelerators, "engine_address", engine_address,
                         "hosts_replica", int(hosts_replica)])
        return bool(res[1])

    def cell_heartbeat(self, cell_id: str, *, inflight: int, kv_used_tokens: int, kv_capacity_tokens: int,
                       weight_version: int, reported_role: CellRole) -> tuple[CellRole, CellRole | None]:
        """Record a cell's load; returns (registry role, pending switch target or None)."""
        res = self._run("CELL_HEARTBEAT", [self.keys.cell(cell_id)],
                        [self.now_ms(), inflight, kv_used_tokens, kv_capacity_tokens, weight_version,
                         reported_role.value])
        if res[0] == -1:
            raise NotFound(f"cell {cell_id!r} is not registered; call RegisterCell first")
        to = _s(res[2])
        return CellRole(_s(res[1])), (CellRole(to) if to else None)

    def cordon_cell(self, cell_id: str, reason: str) -> CellRecord:
        """Cordon (``reason`` non-empty) or uncordon (``""``) a registered cell."""
        res = self._run("CORDON_CELL", [self.keys.cell(cell_id)], [reason])
        if res == -1:
            raise NotFound(f"cell {cell_id!r} is not registered")
        if res == -2:
            raise FailedPrecondition(f"cell {cell_id!r} is the core cell: it always trains and takes no rollout work")
        return self.get_cell(cell_id)

    def deregister_cell(self, cell_id: str) -> CellRole:
        res = self._run("DEREGISTER_CELL", [self.keys.cell(cell_id), self.keys.cells, self.keys.switches], [cell_id])
        if res[0] == -1:
            raise NotFound(f"cell {cell_id!r} is not registered")
        if res[0] == -2:
            raise FailedPrecondition(f"cell {cell_id!r} is switching roles; deregister it after the switch ends")
        return CellRole(_s(res[1]))

    def get_cell(self, cell_id: str) -> CellRecord:
        h = self.r.hgetall(self.keys.cell(cell_id))
        if not h:
            raise NotFound(f"cell {cell_id!r} is not registered")
        return _cell(cell_id, h)

    def list_cells(self, cell_ids: Iterable[str] | None = None) -> list[CellRecord]:
        ids = sorted(_s(c) for c in self.r.smembers(self.keys.cells)) if cell_ids is None else list(cell_ids)
        pipe = self.r.pipeline(transaction=False)
        for cid in ids:
            pipe.hgetall(self.keys.cell(cid))
        return [_cell(cid, h) for cid, h in zip(ids, pipe.execute()) if h]

    # ---------------------------------------------------------------- switches

    def begin_switch(self, *, cell_id: str, from_role: CellRole, to_role: CellRole, job_id: str, reason: str = "",
                     migrate_to: Sequence[str] = ()) -> str:
        """Mark a cell SWITCHING (atomically, iff it holds ``from_role``); returns the switch id."""
        switch_id = secrets.token_hex(8)
        k = self.keys
        res = self._run("BEGIN_SWITCH", [k.cell(cell_id), k.switches, k.events(job_id)],
                        [cell_id, from_role.value, to_role.value, switch_id, self.now_ms(), self.event_maxlen,
                         job_id, reason, ",".join(migrate_to)])
        if res[0] == -1:
            raise NotFound(f"cell {cell_id!r} is not registered")
        if res[0] == -3:
            raise FailedPrecondition(f"cell {cell_id!r} is the core cell; it never leaves training")
        if res[0] == -2:
            raise FailedPrecondition(f"cell {cell_id!r} is {_s(res[1])}, not {from_role.value}; switch not started")
        return switch_id

    def end_switch(self, *, cell_id: str, switch_id: str, job_id: str, done: bool, error: str = "") -> float:
        """Finish (``done``) or roll back a switch; returns its duration in seconds (0 on a repeat)."""
        k = self.keys
        res = self._run("END_SWITCH", [k.cell(cell_id), k.switches, k.events(job_id), k.switch_log],
                        [cell_id, switch_id, self.now_ms(), "done" if done else "rolled_back", self.event_maxlen,
                         error])
        if res[0] == -1:
            raise NotFound(f"cell {cell_id!r} is not registered")
        if res[0] == -2:
            raise FailedPrecondition(f"cell {cell_id!r} has no switch {switch_id!r} in flight")
        return int(res[2]) / 1000 if res[0] == 1 else 0.0

    def pending_switches(self) -> list[CellRecord]:
        ids = [_s(c) for c in self.r.zrange(self.keys.switches, 0, -1)]
        return [c for c in self.list_cells(ids) if c.role is CellRole.SWITCHING]

    def switch_log(self, count: int = 1000) -> list[Event]:
        return [_event(eid, f, "") for eid, f in self.r.xrevrange(self.keys.switch_log, count=count)][::-1]

    # ---------------------------------------------------------------- events, leadership

    def read_events(self, job_id: str, after_id: str = "0-0", *, block_ms: int | None = None,
                    count: int = 256) -> list[Event]:
        """Events after ``after_id`` ("0-0" = from the start); blocks up to ``block_ms`` when none."""
        res = self.r.xread({self.keys.events(job_id): after_id}, count=count, block=block_ms)
        if not res:
            return []
        return [_event(eid, f, job_id) for eid, f in res[0][1]]

    def append_event(self, job_id: str, kind: str, attrs: dict[str, object]) -> str:
        """Log an event the orchestrator observed (e.g. periodic metrics) to the job's stream."""
        fields: dict[str, object] = {"kind": kind, "ts_ms": self.now_ms(), **attrs}
        return _s(self.r.xadd(self.keys.events(job_id), fields, maxlen=self.event_maxlen, approximate=True))

    def leader(self) -> str:
        """Instance id of the orchestrating scheduler ("" when none holds the lead)."""
        return _s(self.r.get(self.keys.leader))

    def acquire_leader(self, instance_id: str, ttl_s: float) -> bool:
        return bool(self._run("ACQUIRE_LEADER", [self.keys.leader], [instance_id, int(ttl_s * 1000)]))

    def release_leader(self, instance_id: str) -> None:
        self._run("RELEASE_LEADER", [self.keys.leader], [instance_id])


def _event(eid: bytes | str, f: dict[Any, Any], job_id: str) -> Event:
    attrs = {_s(k): _s(v) for k, v in f.items()}
    kind = attrs.pop("kind", "")
    ts = _i(attrs.pop("ts_ms", "0")) / 1000
    return Event(event_id=_s(eid), kind=kind, ts_s=ts, job_id=job_id, attrs=attrs)


def _cell(cell_id: str, h: dict[Any, Any]) -> CellRecord:
    def g(name: str) -> bytes | None:
        return h.get(name.encode())

    def role(name: str) -> CellRole | None:
        v = _s(g(name))
        return CellRole(v) if v else None

    return CellRecord(
        cell_id=cell_id, address=_s(g("address")), host=_s(g("host")), role=CellRole(_s(g("role"))),
        is_core=_s(g("is_core")) == "1", kv_capacity_tokens=_i(g("kv_capacity_tokens")),
        kv_used_tokens=_i(g("kv_used_tokens")), inflight=_i(g("inflight")), weight_version=_i(g("weight_version")),
        heartbeat_s=_i(g("heartbeat_ms")) / 1000, registered_s=_i(g("registered_ms")) / 1000,
        reported_role=role("reported_role"), switch_id=_s(g("switch_id")), switch_from=role("switch_from"),
        switch_to=role("switch_to"), switch_started_s=_i(g("switch_started_ms")) / 1000,
        switch_job_id=_s(g("switch_job_id")),
        switch_migrate_to=tuple(t for t in _s(g("switch_migrate_to")).split(",") if t),
        last_switch_s=_i(g("last_switch_ms")) / 1000,
        num_accelerators=_i(g("num_accelerators"), 1), engine_address=_s(g("engine_address")),
        hosts_replica=bool(_i(g("hosts_replica"))), cordon_reason=_s(g("cordon_reason")),
    )
