"""Prefix KV reuse benchmark: one agent execution grows to 64K tokens through the gateway.

Run: ``.venv/bin/python -m bench.bench_prefix_cache`` (about 5-8 minutes on 2 CPU cores); writes
``bench/results/prefix_cache.md``. Everything runs as deployed: two engines on the built-in model
(``gyre-engine --model builtin-tiny``), one with prefix reuse (the default) and one with
``--prefix-cache-mb 0`` (every call prefilled whole: the baseline, measured in the same run), each
behind its own gateway with the OpenAI-compatible HTTP endpoint; this process is only the client.

1. The execution: ``CALLS`` calls through ``/v1/completions`` with token-id prompts and the
   ``x-gyre-execution-id`` header; each call's prompt is the previous prompt + its output + a
   tool result of ``TOOL_TOKENS`` new tokens, up to ~64K tokens (a harness's loop, as TITO sees it).
   Its latency at ~8K / 32K / 64K of context vs the same prompt sent to the full-prefill engine.
2. The issue's figure: a call appending 1K tokens to a 32K context (a prefix of the execution's)
   vs a full prefill of those 33K tokens.
3. Over the whole execution: prefilled / unique tokens (1.0 is the limit: every token computed
   once), from the engine's own Prometheus counters; reused / prompt tokens.
4. Memory: the engine's RSS before and after, against the KV bytes the cache holds (bytes per
   cached token), and its resident tokens.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "prefix_cache.md"
CALLS = 250  # upper bound: the execution stops once the next call would pass 64K tokens
FIRST_TOKENS = 1_000
TOOL_TOKENS = 300
OUTPUT_TOKENS = 16
CHECKPOINTS = (8_192, 32_768, 65_536)
VOCAB_HI = 120  # the built-in tokenizer's ids are all below this


def _spawn(args: list[str], name: str, tmp: Path) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    port_file = tmp / f"{name}.port"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with open(tmp / f"{name}.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", *args, "--port-file", str(port_file), "--log-level",
                                 "WARNING"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not start: {(tmp / f'{name}.log').read_text()[-2000:]}")
        time.sleep(0.2)
    return proc, json.loads(port_file.read_text())


class Client:
    """A gateway's OpenAI endpoint; a connection per call (an idle one would be closed between probes)."""

    def __init__(self, base_url: str) -> None:
        self.host, _, rest = base_url.removeprefix("http://").partition("/")
        self.path = "/" + rest + "/completions"

    def complete(self, prompt: np.ndarray, execution: str) -> tuple[list[int], float]:
        body = json.dumps({"prompt": prompt.tolist(), "max_tokens": OUTPUT_TOKENS,
                           "temperature": 0.0, "return_token_ids": True}).encode()
        conn = http.client.HTTPConnection(self.host, timeout=600)
        t0 = time.perf_counter()
        conn.request("POST", self.path, body, {"content-type": "application/json",
                                                "x-gyre-execution-id": execution, "x-gyre-agent-id": "main"})
        resp = conn.getresponse()
        data = json.loads(resp.read())
        seconds = time.perf_counter() - t0
        conn.close()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {data}")
        return [int(t) for t in data["gyre"]["output_ids"]], seconds


