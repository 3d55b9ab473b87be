"""The policy-gradient objective against hand-computed values (losses, gradients, metrics)."""

from __future__ import annotations

import math

import pytest
import torch

from services.algorithm import ObjectiveConfig, k3_kl, kl_estimate, policy_loss

# Four targets: trainer probs p, behaviour probs q -> ratios 1.25, 1.0, 0.5, 2.0.
P = [0.5, 0.3, 0.2, 0.4]
Q = [0.4, 0.3, 0.4, 0.2]
ADV = [1.0, -1.0, -1.0, 2.0]
W = [0.25, 0.25, 0.25, 0.25]


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    logp = torch.tensor([math.log(p) for p in P], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([math.log(q) for q in Q], dtype=torch.float64)
    return logp, old, torch.tensor(ADV, dtype=torch.float64), torch.tensor(W, dtype=torch.float64)


def test_clipped_ppo_matches_hand_computation() -> None:
    logp, old, adv, w = _inputs()
    out = policy_loss(logp, old, adv, w, config=ObjectiveConfig(eps_low=0.2, eps_high=0.28))
    # token 0: r=1.25 A=+1 -> -1.25 (inside); token 1: r=1 A=-1 -> +1;
    # token 2: r=0.5 A=-1 -> clip at 0.8 -> +0.8 (clip-low); token 3: r=2 A=+2 -> clip 1.28*2 -> -2.56
    assert out.loss.item() == pytest.approx(0.25 * (-1.25 + 1.0 + 0.8 - 2.56), abs=1e-6)
    out.loss.backward()
    # d/dlogp of -w*r*A where unclipped (dr/dlogp = r), 0 where the clip is active.
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad.float(), torch.tensor([-0.25 * 1.25, 0.25, 0.0, 0.0]), atol=1e-6, rtol=0)
    s = out.sums
    assert s["clip_frac"].item() == pytest.approx(0.5)
    assert s["clip_low_frac"].item() == pytest.approx(0.25)
    assert s["clip_high_frac"].item() == pytest.approx(0.25)
    assert s["ratio_mean"].item() == pytest.approx(0.25 * (1.25 + 1.0 + 0.5 + 2.0))
    assert out.ratio_max.item() == pytest.approx(2.0) and out.ratio_min.item() == pytest.approx(0.5)
    # k3(trainer || behaviour) per token: q/p - log(q/p) - 1
    k3 = [q / p - math.log(q / p) - 1 for p, q in zip(P, Q)]
    assert s["mismatch_kl"].item() == pytest.approx(0.25 * sum(k3), abs=1e-6)  # fp32 inside
    assert s["weight_sum"].item() == pytest.approx(1.0) and s["num_targets"].item() == 4


