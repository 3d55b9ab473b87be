"""Grading a built-in XLong workspace: run every test (visible and hidden) of every module.

The reward service's builtin scorers ``xlong-v1`` (`score`) and ``xlong-v1-tests`` (`score_tests`,
no attempt discount) wrap `score_workspace`. `TaskScore.all_passed` is true when every test of
every module passes, after any number of attempts. A job's pass rates (held-out evaluation, the
training pass rate in its metrics) count an execution as passed when its *reward* is 1.0
(services.scheduler.controller): with the default `xlong-v1` scorer that means every module was
right on its first attempt, since a module fixed after a failing report earns at most 0.5.

Reward (partial credit): each module earns the fraction of its tests that pass, discounted by
``ATTEMPT_DISCOUNT ** (attempts - 1)`` when the harness recorded how many attempts the module took
(``harness/attempts.json``, written by the built-in harness, never by the model). Getting a module
right the first time is worth more than getting it right after a failing report and a retry; that
is the signal that teaches the policy the right line instead of leaning on fixes. Without the
file (another harness), or with ``discount=1``, the reward is the plain fraction of tests passing.

Module code is read from ``src/<module>.gs``; a missing or undecodable file fails that module.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.task.dsl import DslError, run_program
from services.task.spec import ModuleSpec, TaskSpec, task_from_id

__all__ = ["ModuleScore", "TaskScore", "score_workspace", "score", "score_tests", "ATTEMPTS_PATH", "ATTEMPT_DISCOUNT",
           "MODULE_KINDS", "module_kind", "first_attempt_by_kind"]

_MAX_CODE_BYTES = 4096
ATTEMPTS_PATH = "harness/attempts.json"
ATTEMPT_DISCOUNT = 0.5


@dataclass(frozen=True)
class ModuleScore:
    name: str
    passed: int
    total: int
    error: str
    attempts: int = 1
    credit: float = 0.0  # fraction of tests passing, discounted by attempts

    @property
    def ok(self) -> bool:
        return self.passed == self.total


@dataclass(frozen=True)
class TaskScore:
    modules: tuple[ModuleScore, ...]

    @property
    def passed(self) -> int:
        return sum(m.passed for m in self.modules)

    @property
    def total(self) -> int:
        return sum(m.total for m in self.modules)

    @property
    def tests_fraction(self) -> float:
        """Fraction of all tests that pass."""
        return self.passed / self.total if self.total else 0.0

    @property
    def reward(self) -> float:
        """Test-weighted mean of the modules' attempt-discounted credit."""
        return sum(m.credit * m.total for m in self.modules) / self.total if self.total else 0.0

    @property
    def all_passed(self) -> bool:
        return self.passed == self.total


def _read_code(files: Mapping[str, bytes], path: str) -> str | None:
    raw = files.get(path)
    if raw is None or len(raw) > _MAX_CODE_BYTES:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _read_attempts(files: Mapping[str, bytes]) -> dict[str, int]:
    raw = files.get(ATTEMPTS_PATH)
    if raw is None or len(raw) > _MAX_CODE_BYTES:
        return {}
    try:
        data = json.loads(raw)
    except ValueError:
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): int(v) for k, v in data.items() if isinstance(v, int) and not isinstance(v, bool) and v >= 1}


def score_workspace(task: TaskSpec, files: Mapping[str, bytes], *, discount: float = ATTEMPT_DISCOUNT) -> TaskScore:
    """Run all tests of `task` against the module code found in `files`."""
    if not 0 < discount <= 1:
        raise ValueError(f"discount must be in (0, 1], got {discount}")
    codes = {m.name: c for m in task.modules if (c := _read_code(files, task.module_path(m.name))) is not None}
    attempts = _read_attempts(files)
    scores = []
    for m in task.modules:
        n = min(attempts.get(m.name, 1), 64)
        if m.name not in codes:
            scores.append(ModuleScore(m.name, 0, len(m.tests), "missing", n, 0.0))
            continue
        passed, error = 0, ""
        for x, want in m.tests:
            try:
                passed += run_program(codes[m.name], x, modules=codes, name=m.name) == want
            except DslError as e:
                error = error or e.reason
        credit = passed / len(m.tests) * discount ** (n - 1)
        scores.append(ModuleScore(m.name, passed, len(m.tests), error, n, credit))
    return TaskScore(tuple(scores))


MODULE_KINDS = ("call", "sub", "rsub", "plain")
"""What a module's steps ask for, the first that applies: it starts from a call to an earlier module
(the line must copy that module's name), it has a ``sub`` step (the warm start's planted habit), an
``rsub`` step, or only ``add`` / ``mul``."""


def module_kind(module: ModuleSpec) -> str:
    """The module's kind (`MODULE_KINDS`)."""
    ops = {step.split()[0] for step in module.steps[1:]}
    if module.calls:
        return "call"
    return "sub" if "sub" in ops else "rsub" if "rsub" in ops else "plain"


def first_attempt_by_kind(task: TaskSpec, result: TaskScore) -> dict[str, tuple[int, int]]:
    """Per module kind: (modules, modules whose every test passed on the first attempt). A job's pass
    rate needs every module right the first time, so this says which kind holds it back."""
    out = {k: (0, 0) for k in MODULE_KINDS}
    for spec, got in zip(task.modules, result.modules, strict=True):
        kind = module_kind(spec)
        n, ok = out[kind]
        out[kind] = (n + 1, ok + int(got.ok and got.attempts == 1))
    return out


def _verdict(result: TaskScore) -> dict[str, Any]:
    """A `TaskScore` in the form reward scorers return (services.reward.scorers.parse_output)."""
    return {
        "score": result.reward,
        "tests_passed": result.passed,
        "tests_total": result.total,
        "modules": [[m.name, m.passed, m.total, m.error] for m in result.modules],
        "metrics": {
            "all_passed": float(result.all_passed),
            "tests_fraction": result.tests_fraction,
            "modules_passed": float(sum(m.ok for m in result.modules)),
            "attempts": float(sum(m.attempts for m in result.modules)),
        },
    }


def score(files: Mapping[str, bytes], task_id: str, status: str) -> dict[str, Any]:
    """Builtin reward scorer ``xlong-v1``: tests passing, each module discounted by its attempts."""
    return _verdict(score_workspace(task_from_id(task_id), files, discount=ATTEMPT_DISCOUNT))


def score_tests(files: Mapping[str, bytes], task_id: str, status: str) -> dict[str, Any]:
    """Builtin reward scorer ``xlong-v1-tests``: the plain fraction of tests passing."""
    return _verdict(score_workspace(task_from_id(task_id), files, discount=1.0))
