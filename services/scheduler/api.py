"""The scheduler's request handling, free of gRPC: what each RPC does to the Redis state.

``servicer.py`` converts protos to the domain types and calls ``SchedulerApi``; errors raised here
(``services.common.errors`` or ``ValueError``) become gRPC statuses in the server interceptor.
Every method validates its input first, so a bad request never reaches Redis.
"""

from __future__ import annotations

import dataclasses
import math
import re
import secrets
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import Counter

from services.common.errors import InvalidArgument
from services.common.logging import get_logger
from services.common.metrics import REGISTRY
from services.common.roles import AGENT_ROLES
from services.common.roles import CellRole
from services.scheduler.costs import TrainSample
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
    lease_temperature,
    HARNESSES,
    MAX_JOB_ID,
    check_id,
)
from services.scheduler.sessions import Sessions, session_base_url
from services.scheduler.state import CompleteResult, SchedulerState
from services.scheduler.tasks import heldout_payloads, validate_task_source

log = get_logger(__name__)

LEASES = Counter("gyre_scheduler_leases_total", "Executions leased to harnesses.", registry=REGISTRY)
COMPLETIONS = Counter("gyre_scheduler_completions_total", "Executions completed, by status (duplicates apart).",
                      ["status"], registry=REGISTRY)
RELEASED = Counter("gyre_scheduler_released_leases_total",
                   "Leases given up by a restarted harness (ReleaseHarness) rather than left to expire.",
                   registry=REGISTRY)

EVENT_ID_RE = re.compile(r"^\d{1,20}-\d{1,20}$")
MAX_WAIT_S = 60.0
MAX_PAGE = 1000


def check_submittable(spec: JobSpec) -> None:
    """Everything a job names must exist before anything is written: its task source, its held-out
    tasks (when it is evaluated), its scorer and its model. Raises InvalidArgument (one sentence)."""
    try:
        validate_task_source(spec)
        if spec.evaluation.tasks:
            heldout_payloads(spec.tasks.generator, dict(spec.tasks.params), 1)
        if spec.scorer:
            from services.scheduler.controller import scorer_spec

            scorer_spec(spec.scorer)
        from services.models.source import check_model

        check_model(spec.model)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None
    if len(spec.job_id) > MAX_JOB_ID:
        raise InvalidArgument(f"job_id {spec.job_id!r} is longer than {MAX_JOB_ID} characters (its evaluation "
                              f"executions are recorded under job_id + '-eval')")


@dataclass(frozen=True)
class CellInfo:
    cell: CellRecord
    heartbeat_age_s: float
    alive: bool


def _require(value: str, what: str, max_len: int = 256) -> str:
    if not value:
        raise InvalidArgument(f"{what} is required")
    if len(value) > max_len:
        raise InvalidArgument(f"{what} is longer than {max_len} characters")
    return value


