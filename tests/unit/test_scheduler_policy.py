"""Unit tests of the scheduling policy: every transition of the three modes, and the invariants
(core never switches, no execution interrupted, SWITCHING cells untouched, staleness bound) on
hand-built and on randomly generated cluster views."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.roles import CellRole
from services.scheduler.policy import (
    Action, CellView, ClusterView, Mode, PolicyParams, choose_cell, decide, effective_staleness_bound,
    may_start, place_execution,
)

KV = 1000  # tokens one execution reserves
CAP = 4 * KV  # four executions per cell


def cell(i: int, role: CellRole, inflight: int = 0, *, core: bool = False, to: CellRole | None = None,
         cordoned: bool = False) -> CellView:
    return CellView(cell_id=f"c{i}", role=role, is_core=core, inflight=inflight, kv_used_tokens=inflight * KV,
                    kv_capacity_tokens=CAP, switching_to=to, cordoned=cordoned)


def view(cells: list[CellView], *, queued: int = 0, running: int | None = None, train_ready: bool = False,
         training_active: bool = False, version: int = 0) -> ClusterView:
    if running is None:
        running = sum(c.inflight for c in cells)
    return ClusterView(now_s=0.0, step=version, weight_version=version, cells=tuple(cells), queued=queued,
                       running=running, finished_in_step=0, step_size=16, train_ready=train_ready,
                       training_active=training_active, next_step_allowed=True)


ELASTIC = PolicyParams(mode=Mode.ELASTIC, execution_kv_tokens=KV)
COLOCATE = PolicyParams(mode=Mode.COLOCATE)


def switches(actions: list[Action]) -> dict[str, CellRole]:
    return {a.cell_id: a.to_role for a in actions}


def assert_invariants(v: ClusterView, actions: list[Action]) -> None:
    """Independent of policy.check_actions: what the issue requires of any decision."""
    by_id = {c.cell_id: c for c in v.cells}
    ids = [a.cell_id for a in actions]
    assert len(ids) == len(set(ids)), "one action per cell"
    switching_away = set(ids)
    room = {c.cell_id: (c.kv_capacity_tokens - c.kv_used_tokens) // KV if c.role is CellRole.ROLLOUT else 0
            for c in v.cells}
    for a in actions:
        c = by_id[a.cell_id]
        assert not c.is_core, "the core cell never switches"
        assert c.role is not CellRole.SWITCHING, "a SWITCHING cell gets no new action"
        assert a.to_role in (CellRole.ROLLOUT, CellRole.TRAIN) and a.to_role is not c.role
        if c.role is CellRole.ROLLOUT:
            left = c.inflight if v.running > 0 else 0  # the job runs nothing: a reported count is stale
            for t in a.migrate_to:
                assert t not in switching_away and by_id[t].role is CellRole.ROLLOUT
                take = min(room[t], left)
                room[t] -= take
                left -= take
            assert left == 0, "a ROLLOUT cell leaves only with its executions migrated to cells with room"
        else:
            assert a.migrate_to == ()


# -- colocate ---------------------------------------------------------------------------------
def test_colocate_assigns_fresh_pool_to_rollout_when_work_is_queued() -> None:
    cells = [cell(0, CellRole.TRAIN, core=True)] + [cell(i, CellRole.IDLE) for i in range(1, 4)]
    acts = decide(view(cells, queued=12), COLOCATE)
    assert switches(acts) == {"c1": CellRole.ROLLOUT, "c2": CellRole.ROLLOUT, "c3": CellRole.ROLLOUT}


def test_colocate_keeps_rolling_out_while_any_execution_runs() -> None:
    cells = [cell(0, CellRole.TRAIN, core=True), cell(1, CellRole.ROLLOUT, 1), cell(2, CellRole.ROLLOUT, 0)]
    assert decide(view(cells, train_ready=True, training_active=True), COLOCATE) == []


def test_colocate_pool_joins_the_update_when_step_rolled_out() -> None:
    cells = [cell(0, CellRole.TRAIN, core=True), cell(1, CellRole.ROLLOUT), cell(2, CellRole.ROLLOUT)]
    acts = decide(view(cells, train_ready=True, training_active=True), COLOCATE)
    assert switches(acts) == {"c1": CellRole.TRAIN, "c2": CellRole.TRAIN}


def test_colocate_moves_the_whole_pool_when_a_heartbeat_still_reports_a_finished_call() -> None:
    # The step rolled out (the job's counters: nothing running or queued) but c2's last heartbeat
    # predates its last call's end. Leaving c2 behind splits the pool: the core publishes, the next
    # step opens and c2 never trains (the CI failure: one cell went to TRAIN, none came back).
    cells = [cell(0, CellRole.TRAIN, core=True), cell(1, CellRole.ROLLOUT, 0), cell(2, CellRole.ROLLOUT, 1)]
    v = view(cells, running=0, train_ready=True, training_active=True)
    acts = decide(v, COLOCATE)
    assert switches(acts) == {"c1": CellRole.TRAIN, "c2": CellRole.TRAIN}
    assert_invariants(v, acts)


def test_colocate_stays_in_train_until_the_update_is_published() -> None:
    cells = [cell(0, CellRole.TRAIN, core=True), cell(1, CellRole.TRAIN), cell(2, CellRole.TRAIN)]
    # Publishing: no backlog, update still active, next step not startable yet (bound 0).
    assert decide(view(cells, training_active=True), COLOCATE) == []
    acts = decide(view(cells, queued=8, version=1), COLOCATE)
    assert switches(acts) == {"c1": CellRole.ROLLOUT, "c2": CellRole.ROLLOUT}


def test_colocate_returns_to_rollout_while_the_trainer_waits_in_the_next_step() -> None:
    # Published; the trainer already opened the next step and waits for its batches (it reports
    # the step started, so the view says training_active). Only rollouts can feed it.
    cells = [cell(0, CellRole.TRAIN, core=True), cell(1, CellRole.TRAIN), cell(2, CellRole.TRAIN)]
    acts = decide(view(cells, queued=8, version=1, training_active=True), COLOCATE)
    assert switches(acts) == {"c1": CellRole.ROLLOUT, "c2": CellRole.ROLLOUT}
    # ... also when harnesses leased all of it at once (nothing queued, all waiting for an engine)
    acts = decide(view(cells, running=8, version=1, training_active=True), COLOCATE)
    assert switches(acts) == {"c1": CellRole.ROLLOUT, "c2": CellRole.ROLLOUT}


def test_colocate_is_on_policy_whatever_the_bound() -> None:
    p = PolicyParams(mode=Mode.COLOCATE, staleness_bound=3)
    assert effective_staleness_bound(p) == 0
    assert may_start(4, 4, p) and not may_start(5, 4, p)


# -- async ------------------------------------------------------------------------------------
def test_async_static_split_from_a_fresh_pool() -> None:
    p = PolicyParams(mode=Mode.ASYNC, async_rollout_cells=2)
    cells = [cell(0, CellRole.TRAIN, core=True)] + [cell(i, CellRole.IDLE) for i in range(1, 5)]
    acts = decide(view(cells, queued=10), p)
    roles = list(switches(acts).values())
    assert roles.count(CellRole.ROLLOUT) == 2 and roles.count(CellRole.TRAIN) == 2


def test_async_holds_its_split_through_tails_and_updates() -> None:
    p = PolicyParams(mode=Mode.ASYNC, async_rollout_cells=2)
    cells = [cell(0, CellRole.TRAIN, core=True), cell(1, CellRole.ROLLOUT, 0), cell(2, CellRole.ROLLOUT, 1),
             cell(3, CellRole.TRAIN)]
    for kw in ({"train_ready": True}, {"queued": 30}, {"training_active": True}, {}):
        assert decide(view(cells, **kw), p) == []


def test_async_shrinks_only_with_empty_cells_and_counts_cells_mid_switch() -> None:
    p = PolicyParams(mode=Mode.ASYNC, async_rollout_cells=1)
    cells = [cell(0, CellRole.TRAIN, core=True), cell(1, CellRole.ROLLOUT, 3), cell(2, CellRole.ROLLOUT, 2),
             cell(3, CellRole.SWITCHING, to=CellRole.ROLLOUT)]
    assert decide(view(cells), p) == []  # both busy: none switches (no migration in async)
    cells[2] = cell(2, CellRole.ROLLOUT, 0)
    assert switches(decide(view(cells), p)) == {"c2": CellRole.TRAIN}


# -- elastic ----------------------------------------------------------------------------------
def test_elastic_starts_every_non_core_cell_in_rollout() -> None:
    cells = [cell(0, CellRole.TRAIN, core=True)] + [cell(i, CellRole.IDLE) for i in range(1, 5)]
    acts = decide(view(cells, queued=32), ELASTIC)
    assert switches(acts) == {f"c{i}": CellRole.ROLLOUT for i in range(1, 5)}


def test_elastic_consolidates_emptiest_cell_and_migrates_its_work() -> None:
    cells = [cell(0, CellRole.TRAIN, core=True), cell(1, CellRole.ROLLOUT, 3), cell(2, CellRole.ROLLOUT, 1),
             cell(3, CellRole.ROLLOUT, 2)]
    v = view(cells, train_ready=True, training_active=True)
    acts = decide(v, ELASTIC)
    assert_invariants(v, acts)
    # 6 executions fit on 2 cells: free the emptiest, c2, moving its one execution to the fullest with room.
    assert len(acts) == 1
    assert acts[0].cell_id == "c2" and acts[0].to_role is CellRole.TRAIN and acts[0].migrate_to == ("c1",)


def test_elastic_frees_several_cells_without_overfilling_receivers() -> None:
    cells = [cell(0, CellRole.TRAIN, core=True)] + [cell(i, CellRole.ROLLOUT, 1) for i in range(1, 6)]
    v = view(cells, train_ready=True, training_active=True)
    acts = decide(v, ELASTIC)
    assert_invariants(v, acts)
    assert len(acts) == 3  # 5 executions need 2 cells of 4
    receivers = {t for a in acts for t in a.migrate_to}
    assert not receivers & {a.cell_id for a in acts}


def test_elastic_does_not_consolidate_without_training_work() -> None:
    cells = [cell(0, CellRole.TRAIN, core=True), cell(1, CellRole.ROLLOUT, 1), cell(2, CellRole.ROLLOUT, 1)]
    assert decide(view(cells, training_active=True), ELASTIC) == []


def test_elastic_keeps_a_cell_whose_work_has_nowhere_to_go() -> None:
    cells = [cell(0, CellRole.TRAIN, core=True), cell(1, CellRole.ROLLOUT, 4), cell(2, CellRole.ROLLOUT, 3),
             cell(3, CellRole.ROLLOUT, 4)]
    # 11 executions need 3 cells exactly: nothing to free.
    assert decide(view(cells, train_ready=True), ELASTIC) == []
    cells[2] = cell(2, CellRole.ROLLOUT, 2)
    v = view(cells, train_ready=True, running=10)
    # 10 need 3 cells of 4: still none (ceil), and no receiver has room anyway.
    assert decide(v, ELASTIC) == []


def test_elastic_returns_train_cells_when_startable_work_exceeds_capacity() -> None:
    cells = [cell(0, CellRole.TRAIN, core=True), cell(1, CellRole.ROLLOUT, 4), cell(2, CellRole.TRAIN), cell(3, CellRole.TRAIN),
             cell(4, CellRole.TRAIN)]
    v = view(cells, queued=6, train_ready=True, training_active=True, version=1)
    acts = decide(v, ELASTIC)
    assert_invariants(v, acts)
    assert switches(acts) == {"c2": CellRole.ROLLOUT, "c3": CellRole.ROLLOUT}  # 10 executions -> 3 cells


def test_elastic_counts_cells_already_switching_back() -> None:
    cells = [cell(0, CellRole.TRAIN, core=True), cell(1, CellRole.ROLLOUT, 4), cell(2, CellRole.SWITCHING, to=CellRole.ROLLOUT),
             cell(3, CellRole.TRAIN)]
    assert decide(view(cells, queued=4, train_ready=True), ELASTIC) == []


def test_elastic_never_moves_the_core_even_when_it_is_the_only_spare_cell() -> None:
    cells = [cell(0, CellRole.TRAIN, core=True), cell(1, CellRole.ROLLOUT, 4)]
    assert decide(view(cells, queued=50), ELASTIC) == []


def test_elastic_min_rollout_cells_keeps_capacity() -> None:
    p = PolicyParams(mode=Mode.ELASTIC, execution_kv_tokens=KV, min_rollout_cells=2)
    cells = [cell(0, CellRole.TRAIN, core=True), cell(1, CellRole.ROLLOUT, 1), cell(2, CellRole.ROLLOUT, 0)]
    assert decide(view(cells, train_ready=True), p) == []
    assert switches(decide(view(cells, train_ready=True), ELASTIC)) == {"c2": CellRole.TRAIN}


def test_elastic_infers_execution_kv_from_cells() -> None:
    p = PolicyParams(mode=Mode.ELASTIC)
    cells = [cell(0, CellRole.TRAIN, core=True), cell(1, CellRole.ROLLOUT, 3), cell(2, CellRole.ROLLOUT, 1)]
    acts = decide(view(cells, train_ready=True), p)
    assert [(a.cell_id, a.migrate_to) for a in acts] == [("c2", ("c1",))]


# -- admission and placement ------------------------------------------------------------------
@pytest.mark.parametrize("bound", [0, 1, 2])
def test_may_start_enforces_the_staleness_bound(bound: int) -> None:
    p = PolicyParams(mode=Mode.ELASTIC, staleness_bound=bound)
    for version in range(4):
        for step in range(version, version + 5):
            assert may_start(step, version, p) == (step - version <= bound)


def test_one_step_off_admission_waits_for_the_previous_step() -> None:
    p = PolicyParams(mode=Mode.ASYNC, async_rollout_cells=1, rollout_batches=True)
    assert not may_start(1, 0, p, previous_step_finished=False)
    assert may_start(1, 0, p, previous_step_finished=True)


def test_placement_packs_for_elastic_and_spreads_otherwise() -> None:
    cells = [cell(0, CellRole.TRAIN, core=True), cell(1, CellRole.ROLLOUT, 1), cell(2, CellRole.ROLLOUT, 3),
             cell(3, CellRole.ROLLOUT, 4), cell(4, CellRole.SWITCHING, to=CellRole.ROLLOUT)]
    v = view(cells)
    assert place_execution(v, ELASTIC, KV) == "c2"
    assert place_execution(v, PolicyParams(mode=Mode.ASYNC, async_rollout_cells=3), KV) == "c1"
    full = view([cell(0, CellRole.TRAIN, core=True), cell(1, CellRole.ROLLOUT, 4)])
    assert place_execution(full, ELASTIC, KV) is None
    assert choose_cell([], Mode.ELASTIC) is None


def test_bad_params_are_rejected_with_a_sentence() -> None:
    with pytest.raises(ValueError, match="async_rollout_cells"):
        PolicyParams(mode=Mode.ASYNC)
    with pytest.raises(ValueError, match="staleness_bound"):
        PolicyParams(mode=Mode.ELASTIC, staleness_bound=-1)
    with pytest.raises(ValueError, match="consolidate_threshold"):
        PolicyParams(mode=Mode.ELASTIC, consolidate_threshold=0.0)
    with pytest.raises(ValueError, match="switching_to"):
        CellView(cell_id="x", role=CellRole.SWITCHING, is_core=False, inflight=0, kv_used_tokens=0,
                 kv_capacity_tokens=1)


# -- invariants on random views ---------------------------------------------------------------
@st.composite
def cluster_views(draw: st.DrawFn) -> ClusterView:
    n = draw(st.integers(2, 10))
    cells = [cell(0, CellRole.TRAIN, core=True)]
    for i in range(1, n):
        role = draw(st.sampled_from([CellRole.ROLLOUT, CellRole.ROLLOUT, CellRole.TRAIN, CellRole.SWITCHING, CellRole.IDLE]))
        cordoned = draw(st.sampled_from([False, False, False, True]))
        if role is CellRole.SWITCHING:
            cells.append(cell(i, role, to=draw(st.sampled_from([CellRole.ROLLOUT, CellRole.TRAIN])), cordoned=cordoned))
        else:
            cells.append(cell(i, role, draw(st.integers(0, 4)) if role is CellRole.ROLLOUT else 0, cordoned=cordoned))
    return view(cells, queued=draw(st.integers(0, 40)), train_ready=draw(st.booleans()),
                training_active=draw(st.booleans()))


@settings(max_examples=300, deadline=None)
@given(v=cluster_views(), mode=st.sampled_from(list(Mode)), split=st.integers(1, 9))
def test_every_decision_keeps_the_invariants(v: ClusterView, mode: Mode, split: int) -> None:
    p = PolicyParams(mode=mode, async_rollout_cells=split, execution_kv_tokens=KV)
    acts = decide(v, p)
    assert_invariants(v, acts)
    assert decide(v, p) == acts  # pure: the same view gives the same answer
    cordoned = {c.cell_id for c in v.cells if c.cordoned}
    assert not [a for a in acts if a.cell_id in cordoned and a.to_role is CellRole.ROLLOUT]
    assert not cordoned & {t for a in acts for t in a.migrate_to}  # never handed work


def test_elastic_never_frees_a_cell_that_receives_work() -> None:
    # Two empty cells and one with 3: both empties are free-able, but the loaded one must stay.
    cells = [cell(0, CellRole.TRAIN, core=True), cell(1, CellRole.ROLLOUT, 0), cell(2, CellRole.ROLLOUT, 0),
             cell(3, CellRole.ROLLOUT, 1), cell(4, CellRole.ROLLOUT, 1)]
    v = view(cells, train_ready=True)
    acts = decide(v, ELASTIC)
    assert_invariants(v, acts)
    assert {a.cell_id for a in acts} == {"c1", "c2", "c3"}
    assert [a.migrate_to for a in acts if a.cell_id == "c3"] == [("c4",)]


# -- cordoned cells (an operator's) ---------------------------------------------------------------
@pytest.mark.parametrize("params", [ELASTIC, COLOCATE, PolicyParams(mode=Mode.ASYNC, async_rollout_cells=2)],
                         ids=["elastic", "colocate", "async"])
def test_a_cordoned_rollout_cell_is_drained_to_training_in_every_mode(params: PolicyParams) -> None:
    cells = [cell(0, CellRole.TRAIN, core=True), cell(1, CellRole.ROLLOUT, 3, cordoned=True), cell(2, CellRole.ROLLOUT, 1)]
    v = view(cells, queued=4)
    acts = [a for a in decide(v, params) if a.cell_id == "c1"]
    assert_invariants(v, acts)
    assert len(acts) == 1 and acts[0].to_role is CellRole.TRAIN and acts[0].migrate_to == ("c2",)
    assert "cordoned" in acts[0].reason


@pytest.mark.parametrize("params", [ELASTIC, COLOCATE, PolicyParams(mode=Mode.ASYNC, async_rollout_cells=2)],
                         ids=["elastic", "colocate", "async"])
def test_a_cordoned_cell_never_goes_back_to_rollout(params: PolicyParams) -> None:
    # every mode wants rollout capacity here (work queued, c2 is the only rollout cell)
    cells = [cell(0, CellRole.TRAIN, core=True), cell(1, CellRole.TRAIN, cordoned=True), cell(2, CellRole.ROLLOUT, 4),
             cell(3, CellRole.TRAIN)]
    acts = decide(view(cells, queued=40, version=1), params)
    assert "c1" not in switches(acts)
    assert switches(acts).get("c3") is CellRole.ROLLOUT  # the mode still uses the cells it may move


def test_a_cordoned_cell_stays_while_its_work_has_nowhere_to_go() -> None:
    cells = [cell(0, CellRole.TRAIN, core=True), cell(1, CellRole.ROLLOUT, 3, cordoned=True), cell(2, CellRole.ROLLOUT, 3)]
    assert "c1" not in switches(decide(view(cells), ELASTIC))  # c2 has room for 1 of its 3
    idle_job = view(cells, running=0)  # the job runs nothing: the reported counts are stale
    assert switches(decide(idle_job, ELASTIC))["c1"] is CellRole.TRAIN
