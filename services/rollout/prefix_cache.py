"""Finished calls' KV, kept by token ids so the next call that starts the same way skips its prefill.

An agent's call N repeats calls 1..N-1 as its prefix; a retry or a sibling repeats the context it
branched from; every execution of a job repeats the system prompt. When a request ends on the
engine, its KV (prompt + generated tokens, all but the last, whose key was never computed) is
inserted here; a new request asks for the longest cached prefix of its context and prefills only
the rest.

Index: the tokens of each entry are cut into blocks of ``block_tokens``; block i's key is a hash
chained over blocks 0..i, so equal keys mean equal prefixes. A lookup hashes the request's blocks
(one numpy ``tobytes`` per block, no loop over tokens) and walks the chain while entries hold it;
the entry found is then compared token by token past the last whole block (vectorized) for the
exact common length, and over the blocks too, so a hash collision can never reuse wrong KV.

Rules:
- KV computed under one weight version is never reused under another (``clear`` on install, and
  every entry carries its version);
- a byte budget, least recently used entries evicted first; an entry that is a prefix of a newly
  inserted one (the previous call of the same agent) is dropped at once: the new one covers it;
- entries are immutable and a lookup's caller copies what it reuses, so nothing is pinned: an
  entry evicted while its copy is in use costs nothing.

Not thread-safe: owned by the engine loop.
"""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from prometheus_client import Counter, Gauge

from services.common.metrics import REGISTRY

REUSED_TOKENS = Counter("gyre_rollout_engine_prefix_reused_tokens_total",
                        "Prompt tokens whose KV came from the prefix cache (not prefilled).", registry=REGISTRY)
PROMPT_TOKENS = Counter("gyre_rollout_engine_prompt_tokens_total",
                        "Context tokens of requests admitted (prefilled + reused).", registry=REGISTRY)
EVICTED_TOKENS = Counter("gyre_rollout_engine_prefix_evicted_tokens_total",
                         "Cached tokens dropped (budget, superseded by a longer entry, new weights).",
                         registry=REGISTRY)
CACHED_TOKENS = Gauge("gyre_rollout_engine_prefix_cached_tokens", "Tokens resident in the prefix cache.",
                      registry=REGISTRY)

KV = list[tuple[torch.Tensor, torch.Tensor]]  # per layer [kv_heads, tokens, head_dim]
# Entries compared token by token per lookup, past the last whole block in common (a longer match in
# an older entry could only add less than one block).
MAX_CANDIDATES = 16


@dataclass(eq=False)
class Entry:
    ids: np.ndarray  # int32[tokens]
    kv: KV
    version: int
    keys: list[bytes]  # chained block hashes, one per whole block


@dataclass(frozen=True)
class Hit:
    entry: Entry
    tokens: int  # leading tokens of the request whose KV ``entry`` holds


