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
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any

from services.algorithm import Algorithm
from services.scheduler.policy import Mode, PolicyParams
from services.common.roles import CellRole

ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
MAX_STEP_SIZE = 100_000
MAX_STEPS = 1_000_000
MAX_PAYLOAD_BYTES = 64 * 1024  # task payloads are references/small specs; large data goes to the spool
MAX_TIMEOUT_S = 30 * 24 * 3600.0
MAX_SHARDS = 64  # ranks of one trainer group (a cell's devices)
SCORER_KINDS = ("builtin", "entry_point", "external")
MAX_JOB_ID = 59  # room for the "-eval" suffix evaluation executions are recorded under


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
    MIGRATION = "migration"  # a drain moved in-flight requests; attrs: cell_id, migrated, transports, targets
    SWITCH_PHASES = "switch_phases"  # where a switch's time went; attrs: cell_id, switch_id, from, to, phases (JSON s)
    ENGINE_MODEL = "engine_model"  # an engine loaded the job's model; attrs: engine, model, model_name
    JOB_PREPARED = "job_prepared"  # the controller configured reward and started the trainer; attrs: scorer, engines
    EVALUATION_STARTED = "evaluation_started"  # a held-out round was enqueued; attrs: round, after_step, tasks
    EVALUATION = "evaluation"  # a round was scored; attrs: round, after_step, pass_rate, mean_reward, statuses
    CONTROLLER_ERROR = "controller_error"  # a lifecycle step failed and is retried; attrs: stage, error


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


HARNESSES = ("builtin", "external")


