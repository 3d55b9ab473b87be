"""HTTP endpoint benchmark: concurrent streaming sessions over HTTP vs the gRPC TITO path, and the
cost of parsing tool calls.

Run: ``.venv/bin/python -m bench.bench_http`` (a few minutes on 2 CPU cores); writes
``bench/results/http.md``. Two engines (``gyre-engine --model builtin-tiny``) and the gateway
(OpenAI/Anthropic HTTP endpoint on) run as their own processes; this process is only the client.
Baseline in the same run: the same load as gRPC ``Gateway.GenerateStream`` calls.

1. Load: N concurrent sessions (N = 100, 500), each one streamed chat call (a short chat, greedy,
   ``max_tokens=4``), all in flight at once: HTTP with one client thread per session reading the
   SSE stream vs gRPC streams. Calls/s and p50/p99 latency; "added" = HTTP - gRPC at the same N.
2. Tool-call parsing: ``HermesFormat.parse`` / ``Llama3JsonFormat.parse`` on a typical reply
   (text + two calls), microseconds per call (median of 5 x 2,000).
"""

from __future__ import annotations

import http.client
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.bench_gateway import _spawn

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "http.md"
LOADS = (100, 500)
NEW_TOKENS = 4


def _at_once(sessions: int, one: Any, start: threading.Event, lat: np.ndarray, ok: np.ndarray) -> dict[str, float]:
    """Run ``one(i)`` for every session in its own thread, all released at once by ``start``."""
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(sessions)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    start.set()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return {"calls_s": sessions / wall, "p50_ms": float(np.percentile(lat, 50) * 1e3),
            "p99_ms": float(np.percentile(lat, 99) * 1e3), "ok": int(ok.sum())}


def _http_load(port: int, sessions: int) -> dict[str, float]:
    lat = np.zeros(sessions)
    ok = np.zeros(sessions, dtype=bool)
    start = threading.Event()

    def one(i: int) -> None:
        body = json.dumps({"model": "gyre", "stream": True, "max_tokens": NEW_TOKENS, "temperature": 0,
                           "messages": [{"role": "user", "content": f"module m{i % 7} tests 1 -> 2"}]})
        start.wait()
        t0 = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        conn.request("POST", "/v1/chat/completions", body=body, headers={
            "Content-Type": "application/json", "x-gyre-execution-id": f"http-{sessions}-{i}"})
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        lat[i] = time.perf_counter() - t0
        ok[i] = resp.status == 200 and data.rstrip().endswith(b"[DONE]")

    return _at_once(sessions, one, start, lat, ok)


def _grpc_load(stub: Any, tokenizer: Any, sessions: int) -> dict[str, float]:
    from protos.gyre.v1 import common_pb2, rollout_pb2

    lat = np.zeros(sessions)
    ok = np.zeros(sessions, dtype=bool)
    start = threading.Event()

    def one(i: int) -> None:
        text = tokenizer.apply_chat_template([{"role": "user", "content": f"module m{i % 7} tests 1 -> 2"}],
                                             tokenize=False, add_generation_prompt=True)
        req = rollout_pb2.GenerateRequest(
            context=common_pb2.CallContext(execution_id=f"grpc-{sessions}-{i}", call_id="c", agent_id="main"),
            prompt_ids=tokenizer(text, add_special_tokens=False)["input_ids"],
            sampling=common_pb2.SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS))
        start.wait()
        t0 = time.perf_counter()
        n = 0
        for chunk in stub.GenerateStream(req, timeout=600):
            n += len(chunk.token_ids)
        lat[i] = time.perf_counter() - t0
        ok[i] = n > 0

    return _at_once(sessions, one, start, lat, ok)


def _parse_cost() -> dict[str, float]:
    from services.rollout.tools import HermesFormat, Llama3JsonFormat

    reply = {"hermes": 'Let me run the tests first.\n<tool_call>\n{"name": "run_tests", "arguments": {"module": "m1"}}'
                       '\n</tool_call>\n<tool_call>\n{"name": "write_module", "arguments": {"module": "m2", '
                       '"code": "sub 2 -"}}\n</tool_call>',
             "llama3_json": '<|python_tag|>{"name": "run_tests", "parameters": {"module": "m1"}}; '
                            '{"name": "write_module", "parameters": {"module": "m2", "code": "sub 2 -"}}'}
    out = {}
    for name, fmt in (("hermes", HermesFormat()), ("llama3_json", Llama3JsonFormat())):
        assert len(fmt.parse(reply[name])[1]) == 2
        runs = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(2000):
                fmt.parse(reply[name])
            runs.append((time.perf_counter() - t0) / 2000 * 1e6)
        out[name] = statistics.median(runs)
    return out


