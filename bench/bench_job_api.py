"""The scheduler's job API on a real `gyre up` stack: submit-to-first-lease, job controller cost
per step, and WatchJob throughput with 16 watchers.

Run: ``.venv/bin/python -m bench.bench_job_api`` (a few minutes); writes ``bench/results/job_api.md``.
It brings up the same stack as ``gyre up`` (own redis-server, every service and cell as a
process, built-in harness workers) in a temporary data dir and talks to it only through the
scheduler's gRPC API, as a client would (plus Redis directly to write synthetic events for 3).

1. Submit -> first lease: SubmitJob of a job run by an external harness (so the built-in workers
   leave it alone), then LeaseExecution(job_id, long-poll) until it hands out the first
   execution; split by the job's events into admission, preparation (reward ConfigureJob +
   trainer StartJob + the initial weights pushed to the engines) and enqueueing. Baseline in the
   same run: leasing a second execution of the already enqueued step.
2. Job controller per step: a small built-in job (3 steps, evaluations after every step) runs to
   completion; the scheduler's ``gyre_scheduler_controller_seconds`` histogram gives the time of
   its passes; reported per published step, against the job's wall time per step.
3. WatchJob: 20,000 events in one job's log; one watcher reading them all (the baseline), then 16
   at once; then 16 following watchers while a writer appends 5,000 more (delivered events/s and
   the lag from append to delivery).

The host is small and shared (2 cores for everything), so absolute figures are a floor.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "job_api.md"
JOB_FILE = ROOT / "deploy" / "config" / "job.toml"


def scrape(port: int, name: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith(name):
                out[s.name] = s.value
    return out


def wait_trainer_free(trainer: object, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if trainer.status().phase in ("idle", "done", "stopped", "failed"):  # type: ignore[attr-defined]
            return
        time.sleep(0.2)
    raise TimeoutError("the trainer did not stop the cancelled job")


def submit_to_lease(scheduler: object, trainer: object, rounds: int = 3) -> list[dict[str, float]]:
    from services.scheduler.jobfile import load_job

    rows = []
    for i in range(rounds):
        spec = load_job(JOB_FILE, ["--num_steps", "1", "--groups_per_step", "1", "--group_size", "2",
                                   "--evaluation.tasks", "0", "--harness", "external"], job_id=f"lat{i}-{int(time.time())}")
        t0 = time.time()
        scheduler.submit_job(spec)  # type: ignore[attr-defined]
        lease = scheduler.lease("bench", job_id=spec.job_id, wait_s=60.0)  # type: ignore[attr-defined]
        t1 = time.time()
        assert lease is not None, "no lease within 60 s"
        second = scheduler.lease("bench", job_id=spec.job_id, wait_s=10.0)  # type: ignore[attr-defined]
        t2 = time.time()
        assert second is not None
        ev = {e.kind + (":" + e.attrs.get("state", "") if e.kind == "job_state" else ""): e.ts_s
              for e in scheduler.watch(spec.job_id, follow=False)}  # type: ignore[attr-defined]
        rows.append({"total_s": t1 - t0, "admit_s": ev["job_state:running"] - ev["job_submitted"],
                     "prepare_s": ev["job_prepared"] - ev["job_state:running"],
                     "enqueue_s": ev["step_started"] - ev["job_prepared"], "lease_queued_s": t2 - t1})
        scheduler.cancel_job(spec.job_id, "benchmark round done")  # type: ignore[attr-defined]
        wait_trainer_free(trainer)
    return rows


def controller_per_step(scheduler: object, metrics_port: int) -> dict[str, float]:
    from services.jobwatch import JobView, follow
    from services.scheduler.jobfile import load_job

    steps = 3
    spec = load_job(JOB_FILE, ["--num_steps", str(steps), "--groups_per_step", "2", "--group_size", "2",
                               "--tasks.params.num_modules", "2", "--evaluation.tasks", "2",
                               "--evaluation.every", "1"], job_id=f"ctl-{int(time.time())}")
    before = scrape(metrics_port, "gyre_scheduler_controller_seconds")
    t0 = time.time()
    scheduler.submit_job(spec)  # type: ignore[attr-defined]
    view = JobView(spec.job_id)
    for _ in follow(scheduler, view):
        pass
    wall = time.time() - t0
    after = scrape(metrics_port, "gyre_scheduler_controller_seconds")
    total = after["gyre_scheduler_controller_seconds_sum"] - before.get("gyre_scheduler_controller_seconds_sum", 0)
    passes = after["gyre_scheduler_controller_seconds_count"] - before.get("gyre_scheduler_controller_seconds_count", 0)
    assert view.state == "completed", view.state
    return {"steps": steps, "state": view.state, "wall_s": wall, "controller_s": total, "passes": passes,
            "per_step_s": total / steps, "per_pass_ms": 1000 * total / max(passes, 1),
            "share": total / wall, "evaluations": len(view.evals)}


def watch_throughput(scheduler: object, redis_url: str) -> dict[str, float]:
    from services.common.redis_store import connect
    from services.scheduler.jobfile import load_job
    from services.scheduler.state import SchedulerState

    spec = load_job(JOB_FILE, ["--num_steps", "1", "--evaluation.tasks", "0", "--harness", "external"],
                    job_id=f"watch-{int(time.time())}")
    scheduler.submit_job(spec)  # type: ignore[attr-defined]
    scheduler.cancel_job(spec.job_id, "only its event log is used")  # type: ignore[attr-defined]
    state = SchedulerState(connect(redis_url))
    n = 20_000
    pipe = state.r.pipeline(transaction=False)
    for i in range(n):
        pipe.xadd(state.keys.events(spec.job_id), {"kind": "metrics", "ts_ms": state.now_ms(), "i": i})
    pipe.execute()
    total = sum(1 for _ in scheduler.watch(spec.job_id, follow=False))  # type: ignore[attr-defined]

    def read_all(out: list[float]) -> None:
        from services.scheduler.client import SchedulerClient

        with SchedulerClient(scheduler.address) as c:  # type: ignore[attr-defined]
            t = time.perf_counter()
            got = sum(1 for _ in c.watch(spec.job_id, follow=False))
            out.append(got / (time.perf_counter() - t))

    one: list[float] = []
    read_all(one)
    many: list[float] = []
    threads = [threading.Thread(target=read_all, args=(many,)) for _ in range(16)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    agg_wall = time.perf_counter() - t
    live = live_follow(scheduler, state, redis_url)
    return {"events": total, "one_watcher_eps": one[0], "sixteen_each_eps": statistics.median(many),
            "sixteen_aggregate_eps": 16 * total / agg_wall, **live}


def live_follow(scheduler: object, state: object, redis_url: str) -> dict[str, float]:
    """16 watchers follow a running job's log while 5,000 events are appended."""
    from services.scheduler.client import SchedulerClient
    from services.scheduler.jobfile import load_job

    spec = load_job(JOB_FILE, ["--num_steps", "1", "--evaluation.tasks", "0", "--harness", "external"],
                    job_id=f"live-{int(time.time())}")
    scheduler.submit_job(spec)  # type: ignore[attr-defined]
    n = 5000
    lags: list[float] = []
    counts: list[int] = []
    ready = threading.Barrier(17)
    lock = threading.Lock()

    def follower() -> None:
        seen = 0
        mine: list[float] = []
        with SchedulerClient(scheduler.address) as c:  # type: ignore[attr-defined]
            ready.wait()
            for ev in c.watch(spec.job_id, follow=True, timeout_s=120):
                if ev.kind == "bench":
                    seen += 1
                    mine.append(time.time() - ev.ts_s)
                    if seen == n:
                        break
        with lock:
            lags.extend(mine)
            counts.append(seen)

    threads = [threading.Thread(target=follower) for _ in range(16)]
    for th in threads:
        th.start()
    ready.wait()
    t = time.perf_counter()
    for i in range(n):
        state.append_event(spec.job_id, "bench", {"i": i})  # type: ignore[attr-defined]
    write_s = time.perf_counter() - t
    for th in threads:
        th.join()
    wall = time.perf_counter() - t
    scheduler.cancel_job(spec.job_id, "benchmark done")  # type: ignore[attr-defined]
    lags.sort()
    return {"live_events": n, "live_delivered": sum(counts), "live_write_eps": n / write_s,
            "live_delivered_eps": sum(counts) / wall, "live_lag_p50_ms": 1000 * lags[len(lags) // 2],
            "live_lag_p99_ms": 1000 * lags[int(len(lags) * 0.99)]}


def main() -> None:
    from services.launcher import Launcher
    from services.run import DEFAULT_RUN_CONFIG, RunConfig, bring_up
    from services.scheduler.client import SchedulerClient
    from services.trainer.client import TrainerClient

    data = Path(tempfile.mkdtemp(prefix="gyre-bench-jobapi-"))
    launcher = Launcher(data, DEFAULT_RUN_CONFIG)
    try:
        up, _model, _env = bring_up(launcher, RunConfig(engines=2, harness_concurrency=8), "builtin-tiny",
                                    echo=lambda _m: None)
        redis_url = json.loads((data / "run" / "state.json").read_text())["redis"]["url"]
        scheduler = SchedulerClient(up["scheduler"].address)
        trainer = TrainerClient(up["trainer"].address)
        lat = submit_to_lease(scheduler, trainer)
        ctl = controller_per_step(scheduler, int(up["scheduler"].metrics_port))
        watch = watch_throughput(scheduler, redis_url)
    finally:
        launcher.down(echo=lambda _m: None)
    med = {k: statistics.median(r[k] for r in lat) for k in lat[0]}
    rounds = ", ".join(f"{r['total_s']:.2f}" for r in lat)
    lines = [
        "# Job API (scheduler owns the job)", "",
        f"Measured {time.strftime('%Y-%m-%d')} by `bench/bench_job_api.py` on a `gyre up` stack (builtin-tiny, "
        "2 engine cells + the trainer core, every service a process), 2 shared CPU cores.", "",
        "## Submit -> first lease (median of 3)", "",
        "| phase | seconds |", "|---|---:|",
        f"| admission (run queue -> running) | {med['admit_s']:.3f} |",
        f"| preparation (reward configured, trainer started, initial weights pushed) | {med['prepare_s']:.3f} |",
        f"| step opened in trajectory + enqueued | {med['enqueue_s']:.3f} |",
        f"| **submit -> first lease** | **{med['total_s']:.3f}** |",
        f"| baseline: lease of an already enqueued execution | {med['lease_queued_s']:.3f} |", "",
        f"Submit-to-first-lease is {med['total_s'] / max(med['lease_queued_s'], 1e-6):.0f}x a plain lease; "
        f"rounds: {rounds} s.", "",
        "## Job controller per step", "",
        "| steps | job wall s | controller passes | controller s | per step s | per pass ms | share of wall |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        f"| {ctl['steps']} | {ctl['wall_s']:.1f} | {ctl['passes']:.0f} | {ctl['controller_s']:.3f} | "
        f"{ctl['per_step_s']:.3f} | {ctl['per_pass_ms']:.2f} | {100 * ctl['share']:.1f}% |", "",
        f"(3 steps of 4 executions, {ctl['evaluations']} evaluation rounds of 2 held-out tasks; the passes include "
        "the trainer start, each step's evaluation and the completion.)", "",
        "## WatchJob", "",
        f"{watch['events']:.0f} events in one job's log, read to the end (follow=false):", "",
        "| watchers | events/s per watcher | events/s in all |", "|---:|---:|---:|",
        f"| 1 (baseline) | {watch['one_watcher_eps']:.0f} | {watch['one_watcher_eps']:.0f} |",
        f"| 16 | {watch['sixteen_each_eps']:.0f} | {watch['sixteen_aggregate_eps']:.0f} |", "",
        f"16 watchers in all deliver {watch['sixteen_aggregate_eps'] / watch['one_watcher_eps']:.2f}x one watcher's "
        "rate.", "",
        f"Live: 16 following watchers while {watch['live_events']:.0f} events are appended "
        f"({watch['live_write_eps']:.0f} appends/s): {watch['live_delivered']:.0f} deliveries "
        f"({watch['live_delivered_eps']:.0f}/s), lag append -> delivery p50 {watch['live_lag_p50_ms']:.0f} ms, "
        f"p99 {watch['live_lag_p99_ms']:.0f} ms.", "",
    ]
    RESULTS.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
