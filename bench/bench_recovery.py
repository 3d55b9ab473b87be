"""Recovery from a crash, per process: SIGKILL -> serving again -> the job's next completed execution.

Run: ``.venv/bin/python -m bench.bench_recovery`` (several minutes); writes ``bench/results/recovery.md``.

It runs `gyre up` (own redis-server with AOF, every service and cell a process, built-in harness
workers, the supervisor) in a temporary data dir, submits one long elastic job with `gyre submit`
and follows it with `gyre watch --json` (which reconnects through scheduler and Redis restarts),
as a user would. Then, one process at a time, while executions of the job are in flight: SIGKILL,
and measure

* **serving again**: until the supervisor's restarted process answers gRPC health SERVING on its
  address (Redis: PING; the harness worker, which serves nothing: its new process is up);
* **next execution**: until the watcher receives the job's next ``execution_completed`` event.
  Baseline in the same run: the median gap between consecutive completions before any kill.

At the end the job is cancelled and its event log checked: executions completed twice (must be
0), steps published twice or out of order (must be 0), and executions of every published step
that never ended (lost; must be 0).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "recovery.md"
PY = sys.executable
VICTIMS = ("engine-1", "cell-1", "gateway", "reward", "trajectory", "harness", "trainer", "scheduler", "redis")
GROUPS, GROUP_SIZE = 2, 2


def gyre(data: Path, *args: str) -> str:
    proc = subprocess.run([PY, "-m", "services.cli", "--data-dir", str(data), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"gyre {' '.join(args)}: {proc.stdout}\n{proc.stderr}")
    return proc.stdout


def state(data: Path) -> dict:
    return json.loads((data / "run" / "state.json").read_text())


class Watcher:
    """`gyre watch --json` of the job; every event with the monotonic time it arrived."""

    def __init__(self, data: Path, job_id: str) -> None:
        self.proc = subprocess.Popen([PY, "-m", "services.cli", "--data-dir", str(data), "watch", job_id, "--json"],
                                     cwd=ROOT, stdout=subprocess.PIPE, text=True)
        self.events: list[tuple[float, dict]] = []
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            ev = json.loads(line)
            with self.lock:
                self.events.append((time.monotonic(), ev))

    def completions_after(self, t: float) -> list[float]:
        with self.lock:
            return [ts for ts, e in self.events if ts > t and e["kind"] == "execution_completed"
                    and not e.get("evaluation")]


def running(data: Path, job_id: str) -> int:
    from services.scheduler.client import SchedulerClient

    try:
        with SchedulerClient(state(data)["services"]["scheduler"]["address"], timeout_s=5) as c:
            return c.get_job(job_id).running
    except Exception:  # deliberate: the scheduler or Redis is restarting
        return 0


def leased(data: Path, job_id: str) -> dict[str, int]:
    """Executions of the job's current and next step that are leased now: id -> attempt."""
    from services.scheduler.client import SchedulerClient
    from services.scheduler.jobs import ExecState
    from services.scheduler.state import execution_id

    out = {}
    with SchedulerClient(state(data)["services"]["scheduler"]["address"], timeout_s=5) as c:
        step = c.get_job(job_id).current_step
        for s in (step, step + 1):
            for g in range(GROUPS):
                for i in range(GROUP_SIZE):
                    try:
                        x = c.get_execution(execution_id(job_id, s, g, i))
                    except Exception:  # deliberate: not enqueued yet
                        continue
                    if x.state is ExecState.LEASED:
                        out[x.execution_id] = x.attempt
    return out


def released_again(data: Path, held: dict[str, int], deadline: float) -> float:
    """Block until every execution of ``held`` was leased again (or ended); the monotonic time."""
    from services.scheduler.client import SchedulerClient
    from services.scheduler.jobs import ExecState

    with SchedulerClient(state(data)["services"]["scheduler"]["address"], timeout_s=5) as c:
        while time.monotonic() < deadline:
            recs = [c.get_execution(e) for e in held]
            if all(r.attempt > held[r.execution_id] or r.state not in (ExecState.LEASED, ExecState.QUEUED)
                   for r in recs):
                return time.monotonic()
            time.sleep(0.02)
    raise TimeoutError("the killed harness's executions were not leased again")


