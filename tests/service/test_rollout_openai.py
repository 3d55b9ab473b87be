"""The gateway's OpenAI-compatible endpoint, driven by the official ``openai`` client: the shared
stack runs the default (asyncio) server; the limits, TLS and credentials tests run both servers."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import openai
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from services.rollout.http_async import AsyncOpenAIServer
from services.rollout.http_server import OpenAIServer
from services.rollout.openai_http import OpenAIEndpoint
from services.common.roles import AgentRole
from tests.support.rollout_cluster import LocalEngine, LocalGateway, start_engine, start_gateway
from tests.support.rollout_tokenizer import make_chatml_tokenizer
from tests.support.waiting import wait_until

torch.set_num_threads(1)
HEADERS = {"x-gyre-execution-id": "ex-chat", "x-gyre-agent-id": "main"}
Server = AsyncOpenAIServer | OpenAIServer
SERVERS = pytest.mark.parametrize("server_cls", [AsyncOpenAIServer, OpenAIServer], ids=["async", "threads"])


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, LocalGateway, Any]]:
    tok = AutoTokenizer.from_pretrained(str(make_chatml_tokenizer(tmp_path_factory.mktemp("tok"))))
    engine: LocalEngine = start_engine("cell-a")
    gw = start_gateway()
    gw.client().register_engine("cell-a", engine.address)
    endpoint = OpenAIEndpoint(gw.gateway, tokenizer=tok, model_name="gyre-tiny", job_id="job-o")
    server = AsyncOpenAIServer(endpoint, max_body_bytes=1 << 20).start()
    yield server, gw, tok
    server.stop()
    gw.stop()
    engine.stop()


def oai(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def test_models_lists_the_served_model(stack: tuple[Server, LocalGateway, Any]) -> None:
    server, _, _ = stack
    assert [m.id for m in oai(server).models.list()] == ["gyre-tiny"]


def test_chat_turns_keep_the_exact_ids_of_earlier_turns(stack: tuple[Server, LocalGateway, Any]) -> None:
    server, gw, tok = stack
    client = oai(server)
    messages: list[dict[str, str]] = [{"role": "system", "content": "You are a helpful assistant."},
                                      {"role": "user", "content": "What is the capital of France?"}]
    first = client.chat.completions.create(model="gyre-tiny", messages=messages, max_tokens=12, temperature=0,
                                           extra_headers=HEADERS, extra_body={"return_token_ids": True})
    g1 = first.model_extra["gyre"]
    reply = first.choices[0].message.content
    assert isinstance(reply, str) and first.usage.completion_tokens == len(g1["output_ids"])
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And of Spain?"}]
    second = client.chat.completions.create(model="gyre-tiny", messages=messages, max_tokens=12, temperature=0,
                                            extra_headers={**HEADERS, "x-gyre-role": "main"},
                                            extra_body={"return_token_ids": True})
    g2 = second.model_extra["gyre"]
    earlier = g1["prompt_ids"] + g1["output_ids"]
    assert g2["prompt_ids"][:len(earlier)] == earlier
    assert g2["reused_prompt_tokens"] == len(earlier) and len(g2["prompt_ids"]) > len(earlier)
    # The first prompt is the template rendered once, tokenized once.
    rendered = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert g1["prompt_ids"] == tok(rendered, add_special_tokens=False)["input_ids"]
    # (tests/unit/test_rollout_chat.py covers outputs whose re-tokenization would drift.)
    # Each call is a TITO record with exactly these ids.
    recs = [r for r in gw.records if r.execution_id == "ex-chat"]
    assert len(recs) == 2 and all(r.job_id == "job-o" and r.role == AgentRole.MAIN for r in recs)
    np.testing.assert_array_equal(recs[1].prompt_ids, g2["prompt_ids"])
    np.testing.assert_array_equal(recs[0].output_ids, g1["output_ids"])


def test_chat_stream_yields_the_same_text(stack: tuple[Server, LocalGateway, Any]) -> None:
    server, gw, _ = stack
    client = oai(server)
    messages = [{"role": "user", "content": "List three prime numbers."}]
    whole = client.chat.completions.create(model="gyre-tiny", messages=messages, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model="gyre-tiny", messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, extra_body={"execution_id": "ex-stream",
                                                                          "role": "subagent"}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    rec = next(r for r in gw.records if r.execution_id == "ex-stream")
    assert rec.role == AgentRole.SUBAGENT and len(rec.output_ids) == 16


def test_completions_with_ids_and_text(stack: tuple[Server, LocalGateway, Any]) -> None:
    server, _, tok = stack
    client = oai(server)
    by_ids = client.completions.create(model="gyre-tiny", prompt=[5, 6, 7, 8], max_tokens=6, temperature=0,
                                       extra_body={"return_token_ids": True})
    assert by_ids.model_extra["gyre"]["prompt_ids"] == [5, 6, 7, 8]
    assert len(by_ids.model_extra["gyre"]["output_ids"]) == 6
    text = "The quick brown fox"
    first = client.completions.create(model="gyre-tiny", prompt=text, max_tokens=6, temperature=0, seed=3,
                                      extra_headers=HEADERS, extra_body={"return_token_ids": True})
    g1 = first.model_extra["gyre"]
    follow = client.completions.create(model="gyre-tiny", prompt=text + first.choices[0].text + " jumps",
                                       max_tokens=4, temperature=0, extra_headers=HEADERS,
                                       extra_body={"return_token_ids": True})
    g2 = follow.model_extra["gyre"]
    assert g2["prompt_ids"][:len(g1["prompt_ids"]) + 6] == g1["prompt_ids"] + g1["output_ids"]


def raw(server: Server, path: str, body: bytes | None, method: str = "POST") -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}", data=body, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_bad_requests_get_openai_style_errors(stack: tuple[Server, LocalGateway, Any]) -> None:
    server, _, _ = stack
    client = oai(server)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model="gyre-tiny", messages=[{"role": "user", "content": "hi"}],
                                       temperature=-1)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model="gyre-tiny", messages=[])
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model="gyre-tiny", prompt=[1, 2, 100000], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model="gyre-tiny", messages=[{"role": "user", "content": "hi"}],
                                       extra_headers={"x-gyre-role": "boss"})
    with pytest.raises(openai.BadRequestError, match="attempt must be a non-negative integer"):
        client.chat.completions.create(model="gyre-tiny", messages=[{"role": "user", "content": "hi"}],
                                       extra_headers={"x-gyre-attempt": "second"})
    status, body = raw(server, "/v1/chat/completions", b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = raw(server, "/v1/nothing", b"{}")
    assert status == 404 and body["error"]["type"] == "not_found_error"
    status, body = raw(server, "/v1/completions", json.dumps({"prompt": "x" * (2 << 20)}).encode())
    assert status == 413 and "exceeds" in body["error"]["message"]
    long_prompt = list(range(1, 400)) * 3  # 1197 tokens > the 1024-token context
    status, body = raw(server, "/v1/completions", json.dumps({"prompt": long_prompt, "max_tokens": 2}).encode())
    assert status == 400 and "context" in body["error"]["message"]


@SERVERS
def test_idle_connections_are_closed_and_too_many_are_refused(stack: tuple[Server, LocalGateway, Any],
                                                              server_cls: type[Server]) -> None:
    import socket

    _, gw, tok = stack
    endpoint = OpenAIEndpoint(gw.gateway, tokenizer=tok, model_name="gyre-tiny")
    server = server_cls(endpoint, idle_timeout_s=0.5, max_connections=2).start()
    try:
        idle = [socket.create_connection(("127.0.0.1", server.port), timeout=30) for _ in range(2)]
        idle[0].sendall(b"GET /v1/mod")  # a request that never completes (a slow client)
        over = socket.create_connection(("127.0.0.1", server.port), timeout=30)
        over.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = over.recv(65536)
        assert answer.startswith(b"HTTP/1.1 503") and b"too many open connections" in answer
        for s in idle:  # both are closed by the server once idle past the timeout
            assert s.recv(1) == b""

        def answered() -> Any:  # their slots come free
            got = raw(server, "/v1/models", None, method="GET")
            assert got[0] in (200, 503), got
            return got if got[0] == 200 else None

        got = wait_until(answered, 30, "a connection slot to come free (503 until then)")
        assert got[1]["data"][0]["id"] == "gyre-tiny"
    finally:
        server.stop()


@SERVERS
def test_the_endpoint_serves_tls(stack: tuple[Server, LocalGateway, Any], tmp_path: Any,
                                 server_cls: type[Server]) -> None:
    from tests.support.pki import make_pki

    _, gw, tok = stack
    pki = make_pki(tmp_path / "pki")
    endpoint = OpenAIEndpoint(gw.gateway, tokenizer=tok, model_name="gyre-tiny")
    server = server_cls(endpoint, host="127.0.0.1", tls_cert_file=str(pki / "node.pem"),
                        tls_key_file=str(pki / "node.key")).start()
    try:
        assert server.base_url.startswith("https://")
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                               http_client=openai.DefaultHttpx2Client(verify=str(pki / "ca.pem")))
        assert [m.id for m in client.models.list()] == ["gyre-tiny"]
        reply = client.chat.completions.create(model="gyre-tiny", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=2, extra_headers=HEADERS)
        assert reply.choices[0].message.content is not None
        with pytest.raises(openai.APIConnectionError):  # plaintext clients do not get through
            openai.OpenAI(base_url=server.base_url.replace("https", "http"), api_key="x",
                          max_retries=0).models.list()
    finally:
        server.stop()


@SERVERS
def test_per_role_tokens_admit_harnesses_only(stack: tuple[Server, LocalGateway, Any],
                                              server_cls: type[Server]) -> None:
    """With per-role tokens the endpoint admits harness (and internal) credentials; an operator's
    valid credential gets 403, an unknown one 401, each in the API's own error shape."""
    import anthropic

    _, gw, tok = stack
    tokens = (("harness", "harness-token-0123456789"), ("operator", "operator-token-0123456789"),
              ("internal", "internal-token-0123456789"))
    endpoint = OpenAIEndpoint(gw.gateway, tokenizer=tok, model_name="gyre-tiny")
    server = server_cls(endpoint, tokens=tokens).start()
    try:
        def client(key: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=60)

        for role, key in tokens:
            if role != "operator":
                assert [m.id for m in client(key).models.list()] == ["gyre-tiny"]
        with pytest.raises(openai.PermissionDeniedError, match="operator credential may not call"):
            client("operator-token-0123456789").models.list()
        with pytest.raises(openai.AuthenticationError):
            client("not-a-token-at-all-0123").models.list()
        claude = anthropic.Anthropic(base_url=server.base_url.removesuffix("/v1"), api_key="operator-token-0123456789",
                                     max_retries=0)
        with pytest.raises(anthropic.PermissionDeniedError):
            claude.messages.create(model="gyre-tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    finally:
        server.stop()


json_values = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                        max_size=3), max_leaves=8)
roles = st.sampled_from(["user", "assistant", "system", "tool", "boss", None])
messages = st.lists(st.fixed_dictionaries({"role": roles}, optional={
    "content": st.one_of(st.text(max_size=12), st.none(), json_values),
    "tool_calls": st.lists(st.fixed_dictionaries({"id": st.text(max_size=4)}, optional={
        "function": st.fixed_dictionaries({"name": st.sampled_from(["f", "g", "no such"]),
                                           "arguments": st.text(max_size=6)})}), max_size=2),
    "tool_call_id": st.text(max_size=4)}), max_size=4)
