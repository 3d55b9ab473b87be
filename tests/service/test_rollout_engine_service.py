"""The Engine gRPC service of one ROLLOUT cell: resume (re-prefill), cancel, load, weight updates."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from services.rollout.calls import CallMeta
from services.rollout.client import EngineClient, collect
from services.rollout.engine import SamplingParams
from tests.support.rollout_cluster import LocalEngine, start_engine, varied_tiny_model
from tests.support.waiting import wait_until

torch.set_num_threads(1)
PROMPT = np.random.default_rng(1).integers(0, 512, 32).astype(np.int32)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=24)
LONG_CONTEXT = 16384
LONG = SamplingParams(temperature=0.0, max_new_tokens=LONG_CONTEXT - len(PROMPT))


@pytest.fixture(scope="module")
def engine() -> Iterator[tuple[LocalEngine, EngineClient]]:
    e = start_engine("cell-a")
    client = EngineClient(e.address)
    yield e, client
    client.close()
    e.stop()


def wait_idle(client: EngineClient, timeout_s: float = 10.0) -> None:
    wait_until(lambda: client.get_load().active == 0, timeout_s, "the engine to be idle")


def test_resume_continues_exactly_where_the_tokens_stop(engine: tuple[LocalEngine, EngineClient]) -> None:
    _, client = engine
    for params in (GREEDY, SamplingParams(temperature=1.0, max_new_tokens=24, seed=77)):
        full = client.generate("full", CallMeta(), PROMPT, params)
        pieces = list(client.resume_stream("resumed", CallMeta(), PROMPT, params, full.output_ids[:10],
                                           full.output_logprobs[:10], 0))
        assert pieces[0].offset == 10
        ids, lps, last = collect(pieces)
        np.testing.assert_array_equal(ids, full.output_ids[10:])
        np.testing.assert_allclose(lps, full.output_logprobs[10:], atol=1e-4)
        assert last.finish_reason == "length"


@pytest.fixture(scope="module")
def long_engine() -> Iterator[EngineClient]:
    """An engine with a 16K context: generating it whole takes minutes, far longer than any stall
    of a busy CI machine between a first token and the next look at the engine, so a request is
    surely still running when cancelled or dropped, and its ending inside ``wait_idle``'s 10 s is
    the cancel's doing, not the request running out."""
    model = varied_tiny_model()
    model.config.max_position_embeddings = LONG_CONTEXT
    e = start_engine("cell-long", model=model, max_context=LONG_CONTEXT)
    client = EngineClient(e.address)
    yield client
    client.close()
    e.stop()


def test_cancel_ends_the_request(long_engine: EngineClient) -> None:
    client = long_engine
    stream = client.generate_stream("to-cancel", CallMeta(), PROMPT, LONG)
    it = iter(stream)
    next(it)
    assert client.cancel("to-cancel")
    rest = list(it)
    assert rest[-1].finished and rest[-1].finish_reason == "aborted"
    wait_idle(client)


def test_caller_disconnect_ends_the_request(long_engine: EngineClient) -> None:
    client = long_engine
    stream = client.generate_stream("to-drop", CallMeta(), PROMPT, LONG)
    # Hold the iterator: a dropped one is closed at once, and closing cancels the call (that race,
    # not the request's length, failed this check on CI before).
    it = iter(stream)
    next(it)
    assert "to-drop" in client.get_load().request_ids
    stream.cancel()  # the caller goes away: the engine stops generating for it
    wait_idle(client)
    assert not client.cancel("to-drop")


def test_update_weights_installs_a_new_version(engine: tuple[LocalEngine, EngineClient]) -> None:
    e, client = engine
    before = client.generate("v0", CallMeta(), PROMPT, GREEDY)
    assert before.weight_version == 0
    new_model = varied_tiny_model(seed=1)
    # Tied embeddings: lm_head.weight is embed_tokens.weight; send it once (the parameter list).
    weights = dict(new_model.named_parameters())
    resp = client.update_weights(weights, version=1, chunk_bytes=10_000)
    assert resp.weight_version == 1 and resp.num_tensors == len(weights)
    wait_until(lambda: client.get_load().weight_version == 1, 10, "the engine to serve weight version 1")
    after = client.generate("v1", CallMeta(), PROMPT, GREEDY)
    assert after.weight_version == 1
    with torch.no_grad():
        ref = new_model.generate(torch.tensor(PROMPT[None].astype(np.int64)), max_new_tokens=24, do_sample=False)
    np.testing.assert_array_equal(after.output_ids, ref[0, len(PROMPT):].numpy())
    assert not np.array_equal(after.output_ids, before.output_ids)
    load = client.get_load()
    assert load.cell_id == "cell-a" and load.vocab_size == 512 and load.max_context == 1024
    assert e.host.engine.weight_version == 1
