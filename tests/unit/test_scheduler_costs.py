"""Switch costs against what a switch buys: the estimator and the elastic policy's use of it."""

from __future__ import annotations

import pytest

from services.common.roles import CellRole
from services.scheduler.costs import (DEFAULT_ROLLOUT_TO_TRAIN_S, DEFAULT_TRAIN_TO_ROLLOUT_S, StepProgress,
                                      SwitchCosts, SwitchSample, TrainSample, estimate, train_left_tokens)
from services.scheduler.policy import CellView, ClusterView, Mode, PolicyParams, decide


def samples(*rates_by_world: tuple[int, float], tokens: float = 12_000.0) -> list[TrainSample]:
    return [TrainSample(step=i, tokens=tokens, compute_s=tokens / rate, world_size=w)
            for i, (w, rate) in enumerate(rates_by_world)]


def test_nothing_measured_means_no_costs_yet() -> None:
    assert estimate([], [SwitchSample(True, 1.0)], max_cells=4) is None
    assert estimate([TrainSample(0, 100.0, 0.0, 1)], [], max_cells=4) is None  # no compute time: no rate


def test_separate_hardware_scales_and_pays_for_a_switch() -> None:
    """Replicas on their own accelerators: twice the cells, twice the rate (alpha 1)."""
    costs = estimate(samples((1, 1000.0), (2, 2000.0), (1, 1000.0)),
                     [SwitchSample(True, 2.0), SwitchSample(False, 1.0), SwitchSample(True, 4.0)], max_cells=4)
    assert costs is not None
    assert costs.train_tok_s == pytest.approx((1000.0, 2000.0, 3000.0, 4000.0))
    assert (costs.rollout_to_train_s, costs.train_to_rollout_s) == (3.0, 1.0)  # medians
    # 12K tokens: 12 s alone; a second cell arrives after 3 s and the last 9K take 4.5 s: 4.5 s sooner
    assert costs.gain_s(1) == pytest.approx(12.0 - (3.0 + 9.0 / 2))
    assert costs.worth_freeing(1)
    assert "alpha 1.00" in costs.basis


def test_cells_sharing_one_hosts_cores_never_pay_for_a_switch() -> None:
    """The 2-core box: a second TRAIN cell trains at the same total rate (alpha 0)."""
    costs = estimate(samples((1, 1000.0), (2, 1000.0), (3, 980.0)), [], max_cells=4)
    assert costs is not None
    assert costs.rollout_to_train_s == DEFAULT_ROLLOUT_TO_TRAIN_S  # priors until a switch is timed
    assert costs.train_to_rollout_s == DEFAULT_TRAIN_TO_ROLLOUT_S
    assert costs.gain_s(1) <= 0.0 and not costs.worth_freeing(1)
    assert not any(costs.worth_freeing(k) for k in range(1, 4))


def test_an_unmeasured_world_size_is_extrapolated_linearly_until_replicas_were_measured() -> None:
    costs = estimate(samples((1, 500.0), (1, 500.0)), [], max_cells=3, train_left_tokens=30_000.0)
    assert costs is not None and costs.train_tok_s == pytest.approx((500.0, 1000.0, 1500.0))
    assert costs.worth_freeing(1)  # 60 s alone vs 3 + 28.5K/1000: exploring a second cell pays


def test_a_short_update_is_not_worth_a_switch() -> None:
    costs = SwitchCosts(rollout_to_train_s=3.0, train_to_rollout_s=5.0, train_tok_s=(1000.0, 2000.0),
                        train_left_tokens=2_000.0)
    assert costs.gain_s(1) == pytest.approx(2.0 - 3.0)  # done before the cell would arrive
    assert not costs.worth_freeing(1)


def test_the_work_left_takes_off_what_the_trainer_already_trained() -> None:
    """Half the executions ended of a 12K-token update: 6K to share without a count; with the
    trajectory service's count, what is trained is taken off, and a sealed step's packed tokens are
    the exact total. Near an update's end, freeing a cell for it no longer pays."""
    assert train_left_tokens(12_000.0, 0.5, None) == pytest.approx(6_000.0)
    assert train_left_tokens(12_000.0, 0.5, StepProgress(4_000, 1_000, sealed=False)) == pytest.approx(5_000.0)
    assert train_left_tokens(12_000.0, 0.5, StepProgress(8_000, 1_000, sealed=False)) == pytest.approx(7_000.0)
    assert train_left_tokens(12_000.0, 1.0, StepProgress(10_000, 9_000, sealed=True)) == pytest.approx(1_000.0)
    assert train_left_tokens(12_000.0, 1.0, StepProgress(10_000, 10_000, sealed=True)) == 0.0
    rates, switches = samples((1, 500.0), (2, 1000.0)), [SwitchSample(True, 1.0), SwitchSample(False, 1.0)]
    early = estimate(rates, switches, max_cells=3, train_left_tokens=train_left_tokens(12_000.0, 1.0, None))
    late = estimate(rates, switches, max_cells=3,
                    train_left_tokens=train_left_tokens(12_000.0, 1.0, StepProgress(12_000, 11_000, sealed=True)))
    assert early is not None and late is not None
    assert early.worth_freeing(1) and not late.worth_freeing(1)


def test_bad_costs_are_refused() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        SwitchCosts(rollout_to_train_s=-1.0, train_to_rollout_s=1.0, train_tok_s=(1.0,), train_left_tokens=0.0)
    with pytest.raises(ValueError, match="positive throughput"):
        SwitchCosts(rollout_to_train_s=1.0, train_to_rollout_s=1.0, train_tok_s=(), train_left_tokens=0.0)


def _tail_view(costs: SwitchCosts | None) -> ClusterView:
    """The tail of a step: two rollout cells with one execution left each, the core training."""
    cells = (CellView("core", CellRole.TRAIN, True, 0, 0, 1000),
             CellView("c1", CellRole.ROLLOUT, False, 1, 100, 1000),
             CellView("c2", CellRole.ROLLOUT, False, 1, 100, 1000))
    return ClusterView(now_s=0.0, step=0, weight_version=0, cells=cells, queued=0, running=2, finished_in_step=30,
                       step_size=32, train_ready=True, training_active=True, next_step_allowed=False, costs=costs)


def test_elastic_frees_a_cell_only_when_the_update_gains_more_than_the_way_back() -> None:
    params = PolicyParams(mode=Mode.ELASTIC, execution_kv_tokens=100)
    uncosted = decide(_tail_view(None), params)
    assert [(a.cell_id, a.to_role) for a in uncosted] == [("c1", CellRole.TRAIN)]
    scaling = SwitchCosts(rollout_to_train_s=3.0, train_to_rollout_s=5.0, train_tok_s=(1000.0, 2000.0, 3000.0),
                          train_left_tokens=60_000.0, basis="test")
    paid = decide(_tail_view(scaling), params)
    assert [(a.cell_id, a.to_role, a.migrate_to) for a in paid] == [("c1", CellRole.TRAIN, ("c2",))]
    assert "sooner with 2 TRAIN cells" in paid[0].reason and "(test)" in paid[0].reason
    shared = SwitchCosts(rollout_to_train_s=3.0, train_to_rollout_s=5.0, train_tok_s=(1000.0, 1000.0, 1000.0),
                         train_left_tokens=60_000.0)
    assert decide(_tail_view(shared), params) == []
