"""`make run`'s job, measured: the trainer's throughput with block-sparse tree attention (the
default on CPU) against the dense N x N SDPA mask in the same session, and the job's prefix reuse.

    .venv/bin/python -m bench.bench_make_run [--steps 8]

Runs `gyre run` (deploy/config/run.toml + job.toml: the main job on the built-in default) twice,
the trainer set to ``attention = blocks`` and then ``sdpa`` (``GYRE_TRAINER_ATTENTION``), and reads
each step's ``step done`` line of the trainer core: tokens trained, step wall time, and the core's
training time (``compute_s``: waits for rollouts left out) with its tokens/s (``train_tok_s``).
Writes bench/results/make_run.md.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "make_run.md"


def run(attention: str, steps: int, work: Path) -> tuple[list[dict], dict, str]:
    out = work / attention
    env = {**os.environ, "GYRE_TRAINER_ATTENTION": attention}
    proc = subprocess.run([sys.executable, "-m", "services.cli", "run", "--num-steps", str(steps), "--quiet", "true",
                           "--report-dir", str(out / "report"), "--data-dir", str(out / "data")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"gyre run (attention={attention}) failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    summary = json.loads(next(x for x in reversed(proc.stdout.splitlines()) if x.startswith("{")))
    mode = summary["mode"]
    log = out / "data" / mode / "logs" / "trainer.log"
    steps_done = [json.loads(x) for x in log.read_text().splitlines() if '"step done"' in x]
    reuse = next((x.split(": ", 1)[1] for x in proc.stdout.splitlines() if x.startswith("prefix reuse: ")), "-")
    return steps_done, summary, reuse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    t0 = time.perf_counter()
    results = {}
    with tempfile.TemporaryDirectory(prefix="gyre-bench-make-run-") as d:
        for attention in ("blocks", "sdpa"):
            print(f"gyre run, trainer attention={attention} ...", flush=True)
            results[attention] = run(attention, args.steps, Path(d))
    med = {}
    out = ["# `make run`'s job: trainer throughput and prefix reuse", "",
           f"`python -m bench.bench_make_run`: `gyre run --num-steps {args.steps}` (the main job on the built-in "
           "default: 2 rollout cells + the trainer core on 2 CPU cores, elastic) twice in one session, the trainer's "
           "tree attention block-sparse (the CPU default) and then the dense SDPA mask. Per step, from the trainer "
           "core's `step done` log line: tokens trained (all replicas), step wall time, and the core's own "
           f"training time and tokens/s (waits for rollouts left out). Total {time.perf_counter() - t0:.0f} s.", "",
           "| attention | step | world | tokens | step s | tok/s (step wall) | core training s | core tok/s "
           "(training) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for attention, (rows, _summary, _reuse) in results.items():
        for r in rows:
            out.append(f"| {attention} | {r['step']} | {r['world']} | {r['tokens']:,.0f} | {r['step_s']:.2f} | "
                       f"{r['tokens'] / max(r['step_s'], 1e-9):,.0f} | {r.get('compute_s', 0):.2f} | "
                       f"{r.get('train_tok_s', 0):,.0f} |")
        trained = [r["train_tok_s"] for r in rows if r.get("compute_s", 0) > 0]  # steps the core trained in
        med[attention] = (statistics.median(trained) if trained else 0.0,
                          statistics.median(r["tokens"] / max(r["step_s"], 1e-9) for r in rows))
    out += ["", "| attention | median core tok/s (training) | median tok/s (step wall) | job wall s | "
            "prefix reuse |", "|---|---:|---:|---:|---|"]
    for attention, (_rows, s, reuse) in results.items():
        out.append(f"| {attention} | {med[attention][0]:,.0f} | {med[attention][1]:,.0f} | {s['wall_s']:.0f} | "
                   f"{reuse} |")
    ratio = med["blocks"][0] / max(med["sdpa"][0], 1e-9)
    out += ["", f"Block-sparse over dense, the core's training tokens/s (median over the steps the core trained "
            f"in; in a step where replicas took every micro-batch the core trained none): **{ratio:.1f}x**. "
            "The step wall time includes waiting for the step's rollouts (elastic: the core trains what has "
            "arrived, then waits), so tok/s per step wall, and the job's wall time, follow the rollout rate "
            "more than the trainer's: this job is rollout-bound on 2 cores.", ""]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(out))
    print("\n".join(out))


if __name__ == "__main__":
    main()
