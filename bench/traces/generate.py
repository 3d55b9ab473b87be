"""Synthetic heavy-tailed agent traces in the scheduler trace format (DESIGN.md).

    .venv/bin/python -m bench.traces.generate --out bench/traces/heavy_tail.jsonl  # the default trace
    .venv/bin/python -m bench.traces.generate --out t.jsonl --steps 4 --executions-per-step 32 --tail-share 0.3

Shape of an execution: ``turns ~ mean_turns * size`` where ``size`` is log-normal (shared in part
by the executions of one group: hard tasks are long for every sample), each turn appends a
log-normal number of tokens (``gen_fraction`` of them generated), and tool time per turn is
log-normal with a Pareto tail (rare long tool calls: builds, test suites). The size spread is
calibrated by bisection so that, per step, the last 10% of executions take ``tail_share`` of a
one-wave rollout phase (solo speeds of the reference cost model), and tokens are rescaled so the
mean execution has ``mean_tokens`` tokens.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import numpy as np

from services.scheduler.sim.cost_model import CostModel
from services.task.traces import TraceExecution, save_trace, trace_stats


@dataclass(frozen=True, kw_only=True)
class TraceSpec:
    """Knobs of a synthetic trace."""

    steps: int = 12
    executions_per_step: int = 180
    group_size: int = 6
    mean_tokens: float = 700_000.0
    """Mean tokens per execution (prefill + generated, over all turns)."""
    mean_turns: float = 20.0
    gen_fraction: float = 0.15
    """Share of an execution's tokens the model generates (the rest is appended context)."""
    tail_share: float | None = 0.65
    """Target (max - p90) / max of solo latency per step; None: use ``size_sigma`` as given."""
    size_sigma: float = 0.8
    group_corr: float = 0.5
    """Share of the log-size variance shared within a group."""
    env_mean_s: float = 4.0
    """Mean of the common (log-normal) tool time per turn."""
    tool_tail_prob: float = 0.02
    """Chance that a turn's tool call is a long one (Pareto)."""
    tool_tail_scale_s: float = 60.0
    tool_tail_alpha: float = 1.5
    tool_tail_cap_s: float = 1800.0
    deadline_s: float | None = None
    """Every execution's ``timeout_s`` (real executions have one); None: no deadlines."""
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 1 or self.executions_per_step < 1 or self.group_size < 1:
            raise ValueError("steps, executions_per_step and group_size must be >= 1")
        if self.executions_per_step % self.group_size:
            raise ValueError("executions_per_step must be a multiple of group_size")
        if not 0 < self.gen_fraction < 1:
            raise ValueError("gen_fraction must be in (0, 1)")
        if self.tail_share is not None and not 0 < self.tail_share < 1:
            raise ValueError("tail_share must be in (0, 1)")
        if self.deadline_s is not None and not self.deadline_s > 0:
            raise ValueError("deadline_s must be > 0")


@dataclass
class _Streams:
    """Per-execution random draws, long enough for the largest size any calibrated spread gives.

    Each execution reads its first ``n`` turns from its own streams, so changing the spread
    changes how many turns it has, never the turns themselves: the tail share is monotone in it.
    """

    z: np.ndarray  # (executions,) standardized log-size, group part included
    tokens: list[np.ndarray]  # relative tokens per turn (mean 1)
    gen_share: list[np.ndarray]
    env: list[np.ndarray]


def _streams(spec: TraceSpec, sigma_max: float) -> _Streams:
    rng = np.random.default_rng(spec.seed)
    n_groups = spec.executions_per_step // spec.group_size
    z_group = np.repeat(rng.normal(size=spec.steps * n_groups), spec.group_size)
    z = np.sqrt(spec.group_corr) * z_group + np.sqrt(1 - spec.group_corr) * rng.normal(size=len(z_group))
    tokens, gen_share, env = [], [], []
    for i, zi in enumerate(z):
        s_star = float(np.clip(zi, 0.0, sigma_max))  # the spread that maximizes this execution's size
        n_cap = _turns(spec, zi, s_star) + 1
        r = np.random.default_rng([spec.seed, i])
        tokens.append(r.lognormal(-0.125, 0.5, n_cap))
        gen_share.append(np.clip(r.normal(spec.gen_fraction, spec.gen_fraction / 4, n_cap), 0.01, 0.9))
        e = spec.env_mean_s * r.lognormal(-0.32, 0.8, n_cap)  # mean env_mean_s
        long = r.random(n_cap) < spec.tool_tail_prob
        tail = np.minimum(spec.tool_tail_scale_s * (1 + r.pareto(spec.tool_tail_alpha, n_cap)), spec.tool_tail_cap_s)
        env.append(np.round(np.where(long, e + tail, e), 2))
    return _Streams(z=z, tokens=tokens, gen_share=gen_share, env=env)


