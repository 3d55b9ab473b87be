"""Asynchronous forwarding of TITO records (finished calls) to the trajectory service.

The gateway produces one ``services.trajectory.records.TitoCall`` per finished call and hands it to a
``TitoForwarder``, which never blocks the caller:

    gateway threads --submit()--> queue bounded --> forwarder thread --sink(batch)--> trajectory
                                  by bytes (full:      (retries with capped exponential
                                  drop+count+log)       backoff and jitter, each attempt logged)

The bound is on bytes, not records: one call of a 1M-token execution carries megabytes of prompt
ids, a short chat turn a few hundred bytes, so a record count bounds neither memory nor backlog.
A record is counted from the moment it is queued until its batch was delivered (or dropped).

``sink`` is whatever delivers a batch (in production ``TrajectoryClient.ingest`` behind a delta
encoder, see ``services.rollout.main``); it raises to signal a failed attempt.
"""

from __future__ import annotations

import random
import threading
from collections import deque
from collections.abc import Callable

from prometheus_client import Counter, Gauge

from services.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument
from services.common.logging import get_logger
from services.common.metrics import REGISTRY
from services.trajectory.records import TitoCall

log = get_logger(__name__)

TITO_FORWARDED = Counter("gyre_rollout_tito_forwarded_total", "TITO records delivered to trajectory.",
                         registry=REGISTRY)
TITO_DROPPED = Counter("gyre_rollout_tito_dropped_total",
                       "TITO records dropped (queue full or forwarder stopped).", registry=REGISTRY)
TITO_RETRIES = Counter("gyre_rollout_tito_retries_total", "Failed attempts to deliver a TITO batch.",
                       registry=REGISTRY)
TITO_QUEUE = Gauge("gyre_rollout_tito_queue", "TITO records waiting to be forwarded.", registry=REGISTRY)
TITO_QUEUE_BYTES = Gauge("gyre_rollout_tito_queue_bytes", "Bytes of TITO records queued or in delivery.",
                         registry=REGISTRY)
RECORD_OVERHEAD_BYTES = 256  # ids, role, version and the object itself, beyond the token arrays


def record_bytes(call: TitoCall) -> int:
    """Memory a queued record holds: its token and logprob arrays plus a fixed overhead."""
    prompt = call.prompt_ids if call.prompt_ids is not None else call.delta.new_ids if call.delta else None
    arrays = call.output_ids.nbytes + call.output_logprobs.nbytes + (0 if prompt is None else prompt.nbytes)
    if call.output_forced is not None and call.output_policy_logprobs is not None:
        arrays += call.output_forced.nbytes + call.output_policy_logprobs.nbytes
    return arrays + RECORD_OVERHEAD_BYTES


Sink = Callable[[list[TitoCall]], None]
# Rejections that no retry can fix.
PERMANENT = (InvalidArgument, AlreadyExists, FailedPrecondition)


