"""Reward scorers: the pluggable seam that turns a workspace into a score.

Three kinds, named by a `ScorerSpec`:

* ``builtin`` - a scorer of a task family, by name (services.task.registry maps it to a dotted
  path, imported in the worker): ``xlong-v1`` (default): fraction of tests passing, each module
  discounted by the attempts the harness recorded; ``xlong-v1-tests``: the plain fraction of tests
  passing. Both rebuild the tests from the task id, so a workspace cannot change what it is graded
  against. ``arith-v1``: fraction of turns answered right, from ``answers.json``. A builtin scorer
  has the entry-point contract below.
* ``entry_point`` - target ``package.module:function``; the function is called as
  ``fn(files: dict[str, bytes], task_id: str, status: str)`` and returns a number, a dict with
  ``score`` (and optional ``tests_passed``, ``tests_total``, ``modules``, ``metrics``, ``detail``)
  or a `ScorerOutput`.
* ``external`` - target ``host:port`` of an ``ExternalScorer`` gRPC service that a harness runs
  (the call lives in services.reward.client, the only module here that speaks gRPC).

Builtin and entry-point scorers run inside sandboxed worker processes (services.reward.sandbox);
this module only holds the data types and the in-worker dispatch (`run_local`).
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from services.task import registry

__all__ = ["ScorerSpec", "ScoreInput", "ModuleResult", "ScorerOutput", "ScorerError", "run_local", "parse_output",
           "Allowlist"]

ScorerKind = Literal["builtin", "entry_point", "external"]
_ENTRY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$")
_ADDR_RE = re.compile(r"^[A-Za-z0-9.\-\[\]:]+:[0-9]{1,5}$")
MAX_MODULES = 4096


class ScorerError(Exception):
    """A scorer failed (raised, crashed, timed out or answered garbage); `state` says which."""

    def __init__(self, state: Literal["error", "timeout"], message: str) -> None:
        super().__init__(message)
        self.state = state


@dataclass(frozen=True, kw_only=True)
class ScorerSpec:
    """Which scorer grades a job's executions."""

    kind: ScorerKind = "builtin"
    target: str = "xlong-v1"
    timeout_s: float = 0.0
    """Time limit of one scoring, seconds; 0 means the service default."""

    def __post_init__(self) -> None:
        if self.kind == "builtin":
            known = registry.builtin_scorers()
            if self.target not in known:
                raise ValueError(f"unknown builtin scorer {self.target!r}; known: {', '.join(known)}.")
        elif self.kind == "entry_point":
            if not _ENTRY_RE.match(self.target):
                raise ValueError(f"entry-point scorer must look like 'package.module:function', got {self.target[:80]!r}.")
        elif self.kind == "external":
            if not _ADDR_RE.match(self.target):
                raise ValueError(f"external scorer target must be host:port, got {self.target[:80]!r}.")
        else:
            raise ValueError(f"scorer kind must be builtin, entry_point or external, got {self.kind!r}.")
        if not (math.isfinite(self.timeout_s) and 0 <= self.timeout_s <= 3600):
            raise ValueError(f"scorer timeout_s must be in [0, 3600], got {self.timeout_s}.")

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.target}"


@dataclass(frozen=True)
class Allowlist:
    """The scorers a reward service runs: every builtin, its default scorer, and what its operator
    listed (``scorer_allowlist``): ``entry_point:pkg.module:function``, ``entry_point:pkg.module:*``
    (any function of that module), ``external:host:port`` and ``external:host:*`` (any port of a
    host the operator trusts, e.g. harness machines serving their own scorer). A job's request only picks among them."""

    entries: tuple[str, ...] = ()
    default: str = ""

    def __post_init__(self) -> None:
        for entry in self.entries:
            kind, _, target = entry.partition(":")
            probe = target[:-1] + ("x" if kind == "entry_point" else "1") if target.endswith(":*") else target
            try:
                if kind not in ("entry_point", "external"):
                    raise ValueError("only entry_point and external scorers are listed (builtins are always allowed)")
                ScorerSpec(kind=kind, target=probe)  # type: ignore[arg-type]
            except ValueError as exc:
                raise ValueError(f"scorer_allowlist entry {entry!r}: {exc}") from None

    def allows(self, spec: ScorerSpec) -> bool:
        if spec.kind == "builtin" or spec.name == self.default:
            return True
        if spec.name in self.entries:
            return True
        if spec.kind == "entry_point":
            return f"entry_point:{spec.target.partition(':')[0]}:*" in self.entries
        return spec.kind == "external" and f"external:{spec.target.rpartition(':')[0]}:*" in self.entries

    def check(self, spec: ScorerSpec) -> None:
        """PermissionDenied (a clear sentence) unless ``spec`` is allowed."""
        if not self.allows(spec):
            from services.common.errors import PermissionDenied

            raise PermissionDenied(
                f"scorer {spec.name} is not allowed by this reward service: builtin scorers and its default "
                f"({self.default or 'none'}) are; an operator allows others in the reward service's "
                "scorer_allowlist (GYRE_REWARD_SCORER_ALLOWLIST), e.g. entry_point:my_pkg.scoring:grade")


