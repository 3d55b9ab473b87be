"""CellRole-switch latency on the live stack, broken into phases: `gyre run` (built-in model, elastic,
a few steps) with the trainer's replica pool off and on (``warm_replicas`` 0: a process per replica,
started cold and exiting with it; 2: pool processes started ahead, each back in the pool when its
cell is given back), from the job's own events (``switch_finished`` durations, ``switch_phases``).

    .venv/bin/python -m bench.bench_switch [--steps 4]
    .venv/bin/python -m bench.bench_switch --model smollm2-135m-instruct --task arith --steps 3 --eval-tasks 8
    .venv/bin/python -m bench.bench_switch --model smollm2-135m-instruct --task arith --handoff   # shm vs gRPC

Writes bench/results/switch.md (the second: switch-smollm2.md; ``--out`` to choose). Phases (services actuator, one host): rollout -> train = drain
(the gateway migrates the cell's requests, KV over UCX) + replica_join (a replica process in the
running step with the current weights: a cold start or a warm process handed the cell);
train -> rollout = release (the replica hands off its gradient and leaves) + engine_resume (the
gateway routes to the engine again; it kept its model and KV pool while the cell trained); a
pool process's release is a leave (SIGUSR1, hand-off), not an exit.

``--handoff``: the pool of 2 both times, once with the gradient hand-off through the core's shared
memory (the default) and once streamed over gRPC (``shared_handoff = false``). Each release is also
broken down from the replicas' own log lines: finish (interrupt -> its last micro-batch done) and
hand-off (the gradient sum to the core).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "switch.md"


def run(warm: int, args: argparse.Namespace, work: Path, *, shared: bool = True) -> tuple[list[dict], dict, list[dict]]:
    out = work / f"warm-{warm}-{'shm' if shared else 'stream'}"
    env = {**os.environ, "GYRE_TRAINER_WARM_REPLICAS": str(warm),
           "GYRE_TRAINER_SHARED_HANDOFF": "true" if shared else "false"}
    job = ["--model", args.model] if args.model else []
    job += ["--task", args.task] if args.task else []
    job += ["--evaluation.tasks", str(args.eval_tasks)] if args.eval_tasks else []
    proc = subprocess.run([sys.executable, "-m", "services.cli", "run", *job, "--mode", "elastic",
                           "--num-steps", str(args.steps), "--quiet", "true", "--report-dir", str(out / "report"),
                           "--data-dir", str(out / "data")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"gyre run (warm_replicas={warm}) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    summary = json.loads(next(x for x in reversed(proc.stdout.splitlines()) if x.startswith("{")))
    rows = [json.loads(x) for x in (out / "report" / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == "switch"], summary, releases(out / "data")


def releases(data: Path) -> list[dict]:
    """The replicas' "left mid-step" log lines (JSON) under a run's data directory."""
    found = []
    for log in sorted(data.rglob("replica*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if '"left mid-step' in line:
                try:
                    found.append(json.loads(line))
                except ValueError:
                    continue
    return found


def _counts(xs: Iterable[str]) -> str:
    return ", ".join(f"{k} {n}" for k, n in sorted(Counter(xs).items())) or "-"


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--model", default="", help="a named model (default: the job's, the built-in one)")
    parser.add_argument("--task", default="", help="gyre run's --task (e.g. arith with smollm2-135m-instruct)")
    parser.add_argument("--eval-tasks", type=int, default=0, help="held-out tasks per evaluation (0: the job's)")
    parser.add_argument("--out", default="", help="results file (default: switch.md, or switch-<model>.md)")
    parser.add_argument("--handoff", action="store_true",
                        help="the pool of 2 both times: gradient hand-off through shared memory vs streamed")
    args = parser.parse_args()
    stem = f"switch-{args.model.split('-')[0]}" if args.model else "switch"
    results_file = Path(args.out) if args.out else RESULTS.with_name(f"{stem}{'-handoff' if args.handoff else ''}.md")
    model = f"model `{args.model}`" + (f", task `{args.task}`" if args.task else "") if args.model else "the built-in model"
    t0 = time.perf_counter()
    variants = [("2, shared memory", 2, True), ("2, streamed", 2, False)] if args.handoff else [
        ("0", 0, True), ("2", 2, True)]
    results = {}
    with tempfile.TemporaryDirectory(prefix="gyre-bench-switch-") as d:
        for label, warm, shared in variants:
            print(f"gyre run, warm_replicas={warm} shared_handoff={shared} ...", flush=True)
            results[label] = run(warm, args, Path(d), shared=shared)
    out = ["# CellRole-switch latency (live stack)", "",
           f"`python -m bench.bench_switch{' ' + ' '.join(sys.argv[1:]) if sys.argv[1:] else ''}`: `gyre run --mode "
           f"elastic --num-steps {args.steps}` on {model} (its run config's rollout cells + the trainer core, "
           "2 CPU cores), " + (
               "twice with a replica pool of 2 (processes started ahead; a released one leaves its step and "
               "waits in the pool for the next cell): a leaving replica's gradient sum handed to the core through "
               "shared memory, then streamed over gRPC (`shared_handoff = false`). " if args.handoff else
               "once with `warm_replicas = 0` (every replica a cold process that exits when its cell is given "
               "back) and once with a replica pool of 2 (processes started ahead; a released one leaves its step "
               "and waits in the pool for the next cell). ") +
           "Durations from the job's "
           f"`switch_finished` events, phases from its `switch_phases` events. Total {time.perf_counter() - t0:.0f} s.",
           "", "| warm replicas | direction | switches | median s | p90 s | mean s | median per phase s |",
           "|---:|---|---:|---:|---:|---:|---|"]
    for label, (switches, _summary, _rel) in results.items():
        for frm, to in (("rollout", "train"), ("train", "rollout")):
            rows = [s for s in switches if (s["from"], s["to"]) == (frm, to)]
            if not rows:
                continue
            ds = [s["duration_s"] for s in rows]
            names = sorted({k for s in rows for k in (s.get("phases") or {})})
            phases = ", ".join(f"{n} {statistics.median([(s.get('phases') or {}).get(n, 0.0) for s in rows]):.2f}"
                               for n in names)
            out.append(f"| {label} | {frm} -> {to} | {len(rows)} | {statistics.median(ds):.2f} | {pct(ds, 0.9):.2f} | "
                       f"{sum(ds) / len(ds):.2f} | {phases or '-'} |")
    out += ["", "| warm replicas | wall s | held-out pass rate (first -> last) | switches |", "|---:|---:|---|---:|"]
    for label, (_switches, s, _rel) in results.items():
        out.append(f"| {label} | {s['wall_s']:.1f} | {s['heldout_pass_rate_first']:.3f} -> "
                   f"{s['heldout_pass_rate_last']:.3f} | {s['switches']} |")
    out += ["", "Releases from the replicas' logs (a release of a replica that trained nothing is a leave, no "
            "hand-off):", "",
            "| warm replicas | releases | with hand-off | median finish s | median hand-off s (max) | MB | way | "
            "interrupted while |",
            "|---:|---:|---:|---:|---|---:|---|---|"]
    for label, (_switches, _s, rel) in results.items():
        handed = [r for r in rel if "handoff_s" in r]
        fin = [r["finish_s"] for r in rel if r.get("finish_s") is not None]
        ways = sorted({"shared memory" if r.get("shared_memory") else "stream" for r in handed})
        ho = ([r["handoff_s"] for r in handed] or [0.0])
        out.append(f"| {label} | {len(rel)} | {len(handed)} | {statistics.median(fin) if fin else 0:.2f} | "
                   f"{statistics.median(ho):.2f} ({max(ho):.2f}) | "
                   f"{statistics.median([r['handoff_mb'] for r in handed]) if handed else 0:.0f} | "
                   f"{', '.join(ways) or '-'} | {_counts(r.get('interrupted_in') or '?' for r in rel)} |")
    out += ["", "Targets (issue: elastic pays for itself): median rollout -> train <= 1.0 s, train -> rollout "
            "<= 0.5 s. A switch's duration runs from the scheduler's switch_started to its switch_finished "
            "(the phases plus bookkeeping). The wall time of so short a job swings with the two cores' load "
            "(a cold process imports while the others train).", ""]
    results_file.parent.mkdir(parents=True, exist_ok=True)
    results_file.write_text("\n".join(out))
    print("\n".join(out))


if __name__ == "__main__":
    main()
