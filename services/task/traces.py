"""Execution traces: the JSONL workload format, loaded into per-execution numpy arrays.

The scheduler's simulator (services/scheduler/sim) plays them offline; the trace-v1 task family
(services/task/families/trace.py, `gyre replay --trace`) plays them on the live stack.

One execution per line::

    {"step": int, "group": str, "execution_id": str,
     "turns": [{"prompt_tokens": int, "gen_tokens": int, "env_s": float,
                "agent": str?, "role": "main" | "subagent" | "summary"?, "compact_to": int?}, ...],
     "timeout_s": float?}

``prompt_tokens`` is the new context a turn appends (prefill), ``gen_tokens`` what the model
generates, ``env_s`` the tool time after the model call. Steps must be 0..S-1 with none empty;
execution ids are unique. The generator lives in ``bench/traces/generate.py``.

The optional per-turn fields (``gyre replay --trace`` plays them on the live stack, see
docs/replay.md) say whose context a turn extends: ``agent`` (default "main"; every agent keeps
its own context), ``role`` (default "main" for the agent "main", else "subagent"; "summary" for a
compaction's summarizer, which reads the main context) and, on a summary turn only,
``compact_to``: the main context restarts from the system prompt plus the first ``compact_to``
tokens of the summary (at most its ``gen_tokens``, and shorter than the main context it replaces).
Any other field is an error naming the line (and the turn).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from services.common.roles import AGENT_ROLES


class Speeds(Protocol):
    """Solo model speeds (services.scheduler.sim.cost_model.CostModel has them)."""

    @property
    def prefill_tok_s(self) -> float: ...
    @property
    def decode_tok_s(self) -> float: ...


@dataclass(frozen=True, eq=False)
class TraceExecution:
    """One execution of a trace. Invariant: the three turn arrays share one length >= 1."""

    step: int
    group: str
    execution_id: str
    prompt_tokens: np.ndarray  # int64 per turn
    gen_tokens: np.ndarray  # int64 per turn
    env_s: np.ndarray  # float64 per turn
    timeout_s: float | None = None
    # per turn (replay): whose context it extends, its role, and what a compaction keeps (-1: none);
    # None: every turn the main agent's
    agents: tuple[str, ...] | None = None
    roles: tuple[str, ...] | None = None
    compact_to: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.prompt_tokens)
        if n < 1 or len(self.gen_tokens) != n or len(self.env_s) != n:
            raise ValueError(f"execution {self.execution_id!r}: turns must be non-empty with all fields set")
        if self.step < 0:
            raise ValueError(f"execution {self.execution_id!r}: step must be >= 0, got {self.step}")
        if (self.prompt_tokens < 0).any() or (self.gen_tokens < 0).any() or (self.env_s < 0).any():
            raise ValueError(f"execution {self.execution_id!r}: token counts and env_s must be >= 0")
        if not np.isfinite(self.env_s).all():
            raise ValueError(f"execution {self.execution_id!r}: env_s must be finite")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"execution {self.execution_id!r}: timeout_s must be > 0, got {self.timeout_s}")

    @property
    def total_tokens(self) -> int:
        return int(self.prompt_tokens.sum() + self.gen_tokens.sum())

    def model_work_s(self, cost: Speeds) -> np.ndarray:
        """Solo seconds of each turn's model call (prefill + decode, alone on a cell)."""
        return self.prompt_tokens / cost.prefill_tok_s + self.gen_tokens / cost.decode_tok_s

    def solo_latency_s(self, cost: Speeds) -> float:
        """Wall time alone on a cell: every model call at full speed plus all tool time."""
        latency = float(self.model_work_s(cost).sum() + self.env_s.sum())
        return min(latency, self.timeout_s) if self.timeout_s is not None else latency


EXECUTION_FIELDS = frozenset({"step", "group", "execution_id", "turns", "timeout_s"})
TURN_FIELDS = frozenset({"prompt_tokens", "gen_tokens", "env_s", "agent", "role", "compact_to"})


def _turn_meta(turns: list, gen: np.ndarray, prompt: np.ndarray
               ) -> tuple[tuple[str, ...] | None, tuple[str, ...] | None, np.ndarray | None]:
    """The optional per-turn fields, checked (None when no turn has any)."""
    if not any(("agent" in t or "role" in t or "compact_to" in t) for t in turns):
        return None, None, None
    agents, roles, keep = [], [], np.full(len(turns), -1, dtype=np.int64)
    main = 0  # tokens of the main context since its last compaction
    for k, t in enumerate(turns):
        agent = t.get("agent", "main")
        if not isinstance(agent, str) or not agent or len(agent) > 64 or "/" in agent:
            raise ValueError(f"turn {k}: agent must be a name of 1-64 characters without '/', got {agent!r}")
        role = t.get("role", "main" if agent == "main" else "subagent")
        if role not in AGENT_ROLES:
            raise ValueError(f"turn {k}: role must be one of {', '.join(AGENT_ROLES)}, got {role!r}")
        if (role == "main") != (agent == "main"):
            raise ValueError(f"turn {k}: the agent 'main' and only it has the role 'main' (agent {agent!r}, "
                             f"role {role!r})")
        if role == "main":
            main += int(prompt[k] + gen[k])
        if "compact_to" in t:
            c = int(t["compact_to"])
            if role != "summary":
                raise ValueError(f"turn {k}: compact_to is only for summary turns (role {role!r})")
            if c < 0 or c > gen[k]:
                raise ValueError(f"turn {k}: compact_to {c} must keep between 0 and the summary's {gen[k]} "
                                 f"gen_tokens")
            if c >= main:
                raise ValueError(f"turn {k}: compact_to {c} is not shorter than the main context it compacts "
                                 f"({main} tokens)")
            keep[k], main = c, c
        agents.append(agent)
        roles.append(role)
    return tuple(agents), tuple(roles), keep


