"""HTTP endpoint benchmark: concurrent streaming sessions over HTTP vs the gRPC TITO path, and the
cost of parsing tool calls.

Run: ``.venv/bin/python -m bench.bench_http`` (a few minutes on 2 CPU cores); writes
``bench/results/http.md``. Two engines (``gyre-engine --model builtin-tiny``) and the gateway
(OpenAI/Anthropic HTTP endpoint on) run as their own processes; this process is only the client.
Baseline in the same run: the same load as gRPC ``Gateway.GenerateStream`` calls.

1. Load: N concurrent sessions (N = 100, 500), each one streamed chat call (a short chat, greedy,
   ``max_tokens=4``), all in flight at once: HTTP with one client thread per session reading the
   SSE stream vs gRPC streams. Calls/s and p50/p99 latency; "added" = HTTP - gRPC at the same N.
2. Servers: the gateway's two HTTP servers (``http_server = "threads"``, a thread per connection,
   and ``"async"``, the default) in the same run, each in its own gateway process on the same
   engines: 10,000 idle connections held at once (every 100th answers a request; none closed;
   a chat call beside them; the gateway's threads and RSS while holding them), 500 concurrent
   streamed chats (``max_tokens=32``: ok, calls/s, p50/p99, peak threads/RSS) and non-streaming
   chats at concurrency 64 over keep-alive connections (calls/s, p50/p99).
3. Tool-call parsing: ``HermesFormat.parse`` / ``Llama3JsonFormat.parse`` on a typical reply
   (text + two calls), microseconds per call (median of 5 x 2,000).
"""

from __future__ import annotations

import http.client
import json
import selectors
import socket
import statistics
import struct
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
SERVERS = ("threads", "async")
IDLE = 10_000  # idle connections held at once
STREAMS, STREAM_TOKENS = 500, 32  # concurrent streamed chats
CONCURRENCY, CALLS_EACH = 64, 10  # non-streaming chats: client threads x calls each


def _release(n: int, one: Any, start: threading.Event) -> float:
    """Run ``one(i)`` for ``i < n``, each in its own thread, all released at once by ``start``;
    returns the wall time until the last one ended."""
    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    t0 = time.perf_counter()
    start.set()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


def _rates(calls: int, wall: float, lat: Any) -> dict[str, float]:
    return {"calls_s": calls / wall, "p50_ms": float(np.percentile(lat, 50) * 1e3),
            "p99_ms": float(np.percentile(lat, 99) * 1e3)}


def _at_once(sessions: int, one: Any, start: threading.Event, lat: np.ndarray, ok: np.ndarray) -> dict[str, float]:
    """Run ``one(i)`` for every session in its own thread, all released at once by ``start``."""
    return {**_rates(sessions, _release(sessions, one, start), lat), "ok": int(ok.sum())}


