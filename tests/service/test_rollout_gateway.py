"""Gateway over real tiny TorchEngines (two in-process Engine gRPC servers on port 0)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from services.common.errors import NotFound
from services.rollout.calls import CallMeta
from services.rollout.client import EngineClient, collect
from services.rollout.engine import SamplingParams
from tests.support.rollout_cluster import LocalEngine, LocalGateway, start_engine, start_gateway

torch.set_num_threads(1)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[LocalGateway, list[LocalEngine]]]:
    engines = [start_engine("cell-a"), start_engine("cell-b")]
    gw = start_gateway()
    for e in engines:
        gw.client().register_engine(e.cell_id, e.address)
    yield gw, engines
    gw.stop()
    for e in engines:
        e.stop()


def prompt(seed: int, n: int = 40) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 512, n).astype(np.int32)


def test_gateway_generate_equals_direct_engine_greedy(cluster: tuple[LocalGateway, list[LocalEngine]]) -> None:
    gw, engines = cluster
    p = prompt(1)
    direct = EngineClient(engines[0].address).generate("direct-1", CallMeta(), p, GREEDY)
    res = gw.client().generate(CallMeta(job_id="j", execution_id="ex-1", call_id="c1", agent_id="main"), p, GREEDY)
    assert len(set(direct.output_ids.tolist())) > 1, "the test model should not repeat one token"
    np.testing.assert_array_equal(res.output_ids, direct.output_ids)
    np.testing.assert_allclose(res.output_logprobs, direct.output_logprobs, atol=1e-4)
    assert res.finish_reason == "length" and len(res.output_ids) == 24
    assert res.weight_version == 0 and res.prompt_len == len(p) and res.cell_id in ("cell-a", "cell-b")
    rec = next(r for r in gw.records if r.call_id == "c1")
    assert rec.execution_id == "ex-1" and rec.job_id == "j" and rec.agent_id == "main"
    np.testing.assert_array_equal(rec.prompt_ids, p)
    np.testing.assert_array_equal(rec.output_ids, res.output_ids)
    np.testing.assert_allclose(rec.output_logprobs, res.output_logprobs)


def test_stream_pieces_concatenate_to_the_unary_answer(cluster: tuple[LocalGateway, list[LocalEngine]]) -> None:
    gw, _ = cluster
    p = prompt(2)
    unary = gw.client().generate(CallMeta(execution_id="ex-2", call_id="u"), p, GREEDY)
    pieces = list(gw.client().generate_stream(CallMeta(execution_id="ex-2", call_id="s"), p, GREEDY))
    assert len(pieces) > 1 and pieces[-1].finished and not any(x.finished for x in pieces[:-1])
    offsets = np.cumsum([0] + [len(x.token_ids) for x in pieces[:-1]])
    assert [x.offset for x in pieces] == offsets.tolist()
    ids, lps, last = collect(pieces)
    np.testing.assert_array_equal(ids, unary.output_ids)
    assert last.finish_reason == "length" and last.weight_version == 0


def test_seeded_sampling_is_reproducible_on_any_engine(cluster: tuple[LocalGateway, list[LocalEngine]]) -> None:
    gw, engines = cluster
    p = prompt(3)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_new_tokens=20, seed=1234)
    a = EngineClient(engines[0].address).generate("seeded-a", CallMeta(), p, params)
    b = EngineClient(engines[1].address).generate("seeded-b", CallMeta(), p, params)
    c = gw.client().generate(CallMeta(execution_id="ex-3", call_id="c"), p, params)
    np.testing.assert_array_equal(a.output_ids, b.output_ids)
    np.testing.assert_array_equal(a.output_ids, c.output_ids)
    assert c.seed == 1234
    other = gw.client().generate(CallMeta(execution_id="ex-3", call_id="d"), p,
                                 SamplingParams(temperature=1.0, max_new_tokens=20, seed=99))
    assert not np.array_equal(other.output_ids, a.output_ids)


def test_routing_is_sticky_per_agent_and_spreads_executions(cluster: tuple[LocalGateway, list[LocalEngine]]) -> None:
    gw, _ = cluster
    client = gw.client()
    short = SamplingParams(temperature=0.0, max_new_tokens=2)
    cells = {client.generate(CallMeta(execution_id="sticky", agent_id="a1", call_id=f"c{i}"), prompt(i), short).cell_id
             for i in range(4)}
    assert len(cells) == 1
    # Concurrent calls of different executions go to the least loaded engine: both get some.
    longer = SamplingParams(temperature=0.0, max_new_tokens=40)
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda i: client.generate(CallMeta(execution_id=f"spread-{i}", call_id="c"),
                                                          prompt(i), longer), range(6)))
    assert {r.cell_id for r in results} == {"cell-a", "cell-b"}


def test_prompt_delta_resolves_against_an_earlier_call(cluster: tuple[LocalGateway, list[LocalEngine]]) -> None:
    gw, _ = cluster
    client = gw.client()
    p = prompt(4)
    first = client.generate(CallMeta(execution_id="ex-delta", call_id="t1"), p, GREEDY)
    new = np.array([7, 8, 9], np.int32)
    full = np.concatenate([p, first.output_ids, new])
    by_delta = client.generate(CallMeta(execution_id="ex-delta", call_id="t2"), None, GREEDY, base_call_id="t1",
                               shared_prefix_len=len(p) + len(first.output_ids), new_ids=new)
    by_full = client.generate(CallMeta(execution_id="ex-delta", call_id="t3"), full, GREEDY)
    assert by_delta.prompt_len == len(full)
    np.testing.assert_array_equal(by_delta.output_ids, by_full.output_ids)
    rec = next(r for r in gw.records if r.call_id == "t2")
    np.testing.assert_array_equal(rec.prompt_ids, full)
    with pytest.raises(NotFound, match="unknown session"):
        client.generate(CallMeta(execution_id="ex-delta", call_id="t4"), None, GREEDY, base_call_id="nope",
                        shared_prefix_len=1, new_ids=new)


def test_engines_come_and_go(cluster: tuple[LocalGateway, list[LocalEngine]]) -> None:
    gw, engines = cluster
    client = gw.client()
    extra = start_engine("cell-c", model=None)
    try:
        info = client.register_engine("cell-c", extra.address)
        assert info.state == "ready" and info.load.vocab_size == 512
        assert {e.cell_id for e in client.list_engines()} == {"cell-a", "cell-b", "cell-c"}
        assert client.deregister_engine("cell-c") == 0
        with pytest.raises(NotFound):
            client.deregister_engine("cell-c")
        res = client.generate(CallMeta(execution_id="after"), prompt(5), GREEDY)
        assert res.cell_id in ("cell-a", "cell-b")
    finally:
        extra.stop()


def test_job_usage_counts_each_jobs_calls_tokens_and_reuse(cluster: tuple[LocalGateway, list[LocalEngine]]) -> None:
    from services.common.errors import InvalidArgument

    gw, _ = cluster
    client = gw.client()
    assert client.job_usage(["usage-job"]) == {}  # a job that made no call: nothing, not an error
    p = prompt(11, 200)
    meta = CallMeta(job_id="usage-job", execution_id="ex-u", agent_id="main")
    first = client.generate(CallMeta(**{**meta.__dict__, "call_id": "u1"}), p, GREEDY)
    grown = np.concatenate([p, first.output_ids, prompt(12, 30)])
    second = client.generate(CallMeta(**{**meta.__dict__, "call_id": "u2"}), grown, GREEDY)
    client.generate(CallMeta(job_id="other-job", execution_id="ex-o", call_id="o1"), prompt(13), GREEDY)
    usage = client.job_usage(["usage-job", "never-called"])
    assert list(usage) == ["usage-job"]
    u = usage["usage-job"]
    assert u.calls == 2 and u.in_flight == 0
    assert u.prompt_tokens == len(p) + len(grown)
    assert u.output_tokens == len(first.output_ids) + len(second.output_ids) == 48
    # the second call is routed to the engine that holds the first's context and reuses it
    assert second.cell_id == first.cell_id and u.cached_tokens >= len(p)
    assert u.last_context_tokens == u.max_context_tokens == len(grown) + 24
    assert 0 < u.first_call_at_s <= u.last_call_at_s
    assert {"usage-job", "other-job"} <= set(client.job_usage())
    with pytest.raises(InvalidArgument, match="empty"):
        client.job_usage([""])
