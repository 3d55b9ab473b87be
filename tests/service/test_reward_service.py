"""The reward service over real gRPC with a real Redis: workspaces, scoring and timeout policies,
safety of untrusted snapshots, scorer failures, an external scorer served by a second real gRPC
server, and outcomes reported to a real trajectory service."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

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

ME = "tests.service.test_reward_service"
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
                              "scorer_workers": 1, "scorer_timeout_s": 20.0, "log_json": False, **overrides})
        server, on_shutdown = build_reward(cfg)
        server.start()
        server.set_serving(True)
        servers.append((server, on_shutdown))
        return RewardClient(server.address, timeout_s=60)

    yield start
    for server, on_shutdown in servers:
        on_shutdown()
        server.stop(0)


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
        client = reward()
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
    tcfg = TrajectoryConfig(redis_url=redis_url, spool_dir=str(tmp_path / "tspool"), port=port, log_json=False)
    tserver, _ = build_trajectory(tcfg)
    tserver.start()
    tserver.set_serving(True)
    try:
        deadline = time.monotonic() + 30
        while True:
            again = client.score("job", "e-late", "finished")
            if again.outcome_reported or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert again.duplicate and again.outcome_reported
    finally:
        tserver.stop(0)
