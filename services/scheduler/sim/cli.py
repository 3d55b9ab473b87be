"""``gyre bench scheduler``: simulate a trace under colocate, async (best static split) and elastic.

    gyre bench scheduler --trace bench/traces/heavy_tail.jsonl --cells 16 [cluster flags] [--json]

Cluster flags are the fields of ``CostModel`` (``--decode-tok-s 50 --train-tok-s 5000 ...``, see
``--help``). Prints, per mode: makespan, utilization, idle cell-seconds, switches, mean/max
staleness, and the lower bound max(total work / cells, longest dependent chain); ``--json``
prints the same as one JSON object ``{"lower_bound_s": x, "modes": {"colocate": {...},
"async": {"rollout_cells": n, ...}, "elastic": {...}}, ...}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import MISSING, fields

from services.scheduler.sim.comparison import MODES, Comparison, compare
from services.scheduler.sim.cost_model import CostModel
from services.task.traces import load_trace, trace_stats

_COST_HELP = {f.name: (f.default, f.type) for f in fields(CostModel)}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gyre bench scheduler", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--trace", required=True, help="trace JSONL (DESIGN.md format)")
    p.add_argument("--cells", type=int, required=True, help="cells in the pool, the core included")
    p.add_argument("--staleness-bound", type=int, default=1, help="shared by async and elastic")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of the modes")
    p.add_argument("--async-rollout-cells", type=int, default=None,
                   help="fix the async split instead of sweeping it")
    p.add_argument("--one-step-off", action="store_true",
                   help="also run one-step-off async (a step's rollouts wait for the previous step's)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    cluster = p.add_argument_group("cluster (cost model)")
    for f in fields(CostModel):
        if f.name == "num_cells":
            continue
        kind = int if f.type in ("int", int) else float
        cluster.add_argument("--" + f.name.replace("_", "-"), type=kind,
                             default=None if f.default is MISSING else f.default)
    return p


def bench_main(argv: list[str]) -> int:
    """Entry point of ``gyre bench scheduler``; returns the process exit code."""
    args = _parser().parse_args(argv)
    try:
        cost = CostModel(num_cells=args.cells, **{f.name: getattr(args, f.name) for f in fields(CostModel)
                                                 if f.name != "num_cells"})
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        bad = [m for m in modes if m not in MODES]
        if bad or not modes:
            raise ValueError(f"--modes takes a subset of {', '.join(MODES)}, got {args.modes!r}")
        if args.staleness_bound < 0:
            raise ValueError("--staleness-bound must be >= 0")
        if args.async_rollout_cells is not None and not 1 <= args.async_rollout_cells <= args.cells - 1:
            raise ValueError(f"--async-rollout-cells must be in 1..{args.cells - 1}")
        if args.one_step_off and "async" not in modes:
            modes.append("async")
        trace = load_trace(args.trace)
        progress = None if args.json else (lambda m: print(f"simulating {m} ...", file=sys.stderr))
        result = compare(trace, cost, args.staleness_bound, modes=modes, one_step_off=args.one_step_off,
                         async_rollout_cells=args.async_rollout_cells, progress=progress)
    except (ValueError, OSError) as exc:
        print(f"gyre bench scheduler: {exc}", file=sys.stderr)
        return 2
    stats = trace_stats(trace, cost)
    if args.json:
        out = result.to_json()
        out["cells"] = args.cells
        out["staleness_bound"] = args.staleness_bound
        out["trace"] = stats.__dict__
        print(json.dumps(out, indent=1))
    else:
        print(format_text(result, stats.__dict__, args.cells))
    return 0


def format_text(result: Comparison, stats: dict, cells: int) -> str:
    b = result.bound
    lines = [f"trace: {stats['executions']} executions in {stats['steps']} steps, "
             f"{stats['mean_tokens_per_execution'] / 1e3:.0f}K tokens/execution, tail share {stats['tail_share']:.2f}; "
             f"{cells} cells",
             f"lower bound {b.lower_bound_s:,.0f} s = max(work / cells {b.work_bound_s:,.0f} s, "
             f"longest chain {b.chain_bound_s:,.0f} s, chain with work links {b.coupled_bound_s:,.0f} s)", "",
             f"{'mode':<20}{'makespan s':>12}{'x bound':>9}{'util':>7}{'idle cell-s':>13}{'switches':>10}"
             f"{'stale mean/max':>16}{'split':>7}"]
    for name, r in result.results.items():
        split = "" if r.rollout_cells is None else str(r.rollout_cells)
        lines.append(f"{name:<20}{r.makespan_s:>12,.0f}{r.makespan_s / b.lower_bound_s:>9.3f}{r.utilization:>7.2f}"
                     f"{r.idle_cell_s:>13,.0f}{r.switches:>10}{f'{r.mean_staleness:.2f}/{r.max_staleness}':>16}"
                     f"{split:>7}")
    ratios = result.ratios()
    if ratios:
        lines += ["", "  ".join(f"{k} {v:.3f}" for k, v in ratios.items())]
    return "\n".join(lines)