class PrefixCache:
    """Token-keyed KV store with a byte budget (see module docstring). ``budget_bytes`` 0 disables."""

    def __init__(self, *, budget_bytes: int, bytes_per_token: int, block_tokens: int = 128) -> None:
        if budget_bytes < 0 or bytes_per_token < 1 or block_tokens < 1:
            raise ValueError("budget_bytes must be >= 0, bytes_per_token and block_tokens >= 1")
        self.budget_bytes, self.bytes_per_token, self.block_tokens = budget_bytes, bytes_per_token, block_tokens
        self._entries: OrderedDict[int, Entry] = OrderedDict()  # id(entry) -> entry, oldest first
        self._by_key: dict[bytes, dict[int, Entry]] = {}  # block chain key -> entries holding it, oldest first
        self.tokens = 0
        self.dropped_tokens = 0  # ever dropped (evicted, superseded, cleared): their KV was freed

    @property
    def enabled(self) -> bool:
        return self.budget_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def _chain(self, ids: np.ndarray, blocks: int) -> list[bytes]:
        keys, prev = [], b""
        b = self.block_tokens
        for i in range(blocks):  # one hash per block, not per token
            prev = hashlib.blake2b(prev + ids[i * b:(i + 1) * b].tobytes(), digest_size=16).digest()
            keys.append(prev)
        return keys

    def lookup(self, ids: np.ndarray, version: int) -> Hit | None:
        """The cached entry sharing the longest prefix with ``ids`` under ``version``, or None."""
        if not self._entries:
            return None
        ids = np.asarray(ids, np.int32)
        b, prev = self.block_tokens, b""
        holders: dict[int, Entry] = {}
        matched = 0  # whole blocks some entry shares with ids
        for i in range(len(ids) // b):  # walk the chain while some entry of this version holds it
            prev = hashlib.blake2b(prev + ids[i * b:(i + 1) * b].tobytes(), digest_size=16).digest()
            at = self._by_key.get(prev)
            if not at or not any(e.version == version for e in reversed(at.values())):
                break
            holders, matched = at, i + 1
        # candidates: the newest holders of the last common block (they agree up to it), or with no
        # whole block in common the most recently used entries; bounded, so a lookup's cost does
        # not grow with the number of cached calls that share a system prompt
        pool = holders.values() if matched else self._entries.values()
        candidates = [e for e in itertools.islice(reversed(pool), MAX_CANDIDATES) if e.version == version]
        # the entries holding the last common block agree up to it; past it, at most one more block
        # can match (or a whole one would have): compare that stretch of each, vectorized
        best: Hit | None = None
        lo = matched * b
        for entry in candidates:  # newest first: ties go to the most recent
            n = min(len(ids), len(entry.ids), lo + b)
            differ = np.flatnonzero(entry.ids[lo:n] != ids[lo:n])
            tokens = lo + (int(differ[0]) if differ.size else n - lo)
            if best is None or tokens > best.tokens:
                best = Hit(entry, tokens)
        if best is None or best.tokens == 0:
            return None
        # the chain's hashes said equal: check it token by token, so a collision reuses nothing
        if not np.array_equal(best.entry.ids[:lo], ids[:lo]):
            return None
        self._entries.move_to_end(id(best.entry))
        return best

    def insert(self, ids: np.ndarray, kv: KV, version: int) -> None:
        """Keep ``kv`` (the KV of ``ids``, per layer ``[kv_heads, len(ids), head_dim]``)."""
        size = len(ids) * self.bytes_per_token
        if not self.enabled or len(ids) == 0 or size > self.budget_bytes:
            return
        ids = np.array(ids, np.int32)  # own copy: the caller's buffer keeps changing
        while (hit := self.lookup(ids, version)) is not None and hit.tokens == len(hit.entry.ids):
            self._drop(hit.entry)  # an earlier call of the same context: the new entry covers it
        entry = Entry(ids, kv, version, self._chain(ids, len(ids) // self.block_tokens))
        self._entries[id(entry)] = entry
        for key in entry.keys:
            self._by_key.setdefault(key, {})[id(entry)] = entry
        self.tokens += len(ids)
        while self.tokens * self.bytes_per_token > self.budget_bytes:
            self._drop(next(iter(self._entries.values())))
        CACHED_TOKENS.set(self.tokens)

    def clear(self) -> None:
        """Drop everything (new weights: every entry is stale)."""
        for entry in list(self._entries.values()):
            self._drop(entry)
        CACHED_TOKENS.set(self.tokens)

    def _drop(self, entry: Entry) -> None:
        del self._entries[id(entry)]
        for key in entry.keys:
            holders = self._by_key[key]
            del holders[id(entry)]
            if not holders:
                del self._by_key[key]
        self.tokens -= len(entry.ids)
        self.dropped_tokens += len(entry.ids)
        EVICTED_TOKENS.inc(len(entry.ids))


__all__ = ["PrefixCache", "Hit", "Entry", "REUSED_TOKENS", "PROMPT_TOKENS"]