def test_dual_clip_caps_a_negative_advantage_tokens_loss() -> None:
    """A stale token the trainer likes 466x more than the engine that sampled it (seen at the first
    off-policy step of an elastic run), with a negative advantage: plain PPO's loss is 466 * |A|
    with a gradient as large; the dual clip caps it at c * |A| with none. Other tokens as before."""
    logp = torch.tensor([math.log(0.466), math.log(0.3), math.log(0.2)], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([math.log(0.001), math.log(0.2), math.log(0.4)], dtype=torch.float64)
    adv = torch.tensor([-1.0, -1.0, -1.0], dtype=torch.float64)
    w = torch.full((3,), 1 / 3, dtype=torch.float64)
    plain = policy_loss(logp, old, adv, w, config=ObjectiveConfig())
    plain.loss.backward()
    assert logp.grad is not None and logp.grad[0].item() == pytest.approx(466.0 / 3, rel=1e-6)
    logp.grad = None
    dual = policy_loss(logp, old, adv, w, config=ObjectiveConfig(dual_clip=3.0))
    # token 0: r=466 -> capped at 3; token 1: r=1.5 (< 3) -> 1.5 as in PPO; token 2: r=0.5 -> clip-low 0.8
    assert dual.loss.item() == pytest.approx((3.0 + 1.5 + 0.8) / 3, abs=1e-6)
    dual.loss.backward()
    torch.testing.assert_close(logp.grad.float(), torch.tensor([0.0, 1.5 / 3, 0.0]), atol=1e-6, rtol=0)
    assert dual.sums["clip_dual_frac"].item() == pytest.approx(1 / 3)
    assert plain.sums["clip_dual_frac"].item() == 0.0
    with pytest.raises(ValueError, match="dual_clip"):
        ObjectiveConfig(dual_clip=1.0)


def test_mismatch_splits_into_the_engines_gap_and_staleness() -> None:
    """Fresh targets (sampled by the weights being trained) measure the engine's own gap to the
    trainer; the rest add the policy's change since they were sampled. Both are weighted means over
    their own targets, and the step's statistics carry them through the all-reduce."""
    from services.trainer.learner import StepStats

    logp, old, adv, w = _inputs()
    fresh = torch.tensor([True, True, False, False])
    out = policy_loss(logp, old, adv, w, config=ObjectiveConfig(), fresh=fresh)
    k3 = [q / p - math.log(q / p) - 1 for p, q in zip(P, Q)]
    s = out.sums
    assert s["mismatch_kl_fresh"].item() == pytest.approx(0.25 * (k3[0] + k3[1]), abs=1e-6)
    assert s["fresh_weight"].item() == pytest.approx(0.5)
    assert out.fresh_logp_dev.item() == pytest.approx(abs(math.log(P[0] / Q[0])), abs=1e-6)
    stats = StepStats()
    for k, v in s.items():
        stats.sums[k] += float(v)
    stats.add_extrema(float(out.ratio_max), float(out.ratio_min), float(out.fresh_logp_dev))
    other = StepStats()  # a replica's share: one fresh target with a larger gap
    other.add_extrema(1.0, 1.0, 3.0)
    stats.merge(other.vector(), other.extrema())
    d = stats.as_dict()
    assert d["mismatch_kl_fresh"] == pytest.approx((k3[0] + k3[1]) / 2, abs=1e-6)
    assert d["mismatch_kl_stale"] == pytest.approx((k3[2] + k3[3]) / 2, abs=1e-6)
    assert d["fresh_logp_dev_max"] == pytest.approx(3.0)
    assert d["compute_s_max"] == 0.0  # nobody timed a micro-batch here
    assert "fresh_weight" not in d
    # no target fresh: the fresh figures are 0, the stale ones all of the mismatch
    none = policy_loss(logp, old, adv, w, config=ObjectiveConfig())
    assert none.sums["fresh_weight"].item() == 0.0 and none.fresh_logp_dev.item() == 0.0
    with pytest.raises(ValueError, match="fresh"):
        policy_loss(logp, old, adv, w, config=ObjectiveConfig(), fresh=torch.ones(3, dtype=torch.bool))


def test_truncated_importance_sampling_matches_hand_computation() -> None:
    logp, old, adv, w = _inputs()
    out = policy_loss(logp, old, adv, w, config=ObjectiveConfig(tis_cap=1.5))
    # IS weights min(r, 1.5) = 1.25, 1, 0.5, 1.5; the proximal ratio is 1 (one update per step).
    assert out.loss.item() == pytest.approx(0.25 * (-1.25 + 1.0 + 0.5 - 3.0), abs=1e-6)
    out.loss.backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad.float(), torch.tensor([-0.3125, 0.25, 0.125, -0.75]), atol=1e-6, rtol=0)
    assert out.sums["tis_trunc_frac"].item() == pytest.approx(0.25)
    assert out.sums["clip_frac"].item() == 0.0


