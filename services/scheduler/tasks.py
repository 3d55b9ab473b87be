"""Task sources: the payload each group of a step runs (pluggable by name).

A job names its tasks either explicitly (payloads, cycled over groups and steps) or by a
generator. A generator is ``fn(params, step, groups) -> list[bytes]`` (one opaque payload per group
of that step; deterministic, so re-enqueueing a step after a crash produces the same tasks). A
generator name is, in this order of lookup:

* one registered here (`register_task_generator`), built in: ``external`` - JSON
  ``{"step": s, "group": g, "index": i, "external": true}`` with ``i = s * groups + g``, for
  executions whose harness lives outside Gyre (no task family);
* a task family of services.task.registry (``xlong-v1``, ``arith-v1``, ``numbered``, ... see
  services/task/families/); its generator is imported only when a job uses it, so the scheduler
  never imports task code at start;
* ``module:function``.

``TASK_GENERATORS`` is the table of the first two (registered names shadow family names).

`heldout_payloads` asks a family for its held-out evaluation tasks.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, MutableMapping

from services.scheduler.jobs import MAX_PAYLOAD_BYTES, JobSpec
from services.task import registry

TaskGenerator = Callable[[Mapping[str, str], int, int], list[bytes]]


def _external(params: Mapping[str, str], step: int, groups: int) -> list[bytes]:
    if params:
        raise ValueError(f"generator 'external' takes no params, got {sorted(params)}")
    return [json.dumps({"step": step, "group": g, "index": step * groups + g, "external": True}).encode()
            for g in range(groups)]


class _GeneratorTable(MutableMapping[str, TaskGenerator]):
    """Every generator by name: those registered here over the task families' (loaded on lookup)."""

    def __init__(self, own: dict[str, TaskGenerator]) -> None:
        self._own = own

    def __getitem__(self, name: str) -> TaskGenerator:
        if name in self._own:
            return self._own[name]
        family = registry.families().get(name)
        if family is None:
            raise KeyError(name)
        return registry.load(family.generator)

    def __contains__(self, name: object) -> bool:
        return name in self._own or name in registry.families()  # without importing the generator

    def __setitem__(self, name: str, fn: TaskGenerator) -> None:
        self._own[name] = fn

    def __delitem__(self, name: str) -> None:
        del self._own[name]

    def __iter__(self) -> Iterator[str]:
        return iter(sorted({*self._own, *registry.families()}))

    def __len__(self) -> int:
        return len({*self._own, *registry.families()})


TASK_GENERATORS: MutableMapping[str, TaskGenerator] = _GeneratorTable({"external": _external})


def register_task_generator(name: str, fn: TaskGenerator) -> None:
    """Make ``fn`` available to jobs as generator ``name`` (ahead of a task family of that name)."""
    if not name or ":" in name:
        raise ValueError(f"generator name {name!r} must be non-empty and contain no ':'")
    TASK_GENERATORS[name] = fn


def resolve_generator(name: str) -> TaskGenerator:
    """The generator called ``name`` (registered, a task family, or ``module:function``); ValueError if none."""
    if name in TASK_GENERATORS:
        return TASK_GENERATORS[name]
    if ":" in name:
        try:
            return registry.load(name)
        except ValueError as exc:
            raise ValueError(f"task generator {exc}") from None
    raise ValueError(f"unknown task generator {name!r}; known: {', '.join(TASK_GENERATORS)} "
                     "(or give module:function)")


def _checked(out: list[bytes], name: str, want: int) -> list[bytes]:
    if len(out) != want:
        raise ValueError(f"task generator {name!r} returned {len(out)} payloads, expected {want}")
    for p in out:
        if not isinstance(p, bytes) or len(p) > MAX_PAYLOAD_BYTES:
            raise ValueError(f"task generator {name!r} must return payloads of bytes, at most {MAX_PAYLOAD_BYTES} each")
    return out


def step_payloads(spec: JobSpec, step: int) -> list[bytes]:
    """One task payload per group of ``step`` (deterministic in spec and step)."""
    groups = spec.groups_per_step
    if spec.tasks.payloads:
        pool = spec.tasks.payloads
        return [pool[(step * groups + g) % len(pool)] for g in range(groups)]
    out = resolve_generator(spec.tasks.generator)(dict(spec.tasks.params), step, groups)
    return _checked(out, spec.tasks.generator, groups)


def heldout_payloads(generator_name: str, params: Mapping[str, str], n: int) -> list[bytes]:
    """``n`` held-out evaluation payloads of the task family ``generator_name`` (deterministic)."""
    if n < 1:
        raise ValueError(f"need at least one held-out task, got n={n}")
    families = registry.families()
    if generator_name not in families:
        raise ValueError(f"generator {generator_name!r} is not a task family, so it has no held-out tasks; "
                         f"families: {', '.join(families)}")
    family = families[generator_name]
    if not family.heldout:
        raise ValueError(f"task family {generator_name!r} has no held-out tasks")
    return _checked(registry.load(family.heldout)(dict(params), n), generator_name, n)


def validate_task_source(spec: JobSpec) -> None:
    """Fail fast at submit: the generator exists and yields step 0 with these params."""
    step_payloads(spec, 0)