@dataclass(frozen=True, kw_only=True)
class Evaluation:
    """Held-out evaluation the scheduler runs for the job (``[job.evaluation]``).

    Rounds run after 0, ``every``, 2 x ``every``, ... published steps and after the last one; each
    round enqueues ``tasks`` held-out executions of the job's task family (split "heldout") that
    any harness leases like rollouts, greedy when ``greedy``; they are scored by the job's scorer
    and never trained on. The job completes after its last round.
    """

    tasks: int = 0
    """Held-out executions per round (0: no evaluation)."""
    every: int = 0
    """Evaluate after every this many published steps (0: only before the first and after the last)."""
    greedy: bool = True
    """Greedy decoding (temperature 0) for evaluation executions."""

    def __post_init__(self) -> None:
        if not 0 <= self.tasks <= 10_000:
            raise ValueError(f"evaluation.tasks is {self.tasks}; expected 0..10000")
        if self.every < 0:
            raise ValueError(f"evaluation.every is {self.every}; expected >= 0")

    def after_steps(self, num_steps: int) -> tuple[int, ...]:
        """Published-step counts after which a round runs (empty without evaluation)."""
        if self.tasks == 0:
            return ()
        marks = set(range(0, num_steps, self.every)) if self.every else {0}
        return tuple(sorted(marks | {num_steps}))


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """A validated RL job: all a client sends (``SubmitJob``; ``[job]`` of a TOML job file).

    ``job_id`` is filled in by the scheduler when the client leaves it empty. The TOML file, the
    proto message and this class share one schema: the same field names, nested the same way.
    """

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
    algorithm: Algorithm = field(default_factory=Algorithm)
    evaluation: Evaluation = field(default_factory=Evaluation)
    scorer: str = ""  # "builtin:NAME", "entry_point:module:function", "external:host:port"; "": the family's
    harness: str = "builtin"  # who runs the executions: the built-in harness, or an external one
    seed: int = 0  # seed of sampling and training (tasks are seeded by the task source's params)
    shards: int = 1  # ranks of the trainer group sharding the policy (FSDP2); replica groups take this shape
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
        if not isinstance(self.algorithm, Algorithm) or not isinstance(self.evaluation, Evaluation):
            raise ValueError("algorithm and evaluation must be sections (tables), not values")
        if self.harness not in HARNESSES:
            raise ValueError(f"harness is {self.harness!r}; expected {' or '.join(HARNESSES)}")
        if self.scorer:
            kind, sep, target = self.scorer.partition(":")
            if not sep or kind not in SCORER_KINDS or not target:
                raise ValueError(f"scorer is {self.scorer!r}; expected builtin:NAME, entry_point:module:function "
                                 "or external:host:port (or empty for the task family's own scorer)")
        if not 0 <= self.seed < 2**63:
            raise ValueError(f"seed is {self.seed}; expected 0 .. 2^63-1")
        if not 1 <= self.shards <= MAX_SHARDS:
            raise ValueError(f"shards is {self.shards}; expected 1..{MAX_SHARDS} trainer ranks (1: one process holds "
                             f"the whole model)")
        if self.shards > 1 and self.algorithm.kl_reference == "initial" and self.algorithm.kl_coef > 0:
            raise ValueError("a KL penalty to the initial policy needs its whole frozen copy in every trainer rank, "
                             "which a sharded trainer (shards > 1) does not keep: use kl_reference = 'behaviour', "
                             "or shards = 1")
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

    def to_dict(self) -> dict[str, Any]:
        """Plain data in the shared schema (TOML [job], JSON in Redis)."""
        d: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        d["tasks"] = {"payloads": [p.hex() for p in self.tasks.payloads], "generator": self.tasks.generator,
                      "params": dict(self.tasks.params)}
        d["mode"] = self.mode.value
        d["timeout_policy"] = self.timeout_policy.value
        d["cell_ids"] = list(self.cell_ids)
        d["algorithm"] = asdict(self.algorithm)
        d["evaluation"] = asdict(self.evaluation)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> JobSpec:
        """Build from the shared schema; unknown or mistyped fields raise ValueError (one sentence).

        ``tasks`` accepts {"generator": NAME, "params": {...}} or {"payloads": [hex, ...]}.
        """
        d = dict(d)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown job field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        t = d.get("tasks")
        if isinstance(t, Mapping):
            extra = sorted(set(t) - {"payloads", "generator", "params"})
            if extra:
                raise ValueError(f"unknown tasks field(s) {', '.join(extra)}; known: generator, params, payloads")
            params = t.get("params") or {}
            if not isinstance(params, Mapping):
                raise ValueError("tasks.params must be a table of name = value")
            try:
                payloads = tuple(bytes.fromhex(p) for p in t.get("payloads") or ())
            except (TypeError, ValueError):
                raise ValueError("tasks.payloads must be hex strings") from None
            d["tasks"] = TaskSource(payloads=payloads, generator=str(t.get("generator") or ""),
                                    params=tuple(sorted((str(k), str(v)) for k, v in params.items())))
        elif not isinstance(t, TaskSource):
            raise ValueError("tasks is required: a table with generator = NAME (and params), or payloads")
        for name, section in (("algorithm", Algorithm), ("evaluation", Evaluation)):
            v = d.get(name)
            if v is None or isinstance(v, section):
                continue
            if not isinstance(v, Mapping):
                raise ValueError(f"{name} must be a table")
            d[name] = _section(section, v, name)
        try:
            if "mode" in d and not isinstance(d["mode"], Mode):
                d["mode"] = Mode(d["mode"])
        except ValueError:
            raise ValueError(f"mode is {d['mode']!r}; expected colocate, async or elastic") from None
        try:
            if "timeout_policy" in d and not isinstance(d["timeout_policy"], TimeoutPolicy):
                d["timeout_policy"] = TimeoutPolicy(d["timeout_policy"])
        except ValueError:
            raise ValueError(f"timeout_policy is {d['timeout_policy']!r}; expected partial, zero or exclude") from None
        if "cell_ids" in d:
            d["cell_ids"] = tuple(d["cell_ids"])
        _check_types(cls, d, "")
        missing = [n for n in ("job_id", "model", "num_steps", "groups_per_step", "group_size", "mode") if n not in d]
        if missing:
            raise ValueError(f"job field(s) {', '.join(missing)} are required")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> JobSpec:
        return cls.from_dict(json.loads(raw))


