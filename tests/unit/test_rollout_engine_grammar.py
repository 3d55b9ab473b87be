"""Grammar-constrained requests in the torch engine: a random-weight model on SmolLM2's real BPE
vocabulary (so JSON is writable, and nothing but the grammar makes it valid) samples schema-valid
JSON alone and batched with free requests; forced tokens and unmasked-policy logprobs are exact
against the model's own distribution; a constrained request migrates and re-prefills to the same
continuation; bad grammars and engines without a tokenizer refuse with one sentence."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch

from services.common.errors import FailedPrecondition
from services.models.source import SMOLLM2, resolve_model
from services.rollout.engine import GenRequest, SamplingParams
from services.rollout.grammar import GrammarSpec
from services.rollout.torch_engine import TorchEngine, build_tiny_model
from tests.unit.test_rollout_engine import Collector

VOCAB = 49152  # SmolLM2's
EOS = 2
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "n", "ok"], "additionalProperties": False}
SPEC = GrammarSpec("json_schema", json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def tokenizer_dir() -> str:
    return str(resolve_model(SMOLLM2))


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_tiny_model(VOCAB, hidden_size=32, seed=4)


def _engine(model: torch.nn.Module, tokenizer_dir: str | None, **kw: Any) -> TorchEngine:
    e = TorchEngine(model, device="cpu", tokenizer_dir=tokenizer_dir, **kw)
    e.start()
    return e


@pytest.fixture
def engine(model: torch.nn.Module, tokenizer_dir: str) -> Iterator[TorchEngine]:
    e = _engine(model, tokenizer_dir)
    yield e
    e.stop()


def _params(seed: int | None = 1, temperature: float = 1.0, grammar: GrammarSpec | None = SPEC) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_new_tokens=120, stop_token_ids=(EOS,), seed=seed,
                          grammar=grammar)


def _prompt(n: int = 12, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(100, 5000, n).astype(np.int32)


def _flags(col: Collector, rid: str) -> tuple[list[bool], list[float]]:
    evs = [e for e in col.events[rid] if len(e.token_ids)]
    assert all(e.forced is not None and e.policy_logprobs is not None for e in evs)
    return ([bool(x) for e in evs for x in e.forced],  # type: ignore[union-attr]
            [float(x) for e in evs for x in e.policy_logprobs])  # type: ignore[union-attr]


def test_constrained_requests_write_schema_valid_json_beside_free_ones(engine: TorchEngine, model: torch.nn.Module,
                                                                       tokenizer_dir: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    col = Collector()
    for i in range(4):  # batched: constrained rows and free rows in one decode step
        engine.submit(GenRequest(f"c{i}", _prompt(10 + i, i), _params(seed=i, temperature=0.0 if i == 0 else 1.0)), col)
        engine.submit(GenRequest(f"f{i}", _prompt(8, 10 + i), _params(seed=i, grammar=None)), col)
    for i in range(4):
        evs = col.wait(f"c{i}")
        out = col.tokens(f"c{i}")
        assert evs[-1].finish_reason == "stop" and out[-1] == EOS
        jsonschema.validate(json.loads(tok.decode(out[:-1])), SCHEMA)
        forced, policy = _flags(col, f"c{i}")
        assert len(forced) == len(out) and forced[-1]  # once closed, only EOS was allowed
        masked = col.logprobs(f"c{i}")
        assert all(p <= m + 1e-6 for p, m in zip(policy, masked))  # masking only raises the kept token's logprob
        assert all(abs(m) < 1e-6 for m, f in zip(masked, forced) if f)  # a forced token had probability 1
        free = col.wait(f"f{i}")
        assert all(e.forced is None and e.policy_logprobs is None for e in free)  # free rows: untouched, unflagged

    # the policy logprob is the unmasked model's own logprob of the token (reference forward)
    prompt, out = _prompt(10, 0), col.tokens("c0")
    ids = torch.from_numpy(np.concatenate([prompt, out]).astype(np.int64))[None]
    with torch.no_grad():
        ref = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1:-1].float(), -1)
    want = ref.gather(-1, torch.tensor(out)[:, None])[:, 0].numpy()
    np.testing.assert_allclose(_flags(col, "c0")[1], want, atol=1e-4)


@pytest.mark.parametrize("via_reprefill", [False, True])
def test_a_constrained_request_migrates_to_the_same_continuation(model: torch.nn.Module, tokenizer_dir: str,
                                                                 via_reprefill: bool) -> None:
    src, dst = _engine(model, tokenizer_dir), _engine(model, tokenizer_dir)
    try:
        ref = Collector()
        src.submit(GenRequest("ref", _prompt(), _params(seed=3)), ref)
        ref.wait("ref")
        col = Collector()
        src.submit(GenRequest("m", _prompt(), _params(seed=3)), col)
        while len(col.tokens("m")) < 5:
            col._flag("m").wait(0.01)
        state = src.export_request("m")
        before = col.tokens("m")
        moved = Collector()
        if via_reprefill:
            dst.reprefill_request(state.request, state.generated_ids, state.generated_logprobs, state.rng_state,
                                  state.weight_version, moved)
        else:
            dst.import_request(state, moved)
        moved.wait("m")
        assert before + moved.tokens("m") == ref.tokens("ref")  # the grammar resumed where it was
        assert _flags(moved, "m")[0] == _flags(ref, "ref")[0][len(before):]
    finally:
        src.stop(), dst.stop()


def test_bad_grammars_and_engines_without_a_tokenizer_refuse(engine: TorchEngine, model: torch.nn.Module) -> None:
    with pytest.raises(ValueError, match="the ebnf grammar does not compile"):
        engine.submit(GenRequest("bad", _prompt(), _params(grammar=GrammarSpec("ebnf", "root ::= missing"))), Collector())
    bare = _engine(model, None)
    try:
        with pytest.raises(FailedPrecondition, match="loaded without a tokenizer"):
            bare.submit(GenRequest("x", _prompt(), _params()), Collector())
        col = Collector()  # unconstrained requests are served as ever
        bare.submit(GenRequest("free", _prompt(), _params(grammar=None)), col)
        assert col.wait("free")[-1].finished
    finally:
        bare.stop()
    # the engine that refused keeps serving
    col = Collector()
    engine.submit(GenRequest("after", _prompt(), _params()), col)
    assert col.wait("after")[-1].finish_reason == "stop"


def test_a_grammar_the_vocabulary_cannot_spell_ends_that_request_with_an_error() -> None:
    """The built-in model's word vocabulary has no token that starts a JSON object: the request
    ends with finish_reason "error" (no NaN sampled, nothing recorded as output), and the engine
    serves the next request."""
    import json as _json

    path = resolve_model("builtin-tiny")
    vocab = int(_json.loads((path / "config.json").read_text())["vocab_size"])
    e = _engine(build_tiny_model(vocab, hidden_size=32, seed=1), str(path))
    try:
        prompt = np.arange(1, 9, dtype=np.int32)
        col = Collector()
        e.submit(GenRequest("json", prompt, SamplingParams(max_new_tokens=8, grammar=GrammarSpec("json_object"))), col)
        evs = col.wait("json")
        assert evs[-1].finish_reason == "error" and col.tokens("json") == []
        e.submit(GenRequest("free", prompt, SamplingParams(max_new_tokens=4)), col)
        assert col.wait("free")[-1].finish_reason == "length"
    finally:
        e.stop()
