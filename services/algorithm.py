"""The RL algorithm, in one place: from scored executions to the loss of one micro-batch.

Gyre's step is spread over services (docs/one_step.md walks it); the algorithm is not. Everything a
reader compares with slime's, verl's or prime-rl's loss is here, in the order it runs, and every
knob is a field of the job's ``[job.algorithm]`` section (``Algorithm``):

1. **Advantages** (the trajectory service, when a group's outcomes are in): group-relative, GRPO
   style, one scalar per execution broadcast to its trainable tokens: ``reward - mean(group)``,
   divided by the group's reward std when ``normalize_advantages`` (``group_advantages``,
   ``outcome_advantages``). Only trained executions take part (excluded ones and ones without a
   reward are dropped; timed-out ones count with their partial reward); a group of one has
   advantage 0.
2. **Loss aggregation** (the trajectory service's packer, as per-token loss weights):
   ``execution_mean``: each execution's token losses are averaged, then executions are averaged,
   so a long execution weighs as much as a short one (``token_weight``). The weights make the
   sum over all micro-batches of a step, on all replicas, the step's loss.
3. **The objective** (the trainer, per micro-batch): a token-level clipped policy gradient with
   clip-higher, optional truncated importance sampling, k3 KL and an entropy bonus
   (``ObjectiveConfig``, ``policy_loss``; below).
4. **The update** (the trainer, once per step, after the all-reduce of the summed gradients):
   AdamW (``adam_beta1``, ``adam_beta2``, ``adam_eps``) with ``learning_rate`` (ramped up over
   ``lr_warmup_steps``, then constant or on a cosine down to ``lr_min_ratio`` of it at the last step:
   ``lr_schedule``) and ``weight_decay``, global grad-norm clip ``max_grad_norm``
   (``services/trainer/learner.py`` ``Updater.apply``).

Which tokens are trained is the trajectory tree's business (``services/trajectory/tree.py``): the
tokens a policy sampled, once per tree node; a grammar's forced tokens are context
(``services/rollout/grammar.py``).

No torch or numpy at import (the scheduler imports this module for ``Algorithm``); the functions
import them when called.

The objective in detail:

Inputs are per *target* token (the trainable nodes of a packed tree, in any order):

    logprobs      trainer log-prob of the token under the current weights (carries the graph)
    old_logprobs  behaviour log-prob recorded by the engine (TITO) when it sampled the token
    advantages    per-token advantage (GRPO: the execution's group-relative advantage)
    loss_weights  sum_i w_i * loss_i over all micro-batches of a step is the step loss
                  (= mean over executions of the mean over that execution's trainable nodes)

Two ways to handle the gap between the behaviour policy (a possibly stale engine, with its own
numerics) and the trainer:

* ``tis_cap is None`` - plain PPO against the behaviour policy:
      r = exp(logp - old),  loss_i = -min(r*A, clip(r, 1-eps_low, 1+eps_high)*A)
  Tokens whose ratio left the trust region in the direction of A get no gradient. With
  ``dual_clip = c`` (dual-clip PPO, Ye et al. 2020; verl's ``clip_ratio_c``), a negative-advantage
  token's loss is also capped at -c*A: a stale token the current policy likes far more than the
  engine that sampled it did (r >> 1; Adam's first update alone moves a small model that far)
  would otherwise be pushed down with a gradient r times its advantage, and one such step can
  wreck an off-policy run.
* ``tis_cap = C`` - truncated importance sampling (Yao et al. 2025, "decoupled" PPO): the
  proximal policy is the trainer's own current weights (the weights are fixed during a step and
  updated once at its end, so "old trainer" == current, detached), and the behaviour/trainer
  mismatch - engine numerics *and* staleness - is corrected by a capped weight:
      r = exp(logp - sg(logp)) (== 1, gradient of logp),  w_is = min(exp(sg(logp) - old), C)
      loss_i = -min(r*A, clip(r)*A) * w_is
  With one optimizer update per step the clip is inert in this mode (r == 1); the cap bounds the
  variance instead. ``proximal_logprobs`` may be given for multi-update variants.

Optional terms: ``kl_coef`` * KL(pi || ref) with ref = ``ref_logprobs`` (a reference model) or
the behaviour log-probs, and ``-entropy_coef * H``. The KL is estimated per sampled token from
d = ref - logp by ``kl_estimator`` (Schulman's k1/k2/k3 naming):

    k3          exp(d) - d - 1       unbiased; its gradient 1 - exp(d) grows exponentially in d,
                                     so one token pushed down by many nats can dominate a step
    k2          d^2 / 2              biased; gradient -d, linear in the gap
    low_var_kl  min(k3, 10)          k3 clamped as verl's ``low_var_kl``: a token past the clamp
                                     gets no KL gradient at all

All metrics are returned as weighted *sums* (sum_i w_i * x_i) so they add over micro-batches and replicas exactly like the loss does; ratio
min/max are returned separately (reduce with max/min).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

LOSS_AGGREGATIONS = ("execution_mean",)
KL_REFERENCES = ("behaviour", "initial")
KL_ESTIMATORS = ("k3", "k2", "low_var_kl")
LR_SCHEDULES = ("constant", "cosine")
"""What the learning rate does after its warmup (``Algorithm.lr_schedule``, ``OptimConfig.schedule``)."""
LOW_VAR_KL_CLAMP = 10.0
DEFAULT_ADVANTAGE_EPS = 1e-6


# ================================================================= the job's [job.algorithm] section
@dataclass(frozen=True, kw_only=True)
class Algorithm:
    """How the trainer turns scored executions into an update (``[job.algorithm]``)."""

    learning_rate: float = 1e-5
    """AdamW learning rate."""
    lr_warmup_steps: int = 0
    """Steps over which the learning rate ramps up linearly: step s < N updates with
    ``learning_rate * (s + 1) / (N + 1)``, later steps with ``learning_rate`` (0: full from the first
    step). Adam's first update moves every parameter by about the learning rate, whatever the size
    of its gradient."""
    lr_schedule: str = "constant"
    """After the warmup: ``"constant"`` or ``"cosine"`` (a half cosine from ``learning_rate`` down to
    ``learning_rate * lr_min_ratio`` at the job's last step; a 30-step job decays over 30 steps)."""
    lr_min_ratio: float = 0.1
    """The cosine schedule's floor, as a fraction of ``learning_rate``, in [0, 1]."""
    clip_low: float = 0.2
    """Lower clip range of the policy ratio (1 - clip_low)."""
    clip_high: float = 0.28
    """Upper clip range of the policy ratio (1 + clip_high, "clip-higher")."""
    kl_coef: float = 0.0
    """Weight of the k3 KL term against ``kl_reference``'s log-probs (0: no KL term)."""
    kl_reference: str = "behaviour"
    """What the KL term anchors to: ``"behaviour"`` (the log-probs the rollout engine sampled with) or
    ``"initial"`` (the job's starting weights, kept frozen beside the policy: an anchor that holds even
    on-policy, where the behaviour KL is ~0)."""
    kl_estimator: str = "k3"
    """How the KL term is estimated per token: ``"k3"`` (unbiased, exponential gradient), ``"k2"``
    (squared log-ratio / 2, linear gradient) or ``"low_var_kl"`` (k3 clamped at 10)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus."""
    tis_cap: float = 0.0
    """Truncated importance sampling cap on trainer/behaviour ratios (0: off)."""
    dual_clip: float = 3.0
    """Dual-clip PPO bound c > 1: a negative-advantage token's loss is at most -c * A (0: off)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    adam_beta1: float = 0.9
    """AdamW's first-moment decay."""
    adam_beta2: float = 0.999
    """AdamW's second-moment decay."""
    adam_eps: float = 1e-8
    """AdamW's epsilon. Adam divides each gradient by its running RMS plus ``adam_eps``. With the
    default, even a parameter whose gradient is pure noise moves by about ``learning_rate`` per
    update. A parameter whose gradient is well below ``adam_eps`` moves in proportion to that
    gradient instead."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip (0: none)."""
    loss_aggregation: str = "execution_mean"
    """Token losses are averaged within each execution, then over executions (the only one so far:
    ``token_weight``)."""
    temperature: float = 1.0
    """Rollout sampling temperature (the trainer divides its logits by it)."""
    normalize_advantages: bool = False
    """Divide each group's reward-minus-mean by the group's reward std (``group_advantages``)."""
    advantage_eps: float = DEFAULT_ADVANTAGE_EPS
    """Added to the group's reward std when ``normalize_advantages`` is on."""

    def __post_init__(self) -> None:
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise ValueError(f"algorithm.learning_rate is {self.learning_rate}; expected a finite number > 0")
        if not (isinstance(self.lr_warmup_steps, int) and self.lr_warmup_steps >= 0):
            raise ValueError(f"algorithm.lr_warmup_steps is {self.lr_warmup_steps}; expected a whole number >= 0")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"algorithm.lr_schedule is {self.lr_schedule!r}; expected one of {', '.join(LR_SCHEDULES)}")
        if not 0.0 <= self.lr_min_ratio <= 1.0:
            raise ValueError(f"algorithm.lr_min_ratio is {self.lr_min_ratio}; expected in [0, 1]")
        if not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"algorithm.clip_low is {self.clip_low}; expected in [0, 1)")
        for name in ("clip_high", "kl_coef", "entropy_coef", "weight_decay", "max_grad_norm"):
            v = getattr(self, name)
            if not (v >= 0 and math.isfinite(v)):
                raise ValueError(f"algorithm.{name} is {v}; expected a finite number >= 0")
        for name in ("adam_beta1", "adam_beta2"):
            v = getattr(self, name)
            if not 0.0 <= v < 1.0:
                raise ValueError(f"algorithm.{name} is {v}; expected in [0, 1)")
        if not (self.adam_eps > 0 and math.isfinite(self.adam_eps)):
            raise ValueError(f"algorithm.adam_eps is {self.adam_eps}; expected a finite number > 0")
        if self.tis_cap != 0.0 and not (self.tis_cap >= 1.0 and math.isfinite(self.tis_cap)):
            raise ValueError(f"algorithm.tis_cap is {self.tis_cap}; expected 0 (off) or a finite number >= 1")
        if self.dual_clip != 0.0 and not (self.dual_clip > 1.0 and math.isfinite(self.dual_clip)):
            raise ValueError(f"algorithm.dual_clip is {self.dual_clip}; expected 0 (off) or a finite number > 1")
        if self.kl_reference not in KL_REFERENCES:
            raise ValueError(f"algorithm.kl_reference is {self.kl_reference!r}; expected one of "
                             f"{', '.join(KL_REFERENCES)}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"algorithm.kl_estimator is {self.kl_estimator!r}; expected one of "
                             f"{', '.join(KL_ESTIMATORS)}")
        if self.loss_aggregation not in LOSS_AGGREGATIONS:
            raise ValueError(f"algorithm.loss_aggregation is {self.loss_aggregation!r}; expected one of "
                             f"{', '.join(LOSS_AGGREGATIONS)}")
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"algorithm.temperature is {self.temperature}; expected a finite number > 0")
        if not (self.advantage_eps > 0 and math.isfinite(self.advantage_eps)):
            raise ValueError(f"algorithm.advantage_eps is {self.advantage_eps}; expected a finite number > 0")

    def objective(self) -> ObjectiveConfig:
        """The trainer's loss hyper-parameters of this algorithm."""
        return ObjectiveConfig(eps_low=self.clip_low, eps_high=self.clip_high, kl_coef=self.kl_coef,
                               entropy_coef=self.entropy_coef, tis_cap=self.tis_cap or None,
                               dual_clip=self.dual_clip or None, kl_estimator=self.kl_estimator)