class SchedulerApi:
    """Jobs, leases and cells over ``SchedulerState``. Stateless itself: any number may serve one Redis."""

    def __init__(self, state: SchedulerState, *, lease_ttl_s: float, cell_dead_after_s: float,
                 poll_s: float = 0.05, sleep: Callable[[float], None] = time.sleep) -> None:
        self.state = state
        self.lease_ttl_s = lease_ttl_s
        self.cell_dead_after_s = cell_dead_after_s
        self.poll_s = poll_s
        self.sleep = sleep
        self._specs: dict[str, JobSpec] = {}  # specs never change: cache them for lease responses
        self.sessions = Sessions(state.r, state.keys.namespace)
        # called with the job before its last step's update is published (every rollout ended):
        # the orchestrator's last 'metrics' event, so the job's log ends with its whole usage
        self.before_last_publish: Callable[[JobStatus], None] | None = None

    def job_spec(self, job_id: str) -> JobSpec:
        spec = self._specs.get(job_id)
        if spec is None:
            spec = self.get_job(job_id).spec
            if len(self._specs) > 10_000:
                self._specs.clear()
            self._specs[job_id] = spec
        return spec

    # ---------------------------------------------------------------- jobs

    def new_job_id(self) -> str:
        return time.strftime("job-%Y%m%d-%H%M%S-", time.gmtime(self.state.clock())) + secrets.token_hex(3)

    def submit_job(self, spec: JobSpec) -> JobStatus:
        check_submittable(spec)
        job = self.state.submit_job(spec)
        log.info("job submitted", job_id=spec.job_id, mode=spec.mode.value, steps=spec.num_steps,
                 step_size=spec.step_size)
        return job

    def get_job(self, job_id: str) -> JobStatus:
        return self.state.get_job(check_id(_require(job_id, "job_id"), "job_id"))

    def list_jobs(self, states: Iterable[JobState], page_size: int, page_token: str) -> tuple[list[JobStatus], str]:
        if not 0 <= page_size <= MAX_PAGE:
            raise InvalidArgument(f"page_size is {page_size}; expected 0..{MAX_PAGE} (0: 100)")
        limit = page_size or 100
        if page_token and not page_token.isdigit():
            raise InvalidArgument(f"page_token {page_token[:40]!r} is not one this scheduler issued")
        offset = int(page_token or 0)
        wanted = list(states)
        if wanted:
            # filtered pages: the token is an index offset, so scan and remember where we stopped
            jobs, stop = self._scan_filtered(set(wanted), offset, limit)
            return jobs, (str(stop) if stop is not None else "")
        jobs = self.state.list_jobs(offset=offset, limit=limit + 1)
        more = len(jobs) > limit
        return jobs[:limit], (str(offset + limit) if more else "")

    def _scan_filtered(self, wanted: set[JobState], offset: int, limit: int) -> tuple[list[JobStatus], int | None]:
        out: list[JobStatus] = []
        pos = offset
        while True:
            batch = self.state.list_jobs(offset=pos, limit=200)
            if not batch:
                return out, None
            for i, job in enumerate(batch):
                if job.state in wanted:
                    if len(out) == limit:
                        return out, pos + i
                    out.append(job)
            pos += len(batch)

    def cancel_job(self, job_id: str, reason: str) -> tuple[JobStatus, int]:
        self.get_job(job_id)
        dropped = self.state.cancel_job(job_id, reason or "cancelled by client")
        log.info("job cancelled", job_id=job_id, dropped_queued=dropped)
        return self.state.get_job(job_id), dropped

    def watch(self, job_id: str, after_event_id: str, follow: bool, active: Callable[[], bool]) -> Iterator[Event]:
        """The job's events after ``after_event_id``; with ``follow`` until the job ended."""
        self.get_job(job_id)
        if after_event_id and not EVENT_ID_RE.match(after_event_id):
            raise InvalidArgument(f"after_event_id {after_event_id[:40]!r} is not an event id like '1700000000000-0'")
        last = after_event_id or "0-0"
        while active():
            events = self.state.read_events(job_id, last, block_ms=500 if follow else None)
            for e in events:
                yield e
                last = e.event_id
            if events:
                continue
            if not follow or self.state.get_job(job_id).state.terminal:
                for e in self.state.read_events(job_id, last, count=10_000):  # logged while we checked
                    yield e
                return

    def report_training(self, job_id: str, step: int, phase: str, weight_version: int, *,
                        trained_tokens: float = 0.0, compute_s: float = 0.0, world_size: int = 0,
                        metrics: Mapping[str, float] | None = None) -> tuple[JobStatus, bool]:
        job = self.get_job(job_id)
        figures = _step_metrics(metrics or {})
        if step < 0:
            raise InvalidArgument(f"step is {step}; expected >= 0")
        if not (math.isfinite(trained_tokens) and math.isfinite(compute_s)) or min(trained_tokens, compute_s) < 0:
            raise InvalidArgument("trained_tokens and compute_s must be finite and >= 0")
        if world_size < 0:
            raise InvalidArgument(f"world_size is {world_size}; expected >= 0 (0: not measured)")
        measured = (TrainSample(step=step, tokens=trained_tokens, compute_s=compute_s, world_size=world_size)
                    if phase == "published" and trained_tokens > 0 and compute_s > 0 and world_size > 0 else None)
        if (phase == "published" and step + 1 == job.spec.num_steps and job.current_step == step
                and job.state is JobState.RUNNING and self.before_last_publish is not None):
            self.before_last_publish(job)
        applied = self.state.report_training(job_id, step, phase, weight_version, measured,
                                             figures if phase == "published" else None)
        log.info("training reported", job_id=job_id, step=step, phase=phase, weight_version=weight_version,
                 duplicate=not applied)
        return self.state.get_job(job_id), not applied

    def get_execution(self, execution_id: str) -> ExecutionRecord:
        return self.state.execution(_require(execution_id, "execution_id"))

    # ---------------------------------------------------------------- harness API

    def lease(self, harness_id: str, job_id: str, wait_s: float, *, harness: str = "",
              request_id: str = "") -> Lease | None:
        """Lease an execution (of ``job_id``, or of any running job run by ``harness`` harnesses),
        waiting up to ``wait_s``."""
        _require(harness_id, "harness_id")
        if not 0 <= wait_s <= MAX_WAIT_S:
            raise InvalidArgument(f"wait_s is {wait_s}; expected 0..{MAX_WAIT_S:.0f} seconds")
        if job_id:
            check_id(job_id, "job_id")
        if len(request_id) > 128:
            raise InvalidArgument("request_id is longer than 128 characters")
        if harness and harness not in HARNESSES:
            raise InvalidArgument(f"harness is {harness!r}; expected {' or '.join(HARNESSES)} (or empty: any job)")
        deadline = time.monotonic() + wait_s
        pause = self.poll_s
        while True:
            if job_id:
                candidates = [job_id]
            else:
                candidates = self.state.active_job_ids()
                if harness:
                    candidates = [j for j, h in zip(candidates, self.state.job_harnesses(candidates)) if h == harness]
            lease = self.state.lease(candidates, harness_id, self.lease_ttl_s, strict=bool(job_id),
                                     request_id=request_id)
            if lease is not None:
                lease = self._with_session(lease)
                LEASES.inc()
                log.debug("leased", job_id=lease.job_id, execution_id=lease.execution_id, attempt=lease.attempt,
                          harness_id=harness_id)
                return lease
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.sleep(min(pause, left))
            pause = min(pause * 2, 0.5)

    def _with_session(self, lease: Lease) -> Lease:
        """The lease with its main agent's session (token and base URL)."""
        token, url = self._mint(lease.job_id, lease.evaluation, lease.execution_id, "main", "main", lease.attempt,
                                lease.deadline_s)
        return dataclasses.replace(lease, session_token=token, session_base_url=url)

    def _mint(self, job_id: str, evaluation: bool, execution_id: str, agent_id: str, role: str, attempt: int,
              deadline_s: float) -> tuple[str, str]:
        """A session of one agent of a leased execution, live until a minute past its deadline, with
        the execution's temperature (what a call that sends none samples at: a CLI such as Claude
        Code has no temperature setting, and a greedy evaluation must still be greedy):
        (token, base URL; "" while no gateway published its endpoint)."""
        token = self.sessions.mint(job_id=eval_job_id(job_id) if evaluation else job_id, execution_id=execution_id,
                                   agent_id=agent_id, role=role, attempt=attempt,
                                   ttl_s=deadline_s - self.state.clock() + 60,
                                   temperature=lease_temperature(evaluation, self.job_spec(job_id)))
        base = self.sessions.http_url()
        return token, session_base_url(base, token) if base else ""

    def mint_session(self, execution_id: str, lease_token: str, agent_id: str, role: str) -> tuple[str, str]:
        """Another agent's session of a leased execution: (token, base URL)."""
        _require(execution_id, "execution_id")
        _require(lease_token, "lease_token")
        _require(agent_id, "agent_id", 128)
        if role not in AGENT_ROLES:
            raise InvalidArgument(f"role is {role!r}; expected one of {', '.join(AGENT_ROLES)}")
        job_id, attempt, evaluation = self.state.current_lease(execution_id, lease_token)
        minted = self._mint(job_id, evaluation, execution_id, agent_id, role, attempt,
                            self.state.execution(execution_id).deadline_s)
        log.info("session minted", execution_id=execution_id, agent_id=agent_id, role=role)
        return minted

    def release_harness(self, harness_id: str, reason: str = "") -> list[str]:
        """A harness (re)starting under ``harness_id`` gives up every lease that id holds: its
        predecessor died holding them, so they run again now instead of after their lease TTL."""
        _require(harness_id, "harness_id")
        if len(reason) > 4096:
            raise InvalidArgument("reason is longer than 4096 characters")
        released = self.state.release_harness(harness_id)
        if released:
            RELEASED.inc(len(released))
            log.info("harness leases released", harness_id=harness_id, executions=released, reason=reason)
        return released

    def heartbeat(self, execution_id: str, lease_token: str) -> tuple[float, float, bool]:
        _require(execution_id, "execution_id")
        _require(lease_token, "lease_token")
        return self.state.heartbeat(execution_id, lease_token, self.lease_ttl_s)

    def complete(self, execution_id: str, lease_token: str, status: ExecState, reason: str) -> CompleteResult:
        _require(execution_id, "execution_id")
        _require(lease_token, "lease_token")
        if len(reason) > 4096:
            raise InvalidArgument("reason is longer than 4096 characters")
        res = self.state.complete(execution_id, lease_token, status, reason)
        if not res.duplicate:
            COMPLETIONS.labels(status.value).inc()
        log.debug("completed", execution_id=execution_id, status=status.value, duplicate=res.duplicate)
        return res

    # ---------------------------------------------------------------- cells

    def register_cell(self, *, cell_id: str, address: str, host: str, role: CellRole, is_core: bool,
                      kv_capacity_tokens: int, num_accelerators: int,
                      engine_address: str = "", hosts_replica: bool = False) -> tuple[CellRecord, bool]:
        check_id(_require(cell_id, "cell_id"), "cell_id")
        _require(address, "address")
        if ":" not in address:
            raise InvalidArgument(f"address {address!r} must be host:port")
        if engine_address and (":" not in engine_address or len(engine_address) > 255):
            raise InvalidArgument(f"engine_address {engine_address[:80]!r} must be host:port")
        if engine_address and is_core:
            raise InvalidArgument("the core cell trains and never serves an engine; register it without engine_address")
        if hosts_replica and is_core:
            raise InvalidArgument("the core cell is the trainer; hosts_replica is for cells that switch to train")
        if kv_capacity_tokens < 0 or num_accelerators < 0:
            raise InvalidArgument("kv_capacity_tokens and num_accelerators must be >= 0")
        created = self.state.register_cell(cell_id=cell_id, address=address, host=host, role=role, is_core=is_core,
                                           kv_capacity_tokens=kv_capacity_tokens,
                                           num_accelerators=max(num_accelerators, 1), engine_address=engine_address,
                                           hosts_replica=hosts_replica)
        log.info("cell registered", cell_id=cell_id, address=address, role=role.value, core=is_core, new=created)
        return self.state.get_cell(cell_id), created

    def cell_heartbeat(self, *, cell_id: str, inflight: int, kv_used_tokens: int, kv_capacity_tokens: int,
                       weight_version: int, role: CellRole) -> tuple[CellRole, CellRole | None]:
        check_id(_require(cell_id, "cell_id"), "cell_id")
        if min(inflight, kv_used_tokens, kv_capacity_tokens, weight_version) < 0:
            raise InvalidArgument("inflight, kv tokens and weight_version must be >= 0")
        if role is CellRole.SWITCHING:
            raise InvalidArgument("a cell reports the role it runs (rollout, train or idle), not switching")
        return self.state.cell_heartbeat(cell_id, inflight=inflight, kv_used_tokens=kv_used_tokens,
                                         kv_capacity_tokens=kv_capacity_tokens, weight_version=weight_version,
                                         reported_role=role)

    def cordon_cell(self, cell_id: str, cordoned: bool, reason: str = "") -> CellRecord:
        """Operator: keep a cell out of rollout (``cordoned``; the policy migrates its requests and
        moves it to training) or give it back."""
        check_id(_require(cell_id, "cell_id"), "cell_id")
        if len(reason) > 512:
            raise InvalidArgument("reason is longer than 512 characters")
        cell = self.state.cordon_cell(cell_id, (reason.strip() or "cordoned by an operator") if cordoned else "")
        log.info("cell cordoned" if cordoned else "cell uncordoned", cell_id=cell_id, reason=cell.cordon_reason)
        return cell

    def deregister_cell(self, cell_id: str) -> CellRole:
        check_id(_require(cell_id, "cell_id"), "cell_id")
        role = self.state.deregister_cell(cell_id)
        log.info("cell deregistered", cell_id=cell_id)
        return role

    def list_cells(self) -> list[CellInfo]:
        now = self.state.clock()
        out = []
        for c in self.state.list_cells():
            age = max(0.0, now - c.heartbeat_s)
            out.append(CellInfo(c, age, age <= self.cell_dead_after_s))
        return out


_METRIC_NAME = re.compile(r"[A-Za-z0-9_.:/+-]{1,64}")
MAX_STEP_METRICS = 256


def _step_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """A published step's figures for its event, validated (InvalidArgument names the bad one)."""
    if len(metrics) > MAX_STEP_METRICS:
        raise InvalidArgument(f"a step reports {len(metrics)} metrics; at most {MAX_STEP_METRICS}")
    out = {}
    for name, value in metrics.items():
        if not _METRIC_NAME.fullmatch(name):
            raise InvalidArgument(f"metric name {name[:80]!r} must be 1-64 characters of A-Z a-z 0-9 _ . : / + -")
        if not math.isfinite(value):
            raise InvalidArgument(f"metric {name!r} is {value}; expected a finite number")
        out[name] = float(value)
    return out
