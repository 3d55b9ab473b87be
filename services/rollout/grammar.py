"""Schema-constrained decoding: a request's grammar masks the tokens it may not emit (xgrammar).

A request may carry a ``GrammarSpec`` (``SamplingParams.grammar``): a JSON schema, any JSON object,
a regular expression or an EBNF grammar (xgrammar's dialect; the gateway builds one for a forced
tool call: the call's JSON arguments between the format's literal text). The engine compiles it
against its tokenizer's vocabulary once (``GrammarBook``, cached by spec) and keeps one matcher per
request (``Constraint``). Each step, before sampling, the rows of constrained requests get their
allowed-token bitmask applied to the logits (disallowed -> -inf, ``constrain_rows``); after
sampling, the matcher accepts the token. When the grammar is complete only the stop tokens stay
allowed, so the call ends there.

What is recorded, per output token of a constrained request (TITO stays exact):

* ``logprob``: the log-probability the token was sampled with, i.e. under the *masked*
  distribution (what the API reports);
* ``forced``: the mask left exactly one token, so the model made no choice there: such tokens are
  context, never trained on (like the forced tool-call opening the gateway puts in the prompt);
* ``policy_logprob``: the token's log-probability under the *unmasked* policy at the same
  temperature (``logprob + log(allowed probability mass)``). The trainer uses it as the rollout
  log-probability of free choices, so its importance ratio at the rollout weights is exactly 1
  (the mask acts as part of the environment; the gradient raises or lowers the policy's own
  probability of the chosen token, and clipping sees the true policy change).

No grammar, no cost: unconstrained requests never touch xgrammar. A constrained row costs one
bitmask fill (xgrammar's cached per-state masks) and a masked log-sum-exp per step.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # no torch at import: engine.py (torch-free) imports GrammarSpec from here
    import torch

KINDS = ("json_schema", "json_object", "regex", "ebnf")
MAX_SOURCE_BYTES = 256 << 10  # a grammar bigger than this is refused (compile time and memory)


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match. ``kind``: ``json_schema`` (``source`` = the schema as
    JSON text), ``json_object`` (any JSON object; no source), ``regex`` or ``ebnf`` (source = the
    expression / grammar with a ``root`` rule)."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"grammar kind must be one of {', '.join(KINDS)}; got {self.kind!r}")
        if len(self.source.encode()) > MAX_SOURCE_BYTES:
            raise ValueError(f"the grammar source has {len(self.source.encode())} bytes; at most {MAX_SOURCE_BYTES} "
                             "are accepted")
        if self.kind == "json_object" and self.source:
            raise ValueError("a json_object grammar takes no source (any JSON object matches)")
        if self.kind != "json_object" and not self.source:
            raise ValueError(f"a {self.kind} grammar needs its source")
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.source)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc.msg} at character {exc.pos}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema must be a JSON object (or true/false)")


def tool_call_ebnf(literal_before: str, schema: Any, literal_after: str) -> str:
    """EBNF of ``literal_before``, then a JSON value valid against ``schema``, then ``literal_after``
    (a forced tool call's arguments inside its format's text)."""
    import xgrammar as xgr

    parts = []
    if literal_before:
        parts.append(xgr.Grammar.from_ebnf(f"root ::= {_ebnf_literal(literal_before)}"))
    parts.append(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False))
    if literal_after:
        parts.append(xgr.Grammar.from_ebnf(f"root ::= {_ebnf_literal(literal_after)}"))
    return str(xgr.Grammar.concat(*parts)) if len(parts) > 1 else str(parts[0])


def union_ebnf(grammars: Sequence[str]) -> str:
    """EBNF matching any one of ``grammars`` (each an EBNF text with a ``root`` rule)."""
    import xgrammar as xgr

    if len(grammars) == 1:
        return grammars[0]
    return str(xgr.Grammar.union(*(xgr.Grammar.from_ebnf(g) for g in grammars)))


_SOURCE_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[12:00:00] /path/file.cc:820: " prefix


def _ebnf_literal(text: str) -> str:
    return json.dumps(text)  # EBNF string literals take JSON's escapes


class GrammarBook:
    """One engine's compiler over its tokenizer's vocabulary; compiled grammars cached by spec
    (``max_entries`` most recently used). Thread-safe."""

    def __init__(self, tokenizer: Any, vocab_size: int, *, max_entries: int = 256) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self._info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)
        self._cache: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._max = max_entries
        self._lock = threading.Lock()

    @classmethod
    def from_dir(cls, path: str | Path, vocab_size: int) -> GrammarBook | None:
        """The book of a checkpoint directory's tokenizer; None when it has no tokenizer files."""
        p = Path(path)
        if not ((p / "tokenizer.json").is_file() or (p / "tokenizer_config.json").is_file()):
            return None
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(str(p), local_files_only=True), vocab_size)

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar of ``spec``; ValueError (one sentence) when it does not compile."""
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        try:
            if spec.kind == "json_schema":
                compiled = self._compiler.compile_json_schema(spec.source, any_whitespace=False)
            elif spec.kind == "json_object":
                compiled = self._compiler.compile_builtin_json_grammar()
            elif spec.kind == "regex":
                compiled = self._compiler.compile_regex(spec.source)
            else:
                compiled = self._compiler.compile_grammar(spec.source)
        except Exception as exc:  # deliberate: xgrammar raises RuntimeError/ValueError subclasses
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            first = _SOURCE_LOCATION.sub("", first)
            raise ValueError(f"the {spec.kind} grammar does not compile: {first}") from None
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > self._max:
                self._cache.popitem(last=False)
        return compiled

    def constraint(self, spec: GrammarSpec, stop_token_ids: Sequence[int] = ()) -> Constraint:
        """A fresh matcher for one request. The request's own stop ids end the grammar (else the
        tokenizer's end-of-sequence ids)."""
        return Constraint(self.compile(spec), spec, stop_token_ids)