def serving_again(data: Path, victim: str, old_pid: int, deadline: float) -> float:
    """Block until the restarted ``victim`` serves; returns the monotonic time it did."""
    import redis

    from services.common.server import wait_for_ready

    while time.monotonic() < deadline:
        st = state(data)
        if victim == "redis":
            info = st["redis"]
            if int(info["pid"]) != old_pid:
                try:
                    redis.Redis.from_url(info["url"], socket_connect_timeout=0.2).ping()
                    return time.monotonic()
                except redis.exceptions.ConnectionError:
                    pass
        else:
            svc = st["services"][victim]
            if int(svc["pid"]) != old_pid and _alive(int(svc["pid"])):
                if not svc.get("address"):
                    return time.monotonic()
                try:
                    wait_for_ready(svc["address"], timeout_s=0.5)
                    return time.monotonic()
                except TimeoutError:
                    pass
        time.sleep(0.02)
    raise TimeoutError(f"{victim} did not serve again")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def main() -> None:
    data = Path(tempfile.mkdtemp(prefix="gyre-bench-recovery-"))
    rows: list[dict[str, float | str]] = []
    held_by_harness: dict[str, int] = {}
    held_by_harness_s = float("nan")
    gyre(data, "up", "--engines", "2", "--harness-concurrency", "4")
    try:
        job_id = gyre(data, "submit", str(ROOT / "deploy" / "config" / "job.toml"), "--num_steps", "200",
                      "--groups_per_step", str(GROUPS), "--group_size", str(GROUP_SIZE), "--execution_timeout_s",
                      "300", "--tasks.params.num_modules", "3", "--evaluation.tasks", "0").strip().splitlines()[-1]
        watch = Watcher(data, job_id)
        while len(watch.completions_after(0.0)) < 12:  # a baseline of steady completions
            time.sleep(0.1)
        ts = watch.completions_after(0.0)
        baseline = statistics.median(b - a for a, b in zip(ts, ts[1:]))
        for victim in VICTIMS:
            while running(data, job_id) == 0:  # kill while executions are in flight
                time.sleep(0.02)
            st = state(data)
            pid = int(st["redis"]["pid"] if victim == "redis" else st["services"][victim]["pid"])
            held = leased(data, job_id) if victim == "harness" else {}
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            t_serve = serving_again(data, victim, pid, t0 + 300)
            if held:  # what the killed harness held runs again (its successor gives the leases up)
                held_s = released_again(data, held, t0 + 300) - t0
                held_by_harness, held_by_harness_s = held, held_s
                print(f"harness: its {len(held)} executions leased again after {held_s:.2f} s", flush=True)
            while not watch.completions_after(t0):
                assert time.monotonic() < t0 + 300, f"no execution completed after killing {victim}"
                time.sleep(0.02)
            t_next = watch.completions_after(t0)[0]
            rows.append({"victim": victim, "serving_s": t_serve - t0, "next_s": t_next - t0})
            print(f"{victim}: serving again {t_serve - t0:.2f} s, next execution {t_next - t0:.2f} s", flush=True)
        status = json.loads(gyre(data, "status", "--json"))
        gyre(data, "cancel", job_id, "--reason", "benchmark over")
        deadline = time.monotonic() + 120
        while watch.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        watch.proc.kill()
        watch.thread.join(10)
    finally:
        subprocess.run([PY, "-m", "services.cli", "--data-dir", str(data), "down"], cwd=ROOT, capture_output=True,
                       timeout=300)
    events = [e for _, e in watch.events]
    completed = [e["execution_id"] for e in events if e["kind"] == "execution_completed" and not e.get("evaluation")]
    trained = [int(e["step"]) for e in events if e["kind"] == "step_trained"]
    per_step: dict[int, set[str]] = {}
    for e in events:
        if e["kind"] == "execution_completed" and not e.get("evaluation"):
            per_step.setdefault(int(e["step"]), set()).add(e["execution_id"])
    lost = sum(GROUPS * GROUP_SIZE - len(per_step.get(s, set())) for s in trained)
    twice = len(completed) - len(set(completed))
    steps_bad = int(trained != list(range(len(trained))))
    restarts = {n: s.get("restarts", 0) for n, s in status["services"].items()}
    lines = [
        "# Recovery from a SIGKILL, per process", "",
        f"Measured {time.strftime('%Y-%m-%d')} by `bench/bench_recovery.py` on a `gyre up` stack (builtin-tiny, "
        "2 engine cells + the trainer core, every service a process, supervisor on), 2 shared CPU cores, one "
        f"elastic job of {GROUPS * GROUP_SIZE} executions a step; each process killed once while executions ran.",
        "",
        f"Baseline in the same run: median gap between consecutive completed executions before any kill "
        f"**{baseline:.2f} s**.", "",
        "| process killed | serving again (s) | next completed execution (s) | next execution / baseline gap |",
        "|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['victim']} | {float(r['serving_s']):.2f} | {float(r['next_s']):.2f} | "
                     f"{float(r['next_s']) / max(baseline, 1e-6):.1f}x |")
    lines += [
        "", f"Over the whole job ({len(trained)} steps published, {len(completed)} executions completed): "
        f"executions completed twice **{twice}**, executions of published steps lost **{lost}**, steps "
        f"published twice or out of order **{steps_bad}**. Restarts the supervisor made: "
        + ", ".join(f"{n} {c}" for n, c in sorted(restarts.items()) if c) + ".", "",
        "\"Serving again\" is the supervisor's restart (backoff starts at 0.5 s) plus the process's start-up "
        "(imports, the model for engines, Redis/spool recovery); the next completed execution also waits for "
        "what the process's peers retry (harness calls, reward retries, the trainer's resume from its last "
        "checkpoint and step journal). A next execution sooner than serving again means work went on "
        "meanwhile (e.g. the other engine served); one much later than serving again means the job waited for "
        "the restarted process to act (e.g. a scheduler killed while the pool trained has to lead again and "
        "switch cells back to rollout before the next call is served).", "",
        f"The killed harness held {len(held_by_harness)} leased executions; all were leased again "
        f"**{held_by_harness_s:.2f} s** after the kill (its restarted process, under the same worker id, gave "
        "up its predecessor's leases at start; before that they waited out the 60 s lease TTL).", "",
    ]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
