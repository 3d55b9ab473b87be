"""A `ModelClient` over an in-process rollout engine (``services.rollout.engine.InferenceEngine``).

Evaluation without services (``services.task.arith_eval``), benches and tests. Many harness
threads can call ``generate`` at once; the engine batches them (continuous batching), which is
what makes a held-out evaluation of dozens of executions affordable on a CPU. The harness's real
path is the rollout gateway (``services.task.gateway_client.GatewayModelClient``, TITO recorded).
"""

from __future__ import annotations

import itertools
import threading

import numpy as np

from services.rollout.engine import GenRequest, InferenceEngine, SamplingParams, TokenEvent
from services.task.agent import CallContext, Generation, Sampling

__all__ = ["EngineModelClient"]


def _params(sampling: Sampling) -> SamplingParams:
    return SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                          max_new_tokens=sampling.max_new_tokens, stop_token_ids=sampling.stop_token_ids,
                          seed=sampling.seed)


class _Pending:
    def __init__(self) -> None:
        self.ids: list[np.ndarray] = []
        self.logprobs: list[np.ndarray] = []
        self.version = 0
        self.reason = ""
        self.done = threading.Event()

    def on_event(self, ev: TokenEvent) -> None:  # engine loop thread: must not block
        if len(ev.token_ids):
            self.ids.append(ev.token_ids)
            self.logprobs.append(ev.logprobs)
            self.version = ev.weight_version
        if ev.finished:
            self.reason = ev.finish_reason or ""
            self.done.set()


class EngineModelClient:
    """``generate`` = submit to an in-process ``engine`` and wait for the request to finish."""

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine
        self._ids = itertools.count()  # request ids stay unique across retries of a call id

    def generate(self, context: CallContext, prompt_ids: np.ndarray, sampling: Sampling, *,
                 timeout_s: float) -> Generation:
        params = _params(sampling)
        rid = f"{context.execution_id}/{context.call_id}#{next(self._ids)}"
        prompt = np.asarray(prompt_ids, dtype=np.int32)
        pending = _Pending()
        self.engine.submit(GenRequest(rid, prompt, params, execution_id=context.execution_id,
                                      call_id=context.call_id, agent_id=context.agent_id, role=context.role),
                           pending.on_event)
        if not pending.done.wait(timeout_s):
            self.engine.cancel(rid)  # past the deadline: keep what was generated
            pending.done.wait(30.0)
        ids = np.concatenate(pending.ids) if pending.ids else np.zeros(0, np.int32)
        logprobs = np.concatenate(pending.logprobs) if pending.logprobs else np.zeros(0, np.float32)
        if pending.reason == "error":
            raise RuntimeError(f"engine failed request {rid}")
        return Generation(output_ids=ids.astype(np.int32), logprobs=logprobs.astype(np.float32),
                          weight_version=pending.version, finish_reason=pending.reason or "aborted")
