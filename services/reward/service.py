"""The reward service's core: workspaces in, scored outcomes out (no gRPC here).

    submit_workspace ──validate (paths, sizes)──> zip ──> blob spool  (bytes)
                                                       └─> Redis ws:<exec> (blob key, sha, size, version)
    score ──stored already? return it (idempotent; re-report if the report was lost)
          ──load latest snapshot (or the empty workspace)
          ──scorer: sandbox worker (builtin / entry point) or external gRPC scorer, time-limited
          ──timeout policy (partial | zero | exclude), failed executions excluded
          ──Redis score:<exec> (JSON)  ──> report ExecutionOutcome (trajectory), mark reported

Lifecycle: RewardService(...) is built by main.py; every method is thread-safe; close() stops
the scorer workers. State lives in Redis and the spool, so a restarted service continues: scores
already stored are returned as duplicates, unreported outcomes are reported on the next Score.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import redis
from prometheus_client import Counter, Histogram

from services.common.blobs import BlobStore
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from services.common.logging import get_logger
from services.common.metrics import REGISTRY
from services.common.redis_store import Keys
from services.reward import workspace
from services.reward.sandbox import ScorerPool
from services.reward.scorers import Allowlist, ModuleResult, ScoreInput, ScorerError, ScorerOutput, ScorerSpec

__all__ = ["RewardService", "ScoreRecord", "JobPolicy", "WorkspaceRef", "TIMEOUT_POLICIES", "END_STATUSES"]

log = get_logger(__name__)

TIMEOUT_POLICIES = ("partial", "zero", "exclude")
END_STATUSES = ("finished", "timeout", "failed")
EndStatus = Literal["finished", "timeout", "failed"]
ExternalScore = Callable[[ScorerSpec, ScoreInput, float], ScorerOutput]

SCORES = Counter(
    "gyre_reward_scores_total", "Executions scored, by end status, scoring state and timeout policy.",
    ["status", "state", "policy"], registry=REGISTRY,
)
SCORE_SECONDS = Histogram(
    "gyre_reward_score_seconds", "Time to score one execution (load + scorer + store).", ["scorer"],
    registry=REGISTRY, buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
WORKSPACE_BYTES = Histogram(
    "gyre_reward_workspace_bytes", "Uncompressed size of submitted workspace snapshots.", registry=REGISTRY,
    buckets=(256, 1024, 4096, 16384, 65536, 262144, 1 << 20, 4 << 20, 16 << 20, 64 << 20),
)
REJECTED = Counter(
    "gyre_reward_workspaces_rejected_total", "Workspace snapshots refused, by reason.", ["reason"], registry=REGISTRY,
)
OUTCOME_REPORTS = Counter(
    "gyre_reward_outcome_reports_total", "ExecutionOutcome reports to the trajectory service, by result.",
    ["result"], registry=REGISTRY,
)


@dataclass(frozen=True)
class JobPolicy:
    scorer: ScorerSpec
    timeout_policy: str  # "" = not set by the job


@dataclass(frozen=True)
class WorkspaceRef:
    blob_key: str
    size_bytes: int
    sha256: str
    num_files: int
    total_bytes: int
    version: int


@dataclass
class ScoreRecord:
    """One execution's score as stored (JSON in Redis) and answered."""

    job_id: str
    execution_id: str
    group_id: str
    step: int
    status: str
    state: str  # ok | scorer_error | scorer_timeout
    reward: float | None
    excluded: bool
    raw_score: float | None
    timeout_policy: str
    scorer: str
    error: str = ""
    scored_at_s: float = 0.0
    outcome_reported: bool = False
    output: dict[str, Any] = field(default_factory=dict)

    def breakdown(self) -> ScorerOutput | None:
        if not self.output:
            return None
        o = self.output
        return ScorerOutput(
            score=o["score"],
            tests_passed=o["tests_passed"],
            tests_total=o["tests_total"],
            modules=tuple(ModuleResult(*m) for m in o["modules"]),
            metrics=dict(o["metrics"]),
            detail=o["detail"],
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> ScoreRecord:
        return cls(**json.loads(raw))


def _text(value: bytes | str | None) -> str:
    """A Redis value as text (clients may or may not decode responses)."""
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else value


def _check_id(name: str, value: str, *, required: bool = True) -> None:
    if required and not value:
        raise InvalidArgument(f"{name} is required")
    if len(value) > 256 or any(ord(c) < 32 for c in value):
        raise InvalidArgument(f"{name} must be at most 256 printable characters")


class RewardService:
    """Thread-safe core of the reward service (see module docstring)."""

    def __init__(
        self,
        *,
        redis_client: redis.Redis,
        blobs: BlobStore,
        pool: ScorerPool,
        limits: workspace.WorkspaceLimits,
        default_scorer: ScorerSpec,
        default_timeout_policy: str = "partial",
        scorer_timeout_s: float = 30.0,
        retention_s: int = 7 * 24 * 3600,
        external_score: ExternalScore | None = None,
        report_outcome: Callable[[ScoreRecord], None] | None = None,
        allowlist: Allowlist | None = None,
    ) -> None:
        if default_timeout_policy not in TIMEOUT_POLICIES:
            raise ValueError(f"default_timeout_policy must be one of {TIMEOUT_POLICIES}, got {default_timeout_policy!r}.")
        self.r = redis_client
        self.blobs = blobs
        self.pool = pool
        self.limits = limits
        self.default_scorer = default_scorer
        self.default_timeout_policy = default_timeout_policy
        self.scorer_timeout_s = scorer_timeout_s
        self.retention_s = retention_s
        self.external_score = external_score
        self.report_outcome = report_outcome
        self.allowlist = allowlist or Allowlist(default=default_scorer.name)
        self.keys = Keys.ns("reward")
        # Striped locks: one execution is scored by one thread of this process at a time.
        self._locks = [threading.Lock() for _ in range(64)]

    def _lock(self, execution_id: str) -> threading.Lock:
        return self._locks[hash(execution_id) % len(self._locks)]

    # ---- jobs -------------------------------------------------------------------------------
    def configure_job(self, job_id: str, scorer: ScorerSpec, timeout_policy: str) -> JobPolicy:
        _check_id("job_id", job_id)
        if timeout_policy and timeout_policy not in TIMEOUT_POLICIES:
            raise InvalidArgument(f"timeout_policy must be one of {TIMEOUT_POLICIES}, got {timeout_policy!r}")
        self.allowlist.check(scorer)  # a request picks among configured scorers; it never names new code
        key = self.keys.key("job", job_id)
        self.r.hset(key, mapping={"scorer": json.dumps(asdict(scorer)), "timeout_policy": timeout_policy})
        self.r.expire(key, self.retention_s)
        log.info("job configured", job_id=job_id, scorer=scorer.name, timeout_policy=timeout_policy or "default")
        return JobPolicy(scorer, timeout_policy)

    def job_policy(self, job_id: str) -> JobPolicy:
        raw = {_text(k): _text(v) for k, v in self.r.hgetall(self.keys.key("job", job_id)).items()} if job_id else {}
        if not raw:
            return JobPolicy(self.default_scorer, "")
        return JobPolicy(ScorerSpec(**json.loads(raw["scorer"])), raw.get("timeout_policy", ""))

    # ---- workspaces -------------------------------------------------------------------------
    def _blob_key(self, execution_id: str) -> str:
        return f"reward/ws/{hashlib.sha256(execution_id.encode()).hexdigest()[:40]}.zip"

    def submit_workspace(self, job_id: str, execution_id: str, task_id: str, files: dict[str, bytes]) -> WorkspaceRef:
        _check_id("execution_id", execution_id)
        _check_id("job_id", job_id, required=False)
        _check_id("task_id", task_id, required=False)
        try:
            checked = workspace.validate_files(files, self.limits)
        except workspace.WorkspaceRejected as exc:
            REJECTED.labels(exc.reason).inc()
            log.warning("workspace rejected", execution_id=execution_id, reason=exc.reason, error=str(exc))
            if exc.reason == "size":
                raise ResourceExhausted(str(exc)) from None
            raise InvalidArgument(str(exc)) from None
        with self._lock(execution_id):
            if self.r.exists(self.keys.key("score", execution_id)):
                raise FailedPrecondition(f"execution {execution_id!r} is already scored; its workspace is final")
            blob = workspace.pack(checked)
            key = self._blob_key(execution_id)
            sha = self.blobs.put(key, blob)
            total = sum(len(v) for v in checked.values())
            ws_key = self.keys.key("ws", execution_id)
            pipe = self.r.pipeline()
            pipe.hset(ws_key, mapping={
                "blob_key": key, "size_bytes": len(blob), "sha256": sha, "num_files": len(checked),
                "total_bytes": total, "job_id": job_id, "task_id": task_id, "submitted_at_s": time.time(),
            })
            pipe.hincrby(ws_key, "version", 1)
            pipe.expire(ws_key, self.retention_s)
            version = int(pipe.execute()[1])
        WORKSPACE_BYTES.observe(total)
        return WorkspaceRef(key, len(blob), sha, len(checked), total, version)

    def _load_workspace(self, execution_id: str) -> tuple[dict[str, bytes], dict[str, str]]:
        meta = {_text(k): _text(v) for k, v in self.r.hgetall(self.keys.key("ws", execution_id)).items()}
        if not meta:
            return {}, {}
        blob = self.blobs.get(meta["blob_key"])
        if hashlib.sha256(blob).hexdigest() != meta["sha256"]:
            raise FailedPrecondition(f"workspace of {execution_id!r} does not match its recorded sha256")
        return workspace.unpack(blob, self.limits), meta

    # ---- scoring ----------------------------------------------------------------------------
    def get_score(self, execution_id: str) -> ScoreRecord:
        _check_id("execution_id", execution_id)
        raw = self.r.get(self.keys.key("score", execution_id))
        if raw is None:
            raise NotFound(f"execution {execution_id!r} has not been scored")
        return ScoreRecord.from_json(raw)

    def _run_scorer(self, spec: ScorerSpec, inp: ScoreInput) -> ScorerOutput:
        timeout_s = spec.timeout_s or self.scorer_timeout_s
        if not self.allowlist.allows(spec):  # configured before the allowlist shrank
            raise ScorerError("error", f"scorer {spec.name} is no longer in this reward service's scorer_allowlist")
        if spec.kind == "external":
            if self.external_score is None:
                raise ScorerError("error", "external scorers are not enabled in this reward service")
            return self.external_score(spec, inp, timeout_s)
        return self.pool.score(spec, inp, timeout_s=timeout_s)

    def score(
        self,
        *,
        job_id: str,
        execution_id: str,
        status: str,
        timeout_policy: str = "",
        group_id: str = "",
        step: int = 0,
        task_id: str = "",
    ) -> tuple[ScoreRecord, bool]:
        """Score once; returns (record, duplicate). Scorer failures are recorded, not raised."""
        _check_id("execution_id", execution_id)
        for name, value in (("job_id", job_id), ("group_id", group_id), ("task_id", task_id)):
            _check_id(name, value, required=False)
        if status not in END_STATUSES:
            raise InvalidArgument(f"status must be one of {END_STATUSES}, got {status!r}")
        if timeout_policy and timeout_policy not in TIMEOUT_POLICIES:
            raise InvalidArgument(f"timeout_policy must be one of {TIMEOUT_POLICIES}, got {timeout_policy!r}")
        if step < 0:
            raise InvalidArgument(f"step must be >= 0, got {step}")
        with self._lock(execution_id):
            key = self.keys.key("score", execution_id)
            raw = self.r.get(key)
            if raw is not None:
                record = ScoreRecord.from_json(raw)
                if not record.outcome_reported:
                    self._report(record)
                return record, True
            record = self._score_new(job_id, execution_id, status, timeout_policy, group_id, step, task_id)
            # owed to the trajectory service until reported (first: a crash right after the set
            # below still leaves the report owed, and retry_reports delivers it)
            if self.report_outcome is not None:
                self.r.zadd(self.keys.key("unreported"), {execution_id: time.time()})
            # NX: another reward process may have scored it meanwhile; its record wins.
            if not self.r.set(key, record.to_json(), nx=True, ex=self.retention_s):
                stored = self.r.get(key)
                if stored is not None:
                    return ScoreRecord.from_json(stored), True
            self._report(record)
            return record, False

    def _score_new(
        self, job_id: str, execution_id: str, status: str, req_policy: str, group_id: str, step: int, task_id: str
    ) -> ScoreRecord:
        start = time.perf_counter()
        job = self.job_policy(job_id)
        policy = job.timeout_policy or req_policy or self.default_timeout_policy
        blog = log.bind(job_id=job_id, execution_id=execution_id)
        files, meta = self._load_workspace(execution_id)
        task_id = meta.get("task_id", "") or task_id
        record = ScoreRecord(
            job_id=job_id, execution_id=execution_id, group_id=group_id, step=step, status=status, state="ok",
            reward=None, excluded=False, raw_score=None, timeout_policy=policy, scorer=job.scorer.name,
            scored_at_s=time.time(),
        )
        if status == "failed":
            # A failed execution (harness error, cancelled job) says nothing about the policy: leave it out.
            record.excluded = True
        else:
            inp = ScoreInput(job_id=job_id, execution_id=execution_id, task_id=task_id, status=status, files=files)
            try:
                out = self._run_scorer(job.scorer, inp)
            except ScorerError as exc:
                record.state = "scorer_timeout" if exc.state == "timeout" else "scorer_error"
                record.error = str(exc)
                record.excluded = True
                blog.warning("scorer failed", scorer=job.scorer.name, state=record.state, error=str(exc))
            else:
                record.raw_score = out.score
                record.output = out.to_json()
                if status == "finished" or policy == "partial":
                    record.reward = out.score
                elif policy == "zero":
                    record.reward = 0.0
                else:
                    record.excluded = True
        SCORES.labels(status, record.state, policy).inc()
        SCORE_SECONDS.labels(job.scorer.name).observe(time.perf_counter() - start)
        blog.info("scored", status=status, state=record.state, reward=record.reward, raw=record.raw_score,
                  policy=policy, excluded=record.excluded)
        return record

    def _report(self, record: ScoreRecord) -> None:
        """Send the outcome to the trajectory service; a failure is logged and retried on the next Score."""
        if self.report_outcome is None:
            return
        try:
            self.report_outcome(record)
        except Exception as exc:  # deliberate: the score is stored; the next Score call retries the report
            OUTCOME_REPORTS.labels("error").inc()
            log.warning("outcome report failed", execution_id=record.execution_id, error=str(exc))
            return
        OUTCOME_REPORTS.labels("ok").inc()
        record.outcome_reported = True
        self.r.set(self.keys.key("score", record.execution_id), record.to_json(), xx=True, keepttl=True)
        self.r.zrem(self.keys.key("unreported"), record.execution_id)

    def retry_reports(self, limit: int = 256) -> int:
        """Report again the outcomes the trajectory service has not acknowledged (it was down or
        restarting when they were scored: a harness does not score a finished execution twice, so
        nothing else would ever deliver them and the step would never complete). Returns how
        many were reported now."""
        if self.report_outcome is None:
            return 0
        owed = self.keys.key("unreported")
        done = 0
        for raw_id in self.r.zrange(owed, 0, limit - 1):
            execution_id = _text(raw_id)  # type: ignore[arg-type]
            with self._lock(execution_id):
                raw = self.r.get(self.keys.key("score", execution_id))
                record = ScoreRecord.from_json(raw) if raw is not None else None
                if record is None or record.outcome_reported:
                    self.r.zrem(owed, execution_id)  # expired, or reported by another process
                    continue
                self._report(record)
                if not record.outcome_reported:
                    break  # the trajectory service is still unreachable: try again later
                done += 1
        return done

    def run_report_retries(self, stop: threading.Event, interval_s: float = 1.0) -> None:
        """``retry_reports`` every ``interval_s`` until ``stop`` (a thread of the service)."""
        while not stop.wait(interval_s):
            try:
                n = self.retry_reports()
            except redis.RedisError as exc:  # Redis restarting: the next round retries
                log.warning("outcome report retry failed", error=str(exc))
                continue
            if n:
                log.info("owed outcomes reported", executions=n)
