"""Run every mode on one trace with its best settings and compare against the lower bound.

* colocate: no knobs (on-policy by construction);
* async: the best static split, found by sweeping the number of rollout cells at the job's
  staleness bound (every split for pools up to ``FULL_SWEEP_MAX`` movable cells; above that a
  coarse grid, then every split around its best point);
* elastic: the default knobs of ``PolicyParams``.

Optionally also the one-step-off async variant (``rollout_batches=True``), swept the same way,
as a reference for how common async trainers behave; it is not the baseline.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from services.scheduler.sim.bounds import LowerBound, lower_bound
from services.scheduler.sim.cost_model import CostModel
from services.scheduler.policy import Mode, PolicyParams
from services.scheduler.sim.simulator import SimResult, simulate
from services.task.traces import TraceExecution

FULL_SWEEP_MAX = 24


@dataclass
class Comparison:
    bound: LowerBound
    results: dict[str, SimResult]  # "colocate" | "async" | "elastic" | "async_one_step_off"
    async_sweep: dict[int, float] = field(default_factory=dict)  # rollout cells -> makespan

    def ratios(self) -> dict[str, float]:
        """Makespan of each other mode over elastic's, and elastic's over the lower bound."""
        out: dict[str, float] = {}
        el = self.results.get("elastic")
        if el is None:
            return out
        for name, r in self.results.items():
            if name != "elastic":
                out[f"{name}_over_elastic"] = r.makespan_s / el.makespan_s
        out["elastic_over_lower_bound"] = el.makespan_s / self.bound.lower_bound_s
        return out

    def to_json(self) -> dict:
        modes: dict[str, dict] = {}
        for name, r in self.results.items():
            modes[name] = r.summary() | {"over_lower_bound": r.makespan_s / self.bound.lower_bound_s}
        if "async" in modes and self.async_sweep:
            modes["async"]["sweep"] = {str(k): v for k, v in sorted(self.async_sweep.items())}
        return {"lower_bound_s": self.bound.lower_bound_s, "work_bound_s": self.bound.work_bound_s,
                "chain_bound_s": self.bound.chain_bound_s, "coupled_bound_s": self.bound.coupled_bound_s,
                "modes": modes, "ratios": self.ratios()}


def sweep_async(trace: Sequence[TraceExecution], cost: CostModel, staleness_bound: int, *,
                rollout_batches: bool = False, around: int | None = None) -> tuple[SimResult, dict[int, float]]:
    """The best static split (least makespan; ties: fewer rollout cells) and every makespan tried.

    ``around=None`` tries every split (a coarse grid, then every split near its best, above
    ``FULL_SWEEP_MAX`` movable cells). ``around=r`` starts at split ``r`` and walks to either side
    while the makespan improves, then two splits further (a local sweep for regime tables).
    """
    movable = cost.num_cells - 1
    results: dict[int, SimResult] = {}

    def run(r: int) -> float:
        if r not in results:
            results[r] = simulate(trace, cost, PolicyParams(mode=Mode.ASYNC, staleness_bound=staleness_bound,
                                                            async_rollout_cells=r, rollout_batches=rollout_batches))
        return results[r].makespan_s

    def best() -> int:
        return min(results, key=lambda r: (results[r].makespan_s, r))

    if around is not None:
        r0 = min(max(1, around), movable)
        run(r0)
        for direction in (-1, 1):
            r, misses = r0, 0
            while misses < 2 and 1 <= r + direction <= movable:
                r += direction
                run(r)
                misses = 0 if best() == r else misses + 1
    elif movable <= FULL_SWEEP_MAX:
        for r in range(1, movable + 1):
            run(r)
    else:
        stride = -(-movable // 12)
        for r in range(1, movable + 1, stride):
            run(r)
        b = best()
        for r in range(max(1, b - stride + 1), min(movable, b + stride - 1) + 1):
            run(r)
    return results[best()], {r: res.makespan_s for r, res in results.items()}


def balanced_split(bound: LowerBound, cost: CostModel) -> int:
    """Rollout cells that balance rollout and training work in a fluid model (sweep start)."""
    share = bound.rollout_cell_s / max(bound.rollout_cell_s + bound.train_cell_s, 1e-9)
    return min(cost.num_cells - 1, max(1, round(share * cost.num_cells)))


MODES = ("colocate", "async", "elastic")


def compare(trace: Sequence[TraceExecution], cost: CostModel, staleness_bound: int = 1, *,
            modes: Sequence[str] = MODES, one_step_off: bool = False, local_sweep: bool = False,
            async_rollout_cells: int | None = None, elastic: PolicyParams | None = None,
            progress: Callable[[str], None] | None = None) -> Comparison:
    """Run ``modes`` on ``trace`` under ``cost``; async and elastic share the staleness bound.

    ``async_rollout_cells`` fixes the async split instead of sweeping it; ``local_sweep`` sweeps
    only around the fluid balance point; ``one_step_off`` adds the one-step-off async reference.
    """
    say = progress or (lambda _msg: None)
    bound = lower_bound(trace, cost, staleness_bound)
    results: dict[str, SimResult] = {}
    sweep: dict[int, float] = {}
    around = balanced_split(bound, cost) if local_sweep else None
    for mode in modes:
        say(mode)
        if mode == "colocate":
            results[mode] = simulate(trace, cost, PolicyParams(mode=Mode.COLOCATE, staleness_bound=staleness_bound))
        elif mode == "elastic":
            results[mode] = simulate(trace, cost,
                                     elastic or PolicyParams(mode=Mode.ELASTIC, staleness_bound=staleness_bound))
        elif mode == "async" and async_rollout_cells is not None:
            results[mode] = simulate(trace, cost, PolicyParams(mode=Mode.ASYNC, staleness_bound=staleness_bound,
                                                               async_rollout_cells=async_rollout_cells))
        elif mode == "async":
            results[mode], sweep = sweep_async(trace, cost, staleness_bound, around=around)
        else:
            raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    if one_step_off:
        say("async_one_step_off")
        start = results["async"].rollout_cells if "async" in results else around
        results["async_one_step_off"], _ = sweep_async(trace, cost, staleness_bound, rollout_batches=True,
                                                       around=start if local_sweep else None)
    return Comparison(bound=bound, results=results, async_sweep=sweep)