_NUMBER = (int, float)


def _check_types(cls: type, d: Mapping[str, Any], prefix: str) -> None:
    """Refuse values of the wrong type with the field's name (TOML/JSON give str/int/float/bool)."""
    hints = {f.name: f.type for f in fields(cls)}
    for name, value in d.items():
        hint = str(hints.get(name, ""))
        if value is None:
            if "None" not in hint:
                raise ValueError(f"{prefix}{name} must be set (got nothing)")
            continue
        ok = True
        if hint.startswith("int"):
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif hint.startswith("float"):
            ok = isinstance(value, _NUMBER) and not isinstance(value, bool)
        elif hint == "bool":
            ok = isinstance(value, bool)
        elif hint == "str":
            ok = isinstance(value, str)
        if not ok:
            raise ValueError(f"{prefix}{name} is {value!r}; expected {hint.split(' ')[0]}")


def _section(cls: type[Any], values: Mapping[str, Any], name: str) -> Any:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"unknown {name} field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    _check_types(cls, values, f"{name}.")
    floats = {f.name for f in fields(cls) if str(f.type).startswith("float")}
    return cls(**{k: float(v) if k in floats else v for k, v in values.items()})


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
    evaluation: bool = False  # a held-out evaluation execution: never trained on
    greedy: bool = False  # decode greedily (evaluation executions of a greedy evaluation)
    record_job_id: str = ""  # job id its model calls and score are recorded under ("" = job_id)
    temperature: float | None = None  # the job's sampling temperature (0: greedy); None: the harness's own
    model: str = ""  # the model the job trains (name or checkpoint dir; the engines serve it)
    session_token: str = ""  # the main agent's session (see services/scheduler/sessions.py)
    session_base_url: str = ""  # http://GATEWAY/s/<token>/v1 ("" while no gateway published its endpoint)


def eval_job_id(job_id: str) -> str:
    """The job id evaluation executions record their calls and scores under (kept out of training)."""
    return f"{job_id}-eval"


@dataclass(frozen=True)
class ExecutionRecord:
    execution_id: str
    job_id: str
    step: int
    group_id: str
    state: ExecState
    attempt: int
    harness_id: str
    deadline_s: float
    lease_expires_s: float
    reason: str


@dataclass(frozen=True)
class CellRecord:
    """A registered cell. ``role`` is SWITCHING while a switch is in flight (``switch_*`` set)."""

    cell_id: str
    address: str
    host: str
    role: CellRole
    is_core: bool
    kv_capacity_tokens: int
    kv_used_tokens: int
    inflight: int
    weight_version: int
    heartbeat_s: float
    registered_s: float
    reported_role: CellRole | None = None  # what the cell itself last said it runs
    switch_id: str = ""
    switch_from: CellRole | None = None
    switch_to: CellRole | None = None
    switch_started_s: float = 0.0
    switch_job_id: str = ""
    switch_migrate_to: tuple[str, ...] = ()  # rollout cells receiving its in-flight executions
    last_switch_s: float = 0.0  # duration of the last completed switch
    num_accelerators: int = 1
    engine_address: str = ""  # the cell's rollout Engine (weights are published to it)
    hosts_replica: bool = False  # its agent runs the trainer replica on the cell's host
    cordon_reason: str = ""  # non-empty: an operator cordoned it (no rollout work)

    @property
    def cordoned(self) -> bool:
        return bool(self.cordon_reason)


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


def lease_temperature(evaluation: bool, job: JobSpec) -> float:
    """An execution's sampling temperature: 0 for a greedy evaluation, else the job's."""
    return 0.0 if evaluation and job.evaluation.greedy else job.algorithm.temperature
