"""The static decode forward (the shape a CUDA graph replays) against the default decode, on CPU.

The engine runs it eagerly here (``static_decode=True``): fixed buckets, padding rows, a mask over
the whole token capacity. Tokens and log-probabilities must equal the default path's in fp32.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest
import torch

from services.rollout.engine import GenRequest
from services.rollout.kv_slots import SlotKV
from services.rollout.static_decode import StaticDecode, decode_buckets
from services.rollout.torch_engine import TorchEngine, build_tiny_model
from tests.unit.test_rollout_engine import VOCAB, Collector, _greedy, _perturbed, _prompt, _sampled

Scenario = Callable[[TorchEngine, Collector], list[str]]


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_tiny_model(VOCAB, seed=0)


def _both(model: torch.nn.Module, scenario: Scenario, **kw: object) -> tuple[dict, dict, TorchEngine]:
    """Run ``scenario`` on a default and a static engine; per request (tokens, logprobs) of each."""
    results = []
    for static in (False, True):
        eng = TorchEngine(model, device="cpu", static_decode=static, **kw)  # type: ignore[arg-type]
        eng.start()
        try:
            col = Collector()
            ids = scenario(eng, col)
            for rid in ids:
                col.wait(rid)
        finally:
            eng.stop()
        results.append({rid: (col.tokens(rid), col.logprobs(rid)) for rid in ids})
    assert eng._static is not None
    return results[0], results[1], eng


def _assert_same(default: dict, static: dict) -> None:
    assert default.keys() == static.keys()
    for rid, (toks, lps) in default.items():
        assert static[rid][0] == toks, f"{rid}: static decode changed the tokens"
        np.testing.assert_allclose(static[rid][1], lps, atol=1e-5, rtol=0, err_msg=rid)


def _wait_tokens(col: Collector, rid: str, n: int) -> None:
    while len(col.tokens(rid)) < n:
        threading.Event().wait(0.002)


def test_buckets_pad_to_powers_of_two_then_steps_of_eight() -> None:
    assert decode_buckets(1) == (1,)
    assert decode_buckets(3) == (1, 2, 4)
    assert decode_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert decode_buckets(65)[-1] == 72


def test_the_default_cpu_engine_keeps_the_dynamic_decode(model: torch.nn.Module) -> None:
    assert TorchEngine(model, device="cpu")._static is None
    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device"):
        TorchEngine(model, device="cpu", cuda_graphs=True)


def test_one_request_equals_the_default_path(model: torch.nn.Module) -> None:
    def one(eng: TorchEngine, col: Collector) -> list[str]:
        eng.submit(GenRequest("a", _prompt(1, 9), _greedy(40)), col)
        return ["a"]

    default, static, _ = _both(model, one)
    _assert_same(default, static)


def test_three_lengths_padded_to_a_bucket_of_four(model: torch.nn.Module) -> None:
    def three(eng: TorchEngine, col: Collector) -> list[str]:
        for i, n in enumerate((3, 21, 50)):
            eng.submit(GenRequest(f"r{i}", _prompt(10 + i, n), _greedy(30)), col)
        eng.submit(GenRequest("s", _prompt(13, 7), _sampled(30, seed=5)), col)  # seeded sampling too
        return ["r0", "r1", "r2", "s"]

    default, static, eng = _both(model, three)
    _assert_same(default, static)
    assert eng._static is not None and eng._static.bucket(3) == 4


def test_requests_joining_and_leaving_mid_decode(model: torch.nn.Module) -> None:
    """Rows finish at different steps (the last row moves into the freed slot) while others join:
    the batch walks through buckets 1, 2, 4 and 8 and back."""

    def churn(eng: TorchEngine, col: Collector) -> list[str]:
        eng.submit(GenRequest("early", _prompt(20, 12), _greedy(70)), col)
        _wait_tokens(col, "early", 5)
        for i in range(6):
            eng.submit(GenRequest(f"j{i}", _prompt(30 + i, 4 + 9 * i), _greedy(6 + 7 * i)), col)
        _wait_tokens(col, "j3", 20)
        eng.submit(GenRequest("late", _prompt(40, 25), _greedy(15)), col)
        return ["early", "late"] + [f"j{i}" for i in range(6)]

    default, static, _ = _both(model, churn)
    _assert_same(default, static)


def test_capacity_growth_in_the_middle_of_decoding(model: torch.nn.Module) -> None:
    """A 200-token prompt decodes past the 256-token buffer: the slot buffers are reallocated
    mid-decode (a new capacity: a new shape for the static forward) beside a shorter request."""

    def grow(eng: TorchEngine, col: Collector) -> list[str]:
        eng.submit(GenRequest("long", _prompt(50, 200), _greedy(120)), col)
        eng.submit(GenRequest("short", _prompt(51, 10), _greedy(90)), col)
        return ["long", "short"]

    default, static, eng = _both(model, grow)
    _assert_same(default, static)
    assert eng._slots.generation >= 2  # grown at least once after the first allocation


def _default(model: torch.nn.Module, prompt: np.ndarray, n: int) -> tuple[list[int], list[float]]:
    eng = TorchEngine(model, device="cpu")
    eng.start()
    try:
        col = Collector()
        eng.submit(GenRequest("ref", prompt, _greedy(n)), col)
        col.wait("ref")
    finally:
        eng.stop()
    return col.tokens("ref"), col.logprobs("ref")


def test_weights_installed_mid_decode_are_used(model: torch.nn.Module) -> None:
    """recompute policy: the tokens before the install are the old weights' (default path), the
    ones after are the new weights' continuation of the context so far."""
    new_sd = _perturbed(model, 3)
    prompt = _prompt(60, 16)
    eng = TorchEngine(build_tiny_model(VOCAB, seed=0), device="cpu", static_decode=True)
    eng.start()
    try:
        col = Collector()
        eng.submit(GenRequest("w", prompt, _greedy(50)), col)
        eng.submit(GenRequest("v", _prompt(61, 5), _greedy(40)), col)
        _wait_tokens(col, "w", 5)
        eng.update_weights(new_sd, version=1)
        evs = col.wait("w")
        col.wait("v")
    finally:
        eng.stop()
    n_old = sum(len(ev.token_ids) for ev in evs if ev.weight_version == 0)
    toks, lps = col.tokens("w"), col.logprobs("w")
    assert 0 < n_old < 50
    new_model = build_tiny_model(VOCAB, seed=0)
    new_model.load_state_dict(new_sd, strict=False)
    old_ref = _default(model, prompt, n_old)
    new_ref = _default(new_model, np.concatenate([prompt, np.asarray(toks[:n_old], np.int32)]), 50 - n_old)
    _assert_same({"w": old_ref}, {"w": (toks[:n_old], lps[:n_old])})
    _assert_same({"w": new_ref}, {"w": (toks[n_old:], lps[n_old:])})


