"""Scheduler benchmark: colocate vs best async split vs elastic, against the physical lower bound.

    .venv/bin/python -m bench.bench_scheduler            # writes bench/results/scheduler.md

1. Reference regime: the default trace (bench/traces/heavy_tail.jsonl: ~700K tokens per
   execution, heavy tail, tool-time tails) on the default cluster (16 cells, 4 executions fit in a
   cell's KV, so KV capacity binds), every async split swept, plus one-step-off async.
2. Regimes: one knob at a time around the reference (training share, executions per cell per
   step, tail heaviness, staleness bound, batching cost, KV slots), async swept locally around
   its best split.
3. The policy's own cost: ``decide()`` decisions/s with 10,000 executions in flight.

The cost model is documented in bench/COST_MODEL.md. GYRE_BENCH_WORKERS sets the process count
(default: up to 2).
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from bench.traces.generate import TraceSpec, generate_trace
from services.scheduler.sim.bounds import lower_bound
from services.scheduler.sim.comparison import Comparison, compare
from services.scheduler.sim.cost_model import CostModel
from services.scheduler.policy import CellView, ClusterView, Mode, PolicyParams, decide
from services.common.roles import CellRole
from services.scheduler.sim.simulator import simulate
from services.task.traces import load_trace

ROOT = Path(__file__).resolve().parent
TRACE = ROOT / "traces" / "heavy_tail.jsonl"
OUT = ROOT / "results" / "scheduler.md"
CELLS = 16
TARGET_ASYNC, TARGET_COLOCATE, TARGET_BOUND = 1.78, 1.21, 1.10
DEADLINE_S = 4 * 3600.0  # every execution has a deadline, as real ones do (the default trace too)


@dataclass(frozen=True)
class Regime:
    name: str
    spec: TraceSpec = field(default_factory=lambda: TraceSpec(seed=1, deadline_s=DEADLINE_S))
    train_share: float | None = None  # None: the default train_tok_s
    staleness_bound: int = 1
    cost: dict = field(default_factory=dict)


REGIMES = [
    Regime("train share ~15%", train_share=0.15),
    Regime("train share ~55%", train_share=0.55),
    Regime("4 executions/cell/step (one wave)",
           spec=TraceSpec(seed=1, deadline_s=DEADLINE_S, executions_per_step=60)),
    Regime("8 executions/cell/step", spec=TraceSpec(seed=1, deadline_s=DEADLINE_S, executions_per_step=120)),
    Regime("light tail (solo tail 0.40)", spec=TraceSpec(seed=1, deadline_s=DEADLINE_S, tail_share=0.40)),
    Regime("heavier tail (solo tail 0.80)", spec=TraceSpec(seed=1, deadline_s=DEADLINE_S, tail_share=0.80)),
    Regime("staleness bound 0", staleness_bound=0),
    Regime("staleness bound 2", staleness_bound=2),
    Regime("batching less free (slowdown 0.3)", cost={"batch_slowdown_at_full": 0.3}),
    Regime("8 executions fit per cell", cost={"kv_capacity_tokens": 8 * 262_144}),
]


@dataclass
class Row:
    name: str
    train_share: float
    per_cell: float
    slots: int
    tail: float
    bound: int
    cmp: Comparison
    seconds: float
    oracle_s: float  # elastic with longest-first admission (clairvoyant diagnostic)


def _run_regime(regime: Regime) -> Row:
    t0 = time.perf_counter()
    trace = generate_trace(regime.spec)
    cost = CostModel(num_cells=CELLS, **regime.cost)
    if regime.train_share is not None:  # pick train_tok_s so training is this share of all work
        roll = lower_bound(trace, cost, regime.staleness_bound).rollout_cell_s
        tokens = sum(e.total_tokens for e in trace)
        cost = replace(cost, train_tok_s=tokens * (1 - regime.train_share) / (regime.train_share * roll))
    cmp = compare(trace, cost, regime.staleness_bound, one_step_off=True, local_sweep=True)
    return _row(regime.name, trace=trace, cost=cost, cmp=cmp, bound=regime.staleness_bound, t0=t0)


def _row(name: str, *, trace: list, cost: CostModel, cmp: Comparison, bound: int, t0: float) -> Row:
    b = cmp.bound
    oracle = simulate(trace, cost, PolicyParams(mode=Mode.ELASTIC, staleness_bound=bound), oracle_longest_first=True)
    steps = max(e.step for e in trace) + 1
    return Row(name=name, train_share=b.train_cell_s / (b.train_cell_s + b.rollout_cell_s),
               per_cell=len(trace) / steps / (cost.num_cells - 1), slots=cost.slots,
               tail=cmp.results["colocate"].rollout_tail_share, bound=bound, cmp=cmp,
               seconds=time.perf_counter() - t0, oracle_s=oracle.makespan_s)


def _reference() -> tuple[Row, float]:
    t0 = time.perf_counter()
    trace = load_trace(TRACE)
    cost = CostModel(num_cells=CELLS)
    cmp = compare(trace, cost, 1, one_step_off=True)
    row = _row("reference (default trace)", trace=trace, cost=cost, cmp=cmp, bound=1, t0=t0)
    events = sum(r.events for r in cmp.results.values())
    return row, events


# -- the policy's own cost --------------------------------------------------------------------------
def _views(rng: np.random.Generator) -> dict[str, tuple[ClusterView, int]]:
    """Cluster snapshots with 10,000 executions in flight: steady (full cells) and tail (half-full)."""
    kv, slots = 262_144, 4
    out = {}
    for label, n_cells, load in (("2,501 cells, full", 2501, None), ("5,001 cells, half full (tail)", 5001, 2)):
        inflight = [slots] * (n_cells - 1) if load is None else list(rng.permutation(
            np.repeat([1, 2, 3], (n_cells - 1) // 3 + 1)[: n_cells - 1]))
        scale = 10_000 / sum(inflight)
        inflight = [min(slots, max(0, int(round(x * scale)))) for x in inflight]
        cells = [CellView(cell_id="core", role=CellRole.TRAIN, is_core=True, inflight=0, kv_used_tokens=0,
                          kv_capacity_tokens=slots * kv)]
        cells += [CellView(cell_id=f"c{i:05d}", role=CellRole.ROLLOUT, is_core=False, inflight=n, kv_used_tokens=n * kv,
                           kv_capacity_tokens=slots * kv) for i, n in enumerate(inflight)]
        running = sum(inflight)
        view = ClusterView(now_s=0.0, step=3, weight_version=3, cells=tuple(cells), queued=0, running=running,
                           finished_in_step=100, step_size=20_000, train_ready=True, training_active=True,
                           next_step_allowed=False)
        out[label] = (view, running)
    return out


def _decision_rates() -> list[tuple[str, int, str, float, int]]:
    rows = []
    for label, (view, running) in _views(np.random.default_rng(0)).items():
        for mode in Mode:
            params = PolicyParams(mode=mode, async_rollout_cells=len(view.cells) // 2, execution_kv_tokens=262_144)
            best = float("inf")
            for _ in range(5):  # best of 5 batches: the machine is shared
                t0 = time.perf_counter()
                for _ in range(3):
                    actions = decide(view, params)
                best = min(best, (time.perf_counter() - t0) / 3)
            rows.append((label, running, mode.value, 1.0 / best, len(actions)))
    return rows


# -- report -----------------------------------------------------------------------------------------
def _ok(x: bool) -> str:
    return "yes" if x else "**no**"


def _report(ref: Row, rows: list[Row], rates: list[tuple[str, int, str, float, int]], sim_rate: float,
            total_s: float) -> str:
    c = ref.cmp
    b = c.bound
    r = c.ratios()
    lines = [
        "# Scheduler: colocate vs async vs elastic",
        "",
        f"Generated by `python -m bench.bench_scheduler` in {total_s:.0f} s. Cost model: bench/COST_MODEL.md. "
        "Every mode runs the same trace on the same simulated cluster through the same `policy.decide`; "
        "async is the best static split found by sweeping the split at the same staleness bound; "
        "the lower bound is max(total work / cells, longest dependent chain) (no schedule that does not stop "
        "an execution earlier than a solo run would can beat it: an execution with a deadline counts with the "
        "turns a solo run completes before it, services/scheduler/sim/bounds.py). Every execution of every trace "
        f"has a deadline of {DEADLINE_S / 3600:.0f} h, as real ones do.",
        "",
        "## Reference regime",
        "",
        f"Default trace `bench/traces/heavy_tail.jsonl` ({ref.per_cell * (CELLS - 1):.0f} executions/step x 12 steps, "
        f"~700K tokens per execution, tool-time tails, {DEADLINE_S / 3600:.0f} h deadlines), 16 cells (1 core), "
        "4 executions fit in a cell's KV "
        f"(KV capacity binds: {ref.per_cell:.0f} executions per cell per step), staleness bound 1, "
        f"training {ref.train_share:.0%} of all work. In colocate the last 10% of a step's executions take "
        f"{ref.tail:.0%} of its rollout time.",
        "",
        f"Lower bound **{b.lower_bound_s / 3600:.1f} h** = max(work / cells {b.work_bound_s / 3600:.1f} h, "
        f"longest chain {b.chain_bound_s / 3600:.1f} h, chain with work links {b.coupled_bound_s / 3600:.1f} h).",
        "",
        "| mode | makespan h | x lower bound | utilization | idle cell-h | switches (mean s) | migrations "
        "| staleness mean / max | rollout cells | timeouts |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, res in c.results.items():
        sw = f"{res.switches} ({res.mean_switch_s:.1f})" if res.switches else "0"
        lines.append(f"| {name} | {res.makespan_s / 3600:.1f} | {res.makespan_s / b.lower_bound_s:.3f} | "
                     f"{res.utilization:.2f} | {res.idle_cell_s / 3600:.0f} | {sw} | {res.migrations} | "
                     f"{res.mean_staleness:.2f} / {res.max_staleness} | "
                     f"{'' if res.rollout_cells is None else res.rollout_cells} | {res.timeouts} |")
    sweep = ", ".join(f"{k}: {v / 3600:.1f}" for k, v in sorted(c.async_sweep.items()))
    best_async = c.results["async"].makespan_s
    lines += [
        "",
        f"Async sweep (rollout cells: makespan h): {sweep}.",
        "",
        "| ratio | measured | target | met |",
        "|---|---:|---:|---|",
        f"| async (best split) / elastic | {r['async_over_elastic']:.3f} | >= {TARGET_ASYNC} | "
        f"{_ok(r['async_over_elastic'] >= TARGET_ASYNC)} |",
        f"| colocate / elastic | {r['colocate_over_elastic']:.3f} | >= {TARGET_COLOCATE} | "
        f"{_ok(r['colocate_over_elastic'] >= TARGET_COLOCATE)} |",
        f"| elastic / lower bound | {r['elastic_over_lower_bound']:.3f} | <= {TARGET_BOUND} | "
        f"{_ok(r['elastic_over_lower_bound'] <= TARGET_BOUND)} |",
        f"| one-step-off async / elastic (reference only) | {r['async_one_step_off_over_elastic']:.3f} | "
        f"(>= {TARGET_ASYNC}) | {_ok(r['async_one_step_off_over_elastic'] >= TARGET_ASYNC)} |",
        f"| best async / lower bound (ceiling on any async speed-up) | {best_async / b.lower_bound_s:.3f} | | |",
        "",
        "## Regimes",
        "",
        "One knob changed at a time from the reference (regime traces: generator seed 1, 12 steps; async and "
        "one-step-off async swept locally around the fluid balance split until two splits in a row are worse). "
        "*tail* = share of a step's colocate rollout time spent on its last 10% of executions; "
        "*binds*: work = total work / cells, chain = pure dependency chain, coupled = chain with work links "
        "(the largest is the lower bound, LB). *oracle* = elastic admitting each step's executions "
        "longest-first, which needs to know execution lengths in advance (a diagnostic, not a mode).",
        "",
        "| regime | train share | exec/cell/step | KV slots | tail | bound | LB h (binds) | elastic x LB "
        "| oracle x LB | async / elastic (split) | one-step-off / elastic | colocate / elastic "
        "| elastic never slower |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in [ref, *rows]:
        cr, rr = row.cmp.results, row.cmp.ratios()
        bd = row.cmp.bound
        parts = {"work": bd.work_bound_s, "chain": bd.chain_bound_s, "coupled": bd.coupled_bound_s}
        binds = max(parts, key=lambda k: parts[k] + (1e-6 if k == "work" else 0.0))
        never = cr["elastic"].makespan_s <= min(cr["colocate"].makespan_s, cr["async"].makespan_s)
        lines.append(
            f"| {row.name} | {row.train_share:.0%} | {row.per_cell:.0f} | {row.slots} | {row.tail:.2f} | {row.bound} | "
            f"{bd.lower_bound_s / 3600:.1f} ({binds}) | {rr['elastic_over_lower_bound']:.3f} | "
            f"{row.oracle_s / bd.lower_bound_s:.3f} | "
            f"{rr['async_over_elastic']:.3f} ({cr['async'].rollout_cells}) | "
            f"{rr['async_one_step_off_over_elastic']:.3f} | {rr['colocate_over_elastic']:.3f} | {_ok(never)} |")
    lines += [
        "",
        "## The policy's own cost",
        "",
        "`decide()` on one core of this machine (pure Python, no I/O), 10,000 executions in flight, "
        "training data ready (so elastic computes a consolidation). Redis operations per decision belong to "
        "the live scheduler (state + orchestrator) and are measured by its own benchmark; `decide()` itself "
        "does none.",
        "",
        "| cluster | executions in flight | mode | decisions/s | actions per decision | Redis ops/decision |",
        "|---|---:|---|---:|---:|---|",
    ]
    for label, running, mode, rate, n_actions in rates:
        lines.append(f"| {label} | {running:,} | {mode} | {rate:,.0f} | {n_actions:,} | 0 here; see live scheduler |")
    lines += [
        "",
        f"Simulator speed: {sim_rate:,.0f} events/s over the reference runs.",
        "",
        NOTES,
    ]
    return "\n".join(lines) + "\n"


NOTES = """## Reading the results

