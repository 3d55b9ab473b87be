"""``gyre run --compare [--seeds N] [--modes A,B] [--vary FIELD=A,B,...]``: the three scheduling modes
(or some of them, or the values of one job field) on the same seed, config and time budget.

Each mode is a full `run_job` (own stack, own Redis); the comparison reports, per mode, the
wall-clock until the held-out pass rate first reached a common target (the lowest final pass rate
among the modes, so every mode reaches it), steps done, cell utilization (share of cell-seconds
spent in ROLLOUT or TRAIN rather than switching or idle) and switch counts. Written to
``<report_dir>/compare/compare.md`` and ``compare.json``; each mode's full report sits beside it,
with its trained policy (``policy/``, listed at the end of compare.md). A per-run table follows (also
``compare.json``'s ``runs``): held-out after each evaluated step and the rise, training executions cut
by the deadline per step, token entropy of the first and last step, the trainer/behaviour KL at step 1.

With ``--seeds N`` every mode runs N times (the job's seed, seed + 1, ...) and the comparison adds,
per mode, the held-out pass rate at each step every run evaluated (equal steps), the last one and
the wall time as mean, min, max and std over the seeds, and whether elastic's mean last pass rate
lies within colocate's spread (the condition for elastic's speed-up to count).

``--modes colocate,elastic`` runs only the listed modes (in their usual order): the comparison that
condition needs, in two thirds of the time.

With ``--vary FIELD=A,B,...`` the job runs in its own mode once per value of one job field (any
``gyre run`` job flag, e.g. ``--vary timeout-policy=partial,zero`` or
``--vary algorithm.learning-rate=1e-3,3e-4``) instead of once per mode: an ablation on equal seeds
(one value: that job repeated over the seeds). Over seeds it adds, for each later value, how its
mean last held-out pass rate differs from the first value's and whether it lies outside the first
value's spread.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import string
from pathlib import Path
from typing import Any

from services.run import RunConfig, RunResult, interrupt_on_signals, load_run, run_job
from services.scheduler.jobs import ID_RE, MAX_JOB_ID, JobSpec, Mode

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


def _heldout(r: RunResult) -> dict[str, Any]:
    """A run's held-out pass rates: the first, the last and each by the step evaluated after."""
    return {"heldout_first": r.evals[0]["heldout_pass_rate"] if r.evals else None,
            "heldout_last": r.evals[-1]["heldout_pass_rate"] if r.evals else None,
            "heldout_by_step": {int(e["step"]): e["heldout_pass_rate"] for e in r.evals}}


def _row(r: RunResult, target: float) -> dict[str, Any]:
    return {"wall_s": round(r.wall_s, 1), "steps": len(r.steps), "state": r.final_state, **_heldout(r),
            "time_to_target_s": time_to(r, target), "utilization": round(utilization(r), 3),
            "switches": len(r.switches)}


def run_facts(label: str, seed: int, r: RunResult) -> dict[str, Any]:
    """One run's learning at a glance, for the per-run table: held-out pass rate after each evaluated
    step and its rise (points), training executions cut by the deadline per step, token entropy of
    the first and last trained step, and the trainer/behaviour KL of step 1 (the first update's
    shock on the samples it trains; 0 on-policy)."""
    steps = sorted(r.steps, key=lambda s: int(s.get("step", 0)))
    entropies = [float(s["entropy"]) for s in steps if s.get("entropy") is not None]
    held = _heldout(r)
    first, last = held["heldout_first"], held["heldout_last"]
    kl1 = [s.get("mismatch_kl") for s in steps if int(s.get("step", -1)) == 1]
    return {"label": label, "seed": seed, "state": r.final_state, "wall_s": round(r.wall_s, 1),
            "heldout_by_step": held["heldout_by_step"],
            "rise_points": None if first is None else round((last - first) * 100, 1),
            "timeouts_by_step": [int(s.get("timeouts", 0)) for s in steps],
            "entropy_first": round(entropies[0], 3) if entropies else None,
            "entropy_last": round(entropies[-1], 3) if entropies else None,
            "mismatch_kl_step1": None if not kl1 or kl1[0] is None else float(kl1[0])}


