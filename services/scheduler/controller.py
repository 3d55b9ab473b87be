"""The job controller: the scheduler drives each job's whole lifecycle through the other services.

A client sends one ``JobSpec`` (``SubmitJob``) and watches ``WatchJob``; everything else happens
here, from Redis state, so a restarted scheduler picks every job up where it was::

    admitted (orchestrator) ──> prepare, once:  reward.ConfigureJob(job, scorer, timeout policy)
        │                                        reward.ConfigureJob(job-eval, same)  (evaluations)
        │                                        trainer.StartJob(job: model, algorithm, steps,
        │                                          engines = the cell registry's engine addresses)
        │                                        evaluation round 0 enqueued (held-out tasks)
        ├── before each step is enqueued:        trajectory.OpenStep(job, step, executions, group size)
        ├── every tick:  trainer supervised      (not running this job any more: StartJob again, which
        │                                          resumes from its checkpoint and step journal)
        │                evaluation rounds       (enqueued once `weight_version` reaches their step;
        │                                          when every execution of a round ended: scores from
        │                                          reward -> pass rate -> an `evaluation` event)
        └── training done + last round scored -> COMPLETED   (cancelled / failed: trainer job stopped)

Progress lives in the job's Redis hash (``ctl_*``, ``eval_*`` fields), never only in memory.
Evaluation executions are ordinary executions of the job in the run queue (leased first, flagged
``evaluation`` in the lease, recorded and scored under ``<job>-eval``), so any harness, built-in or
external, runs them, and they never reach a training step.

Lifecycle: built -> ``start()`` (thread, ticks while this scheduler leads) -> ``stop()``.
``tick()`` is public so tests can drive it.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client import Histogram

from services.algorithm import Algorithm
from services.common.errors import FailedPrecondition, GyreError, InvalidArgument, NotFound, PermissionDenied
from services.common.logging import get_logger
from services.common.metrics import REGISTRY
from services.scheduler.costs import StepProgress
from services.scheduler.jobs import EventKind, JobSpec, JobState, JobStatus, eval_job_id
from services.scheduler.state import SchedulerState, eval_execution_id
from services.scheduler.tasks import heldout_payloads

log = get_logger(__name__)

DRIVE_SECONDS = Histogram("gyre_scheduler_controller_seconds", "One job controller pass over a running job "
                          "(remote calls included).", registry=REGISTRY,
                          buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))

TRAINER_CHECK_S = 5.0  # how often a running job's trainer is checked
STEP_PROGRESS_TIMEOUT_S = 2.0  # an elastic decision waits no longer for the trajectory service's count
MAX_TRAINER_STARTS = 5  # StartJob attempts for one job before it fails (a trainer that keeps failing)
UNSCORED_GRACE_S = 120.0  # an ended evaluation execution without a score after this long counts as 0
ERROR_EVENT_EVERY_S = 30.0


def default_scorer(spec: JobSpec) -> str:
    """The scorer a job uses: its own, else its task family's builtin one ("" = reward's default)."""
    if spec.scorer:
        return spec.scorer
    from services.task.registry import get_family  # light: names and dotted paths only

    try:
        family = get_family(spec.tasks.generator)
    except ValueError:
        return ""
    return f"builtin:{family.name}" if family.scorer else ""


def scorer_spec(name: str) -> Any:
    """``kind:target`` -> the reward service's ScorerSpec (validated there: ValueError if bad)."""
    from services.reward.scorers import ScorerSpec

    kind, _, target = name.partition(":")
    return ScorerSpec(kind=kind, target=target)  # type: ignore[arg-type]


def trainer_objective(a: Algorithm) -> Any:
    """The trainer's ``ObjectiveParams`` for a job's ``[job.algorithm]`` (services/algorithm.py)."""
    from services.trainer.wire import objective_params

    return objective_params(a.objective(), temperature=a.temperature, kl_reference=a.kl_reference)


def trainer_optim(a: Algorithm) -> Any:
    """The trainer's ``OptimParams`` for a job's ``[job.algorithm]``."""
    from protos.gyre.v1 import trainer_pb2

    return trainer_pb2.OptimParams(lr=a.learning_rate, weight_decay=a.weight_decay, max_grad_norm=a.max_grad_norm,
                                   warmup_steps=a.lr_warmup_steps, schedule=a.lr_schedule,
                                   min_lr_ratio=a.lr_min_ratio, beta1=a.adam_beta1, beta2=a.adam_beta2,
                                   eps=a.adam_eps)


