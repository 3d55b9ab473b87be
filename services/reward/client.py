"""Typed clients of the reward service, and of an external harness's ``ExternalScorer``.

    reward = RewardClient("127.0.0.1:50053")
    reward.configure_job("job-1", ScorerSpec(kind="builtin", target="xlong-v1"), timeout_policy="partial")
    reward.submit_workspace("job-1", "exec-7", {"src/m1.gs": b"x 2 +"}, task_id="xlong-v1/train/0/...")
    result = reward.score("job-1", "exec-7", "timeout", group_id="g0", step=3)
    result.reward, result.excluded, result.tests_passed, result.state

Errors come back as domain errors (services.common.errors) carrying the server's message.
`ExternalScorerClient` is what the reward service uses to call back an external harness.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import grpc

from protos.gyre.v1 import reward_pb2, reward_pb2_grpc
from services.common.client import GrpcClient
from services.common.security import Security, open_channel
from services.reward.scorers import ModuleResult, ScoreInput, ScorerError, ScorerOutput, ScorerSpec, parse_output
from services.reward.servicer import (
    POLICY_TO_STR,
    STATUS_TO_STR,
    STR_TO_POLICY,
    STR_TO_STATUS,
    breakdown_from_proto,
    scorer_from_proto,
    scorer_to_proto,
)

_STATES = {reward_pb2.SCORE_STATE_OK: "ok", reward_pb2.SCORE_STATE_SCORER_ERROR: "scorer_error",
           reward_pb2.SCORE_STATE_SCORER_TIMEOUT: "scorer_timeout"}


@dataclass(frozen=True)
class ScoreResult:
    """A Score / GetScore answer. `reward` is None when the execution has no reward."""

    execution_id: str
    status: str
    state: str
    reward: float | None
    excluded: bool
    raw_score: float
    timeout_policy: str
    tests_passed: int
    tests_total: int
    modules: tuple[ModuleResult, ...]
    metrics: dict[str, float]
    scorer: str
    error: str
    duplicate: bool
    outcome_reported: bool


def _result(r: reward_pb2.ScoreResponse) -> ScoreResult:
    b = r.breakdown
    return ScoreResult(
        execution_id=r.execution_id, status=STATUS_TO_STR.get(r.status, ""), state=_STATES.get(r.state, ""),
        reward=r.reward if r.has_reward else None, excluded=r.excluded, raw_score=r.raw_score,
        timeout_policy=POLICY_TO_STR.get(r.timeout_policy, ""), tests_passed=b.tests_passed,
        tests_total=b.tests_total,
        modules=tuple(ModuleResult(m.name, m.tests_passed, m.tests_total, m.error) for m in b.modules),
        metrics=dict(b.metrics), scorer=r.scorer, error=r.error, duplicate=r.duplicate,
        outcome_reported=r.outcome_reported,
    )


def files_to_proto(files: Mapping[str, bytes]) -> list[reward_pb2.WorkspaceFile]:
    return [reward_pb2.WorkspaceFile(path=p, content=bytes(c)) for p, c in sorted(files.items())]


class RewardClient(GrpcClient):
    """Client of the ``Reward`` service; thread-safe."""

    def __init__(self, address: str, *, timeout_s: float = 120.0, max_message_mb: int = 256) -> None:
        super().__init__(address, timeout_s=timeout_s, max_message_mb=max_message_mb)
        self._stub = reward_pb2_grpc.RewardStub(self._channel)

    def configure_job(self, job_id: str, scorer: ScorerSpec | None = None, *,
                      timeout_policy: str = "") -> tuple[ScorerSpec, str]:
        req = reward_pb2.ConfigureJobRequest(job_id=job_id, timeout_policy=STR_TO_POLICY[timeout_policy])
        if scorer is not None:
            req.scorer.CopyFrom(scorer_to_proto(scorer))
        r = self._call(self._stub.ConfigureJob, req)
        return scorer_from_proto(r.scorer), POLICY_TO_STR[r.timeout_policy]

    def submit_workspace(self, job_id: str, execution_id: str, files: Mapping[str, bytes], *,
                         task_id: str = "") -> reward_pb2.SubmitWorkspaceResponse:
        req = reward_pb2.SubmitWorkspaceRequest(job_id=job_id, execution_id=execution_id, task_id=task_id,
                                                files=files_to_proto(files))
        return self._call(self._stub.SubmitWorkspace, req)

    def score(self, job_id: str, execution_id: str, status: str, *, timeout_policy: str = "",
              group_id: str = "", step: int = 0, task_id: str = "") -> ScoreResult:
        req = reward_pb2.ScoreRequest(job_id=job_id, execution_id=execution_id, status=STR_TO_STATUS[status],
                                      timeout_policy=STR_TO_POLICY[timeout_policy], group_id=group_id,
                                      step=step, task_id=task_id)
        return _result(self._call(self._stub.Score, req))

    def get_score(self, execution_id: str) -> ScoreResult:
        return _result(self._call(self._stub.GetScore, reward_pb2.GetScoreRequest(execution_id=execution_id)))


class ExternalScorerClient:
    """Calls an external harness's ``ExternalScorer`` (used by the reward service for EXTERNAL jobs).

    Channels are cached per address. Any failure becomes a `ScorerError`, so a dead or slow
    external scorer is a scoring error of that execution, never an error of the service (hence
    no ``GrpcClient``: one client for many harness addresses, and no domain errors).
    """

    def __init__(self, *, max_message_mb: int = 256, security: Security | None = None) -> None:
        self.max_message_mb = max_message_mb
        # its own settings (none by default): never the process's token and client certificate
        self.security = security or Security()
        self._channels: dict[str, grpc.Channel] = {}

    def _stub(self, address: str) -> reward_pb2_grpc.ExternalScorerStub:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = open_channel(address, security=self.security,
                                                        max_message_mb=self.max_message_mb)
        return reward_pb2_grpc.ExternalScorerStub(ch)

    def __call__(self, spec: ScorerSpec, inp: ScoreInput, timeout_s: float) -> ScorerOutput:
        req = reward_pb2.ExternalScoreRequest(job_id=inp.job_id, execution_id=inp.execution_id, task_id=inp.task_id,
                                              status=STR_TO_STATUS[inp.status], files=files_to_proto(inp.files))
        try:
            r = self._stub(spec.target).Score(req, timeout=timeout_s)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise ScorerError("timeout", f"external scorer {spec.target} exceeded its {timeout_s:g}s time limit") from None
            raise ScorerError("error", f"external scorer {spec.target} failed: {exc.code().name}: {exc.details()}") from None
        try:
            return parse_output(breakdown_from_proto(r.score, r.breakdown))
        except (ValueError, TypeError) as exc:
            raise ScorerError("error", f"external scorer {spec.target} returned an invalid result: {exc}") from None

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()
        self._channels.clear()
