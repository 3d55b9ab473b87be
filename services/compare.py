"""``gyre run --compare [--seeds N]``: the three scheduling modes on the same seed, config and time budget.

Each mode is a full `run_job` (own stack, own Redis); the comparison reports, per mode, the
wall-clock until the held-out pass rate first reached a common target (the lowest final pass rate
among the modes, so every mode reaches it), steps done, cell utilization (share of cell-seconds
spent in ROLLOUT or TRAIN rather than switching or idle) and switch counts. Written to
``<report_dir>/compare/compare.md`` and ``compare.json``; each mode's full report sits beside it.

With ``--seeds N`` every mode runs N times (the job's seed, seed + 1, ...) and the comparison adds,
per mode, the held-out pass rate at each step every run evaluated (equal steps), the last one and
the wall time as mean, min, max and std over the seeds, and whether elastic's mean last pass rate
lies within colocate's spread (the condition for elastic's speed-up to count).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from services.run import RunConfig, RunResult, interrupt_on_signals, load_run, run_job
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


def _row(r: RunResult, target: float) -> dict[str, Any]:
    return {"wall_s": round(r.wall_s, 1), "steps": len(r.steps), "state": r.final_state,
            "heldout_first": r.evals[0]["heldout_pass_rate"] if r.evals else None,
            "heldout_last": r.evals[-1]["heldout_pass_rate"] if r.evals else None,
            "heldout_by_step": {int(e["step"]): e["heldout_pass_rate"] for e in r.evals},
            "time_to_target_s": time_to(r, target), "utilization": round(utilization(r), 3),
            "switches": len(r.switches)}


def spread(values: list[float]) -> dict[str, float]:
    """Mean, min, max and (population) standard deviation of ``values``."""
    n = len(values)
    mean = sum(values) / n
    return {"mean": round(mean, 4), "min": min(values), "max": max(values),
            "std": round((sum((v - mean) ** 2 for v in values) / n) ** 0.5, 4)}


def across_seeds(rows: dict[int, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per mode, over seeds: the held-out pass rate at each step every seed evaluated (equal steps)
    and the last one, and the wall time, each as a `spread`; and whether elastic's last held-out
    pass rate lies within colocate's spread (min..max over the seeds)."""
    modes = sorted({m for by_mode in rows.values() for m in by_mode}, key=lambda m: MODES.index(m))
    out: dict[str, Any] = {"seeds": sorted(rows), "modes": {}}
    for mode in modes:
        runs = [by_mode[mode] for by_mode in rows.values() if mode in by_mode]
        steps = sorted(set.intersection(*(set(r["heldout_by_step"]) for r in runs))) if runs else []
        lasts = [r["heldout_last"] for r in runs if r["heldout_last"] is not None]
        out["modes"][mode] = {
            "runs": len(runs),
            "heldout_by_step": {step: spread([r["heldout_by_step"][step] for r in runs]) for step in steps},
            "heldout_last": spread(lasts) if lasts else None,
            "wall_s": spread([r["wall_s"] for r in runs]),
            "completed": sum(r["state"] == "completed" for r in runs)}
    e, c = out["modes"].get("elastic"), out["modes"].get("colocate")
    if e and c and e["heldout_last"] and c["heldout_last"]:
        out["elastic_within_colocate_spread"] = \
            c["heldout_last"]["min"] <= e["heldout_last"]["mean"] <= c["heldout_last"]["max"]
    return out


def _seed_lines(agg: dict[str, Any]) -> list[str]:
    def fmt(sp: dict[str, float] | None, digits: int = 3) -> str:
        return "-" if sp is None else f"{sp['mean']:.{digits}f} ({sp['min']:.{digits}f}-{sp['max']:.{digits}f})"

    lines = [f"## Over seeds {', '.join(map(str, agg['seeds']))}: mean (min-max)", "",
             "| mode | runs completed | held-out pass rate at equal steps | last held-out | wall s |",
             "|---|---:|---|---:|---:|"]
    for mode, m in agg["modes"].items():
        by_step = "; ".join(f"{step}: {fmt(sp)}" for step, sp in m["heldout_by_step"].items()) or "-"
        lines.append(f"| {mode} | {m['completed']}/{m['runs']} | {by_step} | {fmt(m['heldout_last'])} "
                     f"| {fmt(m['wall_s'], 0)} |")
    if "elastic_within_colocate_spread" in agg:
        lines += ["", "Elastic's mean last held-out pass rate is "
                  + ("within" if agg["elastic_within_colocate_spread"] else "OUTSIDE")
                  + " colocate's spread over the seeds."]
    return lines


