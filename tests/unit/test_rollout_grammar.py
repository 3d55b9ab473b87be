"""Schema-constrained decoding's pieces (services/rollout/grammar.py) on SmolLM2's real BPE vocabulary:
specs are validated with one sentence, sampling under a grammar always yields matching text,
the recorded log-probabilities relate the masked and the unmasked distributions exactly, and
forced tokens are exactly the positions where one token was allowed."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import numpy as np
import pytest
import torch

from services.models.source import SMOLLM2, resolve_model
from services.rollout.grammar import GrammarBook, GrammarSpec, constrain_rows, tool_call_ebnf, union_ebnf

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 30},
                                           "units": {"enum": ["metric", "imperial"]}},
          "required": ["city", "days", "units"], "additionalProperties": False}


@pytest.fixture(scope="module")
def book() -> tuple[GrammarBook, Any]:
    from transformers import AutoTokenizer

    path = resolve_model(SMOLLM2)
    b = GrammarBook.from_dir(path, 49152)
    assert b is not None
    return b, AutoTokenizer.from_pretrained(str(path), local_files_only=True)


@pytest.mark.parametrize("kind,source,match", [
    ("yaml", "", "kind must be one of"),
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", "[1, 2]", "must be a JSON object"),
    ("json_object", "{}", "takes no source"),
    ("regex", "", "needs its source"),
    ("ebnf", "x" * (300 << 10), "at most"),
])
def test_bad_specs_are_one_sentence(kind: str, source: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GrammarSpec(kind, source)


def test_a_grammar_that_does_not_compile_is_one_sentence(book: tuple[GrammarBook, Any]) -> None:
    with pytest.raises(ValueError, match=r'^the ebnf grammar does not compile: .*Rule "nowhere" is not defined$'):
        book[0].compile(GrammarSpec("ebnf", "root ::= nowhere"))


def _sample(book: GrammarBook, spec: GrammarSpec, seed: int, *, temperature: float = 1.0,
            steps: int = 400) -> tuple[list[int], list[bool], list[float], list[float]]:
    """Sample under ``spec`` from random logits (a model that knows nothing of JSON)."""
    c = book.constraint(spec, stop_token_ids=[2])
    g = torch.Generator().manual_seed(seed)
    out, forced, masked_lp, policy_lp = [], [], [], []
    temp = torch.tensor([temperature, 1.0])
    for _ in range(steps):
        logits = torch.randn(2, 49152, generator=g) * 4
        raw = logits.clone()
        res = constrain_rows(logits, [c, None], temp)
        assert res is not None
        logmass, force, dead = res
        assert torch.equal(logits[1], raw[1]) and logmass[1] == 0 and not force[1]  # a free row is untouched
        assert not dead.any()
        t = temperature or 1.0
        logp = torch.log_softmax(logits[0] / t, -1)
        tok = int(torch.multinomial(logp.exp(), 1, generator=g)) if temperature else int(logp.argmax())
        # the masked distribution's logprob plus the allowed mass is the unmasked policy's logprob
        unmasked = float(torch.log_softmax(raw[0] / t, -1)[tok])
        assert float(logp[tok]) + float(logmass[0]) == pytest.approx(unmasked, abs=1e-4)
        assert bool(force[0]) == (int(torch.isfinite(logits[0]).sum()) == 1)
        out.append(tok)
        forced.append(bool(force[0]))
        masked_lp.append(float(logp[tok]))
        policy_lp.append(unmasked)
        c.accept(tok)
        if c.terminated:
            break
    assert c.terminated, "the grammar should end within the step budget"
    return out, forced, masked_lp, policy_lp


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampling_under_a_json_schema_always_matches_it(book: tuple[GrammarBook, Any], seed: int) -> None:
    b, tok = book
    out, forced, masked, policy = _sample(b, GrammarSpec("json_schema", json.dumps(SCHEMA)), seed)
    assert out[-1] == 2 and forced[-1]  # once the object is closed, only the stop token is left
    value = json.loads(tok.decode(out[:-1]))
    jsonschema.validate(value, SCHEMA)
    assert all(m >= p - 1e-5 for m, p in zip(masked, policy))  # masking only raises a kept token's logprob


def test_json_object_and_regex_and_greedy(book: tuple[GrammarBook, Any]) -> None:
    b, tok = book
    out, _, _, _ = _sample(b, GrammarSpec("json_object"), 5, temperature=0.0, steps=600)
    assert isinstance(json.loads(tok.decode(out[:-1])), dict)
    out, _, _, _ = _sample(b, GrammarSpec("regex", r"(yes|no), [0-9]{3}"), 6)
    text = tok.decode(out[:-1])
    assert text.split(", ")[0] in ("yes", "no") and len(text.split(", ")[1]) == 3


def test_a_forced_tool_call_is_its_format_around_schema_valid_arguments(book: tuple[GrammarBook, Any]) -> None:
    """The gateway's grammar for tool_choice required: one of the tools' names, then arguments valid
    against that tool's schema, then the format's closing text; long literals are forced tokens."""
    b, tok = book
    other = {"type": "object", "properties": {"q": {"type": "string", "maxLength": 8}}, "required": ["q"]}
    ebnf = union_ebnf([tool_call_ebnf('get_weather", "arguments": ', SCHEMA, "}\n</tool_call>"),
                       tool_call_ebnf('search", "arguments": ', other, "}\n</tool_call>")])
    for seed in range(3):
        out, forced, _, _ = _sample(b, GrammarSpec("ebnf", ebnf), seed)
        text = tok.decode(out[:-1])
        call = json.loads('{"name": "' + text.removesuffix("\n</tool_call>"))
        jsonschema.validate(call["arguments"], SCHEMA if call["name"] == "get_weather" else other)
        assert text.endswith("}\n</tool_call>") and any(forced)


def test_a_replayed_prefix_resumes_the_grammar(book: tuple[GrammarBook, Any]) -> None:
    """A migrated request's matcher is rebuilt by replaying its output; a token the grammar never
    allowed is refused with one sentence."""
    b, tok = book
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    out, _, _, _ = _sample(b, spec, 3)
    again = b.constraint(spec, stop_token_ids=[2])
    again.advance(np.array(out[:-1]))
    assert not again.terminated
    again.accept(2)
    assert again.terminated
    fresh = b.constraint(spec, stop_token_ids=[2])
    with pytest.raises(ValueError, match="does not match the request's json_schema grammar"):
        fresh.advance(np.array(tok.encode("= not json", add_special_tokens=False)))


def test_a_forced_call_keeps_the_order_its_tool_declares(book: tuple[GrammarBook, Any]) -> None:
    """The arguments of a forced call follow the tool's declared property order (what the model
    sees in its prompt and writes), not an alphabetical one: tool_choice required / named on a
    tool declared {"module", "code"} accepts exactly that order."""
    from services.rollout.tools import HermesFormat, ToolChoice

    b, tok = book
    write = {"name": "write_line", "parameters": {"type": "object", "required": ["module", "code"], "properties": {
        "module": {"type": "string", "maxLength": 6}, "code": {"type": "string", "maxLength": 6}}}}
    run = {"name": "run_tests", "parameters": {"type": "object", "required": ["module"],
                                               "properties": {"module": {"type": "string", "maxLength": 6}}}}
    fmt = HermesFormat()
    declared, alphabetical = '{"module": "m1", "code": "x"}', '{"code": "x", "module": "m1"}'
    for choice, head in ((ToolChoice("required"), 'write_line", "arguments": '), (ToolChoice("named", "write_line"), "")):
        spec = fmt.forced_grammar(choice, [write, run])
        assert spec is not None
        ok = b.constraint(spec, stop_token_ids=[2])
        ok.advance(np.array(tok.encode(head + declared + "}\n</tool_call>", add_special_tokens=False)))
        ok.accept(2)
        assert ok.terminated
        with pytest.raises(ValueError, match="does not match"):
            b.constraint(spec, stop_token_ids=[2]).advance(
                np.array(tok.encode(head + alphabetical, add_special_tokens=False)))
        for seed in range(2):  # what the engine samples under it: the declared order
            out, _, _, _ = _sample(b, spec, seed)
            text = tok.decode(out[:-1]).removesuffix("\n</tool_call>")
            args = json.loads((text.split('"arguments": ', 1)[1] if head else text)[:-1])
            assert list(args) == ["module", "code"] or list(args) == ["module"]
