"""gRPC adapter of the reward service: proto in -> RewardService -> proto out.

Validation errors raised by the core (InvalidArgument, ResourceExhausted, FailedPrecondition,
NotFound) become status codes in the common server interceptor; scorer failures are not errors
of the RPC: they come back as a ScoreResponse with state SCORER_ERROR / SCORER_TIMEOUT.
"""

from __future__ import annotations

from typing import Any

from protos.gyre.v1 import common_pb2, reward_pb2, reward_pb2_grpc, scheduler_pb2
from services.common.errors import InvalidArgument
from services.reward.scorers import ScorerOutput, ScorerSpec
from services.reward.service import RewardService, ScoreRecord

SERVICE_NAME = reward_pb2.DESCRIPTOR.services_by_name["Reward"].full_name

STATUS_TO_STR = {
    common_pb2.EXECUTION_STATUS_FINISHED: "finished",
    common_pb2.EXECUTION_STATUS_TIMEOUT: "timeout",
    common_pb2.EXECUTION_STATUS_FAILED: "failed",
}
STR_TO_STATUS = {v: k for k, v in STATUS_TO_STR.items()}
POLICY_TO_STR = {
    scheduler_pb2.TIMEOUT_POLICY_UNSPECIFIED: "",
    scheduler_pb2.TIMEOUT_POLICY_PARTIAL: "partial",
    scheduler_pb2.TIMEOUT_POLICY_ZERO: "zero",
    scheduler_pb2.TIMEOUT_POLICY_EXCLUDE: "exclude",
}
STR_TO_POLICY = {v: k for k, v in POLICY_TO_STR.items()}
KIND_TO_STR = {
    reward_pb2.SCORER_KIND_UNSPECIFIED: "builtin",
    reward_pb2.SCORER_KIND_BUILTIN: "builtin",
    reward_pb2.SCORER_KIND_ENTRY_POINT: "entry_point",
    reward_pb2.SCORER_KIND_EXTERNAL: "external",
}
STR_TO_KIND = {"builtin": reward_pb2.SCORER_KIND_BUILTIN, "entry_point": reward_pb2.SCORER_KIND_ENTRY_POINT,
               "external": reward_pb2.SCORER_KIND_EXTERNAL}
STATE_TO_PROTO = {"ok": reward_pb2.SCORE_STATE_OK, "scorer_error": reward_pb2.SCORE_STATE_SCORER_ERROR,
                  "scorer_timeout": reward_pb2.SCORE_STATE_SCORER_TIMEOUT}


def scorer_from_proto(msg: reward_pb2.ScorerSpec) -> ScorerSpec:
    kind = KIND_TO_STR.get(msg.kind)
    if kind is None:
        raise InvalidArgument(f"unknown scorer kind {msg.kind}")
    target = msg.target or ("xlong-v1" if kind == "builtin" else "")
    return ScorerSpec(kind=kind, target=target, timeout_s=msg.timeout_s)  # type: ignore[arg-type]


def scorer_to_proto(spec: ScorerSpec) -> reward_pb2.ScorerSpec:
    return reward_pb2.ScorerSpec(kind=STR_TO_KIND[spec.kind], target=spec.target, timeout_s=spec.timeout_s)


def breakdown_to_proto(out: ScorerOutput | None) -> reward_pb2.ScoreBreakdown:
    if out is None:
        return reward_pb2.ScoreBreakdown()
    return reward_pb2.ScoreBreakdown(
        tests_passed=out.tests_passed, tests_total=out.tests_total, detail=out.detail, metrics=out.metrics,
        modules=[reward_pb2.ModuleScore(name=m.name, tests_passed=m.tests_passed, tests_total=m.tests_total,
                                        error=m.error) for m in out.modules],
    )


def breakdown_from_proto(score: float, msg: reward_pb2.ScoreBreakdown) -> dict[str, Any]:
    """An ExternalScorer's answer as the dict `scorers.parse_output` takes."""
    return {
        "score": score, "tests_passed": msg.tests_passed, "tests_total": msg.tests_total,
        "modules": [[m.name, m.tests_passed, m.tests_total, m.error] for m in msg.modules],
        "metrics": dict(msg.metrics), "detail": msg.detail,
    }