def compare_modes(run: RunConfig, spec: JobSpec, *, seeds: int = 1, echo: Any = print,
                  config_path: Any = None) -> dict[str, Any]:
    """Each mode on the job, for ``seeds`` seeds (the job's seed, +1, ...); see the module docstring."""
    if seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {seeds}")
    out_dir = Path(run.report_dir) / "compare"
    per_seed: dict[int, dict[str, dict[str, Any]]] = {}
    first: dict[str, dict[str, Any]] = {}
    target = 0.0
    for k in range(seeds):
        seed = spec.seed + k
        suffix = "" if seeds == 1 else f"-seed{seed}"
        results: dict[str, RunResult] = {}
        for mode in MODES:
            echo(f"== {mode}" + (f" (seed {seed})" if seeds > 1 else ""))
            mode_run = dataclasses.replace(run, report_dir=str(out_dir / f"{mode}{suffix}"))
            mode_spec = dataclasses.replace(spec, job_id=f"{spec.job_id}-{mode}{suffix}", mode=Mode(mode), seed=seed,
                                            staleness_bound=0 if mode == "colocate" else max(spec.staleness_bound, 1),
                                            async_rollout_cells=run.engines if mode == "async" else None)
            results[mode] = run_job(mode_run, mode_spec, echo=echo,
                                    **({"config_path": config_path} if config_path else {}))
        finals = [r.evals[-1]["heldout_pass_rate"] for r in results.values() if r.evals]
        seed_target = min(finals) if finals else 0.0
        per_seed[seed] = {mode: _row(r, seed_target) for mode, r in results.items()}
        if k == 0:
            first, target = per_seed[seed], seed_target
    rows = {mode: {k: v for k, v in row.items() if k != "heldout_by_step"} for mode, row in first.items()}
    summary: dict[str, Any] = {"seed": spec.seed, "target_heldout_pass_rate": target, "modes": rows}
    lines = [f"# Mode comparison (seed {spec.seed}, {spec.num_steps} steps, budget {run.time_budget_s:.0f}s)", "",
             f"Target held-out pass rate: {target:.3f} (lowest final rate among the modes).", "",
             "| mode | wall s | steps | held-out first -> last | time to target s | utilization | switches |",
             "|---|---:|---:|---|---:|---:|---:|"]
    for mode, row in rows.items():
        ttt = "not reached" if row["time_to_target_s"] is None else f"{row['time_to_target_s']:.0f}"
        lines.append(f"| {mode} | {row['wall_s']:.0f} | {row['steps']} | {row['heldout_first']} -> "
                     f"{row['heldout_last']} | {ttt} | {row['utilization']:.2f} | {row['switches']} |")
    if seeds > 1:
        summary["over_seeds"] = across_seeds(per_seed)
        lines += ["", *_seed_lines(summary["over_seeds"])]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "compare.md").write_text("\n".join(lines) + "\n")
    (out_dir / "compare.json").write_text(json.dumps(summary, indent=1))
    echo("\n".join(lines))
    return summary


def compare_main(argv: list[str]) -> int:
    """``gyre run --compare [--seeds N] [same flags as gyre run]``."""
    import sys

    args, seeds = list(argv), 1
    if "--seeds" in args:
        i = args.index("--seeds")
        try:
            seeds = int(args[i + 1])
        except (IndexError, ValueError):
            print("gyre run --compare: --seeds needs a whole number of seeds (e.g. --seeds 3)", file=sys.stderr)
            return 2
        del args[i:i + 2]
    try:
        if seeds < 1:
            raise ValueError(f"--seeds must be >= 1, got {seeds}")
        run, spec, config = load_run(args)
    except ValueError as exc:
        print(f"gyre run --compare: {exc}", file=sys.stderr)
        return 2
    interrupt_on_signals()
    try:
        compare_modes(run, spec, seeds=seeds, config_path=config)
    except KeyboardInterrupt:
        print("gyre run --compare: interrupted; every service it started was stopped (the modes that "
              "ended have their reports under the report directory)", file=sys.stderr)
        return 130
    return 0