# ================================================================= 1. advantages
def group_advantages(rewards: Mapping[str, float], *, normalize_std: bool = False,
                     eps: float = 1e-6) -> dict[str, float]:
    """Advantages of one group from ``{execution_id: reward}``."""
    import numpy as np

    if not rewards:
        return {}
    ids = list(rewards)
    r = np.asarray([rewards[i] for i in ids], dtype=np.float64)
    if not np.isfinite(r).all():
        raise ValueError("group rewards must be finite numbers")
    adv = r - r.mean()
    if normalize_std:
        adv = adv / (r.std() + eps)
    return {i: float(a) for i, a in zip(ids, adv, strict=True)}


class ScoredExecution(Protocol):
    """What advantage estimation reads of an execution's outcome (trajectory ``Outcome``)."""

    @property
    def execution_id(self) -> str: ...

    @property
    def group_id(self) -> str: ...

    @property
    def reward(self) -> float | None: ...

    @property
    def trained(self) -> bool: ...


def outcome_advantages(outcomes: Iterable[ScoredExecution], *, normalize_std: bool = False,
                       eps: float = 1e-6) -> dict[str, float]:
    """Advantages of every trained execution among ``outcomes``, grouped by ``group_id``."""
    groups: dict[str, dict[str, float]] = {}
    for o in outcomes:
        if o.trained:
            assert o.reward is not None
            groups.setdefault(o.group_id, {})[o.execution_id] = o.reward
    out: dict[str, float] = {}
    for rewards in groups.values():
        out.update(group_advantages(rewards, normalize_std=normalize_std, eps=eps))
    return out


