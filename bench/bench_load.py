"""Load benchmark: many concurrent harness sessions through the whole stack, and the scheduler API
under many concurrent clients.

Run: ``.venv/bin/python -m bench.bench_load`` (about 2 minutes on 2 CPU cores); writes
``bench/results/load.md``. Everything runs as deployed, each service its own process: a
redis-server (AOF, fsync every second), the scheduler, the trajectory service, two
``gyre-engine --model random-tiny`` cells and two gateways -- one forwarding TITO records to
trajectory (as deployed), one not (a baseline). This process is only the harnesses, written with
``grpc.aio`` so 500 sessions are 500 coroutines, not 500 threads.

1. Harness sessions. Each session is what the built-in harness does, minus the agent's thinking:
   LeaseExecution -> 3 model calls through the gateway (each prompt extends the previous call's
   prompt + output, max_new_tokens=4) with a Heartbeat -> CompleteExecution. All sessions start
   at once. Reported: sessions/s, calls/s, call and lease p50/p99, session p99, and the TITO
   records that reached trajectory (every call must have one: 0 lost). Baselines from the same
   run: 50 sessions (the same stack, 10x less concurrency) and 500 sessions through the gateway
   that records nothing.
2. Scheduler API. C concurrent clients loop Lease -> Heartbeat -> Complete on a job with enough
   queued executions, for a fixed time; C = 1 is the baseline for the latency inflation.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "load.md"
TURNS = 3
NEW_TOKENS = 4
PROMPT_LEN = 32
SESSION_RUNS = (("stack", 500), ("stack", 50), ("no-tito", 500))  # (gateway, sessions)
API_CLIENTS = (1, 32, 256)
GROUP_SIZE = 2  # divides every session count above
API_SECONDS = float(os.environ.get("GYRE_BENCH_LOAD_API_S", "4"))


def _spawn(args: list[str], name: str, tmp: Path) -> tuple[subprocess.Popen[bytes], int]:
    port_file = tmp / f"{name}.port"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with open(tmp / f"{name}.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", *args, "--port-file", str(port_file), "--log-level",
                                 "WARNING", "--grace-s", "2"], cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not start: {(tmp / f'{name}.log').read_text()[-2000:]}")
        time.sleep(0.1)
    return proc, int(json.loads(port_file.read_text())["port"])


def _redis(tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    import redis

    from services.common.server import free_port

    port = free_port()
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
                             "127.0.0.1", "--dir", str(tmp), "--appendonly", "yes", "--appendfsync", "everysec",
                             "--save", "", "--loglevel", "warning"], stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(100):
        try:
            redis.Redis.from_url(url).ping()
            return proc, url
        except redis.exceptions.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def _cancel(scheduler: str, job_id: str) -> None:
    """End a measured job so the next one is admitted (jobs on the same cells run one at a time)."""
    from services.scheduler.client import SchedulerClient

    with SchedulerClient(scheduler) as client:
        client.cancel_job(job_id, "benchmark run done")


def _submit(scheduler: str, job_id: str, executions: int) -> None:
    assert executions % GROUP_SIZE == 0
    from services.scheduler.client import SchedulerClient
    from services.scheduler.jobs import JobSpec, Mode, TaskSource

    spec = JobSpec(job_id=job_id, model="random-tiny", tasks=TaskSource(payloads=(b"task",)), num_steps=1,
                   groups_per_step=executions // GROUP_SIZE, group_size=GROUP_SIZE, mode=Mode.COLOCATE, execution_timeout_s=3600.0)
    with SchedulerClient(scheduler) as client:
        client.submit_job(spec)
        deadline = time.monotonic() + 60
        while client.get_job(job_id).queued < executions:  # admitted by the orchestrator's next tick
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {job_id} was not admitted within 60 s")
            time.sleep(0.05)


# -- 1. harness sessions ------------------------------------------------------------------------
async def _session(i: int, job_id: str, worker: Any, gateway: Any, out: dict[str, list[float]]) -> int:
    from protos.gyre.v1 import common_pb2, rollout_pb2
    from protos.gyre.v1 import scheduler_pb2 as spb

    start = time.perf_counter()
    t0 = time.perf_counter()
    res = await worker.LeaseExecution(spb.LeaseExecutionRequest(harness_id=f"h{i}", job_id=job_id, wait_s=30),
                                      timeout=120)
    out["lease"].append(time.perf_counter() - t0)
    assert res.leased, "the job has one execution per session"
    lease = res.lease
    rng = np.random.default_rng(i)
    prompt = rng.integers(1, 500, PROMPT_LEN).tolist()
    tokens = 0
    for turn in range(TURNS):
        req = rollout_pb2.GenerateRequest(
            context=common_pb2.CallContext(job_id=job_id, execution_id=lease.execution_id, call_id=f"c{turn}",
                                           agent_id="main", role=common_pb2.ROLE_MAIN),
            prompt_ids=prompt, sampling=common_pb2.SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS))
        t0 = time.perf_counter()
        r = await gateway.Generate(req, timeout=600)
        out["call"].append(time.perf_counter() - t0)
        tokens += len(r.output_ids)
        prompt = prompt + list(r.output_ids) + rng.integers(1, 500, 8).tolist()
        if turn == 0:
            await worker.Heartbeat(spb.HeartbeatRequest(execution_id=lease.execution_id,
                                                        lease_token=lease.lease_token), timeout=60)
    t0 = time.perf_counter()
    await worker.CompleteExecution(spb.CompleteLeaseRequest(
        execution_id=lease.execution_id, lease_token=lease.lease_token,
        status=common_pb2.EXECUTION_STATUS_FINISHED), timeout=60)
    out["complete"].append(time.perf_counter() - t0)
    out["session"].append(time.perf_counter() - start)
    return tokens


async def _sessions(scheduler: str, gateway: str, job_id: str, n: int) -> dict[str, Any]:
    import grpc

    from protos.gyre.v1 import rollout_pb2_grpc, scheduler_pb2_grpc

    out: dict[str, list[float]] = {"lease": [], "call": [], "complete": [], "session": []}
    async with grpc.aio.insecure_channel(scheduler) as sch, grpc.aio.insecure_channel(gateway) as gch:
        worker = scheduler_pb2_grpc.HarnessesStub(sch)
        gw = rollout_pb2_grpc.GatewayStub(gch)
        start = time.perf_counter()
        tokens = await asyncio.gather(*(_session(i, job_id, worker, gw, out) for i in range(n)))
        wall = time.perf_counter() - start
    return {"sessions": n, "wall_s": wall, "tokens": int(sum(tokens)), **{k: np.array(v) for k, v in out.items()}}


def _recorded(trajectory: str, job_id: str, n: int) -> int:
    """TITO records of the job that reached trajectory (waits up to 30 s for the forwarder)."""
    from services.common.errors import NotFound
    from services.trajectory.client import TrajectoryClient

    ids = [f"{job_id}.s0.g{i // GROUP_SIZE}.e{i % GROUP_SIZE}" for i in range(n)]
    deadline = time.monotonic() + 30
    with TrajectoryClient(trajectory) as client:
        while True:
            total = 0
            for eid in ids:
                try:
                    total += client.execution_stats(eid, job_id=job_id).num_calls
                except NotFound:
                    pass
            if total >= n * TURNS or time.monotonic() > deadline:
                return total
            time.sleep(0.5)


# -- 2. scheduler API ---------------------------------------------------------------------------
async def _api_client(worker: Any, job_id: str, stop_at: float, lat: dict[str, list[float]]) -> int:
    from protos.gyre.v1 import common_pb2
    from protos.gyre.v1 import scheduler_pb2 as spb

    cycles = 0
    while time.perf_counter() < stop_at:
        t0 = time.perf_counter()
        res = await worker.LeaseExecution(spb.LeaseExecutionRequest(harness_id="api", job_id=job_id, wait_s=0),
                                          timeout=60)
        t1 = time.perf_counter()
        if not res.leased:
            break
        lz = res.lease
        await worker.Heartbeat(spb.HeartbeatRequest(execution_id=lz.execution_id, lease_token=lz.lease_token),
                               timeout=60)
        t2 = time.perf_counter()
        await worker.CompleteExecution(spb.CompleteLeaseRequest(
            execution_id=lz.execution_id, lease_token=lz.lease_token, status=common_pb2.EXECUTION_STATUS_FINISHED),
            timeout=60)
        t3 = time.perf_counter()
        lat["lease"].append(t1 - t0)
        lat["heartbeat"].append(t2 - t1)
        lat["complete"].append(t3 - t2)
        cycles += 1
    return cycles


async def _api(scheduler: str, job_id: str, clients: int) -> dict[str, Any]:
    import grpc

    from protos.gyre.v1 import scheduler_pb2_grpc

    lat: dict[str, list[float]] = {"lease": [], "heartbeat": [], "complete": []}
    async with grpc.aio.insecure_channel(scheduler) as ch:
        worker = scheduler_pb2_grpc.HarnessesStub(ch)
        start = time.perf_counter()
        cycles = await asyncio.gather(*(_api_client(worker, job_id, start + API_SECONDS, lat) for _ in range(clients)))
        wall = time.perf_counter() - start
    return {"clients": clients, "cycles_s": sum(cycles) / wall, **{k: np.array(v) for k, v in lat.items()}}


def _ms(a: np.ndarray, q: float) -> float:
    return float(np.percentile(a, q) * 1e3) if len(a) else float("nan")


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench-load-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        rproc, redis_url = _redis(tmp)
        procs.append(rproc)
        base = ["--redis-url", redis_url, "--spool-dir", str(tmp / "spool")]
        # The orchestration loop admits jobs; no cells are registered, so it never switches roles.
        p, sched_port = _spawn(["services.scheduler.main", *base, "--actuator", "daemon", "--tick-interval-s", "0.1"],
                               "scheduler", tmp)
        procs.append(p)
        p, traj_port = _spawn(["services.trajectory.main", *base], "trajectory", tmp)
        procs.append(p)
        engines = []
        for cell in ("cell-1", "cell-2"):
            p, port = _spawn(["services.rollout.engine_main", "--cell-id", cell, "--model", "random-tiny",
                              "--device", "cpu", "--torch-threads", "1", "--max-batch-size", "128"], cell, tmp)
            procs.append(p)
            engines.append(f"{cell}=127.0.0.1:{port}")
        scheduler, trajectory = f"127.0.0.1:{sched_port}", f"127.0.0.1:{traj_port}"
        gateways = {}
        for label, extra in (("stack", ["--trajectory-address", trajectory]), ("no-tito", [])):
            p, port = _spawn(["services.rollout.gateway_main", "--engine-addresses", ",".join(engines), *extra],
                             f"gateway-{label}", tmp)
            procs.append(p)
            gateways[label] = f"127.0.0.1:{port}"

        for k, label in enumerate(gateways):  # warm-up (engines' first batches, channels), not reported
            _submit(scheduler, f"warm-{k}", 20)
            asyncio.run(_sessions(scheduler, gateways[label], f"warm-{k}", 20))
            _cancel(scheduler, f"warm-{k}")
        runs = []
        for k, (label, n) in enumerate(SESSION_RUNS):
            job = f"load-{k}"
            _submit(scheduler, job, n)
            r = asyncio.run(_sessions(scheduler, gateways[label], job, n))
            r["label"] = label
            r["recorded"] = _recorded(trajectory, job, n) if label == "stack" else None
            _cancel(scheduler, job)
            runs.append(r)
            print(f"{label} {n} sessions: {n / r['wall_s']:.1f} sessions/s, {n * TURNS / r['wall_s']:.0f} calls/s, "
                  f"call p99 {_ms(r['call'], 99):.0f} ms, records {r['recorded']}")
        api = []
        for k, c in enumerate(API_CLIENTS):
            job = f"api-{k}"
            _submit(scheduler, job, 6000)
            a = asyncio.run(_api(scheduler, job, c))
            _cancel(scheduler, job)
            api.append(a)
            print(f"api {c} clients: {a['cycles_s']:.0f} cycles/s, lease p99 {_ms(a['lease'], 99):.1f} ms")
        write(runs, api)
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


def write(runs: list[dict[str, Any]], api: list[dict[str, Any]]) -> None:
    load = os.getloadavg()[0]
    lines = [
        "# Load: harness sessions through the stack, scheduler API under concurrent clients",
        "",
        f"`python -m bench.bench_load` on {os.cpu_count()} CPU cores, every service its own process (redis-server "
        "with AOF, scheduler, trajectory, two random-init tiny engines with 1 torch thread each, gateways); "
        f"the harnesses are `grpc.aio` coroutines in one client process. Load average at the end: {load:.1f} "
        "(other work included), so absolute numbers are a floor; ratios come from the same run.",
        "",
        f"## Harness sessions (lease, {TURNS} calls of max_new_tokens={NEW_TOKENS} with growing prompts, "
        "heartbeat, complete; all sessions at once)",
        "",
        "| gateway | sessions | sessions/s | calls/s | tokens/s | call p50 / p99 ms | lease p99 ms | "
        "complete p99 ms | session p99 s | TITO records at trajectory |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        n = r["sessions"]
        rec = f"{r['recorded']} / {n * TURNS}" if r["recorded"] is not None else "not recorded"
        lines.append(f"| {'records TITO' if r['label'] == 'stack' else 'no TITO (baseline)'} | {n} | "
                     f"{n / r['wall_s']:.1f} | {n * TURNS / r['wall_s']:.0f} | {r['tokens'] / r['wall_s']:.0f} | "
                     f"{_ms(r['call'], 50):.0f} / {_ms(r['call'], 99):.0f} | {_ms(r['lease'], 99):.0f} | "
                     f"{_ms(r['complete'], 99):.0f} | {float(np.percentile(r['session'], 99)):.1f} | {rec} |")
    big, small, bare = runs
    lines += [
        "",
        f"- 10x the sessions ({small['sessions']} -> {big['sessions']}): calls/s x"
        f"{(big['sessions'] / big['wall_s']) / (small['sessions'] / small['wall_s']):.2f}, call p99 x"
        f"{_ms(big['call'], 99) / _ms(small['call'], 99):.2f}.",
        f"- Recording TITO (gateway -> trajectory, delta-encoded, asynchronous): calls/s "
        f"{(big['sessions'] / big['wall_s']) / (bare['sessions'] / bare['wall_s']):.2f}x of the gateway that "
        f"records nothing, call p99 x{_ms(big['call'], 99) / _ms(bare['call'], 99):.2f}.",
        "",
        f"## Scheduler API: clients looping Lease -> Heartbeat -> Complete for {API_SECONDS:.0f} s",
        "",
        "| clients | cycles/s | vs 1 client | lease p50 / p99 ms | heartbeat p50 / p99 ms | complete p50 / p99 ms |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    one = api[0]["cycles_s"]
    for a in api:
        lines.append(f"| {a['clients']} | {a['cycles_s']:.0f} | x{a['cycles_s'] / one:.2f} | "
                     f"{_ms(a['lease'], 50):.1f} / {_ms(a['lease'], 99):.1f} | "
                     f"{_ms(a['heartbeat'], 50):.1f} / {_ms(a['heartbeat'], 99):.1f} | "
                     f"{_ms(a['complete'], 50):.1f} / {_ms(a['complete'], 99):.1f} |")
    top = api[-1]
    lines += ["", f"At {top['clients']} clients: x{top['cycles_s'] / one:.2f} the single-client throughput, lease p99 "
              f"x{_ms(top['lease'], 99) / _ms(api[0]['lease'], 99):.1f} the single-client p99. The scheduler serves "
              "RPCs from a thread pool in one Python process; bench_scheduler_api.py has the direct-Redis baseline."]
    text = "\n".join(lines) + "\n"
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
