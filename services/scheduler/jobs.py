"""Scheduler domain types: job specs, job/execution/cell records, leases and events.

Pure data with validation, no I/O: ``state.py`` stores these in Redis, ``servicer.py`` converts
them to and from protos. Invariants live here, where the types are defined:

* a ``JobSpec`` is valid by construction (``__post_init__`` raises ``ValueError`` with one
  sentence naming the field), so everything downstream can trust it;
* a step has ``groups_per_step * group_size`` executions; each group runs one task payload
  ``group_size`` times (GRPO-style groups);
* a step's rollouts may start once ``weight_version >= step - staleness_bound``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from services.scheduler.policy import Mode, PolicyParams, Role

ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
MAX_STEP_SIZE = 100_000
MAX_STEPS = 1_000_000
MAX_PAYLOAD_BYTES = 64 * 1024  # task payloads are references/small specs; large data goes to the spool
MAX_TIMEOUT_S = 30 * 24 * 3600.0


class TimeoutPolicy(str, Enum):
    """How a timed-out execution is scored (applied by the reward service)."""

    PARTIAL = "partial"  # scored partially from its preserved workspace
    ZERO = "zero"  # reward 0
    EXCLUDE = "exclude"  # left out of training


class JobState(str, Enum):
    PENDING = "pending"  # admitted when its cells are free
    RUNNING = "running"
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (JobState.COMPLETED, JobState.CANCELLED, JobState.FAILED)


class ExecState(str, Enum):
    QUEUED = "queued"
    LEASED = "leased"
    FINISHED = "finished"
    TIMEOUT = "timeout"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self not in (ExecState.QUEUED, ExecState.LEASED)


class EventKind(str, Enum):
    """Kinds of entries in a job's event log (``WatchJob`` streams them in order)."""

    JOB_SUBMITTED = "job_submitted"
    JOB_STATE = "job_state"  # attrs: state, message
    STEP_STARTED = "step_started"  # a step's executions were enqueued; attrs: step, executions
    EXECUTION_COMPLETED = "execution_completed"  # attrs: execution_id, step, group_id, status, attempt
    EXECUTION_REQUEUED = "execution_requeued"  # lease expired; attrs: execution_id, attempt
    GROUP_DONE = "group_done"  # all executions of a group ended; attrs: step, group_id
    STEP_ROLLOUTS_DONE = "step_rollouts_done"  # attrs: step
    TRAINING_STARTED = "training_started"  # attrs: step
    STEP_TRAINED = "step_trained"  # update published; attrs: step, weight_version
    SWITCH_STARTED = "switch_started"  # attrs: cell_id, from, to, switch_id, reason
    SWITCH_FINISHED = "switch_finished"  # attrs: cell_id, from, to, switch_id, duration_ms, outcome, error
    SWITCH_ROLLED_BACK = "switch_rolled_back"  # attrs: cell_id, from, to, switch_id, duration_s, error
    METRICS = "metrics"  # periodic snapshot: queued, running, done_in_step, rollout_cells, train_cells


def check_id(value: str, what: str) -> str:
    """Validate an id used in Redis key names; returns it."""
    if not ID_RE.match(value):
        raise ValueError(
            f"{what} {value!r} is invalid; use 1-64 characters from A-Z a-z 0-9 _ - starting with a letter or digit"
        )
    return value


