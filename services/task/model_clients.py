"""`ModelClient`s over the rollout service: the gateway (TITO gRPC) and an in-process engine.

``GatewayModelClient`` is the harness's real path: every call goes to the rollout gateway, which
routes it to an engine cell and records it as a TITO record (execution, agent, call ids and role
from the ``CallContext``). ``EngineModelClient`` submits straight to an in-process
``InferenceEngine`` (evaluation without services, benches). Both are thread-safe; many harness
threads calling at once are batched by the engine (continuous batching), which is what makes a
held-out evaluation of dozens of executions affordable on a CPU.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import numpy as np

from services.rollout.calls import CallMeta
from services.rollout.client import GatewayClient
from services.rollout.engine import GenRequest, InferenceEngine, SamplingParams, TokenEvent
from services.task.agent import CallContext, Generation, Sampling

__all__ = ["GatewayModelClient", "EngineModelClient", "EngineRecord"]


def _params(sampling: Sampling) -> SamplingParams:
    return SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                          max_new_tokens=sampling.max_new_tokens, stop_token_ids=sampling.stop_token_ids,
                          seed=sampling.seed)


class GatewayModelClient:
    """``generate`` = one TITO ``Generate`` call on the rollout gateway at ``address``."""

    def __init__(self, address: str, *, max_message_mb: int = 256) -> None:
        self.gateway = GatewayClient(address, max_message_mb=max_message_mb)

    def close(self) -> None:
        self.gateway.close()

    def generate(self, context: CallContext, prompt_ids: np.ndarray, sampling: Sampling, *,
                 timeout_s: float) -> Generation:
        meta = CallMeta(job_id=context.job_id, execution_id=context.execution_id, call_id=context.call_id,
                        agent_id=context.agent_id, role=context.role)
        r = self.gateway.generate(meta, np.asarray(prompt_ids, dtype=np.int32), _params(sampling))
        return Generation(output_ids=r.output_ids, logprobs=r.output_logprobs, weight_version=r.weight_version,
                          finish_reason=r.finish_reason)


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
    """``generate`` = submit to an in-process ``engine`` and wait for the request to finish; records
    are kept (``keep_records``) as the gateway would record them."""

    def __init__(self, engine: InferenceEngine, *, keep_records: bool = False) -> None:
        self.engine = engine
        self.keep_records = keep_records
        self.records: list[EngineRecord] = []
        self._ids = itertools.count()
        self._lock = threading.Lock()

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
        if self.keep_records:
            with self._lock:
                self.records.append(EngineRecord(context, prompt.copy(), ids, logprobs, pending.version))
        return Generation(output_ids=ids.astype(np.int32), logprobs=logprobs.astype(np.float32),
                          weight_version=pending.version, finish_reason=pending.reason or "aborted")
