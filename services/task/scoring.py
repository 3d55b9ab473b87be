"""Grading a built-in XLong workspace: run every test (visible and hidden) of every module.

The reward service's built-in scorer calls `score_workspace`; evaluation of the warm start uses it
too, so "pass rate" means the same everywhere: an execution *passes* when every test of every
module passes, and its reward is the fraction of tests that pass (partial credit). Module code is
read from ``src/<module>.gs``; a missing or undecodable file fails that module's tests.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from services.task.dsl import DslError, run_program
from services.task.spec import TaskSpec

__all__ = ["ModuleScore", "TaskScore", "score_workspace"]

_MAX_CODE_BYTES = 4096


@dataclass(frozen=True)
class ModuleScore:
    name: str
    passed: int
    total: int
    error: str

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
    def reward(self) -> float:
        """Fraction of all tests that pass."""
        return self.passed / self.total if self.total else 0.0

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


def score_workspace(task: TaskSpec, files: Mapping[str, bytes]) -> TaskScore:
    """Run all tests of `task` against the module code found in `files`."""
    codes = {m.name: c for m in task.modules if (c := _read_code(files, task.module_path(m.name))) is not None}
    scores = []
    for m in task.modules:
        if m.name not in codes:
            scores.append(ModuleScore(m.name, 0, len(m.tests), "missing"))
            continue
        passed, error = 0, ""
        for x, want in m.tests:
            try:
                passed += run_program(codes[m.name], x, modules=codes, name=m.name) == want
            except DslError as e:
                error = error or e.reason
        scores.append(ModuleScore(m.name, passed, len(m.tests), error))
    return TaskScore(tuple(scores))
