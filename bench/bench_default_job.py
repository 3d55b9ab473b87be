"""`make run`'s default job, measured: its shape (is it XLong-shaped?) and what it learns.

    .venv/bin/python -m bench.bench_default_job [--steps 8] [--long-steps 30] [--no-zero]

Runs `gyre run` (deploy/config/run.toml + job.toml, unchanged) and reads, per training execution,
the built-in harness's ``execution ended`` log line (model calls, tokens through the model,
compactions, sub-agents, retries, end status, wall time) and, per step, the report's
``metrics.jsonl`` (naive vs tree tokens, timeouts and their partial rewards, the held-out pass rate
on the job's 128 greedy tasks). Then, in the same session, the same job with
``--timeout-policy zero`` (a timed-out execution scores 0 instead of its workspace's partial
score: the baseline for "partial rewards carry signal") and, with ``--long-steps N``, the default
job run for N steps (does it keep improving past step 8?). Writes bench/results/default_job.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "default_job.md"


def run(name: str, work: Path, steps: int, extra: list[str]) -> dict[str, Any]:
    out = work / name.replace(" ", "-").replace("=", "-")
    # make run's budget (900 s) is sized for 8 steps; a longer run gets one sized for its steps
    budget = max(900, 120 * steps)
    cmd = [sys.executable, "-m", "services.cli", "run", "--quiet", "--report-dir", str(out / "report"),
           "--data-dir", str(out / "data"), "--time-budget-s", str(budget), "--num-steps", str(steps), *extra]
    print("running", " ".join(cmd[2:]), flush=True)
    t = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - t
    try:  # a run cut by its time budget (exit 1) still reports what it did
        summary = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise SystemExit(f"{name}: gyre run exited {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-3000:]}") from None
    executions = {}
    for log in (out / "data").glob("*/logs/harness.log"):
        for line in log.read_text(errors="replace").splitlines():
            try:
                o = json.loads(line)
            except ValueError:
                continue
            if o.get("event") == "execution ended" and "calls" in o and not o.get("evaluation"):
                executions[o["execution_id"]] = o  # a re-leased execution: its last attempt
    metrics = [json.loads(x) for x in (out / "report" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {"name": name, "summary": summary, "state": summary.get("state", "?"), "steps_done": summary.get("steps"),
            "wall_s": wall, "executions": list(executions.values()),
            "steps": [m for m in metrics if "naive_tokens" in m],
            "evals": [(m["step"], m["heldout_pass_rate"]) for m in metrics if "heldout_pass_rate" in m]}


def shape_rows(r: dict[str, Any]) -> list[str]:
    ex = r["executions"]
    n = len(ex)
    calls = [sum(e["calls"].values()) for e in ex]
    tokens = [e["prompt_tokens"] + e["output_tokens"] for e in ex]

    def share(event: str) -> float:
        return sum(1 for e in ex if e["events"].get(event, 0) > 0) / n

    timeouts = sum(1 for e in ex if e["status"] == "timeout")
    naive = sum(s["naive_tokens"] for s in r["steps"])
    tree = sum(s["tree_tokens"] for s in r["steps"])
    partial = [s["timeout_reward"] * s["timeouts"] for s in r["steps"] if "timeout_reward" in s]
    wall = sorted(e.get("wall_s", 0.0) for e in ex)
    return [
        "| measure | value | the issue's bar |",
        "|---|---:|---|",
        f"| training executions | {n} | |",
        f"| model calls per execution (mean / median) | {statistics.mean(calls):.1f} / {statistics.median(calls):.0f} "
        "| >= 30 |",
        f"| tokens through the model per execution (prompt + generated, summed over its calls; mean) "
        f"| {statistics.mean(tokens):,.0f} | >= 2K |",
        f"| unique tokens per execution (its tree; mean) | {tree / max(n, 1):,.0f} | |",
        f"| executions with a compaction | {share('compactions'):.0%} | >= 20 % |",
        f"| executions with a sub-agent | {share('subagents'):.0%} | >= 20 % |",
        f"| executions with a retry | {share('retries'):.0%} | >= 20 % |",
        f"| executions timed out (scored partially; mean partial reward) | {timeouts / n:.0%} "
        f"({sum(partial) / max(timeouts, 1):.3f}) | >= 10 % |",
        f"| tokens naive (per path) / tree | {naive:,} / {tree:,} = {naive / max(tree, 1):.2f}x | >= 2x |",
        f"| execution wall time p50 / p90 / max, s | {wall[n // 2]:.1f} / {wall[int(0.9 * n)]:.1f} / {wall[-1]:.1f} | |",
        f"| job wall time, s (gyre run, up to down) | {r['wall_s']:.0f} | <= 600 |",
    ]


def curve(r: dict[str, Any]) -> str:
    return " -> ".join(f"{p:.3f} ({s})" for s, p in r["evals"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--long-steps", type=int, default=0, help="also the default job for this many steps (0: no)")
    ap.add_argument("--no-zero", action="store_true", help="skip the timeout_policy=zero run")
    args = ap.parse_args(argv)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="gyre-bench-default-") as tmp:
        work = Path(tmp)
        plan = [("default", args.steps, [])]
        if not args.no_zero:
            plan.append(("timeout_policy=zero", args.steps, ["--timeout-policy", "zero"]))
        if args.long_steps:
            plan.append((f"{args.long_steps} steps", args.long_steps, []))
        for name, steps, extra in plan:
            runs.append(run(name, work, steps, extra))
            write(runs, args)  # each run's figures are kept even if a later one fails
    return 0


def write(runs: list[dict[str, Any]], args: argparse.Namespace) -> None:
    base = runs[0]
    lines = ["# `make run`'s default job: its shape and what it learns", "",
             f"`python -m bench.bench_default_job --steps {args.steps}"
             + (f" --long-steps {args.long_steps}" if args.long_steps else "") + (" --no-zero" if args.no_zero else "")
             + "`: `gyre run` on deploy/config/run.toml + job.toml (2 CPU cores), the harness's per-execution log "
             "lines and the report's metrics.", "",
             f"## Shape of the default job ({args.steps} steps, training executions only)", "", *shape_rows(base), "",
             "## Held-out pass rate (128 tasks, greedy; after step)", "",
             "| run | end (steps done) | held-out pass rate (after step) | first -> last | job wall s |",
             "|---|---|---|---:|---:|"]
    for r in runs:
        first, last = (r["evals"][0][1], r["evals"][-1][1]) if r["evals"] else (0.0, 0.0)
        lines.append(f"| {r['name']} | {r['state']} ({r['steps_done']}) | {curve(r)} | {100 * (last - first):+.1f} points "
                     f"| {r['wall_s']:.0f} |")
    lines.append("")
    RESULTS.write_text("\n".join(lines))
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