def test_padding_rows_stay_finite_and_never_touch_occupied_rows(model: torch.nn.Module) -> None:
    """Free rows full of NaN (torch.empty may hold anything) are zeroed once static decode starts;
    the padding row writes only its own free row, and the logits of the real rows equal the
    default step's."""
    cfg = model.config
    kw = dict(num_layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
              dtype=torch.float32, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    lengths = (5, 30, 12)
    kv = [[(torch.randn(2, n, 16, generator=gen), torch.randn(2, n, 16, generator=gen)) for _ in range(2)]
          for n in lengths]
    dynamic, static = SlotKV(**kw), SlotKV(**kw)  # type: ignore[arg-type]
    for buf in static.keys + static.values:
        buf.fill_(float("nan"))
    for slots in (dynamic, static):
        for layer_kv, n in zip(kv, lengths):
            slots.add(layer_kv, n)
    last = np.array([7, 8, 9], np.int64)
    cache_kw = TorchEngine(model, device="cpu")._cache_kw  # (the engine also installs its attention)
    decoder = StaticDecode(model, static, cache_kw=cache_kw, max_batch_size=8, graphs=False)
    with torch.no_grad():
        got = decoder.logits(last)
        mask = dynamic.begin_step()
        try:
            want = model(input_ids=torch.from_numpy(last)[:, None], position_ids=dynamic.positions(),
                         attention_mask=mask, use_cache=True, **{cache_kw: dynamic}).logits[:, -1]
        finally:
            dynamic.end_step()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert static.slot_capacity == 4 and all(bool(buf.isfinite().all()) for buf in static.keys + static.values)
    for k_static, k_dynamic in zip(static.keys + static.values, dynamic.keys + dynamic.values):
        torch.testing.assert_close(k_static[:3], k_dynamic[:3], atol=1e-6, rtol=0)  # each row + its new key
        assert bool((k_static[3, :, 1:] == 0).all()) and bool((k_static[3, :, 0] != 0).any())  # padding: position 0
    assert static.lens.tolist() == dynamic.lens.tolist() == [6, 31, 13, 0]