@dataclass(frozen=True, kw_only=True)
class TaskSource:
    """Where a job's tasks come from: explicit payloads (cycled over groups) or a named generator.

    ``generator`` names an entry of ``tasks.TASK_GENERATORS`` (or ``module:function``); ``params``
    are passed to it verbatim. Exactly one of ``payloads`` / ``generator`` is set.
    """

    payloads: tuple[bytes, ...] = ()
    generator: str = ""
    params: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if bool(self.payloads) == bool(self.generator):
            raise ValueError("task source needs exactly one of: explicit task payloads, or a generator name")
        for i, p in enumerate(self.payloads):
            if len(p) > MAX_PAYLOAD_BYTES:
                raise ValueError(
                    f"task payload {i} is {len(p)} bytes; at most {MAX_PAYLOAD_BYTES} (put large data in the blob spool)"
                )


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """A validated RL job. ``job_id`` is filled in by the scheduler when the client leaves it empty."""

    job_id: str
    model: str
    tasks: TaskSource
    num_steps: int
    groups_per_step: int
    group_size: int
    mode: Mode
    staleness_bound: int = 0
    timeout_policy: TimeoutPolicy = TimeoutPolicy.PARTIAL
    execution_timeout_s: float = 3600.0
    cell_ids: tuple[str, ...] = ()  # empty: every registered cell
    algorithm: tuple[tuple[str, str], ...] = ()  # opaque to the scheduler; passed to the trainer
    max_attempts: int = 3  # leases that may expire before the execution is marked failed
    # policy knobs (see ``policy.PolicyParams``)
    async_rollout_cells: int | None = None
    min_rollout_cells: int = 1
    consolidate_threshold: float = 1.0
    execution_kv_tokens: int | None = None
    rollout_batches: bool = False

    def __post_init__(self) -> None:
        check_id(self.job_id, "job_id")
        if not self.model.strip():
            raise ValueError("model must name the model to train (e.g. a path or hub id)")
        if not 1 <= self.num_steps <= MAX_STEPS:
            raise ValueError(f"num_steps is {self.num_steps}; expected 1..{MAX_STEPS}")
        if self.groups_per_step < 1 or self.group_size < 1:
            raise ValueError(
                f"groups_per_step ({self.groups_per_step}) and group_size ({self.group_size}) must both be >= 1"
            )
        if self.step_size > MAX_STEP_SIZE:
            raise ValueError(
                f"a step of {self.groups_per_step} x {self.group_size} = {self.step_size} executions exceeds {MAX_STEP_SIZE}"
            )
        if not isinstance(self.mode, Mode):
            raise ValueError(f"mode is {self.mode!r}; expected colocate, async or elastic")
        if not isinstance(self.timeout_policy, TimeoutPolicy):
            raise ValueError(f"timeout_policy is {self.timeout_policy!r}; expected partial, zero or exclude")
        if not 0 <= self.staleness_bound <= 16:
            raise ValueError(f"staleness_bound is {self.staleness_bound}; expected 0..16 weight versions")
        if self.mode is Mode.COLOCATE and self.staleness_bound != 0:
            raise ValueError(
                "staleness_bound must be 0 in colocate mode: the whole pool trains between steps, "
                "so no rollout can overlap an update"
            )
        if not 0 < self.execution_timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(f"execution_timeout_s is {self.execution_timeout_s}; expected in (0, {MAX_TIMEOUT_S:.0f}]")
        if not 1 <= self.max_attempts <= 100:
            raise ValueError(f"max_attempts is {self.max_attempts}; expected 1..100")
        if len(set(self.cell_ids)) != len(self.cell_ids):
            raise ValueError("cell_ids lists a cell more than once")
        for cid in self.cell_ids:
            check_id(cid, "cell id")
        for key, _ in self.algorithm:
            if not key:
                raise ValueError("algorithm parameter names must be non-empty")
        self.policy_params()  # the policy validates its own knobs

    def policy_params(self) -> PolicyParams:
        return PolicyParams(mode=self.mode, staleness_bound=self.staleness_bound,
                            async_rollout_cells=self.async_rollout_cells, min_rollout_cells=self.min_rollout_cells,
                            consolidate_threshold=self.consolidate_threshold,
                            execution_kv_tokens=self.execution_kv_tokens, rollout_batches=self.rollout_batches)

    @property
    def step_size(self) -> int:
        """Executions per step."""
        return self.groups_per_step * self.group_size

    def to_json(self) -> str:
        return json.dumps(
            {
                "job_id": self.job_id,
                "model": self.model,
                "tasks": {
                    "payloads": [p.hex() for p in self.tasks.payloads],
                    "generator": self.tasks.generator,
                    "params": [list(kv) for kv in self.tasks.params],
                },
                "num_steps": self.num_steps,
                "groups_per_step": self.groups_per_step,
                "group_size": self.group_size,
                "mode": self.mode.value,
                "staleness_bound": self.staleness_bound,
                "timeout_policy": self.timeout_policy.value,
                "execution_timeout_s": self.execution_timeout_s,
                "cell_ids": list(self.cell_ids),
                "algorithm": [list(kv) for kv in self.algorithm],
                "max_attempts": self.max_attempts,
                "async_rollout_cells": self.async_rollout_cells,
                "min_rollout_cells": self.min_rollout_cells,
                "consolidate_threshold": self.consolidate_threshold,
                "execution_kv_tokens": self.execution_kv_tokens,
                "rollout_batches": self.rollout_batches,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, raw: str | bytes) -> JobSpec:
        d = json.loads(raw)
        t = d["tasks"]
        return cls(
            job_id=d["job_id"],
            model=d["model"],
            tasks=TaskSource(
                payloads=tuple(bytes.fromhex(p) for p in t["payloads"]),
                generator=t["generator"],
                params=tuple((k, v) for k, v in t["params"]),
            ),
            num_steps=d["num_steps"],
            groups_per_step=d["groups_per_step"],
            group_size=d["group_size"],
            mode=Mode(d["mode"]),
            staleness_bound=d["staleness_bound"],
            timeout_policy=TimeoutPolicy(d["timeout_policy"]),
            execution_timeout_s=d["execution_timeout_s"],
            cell_ids=tuple(d["cell_ids"]),
            algorithm=tuple((k, v) for k, v in d["algorithm"]),
            max_attempts=d["max_attempts"],
            async_rollout_cells=d["async_rollout_cells"],
            min_rollout_cells=d["min_rollout_cells"],
            consolidate_threshold=d["consolidate_threshold"],
            execution_kv_tokens=d["execution_kv_tokens"],
            rollout_batches=d.get("rollout_batches", False),
        )


@dataclass(frozen=True)
class JobStatus:
    """A job's spec plus its progress, as stored in Redis."""

    spec: JobSpec
    state: JobState
    created_s: float
    updated_s: float
    current_step: int  # oldest step whose update is not yet published
    weight_version: int  # published weight versions (0 = initial weights)
    enqueued_steps: int  # steps 0..enqueued_steps-1 have their executions enqueued
    training_step: int  # step the trainer reported as training, or -1
    done_in_step: int  # executions of current_step that ended (any status)
    groups_done_in_step: int  # groups of current_step whose executions all ended
    queued: int
    running: int
    totals: Mapping[str, int] = field(default_factory=dict)  # finished/timeout/failed/requeued counts
    message: str = ""

    @property
    def job_id(self) -> str:
        return self.spec.job_id


@dataclass(frozen=True)
class Lease:
    """An execution handed to a harness; valid while heartbeats arrive within ``lease_ttl_s``."""

    execution_id: str
    job_id: str
    step: int
    group_id: str
    payload: bytes
    lease_token: str
    attempt: int  # 1 on first lease; the fencing epoch
    deadline_s: float  # the harness must end the execution (as timeout if need be) by then
    lease_ttl_s: float
    lease_expires_s: float


@dataclass(frozen=True)
class ExecutionRecord:
    execution_id: str
    job_id: str
    step: int
    group_id: str
    state: ExecState
    attempt: int
    worker_id: str
    deadline_s: float
    lease_expires_s: float
    reason: str


@dataclass(frozen=True)
class CellRecord:
    """A registered cell. ``role`` is SWITCHING while a switch is in flight (``switch_*`` set)."""

    cell_id: str
    address: str
    host: str
    role: Role
    is_core: bool
    kv_capacity_tokens: int
    kv_used_tokens: int
    inflight: int
    weight_version: int
    heartbeat_s: float
    registered_s: float
    reported_role: Role | None = None  # what the cell itself last said it runs
    switch_id: str = ""
    switch_from: Role | None = None
    switch_to: Role | None = None
    switch_started_s: float = 0.0
    switch_job_id: str = ""
    switch_migrate_to: tuple[str, ...] = ()  # rollout cells receiving its in-flight executions
    last_switch_s: float = 0.0  # duration of the last completed switch
    num_accelerators: int = 1


@dataclass(frozen=True)
class Event:
    """One entry of a job's event log (a Redis stream): ``kind`` plus flat string attributes."""

    event_id: str
    kind: str
    ts_s: float
    job_id: str
    attrs: Mapping[str, str]

    def attr_int(self, name: str, default: int = -1) -> int:
        v = self.attrs.get(name)
        return int(v) if v else default


def spec_dict(spec: JobSpec) -> dict[str, Any]:
    """The spec as plain JSON-able data (for logs and the CLI)."""
    return json.loads(spec.to_json())
