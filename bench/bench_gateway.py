"""Rollout gateway benchmark: per-call overhead and many concurrent sessions.

Run: ``.venv/bin/python -m bench.bench_gateway`` (about 1-2 minutes on 2 CPU cores); writes
``bench/results/gateway.md``. Two engines (``gyre-engine --model random-tiny``) and the gateway
run as their own processes, as deployed; this process is only the client. Baselines are measured
in the same run:

1. Overhead per call: the same unary TITO call sent sequentially to an engine directly and through
   the gateway (routing + stream re-framing + TITO record + prompt cache). Median and p99 latency
   at 1 and 16 new tokens; the overhead is gateway - direct.
2. Load: N concurrent sessions (N = 100, 300, 500), each one call with a 64-token prompt and
   ``max_new_tokens=4``, all in flight at once (gRPC futures, no client threads). Calls/s, tokens/s,
   p50/p99 latency through the gateway (two engines) vs the same load sent straight to one engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "gateway.md"
PROMPT_LEN = 64
OVERHEAD_CALLS = 100
LOADS = (100, 300, 500)
LOAD_NEW_TOKENS = 4


def _spawn(args: list[str], name: str, tmp: Path) -> tuple[subprocess.Popen[bytes], int]:
    port_file = tmp / f"{name}.port"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with open(tmp / f"{name}.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", *args, "--port-file", str(port_file), "--log-level",
                                 "WARNING"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not start: {(tmp / f'{name}.log').read_text()[-2000:]}")
        time.sleep(0.1)
    return proc, int(json.loads(port_file.read_text())["port"])


def _request(i: int, new_tokens: int, execution: str) -> Any:
    from protos.gyre.v1 import common_pb2, rollout_pb2

    prompt = np.random.default_rng(i).integers(0, 512, PROMPT_LEN).tolist()
    return rollout_pb2.GenerateRequest(
        context=common_pb2.CallContext(execution_id=execution, call_id=f"c{i}", agent_id="main"),
        prompt_ids=prompt, sampling=common_pb2.SamplingParams(temperature=0.0, max_new_tokens=new_tokens))


def _sequential(stub: Any, new_tokens: int, label: str) -> np.ndarray:
    lat = []
    for i in range(OVERHEAD_CALLS + 5):
        req = _request(i, new_tokens, f"{label}-{i}")
        if label == "direct":
            req.request_id = f"seq-{new_tokens}-{i}"
        t0 = time.perf_counter()
        stub.Generate(req, timeout=60)
        if i >= 5:  # warm-up
            lat.append(time.perf_counter() - t0)
    return np.array(lat)


def _load(stub: Any, sessions: int, label: str) -> dict[str, float]:
    lat = np.zeros(sessions)
    tokens = np.zeros(sessions, dtype=np.int64)
    done = threading.Semaphore(0)
    start = time.perf_counter()

    def finish(i: int, t0: float) -> Any:
        def cb(fut: Any) -> None:
            lat[i] = time.perf_counter() - t0
            tokens[i] = len(fut.result().output_ids)
            done.release()
        return cb

    for i in range(sessions):
        req = _request(i, LOAD_NEW_TOKENS, f"load-{label}-{sessions}-{i}")
        if label == "direct":
            req.request_id = f"load-{sessions}-{i}-{time.monotonic_ns()}"
        t0 = time.perf_counter()
        stub.Generate.future(req, timeout=300).add_done_callback(finish(i, t0))
    for _ in range(sessions):
        done.acquire()
    wall = time.perf_counter() - start
    return {"calls_s": sessions / wall, "tokens_s": float(tokens.sum()) / wall,
            "p50_ms": float(np.percentile(lat, 50) * 1e3), "p99_ms": float(np.percentile(lat, 99) * 1e3),
            "wall_s": wall}


def main() -> None:
    import grpc

    from protos.gyre.v1 import rollout_pb2_grpc

    tmp = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        ports = []
        for cell in ("cell-1", "cell-2"):
            proc, port = _spawn(["services.rollout.engine_main", "--cell-id", cell, "--model", "random-tiny",
                                 "--device", "cpu", "--torch-threads", "1", "--max-batch-size", "128"], cell, tmp)
            procs.append(proc)
            ports.append(port)
        proc, gport = _spawn(["services.rollout.gateway_main", "--engine-addresses",
                              ",".join(f"127.0.0.1:{p}" for p in ports)], "gateway", tmp)
        procs.append(proc)
        options = [("grpc.max_receive_message_length", 64 << 20)]
        direct = rollout_pb2_grpc.EngineStub(grpc.insecure_channel(f"127.0.0.1:{ports[0]}", options=options))
        gateway = rollout_pb2_grpc.GatewayStub(grpc.insecure_channel(f"127.0.0.1:{gport}", options=options))

        overhead = []
        for new in (1, 16):
            d = _sequential(direct, new, "direct")
            g = _sequential(gateway, new, "gateway")
            overhead.append((new, d, g))
            print(f"overhead new={new}: direct p50 {np.median(d) * 1e3:.2f} ms, gateway {np.median(g) * 1e3:.2f} ms")
        loads = []
        for n in LOADS:
            dl = _load(direct, n, "direct")
            gl = _load(gateway, n, "gateway")
            loads.append((n, dl, gl))
            print(f"load {n}: direct {dl['calls_s']:.0f} calls/s p99 {dl['p99_ms']:.0f} ms; "
                  f"gateway {gl['calls_s']:.0f} calls/s p99 {gl['p99_ms']:.0f} ms")
        write(overhead, loads)
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def write(overhead: list[tuple[int, np.ndarray, np.ndarray]], loads: list[tuple[int, dict, dict]]) -> None:
    lines = [
        "# Rollout gateway",
        "",
        f"Measured by `bench/bench_gateway.py` on {os.cpu_count()} CPU cores: two `gyre-engine` processes "
        "(random-init tiny Qwen3, 1 torch thread each) and one `gyre-gateway` process; the client is a "
        "separate process. Prompts of 64 tokens, greedy. Other jobs may share the machine, so absolute "
        "numbers are noisy; ratios are from the same run.",
        "",
        f"## Overhead per call ({OVERHEAD_CALLS} sequential unary calls)",
        "",
        "| new tokens | direct p50 (ms) | gateway p50 (ms) | overhead p50 (ms) | gateway / direct | "
        "direct p99 (ms) | gateway p99 (ms) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for new, d, g in overhead:
        dm, gm = np.median(d) * 1e3, np.median(g) * 1e3
        lines.append(f"| {new} | {dm:.2f} | {gm:.2f} | {gm - dm:+.2f} | {gm / dm:.2f}x | "
                     f"{np.percentile(d, 99) * 1e3:.2f} | {np.percentile(g, 99) * 1e3:.2f} |")
    lines += [
        "",
        f"## Concurrent sessions (one call each, max_new_tokens={LOAD_NEW_TOKENS}, all in flight at once)",
        "",
        "Direct = every call to engine 1; gateway = routed over engines 1 and 2.",
        "",
        "| sessions | direct calls/s | gateway calls/s | gateway / direct | gateway tokens/s | "
        "direct p50 / p99 (ms) | gateway p50 / p99 (ms) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, dl, gl in loads:
        lines.append(f"| {n} | {dl['calls_s']:.0f} | {gl['calls_s']:.0f} | {gl['calls_s'] / dl['calls_s']:.2f}x | "
                     f"{gl['tokens_s']:.0f} | {dl['p50_ms']:.0f} / {dl['p99_ms']:.0f} | "
                     f"{gl['p50_ms']:.0f} / {gl['p99_ms']:.0f} |")
    text = "\n".join(lines) + "\n"
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