class TitoForwarder:
    """Bounded, retrying, background delivery of ``TitoCall`` batches to ``sink``.

    Lifecycle: start() -> submit()* -> stop(timeout_s) (delivers what is queued, within timeout).
    """

    def __init__(self, sink: Sink, *, max_queue_bytes: int = 256 << 20, batch_size: int = 64,
                 backoff_s: float = 0.2, max_backoff_s: float = 10.0) -> None:
        if max_queue_bytes < 1 or batch_size < 1:
            raise ValueError("max_queue_bytes and batch_size must be >= 1")
        self._sink = sink
        self._max_bytes = max_queue_bytes
        self._queue: deque[tuple[TitoCall, int]] = deque()  # guarded by _idle
        self._bytes = 0  # queued + in delivery
        self._batch_size = batch_size
        self._backoff_s = backoff_s
        self._max_backoff_s = max_backoff_s
        self._stop = threading.Event()
        self._idle = threading.Condition()
        self._busy = 0
        self._waiters: dict[int, threading.Event] = {}
        self._thread = threading.Thread(target=self._run, name="tito-forwarder", daemon=True)

    def start(self) -> "TitoForwarder":
        self._thread.start()
        return self

    def submit(self, call: TitoCall) -> bool:
        """Queue a record; False (counted, logged) when its bytes do not fit or the forwarder
        stopped. A record larger than the whole budget still goes when nothing else is queued."""
        if self._stop.is_set():
            TITO_DROPPED.inc()
            return False
        size = record_bytes(call)
        with self._idle:
            full = self._bytes and self._bytes + size > self._max_bytes
            if not full:
                self._queue.append((call, size))
                self._bytes += size
                self._busy += 1
                self._idle.notify_all()
            queued, queued_bytes = len(self._queue), self._bytes
        if full:
            TITO_DROPPED.inc()
            log.error("tito queue full; record dropped", execution_id=call.execution_id, call_id=call.call_id,
                      record_bytes=size, queued_bytes=queued_bytes, max_queue_bytes=self._max_bytes)
            return False
        TITO_QUEUE.set(queued)
        TITO_QUEUE_BYTES.set(queued_bytes)
        return True

    def submit_and_wait(self, call: TitoCall, timeout_s: float) -> bool:
        """Queue a record and wait (at most ``timeout_s``) until it is delivered.

        Used so a call's response leaves the gateway only once its record is durable at the
        trajectory service: the harness then reports the outcome, and an outcome can never
        overtake its execution's last records. On timeout the record stays queued (delivered
        later, with retries); False says it was not confirmed in time.
        """
        done = threading.Event()
        with self._idle:
            self._waiters[id(call)] = done
        if not self.submit(call):
            with self._idle:
                self._waiters.pop(id(call), None)
            return False
        if done.wait(timeout_s):
            return True
        with self._idle:
            self._waiters.pop(id(call), None)
        log.warning("tito record not confirmed in time; still queued", execution_id=call.execution_id,
                    call_id=call.call_id, timeout_s=timeout_s)
        return False

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every submitted record was delivered (or dropped); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._busy == 0, timeout=timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        self.flush(timeout_s)
        self._stop.set()
        with self._idle:
            self._idle.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=max(timeout_s, 0.1))

    def _run(self) -> None:
        while True:
            with self._idle:
                self._idle.wait_for(lambda: self._queue or self._stop.is_set())
                if self._stop.is_set():
                    return
                taken = [self._queue.popleft() for _ in range(min(self._batch_size, len(self._queue)))]
                TITO_QUEUE.set(len(self._queue))
            batch = [call for call, _ in taken]
            delivered = self._deliver(batch)
            if delivered:
                TITO_FORWARDED.inc(len(batch))
            else:
                TITO_DROPPED.inc(len(batch))
            with self._idle:
                self._busy -= len(batch)
                self._bytes -= sum(size for _, size in taken)
                TITO_QUEUE_BYTES.set(self._bytes)
                for call in batch:
                    waiter = self._waiters.pop(id(call), None)
                    if waiter is not None:
                        waiter.set()
                self._idle.notify_all()

    def _deliver(self, batch: list[TitoCall]) -> bool:
        """Retry until delivered; gives up only when the forwarder is stopping.

        A record the trajectory service rejects for good (invalid, a duplicate with other content,
        arrived after its execution was packed) is never retried: it would block every record
        behind it. The batch is split so only the rejected records are dropped (logged, counted).
        """
        attempt = 0
        while True:
            try:
                self._sink(batch)
                return True
            except PERMANENT as exc:
                if len(batch) > 1:
                    return all([self._deliver([call]) for call in batch])
                TITO_DROPPED.inc()
                log.error("tito record rejected by trajectory; dropped", execution_id=batch[0].execution_id,
                          call_id=batch[0].call_id, error=f"{type(exc).__name__}: {exc}")
                return True
            except Exception as exc:  # deliberate: the trajectory service may be restarting
                attempt += 1
                TITO_RETRIES.inc()
                delay = min(self._max_backoff_s, self._backoff_s * 2 ** min(attempt - 1, 10))
                delay *= 0.5 + random.random()
                log.warning("tito delivery failed; retrying", attempt=attempt, records=len(batch),
                            delay_s=round(delay, 3), error=f"{type(exc).__name__}: {exc}")
                if self._stop.wait(delay):
                    log.error("tito forwarder stopped; batch dropped", records=len(batch))
                    return False