def record_to_proto(rec: ScoreRecord, *, duplicate: bool) -> reward_pb2.ScoreResponse:
    return reward_pb2.ScoreResponse(
        job_id=rec.job_id, execution_id=rec.execution_id, status=STR_TO_STATUS[rec.status],
        state=STATE_TO_PROTO[rec.state], reward=rec.reward or 0.0, has_reward=rec.reward is not None,
        excluded=rec.excluded, raw_score=rec.raw_score or 0.0, timeout_policy=STR_TO_POLICY[rec.timeout_policy],
        breakdown=breakdown_to_proto(rec.breakdown()), scorer=rec.scorer, error=rec.error,
        scored_at_s=rec.scored_at_s, outcome_reported=rec.outcome_reported, duplicate=duplicate,
        group_id=rec.group_id, step=rec.step,
    )


def outcome_to_proto(rec: ScoreRecord) -> common_pb2.ExecutionOutcome:
    """The ExecutionOutcome the trajectory service receives for a score."""
    return common_pb2.ExecutionOutcome(
        job_id=rec.job_id, execution_id=rec.execution_id, group_id=rec.group_id, status=STR_TO_STATUS[rec.status],
        reward=rec.reward or 0.0, has_reward=rec.reward is not None, excluded=rec.excluded, step=rec.step,
    )


class RewardServicer(reward_pb2_grpc.RewardServicer):
    def __init__(self, core: RewardService) -> None:
        self.core = core

    def ConfigureJob(self, request: reward_pb2.ConfigureJobRequest, context: Any) -> reward_pb2.ConfigureJobResponse:
        policy = POLICY_TO_STR.get(request.timeout_policy)
        if policy is None:
            raise InvalidArgument(f"unknown timeout_policy {request.timeout_policy}")
        spec = scorer_from_proto(request.scorer) if request.HasField("scorer") else self.core.default_scorer
        job = self.core.configure_job(request.job_id, spec, policy)
        return reward_pb2.ConfigureJobResponse(scorer=scorer_to_proto(job.scorer),
                                               timeout_policy=STR_TO_POLICY[job.timeout_policy])

    def SubmitWorkspace(self, request: reward_pb2.SubmitWorkspaceRequest,
                        context: Any) -> reward_pb2.SubmitWorkspaceResponse:
        files: dict[str, bytes] = {}
        for f in request.files:
            if f.path in files:
                raise InvalidArgument(f"workspace path {f.path[:80]!r} appears twice")
            files[f.path] = f.content
        ref = self.core.submit_workspace(request.job_id, request.execution_id, request.task_id, files)
        return reward_pb2.SubmitWorkspaceResponse(
            ref=common_pb2.BlobRef(key=ref.blob_key, size_bytes=ref.size_bytes, sha256=ref.sha256),
            num_files=ref.num_files, total_bytes=ref.total_bytes, version=ref.version,
        )

    def Score(self, request: reward_pb2.ScoreRequest, context: Any) -> reward_pb2.ScoreResponse:
        status = STATUS_TO_STR.get(request.status)
        if status is None:
            raise InvalidArgument("status must be FINISHED, TIMEOUT or FAILED")
        policy = POLICY_TO_STR.get(request.timeout_policy)
        if policy is None:
            raise InvalidArgument(f"unknown timeout_policy {request.timeout_policy}")
        rec, duplicate = self.core.score(
            job_id=request.job_id, execution_id=request.execution_id, status=status, timeout_policy=policy,
            group_id=request.group_id, step=request.step, task_id=request.task_id,
        )
        return record_to_proto(rec, duplicate=duplicate)

    def GetScore(self, request: reward_pb2.GetScoreRequest, context: Any) -> reward_pb2.ScoreResponse:
        return record_to_proto(self.core.get_score(request.execution_id), duplicate=True)


class FunctionScorerServicer(reward_pb2_grpc.ExternalScorerServicer):
    """Serves a Python function as an ``ExternalScorer`` (what an external harness runs).

    `fn(files, task_id, status)` returns what a scorer may return (a number, a dict with
    ``score``, or a ScorerOutput).
    """

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def Score(self, request: reward_pb2.ExternalScoreRequest, context: Any) -> reward_pb2.ExternalScoreResponse:
        from services.reward.scorers import parse_output

        files = {f.path: f.content for f in request.files}
        out = parse_output(self.fn(files, request.task_id, STATUS_TO_STR.get(request.status, "")))
        return reward_pb2.ExternalScoreResponse(score=out.score, breakdown=breakdown_to_proto(out))
