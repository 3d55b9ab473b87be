"""Reward benchmark: what sandboxing and the service round trip cost per scored execution.

Run: ``.venv/bin/python -m bench.bench_reward`` (about half a minute); writes
``bench/results/reward.md``. Baselines are measured in the same run:

1. Built-in scorer (all tests of a 4-module XLong workspace) called inline in this process (the
   baseline) vs through the worker pool (a warm worker process per scoring slot, one forked child
   per scoring, pickle in / JSON out, time limit armed), without a sandbox and in bubblewrap:
   scorings per second and the ratio; a cold worker's first scoring (sandbox set-up + imports).
2. The whole service path over real gRPC with a real redis-server: SubmitWorkspace (validate,
   zip, spool write, Redis ref) + Score (load, sandboxed scorer, policy, store), p50/p99 latency
   and executions per second with 1 and 4 concurrent harness threads.
3. Safety checks' own cost: validating a snapshot of 1000 files.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "reward.md"


def _workspaces(n: int) -> list[tuple[str, dict[str, bytes]]]:
    from services.task.spec import task_from_id, task_ids

    out = []
    for k, tid in enumerate(task_ids(n, split="heldout")):
        task = task_from_id(tid)
        files = {task.module_path(m.name): m.reference_code.encode() for m in task.modules[: 1 + k % 4]}
        out.append((tid, files))
    return out


def bench_scorers(n: int) -> list[tuple[str, float, str]]:
    from services.reward.sandbox import SandboxSpec, ScorerPool
    from services.reward.scorers import ScoreInput, ScorerSpec, run_local

    spec = ScorerSpec()
    items = [ScoreInput(job_id="b", execution_id=f"e{i}", task_id=t, status="finished", files=f)
             for i, (t, f) in enumerate(_workspaces(n))]
    run_local(spec, items[0])  # warm imports
    t0 = time.perf_counter()
    for inp in items:
        run_local(spec, inp)
    inline = n / (time.perf_counter() - t0)
    rows = [("built-in scorer inline (baseline)", inline, "scorings/s")]
    for sandbox in ("none", "bwrap"):
        pool = ScorerPool(size=2, sandbox=SandboxSpec(sandbox=sandbox))
        try:
            t0 = time.perf_counter()
            pool.score(spec, items[0], timeout_s=30)  # a cold worker: sandbox set up, imports done
            cold = time.perf_counter() - t0
            pool.score(spec, items[1], timeout_s=30)  # both workers started
            t0 = time.perf_counter()
            with ThreadPoolExecutor(2) as ex:
                list(ex.map(lambda i: pool.score(spec, i, timeout_s=30), items))
            rate = n / (time.perf_counter() - t0)
        finally:
            pool.close()
        what = "bubblewrap sandbox" if sandbox == "bwrap" else "no sandbox (limits only)"
        rows.append((f"built-in scorer, {what}, 2 warm workers", rate, f"scorings/s ({rate / inline:.2f}x baseline)"))
        rows.append((f"first scoring of a cold worker, {what}", cold * 1000, "ms"))
    return rows


def bench_service(n: int) -> list[tuple[str, float, str]]:
    from services.reward.client import RewardClient
    from services.reward.config import RewardConfig
    from services.reward.main import build_reward
    from tests.support.redis_server import RedisServer

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisServer(Path(tmp) / "redis").start()
        server, on_shutdown = build_reward(RewardConfig(redis_url=redis.url, spool_dir=f"{tmp}/spool", port=0,
                                                        scorer_workers=2, log_json=False))
        server.start()
        server.set_serving(True)
        client = RewardClient(server.address)
        work = _workspaces(n)
        try:
            for threads in (1, 4):
                lat: list[float] = []

                def one(i: int, threads: int = threads) -> None:
                    tid, files = work[i]
                    eid = f"t{threads}-e{i}"
                    t = time.perf_counter()
                    client.submit_workspace("bench", eid, files, task_id=tid)
                    client.score("bench", eid, "finished", group_id="g")
                    lat.append(time.perf_counter() - t)

                t0 = time.perf_counter()
                with ThreadPoolExecutor(threads) as ex:
                    list(ex.map(one, range(n)))
                rate = n / (time.perf_counter() - t0)
                q = statistics.quantiles(lat, n=100)
                rows.append((f"submit + score over gRPC, {threads} harness thread(s)", rate,
                             f"executions/s (p50 {q[49] * 1e3:.1f} ms, p99 {q[98] * 1e3:.1f} ms)"))
        finally:
            client.close()
            on_shutdown()
            server.stop(0)
            redis.stop()
    return rows


def bench_validation() -> list[tuple[str, float, str]]:
    from services.reward.workspace import WorkspaceLimits, pack, unpack, validate_files

    files = {f"src/pkg{i % 10}/mod{i}.gs": b"x 1 + 2 *" * 8 for i in range(1000)}
    limits = WorkspaceLimits()
    t0 = time.perf_counter()
    for _ in range(10):
        validate_files(files, limits)
    per = (time.perf_counter() - t0) / 10
    blob = pack(files)
    t0 = time.perf_counter()
    unpack(blob, limits)
    rt = time.perf_counter() - t0
    return [("validate a 1000-file snapshot", per * 1e3, "ms"),
            ("unpack + re-validate it from the spool archive", rt * 1e3, f"ms ({len(blob) / 1024:.0f} KiB zipped)")]


def main() -> None:
    from services.common.logging import setup_logging

    setup_logging(json=False, level="WARNING")
    rows = bench_scorers(300) + bench_service(120) + bench_validation()
    lines = ["# Reward service benchmark", "",
             "Built-in XLong scorer (4-module workspaces, all tests), sandboxed pool, real gRPC + Redis.", "",
             "| measurement | value | unit |", "|---|---:|---|"]
    lines += [f"| {name} | {value:.1f} | {unit} |" for name, value, unit in rows]
    text = "\n".join(lines) + "\n"
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
