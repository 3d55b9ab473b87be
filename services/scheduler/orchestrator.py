"""Live orchestration: observe Redis, ask the policy, carry out role switches.

One loop per scheduler deployment (the instance holding the ``leader`` lease in Redis) runs::

    every tick_interval_s:
      on taking the lead: extend every lease by a full TTL (holders could not heartbeat meanwhile)
      reap expired leases -> re-queue, or after max_attempts end as timeout -> score outbox
      score outbox -> reward service Score(timeout): scored from the preserved workspace under the
        job's policy, outcome reported to trajectory; acknowledged only then (a crash re-sends it)
      for each active job (oldest first):
        pending: admit when no running job holds its cells; running: enqueue every step whose
        rollouts may start (policy.may_start: step - weight_version <= staleness bound)
        view    = ClusterView from Redis (one script + one pipelined read of the job's cells)
        actions = policy.decide(view, params)              # pure, shared with the simulator
        for a in actions:  begin_switch (atomic: cell -> SWITCHING, from/to/start recorded)
                           -> switch pool: actuator.switch(...) -> end_switch(done | rolled back)
      pending switches with no worker here (a crash, a leader change): carry them out again
      (actuators are idempotent per switch id) or roll back those older than switch_timeout_s

A failed switch is rolled back: the actuator puts the cell back in its old role. When a service the
rollback needs does not answer (the trainer or the gateway killed mid-switch, restarting), it is
tried again with backoff for up to restore_timeout_s, the cell still SWITCHING meanwhile: the
registry never shows a role (ROLLOUT, say) that the cell does not serve (its engine left routing
by the drain), which no policy decision would then repair.

The actuator is the seam to the outside (``actuators.py``): the gateway drains the cell's engine
(migrating its in-flight requests, so no execution is interrupted) and the trainer takes or gives
back the replica; or a cell daemon does the same on its cell. Each switch's duration goes to
Redis (switch_log stream, the job's events) and the ``gyre_scheduler_switch_seconds`` histogram.

Lifecycle: built -> start() (thread) -> stop() (waits for in-flight switches, releases leadership).
``tick()`` is public so tests and benchmarks can drive the loop step by step.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from prometheus_client import Counter, Histogram

from services.common.errors import FailedPrecondition, GyreError, Unavailable
from services.common.logging import get_logger
from services.common.metrics import REGISTRY
from services.scheduler.controller import JobController
from services.scheduler.costs import StepProgress, SwitchCosts, estimate, train_left_tokens
from services.scheduler.jobs import CellRecord, EventKind, JobState, JobStatus
from services.common.roles import CellRole
from services.scheduler.policy import Action, CellView, ClusterView, Mode, decide, may_start
from services.scheduler.state import SchedulerState
from services.scheduler.tasks import step_payloads

log = get_logger(__name__)

SWITCH_SECONDS = Histogram("gyre_scheduler_switch_seconds", "Duration of completed role switches.",
                           ["from_role", "to_role"], registry=REGISTRY,
                           buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 3.5, 5, 8.5, 15, 30, 60, 120, 300, 600))
SWITCHES = Counter("gyre_scheduler_switches_total", "Role switches by outcome (done, rolled_back).",
                   ["outcome"], registry=REGISTRY)
DECISIONS = Counter("gyre_scheduler_decisions_total", "Policy decisions made (one per running job per tick).",
                    registry=REGISTRY)
DECISION_SECONDS = Histogram("gyre_scheduler_decision_seconds", "Build view + decide for one job.",
                             registry=REGISTRY, buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1))
REQUEUES = Counter("gyre_scheduler_requeues_total", "Expired leases, by outcome (requeued, timeout, cancelled).",
                   ["outcome"], registry=REGISTRY)
TIMEOUT_SCORES = Counter("gyre_scheduler_timeout_scores_total",
                         "Executions whose last lease expired, sent to the reward service, by outcome (ok, retry).",
                         ["outcome"], registry=REGISTRY)


class CellActuator(Protocol):
    """Carries out one role switch of one cell; blocks until done and raises when it failed.

    Must be idempotent per ``switch_id``: after a scheduler crash the same switch is carried out
    again. ``migrate_to`` are the rollout cells the policy expects to receive the cell's in-flight
    executions (ROLLOUT -> TRAIN); the cell must host nothing when the call returns.
    """

    def switch(self, cell: CellRecord, from_role: CellRole, to_role: CellRole, *, switch_id: str, job: JobStatus,
               migrate_to: Sequence[CellRecord],
               on_migrated: Callable[[Mapping[str, str]], None] | None = None) -> Mapping[str, str] | None:
        """Returns event attributes of what it did (e.g. ``migrated``: requests moved), or None.
        ``on_migrated(attrs)`` is called as soon as a drain moved requests, so the migration is on
        record even when a later phase of the switch fails (the requests moved all the same)."""


class TimeoutScorer(Protocol):
    """Scores an execution that ended because its last lease expired (the reward service's Score
    with status ``timeout``); idempotent per execution, raises when the score is not stored."""

    def __call__(self, *, job_id: str, execution_id: str, step: int, group_id: str, timeout_policy: str) -> None: ...


class _Stopping(Exception):
    """The orchestrator stops while a rollback waits for a service."""


class Orchestrator:
    def __init__(self, state: SchedulerState, actuator: CellActuator, *, instance_id: str,
                 tick_interval_s: float = 0.5, leader_ttl_s: float = 10.0, cell_dead_after_s: float = 30.0,
                 switch_timeout_s: float = 600.0, restore_timeout_s: float = 120.0, switch_workers: int = 8,
                 metrics_event_interval_s: float = 5.0, lease_ttl_s: float = 60.0,
                 timeout_scorer: TimeoutScorer | None = None, controller: JobController | None = None,
                 usage: Callable[[str], Mapping[str, Any] | None] | None = None,
                 step_progress: Callable[[str, int], StepProgress | None] | None = None) -> None:
        self.state = state
        # what the gateway served for a job (GatewayClient.job_usage): its calls, tokens and context
        # go into the job's 'metrics' events (gyre watch shows them); None: no gateway to ask
        self.usage = usage
        self._usage_retry_at = 0.0
        # The job controller (controller.py) prepares jobs and opens their trajectory steps; without
        # one (API-only tests, a client that drives the services itself) steps are enqueued as is.
        self.controller = controller
        if controller is not None:
            controller.before_complete = self.last_metrics_event
        # how much of a step's update is packed and trained (the trajectory service's count, which
        # the controller asks for); None: the work left is estimated from the executions that ended
        self.step_progress = step_progress or (controller.step_progress if controller is not None else None)
        self.actuator = actuator
        self.timeout_scorer = timeout_scorer
        self._scoring: Future[None] | None = None
        self._warned_no_scorer = False
        self.instance_id = instance_id
        self.tick_interval_s = tick_interval_s
        self.leader_ttl_s = leader_ttl_s
        self.cell_dead_after_s = cell_dead_after_s
        self.switch_timeout_s = switch_timeout_s
        self.restore_timeout_s = restore_timeout_s
        self.metrics_event_interval_s = metrics_event_interval_s
        self.lease_ttl_s = lease_ttl_s
        self._leading = False
        self._pool = ThreadPoolExecutor(max_workers=switch_workers, thread_name_prefix="sched-switch")
        self._inflight: dict[str, Future[None]] = {}  # cell_id -> switch carried out by this process
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_metrics: dict[str, float] = {}

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> Orchestrator:
        self._thread = threading.Thread(target=self._run, name="sched-orchestrator", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop ticking, let in-flight switches finish (up to ``timeout_s``), release leadership."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        with self._lock:
            futures = list(self._inflight.values())
        deadline = time.monotonic() + timeout_s
        for f in futures:
            try:
                f.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # deliberate: already logged by the switch worker
                pass
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.state.release_leader(self.instance_id)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.tick()
            except Exception:  # deliberate fault tolerance: Redis blips must not kill the loop
                log.exception("orchestrator tick failed; retrying next tick")
            self._stop.wait(max(0.0, self.tick_interval_s - (time.monotonic() - started)))

    # ---------------------------------------------------------------- the loop

    def tick(self) -> bool:
        """One pass of the loop; False when another instance leads."""
        if not self.state.acquire_leader(self.instance_id, self.leader_ttl_s):
            self._leading = False
            return False
        if not self._leading:
            # taking over (start, restart, failover): harnesses could not heartbeat while no
            # scheduler ran, so no lease may expire before they had a full TTL to reach us
            self._leading = True
            extended = self.state.grace_leases(self.lease_ttl_s)
            log.info("leading", instance_id=self.instance_id, leases_extended=extended)
        for eid, outcome in self.state.reap_expired():
            REQUEUES.labels(outcome).inc()
            if outcome == "timeout":
                log.warning("last allowed lease expired; execution ends as a timeout", execution_id=eid)
        self._score_timeouts()
        self.recover_switches()
        jobs: list[JobStatus] = []
        for job_id in self.state.active_job_ids():
            try:
                jobs.append(self.state.get_job(job_id))
            except GyreError:  # ended and removed meanwhile
                continue
        # cells held by running jobs (None: all cells), so pending jobs are admitted without overlap
        running_cells = [j.spec.cell_ids or None for j in jobs if j.state is JobState.RUNNING]
        for job in jobs:
            try:
                if job.state is JobState.PENDING:
                    admitted = self._admit(job, running_cells)
                    if admitted is None:
                        continue
                    job = admitted
                    running_cells.append(job.spec.cell_ids or None)
                self.step_job(job)
            except Exception:  # deliberate: one job's failure must not stall the others
                log.exception("orchestrating job failed; retrying next tick", job_id=job.job_id)
        return True

    def _score_timeouts(self) -> None:
        """Send the score outbox to the reward service, off the tick (a scorer may take seconds)."""
        if self._scoring is not None and not self._scoring.done():
            return
        pending = self.state.unscored_timeouts()
        if not pending:
            return
        if self.timeout_scorer is None:
            if not self._warned_no_scorer:
                self._warned_no_scorer = True
                log.warning("executions ended by an expired lease wait for a score, but no reward service is "
                            "configured (--reward-address); they stay in the outbox", waiting=len(pending))
            return
        self._scoring = self._pool.submit(self._send_scores, self.timeout_scorer, pending)

    def _send_scores(self, scorer: TimeoutScorer, pending: list[tuple[str, str, int, str]]) -> None:
        for eid, job_id, step, group_id in pending:
            blog = log.bind(execution_id=eid, job_id=job_id, step=step)
            try:
                policy = self.state.get_job(job_id).spec.timeout_policy.value
            except GyreError:
                policy = ""  # the job is gone: the reward service applies its own policy for it
            try:
                scorer(job_id=job_id, execution_id=eid, step=step, group_id=group_id, timeout_policy=policy)
            except Exception as exc:  # deliberate: the reward service may be down; retried next tick
                TIMEOUT_SCORES.labels("retry").inc()
                blog.warning("scoring the timed-out execution failed; retrying", error=str(exc))
                continue
            self.state.ack_scored(eid)
            TIMEOUT_SCORES.labels("ok").inc()
            blog.info("timed-out execution scored", timeout_policy=policy)

    def _admit(self, job: JobStatus, running: list[tuple[str, ...] | None]) -> JobStatus | None:
        mine = set(job.spec.cell_ids)
        for other in running:
            if other is None or not mine or mine & set(other):
                return None  # its cells are held by a running job: stay pending
        if self.state.set_job_state(job.job_id, JobState.PENDING, JobState.RUNNING, "admitted"):
            log.info("job admitted", job_id=job.job_id)
        job = self.state.get_job(job.job_id)
        return job if job.state is JobState.RUNNING else None

    def step_job(self, job: JobStatus) -> list[Action]:
        """Enqueue startable steps, decide, and start the switches for one running job."""
        job = self._enqueue_startable(job)
        if job.state is not JobState.RUNNING:
            return []
        if self.controller is not None and not self.controller.ready(job):
            # no role switch before the job's trainer is started: a cell moved to TRAIN now (a
            # cordon, say) would find no job to join and be rolled back, its drain wasted; a
            # cordoned cell takes no new rollout work meanwhile (the gateway follows cordons)
            return []
        t0 = time.perf_counter()
        cells = self.job_cells(job)
        view = self.build_view(job, cells)
        actions = decide(view, job.spec.policy_params())
        DECISIONS.inc()
        DECISION_SECONDS.observe(time.perf_counter() - t0)
        by_id = {c.cell_id: c for c in cells}
        for a in actions:
            self._start_switch(job, a, by_id)
        self._maybe_metrics_event(job, cells)
        return actions

    def last_metrics_event(self, job: JobStatus) -> None:
        """One more 'metrics' event now, so that the job's log ends with its whole usage (what the
        report shows): called right before the job's last update is published (the scheduler API)
        and before the job controller completes it after its final evaluation."""
        try:
            self._maybe_metrics_event(self.state.get_job(job.job_id), self.job_cells(job), force=True)
        except Exception as exc:  # deliberate: figures never hold up the publish (Redis briefly away...)
            log.warning("no last metrics event", job_id=job.job_id, error=str(exc))

    def _enqueue_startable(self, job: JobStatus) -> JobStatus:
        spec, params = job.spec, job.spec.policy_params()
        step = job.enqueued_steps
        changed = False
        if self.controller is not None and step < spec.num_steps and not self.controller.ready(job):
            return job  # reward and trainer are not prepared yet: no rollout may start
        while step < spec.num_steps and may_start(step, job.weight_version, params, self._step_finished(job, step - 1)):
            if self.controller is not None and not self.controller.open_step(job, step):
                break  # the trajectory service must know the step before its first outcome arrives
            try:
                payloads = step_payloads(spec, step)
            except ValueError as exc:
                log.error("task source failed; failing the job", job_id=job.job_id, step=step, error=str(exc))
                self.state.set_job_state(job.job_id, JobState.RUNNING, JobState.FAILED, f"task source: {exc}")
                return self.state.get_job(job.job_id)
            n = self.state.enqueue_step(spec, step, payloads)
            log.info("step enqueued", job_id=job.job_id, step=step, executions=n)
            step, changed = step + 1, True
        return self.state.get_job(job.job_id) if changed else job

    def _step_finished(self, job: JobStatus, step: int) -> bool:
        """Every rollout of ``step`` ended (only asked for jobs that batch rollouts by step)."""
        if step < 0 or not job.spec.rollout_batches:
            return True
        return self.state.done_in_step(job.job_id, step) >= job.spec.step_size

    def job_cells(self, job: JobStatus) -> list[CellRecord]:
        """The job's live cells: those named in its spec, else every registered cell."""
        cells = self.state.list_cells(job.spec.cell_ids or None)
        horizon = self.state.clock() - self.cell_dead_after_s
        return [c for c in cells if c.heartbeat_s >= horizon or c.role is CellRole.SWITCHING]

    def build_view(self, job: JobStatus, cells: Sequence[CellRecord]) -> ClusterView:
        spec = job.spec
        params = spec.policy_params()
        nxt = job.current_step + 1
        return ClusterView(
            now_s=self.state.clock(), step=job.current_step, weight_version=job.weight_version,
            cells=tuple(CellView(cell_id=c.cell_id, role=c.role, is_core=c.is_core, inflight=c.inflight,
                                 kv_used_tokens=c.kv_used_tokens, kv_capacity_tokens=c.kv_capacity_tokens,
                                 switching_to=c.switch_to if c.role is CellRole.SWITCHING else None,
                                 cordoned=c.cordoned)
                        for c in cells),
            queued=job.queued, running=job.running, finished_in_step=job.done_in_step, step_size=spec.step_size,
            train_ready=job.groups_done_in_step > 0,
            training_active=job.training_step == job.current_step or job.done_in_step >= spec.step_size,
            next_step_allowed=nxt < spec.num_steps and may_start(nxt, job.weight_version, params,
                                                                 self._step_finished(job, job.current_step)),
            costs=self.costs(job, len(cells)),
        )

    def costs(self, job: JobStatus, num_cells: int) -> SwitchCosts | None:
        """What switches cost and buy, measured on this cluster (elastic jobs only; None until the
        job's first update was measured). The work the update has left (what more TRAIN cells could
        share) is ``costs.train_left_tokens``: the steps' median tokens scaled by the share of the
        step's executions that ended, less what the trainer has already trained of it."""
        if job.spec.mode is not Mode.ELASTIC:
            return None
        train = self.state.train_samples(job.job_id, job.current_step)
        if not train:
            return None
        per_step = statistics.median(s.tokens for s in train)
        ended = min(1.0, job.done_in_step / job.spec.step_size) if job.spec.step_size else 1.0
        progress = self.step_progress(job.job_id, job.current_step) if self.step_progress is not None else None
        return estimate(train, self.state.switch_samples(), max_cells=num_cells,
                        train_left_tokens=train_left_tokens(per_step, ended, progress))

    # ---------------------------------------------------------------- switches

    def _start_switch(self, job: JobStatus, a: Action, cells: dict[str, CellRecord]) -> None:
        cell = cells.get(a.cell_id)
        if cell is None or cell.is_core or cell.role is CellRole.SWITCHING:
            log.error("policy action refused", cell_id=a.cell_id, reason="unknown, core or switching cell")
            return
        if cell.role is CellRole.ROLLOUT and cell.inflight > 0 and job.running > 0 and not a.migrate_to:
            # never interrupt an execution: a busy rollout cell leaves only by migrating its work
            log.error("policy action refused", cell_id=a.cell_id, reason="busy rollout cell without migration")
            return
        try:
            switch_id = self.state.begin_switch(cell_id=cell.cell_id, from_role=cell.role, to_role=a.to_role,
                                                job_id=job.job_id, reason=a.reason, migrate_to=a.migrate_to)
        except FailedPrecondition as exc:  # the cell changed since the view was built
            log.info("switch not started", cell_id=cell.cell_id, error=str(exc))
            return
        log.info("switch started", job_id=job.job_id, cell_id=cell.cell_id, from_role=cell.role.value,
                 to_role=a.to_role.value, reason=a.reason, migrate_to=list(a.migrate_to))
        targets = [cells[t] for t in a.migrate_to if t in cells]
        self._submit(cell, cell.role, a.to_role, switch_id, job, targets)

    def _submit(self, cell: CellRecord, from_role: CellRole, to_role: CellRole, switch_id: str, job: JobStatus,
                targets: Sequence[CellRecord]) -> None:
        with self._lock:
            self._inflight[cell.cell_id] = self._pool.submit(
                self._carry_out, cell, from_role, to_role, switch_id, job, targets)

    def _carry_out(self, cell: CellRecord, from_role: CellRole, to_role: CellRole, switch_id: str, job: JobStatus,
                   targets: Sequence[CellRecord]) -> None:
        bound = log.bind(job_id=job.job_id, cell_id=cell.cell_id, switch_id=switch_id)
        recorded = False

        def migrated(attrs: Mapping[str, str]) -> None:
            nonlocal recorded
            if attrs.get("migrated") and not recorded:
                self.state.append_event(job.job_id, EventKind.MIGRATION.value,
                                        {"cell_id": cell.cell_id, "switch_id": switch_id, **attrs})
                recorded = True

        try:
            info = dict(self.actuator.switch(cell, from_role, to_role, switch_id=switch_id, job=job,
                                             migrate_to=targets, on_migrated=migrated) or {})
            phases = info.pop("phases", "")
            migrated(info)  # an actuator that reports the drain only in its result
            if phases:
                self.state.append_event(job.job_id, EventKind.SWITCH_PHASES.value,
                                        {"cell_id": cell.cell_id, "switch_id": switch_id, "from": from_role.value,
                                         "to": to_role.value, "phases": phases})
        except Exception as exc:  # deliberate: a failed switch is rolled back, not fatal
            bound.warning("switch failed; rolling back", from_role=from_role.value, to_role=to_role.value,
                          error=str(exc))
            error = f"{type(exc).__name__}: {exc}"
            try:
                self._restore(cell, from_role, to_role, switch_id, job)
            except _Stopping:  # left in flight: the next leader's recovery carries it out again
                bound.info("rollback left to recovery: the orchestrator stops")
                with self._lock:
                    self._inflight.pop(cell.cell_id, None)
                return
            except Exception as exc2:  # deliberate: the switch is still ended, with both errors
                error += f"; restoring {from_role.value} also failed: {exc2}"
                bound.error("switch rolled back without restoring the cell's role", from_role=from_role.value,
                            error=str(exc2))
            self._end(cell.cell_id, switch_id, job.job_id, False, error, from_role, to_role)
            return
        self._end(cell.cell_id, switch_id, job.job_id, True, "", from_role, to_role)

    def _restore(self, cell: CellRecord, from_role: CellRole, to_role: CellRole, switch_id: str,
                 job: JobStatus) -> None:
        """Put ``cell`` back in ``from_role`` after its switch to ``to_role`` failed. A service the
        rollback needs that does not answer (Unavailable: killed and restarting) is asked again with
        backoff for up to ``restore_timeout_s``; any other error, or the last one, is raised.
        Raises ``_Stopping`` when the orchestrator stops meanwhile."""
        deadline = time.monotonic() + self.restore_timeout_s
        pause, tries = 0.25, 0
        while True:
            try:
                self.actuator.switch(cell, to_role, from_role, switch_id=switch_id + "-rollback", job=job,
                                     migrate_to=())
                if tries:
                    log.info("cell's role restored", cell_id=cell.cell_id, switch_id=switch_id,
                             role=from_role.value, tries=tries + 1)
                return
            except Unavailable as exc:
                tries += 1
                if time.monotonic() + pause > deadline:
                    raise
                log.info("restoring the cell's role waits for a service", cell_id=cell.cell_id,
                         switch_id=switch_id, role=from_role.value, error=str(exc), retry_in_s=pause)
            if self._stop.wait(pause):
                raise _Stopping()
            pause = min(2 * pause, 5.0)

    def _end(self, cell_id: str, switch_id: str, job_id: str, done: bool, error: str, from_role: CellRole,
             to_role: CellRole) -> None:
        try:
            duration = self.state.end_switch(cell_id=cell_id, switch_id=switch_id, job_id=job_id, done=done,
                                             error=error)
        except GyreError as exc:  # rolled back meanwhile by a timeout, or by another leader
            log.info("switch end not recorded", cell_id=cell_id, switch_id=switch_id, error=str(exc))
            duration = 0.0
        finally:
            with self._lock:
                self._inflight.pop(cell_id, None)
        SWITCHES.labels("done" if done else "rolled_back").inc()
        if done and duration > 0:
            SWITCH_SECONDS.labels(from_role.value, to_role.value).observe(duration)
        log.info("switch ended", cell_id=cell_id, switch_id=switch_id, done=done, duration_s=duration, error=error)

    def recover_switches(self) -> None:
        """Carry out again (or roll back, when too old) switches that no worker here is running."""
        now = self.state.clock()
        for cell in self.state.pending_switches():
            with self._lock:
                if cell.cell_id in self._inflight:
                    continue
            assert cell.switch_from is not None and cell.switch_to is not None
            if now - cell.switch_started_s > self.switch_timeout_s:
                log.warning("switch timed out; rolling back", cell_id=cell.cell_id, switch_id=cell.switch_id)
                self._end(cell.cell_id, cell.switch_id, cell.switch_job_id, False,
                          f"no progress for {self.switch_timeout_s:.0f}s", cell.switch_from, cell.switch_to)
                continue
            try:
                job = self.state.get_job(cell.switch_job_id)
            except GyreError:
                self._end(cell.cell_id, cell.switch_id, cell.switch_job_id, False, "job gone",
                          cell.switch_from, cell.switch_to)
                continue
            log.info("resuming switch", cell_id=cell.cell_id, switch_id=cell.switch_id,
                     from_role=cell.switch_from.value, to_role=cell.switch_to.value)
            migrate = self.state.list_cells(cell.switch_migrate_to)
            self._submit(cell, cell.switch_from, cell.switch_to, cell.switch_id, job, migrate)

    def switches_in_flight(self) -> int:
        with self._lock:
            return len(self._inflight)

    def wait_switches(self, timeout_s: float) -> bool:
        """Block until this process carries out no switch (True) or ``timeout_s`` passed (False)."""
        deadline = time.monotonic() + timeout_s
        while self.switches_in_flight():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def _maybe_metrics_event(self, job: JobStatus, cells: Sequence[CellRecord], force: bool = False) -> None:
        now = self.state.clock()
        if not force and now - self._last_metrics.get(job.job_id, 0.0) < self.metrics_event_interval_s:
            return
        self._last_metrics[job.job_id] = now
        roles = [c.role for c in cells]
        self.state.append_event(job.job_id, EventKind.METRICS.value, {
            "step": job.current_step, "weight_version": job.weight_version, "queued": job.queued,
            "running": job.running, "done_in_step": job.done_in_step, "step_size": job.spec.step_size,
            "rollout_cells": roles.count(CellRole.ROLLOUT), "train_cells": roles.count(CellRole.TRAIN),
            "switching_cells": roles.count(CellRole.SWITCHING), "idle_cells": roles.count(CellRole.IDLE),
            **self._usage_attrs(job.job_id),
        })

    def _usage_attrs(self, job_id: str) -> dict[str, Any]:
        """The gateway's totals for ``job_id`` as event attributes ({} without a gateway, before the
        job's first call, or while the gateway does not answer: asked again 30 s later)."""
        if self.usage is None or time.monotonic() < self._usage_retry_at:
            return {}
        try:
            u = self.usage(job_id)
        except Exception as exc:  # deliberate: a gateway away or closing costs only these figures
            log.info("gateway usage not available", job_id=job_id, error=str(exc))
            self._usage_retry_at = time.monotonic() + 30.0
            return {}
        if not u:
            return {}
        return {"calls": u["calls"], "calls_in_flight": u["in_flight"], "prompt_tokens": u["prompt_tokens"],
                "cached_tokens": u["cached_tokens"], "output_tokens": u["output_tokens"],
                "max_context": u["max_context_tokens"], "last_context": u["last_context_tokens"]}