# ================================================================= 2. loss aggregation
def token_weight(num_trainable: int, num_executions: int, aggregation: str = "execution_mean") -> float:
    """Loss weight of each trainable token of an execution with ``num_trainable`` of them, in a step
    of ``num_executions``: summed over the step, ``sum_i w_i * loss_i`` is the mean over executions
    of each execution's mean token loss."""
    if aggregation != "execution_mean":
        raise ValueError(f"loss aggregation {aggregation!r} is not one of {', '.join(LOSS_AGGREGATIONS)}")
    if num_trainable < 1 or num_executions < 1:
        raise ValueError(f"an execution with {num_trainable} trainable tokens in a step of {num_executions} executions")
    return 1.0 / (num_trainable * num_executions)


# ================================================================= 3. the objective
@dataclass(frozen=True, kw_only=True)
class ObjectiveConfig:
    """Hyper-parameters of the policy-gradient loss."""

    eps_low: float = 0.2
    """Lower clip range: ratios below 1 - eps_low stop pushing a negative-advantage token down."""
    eps_high: float = 0.28
    """Upper clip range ("clip-higher"): ratios above 1 + eps_high stop pushing a token up."""
    tis_cap: float | None = None
    """Truncated-importance-sampling cap C on exp(trainer - behaviour); None = plain PPO."""
    dual_clip: float | None = None
    """Dual-clip bound c > 1 on a negative-advantage token's loss (-c * A at most); None = off."""
    kl_coef: float = 0.0
    """Weight of the KL estimate against the reference (or behaviour) log-probs."""
    kl_estimator: str = "k3"
    """The per-token KL estimator: one of ``KL_ESTIMATORS`` (module doc)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss); needs per-token entropy."""

    def __post_init__(self) -> None:
        if not (0.0 <= self.eps_low < 1.0):
            raise ValueError(f"eps_low must be in [0, 1), got {self.eps_low}")
        if not (self.eps_high >= 0.0 and math.isfinite(self.eps_high)):
            raise ValueError(f"eps_high must be a finite number >= 0, got {self.eps_high}")
        if self.tis_cap is not None and not (self.tis_cap >= 1.0 and math.isfinite(self.tis_cap)):
            raise ValueError(f"tis_cap must be a finite number >= 1 (or None), got {self.tis_cap}")
        if self.dual_clip is not None and not (self.dual_clip > 1.0 and math.isfinite(self.dual_clip)):
            raise ValueError(f"dual_clip must be a finite number > 1 (or None), got {self.dual_clip}")
        if not (self.kl_coef >= 0.0 and math.isfinite(self.kl_coef)):
            raise ValueError(f"kl_coef must be a finite number >= 0, got {self.kl_coef}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator must be one of {', '.join(KL_ESTIMATORS)}, got {self.kl_estimator!r}")
        if not (self.entropy_coef >= 0.0 and math.isfinite(self.entropy_coef)):
            raise ValueError(f"entropy_coef must be a finite number >= 0, got {self.entropy_coef}")


