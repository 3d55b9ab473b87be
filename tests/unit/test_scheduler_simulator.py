"""Unit tests of the cluster simulator, the lower bound, traces and `gyre bench scheduler`.

Hand-computed timelines check the cost model; small generated traces check the invariants every
mode must keep (nothing interrupted or run twice, core never switched, staleness bound) and the
bound (no mode beats it)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.traces.generate import TraceSpec, generate_trace
from services.scheduler.sim.bounds import lower_bound, rollout_cell_seconds
from services.scheduler.sim.comparison import compare, sweep_async
from services.scheduler.sim.cost_model import CostModel
from services.scheduler.policy import Mode, PolicyParams
from services.common.roles import CellRole
from services.scheduler.sim.cli import bench_main
from services.scheduler.sim.simulator import Simulator, simulate
from services.task.traces import TraceExecution, load_trace, save_trace, trace_stats

ELASTIC = PolicyParams(mode=Mode.ELASTIC)
COLOCATE = PolicyParams(mode=Mode.COLOCATE)


def execution(step: int, group: str, eid: str, turns: list[tuple[int, int, float]],
              timeout_s: float | None = None) -> TraceExecution:
    p, g, e = zip(*turns, strict=True)
    return TraceExecution(step=step, group=group, execution_id=eid, prompt_tokens=np.array(p, dtype=np.int64),
                          gen_tokens=np.array(g, dtype=np.int64), env_s=np.array(e, dtype=float),
                          timeout_s=timeout_s)


def small_trace(seed: int = 0, steps: int = 3, per_step: int = 24, tail: float = 0.5) -> list[TraceExecution]:
    return generate_trace(TraceSpec(steps=steps, executions_per_step=per_step, group_size=4, mean_tokens=60_000,
                                    mean_turns=8, tail_share=tail, seed=seed))


def small_cost(**kw: float) -> CostModel:
    base = dict(num_cells=5, kv_capacity_tokens=4 * 16_384, execution_kv_tokens=16_384, train_tok_s=2_000.0)
    return CostModel(**(base | kw))  # type: ignore[arg-type]


# -- the cost model, by hand --------------------------------------------------------------------
def test_one_execution_timeline_matches_the_cost_model() -> None:
    # Two turns of 1 s prefill + 1 s decode + 3 s tools, on one rollout cell; the core trains.
    trace = [execution(0, "g", "e", [(8000, 50, 3.0), (8000, 50, 3.0)])]
    cost = CostModel(num_cells=2, decode_tok_s=50.0, prefill_tok_s=8000.0, train_tok_s=5000.0,
                     idle_to_rollout_s=3.5, publish_s=20.0)
    r = simulate(trace, cost, COLOCATE)
    # IDLE->ROLLOUT 3.5 s, execution 10 s -> done at 13.5; the core trains 16,100 tokens in 3.22 s
    # (the other cell's 8.5 s switch to TRAIN finishes later and adds nothing); publish 20 s.
    assert r.makespan_s == pytest.approx(13.5 + 16_100 / 5000 + 20.0)
    assert r.switches == 1 and r.max_staleness == 0


def test_cells_that_share_compute_train_no_faster_than_the_cap() -> None:
    """Colocate: after the rollout every cell trains. Each its own hardware, 3 cells train 3x one's
    rate; cells sharing one host (max_train_tok_s) train at the cap, and the bound knows it."""
    trace = [execution(0, "g", "e", [(8000, 50, 3.0)])]  # 1 s prefill + 1 s decode + 3 s tools: 8,050 tokens
    base = dict(num_cells=3, decode_tok_s=50.0, prefill_tok_s=8000.0, train_tok_s=1000.0, idle_to_rollout_s=0.0,
                idle_to_train_s=0.0, rollout_to_train_s=0.0, publish_s=0.0)
    free = simulate(trace, CostModel(**base), COLOCATE)  # type: ignore[arg-type]
    shared = simulate(trace, CostModel(**base, max_train_tok_s=1500.0), COLOCATE)  # type: ignore[arg-type]
    assert free.makespan_s == pytest.approx(5.0 + 8050 / 3000)
    assert shared.makespan_s == pytest.approx(5.0 + 8050 / 1500)
    assert CostModel(**base, max_train_tok_s=1500.0).train_rate(1) == 1000.0  # type: ignore[arg-type]
    bound = lower_bound(trace, CostModel(**base, max_train_tok_s=1500.0), 0)  # type: ignore[arg-type]
    assert bound.lower_bound_s <= shared.makespan_s * (1 + 1e-9)
    assert bound.chain_bound_s >= 5.0 + 8050 / 1500 - 1e-6


def test_concurrent_calls_share_a_cell_at_the_batched_speed() -> None:
    trace = [execution(0, "g", f"e{i}", [(0, 100, 0.0)]) for i in range(2)]
    cost = CostModel(num_cells=2, kv_capacity_tokens=2, execution_kv_tokens=1, decode_tok_s=50.0,
                     batch_slowdown_at_full=0.1, idle_to_rollout_s=0.0, publish_s=0.0, train_tok_s=1e9)
    sim = Simulator(trace, cost, COLOCATE)
    ends: list[float] = []
    finish = sim._finish

    def record(e, **kw):  # noqa: ANN001, ANN003 - test probe
        ends.append(sim.now)
        finish(e, **kw)

    sim._finish = record  # type: ignore[method-assign]
    sim.run()
    # 2 s of solo work each, both on a full cell of 2: 10% slower.
    assert ends == pytest.approx([2.2, 2.2])


def test_rollout_cell_seconds_lp() -> None:
    cost = CostModel(num_cells=4, kv_capacity_tokens=4, execution_kv_tokens=1, batch_slowdown_at_full=0.1)
    assert rollout_cell_seconds(0.0, 40.0, cost) == pytest.approx(10.0)  # tool time only: 4 slots
    assert rollout_cell_seconds(40.0, 0.0, cost) == pytest.approx(11.0)  # full cell: 4 calls at 1/1.1
    mixed = rollout_cell_seconds(40.0, 40.0, cost)
    assert 20.0 <= mixed <= 21.0 + 1e-9  # slots shared between calls and tool time


def test_migration_time_scales_with_context() -> None:
    cost = CostModel(num_cells=2, kv_bytes_per_token=1000, migration_gb_s=1.0)
    assert cost.migration_s(100_000) == pytest.approx(0.1)
    assert cost.migration_s(10**9) == pytest.approx(cost.execution_kv_tokens * 1000 / 1e9)


# -- invariants on generated traces ---------------------------------------------------------------
def run_probe(trace: list[TraceExecution], cost: CostModel, params: PolicyParams) -> Simulator:
    sim = Simulator(trace, cost, params)
    sim.run()
    return sim


@pytest.mark.parametrize("params", [COLOCATE, ELASTIC, PolicyParams(mode=Mode.ASYNC, async_rollout_cells=2),
                                    PolicyParams(mode=Mode.ELASTIC, staleness_bound=2),
                                    PolicyParams(mode=Mode.ASYNC, async_rollout_cells=3, rollout_batches=True)])
def test_every_call_runs_once_and_the_core_never_switches(params: PolicyParams) -> None:
    trace = small_trace()
    sim = run_probe(trace, small_cost(), params)
    assert sim.calls_done == sum(len(e.env_s) for e in trace)  # none lost, none recomputed
    assert all(e.turn == len(e.work) - 1 for e in sim.execs)
    assert all(cell_id != sim.cells[0].cell_id for _, cell_id, _, _, _ in sim.switch_log)
    stale = [e.staleness for e in sim.execs]
    bound = 0 if params.mode is Mode.COLOCATE else params.staleness_bound
    assert 0 <= min(stale) and max(stale) <= bound
    assert len(sim.step_done_s) == 3 and sim.step_done_s == sorted(sim.step_done_s)


def test_elastic_consolidates_with_migration_and_returns_cells() -> None:
    sim = run_probe(small_trace(steps=4), small_cost(), ELASTIC)
    to_train = [x for x in sim.switch_log if x[2] is CellRole.ROLLOUT and x[3] is CellRole.TRAIN]
    back = [x for x in sim.switch_log if x[2] is CellRole.TRAIN and x[3] is CellRole.ROLLOUT]
    assert to_train and back
    assert sim.migrations > 0 and any(moved > 0 for *_, moved in to_train)


def test_elastic_weighs_the_cost_models_numbers_when_cells_share_compute() -> None:
    """The simulator hands the policy its own rates and switch times (services/scheduler/costs.py):
    where the TRAIN cells share one host's compute (a cap at one cell's rate), a freed cell buys no
    training speed, so elastic frees none; with their own compute it does, as above."""
    trace = small_trace(steps=4)
    shared = run_probe(trace, small_cost(max_train_tok_s=2_000.0), ELASTIC)
    assert not [x for x in shared.switch_log if x[2] is CellRole.ROLLOUT and x[3] is CellRole.TRAIN]
    own = run_probe(trace, small_cost(), ELASTIC)
    assert [x for x in own.switch_log if x[2] is CellRole.ROLLOUT and x[3] is CellRole.TRAIN]
    assert shared.calls_done == own.calls_done == sum(len(e.env_s) for e in trace)


def test_async_keeps_its_split() -> None:
    sim = run_probe(small_trace(), small_cost(), PolicyParams(mode=Mode.ASYNC, async_rollout_cells=3))
    assert [x for x in sim.switch_log if x[2] is not CellRole.IDLE] == []
    assert sum(1 for c in sim.cells if c.role is CellRole.ROLLOUT) == 3


def test_colocate_pool_alternates_every_step() -> None:
    sim = run_probe(small_trace(), small_cost(), COLOCATE)
    to_train = [x for x in sim.switch_log if x[3] is CellRole.TRAIN and x[2] is CellRole.ROLLOUT]
    assert len(to_train) == 3 * 4  # every non-core cell, every step
    assert all(moved == 0 for *_, moved in sim.switch_log)  # colocate never migrates


@settings(max_examples=12, deadline=None)
@given(seed=st.integers(0, 10_000), tail=st.sampled_from([0.2, 0.5, 0.7]), bound=st.integers(0, 2))
def test_no_mode_beats_the_lower_bound(seed: int, tail: float, bound: int) -> None:
    trace = small_trace(seed=seed, steps=2, per_step=16, tail=tail)
    cost = small_cost()
    lb = lower_bound(trace, cost, bound)
    for params in (PolicyParams(mode=Mode.COLOCATE, staleness_bound=bound),
                   PolicyParams(mode=Mode.ELASTIC, staleness_bound=bound),
                   PolicyParams(mode=Mode.ASYNC, staleness_bound=bound, async_rollout_cells=2)):
        r = simulate(trace, cost, params)
        assert r.makespan_s >= lb.lower_bound_s * (1 - 1e-9)
        assert r.max_staleness <= (0 if params.mode is Mode.COLOCATE else bound)
        assert 0.0 < r.utilization <= 1.0 + 1e-9


def test_elastic_beats_colocate_and_best_async_on_a_heavy_tail() -> None:
    trace = small_trace(steps=4, per_step=32, tail=0.5)
    cmp = compare(trace, small_cost(), 1)
    el = cmp.results["elastic"].makespan_s
    assert el <= cmp.results["colocate"].makespan_s
    assert el <= cmp.results["async"].makespan_s
    assert set(cmp.async_sweep) == {1, 2, 3, 4}  # every split tried


def test_local_sweep_finds_the_full_sweep_optimum() -> None:
    trace = small_trace(steps=2, per_step=16)
    cost = small_cost(num_cells=8)
    full, sweep = sweep_async(trace, cost, 1)
    local, tried = sweep_async(trace, cost, 1, around=4)
    assert local.makespan_s == full.makespan_s and set(tried) <= set(sweep)


def test_timeouts_stop_at_a_turn_boundary() -> None:
    trace = [execution(0, "g", "long", [(0, 50, 10.0)] * 10, timeout_s=15.0), execution(0, "g", "short", [(0, 50, 1.0)])]
    cost = CostModel(num_cells=2, idle_to_rollout_s=0.0)
    sim = run_probe(trace, cost, COLOCATE)
    assert sim.timeouts == 1
    # First call shared with "short" on a 4-slot cell (1 + 0.1/3 s), 10 s tools, second call 1 s, 10 s
    # tools: past 15 s at the next turn boundary, so it stops there without starting turn 3.
    assert sim.execs[0].end_t == pytest.approx(1 + 0.1 / 3 + 10 + 1 + 10)


# -- traces ---------------------------------------------------------------------------------------
def test_trace_roundtrip_and_generator_targets(tmp_path: Path) -> None:
    spec = TraceSpec(steps=2, executions_per_step=60, group_size=6, tail_share=0.5, seed=3)
    trace = generate_trace(spec)
    stats = trace_stats(trace, CostModel(num_cells=16))
    assert stats.mean_tokens_per_execution == pytest.approx(700_000, rel=1e-3)
    assert stats.tail_share == pytest.approx(0.5, abs=0.02)
    path = tmp_path / "t.jsonl"
    save_trace(trace, path)
    back = load_trace(path)
    assert [e.execution_id for e in back] == [e.execution_id for e in trace]
    assert all((a.gen_tokens == b.gen_tokens).all() and np.allclose(a.env_s, b.env_s)
               for a, b in zip(trace, back, strict=True))
    assert generate_trace(spec)[5].total_tokens == trace[5].total_tokens  # deterministic per seed


@pytest.mark.parametrize("lines, match", [
    (['{"step": 0, "group": "g", "execution_id": "a"}'], "missing field"),
    (['{"step": 0, "group": "g", "execution_id": "a", "turns": []}'], "non-empty"),
    (['{"step": 0, "group": "g", "execution_id": "a", "turns": [{"prompt_tokens": -1, "gen_tokens": 1, "env_s": 0}]}'],
     ">= 0"),
    (['{"step": 1, "group": "g", "execution_id": "a", "turns": [{"prompt_tokens": 1, "gen_tokens": 1, "env_s": 0}]}'],
     "steps must be 0"),
    (['{"step": 0, "group": "g", "execution_id": "a", "turns": [{"prompt_tokens": 1, "gen_tokens": 1, "env_s": 0}]}'] * 2,
     "duplicate"),
    (["not json"], "not JSON"),
])
def test_bad_traces_are_rejected(tmp_path: Path, lines: list[str], match: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=match):
        load_trace(path)


def test_bad_cost_model_is_rejected() -> None:
    with pytest.raises(ValueError, match="num_cells"):
        CostModel(num_cells=1)
    with pytest.raises(ValueError, match="kv_capacity_tokens"):
        CostModel(num_cells=2, kv_capacity_tokens=10, execution_kv_tokens=100)
    with pytest.raises(ValueError, match="decode_tok_s"):
        CostModel(num_cells=2, decode_tok_s=0)
    with pytest.raises(ValueError, match="max_train_tok_s"):
        CostModel(num_cells=2, max_train_tok_s=-1)


# -- gyre bench scheduler -------------------------------------------------------------------------
def test_bench_cli_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    save_trace(small_trace(steps=2, per_step=16), path)
    rc = bench_main(["--trace", str(path), "--cells", "5", "--kv-capacity-tokens", "65536",
                     "--execution-kv-tokens", "16384", "--train-tok-s", "2000", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["modes"]) == {"colocate", "async", "elastic"}
    assert out["modes"]["async"]["rollout_cells"] in range(1, 5)
    for m in out["modes"].values():
        assert m["makespan_s"] >= out["lower_bound_s"]
        assert {"utilization", "idle_cell_s", "switches", "mean_staleness", "max_staleness"} <= set(m)
    assert out["lower_bound_s"] == max(out["work_bound_s"], out["chain_bound_s"], out["coupled_bound_s"])


def test_bench_cli_text_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    save_trace(small_trace(steps=1, per_step=8), path)
    assert bench_main(["--trace", str(path), "--cells", "3", "--modes", "elastic,colocate"]) == 0
    out = capsys.readouterr().out
    assert "lower bound" in out and "elastic" in out and "async " not in out
    assert bench_main(["--trace", str(tmp_path / "missing.jsonl"), "--cells", "3"]) == 2
    assert bench_main(["--trace", str(path), "--cells", "1"]) == 2
    assert bench_main(["--trace", str(path), "--cells", "3", "--modes", "nope"]) == 2
    assert "gyre bench scheduler:" in capsys.readouterr().err


def test_executions_with_deadlines_count_the_turns_a_solo_run_completes() -> None:
    from dataclasses import replace

    from services.scheduler.sim.bounds import must_do

    cost = CostModel(num_cells=2, idle_to_rollout_s=0.0)
    long = execution(0, "g", "long", [(0, 50, 10.0)] * 10, timeout_s=15.0)
    # solo: turn 1 ends at 11 s, turn 2 at 22 s (past 15 s): two turns, as the simulator stops it
    assert must_do(long, cost) == 2 and must_do(replace(long, timeout_s=None), cost) == 10
    assert must_do(replace(long, timeout_s=1e9), cost) == 10
    # every execution with a deadline: the work term is that of the solo-completed prefixes, not 0
    trace = [replace(e, timeout_s=0.5 * e.solo_latency_s(cost)) for e in small_trace(steps=2, per_step=16)]
    cut = [replace(e, prompt_tokens=e.prompt_tokens[:t], gen_tokens=e.gen_tokens[:t], env_s=e.env_s[:t],
                   timeout_s=None) for e in trace for t in [must_do(e, small_cost())]]
    lb, plain = lower_bound(trace, small_cost(), 1), lower_bound(cut, small_cost(), 1)
    assert lb.work_bound_s > 0 and lb.work_bound_s == pytest.approx(plain.work_bound_s)
    assert lb.rollout_cell_s == pytest.approx(plain.rollout_cell_s)
    assert lb.train_cell_s == pytest.approx(plain.train_cell_s)
