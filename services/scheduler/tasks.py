"""Task sources: the payload each group of a step runs (pluggable by name).

A job names its tasks either explicitly (payloads, cycled over groups and steps) or by a
generator registered here. A generator is ``fn(params, step, groups) -> list[bytes]`` (one opaque
payload per group of that step; deterministic, so re-enqueueing a step after a crash produces the
same tasks). Generators are looked up by name in ``TASK_GENERATORS`` or as ``module:function``.

Built in:

* ``xlong-v1`` - the built-in XLong task family (``services.task.spec``). Payload: JSON
  ``{"task_id": "xlong-v1/<split>/<seed>/<knobs>"}``; the harness and the reward scorer rebuild the
  task from its id. Params: ``split`` (train), ``start_seed`` (0) and any ``TaskParams`` knob
  (num_modules, min_ops, max_ops, call_pct, visible_tests, hidden_tests). Group ``g`` of step ``s``
  gets seed ``start_seed + s * groups + g``.
* ``arith-v1`` - multi-turn arithmetic for real instruct models (``services.task.arith``); same
  payload shape; params ``split``, ``start_seed``, ``turns``, ``max_operand``.
* ``numbered`` - JSON ``{"step": s, "group": g, "index": i}`` with ``i = s * groups + g`` (demos, tests).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Mapping

from services.scheduler.jobs import MAX_PAYLOAD_BYTES, JobSpec

TaskGenerator = Callable[[Mapping[str, str], int, int], list[bytes]]


def _numbered(params: Mapping[str, str], step: int, groups: int) -> list[bytes]:
    if params:
        raise ValueError(f"generator 'numbered' takes no params, got {sorted(params)}")
    return [json.dumps({"step": step, "group": g, "index": step * groups + g}).encode() for g in range(groups)]


_XLONG_KNOBS = ("num_modules", "min_ops", "max_ops", "call_pct", "visible_tests", "hidden_tests")


def _xlong(params: Mapping[str, str], step: int, groups: int) -> list[bytes]:
    from services.task.spec import TaskParams, task_ids  # late: only jobs that use it pay the import

    unknown = set(params) - {"split", "start_seed", *_XLONG_KNOBS}
    if unknown:
        raise ValueError(f"generator 'xlong-v1' got unknown params {sorted(unknown)}; "
                         f"known: split, start_seed, {', '.join(_XLONG_KNOBS)}")
    try:
        knobs = TaskParams(**{k: int(params[k]) for k in _XLONG_KNOBS if k in params})
        start = int(params.get("start_seed", "0")) + step * groups
    except (TypeError, ValueError) as exc:
        raise ValueError(f"generator 'xlong-v1' params are invalid: {exc}") from None
    ids = task_ids(groups, split=params.get("split", "train"), params=knobs, start_seed=start)
    return [json.dumps({"task_id": t}).encode() for t in ids]


def _arith(params: Mapping[str, str], step: int, groups: int) -> list[bytes]:
    from services.task.arith import task_generator  # late: only jobs that use it pay the import

    return task_generator(params, step, groups)


TASK_GENERATORS: dict[str, TaskGenerator] = {"numbered": _numbered, "xlong-v1": _xlong, "arith-v1": _arith}


def register_task_generator(name: str, fn: TaskGenerator) -> None:
    """Make ``fn`` available to jobs as generator ``name``."""
    if not name or ":" in name:
        raise ValueError(f"generator name {name!r} must be non-empty and contain no ':'")
    TASK_GENERATORS[name] = fn


def resolve_generator(name: str) -> TaskGenerator:
    """The generator called ``name`` (registered, or ``module:function``); ValueError if none."""
    if name in TASK_GENERATORS:
        return TASK_GENERATORS[name]
    module, sep, attr = name.partition(":")
    if sep and module and attr:
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"task generator {name!r} cannot be imported: {exc}") from None
        if callable(fn):
            return fn  # type: ignore[no-any-return]
    raise ValueError(f"unknown task generator {name!r}; known: {', '.join(sorted(TASK_GENERATORS))} "
                     f"(or give module:function)")


def step_payloads(spec: JobSpec, step: int) -> list[bytes]:
    """One task payload per group of ``step`` (deterministic in spec and step)."""
    groups = spec.groups_per_step
    if spec.tasks.payloads:
        pool = spec.tasks.payloads
        return [pool[(step * groups + g) % len(pool)] for g in range(groups)]
    out = resolve_generator(spec.tasks.generator)(dict(spec.tasks.params), step, groups)
    if len(out) != groups:
        raise ValueError(f"task generator {spec.tasks.generator!r} returned {len(out)} payloads for {groups} groups")
    for p in out:
        if not isinstance(p, bytes) or len(p) > MAX_PAYLOAD_BYTES:
            raise ValueError(f"task generator {spec.tasks.generator!r} must return bytes of at most "
                             f"{MAX_PAYLOAD_BYTES} per group")
    return out


def validate_task_source(spec: JobSpec) -> None:
    """Fail fast at submit: the generator exists and yields step 0 with these params."""
    step_payloads(spec, 0)
