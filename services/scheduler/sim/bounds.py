"""The physical lower bound on a trace's makespan: max(total work / cells, longest dependent chain).

No schedule of any mode can beat it under the cost model (switches, migrations and weight sync
are free here, which only lowers it). An execution with a ``timeout_s`` ends at the first turn
boundary past its deadline, so how much of it runs depends on the schedule (a slowed execution
does fewer turns). It contributes the turns a solo run completes before its deadline: the work any
schedule must do that does not stop it earlier than a solo run would (``must_do``). Without this,
a trace where every execution has a deadline had a work bound of 0. Its latency counts in the
chain, capped at the deadline.

Work. Rollout occupies KV slots: an execution holds one slot through its model calls and its
tool time. A cell with ``n`` active calls and ``m`` executions in tool time (``n + m <= slots``)
does ``n * speed(n)`` solo-seconds of model work and ``m`` seconds of tool time per second. The
fewest cell-seconds that cover all model work M and all tool time V is a two-constraint linear
program over such (n, m) configurations, solved exactly (optimum mixes two configurations).
Training needs ``tokens / train_tok_s`` cell-seconds. Work bound = (rollout + train) / cells.

Chain. Update ``s`` (done at ``D_s``) needs: update ``s-1`` (its weights), then all of step ``s``'s
tokens trained on at most every cell; and step ``s``'s longest execution, which cannot start
before weights ``s - k`` exist (``D_{s-k-1}``, k = staleness bound) and runs at least its solo
latency, after which its whole group (advantages are group-relative) must still be trained; and
for every window of steps a..s, all their work, which cannot start before weights ``a - k`` exist
(``work(a..s)``, the work bound of those steps alone)::

    D_s = max(D_{s-1} + W_s, max(D_{s-1}, D_{s-k-1} + Lmax_s) + G_s,
              max_a D_{a-k-1} + work(a..s)) + publish_s

``chain_bound_s`` is ``D_last`` without the window term (the pure dependency chain),
``coupled_bound_s`` with it; the lower bound is the largest of work, chain and coupled. Rollouts
never run on the core, so every work bound is also at least rollout cell-seconds / (cells - 1).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from services.scheduler.sim.cost_model import CostModel
from services.task.traces import TraceExecution


@dataclass(frozen=True)
class LowerBound:
    lower_bound_s: float  # max of the three below
    work_bound_s: float  # total work / cells
    chain_bound_s: float  # longest dependent chain (staleness, update order, longest executions, last groups)
    coupled_bound_s: float  # the chain with work windows as links (see module docstring)
    rollout_cell_s: float
    train_cell_s: float


def rollout_cell_seconds(model_work_s: float, env_s: float, cost: CostModel) -> float:
    """Fewest cell-seconds that deliver ``model_work_s`` solo-seconds and ``env_s`` slot-seconds."""
    if model_work_s <= 0 and env_s <= 0:
        return 0.0
    slots = cost.slots
    n = np.arange(slots + 1)
    work_rate = np.array([k * cost.speed(int(k)) if k else 0.0 for k in n])  # solo-s per cell-s
    env_rate = (slots - n).astype(float)  # tool slot-s per cell-s with every other slot in tool time
    best = np.inf
    for i in range(slots + 1):
        for j in range(i, slots + 1):
            # Mix p of config i and 1-p of config j; T(p) = max(M / a(p), V / b(p)).
            a_i, a_j, b_i, b_j = work_rate[i], work_rate[j], env_rate[i], env_rate[j]
            candidates = [0.0, 1.0]
            # Both constraints tight: M * b(p) = V * a(p), linear in p.
            denom = model_work_s * (b_i - b_j) - env_s * (a_i - a_j)
            if denom != 0:
                p = (env_s * a_j - model_work_s * b_j) / denom
                if 0.0 < p < 1.0:
                    candidates.append(p)
            for p in candidates:
                a = p * a_i + (1 - p) * a_j
                b = p * b_i + (1 - p) * b_j
                if (model_work_s > 0 and a <= 0) or (env_s > 0 and b <= 0):
                    continue
                t_work = model_work_s / a if model_work_s > 0 else 0.0
                t_env = env_s / b if env_s > 0 else 0.0
                best = min(best, max(t_work, t_env))
    return float(best)


def must_do(e: TraceExecution, cost: CostModel) -> int:
    """Turns of ``e`` a solo run completes: all of them, or up to the first turn boundary at or past
    its ``timeout_s`` (the simulator's and the harness's rule: an execution ends between turns)."""
    if e.timeout_s is None:
        return len(e.env_s)
    elapsed = np.cumsum(e.model_work_s(cost) + e.env_s)
    past = np.flatnonzero(elapsed >= e.timeout_s)
    return int(past[0]) + 1 if past.size else len(e.env_s)


def lower_bound(trace: Sequence[TraceExecution], cost: CostModel, staleness_bound: int) -> LowerBound:
    """max(total work / cells, longest dependent chain) for ``trace`` under ``cost``."""
    n_steps = max(e.step for e in trace) + 1
    # An execution with a deadline counts with the turns a solo run completes (see ``must_do``);
    # every execution counts toward the chain (latency capped at its deadline).
    model = np.zeros(n_steps)
    env = np.zeros(n_steps)
    tokens = np.zeros(n_steps)
    group_tokens: dict[str, int] = defaultdict(int)
    longest: dict[int, tuple[float, str]] = {}
    for e in trace:
        lat = e.solo_latency_s(cost)
        if e.step not in longest or lat > longest[e.step][0]:
            longest[e.step] = (lat, e.group)
        t = must_do(e, cost)
        n_tokens = int(e.prompt_tokens[:t].sum() + e.gen_tokens[:t].sum())
        model[e.step] += float(e.model_work_s(cost)[:t].sum())
        env[e.step] += float(e.env_s[:t].sum())
        tokens[e.step] += n_tokens
        group_tokens[e.group] += n_tokens

    def work_of(steps: slice) -> float:
        """Cell-seconds lower bound of a set of steps' rollout + training (the core never rolls out)."""
        roll = rollout_cell_seconds(float(model[steps].sum()), float(env[steps].sum()), cost)
        train = float(tokens[steps].sum()) / cost.train_tok_s
        return max((roll + train) / cost.num_cells, roll / (cost.num_cells - 1))

    rollout_cs = rollout_cell_seconds(float(model.sum()), float(env.sum()), cost)
    train_cs = float(tokens.sum()) / cost.train_tok_s
    work = work_of(slice(0, n_steps))

    full_rate = cost.train_rate(cost.num_cells)
    k = staleness_bound
    def chain_dp(with_work: bool) -> float:
        done: list[float] = []  # D_s: earliest time update s can be published
        for s in range(n_steps):
            prev = done[s - 1] if s >= 1 else 0.0
            start = done[s - k - 1] if s - k - 1 >= 0 else 0.0
            lat, group = longest[s]
            whole_step = prev + float(tokens[s]) / full_rate  # step s trains on weights s: after update s-1
            last_group = max(prev, start + lat) + group_tokens.get(group, 0) / full_rate
            windows = 0.0
            if with_work:  # all work of steps a..s happens after weights a-k exist and before update s
                windows = max((done[a - k - 1] if a - k - 1 >= 0 else 0.0) + work_of(slice(a, s + 1))
                              for a in range(s + 1))
            done.append(max(whole_step, last_group, windows) + cost.publish_s)
        return done[-1]

    chain = chain_dp(False)
    coupled = chain_dp(True)
    return LowerBound(lower_bound_s=float(max(work, chain, coupled)), work_bound_s=float(work),
                      chain_bound_s=float(chain), coupled_bound_s=float(coupled),
                      rollout_cell_s=rollout_cs, train_cell_s=train_cs)
