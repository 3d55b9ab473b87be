"""Live against the simulator: one scaled heavy-tail trace in the three modes, on the live stack and
in the simulator with the costs measured here.

    python -m bench.bench_live_vs_sim [--steps 3] [--executions 8] [--engines 2] [--out FILE]

1. **Rates of this machine**: the built-in model's engine alone (one torch thread, as a cell runs
   it): prefill and decode tokens/s of a single call, and how much slower each call decodes with 8
   decoding together (the simulator's ``batch_slowdown_at_full``).
2. **A heavy-tail trace**, generated with ``bench.traces.generate`` at those rates: the same shape as
   bench/traces/heavy_tail.jsonl (log-normal sizes with a calibrated tail, a Pareto tail of long tool
   calls), scaled to minutes.
3. **Live**: ``gyre replay --trace`` (``run_job``, the same code path) in colocate, async and
   elastic: the real scheduler, engines, gateway, harness, trajectory and trainer, each mode on its
   own stack. Measured there: switch durations, the trainer's tokens/s, publish time.
4. **Simulated**: the same trace through ``services.scheduler.sim.simulator`` (the same ``decide()``) on a
   cost model built from the rates of 1 and the costs of 3; the same cells, policy knobs and split.

Writes one table side by side (makespan, ratios to elastic, utilization, switches) and the cost
model used, to bench/results/live_vs_sim.md (a "## Causes" section already there is kept).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "live_vs_sim.md"
MODES = ("colocate", "async", "elastic")
SLOTS = 16  # executions a cell holds in the simulator: the live engines' KV never binds on these traces


# --- 1. rates ---------------------------------------------------------------------------------------
def engine_rates(model_dir: Path) -> dict[str, float]:
    """Prefill and decode tokens/s of one call alone, and the decode slowdown with 8 calls together."""
    import torch
    from transformers import AutoModelForCausalLM

    from services.rollout.engine import GenRequest, SamplingParams
    from services.rollout.torch_engine import TorchEngine

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    engine = TorchEngine(model, device="cpu", torch_threads=1, prefix_cache_bytes=0)
    engine.start()
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size

    def calls(n: int, prompt: int, gen: int) -> tuple[float, float]:
        """(seconds to the first tokens of all, seconds in all) of ``n`` concurrent greedy calls."""
        firsts: list[float] = []
        left = threading.Semaphore(0)
        lock = threading.Lock()

        def cb(ev: Any) -> None:
            with lock:
                if len(ev.token_ids) and ev.request_id not in seen:
                    seen.add(ev.request_id)
                    firsts.append(time.perf_counter())
            if ev.finished:
                left.release()

        seen: set[str] = set()
        t0 = time.perf_counter()
        for i in range(n):
            ids = rng.integers(3, vocab, prompt).astype(np.int32)
            engine.submit(GenRequest(f"r{n}-{prompt}-{i}-{t0}", ids,
                                     SamplingParams(temperature=0.0, max_new_tokens=gen)), cb)
        for _ in range(n):
            assert left.acquire(timeout=600)
        return max(firsts) - t0, time.perf_counter() - t0

    try:
        calls(1, 64, 8)  # warm
        first, _ = calls(1, 2048, 1)
        prefill = 2048 / first
        one_first, one_all = calls(1, 16, 129)
        decode_solo = 128 / (one_all - one_first)
        eight_first, eight_all = calls(8, 16, 129)
        decode_each_at_8 = 128 / (eight_all - eight_first)
    finally:
        engine.stop()
    slow8 = decode_solo / decode_each_at_8  # each call this many times slower with 8 decoding
    # speed(n) = 1 / (1 + b (n - 1) / (slots - 1))  ->  b from n = 8
    b = max(0.0, (slow8 - 1.0) * (SLOTS - 1) / 7)
    return {"prefill_tok_s": prefill, "decode_tok_s": decode_solo, "decode_slowdown_at_8": slow8,
            "batch_slowdown_at_full": b}


# --- 2. trace ---------------------------------------------------------------------------------------
def make_trace(path: Path, rates: dict[str, float], *, steps: int, executions: int, seed: int) -> list:
    from bench.traces.generate import TraceSpec, generate_trace
    from services.scheduler.sim.cost_model import CostModel
    from services.task.traces import save_trace

    # the generator's log-normal spread of sizes (size_sigma 0.8) as given: calibrating the tail share
    # needs far more executions per step than a run of minutes has (p90 is the max below 10)
    spec = TraceSpec(steps=steps, executions_per_step=executions, group_size=1, mean_tokens=6000.0, mean_turns=8.0,
                     gen_fraction=0.15, tail_share=None, size_sigma=0.8, env_mean_s=0.3, tool_tail_prob=0.05,
                     tool_tail_scale_s=3.0, tool_tail_cap_s=20.0, seed=seed)
    cost = CostModel(num_cells=16, prefill_tok_s=rates["prefill_tok_s"], decode_tok_s=rates["decode_tok_s"])
    trace = generate_trace(spec, cost)
    save_trace(trace, str(path))
    return trace


# --- 3. live ----------------------------------------------------------------------------------------
def live(trace_path: Path, mode: str, engines: int, work: Path) -> Any:
    from services.replay_trace import JOB_FILE, trace_job_args
    from services.run import load_run, run_job

    args = ["--job", str(JOB_FILE), *trace_job_args(str(trace_path), 1.0), "--mode", mode,
            "--engines", str(engines), "--quiet", "true", "--time_budget_s", "1200",
            "--report_dir", str(work / "reports" / mode), "--data_dir", str(work / "data" / mode)]
    if mode == "async":
        args += ["--async_rollout_cells", str(engines)]
    if mode == "colocate":
        args += ["--staleness_bound", "0"]
    run, spec, config = load_run(args)
    result = run_job(run, spec, echo=lambda line: None, config_path=config)
    if result.final_state != "completed":
        raise RuntimeError(f"live {mode} ended {result.final_state}")
    return result, spec


def makespan(result: Any) -> float:
    """Seconds from the job's submission to its last update's publication (as the simulator counts;
    the stack's start and stop are not in it)."""
    return max(float(r["time_s"]) for r in result.steps)


def live_utilization(result: Any, cells: int) -> float:
    """Busy cell-seconds (a rollout cell with an execution on it, or a training cell in a step) over
    cells x makespan is what the simulator counts; live we have role spans, so this is the share of
    cell-seconds in ROLLOUT or TRAIN (not switching, not idle) - an upper bound of the same thing."""
    end = makespan(result)
    busy = sum(max(0.0, min(r["end_s"], end) - r["start_s"]) for r in result.roles if r["role"] in ("rollout", "train"))
    return busy / (cells * end) if end > 0 else 0.0


def median(xs: list[float], default: float) -> float:
    return statistics.median(xs) if xs else default


def measured_costs(results: dict[str, Any]) -> dict[str, Any]:
    switches = [s for r in results.values() for s in r.switches]
    r2t = [s["duration_s"] for s in switches if s["from"] == "rollout" and s["to"] == "train"]
    t2r = [s["duration_s"] for s in switches if s["from"] == "train" and s["to"] == "rollout"]
    steps = [m for r in results.values() for m in r.steps]
    train = [float(m["train_tokens_per_s"]) for m in steps if float(m.get("train_tokens_per_s", 0) or 0) > 0]
    publish = [float(m.get("publish_s", 0) or 0) for m in steps]
    update = [float(m.get("step_time_s", 0) or 0) - float(m.get("train_time_s", 0) or 0) for m in steps]
    # steps that several cells trained: the step's tokens over the core's compute time is what the
    # cells trained together per second (they share this machine's cores)
    together = [float(m["tokens"]) / float(m["compute_s"]) for m in steps
                if float(m.get("world_size", 1) or 1) >= 2 and float(m.get("compute_s", 0) or 0) > 0]
    return {"rollout_to_train_s": median(r2t, 0.1), "train_to_rollout_s": median(t2r, 0.1),
            "switches_seen": [len(r2t), len(t2r)], "train_tok_s": median(train, 2000.0),
            "shared_train_tok_s": median(together, 0.0), "shared_steps": len(together),
            "publish_s": median(update, 0.5), "weight_sync_s": median(publish, 0.1)}


# --- 4. simulated -----------------------------------------------------------------------------------
def simulated(trace: list, cost: Any, spec: Any, engines: int) -> dict[str, Any]:
    from services.scheduler.policy import Mode
    from services.scheduler.sim.simulator import simulate

    out = {}
    for mode in MODES:
        params = dataclasses.replace(spec.policy_params(), mode=Mode(mode),
                                     staleness_bound=0 if mode == "colocate" else max(spec.staleness_bound, 1),
                                     async_rollout_cells=engines if mode == "async" else None)
        out[mode] = simulate(trace, cost, params)
    return out


def write(out: Path, *, rates: dict, costs: dict, cost: Any, trace_stats: Any, live_rows: dict, sim_rows: dict,
          free_rows: dict, engines: int, wall_s: float) -> None:
    keep = ""
    if out.exists() and "\n## Causes" in out.read_text():
        keep = out.read_text()[out.read_text().index("\n## Causes"):]

    def order(rows: dict) -> str:
        return " < ".join(sorted(MODES, key=lambda m: rows[m]["makespan_s"]))

    el = {name: rows["elastic"]["makespan_s"] for name, rows in (("live", live_rows), ("shared", sim_rows),
                                                                   ("free", free_rows))}
    lines = ["# Live against the simulator", "",
             f"`python -m bench.bench_live_vs_sim` ({wall_s / 60:.0f} min): {trace_stats.executions} executions in "
             f"{trace_stats.steps} steps ({trace_stats.mean_tokens_per_execution:,.0f} tokens and "
             f"{trace_stats.mean_turns:.1f} turns each on average, tail share {trace_stats.tail_share:.2f}, tool "
             f"share {trace_stats.env_share:.2f}). {engines} engines and the trainer core ({engines + 1} cells) run on "
             "this machine's 2 cores.",
             "- Live: `gyre replay --trace` in each mode, each on its own stack.",
             "- Simulated: the same trace, the same policy knobs and async split, on the cost model below, twice:",
             "  - with the training of all cells capped at what they trained together live (the cells share 2 "
             "cores);",
             "  - as the simulator assumes by default, each cell its own hardware.",
             "- Makespan: from the job's submission to its last update's publication.", "",
             "| mode | live s | simulated, shared cores s | live / simulated | simulated, separate cells s "
             "| live / elastic | shared / elastic | separate / elastic | live switches | simulated switches |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for m in MODES:
        lv, sm, fr = live_rows[m], sim_rows[m], free_rows[m]
        lines.append(f"| {m} | {lv['makespan_s']:.0f} | {sm['makespan_s']:.0f} | {lv['makespan_s'] / sm['makespan_s']:.2f} "
                     f"| {fr['makespan_s']:.0f} | {lv['makespan_s'] / el['live']:.2f} | {sm['makespan_s'] / el['shared']:.2f} "
                     f"| {fr['makespan_s'] / el['free']:.2f} | {lv['switches']} | {sm['switches']} |")
    lines += ["", "Order of the modes, fastest first:",
              f"- live: {order(live_rows)};",
              f"- simulated, shared cores: {order(sim_rows)};",
              f"- simulated, separate cells: {order(free_rows)}.", "",
              "Simulated utilization (busy cell-seconds / cells x makespan): "
              + ", ".join(f"{m} {sim_rows[m]['utilization']:.2f}" for m in MODES) + " with shared cores; "
              + ", ".join(f"{m} {free_rows[m]['utilization']:.2f}" for m in MODES) + " with separate cells. "
              "Live, every cell holds a role all the time (share of cell-seconds in ROLLOUT or TRAIN: "
              + ", ".join(f"{m} {live_rows[m]['utilization']:.2f}" for m in MODES) + "), which says nothing of how "
              "busy its share of the cores was.", "",
              "## The cost model the simulator ran on", "",
              "| parameter | value | from |", "| --- | ---: | --- |",
              f"| prefill_tok_s | {cost.prefill_tok_s:,.0f} | the engine alone, one thread, a 2,048-token prompt |",
              f"| decode_tok_s | {cost.decode_tok_s:,.0f} | the engine alone, one call |",
              f"| batch_slowdown_at_full | {cost.batch_slowdown_at_full:.2f} | 8 calls decode {rates['decode_slowdown_at_8']:.2f}x "
              f"slower each than one (slots {SLOTS}) |",
              f"| train_tok_s | {cost.train_tok_s:,.0f} | live steps' `train_tokens_per_s`, the core's own (median) |",
              f"| max_train_tok_s | {cost.max_train_tok_s:,.0f} | the better of the core alone and the live steps "
              f"that several cells trained ({costs['shared_train_tok_s']:,.0f} tokens/s together: the step's tokens / "
              f"the core's compute time, median of {costs['shared_steps']}); 0 in the separate-cells run |",
              f"| publish_s | {cost.publish_s:.2f} | live steps: step time - train time (median) |",
              f"| weight_sync_s | {cost.weight_sync_s:.2f} | live steps' `publish_s` (median) |",
              f"| rollout_to_train_s | {cost.rollout_to_train_s:.2f} | live switches (median of {costs['switches_seen'][0]}) |",
              f"| train_to_rollout_s | {cost.train_to_rollout_s:.2f} | live switches (median of {costs['switches_seen'][1]}) |",
              f"| kv_capacity_tokens / execution_kv_tokens | {cost.kv_capacity_tokens:,} / {cost.execution_kv_tokens:,} "
              f"| {SLOTS} executions per cell: KV never binds live at this size |", "",
              "The live figures and the trace are kept beside this file (`live_vs_sim.json`, "
              "`live_vs_sim-trace.jsonl`): `python -m bench.bench_live_vs_sim --simulate-only` runs the "
              "simulations again on them."]
    text = "\n".join(lines) + "\n" + keep
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text if text.endswith("\n") else text + "\n")


def simulate_and_write(out: Path, trace: list, saved: dict, engines: int, wall_s: float) -> None:
    from services.scheduler.jobs import JobSpec
    from services.scheduler.sim.cost_model import CostModel
    from services.task.traces import trace_stats

    rates, costs = saved["rates"], saved["costs"]
    max_ctx = max(int(e.prompt_tokens.sum() + e.gen_tokens.sum()) for e in trace)
    base = dict(num_cells=engines + 1, kv_capacity_tokens=SLOTS * max_ctx, execution_kv_tokens=max_ctx,
                prefill_tok_s=rates["prefill_tok_s"], decode_tok_s=rates["decode_tok_s"],
                batch_slowdown_at_full=rates["batch_slowdown_at_full"], train_tok_s=costs["train_tok_s"],
                rollout_to_train_s=costs["rollout_to_train_s"], train_to_rollout_s=costs["train_to_rollout_s"],
                idle_to_rollout_s=0.0, idle_to_train_s=0.0, publish_s=costs["publish_s"],
                weight_sync_s=costs["weight_sync_s"])
    # several cells on these 2 cores trained together no faster than the core alone did (fewer tokens/s,
    # in fact: more processes than cores); the cap is the better of the two, so one cell is not slowed
    cap = max(costs["shared_train_tok_s"], costs["train_tok_s"]) if costs["shared_train_tok_s"] > 0 else 0.0
    shared = CostModel(**base, max_train_tok_s=cap)  # type: ignore[arg-type]
    free = CostModel(**base)  # type: ignore[arg-type]
    spec = JobSpec.from_dict(saved["spec"])

    def rows(cost: Any) -> dict:
        return {m: {"makespan_s": r.makespan_s, "utilization": r.utilization, "switches": r.switches}
                for m, r in simulated(trace, cost, spec, engines).items()}

    sim_rows, free_rows = rows(shared), rows(free)
    print(json.dumps({"live": saved["live"], "simulated": sim_rows, "separate": free_rows}), flush=True)
    write(out, rates=rates, costs=costs, cost=shared, trace_stats=trace_stats(trace, shared), live_rows=saved["live"],
          sim_rows=sim_rows, free_rows=free_rows, engines=engines, wall_s=wall_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--executions", type=int, default=16, help="executions per step")
    ap.add_argument("--engines", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--simulate-only", action="store_true",
                    help="no live runs: simulate again on the live figures and trace kept beside --out")
    args = ap.parse_args()
    from services.task.traces import load_trace, save_trace
    from services.task.model import ensure_builtin_model

    out = Path(args.out)
    saved_json, saved_trace = out.with_suffix(".json"), out.with_name(out.stem + "-trace.jsonl")
    if args.simulate_only:
        saved = json.loads(saved_json.read_text())
        simulate_and_write(out, load_trace(str(saved_trace)), saved, saved["engines"], saved["wall_s"])
        return
    t0 = time.time()
    rates = engine_rates(ensure_builtin_model(ROOT / ".gyre" / "models"))
    print(json.dumps({"rates": rates}), flush=True)
    with tempfile.TemporaryDirectory(prefix="gyre-live-vs-sim-") as tmp:
        work = Path(tmp)
        trace_path = work / "trace.jsonl"
        trace = make_trace(trace_path, rates, steps=args.steps, executions=args.executions, seed=args.seed)
        results, spec = {}, None
        for mode in MODES:
            results[mode], spec = live(trace_path, mode, args.engines, work)
            r = results[mode]
            print(json.dumps({"live": mode, "wall_s": round(r.wall_s, 1), "makespan_s": round(makespan(r), 1),
                              "switches": len(r.switches), "steps": len(r.steps)}), flush=True)
    assert spec is not None
    live_rows = {m: {"makespan_s": makespan(r), "utilization": live_utilization(r, args.engines + 1),
                     "switches": len(r.switches)} for m, r in results.items()}
    saved = {"rates": rates, "costs": measured_costs(results), "live": live_rows, "engines": args.engines,
             "wall_s": time.time() - t0, "spec": spec.to_dict(),
             "steps": {m: r.steps for m, r in results.items()}, "switches": {m: r.switches for m, r in results.items()}}
    out.parent.mkdir(parents=True, exist_ok=True)
    saved_json.write_text(json.dumps(saved, indent=1, default=float) + "\n")
    save_trace(trace, str(saved_trace))
    simulate_and_write(out, trace, saved, args.engines, saved["wall_s"])


if __name__ == "__main__":
    main()
