"""Engine registry and load-aware, sticky routing for the rollout gateway (no gRPC here).

Each registered ROLLOUT cell is an ``EngineEntry``. ``Router.pick`` chooses the engine for a call:

- only ``ready`` engines are candidates (``draining`` ones finish or migrate what they have,
  ``dead`` ones failed their health probes or a stream broke);
- cells an operator cordoned (``set_cordoned``, which the gateway follows from the scheduler's
  registry) get no new call while an uncordoned engine is ready, so the work they host only
  shrinks and the scheduler can drain them; they still serve when nothing else can;
- calls of the same agent context ``(execution_id, agent_id)`` stick to the engine that served
  them last, so the engine's prefix cache sees the growing context again - unless that engine
  is more than ``sticky_slack`` calls busier than the least loaded one; the first call of a new
  agent of a known execution goes (within the same slack) to the engine of that execution's
  latest call: its system prompt is cached there, and a summary call reads the context it
  compacts (an XLong replay prefilled 1.54x its unique tokens when such calls went elsewhere);
- otherwise the least loaded engine wins: load = calls this gateway has in flight there, plus
  the engine's own KV fill fraction from the last probe as a tie-breaker; equal loads rotate.

Lifecycle of an entry: register -> ready <-> dead (probes) ; ready -> draining -> deregistered.
All methods are thread-safe (one lock; every operation is O(engines)).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from services.common.errors import NotFound, Unavailable

READY = "ready"
DRAINING = "draining"
DEAD = "dead"
STATES = (READY, DRAINING, DEAD)

StickyKey = tuple[str, str]


@dataclass
class EngineEntry:
    """One registered engine as the gateway sees it."""

    cell_id: str
    address: str
    state: str = READY
    # Calls this gateway currently streams from the engine.
    in_flight: int = 0
    # Last probe (GetLoad): active requests, KV tokens held, KV capacity; -1 = never probed.
    active: int = -1
    kv_tokens: int = 0
    capacity_tokens: int = 0
    weight_version: int = -1
    vocab_size: int = 0
    max_context: int = 0
    model_name: str = ""
    failed_probes: int = 0
    cordoned: bool = False  # an operator cordoned its cell: new calls go elsewhere while they can
    registered_at_s: float = field(default_factory=time.time)

    def score(self) -> float:
        """Routing load: in-flight calls, plus KV fill in [0, 1) to break ties."""
        fill = self.kv_tokens / self.capacity_tokens if self.capacity_tokens > 0 else 0.0
        return self.in_flight + min(fill, 0.999)


class Router:
    """Registry of engines plus the routing policy described in the module docstring."""

    def __init__(self, *, sticky_slack: int = 4, max_sticky_keys: int = 200_000) -> None:
        if sticky_slack < 0:
            raise ValueError(f"sticky_slack must be >= 0, got {sticky_slack}")
        if max_sticky_keys < 1:
            raise ValueError(f"max_sticky_keys must be >= 1, got {max_sticky_keys}")
        self.sticky_slack = sticky_slack
        self.max_sticky_keys = max_sticky_keys
        self._engines: dict[str, EngineEntry] = {}
        self._sticky: OrderedDict[StickyKey, str] = OrderedDict()
        # the engine of each execution's latest call: where a new agent of that execution starts
        self._exec: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()
        self._rotation = itertools.count()
        self._cordoned: frozenset[str] = frozenset()

    # -- registry ---------------------------------------------------------------------------
    def register(self, cell_id: str, address: str) -> EngineEntry:
        """Add (or re-add, e.g. a cell back in ROLLOUT) an engine; it is routable at once."""
        if not cell_id:
            raise ValueError("cell_id must be a non-empty string")
        if not address or ":" not in address:
            raise ValueError(f"engine address must look like host:port, got {address!r}")
        with self._lock:
            entry = self._engines.get(cell_id)
            if entry is None or entry.address != address:
                in_flight = entry.in_flight if entry is not None else 0
                entry = EngineEntry(cell_id=cell_id, address=address, in_flight=in_flight,
                                    cordoned=cell_id in self._cordoned)
                self._engines[cell_id] = entry
            entry.state = READY
            entry.failed_probes = 0
            return entry

    def deregister(self, cell_id: str) -> EngineEntry:
        with self._lock:
            entry = self._engines.pop(cell_id, None)
        if entry is None:
            raise NotFound(f"no engine is registered for cell {cell_id!r}")
        return entry

    def get(self, cell_id: str) -> EngineEntry:
        with self._lock:
            entry = self._engines.get(cell_id)
        if entry is None:
            raise NotFound(f"no engine is registered for cell {cell_id!r}")
        return entry

    def by_address(self, address: str) -> EngineEntry | None:
        with self._lock:
            for entry in self._engines.values():
                if entry.address == address:
                    return entry
        return None

    def entries(self) -> list[EngineEntry]:
        with self._lock:
            return list(self._engines.values())

    def set_state(self, cell_id: str, state: str) -> None:
        if state not in STATES:
            raise ValueError(f"engine state must be one of {STATES}, got {state!r}")
        with self._lock:
            entry = self._engines.get(cell_id)
            if entry is None:
                raise NotFound(f"no engine is registered for cell {cell_id!r}")
            entry.state = state

    def set_cordoned(self, cell_ids: Iterable[str]) -> bool:
        """The cells cordoned now (the whole set); whether it changed."""
        cordoned = frozenset(cell_ids)
        with self._lock:
            changed = cordoned != self._cordoned
            self._cordoned = cordoned
            for entry in self._engines.values():
                entry.cordoned = entry.cell_id in cordoned
        return changed

    def cordoned(self) -> frozenset[str]:
        with self._lock:
            return self._cordoned

    def _routable(self, excluded: set[str]) -> list[EngineEntry]:
        """Ready engines not excluded, uncordoned ones only while there are any (lock held)."""
        ready = [e for e in self._engines.values() if e.state == READY and e.cell_id not in excluded]
        open_ = [e for e in ready if not e.cordoned]
        return open_ or ready

    def record_probe(self, cell_id: str, *, ok: bool, dead_after: int = 3, draining: bool = False,
                     **load: int | str) -> None:
        """Fold one health/load probe into the entry; ``dead_after`` failures in a row mark it dead,
        an engine that says it drains is not routable."""
        with self._lock:
            entry = self._engines.get(cell_id)
            if entry is None:
                return
            if not ok:
                entry.failed_probes += 1
                if entry.failed_probes >= dead_after and entry.state == READY:
                    entry.state = DEAD
                return
            entry.failed_probes = 0
            for key, value in load.items():
                setattr(entry, key, value)
            if draining:
                entry.state = DRAINING
            elif entry.state == DEAD:
                entry.state = READY  # came back (same address, e.g. a restarted process)

    # -- routing ----------------------------------------------------------------------------
    def pick(self, key: StickyKey | None, *, exclude: Iterable[str] = ()) -> EngineEntry:
        """Choose the engine for a call and count it in flight there (release with ``release``)."""
        excluded = set(exclude)
        with self._lock:
            candidates = self._routable(excluded)
            if not candidates:
                known = ", ".join(f"{e.cell_id}={e.state}" for e in self._engines.values()) or "none"
                raise Unavailable(f"no rollout engine is available (registered: {known})")
            best_score = min(e.score() for e in candidates)
            chosen: EngineEntry | None = None
            if key is not None and key[0]:
                # an agent's own engine holds its context's KV; a new agent of a known execution
                # starts where that execution's contexts are (the system prompt is cached there, and
                # a summary call reads the context it compacts)
                sticky = self._engines.get(self._sticky.get(key) or self._exec.get(key[0], ""))
                if sticky is not None and any(c is sticky for c in candidates) and \
                        sticky.in_flight <= int(best_score) + self.sticky_slack:
                    chosen = sticky
            if chosen is None:
                best = [e for e in candidates if e.score() == best_score]
                chosen = best[next(self._rotation) % len(best)]
            chosen.in_flight += 1
            if key is not None and key[0]:
                self._bind(key, chosen.cell_id)
            return chosen

    def _bind(self, key: StickyKey, cell_id: str) -> None:
        """(caller holds the lock)"""
        self._sticky[key] = cell_id
        self._sticky.move_to_end(key)
        self._exec[key[0]] = cell_id
        self._exec.move_to_end(key[0])
        while len(self._sticky) > self.max_sticky_keys:
            self._sticky.popitem(last=False)
        while len(self._exec) > self.max_sticky_keys:
            self._exec.popitem(last=False)

    def plan(self, count: int, *, exclude: Iterable[str] = ()) -> list[str]:
        """Targets for ``count`` requests leaving an engine: each to the least loaded ready engine,
        counting the ones already planned (no side effects; [] when no engine is ready)."""
        excluded = set(exclude)
        with self._lock:
            loads = {e.cell_id: e.score() for e in self._routable(excluded)}
        if not loads:
            return []
        out = []
        for _ in range(count):
            cell = min(loads, key=lambda c: (loads[c], c))
            loads[cell] += 1
            out.append(cell)
        return out

    def acquire(self, cell_id: str) -> EngineEntry | None:
        """Count a call in flight on ``cell_id`` (after it moved there); None if unknown."""
        with self._lock:
            entry = self._engines.get(cell_id)
            if entry is not None:
                entry.in_flight += 1
            return entry

    def release(self, cell_id: str) -> None:
        with self._lock:
            entry = self._engines.get(cell_id)
            if entry is not None and entry.in_flight > 0:
                entry.in_flight -= 1

    def rebind(self, key: StickyKey | None, cell_id: str) -> None:
        """Point an agent context at the engine its request moved to (its KV now lives there)."""
        if key is None or not key[0]:
            return
        with self._lock:
            if cell_id in self._engines:
                self._bind(key, cell_id)
