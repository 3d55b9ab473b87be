"""Scorers in sandbox workers: correct results, and every way a scorer can misbehave yields a
clear ScorerError while the pool keeps working. The functions below are the entry points."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.reward.sandbox import SandboxSpec, ScorerPool
from services.reward.scorers import ScoreInput, ScorerError, ScorerSpec, parse_output
from services.task.spec import task_from_id, task_ids

ME = "tests.unit.test_reward_scorers"
REPO = Path(__file__).resolve().parents[2]


def count_files(files: dict[str, bytes], task_id: str, status: str) -> dict:
    return {"score": len(files) / 10, "tests_passed": len(files), "tests_total": 10,
            "metrics": {"timeout": float(status == "timeout")}, "detail": task_id}


def sleepy(files: dict[str, bytes], task_id: str, status: str) -> float:
    time.sleep(60)
    return 1.0


def killer(files: dict[str, bytes], task_id: str, status: str) -> float:
    os.kill(os.getpid(), signal.SIGKILL)
    return 1.0


def raiser(files: dict[str, bytes], task_id: str, status: str) -> float:
    raise RuntimeError("grader exploded")


def garbage(files: dict[str, bytes], task_id: str, status: str) -> str:
    return "a lot"


def chatty(files: dict[str, bytes], task_id: str, status: str) -> float:
    print("noise on stdout " * 1000)  # must not corrupt the worker protocol
    return 0.25


def hog(files: dict[str, bytes], task_id: str, status: str) -> float:
    blob = bytearray(8 << 30)  # over the worker's address-space cap
    return float(len(blob))


def exiter(files: dict[str, bytes], task_id: str, status: str) -> float:
    raise SystemExit(3)


@pytest.fixture(scope="module")
def pool() -> Iterator[ScorerPool]:
    p = ScorerPool(size=2, sandbox=SandboxSpec(memory_mb=512, paths=(str(REPO / "tests"),)))
    yield p
    p.close()


def _inp(files: dict[str, bytes], task_id: str = "t", status: str = "finished") -> ScoreInput:
    return ScoreInput(job_id="j", execution_id="e", task_id=task_id, status=status, files=files)


def test_builtin_scorer_grades_the_xlong_task(pool: ScorerPool) -> None:
    task = task_from_id(task_ids(1, split="heldout")[0])
    ref = {task.module_path(m.name): m.reference_code.encode() for m in task.modules}
    spec = ScorerSpec(kind="builtin", target="xlong-v1")
    out = pool.score(spec, _inp(ref, task.task_id), timeout_s=30)
    assert out.score == 1.0 and out.tests_passed == out.tests_total == task.num_tests
    assert out.metrics["all_passed"] == 1.0
    half = dict(list(ref.items())[:2])
    out = pool.score(spec, _inp(half, task.task_id, "timeout"), timeout_s=30)
    assert out.score == pytest.approx(out.tests_passed / out.tests_total) and 0 < out.score < 1
    assert [m.error for m in out.modules[2:]] == ["missing"] * (len(task.modules) - 2)


def test_builtin_scorer_refuses_unknown_task_ids(pool: ScorerPool) -> None:
    with pytest.raises(ScorerError, match="not a built-in XLong task id"):
        pool.score(ScorerSpec(), _inp({}, "xlong-v1/../../etc"), timeout_s=30)


def test_entry_point_scorer(pool: ScorerPool) -> None:
    out = pool.score(ScorerSpec(kind="entry_point", target=f"{ME}:count_files"),
                     _inp({"a": b"1", "b/c": b"2"}, "task-9", "timeout"), timeout_s=30)
    assert (out.score, out.tests_passed, out.detail, out.metrics) == (0.2, 2, "task-9", {"timeout": 1.0})
    out = pool.score(ScorerSpec(kind="entry_point", target=f"{ME}:chatty"), _inp({}), timeout_s=30)
    assert out.score == 0.25


@pytest.mark.parametrize(
    ("fn", "state", "match"),
    [
        ("sleepy", "timeout", "time limit"),
        ("killer", "error", "crashed"),
        ("raiser", "error", "grader exploded"),
        ("garbage", "error", "must return a number"),
        ("hog", "error", "MemoryError"),
        ("exiter", "error", "SystemExit"),
        ("no_such_function", "error", "AttributeError"),
    ],
)
def test_misbehaving_scorers_fail_clearly_and_the_pool_survives(pool: ScorerPool, fn: str, state: str,
                                                                 match: str) -> None:
    with pytest.raises(ScorerError, match=match) as err:
        pool.score(ScorerSpec(kind="entry_point", target=f"{ME}:{fn}"), _inp({}), timeout_s=2.0)
    assert err.value.state == state
    out = pool.score(ScorerSpec(kind="entry_point", target=f"{ME}:count_files"), _inp({"a": b""}), timeout_s=30)
    assert out.score == 0.1


def test_specs_and_outputs_are_validated() -> None:
    for bad in (dict(kind="builtin", target="nope"), dict(kind="entry_point", target="os.system"),
                dict(kind="entry_point", target="a:b; rm"), dict(kind="external", target="no-port"),
                dict(kind="shell", target="x"), dict(timeout_s=-1)):
        with pytest.raises(ValueError):
            ScorerSpec(**bad)  # type: ignore[arg-type]
    assert parse_output(True).score == 1.0
    for bad_out in ({"no": 1}, {"score": float("nan")}, {"score": 1, "tests_passed": 3, "tests_total": 2}, None):
        with pytest.raises((ValueError, TypeError)):
            parse_output(bad_out)