* **Elastic vs async: the 1.78x target is missed against this baseline, by construction.** The
  async baseline is the strongest static split we could build: every split simulated, and
  rollouts of the next step refill free KV slots whenever the staleness bound allows (fully
  asynchronous refill). On the reference trace the best split is already within
  "best async / lower bound" of the physical limit, so no scheduler could be 1.78x faster than it
  there. Elastic still beats it on every trace (last column). Against one-step-off async (a
  step's rollouts start only once the previous step's have all finished, overlapping only its
  update, as common async RL trainers ship it) elastic's lead is the "one-step-off / elastic"
  column; it comes closer to the published 1.78x but also stays below it on the reference trace.
* **Colocate**: elastic is >= 1.21x faster on every trace: a colocated pool idles through every
  step's tail (its utilization is the KV occupancy, mostly one straggler per cell).
* **Where elastic is more than 10% above the lower bound**, the bound is what is loose: it is
  clairvoyant and ignores rollout capacity on its chain. It starts each step's longest execution
  the instant the staleness bound allows, alone on a cell (full speed), and trains a whole
  update on every cell at once. A real scheduler does not know which execution will be long
  (FIFO admission; the *oracle* column shows what knowing it would buy), runs it on a shared cell
  (batched speed, 1 + slowdown), and has to split cells between the update in flight and the
  next step's rollouts when both are on the critical path. These rows are the chain-bound ones:
  little training to fill the gaps (train share 15%), on-policy (bound 0, nothing to overlap),
  two waves per step, or a cluster that finishes rollout work fast (8 per cell). More steps
  amortize the last step's tail, which nothing can overlap (the reference run has 12 steps, the
  published one 48).
* Staleness: colocate is on-policy (0); async and elastic stay within the bound by admission
  (`policy.may_start`), which the simulator asserts for every execution.
"""


def main() -> int:
    t0 = time.perf_counter()
    workers = int(os.environ.get("GYRE_BENCH_WORKERS", min(2, os.cpu_count() or 1)))
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(_run_regime, r) for r in REGIMES]
        t_ref = time.perf_counter()
        ref, events = _reference()
        ref_wall = time.perf_counter() - t_ref
        rows = [f.result() for f in futures]
    rates = _decision_rates()
    report = _report(ref, rows, rates, events / ref_wall, time.perf_counter() - t0)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(report)
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
