"""A `ModelClient` over the rollout gateway's TITO gRPC API (what the built-in harness and
held-out evaluations call the model through; every call is recorded by the gateway)."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import numpy as np

from services.common import errors
from services.common.logging import get_logger
from services.task.agent import CallContext, Generation, Sampling

log = get_logger(__name__)

__all__ = ["GatewayModelClient", "common_prefix_len"]


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays (vectorized)."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class GatewayModelClient:
    """`ModelClient` over the rollout gateway's TITO API, with delta-encoded prompts.

    Each call is sent relative to the previous call of the same agent in the same execution
    (``prompt = (base prompt + base output)[:shared] + new_ids``), so a long context is not
    resent every turn. Thread-safe; `forget(execution_id)` drops an ended execution's state.
    """

    def __init__(self, gateway: Any, *, retries: int = 3) -> None:
        self.gateway = gateway  # services.rollout.client.GatewayClient
        self.retries = retries
        self._last: dict[tuple[str, str], tuple[str, np.ndarray]] = {}
        self._attempts: dict[str, int] = {}  # execution id -> its lease attempt (sent with each call)
        self._lock = threading.Lock()

    def begin(self, execution_id: str, attempt: int) -> None:
        """Calls of ``execution_id`` from now on belong to lease ``attempt`` (a re-leased execution
        starts over: the trajectory service drops an earlier attempt's records)."""
        with self._lock:
            self._attempts[execution_id] = attempt
            for key in [k for k in self._last if k[0] == execution_id]:
                del self._last[key]  # sessions of an earlier attempt are not this one's context

    def forget(self, execution_id: str) -> None:
        with self._lock:
            self._attempts.pop(execution_id, None)
            for key in [k for k in self._last if k[0] == execution_id]:
                del self._last[key]

    def generate(self, context: CallContext, prompt_ids: np.ndarray, sampling: Sampling, *,
                 timeout_s: float) -> Generation:
        from services.rollout.calls import CallMeta
        from services.rollout.engine import SamplingParams

        with self._lock:
            attempt = self._attempts.get(context.execution_id, 0)
        meta = CallMeta(job_id=context.job_id, execution_id=context.execution_id, call_id=context.call_id,
                        agent_id=context.agent_id, role=context.role, attempt=attempt)
        params = SamplingParams(temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                                max_new_tokens=sampling.max_new_tokens, stop_token_ids=sampling.stop_token_ids,
                                seed=sampling.seed)
        prompt = np.asarray(prompt_ids, dtype=np.int32)
        key = (context.execution_id, context.agent_id)
        with self._lock:
            base = self._last.get(key)
        shared = common_prefix_len(base[1], prompt) if base is not None else 0
        for attempt in range(self.retries + 1):
            try:
                if shared > 0 and base is not None:
                    try:
                        res = self.gateway.generate(meta, None, params, base_call_id=base[0],
                                                    shared_prefix_len=shared, new_ids=prompt[shared:])
                    except errors.NotFound:
                        # The gateway no longer knows the base call (restart, eviction): send it all.
                        res = self.gateway.generate(meta, prompt, params)
                else:
                    res = self.gateway.generate(meta, prompt, params)
                break
            except errors.Unavailable as exc:
                if attempt == self.retries:
                    raise
                pause = min(5.0, 0.2 * 2**attempt) * (0.5 + random.random())
                log.warning("model call unavailable; retrying", execution_id=context.execution_id,
                            call_id=context.call_id, attempt=attempt + 1, pause_s=round(pause, 2), error=str(exc))
                time.sleep(pause)
        out = np.asarray(res.output_ids, dtype=np.int32)
        with self._lock:
            self._last[key] = (context.call_id, np.concatenate([prompt, out]))
        return Generation(output_ids=out, logprobs=np.asarray(res.output_logprobs, dtype=np.float32),
                          weight_version=int(res.weight_version), finish_reason=res.finish_reason)
