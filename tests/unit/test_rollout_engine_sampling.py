"""Sampling (counter RNG, top-k/top-p, logprobs) and the sglang adapter's request/response mapping."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.rollout.engine import GenRequest, SamplingParams
from services.rollout.sampling import (
    counter_uniforms,
    pack_rng_state,
    sample_tokens,
    unpack_rng_state,
)
from services.rollout.sglang_engine import generate_payload, iter_sse, parse_chunk


def _params(b: int, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0) -> tuple[torch.Tensor, ...]:
    return (torch.full((b,), temperature), torch.full((b,), top_p), torch.full((b,), top_k, dtype=torch.long))


def test_counter_uniforms_are_deterministic_and_independent_of_batch() -> None:
    seeds = np.array([1, 2, 3, 2**64 - 1], np.uint64)
    counters = np.array([0, 5, 9, 1], np.uint64)
    u = counter_uniforms(seeds, counters)
    assert ((u >= 0) & (u < 1)).all()
    for i in range(4):
        assert counter_uniforms(seeds[i : i + 1], counters[i : i + 1])[0] == u[i]
    many = counter_uniforms(np.full(20000, 7, np.uint64), np.arange(20000, dtype=np.uint64))
    assert abs(many.mean() - 0.5) < 0.01 and len(np.unique(many)) == 20000


def test_rng_state_round_trip_and_rejects_junk() -> None:
    assert unpack_rng_state(pack_rng_state(2**64 - 5, 17)) == (2**64 - 5, 17)
    with pytest.raises(ValueError):
        unpack_rng_state(b"nope")
    with pytest.raises(ValueError):
        unpack_rng_state(b"XXXX" + bytes(16))


def test_greedy_rows_take_argmax_with_raw_logprob() -> None:
    logits = torch.randn(3, 50)
    tok, lp = sample_tokens(logits, *_params(3, temperature=0.0), torch.rand(3))
    assert tok.tolist() == logits.argmax(-1).tolist()
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1).gather(1, tok[:, None])[:, 0])


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    logits = torch.randn(4, 100)
    u = torch.rand(4, dtype=torch.float64)
    k1, _ = sample_tokens(logits, *_params(4, temperature=1.3, top_k=1), u)
    p0, _ = sample_tokens(logits, *_params(4, temperature=1.3, top_p=1e-6), u)
    assert k1.tolist() == p0.tolist() == logits.argmax(-1).tolist()


def test_sampled_logprob_is_temperature_scaled_full_vocab() -> None:
    logits = torch.randn(2, 64)
    tok, lp = sample_tokens(logits, *_params(2, temperature=0.7, top_k=5), torch.tensor([0.3, 0.9], dtype=torch.float64))
    expect = torch.log_softmax(logits / 0.7, -1).gather(1, tok[:, None])[:, 0]
    torch.testing.assert_close(lp, expect)
    # top-k=5 keeps the sampled token within the 5 most likely
    top5 = logits.topk(5, dim=-1).indices
    assert all(int(t) in top5[i].tolist() for i, t in enumerate(tok))


def test_empirical_distribution_matches_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    n = 20000
    u = torch.from_numpy(counter_uniforms(np.full(n, 3, np.uint64), np.arange(n, dtype=np.uint64)))
    tok, _ = sample_tokens(logits.expand(n, 4), *_params(n), u)
    freq = np.bincount(tok.numpy(), minlength=4) / n
    np.testing.assert_allclose(freq, torch.softmax(logits[0], -1).numpy(), atol=0.015)
    # top_p=0.7 keeps tokens 0 and 1 (0.64 + 0.24 >= 0.7), renormalized
    tok, _ = sample_tokens(logits.expand(n, 4), *_params(n, top_p=0.7), u)
    freq = np.bincount(tok.numpy(), minlength=4) / n
    p = torch.softmax(logits[0], -1).numpy()[:2]
    np.testing.assert_allclose(freq[:2], p / p.sum(), atol=0.015)
    assert freq[2:].sum() == 0


def test_row_result_does_not_depend_on_neighbours() -> None:
    logits = torch.randn(1, 80)
    u = torch.tensor([0.4242], dtype=torch.float64)
    alone, _ = sample_tokens(logits, *_params(1, temperature=0.8), u)
    mixed_logits = torch.cat([torch.randn(2, 80), logits])
    temps = torch.tensor([0.0, 1.0, 0.8])
    top_p = torch.tensor([1.0, 0.5, 1.0])
    top_k = torch.tensor([0, 10, 0])
    mixed, _ = sample_tokens(mixed_logits, temps, top_p, top_k, torch.tensor([0.1, 0.2, 0.4242], dtype=torch.float64))
    assert mixed[2] == alone[0]


# ------------------------------------------------------------------ sglang mapping (unverified adapter)
def test_sglang_payload_maps_params() -> None:
    req = GenRequest("r1", np.array([5, 6, 7], np.int32),
                     SamplingParams(temperature=0.5, top_p=0.9, top_k=0, max_new_tokens=10, stop_token_ids=(2,), seed=4))
    body = generate_payload(req)
    assert body["input_ids"] == [5, 6, 7] and body["return_logprob"] and body["rid"] == "r1"
    sp = body["sampling_params"]
    assert sp["top_k"] == -1 and sp["max_new_tokens"] == 10 and sp["stop_token_ids"] == [2]
    assert sp["sampling_seed"] == 4 and sp["temperature"] == 0.5
    resumed = generate_payload(req, np.array([9, 9], np.int32))
    assert resumed["input_ids"] == [5, 6, 7, 9, 9] and resumed["sampling_params"]["max_new_tokens"] == 8


def test_sglang_chunks_cumulative_and_incremental() -> None:
    cumulative = [
        {"output_ids": [11], "meta_info": {"completion_tokens": 1, "output_token_logprobs": [[-0.5, 11, None]],
                                           "finish_reason": None}},
        {"output_ids": [11, 12, 13], "meta_info": {"completion_tokens": 3, "weight_version": "4",
                                                   "output_token_logprobs": [[-0.5, 11, None], [-1.0, 12, None],
                                                                             [-2.0, 13, None]],
                                                   "finish_reason": {"type": "stop", "matched": 13}}},
    ]
    ids, lps, reason, version = parse_chunk(cumulative[0], 0)
    assert ids.tolist() == [11] and reason is None and version is None
    ids, lps, reason, version = parse_chunk(cumulative[1], 1)
    assert ids.tolist() == [12, 13] and lps.tolist() == [-1.0, -2.0] and reason == "stop" and version == 4
    incremental = {"output_ids": [14], "meta_info": {"completion_tokens": 4, "output_token_logprobs": [[-0.1, 14, None]],
                                                     "finish_reason": {"type": "length", "length": 4}}}
    ids, _, reason, _ = parse_chunk(incremental, 3)
    assert ids.tolist() == [14] and reason == "length"
    abort = {"output_ids": [], "meta_info": {"completion_tokens": 0, "finish_reason": {"type": "abort"}}}
    assert parse_chunk(abort, 0)[2] == "aborted"
    with pytest.raises(ValueError):
        parse_chunk({"output_ids": [1, 2], "meta_info": {"completion_tokens": 5, "output_token_logprobs": [[0, 1, None]]}}, 0)


def test_sglang_sse_parsing() -> None:
    lines = [b"data: {\"a\": 1}\n", b"\n", b": keepalive\n", b"data: {\"a\": 2}\n", b"data: [DONE]\n", b"data: {\"a\": 3}\n"]
    assert [c["a"] for c in iter_sse(iter(lines))] == [1, 2]