@dataclass(frozen=True, kw_only=True)
class ScoreInput:
    job_id: str
    execution_id: str
    task_id: str
    status: str
    files: Mapping[str, bytes]


@dataclass(frozen=True)
class ModuleResult:
    name: str
    tests_passed: int
    tests_total: int
    error: str = ""


@dataclass(frozen=True, kw_only=True)
class ScorerOutput:
    """A scorer's verdict before the timeout policy. Invariant: 0 <= tests_passed <= tests_total."""

    score: float
    tests_passed: int = 0
    tests_total: int = 0
    modules: tuple[ModuleResult, ...] = ()
    metrics: dict[str, float] = field(default_factory=dict)
    detail: str = ""

    def __post_init__(self) -> None:
        if not math.isfinite(self.score):
            raise ValueError(f"score must be a finite number, got {self.score!r}")
        if not 0 <= self.tests_passed <= self.tests_total:
            raise ValueError(f"need 0 <= tests_passed <= tests_total, got {self.tests_passed}/{self.tests_total}")
        if len(self.modules) > MAX_MODULES:
            raise ValueError(f"at most {MAX_MODULES} module results, got {len(self.modules)}")

    def to_json(self) -> dict[str, Any]:
        return {
            "score": self.score,
            "tests_passed": self.tests_passed,
            "tests_total": self.tests_total,
            "modules": [[m.name, m.tests_passed, m.tests_total, m.error] for m in self.modules],
            "metrics": dict(self.metrics),
            "detail": self.detail,
        }


def parse_output(value: Any) -> ScorerOutput:
    """Normalize what a scorer returned (number, dict or ScorerOutput); ValueError if it is garbage."""
    if isinstance(value, ScorerOutput):
        return value
    if isinstance(value, bool):
        return ScorerOutput(score=float(value))
    if isinstance(value, (int, float)):
        return ScorerOutput(score=float(value))
    if not isinstance(value, Mapping) or "score" not in value:
        raise ValueError(f"a scorer must return a number or a dict with 'score', got {type(value).__name__}")
    modules = tuple(
        ModuleResult(str(m[0])[:128], int(m[1]), int(m[2]), str(m[3] if len(m) > 3 else "")[:256])
        for m in value.get("modules", ())
    )
    metrics = {str(k)[:64]: float(v) for k, v in dict(value.get("metrics", {})).items()}
    return ScorerOutput(
        score=float(value["score"]),
        tests_passed=int(value.get("tests_passed", 0)),
        tests_total=int(value.get("tests_total", 0)),
        modules=modules,
        metrics=metrics,
        detail=str(value.get("detail", ""))[:1024],
    )


def run_local(spec: ScorerSpec, inp: ScoreInput) -> ScorerOutput:
    """Run a builtin or entry-point scorer in this process (called inside a sandbox worker)."""
    if spec.kind == "builtin":
        fn = registry.load(registry.builtin_scorers()[spec.target])
    elif spec.kind == "entry_point":
        module, _, attr = spec.target.partition(":")
        fn = getattr(importlib.import_module(module), attr)
        if not callable(fn):
            raise ValueError(f"entry point {spec.target!r} is not callable")
    else:
        raise ValueError(f"scorer kind {spec.kind!r} does not run in a sandbox worker")
    return parse_output(fn(dict(inp.files), inp.task_id, inp.status))
