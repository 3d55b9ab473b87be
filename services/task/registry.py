"""Task families: the one place that names them (light to import: dotted paths, resolved late).

A **task family** is everything Gyre knows about one kind of task, by name:

    TaskFamily(name="xlong-v1",
               generator="services.task.spec:task_generator",   fn(params, step, groups) -> list[bytes]
               heldout="services.task.spec:heldout_tasks",      fn(params, n) -> list[bytes]
               scorer="services.task.scoring:score",            fn(files, task_id, status), builtin "xlong-v1"
               other_scorers={"xlong-v1-tests": "services.task.scoring:score_tests"},
               runner="services.task.families.xlong:run")       what the harness (services.harness) runs

The scheduler names a family as a job's task generator, the reward service as a builtin scorer and
the harness by the prefix of a task id (``<family>/...``); none of them imports task code: they
ask this module for a dotted path and `load` it when a job needs it, so the scheduler never pays
for torch, numpy or a tokenizer.

Adding a family is one file: ``services/task/families/<name>.py`` that declares
``FAMILY = TaskFamily(...)`` (keep its module-level imports light; import heavy code inside the
functions). Every module of that package is registered on first lookup. A family outside the
repository calls `register` (or `register_module("pkg.module")`) in the process that needs it.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TaskFamily", "load", "register", "register_module", "get_family", "family_of_task", "families",
           "builtin_scorers"]

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
_PATH_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$")
_FAMILIES_PACKAGE = "services.task.families"


@dataclass(frozen=True, kw_only=True)
class TaskFamily:
    """One task family; every callable is a ``module:function`` path, imported only when used."""

    name: str
    """The family's name and the first segment of its task ids (``xlong-v1`` -> ``xlong-v1/...``)."""
    generator: str
    """Training tasks: ``fn(params: Mapping[str, str], step: int, groups: int) -> list[bytes]``, one
    payload per group, deterministic (a step re-enqueued after a crash gets the same tasks)."""
    heldout: str = ""
    """Evaluation tasks: ``fn(params, n) -> list[bytes]``, ``n`` payloads of the held-out split,
    deterministic; empty when the family has no held-out set."""
    scorer: str = ""
    """Its builtin reward scorer, registered under the family's name: ``fn(files: dict[str, bytes],
    task_id, status)`` returning what services.reward.scorers.parse_output takes (a number or a
    dict with ``score``); empty when the family has none."""
    other_scorers: Mapping[str, str] = field(default_factory=dict)
    """Further builtin scorers of the family by name (variants, e.g. ``xlong-v1-tests``), same contract."""
    default_scorer: str = ""
    """Name of the builtin scorer a job of this family uses unless it names another; empty means the
    family's own (``name``) when it has ``scorer``."""
    runner: str = ""
    """One execution in the built-in harness: ``fn(harness, lease, task_id, *, preserve, cancelled)
    -> services.task.runner.RunOutcome``; empty when Gyre has no harness for the family."""

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name):
            raise ValueError(f"task family name {self.name!r} must be 1-64 characters from A-Z a-z 0-9 _ -")
        for what, path in [("generator", self.generator), ("heldout", self.heldout), ("runner", self.runner),
                           ("scorer", self.scorer), *((f"scorer {n!r}", p) for n, p in self.other_scorers.items())]:
            if (path or what == "generator") and not _PATH_RE.match(path):
                raise ValueError(f"task family {self.name!r}: {what} must look like 'package.module:function', "
                                 f"got {path[:80]!r}")
        for name in self.other_scorers:
            if not _NAME_RE.match(name) or name == self.name:
                raise ValueError(f"task family {self.name!r}: scorer name {name!r} must be 1-64 characters "
                                 "from A-Z a-z 0-9 _ - and differ from the family's name")
        if not self.default_scorer and self.scorer:
            object.__setattr__(self, "default_scorer", self.name)
        if self.default_scorer and self.default_scorer not in self.scorers:
            raise ValueError(f"task family {self.name!r}: default_scorer {self.default_scorer!r} is not one of its "
                             f"scorers ({', '.join(self.scorers) or 'none'})")

    @property
    def scorers(self) -> dict[str, str]:
        """Every builtin scorer of the family: name -> ``module:function``."""
        own = {self.name: self.scorer} if self.scorer else {}
        return {**own, **self.other_scorers}


def load(path: str) -> Callable[..., Any]:
    """The callable at ``module:function``; ValueError when it cannot be imported or is not callable."""
    module, sep, attr = path.partition(":")
    if not (sep and module and attr):
        raise ValueError(f"{path!r} is not a 'module:function' path")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{path!r} cannot be imported: {exc}") from None
    if not callable(fn):
        raise ValueError(f"{path!r} is not callable")
    return fn  # type: ignore[no-any-return]


_FAMILIES: dict[str, TaskFamily] = {}
_lock = threading.RLock()
_discovered = False


def _discover() -> None:
    """Register every module of services/task/families once (each declares ``FAMILY``)."""
    global _discovered
    with _lock:
        if _discovered:
            return
        _discovered = True  # first, so that register() inside the loop does not recurse
        try:
            package = importlib.import_module(_FAMILIES_PACKAGE)
            for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
                if not info.name.startswith("_"):
                    register_module(f"{_FAMILIES_PACKAGE}.{info.name}")
        except BaseException:
            _discovered = False  # a broken family module fails every lookup, not just the first
            raise


def register(family: TaskFamily) -> TaskFamily:
    """Make ``family`` known by its name (again registering the same record is a no-op); ValueError
    when another family already has that name or one of its scorer names."""
    _discover()
    with _lock:
        known = _FAMILIES.get(family.name)
        if known == family:
            return family
        if known is not None:
            raise ValueError(f"task family {family.name!r} is already registered")
        taken = builtin_scorers()
        clash = sorted(set(family.scorers) & set(taken))
        if clash:
            raise ValueError(f"task family {family.name!r}: scorer names {clash} already belong to another family")
        _FAMILIES[family.name] = family
        return family


def register_module(module: str) -> TaskFamily:
    """Import ``module`` and register the `TaskFamily` it declares as ``FAMILY``."""
    family = getattr(importlib.import_module(module), "FAMILY", None)
    if not isinstance(family, TaskFamily):
        raise ValueError(f"module {module!r} declares no FAMILY = TaskFamily(...)")
    return register(family)


def families() -> dict[str, TaskFamily]:
    """Every known family by name (a copy, sorted by name)."""
    _discover()
    with _lock:
        return dict(sorted(_FAMILIES.items()))


def get_family(name: str) -> TaskFamily:
    """The family called ``name``; ValueError naming the known ones when there is none."""
    known = families()
    if name not in known:
        raise ValueError(f"unknown task family {name!r}; known: {', '.join(known)}.")
    return known[name]


def family_of_task(task_id: str) -> TaskFamily:
    """The family a task id belongs to (its first segment: ``arith-v1/train/4/n3.v10`` -> arith-v1)."""
    return get_family(task_id.partition("/")[0])


def builtin_scorers() -> dict[str, str]:
    """Every family's builtin scorers: scorer name -> ``module:function``, sorted by name."""
    return dict(sorted((name, path) for fam in families().values() for name, path in fam.scorers.items()))
