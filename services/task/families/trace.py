"""``trace-v1``: executions that follow a scheduler trace on the live stack (``gyre replay --trace``).

Each execution of the trace (services/task/traces.py, with the per-turn ``agent``, ``role``
and ``compact_to`` fields; docs/replay.md) becomes one execution of a job: the built-in harness
plays its turns against the gateway as an agent harness would, and the trainer trains on what was
recorded. A turn appends ``prompt_tokens`` fresh token ids (tool output) to its agent's context,
generates exactly ``gen_tokens`` (no stop token: the end of sequence is ignored until then; the
model's output is kept, whatever it is), and then waits ``env_s x time_scale`` (the tool time).

* Every agent keeps its own context, starting from the system prompt (the same ``SYSTEM_TOKENS``
  ids in every execution, as a harness's system prompt is: engines reuse its KV).
* A ``summary`` turn reads the main context (plus its own prompt); with ``compact_to`` the main
  context then restarts from the system prompt plus the first ``compact_to`` tokens of the summary.
* Reward (the family's scorer): the fraction of the trace's turns played, so an execution that ran
  out of time scores partially from its preserved workspace; the payload is a load shape, not a
  task the policy could get better at.

Generator params: ``path`` (the trace file, read where the scheduler runs) and ``time_scale``
(default 1). Step ``s`` of a job is the trace's step ``s``; its executions are the job's groups
(one execution each), in file order.
"""

from __future__ import annotations

import json
import threading
import time
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.task.registry import TaskFamily

if TYPE_CHECKING:
    from services.task.runner import RunnerHost, RunOutcome

NAME = "trace-v1"
SYSTEM_TOKENS = 32  # the system prompt every agent context starts from
PROGRESS_PATH = "trace.json"
_cache: dict[tuple[str, float], list[Any]] = {}
_cache_lock = threading.Lock()


def _load(path: str) -> list[Any]:
    """The trace at ``path`` (validated), cached by path and modification time."""
    from services.task.traces import load_trace

    p = Path(path)
    try:
        key = (str(p.resolve()), p.stat().st_mtime)
    except OSError as exc:
        raise ValueError(f"trace file {path!r} cannot be read: {exc.strerror}") from None
    with _cache_lock:
        if key not in _cache:
            _cache.clear()
            _cache[key] = load_trace(p)
        return _cache[key]


def _time_scale(params: Mapping[str, str]) -> float:
    try:
        scale = float(params.get("time_scale", "1"))
    except ValueError:
        raise ValueError(f"time_scale must be a number, got {params.get('time_scale')!r}") from None
    if not scale >= 0:
        raise ValueError(f"time_scale must be >= 0, got {scale}")
    return scale


def generate(params: Mapping[str, str], step: int, groups: int) -> list[bytes]:
    """The payloads of the trace's step ``step``: one per execution, ``groups`` of them."""
    unknown = sorted(set(params) - {"path", "time_scale"})
    if unknown:
        raise ValueError(f"generator {NAME!r} takes the params path and time_scale, not {unknown[0]!r}")
    if not params.get("path"):
        raise ValueError(f"generator {NAME!r} needs the param path (a trace file)")
    scale = _time_scale(params)
    trace = _load(params["path"])
    execs = [e for e in trace if e.step == step]
    if not execs:
        raise ValueError(f"the trace {params['path']} has no step {step} (it has {trace[-1].step + 1})")
    if len(execs) != groups:
        raise ValueError(f"the trace's step {step} has {len(execs)} executions; the job asks for {groups} "
                         f"groups per step (one execution each)")
    return [json.dumps({"task_id": f"{NAME}/{e.execution_id}", "time_scale": scale, "turns": _turns(e)},
                       separators=(",", ":")).encode() for e in execs]


def _turns(e: Any) -> list[dict[str, Any]]:
    out = []
    for k in range(len(e.prompt_tokens)):
        turn: dict[str, Any] = {"prompt_tokens": int(e.prompt_tokens[k]), "gen_tokens": int(e.gen_tokens[k]),
                                "env_s": float(e.env_s[k]), "agent": e.agents[k] if e.agents else "main",
                                "role": e.roles[k] if e.roles else "main"}
        if e.compact_to is not None and e.compact_to[k] >= 0:
            turn["compact_to"] = int(e.compact_to[k])
        out.append(turn)
    return out