tools = st.lists(st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["f", "g", "bad name", ""])})}), max_size=2)
bodies = st.fixed_dictionaries({}, optional={
    "messages": messages, "tools": tools, "n": st.integers(-1, 3), "stream": st.booleans(),
    "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=3)),
    "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required", "x"]),
                             st.fixed_dictionaries({"function": st.fixed_dictionaries({"name": st.text(max_size=3)})})),
    "system": json_values, "max_tokens": st.integers(-1, 2), "temperature": st.floats(-1, 3)})


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(["/v1/chat/completions", "/v1/messages", "/v1/completions"]),
       body=st.one_of(bodies, json_values))
def test_fuzzed_requests_get_a_clear_answer_and_write_nothing_half(stack: tuple[Server, LocalGateway, Any],
                                                                   route: str, body: Any) -> None:
    server, gw, _ = stack
    if isinstance(body, dict):
        body = {**body, "max_tokens": min(int(body.get("max_tokens", 1) or 1), 2) or 1}
    before = len(gw.records)
    req = urllib.request.Request(f"http://127.0.0.1:{server.port}{route}", data=json.dumps(body).encode(),
                                 method="POST", headers={"Content-Type": "application/json", **HEADERS})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            status, payload = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, payload = err.code, err.read()
    assert status in (200, 400, 404), (status, payload[:300])
    if status != 200:
        err = json.loads(payload)
        message = err["error"]["message"]
        assert isinstance(message, str) and message  # one sentence in the API's own shape
        assert len(gw.records) == before  # a refused call recorded nothing
    for rec in gw.records[before:]:  # whatever ran is recorded whole
        assert len(rec.output_ids) == len(rec.output_logprobs) and len(rec.prompt_ids) > 0


def test_a_burst_of_connections_is_served_not_reset(stack: tuple[Server, LocalGateway, Any]) -> None:
    import threading

    server, _, _ = stack
    go, results = threading.Event(), []

    def one() -> None:
        go.wait()
        results.append(raw(server, "/v1/models", None, method="GET")[0])

    threads = [threading.Thread(target=one) for _ in range(300)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join(60)
    assert results == [200] * 300  # (a listen backlog of 5 reset most of such a burst)