def _metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("gyre_rollout_engine_") and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="bench-prefix-"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        infos = {}
        for cell, extra in (("reuse", []), ("full", ["--prefix-cache-mb", "0"])):
            proc, info = _spawn(["services.rollout.engine_main", "--cell-id", cell, "--model", "builtin-tiny",
                                 "--device", "cpu", "--torch-threads", "1", "--metrics-port", "0", *extra], cell, tmp)
            procs.append(proc)
            infos[cell] = (proc, info)
        gateways = {}
        for cell, (_, info) in infos.items():
            proc, ginfo = _spawn(["services.rollout.gateway_main", "--engine-addresses", f"127.0.0.1:{info['port']}",
                                  "--http-port", "0", "--http-host", "127.0.0.1", "--tokenizer-path", "builtin-tiny",
                                  "--http-max-body-mb", "16"], f"gw-{cell}", tmp)
            procs.append(proc)
            gateways[cell] = Client(ginfo["http"])
        reuse, full = gateways["reuse"], gateways["full"]
        engine_pid, metrics_port = infos["reuse"][0].pid, int(infos["reuse"][1]["metrics_port"])
        reuse.complete(np.arange(1, 64) % VOCAB_HI, "warmup"), full.complete(np.arange(1, 64) % VOCAB_HI, "warmup")
        base_metrics, rss_before = _metrics(metrics_port), _rss_mib(engine_pid)

        rng = np.random.default_rng(0)
        context = rng.integers(1, VOCAB_HI, FIRST_TOKENS).astype(np.int32)
        calls: list[tuple[int, float]] = []
        probes: list[tuple[int, float, float]] = []
        pending = list(CHECKPOINTS)
        unique = 0
        for i in range(CALLS):
            out, seconds = reuse.complete(context, "exec-64k")
            calls.append((len(context), seconds))
            unique = len(context) + len(out)
            if pending and len(context) + len(out) + TOOL_TOKENS >= min(pending[0], 65_536 - OUTPUT_TOKENS - 1):
                pending.pop(0)
                _, full_s = full.complete(context, f"full-{i}")
                probes.append((len(context), seconds, full_s))
                print(f"context {len(context):>6}: reuse {seconds * 1e3:8.1f} ms, full prefill {full_s * 1e3:8.1f} ms")
            if len(context) + len(out) + TOOL_TOKENS + OUTPUT_TOKENS >= 65_536:
                break
            context = np.concatenate([context, np.asarray(out, np.int32),
                                      rng.integers(1, VOCAB_HI, TOOL_TOKENS).astype(np.int32)])
        after = _metrics(metrics_port)
        rss_after = _rss_mib(engine_pid)

        def delta(name: str) -> float:
            return after.get(name, 0.0) - base_metrics.get(name, 0.0)

        prefilled = delta("gyre_rollout_engine_prefill_tokens_total")
        reused = delta("gyre_rollout_engine_prefix_reused_tokens_total")
        prompt = delta("gyre_rollout_engine_prompt_tokens_total")
        cached = after.get("gyre_rollout_engine_prefix_cached_tokens", 0.0)

        # the figure: 1K new tokens on a 32K prefix of the execution (a sibling branching there)
        branch = np.concatenate([context[:32_768], rng.integers(1, VOCAB_HI, 1_024).astype(np.int32)])
        _, branch_reuse = reuse.complete(branch, "branch-33k")
        _, branch_full = full.complete(branch, "branch-33k-full")
        print(f"1K appended to 32K: reuse {branch_reuse * 1e3:.1f} ms, full {branch_full * 1e3:.1f} ms")
        write(calls=calls, probes=probes, branch=(len(branch), branch_reuse, branch_full), unique=unique,
              prefilled=prefilled, reused=reused, prompt=prompt, cached=cached, rss=(rss_before, rss_after))
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def write(*, calls: list[tuple[int, float]], probes: list[tuple[int, float, float]], branch: tuple[int, float, float],
          unique: int, prefilled: float, reused: float, prompt: float, cached: float,
          rss: tuple[float, float]) -> None:
    from services.task.model import BuiltinModelSpec

    spec = BuiltinModelSpec()
    kv_bytes = 2 * spec.layers * spec.kv_heads * (spec.hidden // spec.heads) * 4
    lat = np.array([s for _, s in calls])
    lines = [
        "# Prefix KV reuse (bench/bench_prefix_cache.py)",
        "",
        f"Built-in model (builtin-tiny: {spec.layers} layers, hidden {spec.hidden}, {spec.max_positions} positions), "
        "CPU, 1 torch thread per engine, as deployed: engine and gateway processes, the OpenAI endpoint with "
        "token-id prompts. Baseline in the same run: the same prompts on an engine with `--prefix-cache-mb 0` "
        "(every call prefilled whole).",
        "",
        f"## One execution, {len(calls)} calls growing to {calls[-1][0]:,} tokens",
        "",
        f"Each call = the previous prompt + its {OUTPUT_TOKENS} output tokens + a {TOOL_TOKENS}-token tool result.",
        "",
        "| context (tokens) | with reuse (ms) | full prefill (ms) | speedup |",
        "| --- | --- | --- | --- |",
    ]
    for n, r, f in probes:
        lines.append(f"| {n:,} | {r * 1e3:.1f} | {f * 1e3:.1f} | {f / r:.1f}x |")
    n, r, f = branch
    lines += [
        "",
        f"A call that appends 1,024 tokens to a 32,768-token prefix ({n:,} tokens): **{r * 1e3:.1f} ms** with reuse vs "
        f"{f * 1e3:.1f} ms for a full prefill: **{f / r:.1f}x** (target >= 10x).",
        "",
        f"Call latency over the execution with reuse: median {np.median(lat) * 1e3:.1f} ms, p90 "
        f"{np.quantile(lat, 0.9) * 1e3:.1f} ms, first {lat[0] * 1e3:.1f} ms, last {lat[-1] * 1e3:.1f} ms.",
        "",
        "## Tokens computed",
        "",
        "| unique tokens | prompt tokens sent | prefilled | reused | prefilled / unique | reused / prompt |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| {unique:,} | {prompt:,.0f} | {prefilled:,.0f} | {reused:,.0f} | **{prefilled / unique:.3f}** | "
        f"{reused / prompt:.3f} |",
        "",
        "Prefilled / unique counts every context token the engine computed in prefill (generated tokens are "
        "decoded, not prefilled, so the limit is just under 1.0); target <= 1.2 between weight updates.",
        "",
        "## Memory",
        "",
        f"KV per cached token: {kv_bytes} bytes (2 x {spec.layers} layers x {spec.kv_heads} KV heads x "
        f"{spec.hidden // spec.heads} dims x fp32). Resident in the cache after the run: {cached:,.0f} tokens = "
        f"{cached * kv_bytes / 2**20:.1f} MiB (each call's entry superseded the previous one). Engine RSS "
        f"{rss[0]:.0f} MiB before, {rss[1]:.0f} MiB after (+{rss[1] - rss[0]:.0f} MiB).",
        "",
        "## In `make run`",
        "",
        "The reuse rate of `make run`'s own job (many short executions of a few calls each) is measured by "
        "bench/bench_make_run.py in bench/results/make_run.md (93% of prompt tokens came from the engines' "
        "prefix caches on 2026-12-04); `gyre run` prints it, `gyre watch` shows it live, the report has it.",
        "",
    ]
    RESULTS.write_text("\n".join(lines))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