def main() -> None:
    import grpc
    from transformers import AutoTokenizer

    from protos.gyre.v1 import rollout_pb2_grpc
    from services.models.source import resolve_model

    tmp = Path(tempfile.mkdtemp(prefix="bench-http-"))
    procs = []
    try:
        ports = []
        for cell in ("cell-1", "cell-2"):
            proc, port = _spawn(["services.rollout.engine_main", "--cell-id", cell, "--model", "builtin-tiny",
                                 "--device", "cpu", "--torch-threads", "1", "--max-batch-size", "128"], cell, tmp)
            procs.append(proc)
            ports.append(port)
        proc, gport = _spawn(["services.rollout.gateway_main", "--engine-addresses",
                              ",".join(f"127.0.0.1:{p}" for p in ports), "--tokenizer-path", "builtin-tiny",
                              "--http-port", "0"], "gateway", tmp)
        procs.append(proc)
        info = json.loads((tmp / "gateway.port").read_text())
        hport = int(info["http"].rsplit(":", 1)[1].split("/")[0])
        stub = rollout_pb2_grpc.GatewayStub(grpc.insecure_channel(f"127.0.0.1:{gport}"))
        tokenizer = AutoTokenizer.from_pretrained(str(resolve_model("builtin-tiny")))
        _http_load(hport, 10)  # warm-up
        _grpc_load(stub, tokenizer, 10)
        loads = []
        for n in LOADS:
            g = _grpc_load(stub, tokenizer, n)
            h = _http_load(hport, n)
            loads.append((n, g, h))
            print(f"{n} sessions: gRPC {g['calls_s']:.0f} calls/s p99 {g['p99_ms']:.0f} ms; "
                  f"HTTP {h['calls_s']:.0f} calls/s p99 {h['p99_ms']:.0f} ms", flush=True)
        parse = _parse_cost()
        write(loads, parse)
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except Exception:  # deliberate: a stuck process is killed
                p.kill()


def write(loads: list[tuple[int, dict, dict]], parse: dict[str, float]) -> None:
    lines = [
        "# HTTP endpoint: streaming sessions vs gRPC, tool-call parsing", "",
        f"Measured {time.strftime('%Y-%m-%d')} by `bench/bench_http.py` on 2 shared CPU cores: two `gyre-engine` "
        "processes (builtin-tiny, 1 torch thread each) and one `gyre-gateway` process with its HTTP endpoint; the "
        "client is this process (one thread per session). Each session is one streamed chat call, greedy, "
        f"max_tokens={NEW_TOKENS}, all sessions in flight at once. Baseline: the same load as gRPC GenerateStream "
        "calls in the same run.", "",
        "| sessions | gRPC calls/s | HTTP calls/s | HTTP / gRPC | gRPC p50 / p99 (ms) | HTTP p50 / p99 (ms) | "
        "added p50 / p99 (ms) | HTTP ok |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, g, h in loads:
        lines.append(f"| {n} | {g['calls_s']:.0f} | {h['calls_s']:.0f} | {h['calls_s'] / g['calls_s']:.2f}x | "
                     f"{g['p50_ms']:.0f} / {g['p99_ms']:.0f} | {h['p50_ms']:.0f} / {h['p99_ms']:.0f} | "
                     f"{h['p50_ms'] - g['p50_ms']:+.0f} / {h['p99_ms'] - g['p99_ms']:+.0f} | {h['ok']}/{n} |")
    lines += ["", "Tool-call parsing of a reply with text and two calls (median of 5 x 2,000):", "",
              "| format | µs per reply |", "|---|---:|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in parse.items()]
    lines += ["", "HTTP renders the chat template and tokenizes in the gateway (the gRPC client sends ids), "
              "and streams SSE from a thread per connection; both paths share routing, engines and TITO "
              "recording.", ""]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