def _turns(spec: TraceSpec, z: float, sigma: float) -> int:
    return max(1, int(round(spec.mean_turns * np.exp(sigma * z - sigma**2 / 2))))  # mean size 1


def _solo_latencies(spec: TraceSpec, st: _Streams, sigma: float, cost: CostModel) -> np.ndarray:
    """Solo latency of every execution at this spread (tokens rescaled to mean_tokens), vectorized."""
    ns = [_turns(spec, z, sigma) for z in st.z]
    per_turn = spec.mean_tokens / spec.mean_turns
    tok = np.array([t[:n].sum() for t, n in zip(st.tokens, ns, strict=True)]) * per_turn
    gen = np.array([(t[:n] * g[:n]).sum() for t, g, n in zip(st.tokens, st.gen_share, ns, strict=True)]) * per_turn
    env = np.array([e[:n].sum() for e, n in zip(st.env, ns, strict=True)])
    scale = spec.mean_tokens / tok.mean()
    return scale * ((tok - gen) / cost.prefill_tok_s + gen / cost.decode_tok_s) + env


def _tail_share(spec: TraceSpec, lat: np.ndarray) -> float:
    per_step = np.sort(lat.reshape(spec.steps, spec.executions_per_step), axis=1)
    p90 = per_step[:, max(0, int(np.ceil(0.9 * spec.executions_per_step)) - 1)]
    return float(np.mean((per_step[:, -1] - p90) / per_step[:, -1]))


def _build(spec: TraceSpec, st: _Streams, sigma: float) -> list[TraceExecution]:
    per_turn = spec.mean_tokens / spec.mean_turns
    n_groups = spec.executions_per_step // spec.group_size
    raw = []
    for i, z in enumerate(st.z):
        n = _turns(spec, z, sigma)
        tokens = per_turn * st.tokens[i][:n]
        raw.append((tokens * (1 - st.gen_share[i][:n]), tokens * st.gen_share[i][:n], st.env[i][:n]))
    scale = spec.mean_tokens / np.mean([p.sum() + g.sum() for p, g, _ in raw])  # exact mean tokens
    out = []
    for i, (prompt, gen, env) in enumerate(raw):
        step, rest = divmod(i, spec.executions_per_step)
        g, k = divmod(rest, spec.group_size)
        assert g < n_groups
        name = f"s{step:03d}-g{g:03d}"
        out.append(TraceExecution(step=step, group=name, execution_id=f"{name}-e{k:02d}",
                                  prompt_tokens=np.maximum(1, np.round(prompt * scale)).astype(np.int64),
                                  gen_tokens=np.maximum(1, np.round(gen * scale)).astype(np.int64), env_s=env,
                                  timeout_s=spec.deadline_s))
    return out


def generate_trace(spec: TraceSpec, cost: CostModel | None = None) -> list[TraceExecution]:
    """Draw a trace; with ``spec.tail_share`` set, calibrate the size spread to reach it."""
    cost = cost or CostModel(num_cells=16)
    if spec.tail_share is None:
        return _build(spec, _streams(spec, spec.size_sigma), spec.size_sigma)
    lo, hi = 0.01, 2.5
    st = _streams(spec, hi)
    while hi - lo > 2e-3:  # the tail share grows monotonically with the spread
        mid = (lo + hi) / 2
        if _tail_share(spec, _solo_latencies(spec, st, mid, cost)) < spec.tail_share:
            lo = mid
        else:
            hi = mid
    return _build(spec, st, (lo + hi) / 2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    for f in TraceSpec.__dataclass_fields__.values():
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        kind = float if f.type in ("float", "float | None") else int
        p.add_argument(flag, type=kind, default=default, help=f"default {default}")
    args = p.parse_args(argv)
    spec = TraceSpec(**{k: getattr(args, k) for k in TraceSpec.__dataclass_fields__})
    trace = generate_trace(spec)
    save_trace(trace, args.out)
    st = trace_stats(trace, CostModel(num_cells=16))
    print(f"wrote {args.out}: {st.executions} executions, {st.steps} steps, "
          f"{st.mean_tokens_per_execution / 1e3:.0f}K tokens/execution, {st.mean_turns:.0f} turns, "
          f"tail share {st.tail_share:.2f}, tool share {st.env_share:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