def run(harness: RunnerHost, lease: Any, task_id: str, *, preserve: Callable[[dict[str, bytes]], None],
        cancelled: threading.Event) -> RunOutcome:
    """Play one execution's turns through the gateway (see the module doc)."""
    import numpy as np

    from services.task.agent import CallContext, Sampling
    from services.task.runner import RunOutcome

    payload = json.loads(lease.payload)
    turns, scale = payload["turns"], float(payload.get("time_scale", 1.0))
    eid = lease.execution_id
    vocab = int(harness.codec_for(lease).vocab_size)
    low = min(16, vocab // 2)  # clear of the special ids at the start of the vocabulary
    rng = np.random.default_rng(zlib.crc32(eid.encode()))
    system = np.random.default_rng(0).integers(low, vocab, SYSTEM_TOKENS).astype(np.int32)
    contexts: dict[str, np.ndarray] = {}
    done = calls = prompt_tokens = output_tokens = 0
    status, error = "finished", ""
    deadline = min(lease.deadline_s, time.time() + harness.cfg.timeout_s) if lease.deadline_s else \
        time.time() + harness.cfg.timeout_s
    temperature = harness.temperature(lease)

    def progress() -> dict[str, bytes]:
        return {PROGRESS_PATH: json.dumps({"turns_done": done, "turns": len(turns), "calls": calls,
                                           "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
                                           "contexts": {a: int(len(c)) for a, c in contexts.items()}}).encode()}

    for k, turn in enumerate(turns):
        agent, role = str(turn["agent"]), str(turn["role"])
        if role == "summary":  # the summarizer reads the main context
            base = contexts.get("main", system)
        else:
            base = contexts.get(agent, system)
        fresh = rng.integers(low, vocab, int(turn["prompt_tokens"])).astype(np.int32)
        ctx = np.concatenate([base, fresh])
        gen_tokens = int(turn["gen_tokens"])
        out = np.zeros(0, np.int32)
        if gen_tokens > 0:
            remaining = deadline - time.time()
            if remaining <= 0 or cancelled.is_set():
                status = "timeout"
                break
            context = CallContext(job_id=harness.record_job(lease), execution_id=eid, call_id=f"{agent}/{k}",
                                  agent_id=agent, role=role)  # type: ignore[arg-type]
            gen = harness.model.generate(context, ctx, Sampling(temperature=temperature, max_new_tokens=gen_tokens,
                                                                stop_token_ids=(), seed=zlib.crc32(f"{eid}/{k}".encode())),
                                         timeout_s=remaining)
            out = np.asarray(gen.output_ids, dtype=np.int32)
            calls += 1
            prompt_tokens += len(ctx)
            output_tokens += len(out)
        if role == "summary":
            if "compact_to" in turn:
                contexts["main"] = np.concatenate([system, out[:int(turn["compact_to"])]])
        else:
            contexts[agent] = np.concatenate([ctx, out])
        done = k + 1
        if turn["env_s"] and scale > 0 and cancelled.wait(float(turn["env_s"]) * scale):
            status = "timeout"
            break
        if done < len(turns):
            preserve(progress())
    if status == "finished" and done < len(turns):
        status, error = "timeout", f"{done} of {len(turns)} turns played"
    return RunOutcome(status=status, error=error, files=progress(),
                      log={"turns": done, "calls": calls, "prompt_tokens": prompt_tokens,
                           "output_tokens": output_tokens})


def score(files: Mapping[str, bytes], task_id: str, status: str) -> dict[str, Any]:
    """The fraction of the trace's turns the execution played."""
    try:
        p = json.loads(files[PROGRESS_PATH])
        turns, done = max(int(p["turns"]), 1), int(p["turns_done"])
    except (KeyError, ValueError, TypeError):
        return {"score": 0.0, "detail": f"no readable {PROGRESS_PATH} in the workspace"}
    return {"score": min(done, turns) / turns, "tests_passed": min(done, turns), "tests_total": turns,
            "metrics": {"calls": float(p.get("calls", 0)), "output_tokens": float(p.get("output_tokens", 0))}}


FAMILY = TaskFamily(
    name=NAME,
    generator="services.task.families.trace:generate",
    scorer="services.task.families.trace:score",
    runner="services.task.families.trace:run",
)