def parse_execution(obj: dict, where: str = "") -> TraceExecution:
    """Build one execution from a decoded JSON line; ValueError names the bad field."""
    try:
        unknown = sorted(set(obj) - EXECUTION_FIELDS)
        if unknown:
            raise ValueError(f"unknown field {unknown[0]!r} (an execution has {', '.join(sorted(EXECUTION_FIELDS))})")
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns:
            raise ValueError("'turns' must be a non-empty list")
        for k, t in enumerate(turns):
            if not isinstance(t, dict):
                raise ValueError(f"turn {k} must be a JSON object")
            bad = sorted(set(t) - TURN_FIELDS)
            if bad:
                raise ValueError(f"turn {k}: unknown field {bad[0]!r} (a turn has {', '.join(sorted(TURN_FIELDS))})")
        prompt = np.array([int(t["prompt_tokens"]) for t in turns], dtype=np.int64)
        gen = np.array([int(t["gen_tokens"]) for t in turns], dtype=np.int64)
        env = np.array([float(t["env_s"]) for t in turns], dtype=np.float64)
        timeout = obj.get("timeout_s")
        eid = str(obj["execution_id"])
        if (prompt < 0).any() or (gen < 0).any():
            k = int(np.flatnonzero((prompt < 0) | (gen < 0))[0])
            raise ValueError(f"turn {k}: prompt_tokens and gen_tokens must be >= 0")
        agents, roles, keep = _turn_meta(turns, gen, prompt)
        return TraceExecution(step=int(obj["step"]), group=str(obj["group"]), execution_id=eid,
                              prompt_tokens=prompt, gen_tokens=gen, env_s=env,
                              timeout_s=None if timeout is None else float(timeout),
                              agents=agents, roles=roles, compact_to=keep)
    except KeyError as exc:
        raise ValueError(f"trace{where}: missing field {exc}") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"trace{where}: {exc}") from None


def validate_trace(executions: Sequence[TraceExecution]) -> None:
    """Steps 0..S-1 all present, unique execution ids, a group never spans two steps."""
    if not executions:
        raise ValueError("trace has no executions")
    ids = {e.execution_id for e in executions}
    if len(ids) != len(executions):
        raise ValueError("trace has duplicate execution_id values")
    steps = sorted({e.step for e in executions})
    if steps != list(range(len(steps))):
        raise ValueError(f"trace steps must be 0..{len(steps) - 1} with none missing, got {steps[:10]}...")
    group_step: dict[str, int] = {}
    for e in executions:
        if group_step.setdefault(e.group, e.step) != e.step:
            raise ValueError(f"group {e.group!r} appears in steps {group_step[e.group]} and {e.step}")


def load_trace(path: str | Path) -> list[TraceExecution]:
    """Read and validate a trace file."""
    out: list[TraceExecution] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"trace {path}:{lineno}: not JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise ValueError(f"trace {path}:{lineno}: each line must be a JSON object")
            out.append(parse_execution(obj, f" {path}:{lineno}"))
    validate_trace(out)
    return out


def dump_execution(e: TraceExecution) -> str:
    turns: list[dict[str, object]] = [{"prompt_tokens": int(p), "gen_tokens": int(g), "env_s": round(float(s), 2)}
                                      for p, g, s in zip(e.prompt_tokens, e.gen_tokens, e.env_s, strict=True)]
    if e.agents is not None and e.roles is not None and e.compact_to is not None:
        for t, agent, role, keep in zip(turns, e.agents, e.roles, e.compact_to, strict=True):
            t.update(agent=agent, role=role)
            if keep >= 0:
                t["compact_to"] = int(keep)
    obj: dict = {"step": e.step, "group": e.group, "execution_id": e.execution_id, "turns": turns}
    if e.timeout_s is not None:
        obj["timeout_s"] = e.timeout_s
    return json.dumps(obj, separators=(",", ":"))


def save_trace(executions: Iterable[TraceExecution], path: str | Path) -> None:
    """Write a trace atomically (tmp + rename)."""
    path = Path(path)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for e in executions:
            f.write(dump_execution(e) + "\n")
    tmp.replace(path)


@dataclass(frozen=True)
class TraceStats:
    """What a trace looks like under a cost model (solo speeds)."""

    steps: int
    executions: int
    executions_per_step: float
    mean_tokens_per_execution: float
    mean_turns: float
    mean_latency_s: float
    max_latency_s: float
    # Per step: (max latency - 90th-percentile latency) / max latency, averaged over steps. In a
    # one-wave rollout this is the share of the rollout phase spent on its last 10% executions.
    tail_share: float
    env_share: float  # tool time / solo latency, over all executions


def trace_stats(executions: Sequence[TraceExecution], cost: Speeds) -> TraceStats:
    lat = np.array([e.solo_latency_s(cost) for e in executions])
    steps = np.array([e.step for e in executions])
    n_steps = int(steps.max()) + 1
    shares = []
    for s in range(n_steps):
        ls = np.sort(lat[steps == s])
        p90 = ls[max(0, math.ceil(0.9 * len(ls)) - 1)]
        shares.append((ls[-1] - p90) / ls[-1] if ls[-1] > 0 else 0.0)
    env = sum(float(e.env_s.sum()) for e in executions)
    return TraceStats(steps=n_steps, executions=len(executions), executions_per_step=len(executions) / n_steps,
                      mean_tokens_per_execution=float(np.mean([e.total_tokens for e in executions])),
                      mean_turns=float(np.mean([len(e.env_s) for e in executions])),
                      mean_latency_s=float(lat.mean()), max_latency_s=float(lat.max()),
                      tail_share=float(np.mean(shares)), env_share=env / float(lat.sum()))
