"""TorchEngine: continuous batching vs HF generate, seeded sampling, migration, weights, bad input."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from services.common.errors import FailedPrecondition, NotFound
from services.rollout.engine import GenRequest, MigrationState, SamplingParams, TokenEvent
from services.rollout.sampling import pack_rng_state
from services.rollout.torch_engine import TorchEngine, build_tiny_model
from tests.support.waiting import wait_until

VOCAB = 512
torch.set_num_threads(1)


class Collector:
    """Gathers TokenEvents per request; ``wait(id)`` blocks until the request finished."""

    def __init__(self) -> None:
        self.events: dict[str, list[TokenEvent]] = {}
        self.order: list[str] = []  # request id of every event, in arrival order
        self._done: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def __call__(self, ev: TokenEvent) -> None:
        with self._lock:
            self.events.setdefault(ev.request_id, []).append(ev)
            self.order.append(ev.request_id)
            self._flag(ev.request_id)
            if ev.finished:
                self._done[ev.request_id].set()

    def _flag(self, rid: str) -> threading.Event:
        return self._done.setdefault(rid, threading.Event())

    def wait(self, rid: str, timeout: float = 60) -> list[TokenEvent]:
        with self._lock:
            flag = self._flag(rid)
        assert flag.wait(timeout), f"{rid} did not finish"
        return self.events[rid]

    def tokens(self, rid: str) -> list[int]:
        return [int(t) for ev in self.events.get(rid, []) for t in ev.token_ids]

    def logprobs(self, rid: str) -> list[float]:
        return [float(x) for ev in self.events.get(rid, []) for x in ev.logprobs]


def _prompt(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, n).astype(np.int32)


def _hf_greedy(model: torch.nn.Module, prompt: np.ndarray, n: int) -> tuple[list[int], list[float]]:
    """HF generate with transformers' own sdpa attention (an engine switches the model it serves to
    its mask-free attention; the reference must not be the code under test). Called only while
    the engines sharing ``model`` are idle."""
    impl, model.config._attn_implementation = model.config._attn_implementation, "sdpa"
    try:
        return _hf_generate(model, prompt, n)
    finally:
        model.config._attn_implementation = impl


def _hf_generate(model: torch.nn.Module, prompt: np.ndarray, n: int) -> tuple[list[int], list[float]]:
    out = model.generate(torch.tensor(prompt[None], dtype=torch.long), do_sample=False, max_new_tokens=n,
                         min_new_tokens=n, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    seq = out.sequences[0, len(prompt):].tolist()
    lps = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, seq)]
    return seq, lps


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_tiny_model(VOCAB, seed=0)


@pytest.fixture
def engine(model: torch.nn.Module) -> Iterator[TorchEngine]:
    eng = TorchEngine(model, device="cpu", max_batch_size=16)
    eng.start()
    yield eng
    eng.stop()


def _greedy(n: int, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n, **kw)  # type: ignore[arg-type]


def _sampled(n: int, seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.95, top_k=50, max_new_tokens=n, seed=seed)


# ------------------------------------------------------------------ greedy == HF generate
def test_greedy_matches_hf_generate_alone_and_batched(model: torch.nn.Module, engine: TorchEngine) -> None:
    # different lengths and budgets: rows finish at different steps (slot moves) and the 300-token
    # prompt grows the slot buffer while others are running
    lengths, budgets = [5, 17, 33, 2, 60, 9, 300], [24, 10, 30, 5, 24, 17, 90]
    prompts = [_prompt(i, n) for i, n in enumerate(lengths)]
    refs = [_hf_greedy(model, p, n) for p, n in zip(prompts, budgets)]
    alone = Collector()
    engine.submit(GenRequest("alone", prompts[1], _greedy(budgets[1])), alone)
    alone.wait("alone")
    assert alone.tokens("alone") == refs[1][0]
    batched = Collector()
    for i, (p, n) in enumerate(zip(prompts, budgets)):
        engine.submit(GenRequest(f"b{i}", p, _greedy(n)), batched)
    for i, (ref_ids, ref_lps) in enumerate(refs):
        evs = batched.wait(f"b{i}")
        assert batched.tokens(f"b{i}") == ref_ids, f"request {i} diverged from HF generate"
        np.testing.assert_allclose(batched.logprobs(f"b{i}"), ref_lps, atol=1e-4)
        assert evs[-1].finished and evs[-1].finish_reason == "length"
        assert all(ev.weight_version == 0 for ev in evs)
        # offsets index the output; events tile it exactly
        assert [ev.offset for ev in evs] == list(np.cumsum([0] + [len(ev.token_ids) for ev in evs[:-1]]))
    assert engine.load()["kv_tokens"] == 0


def test_requests_joining_mid_flight_still_match(model: torch.nn.Module, engine: TorchEngine) -> None:
    col = Collector()
    first = _prompt(10, 12)
    engine.submit(GenRequest("early", first, _greedy(40)), col)
    while len(col.tokens("early")) < 5:
        threading.Event().wait(0.005)
    late = _prompt(11, 30)
    engine.submit(GenRequest("late", late, _greedy(20)), col)
    col.wait("early"), col.wait("late")
    assert col.tokens("early") == _hf_greedy(model, first, 40)[0]
    assert col.tokens("late") == _hf_greedy(model, late, 20)[0]


def test_chunked_prefill_matches_and_interleaves(model: torch.nn.Module) -> None:
    eng = TorchEngine(model, device="cpu", prefill_chunk_tokens=16)
    eng.start()
    try:
        col = Collector()
        short, long = _prompt(20, 6), _prompt(21, 70)
        eng.submit(GenRequest("short", short, _greedy(30)), col)
        eng.submit(GenRequest("long", long, _greedy(12)), col)
        col.wait("short"), col.wait("long")
        assert col.tokens("long") == _hf_greedy(model, long, 12)[0]
        assert col.tokens("short") == _hf_greedy(model, short, 30)[0]
        # the long prompt needed 5 chunks of 16; "short" kept decoding in between
        assert col.order[: col.order.index("long")].count("short") >= 3
    finally:
        eng.stop()


def test_stop_tokens_and_context_limit(model: torch.nn.Module) -> None:
    prompt = _prompt(3, 8)
    ref, _ = _hf_greedy(model, prompt, 30)
    stop = ref[6]
    eng = TorchEngine(model, device="cpu", max_context=len(prompt) + 10)
    eng.start()
    try:
        col = Collector()
        eng.submit(GenRequest("s", prompt, _greedy(30, stop_token_ids=(stop,))), col)
        eng.submit(GenRequest("ctx", prompt, _greedy(30)), col)
        evs = col.wait("s")
        assert col.tokens("s") == ref[: ref.index(stop) + 1] and evs[-1].finish_reason == "stop"
        evs = col.wait("ctx")
        assert col.tokens("ctx") == ref[:10] and evs[-1].finish_reason == "length"
    finally:
        eng.stop()


# ------------------------------------------------------------------ seeded sampling
def test_seeded_sampling_same_alone_and_batched(engine: TorchEngine) -> None:
    prompt = _prompt(5, 20)
    alone = Collector()
    engine.submit(GenRequest("x", prompt, _sampled(30, seed=123)), alone)
    alone.wait("x")
    batched = Collector()
    engine.submit(GenRequest("x", prompt, _sampled(30, seed=123)), batched)
    for i in range(7):
        engine.submit(GenRequest(f"n{i}", _prompt(40 + i, 5 + 3 * i), _sampled(30, seed=i)), batched)
    engine.submit(GenRequest("other-seed", prompt, _sampled(30, seed=124)), batched)
    batched.wait("x"), batched.wait("other-seed")
    assert batched.tokens("x") == alone.tokens("x")
    np.testing.assert_allclose(batched.logprobs("x"), alone.logprobs("x"), atol=1e-5)
    assert batched.tokens("other-seed") != alone.tokens("x")
    assert all(lp <= 0 for lp in alone.logprobs("x"))


def test_unseeded_request_reports_its_seed(engine: TorchEngine) -> None:
    col = Collector()
    engine.submit(GenRequest("u", _prompt(6, 10), SamplingParams(max_new_tokens=12)), col)
    evs = col.wait("u")
    seed = evs[0].seed
    again = Collector()
    engine.submit(GenRequest("u2", _prompt(6, 10), SamplingParams(max_new_tokens=12, seed=seed)), again)
    again.wait("u2")
    assert again.tokens("u2") == col.tokens("u")


# ------------------------------------------------------------------ migration
def _run_and_migrate(src: TorchEngine, dst: TorchEngine, req: GenRequest, after: int,
                     via_reprefill: bool = False) -> tuple[list[int], MigrationState]:
    col = Collector()
    # neighbours keep the batch busy on both sides
    for i in range(3):
        src.submit(GenRequest(f"{req.request_id}-src-n{i}", _prompt(60 + i, 7 + i), _sampled(60, seed=i)), col)
        dst.submit(GenRequest(f"{req.request_id}-dst-n{i}", _prompt(70 + i, 4 + i), _greedy(60)), col)
    src.submit(req, col)
    while len(col.tokens(req.request_id)) < after:
        threading.Event().wait(0.002)
    state = src.export_request(req.request_id)
    evs = col.wait(req.request_id)
    assert evs[-1].finish_reason == "migrated" and len(evs[-1].token_ids) == 0
    before = col.tokens(req.request_id)
    assert before == state.generated_ids.tolist()
    moved = Collector()
    if via_reprefill:
        dst.reprefill_request(state.request, state.generated_ids, state.generated_logprobs, None,
                              state.weight_version, moved)
    else:
        dst.import_request(state, moved)
    evs = moved.wait(req.request_id)
    assert evs[0].offset == len(before)
    return before + moved.tokens(req.request_id), state


def test_freed_kv_goes_back_to_the_os_once_idle_not_while_an_export_waits(
        model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    """An export that leaves the engine idle answers before the engine gives freed pages back (a
    release takes ~0.2 s and holds the GIL); the release still comes once the engine is idle."""
    import services.rollout.torch_engine as te

    go, released = threading.Event(), threading.Event()

    def release() -> bool:  # held until the test lets it go: an export that waited on it would hang
        assert go.wait(60)
        released.set()
        return True

    monkeypatch.setattr(te, "release_free_memory", release)
    monkeypatch.setattr(te, "RELEASE_AFTER_BYTES", 0)
    monkeypatch.setattr(te, "RELEASE_IDLE_S", 0.01)
    eng = TorchEngine(model, device="cpu", max_batch_size=4)
    eng.start()
    try:
        col = Collector()
        eng.submit(GenRequest("m", _prompt(5, 12), _greedy(200)), col)
        wait_until(lambda: len(col.tokens("m")) >= 3, timeout_s=60, what="first tokens")
        state = eng.export_request("m", timeout_s=30)
        assert len(state.generated_ids) >= 3 and not released.is_set()
        go.set()
        assert released.wait(60), "the idle engine never gave its freed memory back"
    finally:
        go.set()
        eng.stop()


@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("where", ["same", "other"])
def test_export_import_continues_identically(model: torch.nn.Module, greedy: bool, where: str) -> None:
    prompt = _prompt(8, 25)
    params = _greedy(60) if greedy else _sampled(60, seed=99)
    src = TorchEngine(model, device="cpu")
    dst = src if where == "same" else TorchEngine(build_tiny_model(VOCAB, seed=0), device="cpu")
    for e in {src, dst}:
        e.start()
    try:
        ref = Collector()
        src.submit(GenRequest("ref", prompt, params), ref)
        ref.wait("ref")
        got, state = _run_and_migrate(src, dst, GenRequest("m", prompt, params), after=6)
        assert got == ref.tokens("ref")
        assert state.kv and state.kv_tokens == len(prompt) + len(state.generated_ids) - 1
        assert state.kv[0][0].shape == (2, state.kv_tokens, 16)
    finally:
        for e in {src, dst}:
            e.stop()


@pytest.mark.parametrize("greedy", [True, False])
def test_reprefill_without_rng_state_continues_identically(model: torch.nn.Module, greedy: bool) -> None:
    prompt = _prompt(9, 30)
    params = _greedy(30) if greedy else _sampled(30, seed=7)
    a, b = TorchEngine(model, device="cpu"), TorchEngine(build_tiny_model(VOCAB, seed=0), device="cpu")
    a.start(), b.start()
    try:
        ref = Collector()
        a.submit(GenRequest("ref", prompt, params), ref)
        ref.wait("ref")
        got, _ = _run_and_migrate(a, b, GenRequest("m", prompt, params), after=4, via_reprefill=True)
        assert got == ref.tokens("ref")
    finally:
        a.stop(), b.stop()


def test_export_unknown_and_import_validation(engine: TorchEngine) -> None:
    with pytest.raises(NotFound):
        engine.export_request("nope")
    assert engine.cancel("nope") is False
    req = GenRequest("bad", _prompt(1, 10), _greedy(10))
    gen = np.array([1, 2, 3], np.int32)
    good_kv = [(np.zeros((2, 12, 16), np.float32), np.zeros((2, 12, 16), np.float32))] * 2
    with pytest.raises(ValueError, match="layers"):
        engine.import_request(MigrationState(req, gen, np.zeros(3, np.float32), pack_rng_state(1, 3), 0,
                                             kv=good_kv[:1]), lambda ev: None)
    wrong_heads = [(np.zeros((4, 12, 8), np.float32), np.zeros((4, 12, 8), np.float32))] * 2
    with pytest.raises(ValueError, match="model needs"):
        engine.import_request(MigrationState(req, gen, np.zeros(3, np.float32), pack_rng_state(1, 3), 0,
                                             kv=wrong_heads), lambda ev: None)
    with pytest.raises(ValueError, match="counter"):
        engine.import_request(MigrationState(req, gen, np.zeros(3, np.float32), pack_rng_state(1, 2), 0,
                                             kv=good_kv), lambda ev: None)
    with pytest.raises(ValueError, match="rng_state"):
        engine.import_request(MigrationState(req, gen, np.zeros(3, np.float32), b"junk", 0), lambda ev: None)
    with pytest.raises(ValueError):  # kv length must be prompt + generated - 1
        MigrationState(req, gen, np.zeros(3, np.float32), pack_rng_state(1, 3), 0,
                       kv=[(np.zeros((2, 13, 16), np.float32), np.zeros((2, 13, 16), np.float32))])


# ------------------------------------------------------------------ weights
def _perturbed(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: p.detach() + 0.5 * torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}


def test_weight_update_recompute_reports_versions(model: torch.nn.Module) -> None:
    own = build_tiny_model(VOCAB, seed=0)
    new_sd = _perturbed(own, 1)
    eng = TorchEngine(own, device="cpu", weight_policy="recompute")
    eng.start()
    try:
        prompt = _prompt(12, 16)
        col = Collector()
        eng.submit(GenRequest("w", prompt, _greedy(60)), col)
        while len(col.tokens("w")) < 5:
            threading.Event().wait(0.002)
        eng.update_weights(new_sd, version=1)
        assert eng.wait_weight_version(1, timeout_s=30)
        evs = col.wait("w")
        versions = [ev.weight_version for ev in evs for _ in ev.token_ids]
        assert versions == sorted(versions) and versions[0] == 0 and versions[-1] == 1
        n_old = versions.count(0)
        toks = col.tokens("w")
        assert toks[:n_old] == _hf_greedy(model, prompt, n_old)[0]
        # after the switch: the new model's greedy continuation of prompt + old tokens
        new_model = build_tiny_model(VOCAB, seed=0)
        new_model.load_state_dict(new_sd, strict=False)
        ctx = np.concatenate([prompt, np.array(toks[:n_old], np.int32)])
        assert toks[n_old:] == _hf_greedy(new_model, ctx, 60 - n_old)[0]
        after = Collector()
        eng.submit(GenRequest("after", prompt, _greedy(8)), after)
        assert all(ev.weight_version == 1 for ev in after.wait("after"))
        assert after.tokens("after") == _hf_greedy(new_model, prompt, 8)[0]
    finally:
        eng.stop()


def test_weight_update_finish_on_old_never_mixes(model: torch.nn.Module) -> None:
    own = build_tiny_model(VOCAB, seed=0)
    eng = TorchEngine(own, device="cpu", weight_policy="finish_on_old")
    eng.start()
    try:
        prompt = _prompt(13, 16)
        col = Collector()
        eng.submit(GenRequest("old", prompt, _greedy(50)), col)
        while len(col.tokens("old")) < 3:
            threading.Event().wait(0.002)
        eng.update_weights(_perturbed(own, 2), version=1)
        eng.submit(GenRequest("new", prompt, _greedy(5)), col)
        evs = col.wait("old")
        assert all(ev.weight_version == 0 for ev in evs)
        assert col.tokens("old") == _hf_greedy(model, prompt, 50)[0]
        assert all(ev.weight_version == 1 for ev in col.wait("new"))
        # a resume whose tokens came from version 0 may not continue on version 1
        req = GenRequest("late", prompt, _greedy(10))
        with pytest.raises(FailedPrecondition, match="finish_on_old"):
            eng.reprefill_request(req, np.array([1, 2], np.int32), np.zeros(2, np.float32), None, 0,
                                  lambda ev: None)
    finally:
        eng.stop()


def test_update_weights_validation(engine: TorchEngine) -> None:
    with pytest.raises(ValueError, match="unknown parameter"):
        engine.update_weights({"nope.weight": torch.zeros(1)}, version=1)
    name, p = next(iter(engine.model.named_parameters()))
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights({name: torch.zeros(3, 3)}, version=1)
    with pytest.raises(ValueError, match="not newer"):
        engine.update_weights({name: p.detach().clone()}, version=0)
    with pytest.raises(ValueError, match="empty"):
        engine.update_weights({}, version=1)


# ------------------------------------------------------------------ bad input, cancel, load
def test_bad_requests_are_value_errors(engine: TorchEngine) -> None:
    cb = Collector()
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.submit(GenRequest("a", np.array([1, VOCAB], np.int32), _greedy(4)), cb)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.submit(GenRequest("a", np.array([-1, 2], np.int32), _greedy(4)), cb)
    with pytest.raises(ValueError, match="empty"):
        engine.submit(GenRequest("a", np.array([], np.int32), _greedy(4)), cb)
    with pytest.raises(ValueError, match="context"):
        engine.submit(GenRequest("a", np.zeros(engine.max_context, np.int32), _greedy(4)), cb)
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine.submit(GenRequest("a", np.array([1], np.int32), _greedy(4, stop_token_ids=(VOCAB + 3,))), cb)
    with pytest.raises(ValueError, match="1-D"):
        GenRequest("a", np.zeros((2, 2), np.int32), _greedy(4))
    with pytest.raises(ValueError, match="integer"):
        GenRequest("a", np.array([0.5]), _greedy(4))
    for bad in (dict(temperature=-1.0), dict(temperature=float("nan")), dict(top_p=0.0), dict(top_p=1.5),
                dict(top_k=-1), dict(max_new_tokens=0), dict(seed=-3), dict(seed=2**64),
                dict(stop_token_ids=(-2,))):
        with pytest.raises(ValueError):
            SamplingParams(**bad)  # type: ignore[arg-type]
    engine.submit(GenRequest("dup", _prompt(1, 4), _greedy(200)), cb)
    with pytest.raises(ValueError, match="already active"):
        engine.submit(GenRequest("dup", _prompt(1, 4), _greedy(4)), cb)
    assert "dup" in engine.active_requests()
    assert engine.load()["active"] >= 1
    assert engine.cancel("dup") is True
    evs = cb.wait("dup")
    assert evs[-1].finish_reason == "aborted"
    assert "dup" not in engine.active_requests()


def test_stop_aborts_in_flight_and_rejects_new(model: torch.nn.Module) -> None:
    eng = TorchEngine(model, device="cpu")
    eng.start()
    col = Collector()
    eng.submit(GenRequest("long", _prompt(2, 8), _greedy(10_000)), col)
    while not col.tokens("long"):
        threading.Event().wait(0.002)
    eng.stop(drain=False)
    assert col.wait("long")[-1].finish_reason == "aborted"
    with pytest.raises(FailedPrecondition):
        eng.submit(GenRequest("x", _prompt(2, 8), _greedy(4)), col)


def test_full_state_dict_with_tied_embeddings_installs() -> None:
    """A trainer publishes state_dict() (tied lm_head.weight included); the engine must install it."""

    from services.rollout.engine import GenRequest, SamplingParams
    from services.rollout.torch_engine import TorchEngine, build_tiny_model

    model = build_tiny_model()
    assert model.config.tie_word_embeddings and "lm_head.weight" in model.state_dict()
    engine = TorchEngine(model, model_name="tied")
    engine.start()
    try:
        sd = {k: v.clone() + 0.01 for k, v in model.state_dict().items()}
        engine.update_weights(sd, version=1)
        assert engine.wait_weight_version(1, timeout_s=30)
        events = []
        engine.submit(GenRequest(request_id="r", prompt_ids=np.array([1, 2, 3], dtype=np.int32),
                                 params=SamplingParams(temperature=0.0, max_new_tokens=3)), events.append)
        wait_until(lambda: events and events[-1].finished, 30, "the request to finish")
        assert events[-1].finished and events[-1].finish_reason == "length" and events[-1].weight_version == 1
    finally:
        engine.stop()


# ------------------------------------------------------------------ long contexts, no dense masks
def test_lower_right_attention_equals_the_masked_reference() -> None:
    from services.rollout.attention import lower_right_causal

    gen = torch.Generator().manual_seed(0)
    for q_len, keys in ((5, 5), (7, 30), (1, 9), (64, 1000)):
        q = torch.randn(2, 4, q_len, 32, generator=gen)
        k, v = torch.randn(2, 2, keys, 32, generator=gen), torch.randn(2, 2, keys, 32, generator=gen)
        mask = torch.ones(q_len, keys, dtype=torch.bool).tril(keys - q_len)  # query i sees keys <= past + i
        ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                               attn_mask=mask)
        torch.testing.assert_close(lower_right_causal(q, k, v, 32 ** -0.5), ref, atol=1e-5, rtol=1e-5)


def test_long_chunked_prefill_builds_no_context_sized_mask(model: torch.nn.Module,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from services.rollout import attention

    masks: list[tuple[int, ...]] = []
    sdpa = attention.F.scaled_dot_product_attention

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        mask = kwargs.get("attn_mask")
        if isinstance(mask, torch.Tensor):
            masks.append(tuple(mask.shape))
        return sdpa(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    eng = TorchEngine(model, device="cpu", prefill_chunk_tokens=256)
    eng.start()
    try:
        col = Collector()
        long = _prompt(30, 1500)  # 6 chunks: five of them meet a cache that already holds keys
        eng.submit(GenRequest("long", long, _greedy(6)), col)
        col.wait("long")
        assert masks == []  # one request alone: prefill and decode pass no mask at all
        short = _prompt(31, 40)
        eng.submit(GenRequest("l2", long, _greedy(30)), col)
        eng.submit(GenRequest("short", short, _greedy(30)), col)
        col.wait("l2"), col.wait("short")
    finally:
        eng.stop()
    # rows of different lengths decode with a per-row length mask: rows x keys, never queries x keys
    assert masks and all(shape[1:3] == (1, 1) and shape[0] <= 2 for shape in masks)
    assert col.tokens("long") == _hf_greedy(model, long, 6)[0]
    assert col.tokens("short") == _hf_greedy(model, short, 30)[0]


def test_kv_budget_must_hold_one_full_length_request(model: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match="cannot hold one full-length request of 4096 tokens"):
        TorchEngine(model, device="cpu", kv_capacity_tokens=1000)
    assert TorchEngine(model, device="cpu").kv_capacity_tokens == 65_536
    assert TorchEngine(model, device="cpu", max_context=512, kv_capacity_tokens=512).kv_capacity_tokens == 512
