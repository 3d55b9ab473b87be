"""The gateway's asyncio HTTP server (``http_async.py``) under its limits, with a real gateway and
a tiny engine: thousands of idle connections held without threads, the connection cap, the idle
timeout, a stream cancelled when its client leaves, TLS and a graceful stop. (The routes, errors
and credentials are ``test_rollout_openai.py``'s, run against this server.)"""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from transformers import AutoTokenizer

from services.common.metrics import REGISTRY
from services.rollout.client import EngineClient
from services.rollout.http_async import AsyncOpenAIServer
from services.rollout.openai_http import OpenAIEndpoint
from tests.support.rollout_cluster import LocalEngine, LocalGateway, start_engine, start_gateway, varied_tiny_model
from tests.support.rollout_tokenizer import make_chatml_tokenizer
from tests.support.waiting import wait_until

torch.set_num_threads(1)
LONG_CONTEXT = 16384  # a stream of 16K tokens takes minutes: it ends early only when cancelled
CHAT = {"model": "gyre-tiny", "messages": [{"role": "user", "content": "count to ten"}], "temperature": 0}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[OpenAIEndpoint, EngineClient, LocalGateway]]:
    tok = AutoTokenizer.from_pretrained(str(make_chatml_tokenizer(tmp_path_factory.mktemp("tok"))))
    model = varied_tiny_model()
    model.config.max_position_embeddings = LONG_CONTEXT
    engine: LocalEngine = start_engine("cell-h", model=model, max_context=LONG_CONTEXT)
    gw = start_gateway()
    gw.client().register_engine("cell-h", engine.address)
    endpoint = OpenAIEndpoint(gw.gateway, tokenizer=tok, model_name="gyre-tiny")
    endpoint.default_stop_ids = ()  # calls run to max_tokens: a long one is surely still running when cut
    client = EngineClient(engine.address)
    yield endpoint, client, gw
    client.close()
    gw.stop()
    engine.stop()


def chat(server: AsyncOpenAIServer, max_tokens: int = 4, **kw: Any) -> Any:
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60, **kw)
    return client.chat.completions.create(max_tokens=max_tokens, **CHAT)  # type: ignore[call-overload]


def request(sock: socket.socket, method: str = "GET", path: str = "/v1/models", body: bytes = b"") -> None:
    sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)


def refused() -> float:
    return REGISTRY.get_sample_value("gyre_gateway_http_refused_connections_total") or 0.0


def test_two_thousand_idle_connections_are_held_without_threads(stack: tuple[OpenAIEndpoint, EngineClient,
                                                                             LocalGateway]) -> None:
    endpoint, _, _ = stack
    server = AsyncOpenAIServer(endpoint, max_connections=4096).start()
    threads_before = threading.active_count()
    idle: list[socket.socket] = []
    try:
        idle = [socket.create_connection(("127.0.0.1", server.port), timeout=30) for _ in range(2000)]
        wait_until(lambda: server.open_connections >= 2000, what="2,000 connections accepted")
        reply = chat(server)  # a call still goes through beside them
        assert reply.choices[0].message.content is not None and reply.usage.completion_tokens == 4
        assert server.open_connections >= 2000  # none was dropped
        assert threading.active_count() < threads_before + 50  # they cost no thread
        request(idle[-1])  # and any of them can still be used
        assert idle[-1].recv(65536).startswith(b"HTTP/1.1 200")
    finally:
        for s in idle:
            s.close()
        server.stop()


def test_connections_beyond_the_cap_get_503(stack: tuple[OpenAIEndpoint, EngineClient, LocalGateway]) -> None:
    endpoint, _, _ = stack
    server = AsyncOpenAIServer(endpoint, max_connections=50).start()
    held = [socket.create_connection(("127.0.0.1", server.port), timeout=30) for _ in range(50)]
    try:
        wait_until(lambda: server.open_connections == 50, what="50 connections accepted")
        before = refused()
        over = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        request(over)
        answer = over.recv(65536)
        assert answer.startswith(b"HTTP/1.1 503") and b"too many open connections" in answer
        assert over.recv(1) == b""  # and closed
        assert refused() == before + 1
        held.pop().close()  # a slot comes free: a new connection is served
        wait_until(lambda: server.open_connections == 49, what="the closed connection to be let go")
        again = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        request(again)
        assert again.recv(65536).startswith(b"HTTP/1.1 200")
        again.close()
    finally:
        for s in held:
            s.close()
        server.stop()


