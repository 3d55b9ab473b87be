"""Job files: the ``[job]`` table of a TOML file is a ``JobSpec`` in the shared schema.

    gyre submit deploy/config/job.toml --num_steps 4 --algorithm.learning_rate 3e-4 \
        --tasks.params.num_modules 3

A flag names a field of the spec (``--mode``), of a section (``--algorithm.kl_coef``,
``--evaluation.tasks``) or a task parameter (``--tasks.params.KEY``); ``-`` and ``_`` are the
same; ``--steps``, ``--learning-rate``, ``--temperature``, ``--eval-tasks`` and ``--eval-every``
are short for their fields. Values are typed by the field (numbers, ``true``/``false``). Light to import: no gRPC.
"""

from __future__ import annotations

import secrets
import time
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from services.scheduler.jobs import Algorithm, Evaluation, JobSpec

REPO = Path(__file__).resolve().parents[2]
DEFAULT_JOB_FILE = REPO / "deploy" / "config" / "job.toml"
_SECTIONS: dict[str, type] = {"algorithm": Algorithm, "evaluation": Evaluation}
# Short flags of earlier `gyre run` versions, kept as aliases of the spec's fields.
ALIASES = {"steps": "num_steps", "learning_rate": "algorithm.learning_rate", "lr": "algorithm.learning_rate",
           "temperature": "algorithm.temperature", "eval_tasks": "evaluation.tasks", "eval_every": "evaluation.every"}


def new_job_id(prefix: str = "job") -> str:
    """A fresh, readable job id: ``{prefix}-{yyyymmdd-hhmmss}-{4 hex}``."""
    return f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def read_job_table(path: str | Path) -> dict[str, Any]:
    """The ``[job]`` table of a TOML file (ValueError naming the file when it is missing or bad)."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"job file {str(p)!r} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"job file {str(p)!r} is not valid TOML: {exc}") from None
    table = data.get("job")
    if not isinstance(table, dict):
        raise ValueError(f"job file {str(p)!r} has no [job] table")
    return table


def apply_overrides(table: Mapping[str, Any], argv: Sequence[str]) -> dict[str, Any]:
    """``--field value`` pairs on top of a job table (nested copies, the input is not changed)."""
    out: dict[str, Any] = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in table.items()}
    if isinstance(out.get("tasks"), dict):
        out["tasks"] = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in out["tasks"].items()}
    args = list(argv)
    if len(args) % 2:
        raise ValueError(f"flag {args[-1]!r} needs a value")
    for flag, raw in zip(args[::2], args[1::2]):
        if not flag.startswith("--"):
            raise ValueError(f"expected --field value, got {flag!r}")
        name = flag[2:].replace("-", "_")
        path = ALIASES.get(name, name).split(".")
        if path[0] == "tasks" and len(path) == 3 and path[1] == "params":
            tasks = out.setdefault("tasks", {})
            tasks.setdefault("params", {})[flag[2:].split(".", 2)[2]] = raw
        elif path[0] == "tasks" and len(path) == 2 and path[1] == "generator":
            out.setdefault("tasks", {})["generator"] = raw
        elif len(path) == 2 and path[0] in _SECTIONS:
            out.setdefault(path[0], {})[path[1]] = _typed(_SECTIONS[path[0]], path[1], raw, flag)
        elif len(path) == 1:
            out[path[0]] = _typed(JobSpec, path[0], raw, flag)
        else:
            raise ValueError(f"unknown job flag {flag!r}; use --FIELD, --algorithm.FIELD, --evaluation.FIELD, "
                             f"--tasks.generator or --tasks.params.KEY")
    return out


def _typed(cls: type, name: str, raw: str, flag: str) -> Any:
    hints = {f.name: str(f.type) for f in fields(cls)}
    if name not in hints:
        raise ValueError(f"unknown job flag {flag!r}; known fields: {', '.join(sorted(hints))}")
    hint = hints[name]
    if "None" in hint and raw.lower() in ("none", ""):
        return None
    try:
        if hint.startswith("int"):
            return int(raw)
        if hint.startswith("float"):
            return float(raw)
        if hint == "bool":
            if raw.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1", "yes")
    except ValueError:
        raise ValueError(f"{flag} {raw!r} is not a valid {hint.split(' ')[0]}") from None
    if hint.startswith("tuple"):
        return tuple(x for x in raw.split(",") if x)
    return raw


def load_job(path: str | Path = DEFAULT_JOB_FILE, argv: Sequence[str] = (), *, job_id: str = "") -> JobSpec:
    """A validated spec from a job file plus ``--field value`` overrides; a missing ``job_id`` gets
    a fresh one (``job_id`` given here wins over the file)."""
    table = apply_overrides(read_job_table(path), argv)
    if job_id:
        table["job_id"] = job_id
    table.setdefault("job_id", new_job_id())
    return JobSpec.from_dict(table)
