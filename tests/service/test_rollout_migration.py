"""Live migration through the gateway: DrainEngine moves in-flight requests (KV over TCP / UCX) and
the caller's stream continues with exactly the tokens of an unmigrated run."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from services.rollout.calls import CallMeta, MigrationReport, Piece
from services.rollout.client import EngineClient, GatewayClient, collect
from services.rollout.engine import SamplingParams
from tests.support.rollout_cluster import LocalEngine, LocalGateway, start_engine, start_gateway
from tests.support.waiting import wait_until

torch.set_num_threads(1)
PROMPT = np.random.default_rng(0).integers(0, 512, 48).astype(np.int32)
LONG = 300  # tokens: long enough that the drain lands mid-stream


def ucx_works() -> bool:
    from services.rollout import kv_transport

    try:
        address = kv_transport.make_receiver("ucx", lambda s: None)
    except Exception:
        return False
    kv_transport.close_receiver(address)
    return address.startswith("ucx://")


@pytest.fixture(scope="module", params=["tcp", "ucx"])
def cluster(request: pytest.FixtureRequest) -> Iterator[tuple[LocalGateway, dict[str, LocalEngine], str]]:
    kind = request.param
    if kind == "ucx" and not ucx_works():
        pytest.skip("ucxx is not usable on this machine")
    engines = {c: start_engine(c, kv_kinds=(kind,)) for c in ("cell-a", "cell-b")}
    gw = start_gateway()
    yield gw, engines, kind
    gw.stop()
    for e in engines.values():
        e.stop()


def register_all(gw: LocalGateway, engines: dict[str, LocalEngine]) -> GatewayClient:
    client = gw.client()
    for e in engines.values():
        client.register_engine(e.cell_id, e.address)
    return client


def busy_cell(client: GatewayClient, timeout_s: float = 10.0) -> str:
    busy = wait_until(lambda: [e.cell_id for e in client.list_engines() if e.in_flight > 0], timeout_s,
                      "an engine with the call in flight", poll_s=0.005)
    return busy[0]


def stream_and_drain(client: GatewayClient, meta: CallMeta, prompt: np.ndarray, params: SamplingParams,
                     kind: str) -> tuple[list[Piece], list[MigrationReport], str]:
    """Stream a call; once 16 tokens arrived, drain the engine it runs on. (pieces, drain reports,
    the drained cell), after the stream ended."""
    pieces: list[Piece] = []
    reports: list[MigrationReport] = []
    drainer: threading.Thread | None = None
    cell = ""
    for piece in client.generate_stream(meta, prompt, params):
        pieces.append(piece)
        if drainer is None and sum(len(p.token_ids) for p in pieces) >= 16:
            cell = busy_cell(client)
            drainer = threading.Thread(target=lambda: reports.extend(client.drain_engine(cell, kind)))
            drainer.start()
    assert drainer is not None
    drainer.join(timeout=60)
    return pieces, reports, cell


def reference(engines: dict[str, LocalEngine], params: SamplingParams) -> np.ndarray:
    return EngineClient(engines["cell-a"].address).generate(f"ref-{time.monotonic_ns()}", CallMeta(),
                                                           PROMPT, params).output_ids


def test_drain_moves_a_greedy_stream_without_changing_its_tokens(
        cluster: tuple[LocalGateway, dict[str, LocalEngine], str]) -> None:
    gw, engines, kind = cluster
    client = register_all(gw, engines)
    params = SamplingParams(temperature=0.0, max_new_tokens=LONG)
    expected = reference(engines, params)
    pieces, reports, cell = stream_and_drain(client, CallMeta(execution_id=f"mig-{kind}", call_id="c1"), PROMPT,
                                             params, kind)
    ids, _lps, last = collect(pieces)
    assert last.finished and last.finish_reason == "length"
    np.testing.assert_array_equal(ids, expected)
    assert [p.offset for p in pieces] == np.cumsum([0] + [len(p.token_ids) for p in pieces[:-1]]).tolist()
    (report,) = reports
    assert report.ok and report.transport == kind, report
    assert report.bytes > 0 and report.kv_tokens > len(PROMPT) and report.duration_s > 0
    assert report.source_cell_id == cell and report.target_cell_id != cell
    assert {e.cell_id for e in client.list_engines()} == {"cell-a", "cell-b"} - {cell}
    rec = next(r for r in gw.records if r.execution_id == f"mig-{kind}")
    np.testing.assert_array_equal(rec.output_ids, expected)


def test_drain_moves_seeded_sampling_calls_without_changing_their_tokens(
        cluster: tuple[LocalGateway, dict[str, LocalEngine], str]) -> None:
    gw, engines, kind = cluster
    client = register_all(gw, engines)
    params = [SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=LONG, seed=s) for s in (11, 12, 13)]
    with ThreadPoolExecutor(3) as pool:  # batched on one engine: same tokens as alone
        expected = list(pool.map(lambda p: reference(engines, p), params))
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(client.generate, CallMeta(execution_id=f"seeded-{kind}-{i}", call_id="c"), PROMPT, p)
                   for i, p in enumerate(params)]
        cell = busy_cell(client)
        time.sleep(0.05)  # let them generate a little
        reports: list[MigrationReport] = client.drain_engine(cell, kind)
        results = [f.result(timeout=120) for f in futures]
    for res, exp in zip(results, expected):
        np.testing.assert_array_equal(res.output_ids, exp)
    moved = [r for r in results if r.num_migrations]
    assert moved and all(r.cell_id != cell for r in moved)
    assert len([r for r in reports if r.ok]) == len(moved)
    assert all(r.transport == kind for r in reports if r.ok)


def test_drain_by_reprefill_sends_no_kv_and_keeps_the_tokens(
        cluster: tuple[LocalGateway, dict[str, LocalEngine], str]) -> None:
    gw, engines, kind = cluster
    if kind != "tcp":
        pytest.skip("transport-independent; run once")
    client = register_all(gw, engines)
    params = SamplingParams(temperature=1.0, max_new_tokens=LONG, seed=5)
    expected = reference(engines, params)
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(client.generate, CallMeta(execution_id="reprefill", call_id="c"), PROMPT, params)
        cell = busy_cell(client)
        time.sleep(0.05)
        (report,) = client.drain_engine(cell, "reprefill")
        res = fut.result(timeout=120)
    np.testing.assert_array_equal(res.output_ids, expected)
    assert report.ok and report.transport == "reprefill" and res.num_migrations == 1
    # Only the request header, tokens and RNG state travel: far less than any KV.
    assert report.bytes < 4 * (len(PROMPT) + LONG) * 2 + 64


def test_a_migrated_call_leaves_its_kv_as_the_receivers_cached_prefix(
        cluster: tuple[LocalGateway, dict[str, LocalEngine], str]) -> None:
    gw, engines, kind = cluster
    client = register_all(gw, engines)
    prompt = np.random.default_rng(7).integers(0, 512, 200).astype(np.int32)  # no other test's context
    meta = dict(execution_id=f"prefix-{kind}", agent_id="agent-m")
    pieces, reports, _ = stream_and_drain(client, CallMeta(call_id="c1", **meta), prompt,
                                          SamplingParams(temperature=0.0, max_new_tokens=LONG), kind)
    out, _lps, last = collect(pieces)
    (report,) = reports
    assert report.ok and last.finished
    target = report.target_cell_id
    register_all(gw, engines)  # the drained engine is back: the agent's next call could go either way
    before = engines[target].host.engine.prefix_stats()["reused_tokens"]
    follow_up = np.concatenate([prompt, out, np.arange(1, 40, dtype=np.int32)])
    res = client.generate(CallMeta(call_id="c2", **meta), follow_up, SamplingParams(temperature=0.0, max_new_tokens=4))
    # the call went where the agent's context now lives, and found it there: only the tail was prefilled
    assert res.cell_id == target
    reused = engines[target].host.engine.prefix_stats()["reused_tokens"] - before
    assert reused == len(prompt) + len(out) - 1
