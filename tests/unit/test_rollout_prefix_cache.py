"""Prefix KV reuse: the token-keyed cache's rules, and an engine that reuses equals one that does not."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.rollout.engine import GenRequest, SamplingParams
from services.rollout.prefix_cache import PrefixCache
from services.rollout.torch_engine import TorchEngine, build_tiny_model
from tests.unit.test_rollout_engine import Collector

torch.set_num_threads(1)


def kv_of(ids: np.ndarray) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Stand-in KV whose values encode the token ids (so a test can see which entry was reused)."""
    t = torch.from_numpy(ids.astype(np.float32))[None, :, None].expand(1, len(ids), 2).clone()
    return [(t, t.clone())]


def ids(*parts: np.ndarray | list[int]) -> np.ndarray:
    return np.concatenate([np.asarray(p, np.int32) for p in parts])


def test_longest_prefix_version_rule_and_collisions_are_exact() -> None:
    cache = PrefixCache(budget_bytes=1 << 20, bytes_per_token=16, block_tokens=4)
    system = np.arange(10, 30, dtype=np.int32)
    a, b = ids(system, [1, 2, 3]), ids(system, [7, 8, 9, 10, 11])
    cache.insert(a, kv_of(a), version=0)
    cache.insert(b, kv_of(b), version=0)
    hit = cache.lookup(ids(system, [7, 8, 9, 99]), version=0)
    assert hit is not None and hit.entry.ids.tolist() == b.tolist() and hit.tokens == len(system) + 3
    hit = cache.lookup(ids(system, [1, 2]), version=0)  # shorter than the entry: its own length
    assert hit is not None and hit.tokens == len(system) + 2
    assert cache.lookup(ids([5], system), version=0) is None  # differs at token 0
    assert cache.lookup(a, version=1) is None  # KV of another weight version is never reused
    short = np.array([10, 11], np.int32)  # no whole block in common: still found token by token
    hit = cache.lookup(short, version=0)
    assert hit is not None and hit.tokens == 2
    cache.clear()
    assert len(cache) == 0 and cache.tokens == 0 and cache.lookup(a, version=0) is None


def test_a_longer_call_supersedes_its_prefix_and_the_budget_evicts_least_recent() -> None:
    cache = PrefixCache(budget_bytes=100 * 8, bytes_per_token=8, block_tokens=8)  # 100 tokens
    turn1 = np.arange(1, 41, dtype=np.int32)
    cache.insert(turn1, kv_of(turn1), version=0)
    turn2 = ids(turn1, np.arange(50, 70))  # the same agent's next call: turn1 is its prefix
    cache.insert(turn2, kv_of(turn2), version=0)
    assert len(cache) == 1 and cache.tokens == 60  # turn1 was dropped: turn2 covers it
    other = np.arange(200, 240, dtype=np.int32)
    cache.insert(other, kv_of(other), version=0)  # 100 tokens: at the budget
    assert cache.lookup(turn2, version=0) is not None  # touched: now the most recent
    third = np.arange(300, 330, dtype=np.int32)
    cache.insert(third, kv_of(third), version=0)  # over budget: the least recently used (other) goes
    assert cache.lookup(other, version=0) is None and cache.lookup(turn2, version=0) is not None
    assert cache.tokens == 90
    huge = np.arange(1000, 1200, dtype=np.int32)
    cache.insert(huge, kv_of(huge), version=0)  # larger than the whole budget: not kept
    assert cache.lookup(huge, version=0) is None and cache.tokens == 90


def _run(engine: TorchEngine, rid: str, prompt: np.ndarray, n: int) -> tuple[list[int], list[float]]:
    col = Collector()
    engine.submit(GenRequest(rid, prompt, SamplingParams(temperature=0.0, max_new_tokens=n)), col)
    col.wait(rid)
    return col.tokens(rid), col.logprobs(rid)