def run_lines(runs: list[dict[str, Any]]) -> list[str]:
    """The compare report's per-run table (`run_facts` rows, in the order run)."""
    if not runs:
        return []
    def num(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)
    lines = ["", "Per run: held-out pass rate after each evaluated step, its rise, training executions cut by "
             "the deadline per step, token entropy of the first and last trained step, trainer/behaviour KL "
             "at step 1 (nats/token, 0 on-policy):", "",
             "| run | held-out after step | rise (points) | timed out per step | token entropy first -> last "
             "| KL at step 1 | wall s |", "|---|---|---:|---|---|---:|---:|"]
    for f in runs:
        kl = f["mismatch_kl_step1"]
        lines.append(
            f"| {f['label']} seed {f['seed']}{'' if f['state'] == 'completed' else ' (' + f['state'] + ')'} | "
            + ("; ".join(f"{k}: {v:.3f}" for k, v in sorted(f["heldout_by_step"].items())) or "-")
            + f" | {num(f['rise_points'], '+.1f')} | {', '.join(map(str, f['timeouts_by_step'])) or '-'}"
            + f" | {num(f['entropy_first'], '.2f')} -> {num(f['entropy_last'], '.2f')}"
            + f" | {'-' if kl is None else format(max(kl, 0.0), '.3g')} | {f['wall_s']:.0f} |")
    return lines


def spread(values: list[float]) -> dict[str, float]:
    """Mean, min, max and (population) standard deviation of ``values``."""
    n = len(values)
    mean = sum(values) / n
    return {"mean": round(mean, 4), "min": min(values), "max": max(values),
            "std": round((sum((v - mean) ** 2 for v in values) / n) ** 0.5, 4)}


def position(value: float, sp: dict[str, float]) -> str:
    """Where ``value`` lies against a `spread`'s min..max: "below", "within" or "above"."""
    return "below" if value < sp["min"] else "above" if value > sp["max"] else "within"


def _against(mean: float, base: dict[str, float]) -> dict[str, Any]:
    """A variant's mean last held-out against the first variant's `spread`."""
    where = position(mean, base)
    return {"difference": round(mean - base["mean"], 4), "outside_first_spread": where != "within",
            "against_first_spread": where}


def _are_modes(labels: Any) -> bool:
    """Whether the compared labels are the scheduling modes (not ``--vary`` values)."""
    return all(label in MODES for label in labels)