class JobController:
    def __init__(self, state: SchedulerState, *, trainer: Any, trajectory: Any, reward: Any,
                 trajectory_address: str, scheduler_address: str, checkpoint_root: str, is_leader: Callable[[], bool] = lambda: True,
                 tick_interval_s: float = 0.5, token_budget: int = 0) -> None:
        self.state = state
        self.trainer, self.trajectory, self.reward = trainer, trajectory, reward
        # called with a job right before it is marked completed (the orchestrator's last metrics event)
        self.before_complete: Callable[[JobStatus], None] | None = None
        self.trajectory_address = trajectory_address
        self.scheduler_address = scheduler_address
        self.checkpoint_root = checkpoint_root
        self.is_leader = is_leader
        self.tick_interval_s = tick_interval_s
        self.token_budget = token_budget
        self._last_trainer_check: dict[str, float] = {}
        self._last_error_event: dict[tuple[str, str], float] = {}
        self._ended_unscored: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> JobController:
        self._thread = threading.Thread(target=self._run, name="job-controller", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                if self.is_leader():
                    self.tick()
            except Exception:  # deliberate fault tolerance: a Redis blip must not end the loop
                log.exception("job controller tick failed; retrying next tick")
            self._stop.wait(max(0.0, self.tick_interval_s - (time.monotonic() - started)))

    # ---------------------------------------------------------------- the loop
    def tick(self) -> None:
        active = set()
        for job_id in self.state.active_job_ids():
            active.add(job_id)
            try:
                job = self.state.get_job(job_id)
            except NotFound:
                continue
            if job.state is JobState.RUNNING:
                t0 = time.perf_counter()
                try:
                    self.drive(job)
                except GyreError as exc:  # a service is down or refused: said once in a while, retried
                    self._error(job.job_id, "drive", exc)
                finally:
                    DRIVE_SECONDS.observe(time.perf_counter() - t0)
        for job_id in self.state.controlled_jobs():
            if job_id not in active:
                self._wind_down(job_id)

    def drive(self, job: JobStatus) -> None:
        """One pass over a running job: prepare it, supervise its trainer, run its evaluations."""
        ctl = self.state.controller_fields(job.job_id)
        if "ctl_prepared" not in ctl:
            if not self._prepare(job):
                return
            ctl = self.state.controller_fields(job.job_id)
        if "training_done" not in ctl:
            self._supervise_trainer(job, ctl)
        self._evaluations(job, ctl)
        if "training_done" in ctl and self._all_rounds_scored(job.spec, ctl):
            if self.before_complete is not None:
                self.before_complete(job)
            if self.state.set_job_state(job.job_id, JobState.RUNNING, JobState.COMPLETED,
                                        "all steps trained and evaluated"):
                log.info("job completed", job_id=job.job_id, weight_version=job.weight_version)

    def step_progress(self, job_id: str, step: int) -> StepProgress | None:
        """How much of ``step``'s update is packed and trained (the trajectory service's count), or
        None when the service cannot answer now (the caller then estimates without it)."""
        if self.trajectory is None:
            return None
        try:
            plan = self.trajectory.step_plan(job_id, step, timeout_s=STEP_PROGRESS_TIMEOUT_S)
        except GyreError as exc:
            log.debug("step progress unavailable", job_id=job_id, step=step, error=str(exc))
            return None
        return StepProgress(packed_tokens=plan.num_tokens, trained_tokens=plan.acked_tokens, sealed=plan.sealed)

    def ready(self, job: JobStatus) -> bool:
        """Whether the job's rollouts may be enqueued (its services were prepared)."""
        return bool(self.state.controller_fields(job.job_id).get("ctl_prepared"))

    def open_step(self, job: JobStatus, step: int) -> bool:
        """Declare ``step`` to the trajectory service before its executions are enqueued (idempotent)."""
        spec = job.spec
        try:
            self.trajectory.open_step(job.job_id, step, num_executions=spec.step_size, group_size=spec.group_size,
                                      token_budget=self.token_budget,
                                      normalize_advantages=spec.algorithm.normalize_advantages,
                                      advantage_eps=spec.algorithm.advantage_eps)
        except GyreError as exc:
            self._error(job.job_id, "open_step", exc)
            return False
        return True

    # ---------------------------------------------------------------- stages
    def _prepare(self, job: JobStatus) -> bool:
        spec = job.spec
        blog = log.bind(job_id=job.job_id)
        scorer = default_scorer(spec)
        policy = spec.timeout_policy.value
        spec_scorer = scorer_spec(scorer) if scorer else None
        try:
            self.reward.configure_job(job.job_id, spec_scorer, timeout_policy=policy)
            if spec.evaluation.tasks:
                self.reward.configure_job(eval_job_id(job.job_id), spec_scorer, timeout_policy=policy)
        except (PermissionDenied, InvalidArgument) as exc:  # no retry changes that: the job cannot be scored
            self._fail(job.job_id, f"the reward service refused the job's scorer {scorer!r}: {exc}")
            return False
        self.state.mark_controlled(job.job_id)
        if not self._load_model(job):
            return False
        if not self._start_trainer(job, first=True):
            return False
        if not self._engines_serve_the_job(job):
            return False
        self.state.set_controller_field(job.job_id, "ctl_prepared", str(time.time()))
        self.state.append_event(job.job_id, EventKind.JOB_PREPARED.value, {
            "scorer": scorer or "(reward default)", "timeout_policy": policy, "model": spec.model,
            "engines": ",".join(self._engines()), "trainer": getattr(self.trainer, "address", "")})
        blog.info("job prepared", scorer=scorer, engines=self._engines())
        return True

    def _load_model(self, job: JobStatus) -> bool:
        """Every engine of the registry serves the job's model (loaded where another one is served;
        between jobs the engines host nothing). An engine still busy is retried next pass."""
        from services.rollout.client import EngineClient

        for address in self._engines():
            with EngineClient(address, timeout_s=600.0) as engine:
                if engine.get_load().model == job.spec.model:
                    continue
                try:
                    res = engine.load_model(job.spec.model)
                except InvalidArgument as exc:
                    self._fail(job.job_id, f"the engine at {address} cannot load the job's model: {exc}")
                    return False
                except FailedPrecondition as exc:  # requests of the previous job still finishing
                    self._error(job.job_id, "load_model", exc)
                    return False
            log.info("engine loaded the job's model", job_id=job.job_id, engine=address, model=res.model,
                     model_name=res.model_name)
            self.state.append_event(job.job_id, EventKind.ENGINE_MODEL.value,
                                    {"engine": address, "model": res.model, "model_name": res.model_name})
        return True

    def _engines_serve_the_job(self, job: JobStatus, wait_s: float = 30.0) -> bool:
        """The trainer pushed the job's initial weights to every engine when it started; an engine
        that does not install them serves another model (its parameters do not match): the job
        fails with that sentence rather than training one model on another's samples."""
        from services.rollout.client import EngineClient

        status = self.trainer.status()
        want = int(status.weight_version)
        for address in self._engines():
            with EngineClient(address, timeout_s=10.0) as engine:
                deadline = time.monotonic() + wait_s
                load = engine.get_load()
                while load.weight_version != want and time.monotonic() < deadline:
                    time.sleep(0.2)
                    load = engine.get_load()
            if load.weight_version != want:
                self._fail(job.job_id, f"the engine at {address} serves {load.model_name!r} and did not take the "
                                       f"weights of the job's model {job.spec.model!r} (version {want}); bring the "
                                       f"stack up with that model (`gyre up --model {job.spec.model}`)")
                return False
        return True

    def _engines(self) -> list[str]:
        """Engines of the cell registry (the trainer publishes every version to them)."""
        return sorted(c.engine_address for c in self.state.list_cells() if c.engine_address)

    def _trainer_spec(self, job: JobStatus) -> Any:
        from protos.gyre.v1 import trainer_pb2

        spec, a = job.spec, job.spec.algorithm
        objective = trainer_objective(a)
        optim = trainer_optim(a)
        return trainer_pb2.TrainerJobSpec(
            job_id=job.job_id, model=spec.model, source="trajectory",
            trajectory_address=self.trajectory_address, engine_addresses=self._engines(),
            scheduler_address=self.scheduler_address, num_steps=spec.num_steps, objective=objective, optim=optim,
            seed=spec.seed, shards=spec.shards, checkpoint_dir=str(Path(self.checkpoint_root) / job.job_id))

    def _start_trainer(self, job: JobStatus, *, first: bool) -> bool:
        starts = int(self.state.controller_fields(job.job_id).get("ctl_trainer_starts", "0"))
        if starts >= MAX_TRAINER_STARTS:
            self._fail(job.job_id, f"the trainer stopped running the job {starts} times; see the trainer's log")
            return False
        try:
            res = self.trainer.start_job(self._trainer_spec(job))
        except InvalidArgument as exc:
            self._fail(job.job_id, f"the trainer refused the job: {exc}")
            return False
        except FailedPrecondition as exc:  # another job still trains there (stopping): wait for it
            self._error(job.job_id, "start_trainer", exc)
            return False
        if not res.already_running:
            self.state.incr_controller_counter(job.job_id, "ctl_trainer_starts")
        log.info("trainer job started", job_id=job.job_id, step=res.step, weight_version=res.weight_version,
                 already_running=res.already_running, resumed=not first)
        return True

    def _supervise_trainer(self, job: JobStatus, ctl: dict[str, str]) -> None:
        now = time.monotonic()
        if now - self._last_trainer_check.get(job.job_id, 0.0) < TRAINER_CHECK_S:
            return
        self._last_trainer_check[job.job_id] = now
        status = self.trainer.status()
        if status.job_id == job.job_id:
            self._catch_up(job, int(status.weight_version))
            self._resync_engines(job, int(status.weight_version))
        if status.job_id == job.job_id and status.phase not in ("failed", "stopped", "idle"):
            return
        why = f"phase {status.phase or 'idle'}" + (f", error: {status.error}" if status.error else "")
        log.warning("the trainer does not run the job; starting it again (resumes from its checkpoint)",
                    job_id=job.job_id, trainer_job=status.job_id, reason=why)
        self.state.append_event(job.job_id, EventKind.CONTROLLER_ERROR.value,
                                {"stage": "trainer", "error": f"trainer {why}; restarting the trainer job"})
        self._start_trainer(job, first=False)

    def _resync_engines(self, job: JobStatus, version: int) -> None:
        """An engine that restarted serves its base weights: relay it the trainer's current version
        (the trainer's GetWeights stream into the engine's UpdateWeights, chunks as they are)."""
        from services.rollout.client import EngineClient

        for address in self._engines():
            try:
                with EngineClient(address, timeout_s=10.0) as engine:
                    load = engine.get_load()
                    if load.model != job.spec.model or load.weight_version >= version:
                        continue
                    engine.update_weights_from(self.trainer.weight_chunks(version))
                log.warning("engine behind the job's weights (restarted?); sent it the current version",
                            job_id=job.job_id, engine=address, had=load.weight_version, version=version)
            except GyreError as exc:  # down or restarting: next check
                log.info("engine not resynced yet", engine=address, error=str(exc))

    def _catch_up(self, job: JobStatus, trainer_version: int) -> None:
        """Apply publications the trainer made but whose report never arrived (the scheduler was
        down or restarting when the trainer sent it; the trainer does not resend it)."""
        for step in range(job.weight_version, min(trainer_version, job.spec.num_steps)):
            try:
                applied = self.state.report_training(job.job_id, step, "published", step + 1)
            except FailedPrecondition as exc:  # its executions have not all ended here: not yet
                log.info("trainer is ahead; its report waits", job_id=job.job_id, step=step, error=str(exc))
                return
            if applied:
                log.warning("applied a publication whose report was lost", job_id=job.job_id, step=step,
                            weight_version=step + 1)

    def _evaluations(self, job: JobStatus, ctl: dict[str, str]) -> None:
        spec = job.spec
        marks = spec.evaluation.after_steps(spec.num_steps)
        for round_, after in enumerate(marks):
            if f"eval_result:{round_}" in ctl:
                continue
            size = ctl.get(f"eval_size:{round_}")
            if size is None:
                if job.weight_version >= after:
                    payloads = heldout_payloads(spec.tasks.generator, dict(spec.tasks.params), spec.evaluation.tasks)
                    n = self.state.enqueue_evaluation(spec, round_, after, job.weight_version, payloads)
                    log.info("evaluation enqueued", job_id=job.job_id, round=round_, after_step=after, tasks=n)
                continue
            if int(ctl.get(f"eval_done:{round_}", "0")) >= int(size):
                self._score_round(job, round_, after, int(size), int(ctl.get(f"eval_version:{round_}", "0")))

    def _score_round(self, job: JobStatus, round_: int, after: int, size: int, version: int) -> None:
        """Every execution of the round ended: its scores -> pass rate (reward 1.0 = passed) and mean
        reward, stored once and published as an ``evaluation`` event. ``version``: the job's weight
        version when the round was enqueued (its executions may see newer weights in async modes)."""
        rewards: list[float] = []
        statuses: dict[str, int] = {}
        for i in range(size):
            eid = eval_execution_id(job.job_id, round_, i)
            try:
                score = self.reward.get_score(eid)
            except NotFound:
                first = self._ended_unscored.setdefault(eid, time.monotonic())
                if time.monotonic() - first < UNSCORED_GRACE_S:
                    return  # a timeout still on its way through the score outbox: next tick
                rewards.append(0.0)
                statuses["unscored"] = statuses.get("unscored", 0) + 1
                continue
            self._ended_unscored.pop(eid, None)
            if score.reward is None:  # excluded (its scorer failed, or the policy excludes it): not a pass
                rewards.append(0.0)
                key = f"{score.status}:{score.state}" if score.state and score.state != "ok" else score.status
                statuses[key] = statuses.get(key, 0) + 1
                continue
            rewards.append(float(score.reward))
            statuses[score.status] = statuses.get(score.status, 0) + 1
        n = max(len(rewards), 1)
        result = {"round": round_, "after_step": after, "weight_version": version, "tasks": size,
                  "pass_rate": sum(r >= 1.0 - 1e-9 for r in rewards) / n, "mean_reward": sum(rewards) / n,
                  "statuses": statuses}
        if self.state.set_controller_field(job.job_id, f"eval_result:{round_}", json.dumps(result), only_new=True):
            self.state.append_event(job.job_id, EventKind.EVALUATION.value, {
                **{k: v for k, v in result.items() if k != "statuses"}, "statuses": json.dumps(statuses)})
            log.info("evaluation scored", job_id=job.job_id, **result)

    def _all_rounds_scored(self, spec: JobSpec, ctl: dict[str, str]) -> bool:
        return all(f"eval_result:{r}" in ctl for r in range(len(spec.evaluation.after_steps(spec.num_steps))))

    def _wind_down(self, job_id: str) -> None:
        """A controlled job ended (completed, cancelled or failed): stop its trainer job, once."""
        try:
            status = self.trainer.status()
            if status.job_id == job_id and status.phase not in ("done", "failed", "stopped", "idle"):
                self.trainer.stop_job(job_id)
                log.info("trainer job stopped", job_id=job_id)
        except GyreError as exc:
            self._error(job_id, "wind_down", exc)
            return
        self.state.forget_controlled(job_id)
        self._last_trainer_check.pop(job_id, None)

    # ---------------------------------------------------------------- helpers
    def _fail(self, job_id: str, message: str) -> None:
        log.error("job failed", job_id=job_id, error=message)
        try:
            self.state.set_job_state(job_id, JobState.RUNNING, JobState.FAILED, message)
        except FailedPrecondition:  # ended meanwhile
            pass

    def _error(self, job_id: str, stage: str, exc: Exception) -> None:
        log.warning("job controller step failed; retrying", job_id=job_id, stage=stage, error=str(exc))
        key = (job_id, stage)
        now = time.monotonic()
        if now - self._last_error_event.get(key, 0.0) >= ERROR_EVENT_EVERY_S:
            self._last_error_event[key] = now
            try:
                self.state.append_event(job_id, EventKind.CONTROLLER_ERROR.value, {"stage": stage, "error": str(exc)})
            except Exception:  # deliberate: the event is informative; Redis may be what failed
                pass