@pytest.mark.parametrize("chunk", [64, 4096])
def test_an_agents_next_call_reuses_its_context_exactly(chunk: int) -> None:
    model = build_tiny_model(512, seed=1)
    cached = TorchEngine(model, device="cpu", prefill_chunk_tokens=chunk)
    plain = TorchEngine(build_tiny_model(512, seed=1), device="cpu", prefill_chunk_tokens=chunk,
                        prefix_cache_bytes=0)
    cached.start(), plain.start()
    try:
        rng = np.random.default_rng(0)
        context = rng.integers(0, 512, 700).astype(np.int32)
        for turn in range(4):  # call N = calls 1..N-1 + their outputs + a tool result
            out_c, lp_c = _run(cached, f"c{turn}", context, 12)
            out_p, lp_p = _run(plain, f"p{turn}", context, 12)
            assert out_c == out_p, f"turn {turn}: reuse changed the greedy tokens"
            np.testing.assert_allclose(lp_c, lp_p, atol=1e-4)
            context = np.concatenate([context, np.asarray(out_c, np.int32), rng.integers(0, 512, 150).astype(np.int32)])
        stats = cached.prefix_stats()
        # each later call prefilled only its new tail: the tool result (the last output token, whose
        # key was never computed, plus 150)
        assert stats["reused_tokens"] == sum(700 + k * 162 + 11 for k in range(3))
        assert stats["prefilled_tokens"] == stats["prompt_tokens"] - stats["reused_tokens"] == 700 + 3 * 151
        assert plain.prefix_stats()["reused_tokens"] == 0
        assert len(cached.prefix_cache) == 1  # each call superseded the previous one
    finally:
        cached.stop(), plain.stop()


def test_new_weights_never_reuse_old_kv_and_siblings_share_the_prefix() -> None:
    model = build_tiny_model(512, seed=2)
    engine = TorchEngine(model, device="cpu", prefill_chunk_tokens=128)
    engine.start()
    try:
        rng = np.random.default_rng(1)
        system = rng.integers(0, 512, 400).astype(np.int32)
        _run(engine, "a", np.concatenate([system, [5, 6, 7]]).astype(np.int32), 4)
        before = engine.prefix_stats()["reused_tokens"]
        _run(engine, "sibling", np.concatenate([system, [9, 9]]).astype(np.int32), 4)  # a retry from the branch
        assert engine.prefix_stats()["reused_tokens"] - before == len(system)
        new_state = {n: t * 1.01 for n, t in model.state_dict().items() if n.endswith("proj.weight")}
        engine.update_weights(new_state, 1)
        assert engine.wait_weight_version(1, 30)
        before = engine.prefix_stats()["reused_tokens"]
        got = _run(engine, "after", np.concatenate([system, [5, 6, 7]]).astype(np.int32), 4)
        assert engine.prefix_stats()["reused_tokens"] == before  # the cache was of version 0
        fresh = TorchEngine(model, device="cpu", prefix_cache_bytes=0, weight_version=1)  # same model object
        fresh.start()
        try:
            assert _run(fresh, "ref", np.concatenate([system, [5, 6, 7]]).astype(np.int32), 4) == got
        finally:
            fresh.stop()
    finally:
        engine.stop()


def test_a_budget_that_cannot_hold_one_full_request_is_a_config_error() -> None:
    with pytest.raises(ValueError, match="cannot hold one full-length request"):
        TorchEngine(build_tiny_model(512), device="cpu", prefix_cache_bytes=1 << 10)
    assert not TorchEngine(build_tiny_model(512), device="cpu", prefix_cache_bytes=0).prefix_cache.enabled


def test_a_lookup_compares_a_bounded_number_of_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    """A thousand executions share a system prompt: a lookup still compares at most MAX_CANDIDATES
    entries token by token (its cost does not grow with the calls cached), and finds the newest."""
    from services.rollout import prefix_cache

    cache = PrefixCache(budget_bytes=1 << 30, bytes_per_token=4, block_tokens=64)
    system = np.arange(1, 257, dtype=np.int32)
    for e in range(1000):
        own = ids(system, [1000 + e, 7, 7])
        cache.insert(own, kv_of(own), version=0)
    compared = []
    real = prefix_cache.np.flatnonzero
    monkeypatch.setattr(prefix_cache.np, "flatnonzero", lambda a: compared.append(1) or real(a))
    hit = cache.lookup(ids(system, [1999, 7, 5]), version=0)
    assert hit is not None and hit.tokens == len(system) + 2 and hit.entry.ids[len(system)] == 1999
    assert len(compared) <= prefix_cache.MAX_CANDIDATES
    assert cache.lookup(ids(system, [5]), version=0).tokens == len(system)  # type: ignore[union-attr]