def test_idle_connections_are_closed_busy_ones_are_not(stack: tuple[OpenAIEndpoint, EngineClient,
                                                                    LocalGateway]) -> None:
    endpoint, _, _ = stack
    server = AsyncOpenAIServer(endpoint, idle_timeout_s=0.5).start()
    try:
        silent = socket.create_connection(("127.0.0.1", server.port), timeout=30)  # never sends
        trickle = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        trickle.sendall(b"GET /v1/mod")  # a request that never completes
        kept = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        request(kept)  # served, then idle on keep-alive
        assert kept.recv(65536).startswith(b"HTTP/1.1 200")
        for s in (silent, trickle, kept):  # the server closes each once idle past the timeout
            assert s.recv(1) == b""
        # a call generating for longer than the timeout is not idle: it completes
        reply = chat(server, max_tokens=200)
        assert reply.usage.completion_tokens == 200
    finally:
        server.stop()


def test_a_stream_whose_client_leaves_is_cancelled(stack: tuple[OpenAIEndpoint, EngineClient, LocalGateway]) -> None:
    endpoint, engine, _ = stack
    server = AsyncOpenAIServer(endpoint).start()
    try:
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=60)
        request(sock, "POST", "/v1/chat/completions", json.dumps({**CHAT, "stream": True,
                                                                   "max_tokens": LONG_CONTEXT - 64}).encode())
        got = b""
        while got.count(b"data: ") < 3:  # a few tokens arrive: the call is running
            chunk = sock.recv(65536)
            assert chunk, got
            got += chunk
        assert got.startswith(b"HTTP/1.1 200") and b"text/event-stream" in got
        assert engine.get_load().active == 1
        sock.close()  # the client goes away mid-stream
        wait_until(lambda: engine.get_load().active == 0, what="the engine request to be cancelled")
    finally:
        server.stop()


def test_streams_over_tls_and_a_stalled_handshake_is_closed(stack: tuple[OpenAIEndpoint, EngineClient,
                                                                         LocalGateway], tmp_path: Path) -> None:
    from tests.support.pki import make_pki

    endpoint, _, _ = stack
    pki = make_pki(tmp_path / "pki")
    server = AsyncOpenAIServer(endpoint, idle_timeout_s=0.5, tls_cert_file=str(pki / "node.pem"),
                               tls_key_file=str(pki / "node.key")).start()
    try:
        assert server.base_url.startswith("https://")
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60,
                               http_client=openai.DefaultHttpxClient(verify=str(pki / "ca.pem")))
        chunks = list(client.chat.completions.create(max_tokens=8, stream=True, **CHAT))  # type: ignore[call-overload]
        assert chunks[-1].choices[0].finish_reason == "length"
        stalled = socket.create_connection(("127.0.0.1", server.port), timeout=30)  # never says hello
        assert stalled.recv(1) == b""
        ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        with ctx.wrap_socket(socket.create_connection(("127.0.0.1", server.port), timeout=30),
                             server_hostname="localhost") as idle:  # a TLS connection idle past the timeout
            assert idle.recv(1) == b""
    finally:
        server.stop()


def test_stop_lets_in_flight_requests_finish(stack: tuple[OpenAIEndpoint, EngineClient, LocalGateway]) -> None:
    endpoint, engine, _ = stack
    server = AsyncOpenAIServer(endpoint).start()
    idle = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    results: dict[str, Any] = {}

    def stream() -> None:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        conn.request("POST", "/v1/chat/completions", body=json.dumps({**CHAT, "stream": True, "max_tokens": 300}),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        results["status"], results["body"] = resp.status, resp.read()

    t = threading.Thread(target=stream)
    t.start()
    wait_until(lambda: engine.get_load().active == 1, what="the stream to start")
    server.stop(grace_s=60)  # returns once the stream is done (the idle connection does not hold it)
    assert results["status"] == 200 and results["body"].rstrip().endswith(b"data: [DONE]")
    events = [json.loads(line[6:]) for line in results["body"].split(b"\n\n") if line.startswith(b"data: {")]
    assert events[-1]["usage"]["completion_tokens"] == 300
    assert idle.recv(1) == b""  # closed at the stop
    with pytest.raises(ConnectionRefusedError):  # and no new connection is taken
        socket.create_connection(("127.0.0.1", server.port), timeout=30)
    t.join(10)
