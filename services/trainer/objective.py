"""Token-level clipped policy-gradient objective (PPO / GRPO family), pure torch.

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
  Tokens whose ratio left the trust region in the direction of A get no gradient.
* ``tis_cap = C`` - truncated importance sampling (Yao et al. 2025, "decoupled" PPO): the
  proximal policy is the trainer's own current weights (the weights are fixed during a step and
  updated once at its end, so "old trainer" == current, detached), and the behaviour/trainer
  mismatch - engine numerics *and* staleness - is corrected by a capped weight:
      r = exp(logp - sg(logp)) (== 1, gradient of logp),  w_is = min(exp(sg(logp) - old), C)
      loss_i = -min(r*A, clip(r)*A) * w_is
  With one optimizer update per step the clip is inert in this mode (r == 1); the cap bounds the
  variance instead. ``proximal_logprobs`` may be given for multi-update variants.

Optional terms: ``kl_coef`` * k3(ref || pi) with ref = ``ref_logprobs`` (a reference model) or
the behaviour log-probs, and ``-entropy_coef * H``. All metrics are returned as weighted *sums*
(sum_i w_i * x_i) so they add over micro-batches and replicas exactly like the loss does; ratio
min/max are returned separately (reduce with max/min).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class ObjectiveConfig:
    """Hyper-parameters of the policy-gradient loss."""

    eps_low: float = 0.2
    """Lower clip range: ratios below 1 - eps_low stop pushing a negative-advantage token down."""
    eps_high: float = 0.28
    """Upper clip range ("clip-higher"): ratios above 1 + eps_high stop pushing a token up."""
    tis_cap: float | None = None
    """Truncated-importance-sampling cap C on exp(trainer - behaviour); None = plain PPO."""
    kl_coef: float = 0.0
    """Weight of the k3 KL estimate against the reference (or behaviour) log-probs."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss); needs per-token entropy."""

    def __post_init__(self) -> None:
        if not (0.0 <= self.eps_low < 1.0):
            raise ValueError(f"eps_low must be in [0, 1), got {self.eps_low}")
        if not (self.eps_high >= 0.0 and math.isfinite(self.eps_high)):
            raise ValueError(f"eps_high must be a finite number >= 0, got {self.eps_high}")
        if self.tis_cap is not None and not (self.tis_cap >= 1.0 and math.isfinite(self.tis_cap)):
            raise ValueError(f"tis_cap must be a finite number >= 1 (or None), got {self.tis_cap}")
        if not (self.kl_coef >= 0.0 and math.isfinite(self.kl_coef)):
            raise ValueError(f"kl_coef must be a finite number >= 0, got {self.kl_coef}")
        if not (self.entropy_coef >= 0.0 and math.isfinite(self.entropy_coef)):
            raise ValueError(f"entropy_coef must be a finite number >= 0, got {self.entropy_coef}")


# Names of the additive (weighted-sum) metrics, in the fixed order used to pack them into one
# tensor for the all-reduce.
SUM_METRICS: tuple[str, ...] = (
    "loss", "pg_loss", "kl", "mismatch_kl", "entropy", "clip_frac", "clip_low_frac",
    "clip_high_frac", "tis_trunc_frac", "ratio_mean", "weight_sum", "num_targets",
)


@dataclass(frozen=True)
class ObjectiveOutput:
    """The differentiable loss plus detached metrics.

    ``sums`` maps each name of SUM_METRICS to sum_i w_i * x_i (``num_targets`` and ``weight_sum``
    are plain counts/sums); ``ratio_max``/``ratio_min`` are extrema over the micro-batch.
    """

    loss: torch.Tensor
    sums: dict[str, torch.Tensor]
    ratio_max: torch.Tensor
    ratio_min: torch.Tensor


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 (>= 0)."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1.0


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
) -> ObjectiveOutput:
    """The weighted clipped policy-gradient loss of one micro-batch's targets (see module doc)."""
    n = logprobs.shape[0]
    for name, t in (("old_logprobs", old_logprobs), ("advantages", advantages),
                    ("loss_weights", loss_weights), ("entropy", entropy),
                    ("ref_logprobs", ref_logprobs), ("proximal_logprobs", proximal_logprobs)):
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
    pg = -torch.minimum(surr, surr_clipped) * is_weight
    # The clip is active (no gradient) where the clipped surrogate is the smaller one.
    active = surr_clipped < surr
    clip_low = (active & (ratio < 1.0 - config.eps_low)).float()
    clip_high = (active & (ratio > 1.0 + config.eps_high)).float()

    kl_ref = old if ref_logprobs is None else ref_logprobs.float()
    kl = k3_kl(logp, kl_ref)
    per_token = pg
    if config.kl_coef > 0:
        per_token = per_token + config.kl_coef * kl
    ent = entropy.float() if entropy is not None else torch.zeros_like(logp)
    if config.entropy_coef > 0:
        per_token = per_token - config.entropy_coef * ent
    loss = (w * per_token).sum()

    with torch.no_grad():
        behaviour_ratio = torch.exp(logp.detach() - old)
        sums = {
            "loss": loss.detach(),
            "pg_loss": (w * pg.detach()).sum(),
            "kl": (w * kl.detach()).sum(),
            # k3 KL between the trainer and the behaviour policy: engine mismatch + staleness.
            "mismatch_kl": (w * k3_kl(logp.detach(), old)).sum(),
            "entropy": (w * ent.detach()).sum(),
            "clip_frac": (w * active.float()).sum(),
            "clip_low_frac": (w * clip_low).sum(),
            "clip_high_frac": (w * clip_high).sum(),
            "tis_trunc_frac": (w * truncated).sum(),
            "ratio_mean": (w * behaviour_ratio).sum(),
            "weight_sum": w.sum(),
            "num_targets": torch.tensor(float(n)),
        }
        if n:
            ratio_max, ratio_min = behaviour_ratio.max(), behaviour_ratio.min()
        else:
            ratio_max, ratio_min = torch.tensor(-math.inf), torch.tensor(math.inf)
    return ObjectiveOutput(loss=loss, sums=sums, ratio_max=ratio_max, ratio_min=ratio_min)