def _http_load(port: int, sessions: int, new_tokens: int = NEW_TOKENS) -> dict[str, float]:
    lat = np.zeros(sessions)
    ok = np.zeros(sessions, dtype=bool)
    start = threading.Event()

    def one(i: int) -> None:
        body = json.dumps({"model": "gyre", "stream": True, "max_tokens": new_tokens, "temperature": 0,
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


def _proc(pid: int) -> tuple[int, float]:
    """(threads, RSS MiB) of a process."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["Threads"]), int(fields["VmRSS"].split()[0]) / 1024


class _Peak:
    """The most threads and RSS a process reaches while this is entered (sampled every 50 ms)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.threads, self.rss_mb = pid, 0, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:
            t, r = _proc(self.pid)
            self.threads, self.rss_mb = max(self.threads, t), max(self.rss_mb, r)
            if self._stop.wait(0.05):
                return

    def __enter__(self) -> "_Peak":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def _chat(conn: http.client.HTTPConnection, i: int) -> bool:
    body = json.dumps({"model": "gyre", "max_tokens": NEW_TOKENS, "temperature": 0,
                       "messages": [{"role": "user", "content": f"module m{i % 7} tests 1 -> 2"}]})
    conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status == 200 and b'"choices"' in resp.read()


def _idle_hold(port: int, pid: int) -> dict[str, float]:
    """Open IDLE connections and hold them; check each 100th is served and none was closed."""
    socks: list[socket.socket] = []
    t0 = time.perf_counter()
    try:
        for _ in range(IDLE):
            s = socket.create_connection(("127.0.0.1", port), timeout=60)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # no TIME_WAIT
            socks.append(s)
    except OSError as exc:
        print(f"  opened {len(socks)} connections, then: {exc}", flush=True)
    opened_s = time.perf_counter() - t0
    probes = socks[99::100]
    answered = 0
    for s in probes:  # a connection still in the listen backlog would not answer
        try:
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            answered += s.recv(65536).startswith(b"HTTP/1.1 200")
        except OSError:
            pass
    sel = selectors.DefaultSelector()
    probed = set(probes)
    quiet = [s for s in socks if s not in probed]
    for s in quiet:
        sel.register(s, selectors.EVENT_READ)
    closed = len(sel.select(timeout=0.5))  # a closed (or refused) connection turns readable
    sel.close()
    threads, rss = _proc(pid)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    t1 = time.perf_counter()
    call_ok = _chat(conn, 0)
    call_ms = (time.perf_counter() - t1) * 1e3
    conn.close()
    for s in socks:
        s.close()
    return {"held": len(quiet) - closed, "quiet": len(quiet), "answered": answered, "probes": len(probes),
            "opened_s": opened_s, "threads": threads, "rss_mb": rss, "call_ok": call_ok, "call_ms": call_ms}


def _calls(port: int) -> dict[str, float]:
    """CONCURRENCY client threads, each CALLS_EACH non-streaming chats over one keep-alive connection."""
    lat: list[float] = []
    ok: list[bool] = []
    start = threading.Event()

    def client(k: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        start.wait()
        for j in range(CALLS_EACH):
            t0 = time.perf_counter()
            good = _chat(conn, k * CALLS_EACH + j)
            lat.append(time.perf_counter() - t0)
            ok.append(good)
        conn.close()

    wall = _release(CONCURRENCY, client, start)
    return {**_rates(len(lat), wall, lat), "ok": sum(ok), "n": len(lat)}


def _settle(pid: int, threads: int, cap_s: float = 60.0) -> tuple[float, int]:
    """(seconds, threads left): until the process is back to about ``threads`` threads (its
    connections let go), at most ``cap_s``."""
    t0 = time.perf_counter()
    while (left := _proc(pid)[0]) > threads + 16 and time.perf_counter() - t0 < cap_s:
        time.sleep(0.1)
    return time.perf_counter() - t0, left


def _servers(gateways: dict[str, tuple[int, int]]) -> dict[str, dict[str, Any]]:
    """Each server under the three loads, one server at a time, each load starting from a server
    at rest; (http port, gateway pid) by server, both gateways fresh."""
    out: dict[str, dict[str, Any]] = {}
    for kind, (port, pid) in gateways.items():
        base_threads, base_rss = _proc(pid)
        _http_load(port, 10)  # warm-up
        calls = _calls(port)
        with _Peak(pid) as peak:
            streams = _http_load(port, STREAMS, STREAM_TOKENS)
        before = _proc(pid)  # (the async server's pool keeps the threads the streams grew)
        idle = _idle_hold(port, pid)  # last: a thread server takes long to let 10,000 threads go
        idle["added_threads"], idle["added_rss_mb"] = idle["threads"] - before[0], idle["rss_mb"] - before[1]
        idle["release_s"], idle["left"] = _settle(pid, before[0])
        out[kind] = {"base_threads": base_threads, "base_rss_mb": base_rss, "idle": idle, "streams": streams,
                     "stream_threads": peak.threads, "stream_rss_mb": peak.rss_mb, "calls": calls}
        print(f"{kind}: idle held {idle['held']}/{idle['quiet']} ({idle['threads']} threads, "
              f"{idle['rss_mb']:.0f} MiB); {STREAMS} streams {streams['ok']}/{STREAMS} {streams['calls_s']:.0f}/s "
              f"p99 {streams['p99_ms']:.0f} ms; calls {calls['calls_s']:.0f}/s p99 {calls['p99_ms']:.0f} ms", flush=True)
    return out


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

    from services.rollout.http_api import raise_open_files_limit

    raise_open_files_limit()  # IDLE client sockets here (the gateways inherit it, and raise their own)
    tmp = Path(tempfile.mkdtemp(prefix="bench-http-"))
    procs = []
    try:
        ports = []
        for cell in ("cell-1", "cell-2"):
            proc, port = _spawn(["services.rollout.engine_main", "--cell-id", cell, "--model", "builtin-tiny",
                                 "--device", "cpu", "--torch-threads", "1", "--max-batch-size", "128"], cell, tmp)
            procs.append(proc)
            ports.append(port)
        gateways: dict[str, tuple[int, int]] = {}
        gport = 0
        for kind in reversed(SERVERS):  # the default (async) gateway also serves the gRPC baseline
            proc, grpc_port = _spawn(["services.rollout.gateway_main", "--engine-addresses",
                                      ",".join(f"127.0.0.1:{p}" for p in ports), "--tokenizer-path", "builtin-tiny",
                                      "--http-port", "0", "--http-server", kind, "--http-max-connections",
                                      str(IDLE + 2000), "--http-idle-timeout-s", "600"], f"gateway-{kind}", tmp)
            procs.append(proc)
            info = json.loads((tmp / f"gateway-{kind}.port").read_text())
            gateways[kind] = (int(info["http"].rsplit(":", 1)[1].split("/")[0]), proc.pid)
            gport = gport or grpc_port
        servers = _servers({kind: gateways[kind] for kind in SERVERS})  # first: on fresh gateways
        hport = gateways["async"][0]
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
        write(loads, servers, parse)
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except Exception:  # deliberate: a stuck process is killed
                p.kill()


def write(loads: list[tuple[int, dict, dict]], servers: dict[str, dict[str, Any]], parse: dict[str, float]) -> None:
    lines = [
        "# HTTP endpoint: streaming sessions vs gRPC, threads vs asyncio server, tool-call parsing", "",
        f"Measured {time.strftime('%Y-%m-%d')} by `bench/bench_http.py` on 2 shared CPU cores: two `gyre-engine` "
        "processes (builtin-tiny, 1 torch thread each) and one `gyre-gateway` process with its HTTP endpoint; the "
        "client is this process (one thread per session). Each session is one streamed chat call, greedy, "
        f"max_tokens={NEW_TOKENS}, all sessions in flight at once. Baseline: the same load as gRPC GenerateStream "
        "calls in the same run; HTTP is the default (async) server.", "",
        "| sessions | gRPC calls/s | HTTP calls/s | HTTP / gRPC | gRPC p50 / p99 (ms) | HTTP p50 / p99 (ms) | "
        "added p50 / p99 (ms) | HTTP ok |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, g, h in loads:
        lines.append(f"| {n} | {g['calls_s']:.0f} | {h['calls_s']:.0f} | {h['calls_s'] / g['calls_s']:.2f}x | "
                     f"{g['p50_ms']:.0f} / {g['p99_ms']:.0f} | {h['p50_ms']:.0f} / {h['p99_ms']:.0f} | "
                     f"{h['p50_ms'] - g['p50_ms']:+.0f} / {h['p99_ms'] - g['p99_ms']:+.0f} | {h['ok']}/{n} |")
    t, a = servers["threads"], servers["async"]

    def idle(r: dict[str, Any]) -> str:
        i = r["idle"]
        return f"{i['held']:,}/{i['quiet']:,} held, {i['answered']}/{i['probes']} answered"

    def released(r: dict[str, Any]) -> str:
        i = r["idle"]
        return f"{i['release_s']:.1f}" if i["left"] <= i["threads"] - i["added_threads"] + 16 else \
            f"> {i['release_s']:.0f} ({i['left']:,} threads left)"

    def row(name: str, f: Any) -> str:
        return f"| {name} | {f(t)} | {f(a)} |"

    lines += ["", "## The two HTTP servers: thread per connection vs asyncio", "",
              "Same run, same engines: one gateway process per server (`http_server = \"threads\"` / `\"async\"`, "
              f"`http_max_connections` {IDLE + 2000:,}), loaded one at a time (calls, then streams, then idle connections). Idle: {IDLE:,} connections opened and "
              "held (each 100th sends a request and must be answered; the rest must stay open); threads and RSS "
              f"are the gateway process's. Streams: {STREAMS} streamed chats released at once (max_tokens="
              f"{STREAM_TOKENS}). Calls: {CONCURRENCY} client threads x {CALLS_EACH} non-streaming chats "
              f"(max_tokens={NEW_TOKENS}) over keep-alive connections.", "",
              "| | threads | async |", "|---|---:|---:|",
              row("fresh gateway: threads / RSS (MiB)", lambda r: f"{r['base_threads']} / {r['base_rss_mb']:.0f}"),
              row(f"{IDLE:,} idle connections", idle),
              row("time to open them (s)", lambda r: f"{r['idle']['opened_s']:.1f}"),
              row("holding them: threads / RSS (MiB)", lambda r: f"{r['idle']['threads']:,} / {r['idle']['rss_mb']:.0f}"),
              row("added by holding them: threads / RSS (MiB)",
                  lambda r: f"+{r['idle']['added_threads']:,} / +{r['idle']['added_rss_mb']:.0f}"),
              row("time to let them go once closed (s)", released),
              row("a chat call beside them (ms)",
                  lambda r: f"{r['idle']['call_ms']:.0f}" + ("" if r["idle"]["call_ok"] else " (failed)")),
              row(f"{STREAMS} streams: ok", lambda r: f"{r['streams']['ok']}/{STREAMS}"),
              row(f"{STREAMS} streams: calls/s", lambda r: f"{r['streams']['calls_s']:.0f}"),
              row(f"{STREAMS} streams: p50 / p99 (ms)",
                  lambda r: f"{r['streams']['p50_ms']:.0f} / {r['streams']['p99_ms']:.0f}"),
              row(f"{STREAMS} streams: peak threads / RSS (MiB)",
                  lambda r: f"{r['stream_threads']} / {r['stream_rss_mb']:.0f}"),
              row(f"calls at concurrency {CONCURRENCY}: ok", lambda r: f"{r['calls']['ok']}/{r['calls']['n']}"),
              row(f"calls at concurrency {CONCURRENCY}: calls/s", lambda r: f"{r['calls']['calls_s']:.0f}"),
              row(f"calls at concurrency {CONCURRENCY}: p50 / p99 (ms)",
                  lambda r: f"{r['calls']['p50_ms']:.0f} / {r['calls']['p99_ms']:.0f}"),
              "", "The async server holds an idle connection as a socket and a few KiB; the thread server as a "
              "thread blocked on it. Endpoint calls block (a call waits for generation), so the async server runs "
              "them in a pool (`http_workers`): a stream holds a pool thread while it waits for its next chunk, "
              "so concurrent streams cost threads on both servers."]
    lines += ["", "Tool-call parsing of a reply with text and two calls (median of 5 x 2,000):", "",
              "| format | µs per reply |", "|---|---:|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in parse.items()]
    lines += ["", "HTTP renders the chat template and tokenizes in the gateway (the gRPC client sends ids), "
              "and streams SSE; both paths share routing, engines and TITO recording.", ""]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