# Names of the additive (weighted-sum) metrics, in the fixed order used to pack them into one
# tensor for the all-reduce.
SUM_METRICS: tuple[str, ...] = (
    "loss", "pg_loss", "kl", "mismatch_kl", "entropy", "clip_frac", "clip_low_frac",
    "clip_high_frac", "tis_trunc_frac", "ratio_mean", "weight_sum", "num_targets", "clip_dual_frac",
    "mismatch_kl_fresh", "fresh_weight",
)


@dataclass(frozen=True)
class ObjectiveOutput:
    """The differentiable loss plus detached metrics.

    ``sums`` maps each name of SUM_METRICS to sum_i w_i * x_i (``num_targets`` and ``weight_sum``
    are plain counts/sums; ``mismatch_kl_fresh`` and ``fresh_weight`` sum over the fresh targets
    only); ``ratio_max``/``ratio_min`` are extrema over the micro-batch and ``fresh_logp_dev`` the
    largest |trainer - behaviour| log-prob gap of a fresh target (0 without one).
    """

    loss: torch.Tensor
    sums: dict[str, torch.Tensor]
    ratio_max: torch.Tensor
    ratio_min: torch.Tensor
    fresh_logp_dev: torch.Tensor


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 (>= 0)."""
    d = ref_logprobs - logprobs
    return d.exp() - d - 1.0


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) by ``estimator`` (one of ``KL_ESTIMATORS``; module doc)."""
    if estimator == "k3":
        return k3_kl(logprobs, ref_logprobs)
    if estimator == "k2":
        return 0.5 * (ref_logprobs - logprobs).square()
    if estimator == "low_var_kl":
        return k3_kl(logprobs, ref_logprobs).clamp(max=LOW_VAR_KL_CLAMP)
    raise ValueError(f"kl_estimator must be one of {', '.join(KL_ESTIMATORS)}, got {estimator!r}")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_weights: torch.Tensor,
    *,
    config: ObjectiveConfig,
    entropy: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    proximal_logprobs: torch.Tensor | None = None,
    fresh: torch.Tensor | None = None,
) -> ObjectiveOutput:
    """The weighted clipped policy-gradient loss of one micro-batch's targets (part 3 of the module doc).

    ``fresh`` (bool per target): sampled by the very weights the trainer holds, so its log-prob gap
    to the behaviour policy is the engine's numerical mismatch alone, without staleness; only the
    metrics use it (None: no target is fresh)."""
    import torch

    n = logprobs.shape[0]
    for name, t in (("old_logprobs", old_logprobs), ("advantages", advantages),
                    ("loss_weights", loss_weights), ("entropy", entropy),
                    ("ref_logprobs", ref_logprobs), ("proximal_logprobs", proximal_logprobs),
                    ("fresh", fresh)):
        if t is not None and t.shape != (n,):
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected ({n},) like logprobs")
    if config.entropy_coef > 0 and entropy is None:
        raise ValueError("entropy_coef > 0 needs the per-token entropy")
    # Compute in fp32 whatever the model dtype: the ratio exp() is where bf16 hurts most.
    logp = logprobs.float()
    old = old_logprobs.float()
    adv = advantages.float()
    w = loss_weights.float()

    if config.tis_cap is None:
        prox = old
        is_weight = torch.ones_like(logp)
        truncated = torch.zeros_like(logp)
    else:
        prox = logp.detach() if proximal_logprobs is None else proximal_logprobs.float()
        raw_is = torch.exp(prox - old)
        is_weight = raw_is.clamp(max=config.tis_cap)
        truncated = (raw_is > config.tis_cap).float()

    ratio = torch.exp(logp - prox)
    clipped_ratio = ratio.clamp(1.0 - config.eps_low, 1.0 + config.eps_high)
    surr = ratio * adv
    surr_clipped = clipped_ratio * adv
    pg = -torch.minimum(surr, surr_clipped)
    # The clip is active (no gradient) where the clipped surrogate is the smaller one.
    active = surr_clipped < surr
    if config.dual_clip is not None:
        bound = -config.dual_clip * adv  # > 0 where adv < 0
        dual = (adv < 0) & (pg > bound)
        pg = torch.where(dual, bound, pg)  # constant there: no gradient
    else:
        dual = torch.zeros_like(active)
    pg = pg * is_weight
    clip_low = (active & (ratio < 1.0 - config.eps_low)).float()
    clip_high = (active & (ratio > 1.0 + config.eps_high)).float()

    kl_ref = old if ref_logprobs is None else ref_logprobs.float()
    kl = k3_kl(logp, kl_ref)  # the metric: unbiased whatever the loss uses
    per_token = pg
    if config.kl_coef > 0:
        per_token = per_token + config.kl_coef * (kl if config.kl_estimator == "k3"
                                                  else kl_estimate(logp, kl_ref, config.kl_estimator))
    ent = entropy.float() if entropy is not None else torch.zeros_like(logp)
    if config.entropy_coef > 0:
        per_token = per_token - config.entropy_coef * ent
    loss = (w * per_token).sum()

    with torch.no_grad():
        behaviour_ratio = torch.exp(logp.detach() - old)
        mismatch = k3_kl(logp.detach(), old)
        fw = w * fresh.float() if fresh is not None else torch.zeros_like(w)
        if fresh is not None and bool(fresh.any()):
            fresh_dev = (logp.detach() - old).abs()[fresh].max()
        else:
            fresh_dev = torch.tensor(0.0)
        sums = {
            "loss": loss.detach(),
            "pg_loss": (w * pg.detach()).sum(),
            "kl": (w * kl.detach()).sum(),
            # k3 KL between the trainer and the behaviour policy: engine mismatch + staleness.
            "mismatch_kl": (w * mismatch).sum(),
            "entropy": (w * ent.detach()).sum(),
            "clip_frac": (w * active.float()).sum(),
            "clip_low_frac": (w * clip_low).sum(),
            "clip_high_frac": (w * clip_high).sum(),
            "tis_trunc_frac": (w * truncated).sum(),
            "clip_dual_frac": (w * dual.float()).sum(),
            "ratio_mean": (w * behaviour_ratio).sum(),
            "weight_sum": w.sum(),
            "num_targets": torch.tensor(float(n)),
            "mismatch_kl_fresh": (fw * mismatch).sum(),
            "fresh_weight": fw.sum(),
        }
        if n:
            ratio_max, ratio_min = behaviour_ratio.max(), behaviour_ratio.min()
        else:
            ratio_max, ratio_min = torch.tensor(-math.inf), torch.tensor(math.inf)
    return ObjectiveOutput(loss=loss, sums=sums, ratio_max=ratio_max, ratio_min=ratio_min, fresh_logp_dev=fresh_dev)