def across_seeds(rows: dict[int, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per mode (or variant), over seeds: the held-out pass rate at each step every seed evaluated
    (equal steps) and the last one, and the wall time, each as a `spread`; whether elastic's last
    held-out pass rate lies within colocate's spread (min..max over the seeds); and for variants,
    each later one's mean last held-out against the first's spread (``against_first``)."""
    labels = list(dict.fromkeys(m for by_mode in rows.values() for m in by_mode))
    modes = sorted(labels, key=MODES.index) if _are_modes(labels) else labels
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
        where = position(e["heldout_last"]["mean"], c["heldout_last"])
        out["elastic_within_colocate_spread"] = where == "within"
        out["elastic_against_colocate_spread"] = where
    if modes and not _are_modes(modes) and out["modes"][modes[0]]["heldout_last"]:
        base = out["modes"][modes[0]]["heldout_last"]
        out["against_first"] = {label: _against(m["heldout_last"]["mean"], base)
                                for label, m in list(out["modes"].items())[1:] if m["heldout_last"]}
    return out


def _where_words(where: str) -> str:
    return {"within": "within", "above": "ABOVE (outside)", "below": "BELOW (outside)"}[where]


def _seed_lines(agg: dict[str, Any]) -> list[str]:
    def fmt(sp: dict[str, float] | None, digits: int = 3) -> str:
        return "-" if sp is None else f"{sp['mean']:.{digits}f} ({sp['min']:.{digits}f}-{sp['max']:.{digits}f})"

    what = "mode" if _are_modes(agg["modes"]) else "variant"
    lines = [f"## Over seeds {', '.join(map(str, agg['seeds']))}: mean (min-max)", "",
             f"| {what} | runs completed | held-out pass rate at equal steps | last held-out | wall s |",
             "|---|---:|---|---:|---:|"]
    for mode, m in agg["modes"].items():
        by_step = "; ".join(f"{step}: {fmt(sp)}" for step, sp in m["heldout_by_step"].items()) or "-"
        lines.append(f"| {mode} | {m['completed']}/{m['runs']} | {by_step} | {fmt(m['heldout_last'])} "
                     f"| {fmt(m['wall_s'], 0)} |")
    if "elastic_within_colocate_spread" in agg:
        lines += ["", "Elastic's mean last held-out pass rate is "
                  + _where_words(agg["elastic_against_colocate_spread"]) + " colocate's spread over the seeds."]
    first = next(iter(agg["modes"]), "")
    for label, a in agg.get("against_first", {}).items():
        lines += ["", f"{label}: mean last held-out {a['difference'] * 100:+.1f} points against {first}, "
                  + _where_words(a["against_first_spread"]) + f" {first}'s spread over the seeds."]
    return lines


def mode_variants(spec: JobSpec, run: RunConfig, modes: tuple[str, ...] = MODES) -> list[tuple[str, JobSpec]]:
    """The job in each scheduling mode of ``modes`` (colocate on-policy; the others at least one version
    stale), in `MODES` order."""
    return [(mode, dataclasses.replace(spec, mode=Mode(mode),
                                       staleness_bound=0 if mode == "colocate" else max(spec.staleness_bound, 1),
                                       async_rollout_cells=run.engines if mode == "async" else None))
            for mode in MODES if mode in modes]


def parse_modes(value: str) -> tuple[str, ...]:
    """``colocate,elastic`` -> the listed modes; ValueError with one sentence if one is unknown or repeated."""
    modes = tuple(m.strip() for m in value.split(","))
    unknown = [m for m in modes if m not in MODES]
    if not value.strip() or unknown:
        raise ValueError(f"--modes lists scheduling modes from {', '.join(MODES)}, like colocate,elastic; "
                         f"got {value!r}")
    if len(set(modes)) != len(modes):
        raise ValueError(f"--modes lists a mode twice: {value!r}")
    return modes


def compare_modes(run: RunConfig, spec: JobSpec, *, seeds: int = 1, echo: Any = print,
                  config_path: Any = None, variants: list[tuple[str, JobSpec]] | None = None) -> dict[str, Any]:
    """Each mode on the job (or each of ``variants``: (label, job spec)), for ``seeds`` seeds (the
    job's seed, +1, ...); see the module docstring."""
    if seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {seeds}")
    variants = variants or mode_variants(spec, run)
    out_dir = Path(run.report_dir) / "compare"
    per_seed: dict[int, dict[str, dict[str, Any]]] = {}
    policies: dict[str, list[str | None]] = {}
    runs: list[dict[str, Any]] = []
    first: dict[str, dict[str, Any]] = {}
    target = 0.0
    for k in range(seeds):
        seed = spec.seed + k
        suffix = "" if seeds == 1 else f"-seed{seed}"
        results: dict[str, RunResult] = {}
        for label, variant in variants:
            echo(f"== {label}" + (f" (seed {seed})" if seeds > 1 else ""))
            name = _file_name(label)
            mode_run = dataclasses.replace(run, report_dir=str(out_dir / f"{name}{suffix}"))
            mode_spec = dataclasses.replace(variant, job_id=_job_id(spec.job_id, label, suffix), seed=seed)
            results[label] = run_job(mode_run, mode_spec, echo=echo,
                                     **({"config_path": config_path} if config_path else {}))
            runs.append(run_facts(label, seed, results[label]))
            policy = results[label].policy
            policies.setdefault(label, []).append(str(policy) if policy else None)
        finals = [r.evals[-1]["heldout_pass_rate"] for r in results.values() if r.evals]
        seed_target = min(finals) if finals else 0.0
        per_seed[seed] = {mode: _row(r, seed_target) for mode, r in results.items()}
        if k == 0:
            first, target = per_seed[seed], seed_target
    rows = {mode: {k: v for k, v in row.items() if k != "heldout_by_step"} for mode, row in first.items()}
    by_mode = _are_modes(label for label, _ in variants)
    what = "mode" if by_mode else "variant"
    summary: dict[str, Any] = {"seed": spec.seed, "target_heldout_pass_rate": target, "modes": rows,
                               "runs": runs, "policies": policies}
    title = "Mode comparison" if by_mode else f"Comparison of {', '.join(label for label, _ in variants)} ({spec.mode.value})"
    lines = [f"# {title} (seed {spec.seed}, {spec.num_steps} steps, budget {run.time_budget_s:.0f}s)", "",
             f"Target held-out pass rate: {target:.3f} (lowest final rate among the {what}s).", "",
             f"| {what} | wall s | steps | held-out first -> last | time to target s | utilization | switches |",
             "|---|---:|---:|---|---:|---:|---:|"]
    for mode, row in rows.items():
        ttt = "not reached" if row["time_to_target_s"] is None else f"{row['time_to_target_s']:.0f}"
        lines.append(f"| {mode} | {row['wall_s']:.0f} | {row['steps']} | {row['heldout_first']} -> "
                     f"{row['heldout_last']} | {ttt} | {row['utilization']:.2f} | {row['switches']} |")
    if seeds > 1:
        summary["over_seeds"] = across_seeds(per_seed)
        lines += ["", *_seed_lines(summary["over_seeds"])]
    lines += run_lines(runs)
    lines += policy_lines(policies)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "compare.md").write_text("\n".join(lines) + "\n")
    (out_dir / "compare.json").write_text(json.dumps(summary, indent=1))
    echo("\n".join(lines))
    return summary


def policy_lines(policies: dict[str, list[str | None]]) -> list[str]:
    """The compare report's list of each run's trained policy directory (`run_job`'s ``policy``),
    per mode or variant in seed order; empty when no run wrote one (``--save-policy false``)."""
    if not any(p for paths in policies.values() for p in paths):
        return []
    lines = ["", "Trained policies, one model directory per run in seed order (`gyre run --model DIR` trains on "
             "from one; `python -m bench.bench_heldout_kinds --checkpoint DIR ...` measures the built-in "
             "model's on held-out tasks without a deadline):", ""]
    return lines + [f"- {label}: " + ", ".join(p or "none (no step trained)" for p in paths)
                    for label, paths in policies.items()]


def _file_name(label: str) -> str:
    """A variant label as a report directory and job id part (``timeout_policy=zero`` -> ``timeout_policy-zero``)."""
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in label)


def _job_id(base: str, label: str, suffix: str) -> str:
    """The job id of a variant's run: ``BASE-LABEL-seedN`` in a job id's characters (a dotted field
    ``algorithm.learning_rate=1e-3`` -> ``algorithm-learning_rate-1e-3``), shortened with a digest of
    the label when that is longer than a job's id may be (``MAX_JOB_ID``: a job id leaves room for
    its evaluation executions' ``-eval``)."""
    allowed = set(string.ascii_letters + string.digits + "_-")
    part = "".join(c if c in allowed else "-" for c in label)
    job_id = f"{base}-{part}{suffix}"
    if len(job_id) > MAX_JOB_ID:
        tail = f"-{hashlib.blake2b(label.encode(), digest_size=4).hexdigest()}{suffix}"
        head = f"{base}-{part}"[: MAX_JOB_ID - len(tail)]
        job_id = head + tail
    assert ID_RE.match(job_id), job_id
    return job_id


def parse_vary(value: str) -> tuple[str, list[str]]:
    """``FIELD=A,B,...`` -> (field as a job flag name, values); ValueError with one sentence if malformed."""
    field_name, eq, values = value.partition("=")
    field_name = field_name.strip().removeprefix("--")
    choices = [v.strip() for v in values.split(",")] if eq else []
    if not field_name or not choices or not all(choices):
        raise ValueError(f"--vary needs a job field and its values, like timeout-policy=partial,zero; got {value!r}")
    if len(set(choices)) != len(choices):
        raise ValueError(f"--vary lists a value twice: {value!r}")
    return field_name, choices


def compare_main(argv: list[str]) -> int:
    """``gyre run --compare [--seeds N] [--modes A,B] [--vary FIELD=A,B,...] [same flags as gyre run]``."""
    import sys

    args, seeds, vary = list(argv), 1, None
    modes: tuple[str, ...] = MODES
    if "--seeds" in args:
        i = args.index("--seeds")
        try:
            seeds = int(args[i + 1])
        except (IndexError, ValueError):
            print("gyre run --compare: --seeds needs a whole number of seeds (e.g. --seeds 3)", file=sys.stderr)
            return 2
        del args[i:i + 2]
    try:
        if "--vary" in args:
            i = args.index("--vary")
            if i + 1 >= len(args):
                raise ValueError("--vary needs a job field and its values, like timeout-policy=partial,zero")
            vary = parse_vary(args[i + 1])
            del args[i:i + 2]
        if "--modes" in args:
            i = args.index("--modes")
            if i + 1 >= len(args):
                raise ValueError("--modes needs the scheduling modes to compare, like colocate,elastic")
            if vary is not None:
                raise ValueError("--modes and --vary do not go together: --vary compares one field's values "
                                 "in the job's own mode (set it with --mode)")
            modes = parse_modes(args[i + 1])
            del args[i:i + 2]
        if seeds < 1:
            raise ValueError(f"--seeds must be >= 1, got {seeds}")
        run, spec, config = load_run(args)
        variants = mode_variants(spec, run, modes)
        if vary is not None:
            name, values = vary
            label = name.replace("-", "_")
            variants = [(f"{label}={v}", load_run([*args, f"--{name}", v])[1]) for v in values]
    except ValueError as exc:
        print(f"gyre run --compare: {exc}", file=sys.stderr)
        return 2
    interrupt_on_signals()
    try:
        compare_modes(run, spec, seeds=seeds, config_path=config, variants=variants)
    except KeyboardInterrupt:
        print("gyre run --compare: interrupted; every service it started was stopped (the modes that "
              "ended have their reports under the report directory)", file=sys.stderr)
        return 130
    return 0
