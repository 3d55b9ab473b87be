"""RL through each agent loop on the tool-calling task: ``gyre run --harness NAME`` side by side.

    .venv/bin/python -m bench.bench_harness_loops [--steps 2] [--groups 4] [--group-size 4] [--eval-tasks 16]

For each loop (the built-in tool agent, openai-agents, smolagents, mini-swe-agent) one elastic job of the same
size on its own live stack, model ``builtin-tools``, task family ``xlong-tools-v1``; the table
(``bench/results/harness_loops.md``) has, per loop (and ``builtin-linear``, the built-in agent
without compaction, sub-agents and retries: the control for the third-party loops' linear runs): held-out pass rate before and after, model
calls and unique tokens per execution (from the steps' metrics), naive / tree tokens (the prefix
sharing a loop's branching leaves to the tree; 1.00 = every execution one path) and wall time.
A loop that cannot finish within ``--budget-s`` is cancelled and reported as such.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.run import load_run, run_job  # noqa: E402

LOOPS = ("builtin", "builtin-linear", "openai-agents", "smolagents", "mini-swe-agent", "claude-code", "codex")
# The control: the built-in tool agent without its compaction, sub-agents and branch retries (a
# linear conversation, as the third-party loops have), set through the harness's environment.
LINEAR = {"GYRE_HARNESS_TOOL_CONTEXT_LIMIT_TOKENS": "1000000", "GYRE_HARNESS_DELEGATE_EVERY": "0",
          "GYRE_HARNESS_RETRIES": "0"}


def one(loop: str, args: argparse.Namespace, data: Path) -> dict[str, object]:
    flags = ["--task", "tools", "--num_steps", str(args.steps), "--groups_per_step", str(args.groups),
             "--group_size", str(args.group_size), "--evaluation.tasks", str(args.eval_tasks),
             "--evaluation.every", str(args.steps)]
    run, spec, config = load_run(([] if loop.startswith("builtin") else ["--harness", loop]) + flags)
    run = dataclasses.replace(run, quiet=True, time_budget_s=args.budget_s, data_dir=str(data / loop),
                              report_dir=str(data / loop / "report"))
    t0 = time.monotonic()
    saved = {k: os.environ.get(k) for k in LINEAR}
    if loop == "builtin-linear":
        os.environ.update(LINEAR)  # the harness worker process inherits it
    try:
        result = run_job(run, spec, echo=lambda _m: None, config_path=config)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    calls = [c for s in result.steps for c in s.get("execution_calls", [])]
    tokens = [t for s in result.steps for t in s.get("execution_tokens", [])]
    naive = sum(s.get("naive_tokens", 0) for s in result.steps)
    tree = sum(s.get("tree_tokens", 0) for s in result.steps)
    return {"loop": loop, "state": result.final_state, "steps": len(result.steps),
            "before": result.evals[0]["heldout_pass_rate"] if result.evals else None,
            "after": result.evals[-1]["heldout_pass_rate"] if len(result.evals) > 1 else None,
            "calls": statistics.mean(calls) if calls else None, "tokens": statistics.mean(tokens) if tokens else None,
            "naive_tree": naive / tree if tree else None, "wall_s": time.monotonic() - t0}


def _fmt(v: object, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--eval-tasks", type=int, default=16)
    ap.add_argument("--budget-s", type=float, default=600.0, help="cancel a loop's job after this long")
    ap.add_argument("--loops", default=",".join(LOOPS))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "harness_loops.md"))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="gyre-loops-") as tmp:
        for loop in args.loops.split(","):
            rows.append(one(loop, args, Path(tmp)))
            print(rows[-1], flush=True)
    lines = [
        "# RL through each agent loop (`gyre run --harness NAME`, model builtin-tools, task xlong-tools-v1)",
        "",
        f"`python -m bench.bench_harness_loops` on {args.steps} elastic steps of {args.groups} groups x "
        f"{args.group_size}, {args.eval_tasks} held-out tasks (greedy) before and after; 2-core machine. "
        "Calls and tokens are per training execution (means); naive / tree tokens is 1.00 when every "
        "execution is one path. `builtin-linear` is the control: the built-in tool agent without compaction, "
        "sub-agents and branch retries, a linear conversation as the third-party loops have.",
        "",
        "| loop | job | held-out before | held-out after | model calls / execution | unique tokens / execution "
        "| naive / tree tokens | wall |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(f"| {r['loop']} | {r['state']} ({r['steps']} steps) | {_fmt(r['before'], '.3f')} | "
                     f"{_fmt(r['after'], '.3f')} | {_fmt(r['calls'], '.1f')} | {_fmt(r['tokens'], '.0f')} | "
                     f"{_fmt(r['naive_tree'], '.2f')} | {_fmt(r['wall_s'], '.0f')} s |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
