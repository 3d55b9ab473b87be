"""Recent calls' token sequences per execution, so harnesses can send prompts as deltas.

A long-horizon execution re-sends its whole (up to ~1M token) context with every call. With a
``TitoDelta`` the harness sends only what changed: ``prompt = (prompt + output of base_call_id)
[:shared_prefix_len] + new_ids``. The gateway keeps the full sequence of the last few calls of
each execution (bounded by a global token budget, least recently used executions evicted first)
and resolves deltas against them; an unknown base call is the caller's error (NOT_FOUND).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from services.common.errors import InvalidArgument, NotFound


class CallCache:
    """``execution_id -> {call_id -> prompt+output ids}``; thread-safe, bounded in tokens."""

    def __init__(self, *, max_calls_per_execution: int = 8, max_tokens: int = 16_000_000) -> None:
        if max_calls_per_execution < 1 or max_tokens < 1:
            raise ValueError("max_calls_per_execution and max_tokens must be >= 1")
        self.max_calls_per_execution = max_calls_per_execution
        self.max_tokens = max_tokens
        self._executions: OrderedDict[str, OrderedDict[str, np.ndarray]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()

    @property
    def tokens(self) -> int:
        return self._tokens

    def put(self, execution_id: str, call_id: str, sequence: np.ndarray) -> None:
        """Remember a finished call's full sequence (prompt + output)."""
        if not execution_id or not call_id:
            return  # anonymous calls cannot be referenced later
        seq = np.ascontiguousarray(sequence, dtype=np.int32)
        with self._lock:
            calls = self._executions.setdefault(execution_id, OrderedDict())
            self._executions.move_to_end(execution_id)
            old = calls.pop(call_id, None)
            if old is not None:
                self._tokens -= len(old)
            calls[call_id] = seq
            self._tokens += len(seq)
            while len(calls) > self.max_calls_per_execution:
                _, dropped = calls.popitem(last=False)
                self._tokens -= len(dropped)
            while self._tokens > self.max_tokens and self._executions:
                _, evicted = self._executions.popitem(last=False)
                self._tokens -= sum(len(s) for s in evicted.values())

    def resolve(self, execution_id: str, base_call_id: str, shared_prefix_len: int,
                new_ids: np.ndarray) -> np.ndarray:
        """The full prompt a delta describes."""
        new = np.asarray(new_ids, dtype=np.int32)
        if not base_call_id:
            if shared_prefix_len != 0:
                raise InvalidArgument("prompt_delta without base_call_id must have shared_prefix_len 0")
            return new
        with self._lock:
            calls = self._executions.get(execution_id)
            base = calls.get(base_call_id) if calls is not None else None
            if calls is not None:
                self._executions.move_to_end(execution_id)
        if base is None:
            raise NotFound(f"unknown session: call {base_call_id!r} of execution {execution_id!r} "
                           "is not (or no longer) cached by this gateway; send the full prompt_ids")
        if not 0 <= shared_prefix_len <= len(base):
            raise InvalidArgument(f"prompt_delta.shared_prefix_len {shared_prefix_len} is outside "
                                  f"[0, {len(base)}] (length of call {base_call_id!r})")
        return np.concatenate([base[:shared_prefix_len], new])
