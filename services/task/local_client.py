"""An in-process `ModelClient` over a transformers causal LM (evaluation of the warm start, tests).

It runs the model directly, one call at a time, with a KV cache: prefill the prompt, then sample
token by token. Logprobs are those of the distribution actually sampled from (after temperature
and top-k/top-p), as the rollout engines report them; greedy calls report the raw model's.
It also keeps the TITO records of every call it served, like the gateway would, so tests can look
at the branch structure an execution produced. The real harness uses the rollout gateway instead.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from services.task.agent import CallContext, Generation, Sampling

__all__ = ["LocalModelClient", "LocalRecord"]


@dataclass(frozen=True)
class LocalRecord:
    """One served call, exactly as the model saw it."""

    context: CallContext
    prompt_ids: np.ndarray
    output_ids: np.ndarray
    logprobs: np.ndarray
    weight_version: int


# transformers 5.x renamed `past_key_values` to `cache` (the old name warns, then goes away).
_CACHE_KW = "cache"


def _cache_of(out: Any) -> Any:
    cache = out.get("cache")
    return cache if cache is not None else out.get("past_key_values")


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[..., -1, None]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if 0.0 < top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first token always stays).
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


class LocalModelClient:
    """Serves `generate` from `model` in this process; thread-safe (one call at a time)."""

    def __init__(self, model: Any, *, weight_version: int = 0, keep_records: bool = True) -> None:
        self.model = model.eval()
        self.weight_version = weight_version
        self.keep_records = keep_records
        self.records: list[LocalRecord] = []
        self._lock = threading.Lock()

    @torch.inference_mode()
    def _sample(self, prompt_ids: np.ndarray, sampling: Sampling) -> tuple[np.ndarray, np.ndarray, str]:
        gen = torch.Generator().manual_seed(int(sampling.seed or 0) & ((1 << 63) - 1))
        stops = set(sampling.stop_token_ids)
        ids = torch.as_tensor(prompt_ids, dtype=torch.long)[None]
        out = self.model(input_ids=ids, use_cache=True)
        past = _cache_of(out)
        logits = out.logits[0, -1].float()
        tokens: list[int] = []
        logprobs: list[float] = []
        finish = "length"
        constraint = sampling.constraint
        if constraint is not None:
            from services.rollout.grammar import constrain_rows

            temp = torch.tensor([float(sampling.temperature)])
        for _ in range(sampling.max_new_tokens):
            if constraint is not None:  # as the engine does: disallowed tokens -> -inf (in place), before sampling
                constrain_rows(logits[None], [constraint], temp)
            if sampling.temperature == 0:
                logp = torch.log_softmax(logits, -1)
                tok = int(torch.argmax(logits))
            else:
                logp = torch.log_softmax(_filter_logits(logits / sampling.temperature, sampling.top_k, sampling.top_p), -1)
                tok = int(torch.multinomial(logp.exp(), 1, generator=gen))
            tokens.append(tok)
            logprobs.append(float(logp[tok]))
            if constraint is not None:
                try:
                    constraint.accept(tok)
                except ValueError:  # the grammar allowed no token of this vocabulary (as the engine: an error)
                    finish = "error"
                    break
            if tok in stops or (constraint is not None and constraint.terminated):
                finish = "stop"
                break
            step = self.model(input_ids=torch.tensor([[tok]]), use_cache=True, **{_CACHE_KW: past})
            past = _cache_of(step)
            logits = step.logits[0, -1].float()
        return np.asarray(tokens, dtype=np.int32), np.asarray(logprobs, dtype=np.float32), finish

    def generate(
        self, context: CallContext, prompt_ids: np.ndarray, sampling: Sampling, *, timeout_s: float
    ) -> Generation:
        with self._lock:
            out, logprobs, finish = self._sample(np.asarray(prompt_ids), sampling)
            if self.keep_records:
                prompt = np.asarray(prompt_ids, dtype=np.int32).copy()
                self.records.append(LocalRecord(context, prompt, out, logprobs, self.weight_version))
        return Generation(output_ids=out, logprobs=logprobs, weight_version=self.weight_version, finish_reason=finish)