class Constraint:
    """One request's position in its grammar (owned by the engine loop)."""

    def __init__(self, compiled: Any, spec: GrammarSpec, stop_token_ids: Sequence[int] = ()) -> None:
        import xgrammar as xgr

        self.spec = spec
        stops = [int(t) for t in stop_token_ids] or None
        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> None:
        """Advance past ``token``; ValueError if the grammar does not allow it."""
        if not self._matcher.accept_token(int(token)):
            raise ValueError(f"token {int(token)} does not match the request's {self.spec.kind} grammar")

    def advance(self, tokens: np.ndarray) -> None:
        """Replay tokens already generated (a migrated or re-prefilled request)."""
        for t in tokens.tolist():  # once per migration, not per decode step
            self.accept(t)

    @property
    def terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


def constrain_rows(logits: torch.Tensor, constraints: Sequence[Constraint | None],
                   temperature: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """Mask ``logits`` [B, V] in place for the rows with a constraint; returns per row (log of the
    allowed probability mass at the row's temperature (greedy rows: 1), whether exactly one token
    is allowed, whether none is), or None when no row is constrained. Rows without a constraint:
    (0, False, False). A row whose grammar allows no token of this vocabulary (a model whose
    tokenizer cannot spell it) keeps its logits unmasked: the caller ends that request."""
    import torch
    import xgrammar as xgr

    rows = [i for i, c in enumerate(constraints) if c is not None]
    if not rows:
        return None
    bsz, vocab = logits.shape
    bitmask = xgr.allocate_token_bitmask(bsz, vocab)
    for i in rows:
        constraints[i].fill(bitmask, i)  # type: ignore[union-attr]
    idx = torch.tensor(rows, device=logits.device)
    temp = temperature[idx].float()
    scale = torch.where(temp > 0, temp, torch.ones_like(temp))[:, None]
    raw = logits[idx]  # a gather: a copy of the rows before masking
    before = torch.logsumexp(raw.float() / scale, dim=-1)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
    masked = logits[idx].float()
    allowed = torch.isfinite(masked).sum(dim=-1)
    none = allowed == 0
    if bool(none.any()):
        logits[idx[none]] = raw[none]
    after = torch.logsumexp(masked / scale, dim=-1)
    logmass = np.zeros(bsz, np.float32)
    forced, dead = np.zeros(bsz, bool), np.zeros(bsz, bool)
    logmass[rows] = torch.where(none, torch.zeros_like(after), (after - before).clamp(max=0.0)).cpu().numpy()
    forced[rows] = (allowed == 1).cpu().numpy()
    dead[rows] = none.cpu().numpy()
    return logmass, forced, dead


__all__ = ["GrammarBook", "GrammarSpec", "Constraint", "KINDS", "constrain_rows", "tool_call_ebnf", "union_ebnf"]
