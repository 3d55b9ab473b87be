"""``gyre run --compare``: the three scheduling modes on the same seed, config and time budget.

Each mode is a full `run_job` (own stack, own Redis); the comparison reports, per mode, the
wall-clock until the held-out pass rate first reached a common target (the lowest final pass rate
among the modes, so every mode reaches it), steps done, cell utilization (share of cell-seconds
spent in ROLLOUT or TRAIN rather than switching or idle) and switch counts. Written to
``<report_dir>/compare/compare.md`` and ``compare.json``; each mode's full report sits beside it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from services.run import RunConfig, RunResult, load_run, run_job
from services.scheduler.jobs import JobSpec, Mode

MODES = ("colocate", "async", "elastic")


def utilization(result: RunResult) -> float:
    busy = total = 0.0
    for r in result.roles:
        span = max(0.0, r["end_s"] - r["start_s"])
        total += span
        if r["role"] in ("rollout", "train"):
            busy += span
    return busy / total if total else 0.0


def time_to(result: RunResult, target: float) -> float | None:
    for e in result.evals:
        if e["heldout_pass_rate"] >= target:
            return float(e["time_s"])
    return None


def compare_modes(run: RunConfig, spec: JobSpec, *, echo: Any = print, config_path: Any = None) -> dict[str, Any]:
    out_dir = Path(run.report_dir) / "compare"
    results: dict[str, RunResult] = {}
    for mode in MODES:
        echo(f"== {mode}")
        mode_run = dataclasses.replace(run, report_dir=str(out_dir / mode))
        mode_spec = dataclasses.replace(spec, job_id=f"{spec.job_id}-{mode}", mode=Mode(mode),
                                        staleness_bound=0 if mode == "colocate" else max(spec.staleness_bound, 1),
                                        async_rollout_cells=run.engines if mode == "async" else None)
        results[mode] = run_job(mode_run, mode_spec, echo=echo, **({"config_path": config_path} if config_path else {}))
    finals = [r.evals[-1]["heldout_pass_rate"] for r in results.values() if r.evals]
    target = min(finals) if finals else 0.0
    rows = {}
    for mode, r in results.items():
        rows[mode] = {"wall_s": round(r.wall_s, 1), "steps": len(r.steps), "state": r.final_state,
                      "heldout_first": r.evals[0]["heldout_pass_rate"] if r.evals else None,
                      "heldout_last": r.evals[-1]["heldout_pass_rate"] if r.evals else None,
                      "time_to_target_s": time_to(r, target), "utilization": round(utilization(r), 3),
                      "switches": len(r.switches)}
    summary = {"seed": spec.seed, "target_heldout_pass_rate": target, "modes": rows}
    lines = [f"# Mode comparison (seed {spec.seed}, {spec.num_steps} steps, budget {run.time_budget_s:.0f}s)", "",
             f"Target held-out pass rate: {target:.3f} (lowest final rate among the modes).", "",
             "| mode | wall s | steps | held-out first -> last | time to target s | utilization | switches |",
             "|---|---:|---:|---|---:|---:|---:|"]
    for mode, row in rows.items():
        ttt = "not reached" if row["time_to_target_s"] is None else f"{row['time_to_target_s']:.0f}"
        lines.append(f"| {mode} | {row['wall_s']:.0f} | {row['steps']} | {row['heldout_first']} -> "
                     f"{row['heldout_last']} | {ttt} | {row['utilization']:.2f} | {row['switches']} |")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "compare.md").write_text("\n".join(lines) + "\n")
    (out_dir / "compare.json").write_text(json.dumps(summary, indent=1))
    echo("\n".join(lines))
    return summary


def compare_main(argv: list[str]) -> int:
    """``gyre run --compare [same flags as gyre run]``."""
    import sys

    try:
        run, spec, config = load_run(argv)
    except ValueError as exc:
        print(f"gyre run --compare: {exc}", file=sys.stderr)
        return 2
    compare_modes(run, spec, config_path=config)
    return 0
