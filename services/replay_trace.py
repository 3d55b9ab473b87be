"""``gyre replay --trace FILE.jsonl [--time-scale X]``: a trace's executions on the live stack.

A scheduler trace (services/task/traces.py, with the per-turn ``agent``, ``role`` and
``compact_to`` fields of docs/replay.md) becomes one job on a stack this command brings up and
takes down, as ``gyre run`` does (the same services, the same report): the trace's steps are the
job's steps, each of its executions one execution (a group of one) of the ``trace-v1`` task
family, which the built-in harness plays against the gateway turn by turn (fresh tool-output
tokens, exactly ``gen_tokens`` generated, ``env_s x time_scale`` of tool time); the trainer trains
on what the gateway recorded, in the same job.

    gyre replay --trace bench/traces/small.jsonl --time-scale 0.1 [--mode async] [--engines 2] ...

Any other flag is a ``gyre run`` flag (the stack: --engines, --quiet, --report-dir, --data-dir,
--time-budget-s) or a job field (--mode, --num-steps, --algorithm.learning-rate, ...). A trace
that does not parse (a negative token count, an unknown field, a compaction longer than the
context it compacts) is one sentence naming its line, and nothing starts.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
JOB_FILE = REPO / "deploy" / "config" / "job-trace.toml"
USAGE = "gyre replay --trace FILE.jsonl [--time-scale X] [gyre run flags] [--JOB-FIELD value ...]"


def trace_job_args(path: str, time_scale: float) -> list[str]:
    """Job flags that make the trace at ``path`` a job (ValueError: one sentence on what is wrong)."""
    from services.task.traces import load_trace

    trace = load_trace(path)
    per_step = Counter(e.step for e in trace)
    counts = sorted(set(per_step.values()))
    if len(counts) != 1:
        raise ValueError(f"trace {path}: its steps have {', '.join(map(str, counts))} executions; a job runs the "
                         f"same number of groups in every step, so replay needs one count for all steps")
    timeouts = [e.timeout_s for e in trace if e.timeout_s is not None]
    args = ["--tasks.params.path", str(Path(path).resolve()), "--tasks.params.time_scale", repr(time_scale),
            "--num_steps", str(len(per_step)), "--groups_per_step", str(counts[0]), "--group_size", "1"]
    if timeouts:
        args += ["--execution_timeout_s", str(max(timeouts))]
    return args


def trace_main(argv: Sequence[str]) -> int:
    from services.run import load_run

    args = list(argv)
    if "-h" in args or "--help" in args:
        print(__doc__)
        return 0
    try:
        path, scale, rest = _take(args)
        rest = ["--job", str(JOB_FILE), *trace_job_args(path, scale), *rest]
        run, spec, config = load_run(rest)
    except ValueError as exc:
        print(f"gyre replay: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"gyre replay: cannot read the trace {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    from services.run import run_job_cli

    result = run_job_cli(run, spec, config, prog="gyre replay")
    if isinstance(result, int):
        return result
    print(json.dumps(_summary(result)))
    return 0 if result.final_state == "completed" else 1


def _take(args: list[str]) -> tuple[str, float, list[str]]:
    """(--trace, --time-scale, the other flags)."""
    path, scale, rest = "", 1.0, []
    i = 0
    while i < len(args):
        flag = args[i]
        if flag in ("--trace", "--time-scale", "--time_scale"):
            if i + 1 >= len(args):
                raise ValueError(f"{flag} needs a value; usage: {USAGE}")
            if flag == "--trace":
                path = args[i + 1]
            else:
                try:
                    scale = float(args[i + 1])
                except ValueError:
                    raise ValueError(f"--time-scale must be a number, got {args[i + 1]!r}") from None
                if not scale >= 0:
                    raise ValueError(f"--time-scale must be >= 0, got {scale}")
            i += 2
            continue
        rest.append(flag)
        i += 1
    if not path:
        raise ValueError(f"--trace FILE.jsonl is required; usage: {USAGE}")
    return path, scale, rest


def _summary(result: Any) -> dict[str, Any]:
    return {"job_id": result.job_id, "mode": result.mode, "state": result.final_state, "steps": len(result.steps),
            "wall_s": round(result.wall_s, 1), "weight_version": result.weight_version,
            "trained_tokens": sum(int(r.get("tree_tokens", 0)) for r in result.steps),
            "switches": len(result.switches), "migrations": result.migrations, "outcomes": result.outcomes,
            "report": str(result.report)}
