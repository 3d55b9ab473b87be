"""Work queue of one step's micro-batches, shared by every trainer replica of that step.

Each micro-batch goes to exactly one consumer at a time::

    add() -> PENDING --lease(consumer)--> LEASED --ack(consumer)--> ACKED
                ^                            |
                +-- release(consumer) / lease older than lease_s (consumer gone)

A consumer holds at most ``max_in_flight`` unacknowledged batches, so a fast replica cannot hoard
the step and all replicas finish together. ``seal()`` says no batch will be added; the step is
*done* when it is sealed and every batch is acknowledged -- then every waiting consumer's stream
ends. Leases live only in memory: after a restart every unacknowledged batch is pending again.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from services.trajectory.store import BatchMeta


@dataclass(frozen=True)
class StepPlan:
    """Where a step stands (mirrors gyre.v1.StepPlan)."""

    job_id: str
    step: int
    num_executions: int  # loss-weight denominator; 0 = not known yet
    num_completed: int
    num_trained: int
    num_micro_batches: int
    num_acked: int
    sealed: bool
    done: bool
    token_budget: int
    num_tokens: int
    context_tokens: int
    group_size: int
    acked_tokens: int = 0  # tokens in the acknowledged micro-batches


class Done:
    """Sentinel: the step is sealed and fully acknowledged."""


DONE = Done()


class LeaseConflict(Exception):
    """An ack for a batch that is leased to another consumer (its lease expired and it was re-handed)."""


class StepQueue:
    def __init__(self, *, lease_s: float, max_in_flight: int, clock: Callable[[], float] = time.monotonic) -> None:
        if lease_s <= 0 or max_in_flight < 1:
            raise ValueError("lease_s must be > 0 and max_in_flight >= 1")
        self.lease_s = lease_s
        self.max_in_flight = max_in_flight
        self._clock = clock
        self.cond = threading.Condition()
        self.metas: dict[str, BatchMeta] = {}
        self._pending: deque[str] = deque()
        self._leases: dict[str, tuple[str, float]] = {}  # batch id -> (consumer, deadline)
        self.acked: dict[str, str] = {}  # batch id -> consumer that acknowledged it ("" after a restart)
        self.sealed = False

    # ----------------------------------------------------------------- producers
    def add(self, meta: BatchMeta, *, acked: bool = False) -> None:
        with self.cond:
            assert not self.sealed, "batch added to a sealed step"
            self.metas[meta.batch_id] = meta
            if acked:
                self.acked[meta.batch_id] = ""
            else:
                self._pending.append(meta.batch_id)
            self.cond.notify_all()

    def seal(self) -> None:
        with self.cond:
            self.sealed = True
            self.cond.notify_all()

    # ----------------------------------------------------------------- consumers
    @property
    def done(self) -> bool:
        return self.sealed and len(self.acked) == len(self.metas)

    def lease(self, consumer: str, timeout_s: float) -> BatchMeta | Done | None:
        """The next batch for ``consumer``; ``DONE`` when the step is consumed; None on timeout."""
        deadline = self._clock() + timeout_s
        with self.cond:
            while True:
                self._expire()
                if self.done:
                    return DONE
                mine = sum(1 for c, _ in self._leases.values() if c == consumer)
                if self._pending and mine < self.max_in_flight:
                    batch_id = self._pending.popleft()
                    self._leases[batch_id] = (consumer, self._clock() + self.lease_s)
                    return self.metas[batch_id]
                left = deadline - self._clock()
                if left <= 0:
                    return None
                wait = left
                if self._leases:  # wake up for the earliest lease expiry
                    wait = min(wait, max(0.0, min(d for _, d in self._leases.values()) - self._clock()) + 1e-3)
                self.cond.wait(wait)

    def ack(self, batch_id: str, consumer: str) -> bool:
        """Acknowledge a batch; True when this call acknowledged it (False: already acknowledged)."""
        with self.cond:
            if batch_id not in self.metas:
                raise KeyError(batch_id)
            if batch_id in self.acked:
                by = self.acked[batch_id]
                if by and by != consumer:
                    raise LeaseConflict(f"batch {batch_id!r} was acknowledged by consumer {by!r}, not {consumer!r}; "
                                        "discard its result")
                return False
            holder = self._leases.get(batch_id)
            if holder is None or holder[0] != consumer:
                raise LeaseConflict(
                    f"batch {batch_id!r} is not leased to consumer {consumer!r}"
                    + (f" (it is leased to {holder[0]!r})" if holder else " (it is pending: its lease was returned)")
                    + "; discard its result")
            del self._leases[batch_id]
            self.acked[batch_id] = consumer
            self.cond.notify_all()
            return True

    def release(self, consumer: str) -> int:
        """Return every unacknowledged batch of ``consumer`` to the queue (front); returns how many."""
        with self.cond:
            mine = [b for b, (c, _) in self._leases.items() if c == consumer]
            for b in reversed(mine):
                del self._leases[b]
                self._pending.appendleft(b)
            if mine:
                self.cond.notify_all()
            return len(mine)

    def reopen(self, consumers: set[str]) -> list[str]:
        """Put every batch acknowledged by one of ``consumers`` back in the queue (front): their
        gradients never reached the trainer core. Returns the batch ids."""
        with self.cond:
            ids = [b for b, c in self.acked.items() if c and c in consumers]
            for b in reversed(ids):
                del self.acked[b]
                self._pending.appendleft(b)
            if ids:
                self.cond.notify_all()
            return ids

    def _expire(self) -> None:
        now = self._clock()
        expired = [b for b, (_, d) in self._leases.items() if d <= now]
        for b in reversed(expired):
            del self._leases[b]
            self._pending.appendleft(b)

    def counts(self) -> tuple[int, int, int]:
        """(pending, leased, acked)."""
        with self.cond:
            return len(self._pending), len(self._leases), len(self.acked)

    def acked_tokens(self) -> int:
        """Tokens in the acknowledged batches (what the trainer has trained of the step)."""
        with self.cond:
            return sum(self.metas[b].num_tokens for b in self.acked if b in self.metas)
