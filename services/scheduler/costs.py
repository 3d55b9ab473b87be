"""What a role switch costs and what it buys: the numbers elastic's ``decide()`` weighs.

Freeing a ROLLOUT cell for training pays its way only if the update finishes sooner by more than
the cell's round trip: it trains nothing while it switches (``rollout_to_train_s``) and must come
back for the next step's rollouts (``train_to_rollout_s``). What it buys depends on how much the
update's throughput grows with one more TRAIN cell: nearly linearly when every cell brings its own
accelerators, not at all when the cells share one host's cores (a small box, CPU runs). So the
policy is given ``SwitchCosts`` and frees a cell only when ``gain_s(k) > train_to_rollout_s``.

Where the numbers come from:

- live (``estimate``): the scheduler times every switch it carries out and the trainer reports
  each update's tokens, compute seconds and world size (``ReportTraining``); the medians of the
  recent ones are the costs and the training throughput by world size. Throughput for a world
  size never seen is extrapolated as ``rate(1) * k ** alpha``, ``alpha`` fitted on the sizes seen
  (1.0, linear, until a step with replicas was measured);
- simulated (``services/scheduler/sim``): the cost model's own rates and switch times, so the
  simulator's policy weighs the same quantities.

Until the first update was measured there is nothing to weigh and the policy decides as without
costs (that first step is also what measures them).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["SwitchCosts", "TrainSample", "SwitchSample", "StepProgress", "estimate", "train_left_tokens",
           "DEFAULT_ROLLOUT_TO_TRAIN_S", "DEFAULT_TRAIN_TO_ROLLOUT_S"]

# Priors until a switch of that direction was timed: `make run`'s medians on the built-in model.
DEFAULT_ROLLOUT_TO_TRAIN_S = 3.0
DEFAULT_TRAIN_TO_ROLLOUT_S = 5.0
RECENT = 16  # samples of each kind that count (the newest)


@dataclass(frozen=True)
class TrainSample:
    """One published update as the trainer measured it."""

    step: int
    tokens: float  # trained by every participant
    compute_s: float  # the core's time computing (not waiting for rollouts)
    world_size: int  # participants in the reduce, the core included

    @property
    def rate(self) -> float:
        return self.tokens / self.compute_s if self.compute_s > 0 else 0.0


@dataclass(frozen=True)
class SwitchSample:
    """One completed switch as the scheduler timed it."""

    to_train: bool  # rollout (or idle) -> train; else train -> rollout
    seconds: float


@dataclass(frozen=True)
class StepProgress:
    """How far the update of a step has come, as the trajectory service counts it."""

    packed_tokens: int  # in the micro-batches made so far (every one of them once ``sealed``)
    trained_tokens: int  # in the micro-batches the trainer acknowledged
    sealed: bool  # no micro-batch will be added


def train_left_tokens(per_step_tokens: float, ended_share: float, progress: StepProgress | None) -> float:
    """The training work an update has left that more TRAIN cells could share, tokens.

    Without progress it is a whole update (``per_step_tokens``, the median of the measured ones)
    scaled by the share of the step's executions that ended. With progress, what the trainer has
    trained is taken off, and once the step is sealed its packed tokens are the exact total."""
    expected = per_step_tokens * min(1.0, max(0.0, ended_share))
    if progress is None:
        return expected
    total = progress.packed_tokens if progress.sealed else max(progress.packed_tokens, expected)
    return max(0.0, total - progress.trained_tokens)


@dataclass(frozen=True)
class SwitchCosts:
    """The costs and rates the elastic policy weighs (see the module docstring)."""

    rollout_to_train_s: float
    train_to_rollout_s: float
    train_tok_s: tuple[float, ...]  # update throughput with k TRAIN cells at index k - 1 (k >= 1)
    train_left_tokens: float  # training work the update has left that more cells could share
    basis: str = ""  # where the numbers came from, for the switch reasons

    def __post_init__(self) -> None:
        if self.rollout_to_train_s < 0 or self.train_to_rollout_s < 0 or self.train_left_tokens < 0:
            raise ValueError("switch costs and the training work left must be >= 0")
        if not self.train_tok_s or any(r <= 0 for r in self.train_tok_s):
            raise ValueError("train_tok_s needs a positive throughput for at least one TRAIN cell")

    def rate(self, k: int) -> float:
        """Update throughput with ``k`` TRAIN cells (the last known size's beyond the table)."""
        return self.train_tok_s[min(max(k, 1), len(self.train_tok_s)) - 1]

    def gain_s(self, k: int) -> float:
        """Seconds the update finishes sooner when one more cell joins ``k`` TRAIN cells, counting
        that it trains nothing while it switches (the others go on meanwhile)."""
        work, before, after = self.train_left_tokens, self.rate(k), self.rate(k + 1)
        during = min(work, before * self.rollout_to_train_s)
        return work / before - (self.rollout_to_train_s + (work - during) / after)

    def worth_freeing(self, k: int) -> bool:
        """Free a rollout cell for an update run by ``k`` TRAIN cells: only when the update's gain
        exceeds the cell's way back to rollout."""
        return self.gain_s(k) > self.train_to_rollout_s


def _median(values: Sequence[float], default: float) -> float:
    return float(statistics.median(values)) if values else default


def estimate(train: Sequence[TrainSample], switches: Sequence[SwitchSample], *, max_cells: int,
             train_left_tokens: float | None = None) -> SwitchCosts | None:
    """Costs from live measurements (newest last), or None before the first measured update.

    ``train_left_tokens`` defaults to one whole update (the median tokens per step), an upper
    bound of what more cells can still share."""
    train = [s for s in train if s.rate > 0 and s.world_size >= 1][-RECENT:]
    if not train:
        return None
    to_train = [s.seconds for s in switches if s.to_train][-RECENT:]
    to_rollout = [s.seconds for s in switches if not s.to_train][-RECENT:]
    by_world: dict[int, list[float]] = {}
    for s in train:
        by_world.setdefault(s.world_size, []).append(s.rate)
    seen = {k: _median(v, 0.0) for k, v in sorted(by_world.items())}
    base_k = min(seen)
    base = seen[base_k]
    fits = [math.log(seen[k] / base) / math.log(k / base_k) for k in seen if k != base_k]
    alpha = min(1.0, max(0.0, statistics.fmean(fits))) if fits else 1.0
    rates = tuple(seen.get(k, base * (k / base_k) ** alpha) for k in range(1, max(2, max_cells) + 1))
    work = _median([s.tokens for s in train], 0.0) if train_left_tokens is None else train_left_tokens
    basis = (f"measured: {len(train)} updates (world sizes {', '.join(map(str, seen))}, alpha {alpha:.2f}), "
             f"{len(to_train)} + {len(to_rollout)} switches")
    return SwitchCosts(rollout_to_train_s=_median(to_train, DEFAULT_ROLLOUT_TO_TRAIN_S),
                       train_to_rollout_s=_median(to_rollout, DEFAULT_TRAIN_TO_ROLLOUT_S),
                       train_tok_s=rates, train_left_tokens=max(0.0, work), basis=basis)