def test_kl_and_entropy_terms() -> None:
    logp, old, adv, w = _inputs()
    zero_adv = torch.zeros_like(adv)
    ref = logp.detach().clone()
    ref[1] += math.log(2.0)  # ref/pi = 2 at token 1: k3 = 2 - log 2 - 1, d k3/d logp = 1 - 2 = -1
    ent = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64, requires_grad=True)
    out = policy_loss(logp, old, zero_adv, w, config=ObjectiveConfig(kl_coef=0.1, entropy_coef=0.01),
                      entropy=ent, ref_logprobs=ref)
    expected = 0.1 * 0.25 * (2 - math.log(2) - 1) - 0.01 * 0.25 * (1 + 2 + 3 + 4)
    assert out.loss.item() == pytest.approx(expected, abs=1e-7)
    out.loss.backward()
    assert logp.grad is not None and ent.grad is not None
    torch.testing.assert_close(logp.grad.float(), torch.tensor([0.0, -0.025, 0.0, 0.0]), atol=1e-7, rtol=0)
    torch.testing.assert_close(ent.grad.float(), torch.full((4,), -0.0025), atol=1e-9, rtol=0)
    assert out.sums["entropy"].item() == pytest.approx(2.5)


def test_kl_estimators_bound_the_pull_on_a_token_pushed_far_down() -> None:
    """A token one update pushed 8 nats below the reference: k3's gradient is 1 - e^8 (~ -2980), k2's
    is -8, and low_var_kl's is 0 (past its clamp); near the reference all three agree to first order.
    The "kl" metric stays k3 whatever the loss uses."""
    gap = torch.tensor([8.0, 0.01], dtype=torch.float64)  # ref - logp per token
    w = torch.tensor([1.0, 1.0], dtype=torch.float64)
    expected = {"k3": [1 - math.exp(8.0), 1 - math.exp(0.01)], "k2": [-8.0, -0.01], "low_var_kl": [0.0, 1 - math.exp(0.01)]}
    for estimator, grads in expected.items():
        logp = torch.tensor([-9.0, -1.0], dtype=torch.float64, requires_grad=True)
        ref = logp.detach() + gap
        out = policy_loss(logp, ref, torch.zeros(2, dtype=torch.float64), w,
                          config=ObjectiveConfig(kl_coef=1.0, kl_estimator=estimator), ref_logprobs=ref)
        out.loss.backward()
        assert logp.grad is not None
        torch.testing.assert_close(logp.grad, torch.tensor(grads, dtype=torch.float64), rtol=1e-6, atol=1e-9)
        assert out.sums["kl"].item() == pytest.approx(float(k3_kl(-gap, torch.zeros(2, dtype=torch.float64)).sum()))
    assert kl_estimate(-gap, torch.zeros(2, dtype=torch.float64), "low_var_kl")[0].item() == 10.0
    with pytest.raises(ValueError, match="kl_estimator"):
        ObjectiveConfig(kl_estimator="k1")


def test_k3_is_nonnegative_and_zero_at_equality() -> None:
    x = torch.linspace(-3, 3, 13)
    assert torch.all(k3_kl(x, x) == 0)
    assert torch.all(k3_kl(x, x.flip(0)) >= 0)


def test_zero_weight_tokens_do_not_contribute() -> None:
    logp, old, adv, _ = _inputs()
    w = torch.tensor([1.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    out = policy_loss(logp, old, adv, w, config=ObjectiveConfig())
    assert out.loss.item() == pytest.approx(-1.25)


@pytest.mark.parametrize("kwargs", [{"eps_low": 1.0}, {"eps_low": -0.1}, {"eps_high": float("inf")},
                                    {"tis_cap": 0.5}, {"kl_coef": -1.0}, {"entropy_coef": float("nan")}])
def test_bad_config_rejected(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ObjectiveConfig(**kwargs)


def test_shape_mismatch_and_missing_entropy_rejected() -> None:
    logp, old, adv, w = _inputs()
    with pytest.raises(ValueError, match="shape"):
        policy_loss(logp, old[:3], adv, w, config=ObjectiveConfig())
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(logp, old, adv, w, config=ObjectiveConfig(entropy_coef=0.1))
