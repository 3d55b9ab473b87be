"""The scorer sandbox against hostile scorers (tests/support/hostile_scorers.py): each attempt
to reach the service's environment, files outside the workspace, other processes, the network
(a real redis-server), or to exhaust processes, CPU, output or disk fails or is cut; the pool
goes on scoring, and one job's workers never serve another job.

Real bubblewrap sandboxes, real worker processes; the reward service itself is exercised in
tests/service/test_reward_service.py (allowlist, external scorers' credentials, a hostile scorer
through the RPCs)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.reward.sandbox import SandboxSpec, ScorerPool
from services.reward.scorers import ScoreInput, ScorerError, ScorerSpec
from tests.support.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
HOSTILE = "tests.support.hostile_scorers"
UID_BASE = 62000

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (make install)")


@pytest.fixture(scope="module")
def pool() -> Iterator[ScorerPool]:
    os.environ["GYRE_TEST_SECRET_TOKEN"] = "sekrit-token-123"  # in the service's environment
    p = ScorerPool(size=2, sandbox=SandboxSpec(paths=(str(REPO / "tests"),), uid_base=UID_BASE, memory_mb=512))
    yield p
    p.close()
    os.environ.pop("GYRE_TEST_SECRET_TOKEN", None)


def _score(pool: ScorerPool, fn: str, task_id: str = "t", job: str = "hostile", timeout_s: float = 20.0,
           files: dict[str, bytes] | None = None) -> dict:
    out = pool.score(ScorerSpec(kind="entry_point", target=f"{HOSTILE}:{fn}"),
                     ScoreInput(job_id=job, execution_id="e", task_id=task_id, status="finished",
                                files=files or {"main.py": b"print(1)"}), timeout_s=timeout_s)
    return json.loads(out.detail) if out.detail else {"score": out.score}


def _still_scores(pool: ScorerPool) -> None:
    assert _score(pool, "find_mark", job="benign", files={"a.py": b""})["workspace"] == ["a.py"]


def test_the_service_environment_is_not_visible(pool: ScorerPool) -> None:
    env = _score(pool, "read_env")
    assert set(env) <= {"PATH", "HOME", "TMPDIR", "LANG", "LC_CTYPE", "PWD", "PYTHONPATH", "PYTHONDONTWRITEBYTECODE",
                        "PYTHONNOUSERSITE"}
    assert "sekrit-token-123" not in json.dumps(env)


def test_files_outside_the_workspace_are_not_there(pool: ScorerPool, tmp_path: Path) -> None:
    secret = tmp_path / "service-secret.txt"  # what the service can read (a token file, its data)
    secret.write_text("the service's secret")
    assert _score(pool, "read_file", str(secret)) == {"error": "FileNotFoundError"}
    seen = _score(pool, "look_around", files={"main.py": b"x", "pkg/mod.py": b"y"})
    assert seen["workspace"] == ["main.py", "pkg"] and seen["cwd"].startswith("/ws/")
    assert seen["/root"] == [".pyenv"] or seen["/root"] in ([], "FileNotFoundError")  # only the interpreter
    # /tmp is the sandbox's own tmpfs: only the parents of read-only binds below it (a checkout in /tmp)
    bound = {Path(p).relative_to("/tmp").parts[0] for p in pool.sandbox.read_only_paths() if p.startswith("/tmp/")}
    assert seen["/home"] == "FileNotFoundError" and set(seen["/tmp"]) <= bound
    assert set(seen[str(REPO)]) <= {"services", "tests", ".venv"}  # not the data dirs, not the secrets
    assert seen["uid"] != 0
    # writes go nowhere but the workspace and /tmp: the code and the system are read-only
    for target in (str(REPO / "services" / "owned.py"), "/usr/owned", str(tmp_path / "owned")):
        assert _score(pool, "write_outside", target)["error"] in ("OSError", "PermissionError", "FileNotFoundError")
    assert not (REPO / "services" / "owned.py").exists() and not (tmp_path / "owned").exists()


def test_other_processes_are_not_visible(pool: ScorerPool) -> None:
    seen = _score(pool, "look_around")
    assert os.getpid() not in seen["pids"] and len(seen["pids"]) <= 4, seen["pids"]  # init, worker, scoring
    assert "sekrit-token-123" not in seen["init_environ"]


def test_no_network_not_even_the_local_redis(pool: ScorerPool, redis_url: str) -> None:
    host_port = redis_url.split("//", 1)[1].split("/", 1)[0]
    import redis

    assert redis.Redis.from_url(redis_url).ping()  # it is there for the service
    assert "error" in _score(pool, "connect", host_port)
    assert "error" in _score(pool, "connect", "1.1.1.1:53")


def _sandbox_processes() -> list[int]:
    """Host processes running as one of the pool's worker users."""
    out = []
    for p in os.listdir("/proc"):
        try:
            if p.isdigit() and UID_BASE <= os.stat(f"/proc/{p}").st_uid < UID_BASE + 1000:
                out.append(int(p))
        except FileNotFoundError:
            pass
    return out


@pytest.mark.parametrize("fn", ["fork_bomb", "busy_loop"])
def test_fork_bombs_and_endless_loops_are_cut_and_leave_nothing(pool: ScorerPool, fn: str) -> None:
    with pytest.raises(ScorerError, match="time limit") as err:
        _score(pool, fn, timeout_s=2.0)
    assert err.value.state == "timeout"
    _still_scores(pool)
    if os.geteuid() == 0:  # the killed worker's sandbox is gone with everything it forked
        live = {w.proc.pid for w in pool._all}  # noqa: SLF001 - the pool's own live workers
        left: list[int] = []

        def gone() -> bool:  # each live worker: its init and itself
            left[:] = _sandbox_processes()
            return len(left) <= 2 * len(live)

        try:
            wait_until(gone, 30, "the killed worker's sandbox processes to go", poll_s=0.1)
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {left}") from None


def test_huge_output_answer_and_files_are_cut(pool: ScorerPool) -> None:
    assert _score(pool, "huge_output") == {"score": 0.5}  # its prints went nowhere
    with pytest.raises(ScorerError, match="exceeds"):
        _score(pool, "huge_answer")
    assert _score(pool, "huge_file")["error"] == "OSError"  # file size cap (and a bounded tmpfs)
    _still_scores(pool)


def test_a_job_never_sees_what_another_job_left(pool: ScorerPool) -> None:
    assert _score(pool, "leave_mark", "from-job-a", job="job-a") == {"score": 1.0}
    same_job = _score(pool, "find_mark", job="job-a")
    assert not same_job["global"] and not same_job["cwd"]  # each scoring: a fresh child, a fresh directory
    other = _score(pool, "find_mark", job="job-b")
    assert other == {"global": [], "tmp": False, "cwd": False, "workspace": ["main.py"]}
    assert {w.job_id for w in pool._all} <= {"job-a", "job-b", "benign", "hostile"}  # noqa: SLF001
