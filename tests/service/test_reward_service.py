"""The reward service over real gRPC with a real Redis: workspaces, scoring and timeout policies,
safety of untrusted snapshots, scorer failures, an external scorer served by a second real gRPC
server, and outcomes reported to a real trajectory service."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from protos.gyre.v1 import reward_pb2, reward_pb2_grpc
from services.common import errors
from services.common.server import build_server
from services.reward.client import RewardClient
from services.reward.config import RewardConfig
from services.reward.main import build_reward
from services.reward.scorers import ScorerSpec
from services.reward.servicer import FunctionScorerServicer
from services.task.spec import TaskParams, task_from_id, task_ids
from services.trajectory.client import TrajectoryClient
from services.trajectory.config import TrajectoryConfig
from services.trajectory.main import build_trajectory
from tests.support.waiting import wait_until

ME = "tests.service.test_reward_service"
REPO = Path(__file__).resolve().parents[2]
PARAMS = TaskParams(num_modules=3)


def always_half(files: dict[str, bytes], task_id: str, status: str) -> float:
    return 0.5


def never_ends(files: dict[str, bytes], task_id: str, status: str) -> float:
    while True:
        pass


@pytest.fixture
def reward(redis_url: str, tmp_path: Path) -> Iterator:
    servers = []

    def start(**overrides: object) -> RewardClient:
        cfg = RewardConfig(**{"redis_url": redis_url, "spool_dir": str(tmp_path / "spool"), "port": 0,
                              "scorer_workers": 1, "scorer_timeout_s": 20.0, "log_json": False,
                              "scorer_allowlist": (f"entry_point:{ME}:*", "entry_point:tests.nonexistent_module:f",
                                                   "entry_point:tests.support.hostile_scorers:*"),
                              "scorer_paths": (str(REPO / "tests"), str(REPO / "protos")), **overrides})
        server, on_shutdown = build_reward(cfg)
        server.start()
        server.set_serving(True)
        servers.append((server, on_shutdown))
        return RewardClient(server.address, timeout_s=60)

    yield start
    for server, on_shutdown in servers:
        on_shutdown()
        server.stop(0)


def _trajectory_server(redis_url: str, tmp_path: Path, port: int = 0) -> Any:
    """A real trajectory service on ``port`` (0: any), serving."""
    tcfg = TrajectoryConfig(redis_url=redis_url, spool_dir=str(tmp_path / "tspool"), port=port, log_json=False)
    tserver, _ = build_trajectory(tcfg)
    tserver.start()
    tserver.set_serving(True)
    return tserver


def _task_files(task_id: str, n_modules: int) -> dict[str, bytes]:
    task = task_from_id(task_id)
    return {task.module_path(m.name): m.reference_code.encode() for m in task.modules[:n_modules]}


def test_builtin_scoring_and_timeout_policies(reward, redis_url: str) -> None:
    client = reward()
    tid = task_ids(1, params=PARAMS)[0]
    total = task_from_id(tid).num_tests
    # Finished with everything right.
    client.submit_workspace("job", "e-full", _task_files(tid, 3), task_id=tid)
    r = client.score("job", "e-full", "finished", group_id="g", step=2)
    assert (r.state, r.reward, r.excluded, r.tests_passed, r.tests_total) == ("ok", 1.0, False, total, total)
    assert r.metrics["all_passed"] == 1.0 and [m.tests_passed for m in r.modules] == [4, 4, 4]
    # Timed out after one module: partial credit from the preserved workspace.
    for eid, policy in (("e-p", "partial"), ("e-z", "zero"), ("e-x", "exclude")):
        client.submit_workspace("job", eid, _task_files(tid, 1), task_id=tid)
        r = client.score("job", eid, "timeout", timeout_policy=policy, group_id="g", step=2)
        assert r.timeout_policy == policy and r.raw_score == pytest.approx(4 / total)
        assert r.tests_passed == 4 and r.modules[1].error == "missing"
        want = {"partial": (4 / total, False), "zero": (0.0, False), "exclude": (None, True)}[policy]
        assert (r.reward, r.excluded) == (pytest.approx(want[0]) if want[0] else want[0], want[1])
    # The job's own policy wins over the one a harness passes.
    client.configure_job("strict", ScorerSpec(), timeout_policy="zero")
    client.submit_workspace("strict", "e-s", _task_files(tid, 2), task_id=tid)
    r = client.score("strict", "e-s", "timeout", timeout_policy="partial")
    assert (r.timeout_policy, r.reward, r.raw_score) == ("zero", 0.0, pytest.approx(8 / total))
    # Failed executions are left out; nothing was submitted: the empty workspace is scored.
    r = client.score("job", "e-fail", "failed", task_id=tid)
    assert (r.reward, r.excluded, r.state) == (None, True, "ok")
    r = client.score("job", "e-none", "timeout", task_id=tid)
    assert (r.reward, r.tests_passed, r.tests_total) == (0.0, 0, total)
    # Idempotent; the workspace is final once scored; stored in Redis, bytes in the spool.
    again = client.score("job", "e-p", "finished")
    assert again.duplicate and again.status == "timeout" and again.reward == pytest.approx(4 / total)
    with pytest.raises(errors.FailedPrecondition, match="already scored"):
        client.submit_workspace("job", "e-p", {"x": b"1"})
    assert client.get_score("e-full").reward == 1.0
    with pytest.raises(errors.NotFound):
        client.get_score("never")
    r_ = redis.Redis.from_url(redis_url)
    ws = r_.hgetall("gyre:reward:ws:e-full")
    assert ws[b"blob_key"].startswith(b"reward/ws/") and int(ws[b"num_files"]) == 3
    assert all(b"x " not in v for v in ws.values() if v != ws[b"task_id"])  # no file bytes in Redis


def test_latest_snapshot_wins(reward) -> None:
    client = reward()
    tid = task_ids(1, params=PARAMS)[0]
    a = client.submit_workspace("job", "e1", _task_files(tid, 1), task_id=tid)
    b = client.submit_workspace("job", "e1", _task_files(tid, 3), task_id=tid)
    assert (a.version, b.version, b.num_files) == (1, 2, 3)
    assert client.score("job", "e1", "finished").reward == 1.0


@pytest.mark.parametrize(
    ("files", "code"),
    [
        ({"../escape": b"x"}, errors.InvalidArgument),
        ({"/etc/passwd": b"x"}, errors.InvalidArgument),
        ({"src/../../x": b"x"}, errors.InvalidArgument),
        ({"a\\..\\b": b"x"}, errors.InvalidArgument),
        ({"big": b"x" * 2048}, errors.ResourceExhausted),
    ],
)
def test_unsafe_snapshots_are_refused(reward, files: dict[str, bytes], code: type) -> None:
    client = reward(max_file_bytes=1024)
    with pytest.raises(code):
        client.submit_workspace("job", "e-bad", files)
    # Nothing was stored; the service still works.
    r = client.score("job", "e-bad", "finished", task_id=task_ids(1, params=PARAMS)[0])
    assert r.tests_passed == 0 and r.state == "ok"


def test_duplicate_paths_and_bad_requests(reward) -> None:
    client = reward()
    stub = reward_pb2_grpc.RewardStub(client._channel)
    import grpc

    req = reward_pb2.SubmitWorkspaceRequest(execution_id="e", files=[reward_pb2.WorkspaceFile(path="a"),
                                                                     reward_pb2.WorkspaceFile(path="a")])
    with pytest.raises(grpc.RpcError) as err:
        stub.SubmitWorkspace(req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "twice" in err.value.details()
    with pytest.raises(errors.InvalidArgument, match="execution_id is required"):
        client.score("job", "", "finished")
    with pytest.raises(grpc.RpcError) as err:
        stub.Score(reward_pb2.ScoreRequest(execution_id="e"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(errors.InvalidArgument, match="job_id is required"):
        client.configure_job("", ScorerSpec())
    with pytest.raises(grpc.RpcError) as err:
        stub.ConfigureJob(reward_pb2.ConfigureJobRequest(job_id="j", scorer=reward_pb2.ScorerSpec(
            kind=reward_pb2.SCORER_KIND_ENTRY_POINT, target="os.system; rm -rf")))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_scorer_crash_and_timeout_are_clear_errors_not_a_dead_service(reward) -> None:
    client = reward()
    client.configure_job("slow", ScorerSpec(kind="entry_point", target=f"{ME}:never_ends", timeout_s=1.0))
    client.configure_job("bad", ScorerSpec(kind="entry_point", target="tests.nonexistent_module:f"))
    r = client.score("slow", "e-slow", "finished")
    assert (r.state, r.reward, r.excluded) == ("scorer_timeout", None, True) and "time limit" in r.error
    r = client.score("bad", "e-bad", "finished")
    assert r.state == "scorer_error" and "ModuleNotFoundError" in r.error
    client.configure_job("half", ScorerSpec(kind="entry_point", target=f"{ME}:always_half"))
    assert client.score("half", "e-ok", "finished").reward == 0.5


def test_scorers_a_request_may_pick_are_configuration(reward) -> None:
    """ConfigureJob picks among the builtins, the default and the allowlist; arbitrary importable
    functions (os:system, subprocess:getoutput) and unlisted external addresses are refused with
    PERMISSION_DENIED and nothing is written: the job keeps the default scorer."""
    client = reward()
    for kind, target in (("entry_point", "os:system"), ("entry_point", "subprocess:getoutput"),
                         ("entry_point", "tests.support.harness_scorer:fraction_done"), ("external", "127.0.0.1:9")):
        with pytest.raises(errors.PermissionDenied, match="scorer_allowlist"):
            client.configure_job("j-evil", ScorerSpec(kind=kind, target=target))  # type: ignore[arg-type]
    client.submit_workspace("j-evil", "e-evil", {"a": b"1"}, task_id="t")
    r = client.score("j-evil", "e-evil", "finished")
    assert r.scorer == "builtin:xlong-v1"  # the default: nothing of the refused requests was kept
    client.configure_job("ok", ScorerSpec(kind="entry_point", target=f"{ME}:always_half"))  # listed by module
    client.configure_job("ok", ScorerSpec(kind="builtin", target="xlong-v1-tests"))  # builtins: always
    with pytest.raises(ValueError, match="scorer_allowlist entry"):
        RewardConfig(scorer_allowlist=("os.system",))


def test_a_hostile_scorer_through_the_service_gets_nothing_and_the_service_stays_up(reward, monkeypatch) -> None:
    monkeypatch.setenv("GYRE_REWARD_AUTH_TOKEN_SECRET", "not-for-scorers")  # in the service's environment
    client = reward(scorer_timeout_s=3.0)
    client.configure_job("env", ScorerSpec(kind="entry_point", target="tests.support.hostile_scorers:leaked_env"))
    client.configure_job("bomb", ScorerSpec(kind="entry_point", target="tests.support.hostile_scorers:fork_bomb"))
    client.configure_job("half", ScorerSpec(kind="entry_point", target=f"{ME}:always_half"))
    r = client.score("env", "e-env", "finished")
    assert (r.state, r.reward) == ("ok", 0.0)  # no REDIS_*, GYRE_*, *TOKEN*, *SECRET* variable reached it
    r = client.score("bomb", "e-bomb", "finished")
    assert r.state == "scorer_timeout" and r.excluded
    assert client.score("half", "e-half", "finished").reward == 0.5  # another job's score is unaffected


class _SeesCredentials(FunctionScorerServicer):
    def __init__(self, fn: Any, seen: list[str]) -> None:
        super().__init__(fn)
        self.seen = seen

    def Score(self, request: Any, context: Any) -> Any:
        self.seen.extend(str(v) for _, v in context.invocation_metadata())
        return super().Score(request, context)


def test_external_scorers_get_their_own_credential_never_the_services(reward, tmp_path: Path) -> None:
    from services.common import security

    seen: list[str] = []
    ext = build_server("ext-scorer", [(reward_pb2_grpc.add_ExternalScorerServicer_to_server,
                                       _SeesCredentials(lambda f, t, s: 1.0, seen))],
                       service_names=[reward_pb2.DESCRIPTOR.services_by_name["ExternalScorer"].full_name])
    ext.start()
    ext.set_serving(True)
    token_file = tmp_path / "ext-token"
    token_file.write_text("the-external-scorers-own-token\n")
    before = security.current()
    # the reward service's own token (it and its clients use it; the process is both here)
    security.configure(security.Security(auth_token="the-reward-services-token"))
    try:
        client = reward(scorer_allowlist=(f"external:{ext.address}",), external_scorer_token_file=str(token_file))
        client.configure_job("ext", ScorerSpec(kind="external", target=ext.address))
        assert client.score("ext", "e-ext", "finished", task_id="t").reward == 1.0
    finally:
        security.configure(before)
        ext.stop(0)
    assert any("the-external-scorers-own-token" in v for v in seen), seen
    assert not any("the-reward-services-token" in v for v in seen), seen


def test_external_scorer_on_a_second_grpc_server(reward) -> None:
    seen: list[tuple[dict[str, bytes], str, str]] = []

    def grade(files: dict[str, bytes], task_id: str, status: str) -> dict:
        seen.append((files, task_id, status))
        if task_id == "boom":
            raise RuntimeError("external grader broke")
        return {"score": 0.75, "tests_passed": 3, "tests_total": 4, "modules": [["main", 3, 4, ""]]}

    ext = build_server("ext-scorer", [(reward_pb2_grpc.add_ExternalScorerServicer_to_server,
                                       FunctionScorerServicer(grade))],
                       service_names=[reward_pb2.DESCRIPTOR.services_by_name["ExternalScorer"].full_name])
    ext.start()
    ext.set_serving(True)
    try:
        client = reward(scorer_allowlist=(f"external:{ext.address}",))
        client.configure_job("ext", ScorerSpec(kind="external", target=ext.address), timeout_policy="partial")
        client.submit_workspace("ext", "e-ext", {"out/answer.txt": b"42"}, task_id="my-task")
        r = client.score("ext", "e-ext", "timeout")
        assert (r.reward, r.tests_passed, r.scorer) == (0.75, 3, f"external:{ext.address}")
        assert seen == [({"out/answer.txt": b"42"}, "my-task", "timeout")]
        r = client.score("ext", "e-boom", "finished", task_id="boom")
        assert r.state == "scorer_error" and "external grader broke" in r.error
    finally:
        ext.stop(0)
    r = client.score("ext", "e-gone", "finished", task_id="t")  # the external scorer is down now
    assert r.state == "scorer_error" and "UNAVAILABLE" in r.error


def test_outcomes_reach_a_real_trajectory_service(reward, redis_url: str, tmp_path: Path) -> None:
    tcfg = TrajectoryConfig(redis_url=redis_url, spool_dir=str(tmp_path / "tspool"), port=0, log_json=False)
    tserver, _ = build_trajectory(tcfg)
    tserver.start()
    tserver.set_serving(True)
    try:
        client = reward(trajectory_address=tserver.address)
        tid = task_ids(1, params=PARAMS)[0]
        client.submit_workspace("job", "e-t1", _task_files(tid, 3), task_id=tid)
        r = client.score("job", "e-t1", "finished", group_id="g0", step=0)
        assert r.outcome_reported and r.reward == 1.0
        r = client.score("job", "e-t2", "timeout", timeout_policy="exclude", group_id="g0", step=0, task_id=tid)
        assert r.outcome_reported and r.excluded
        with TrajectoryClient(tserver.address) as traj:
            from services.trajectory.records import Outcome

            dup, _ = traj.complete_execution(Outcome(execution_id="e-t1", group_id="g0", status="finished",
                                                     reward=1.0, step=0, job_id="job"))
            assert dup  # the reward service had already reported exactly this outcome
    finally:
        tserver.stop(0)


def test_unreported_outcome_is_reported_on_the_next_score(reward, redis_url: str, tmp_path: Path) -> None:
    from services.common.server import free_port

    port = free_port()
    client = reward(trajectory_address=f"127.0.0.1:{port}")
    tid = task_ids(1, params=PARAMS)[0]
    r = client.score("job", "e-late", "finished", group_id="g", task_id=tid)
    assert not r.outcome_reported and r.state == "ok"  # trajectory is down: score kept, report pending
    tserver = _trajectory_server(redis_url, tmp_path, port)
    try:
        def reported() -> Any:  # scoring again is what reports the pending outcome
            again = client.score("job", "e-late", "finished")
            return again if again.outcome_reported else None

        again = wait_until(reported, 30, "a score that reports the pending outcome", poll_s=0.5)
        assert again.duplicate and again.outcome_reported
    finally:
        tserver.stop(0)


def test_an_outcome_scored_while_trajectory_is_down_is_delivered_without_another_score(
        reward, redis_url: str, tmp_path: Path) -> None:
    """A harness scores a finished execution once: if the trajectory service was down then (the
    crash test killed it), the reward service delivers the outcome by itself once it is back, or
    its group, and with it the step, would never complete."""
    from services.common.server import free_port
    from services.trajectory.records import Outcome

    port = free_port()
    client = reward(trajectory_address=f"127.0.0.1:{port}")
    tid = task_ids(1, params=PARAMS)[0]
    r = client.score("job", "e-owed", "finished", group_id="g", task_id=tid)
    assert not r.outcome_reported and r.state == "ok"
    tserver = _trajectory_server(redis_url, tmp_path, port)
    try:
        wait_until(lambda: client.get_score("e-owed").outcome_reported,  # GetScore reads; it reports nothing
                   60, "the owed outcome to be reported", poll_s=0.1)
        with TrajectoryClient(tserver.address) as traj:
            dup, _ = traj.complete_execution(Outcome(execution_id="e-owed", group_id="g", status="finished",
                                                     reward=r.reward, step=0, job_id="job"))
        assert dup  # the trajectory service already had exactly this outcome
    finally:
        tserver.stop(0)
