"""A `ModelClient` over an in-process rollout engine (``services.rollout.engine.InferenceEngine``).

Many harness threads can call ``generate`` at once; the engine batches them (continuous
batching), which is what makes a held-out evaluation of dozens of executions affordable on a
CPU. Each call is one engine request; the engine's log-probs and weight version come back as
they are. Records are kept (optionally) like the gateway would record TITO, for tests.
The real harness path goes through the rollout gateway instead.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import numpy as np

from services.rollout.engine import GenRequest, InferenceEngine, SamplingParams, TokenEvent
from services.task.agent import CallContext, Generation, Sampling

__all__ = ["EngineModelClient", "EngineRecord"]


@dataclass(frozen=True)
class EngineRecord:
    context: CallContext
    prompt_ids: np.ndarray
    output_ids: np.ndarray
    logprobs: np.ndarray
    weight_version: int


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
    """``generate`` = submit to ``engine`` and wait for the request to finish. Thread-safe."""

    def __init__(self, engine: InferenceEngine, *, keep_records: bool = False) -> None:
        self.engine = engine
        self.keep_records = keep_records
        self.records: list[EngineRecord] = []
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def generate(self, context: CallContext, prompt_ids: np.ndarray, sampling: Sampling, *,
                 timeout_s: float) -> Generation:
        params = SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                                max_new_tokens=sampling.max_new_tokens, stop_token_ids=sampling.stop_token_ids,
                                seed=sampling.seed)
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
        if self.keep_records:
            with self._lock:
                self.records.append(EngineRecord(context, prompt.copy(), ids, logprobs, pending.version))
        return Generation(output_ids=ids.astype(np.int32), logprobs=logprobs.astype(np.float32),
                          weight_version=pending.version, finish_reason=pending.reason or "aborted")
