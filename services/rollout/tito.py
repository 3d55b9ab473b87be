"""Asynchronous forwarding of TITO records (finished calls) to the trajectory service.

The gateway produces one ``services.trajectory.records.TitoCall`` per finished call and hands it to a
``TitoForwarder``, which never blocks the caller:

    gateway threads --submit()--> bounded queue --> forwarder thread --sink(batch)--> trajectory
                                  (full: drop +        (retries with capped exponential
                                   count + log)         backoff and jitter, each attempt logged)

``sink`` is whatever delivers a batch (in production ``TrajectoryClient.ingest`` behind a delta
encoder, see ``services.rollout.main``); it raises to signal a failed attempt.
"""

from __future__ import annotations

import queue
import random
import threading
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


Sink = Callable[[list[TitoCall]], None]
# Rejections that no retry can fix.
PERMANENT = (InvalidArgument, AlreadyExists, FailedPrecondition)


class TitoForwarder:
    """Bounded, retrying, background delivery of ``TitoCall`` batches to ``sink``.

    Lifecycle: start() -> submit()* -> stop(timeout_s) (delivers what is queued, within timeout).
    """

    def __init__(self, sink: Sink, *, max_queue: int = 10_000, batch_size: int = 64,
                 backoff_s: float = 0.2, max_backoff_s: float = 10.0) -> None:
        if max_queue < 1 or batch_size < 1:
            raise ValueError("max_queue and batch_size must be >= 1")
        self._sink = sink
        self._queue: queue.Queue[TitoCall] = queue.Queue(maxsize=max_queue)
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
        """Queue a record; False (counted, logged) when the queue is full or stopped."""
        if self._stop.is_set():
            TITO_DROPPED.inc()
            return False
        try:
            self._queue.put_nowait(call)
        except queue.Full:
            TITO_DROPPED.inc()
            log.error("tito queue full; record dropped", execution_id=call.execution_id,
                      call_id=call.call_id)
            return False
        with self._idle:
            self._busy += 1
        TITO_QUEUE.set(self._queue.qsize())
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
        if self._thread.is_alive():
            self._thread.join(timeout=max(timeout_s, 0.1))

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                first = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            batch = [first]
            while len(batch) < self._batch_size:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            TITO_QUEUE.set(self._queue.qsize())
            delivered = self._deliver(batch)
            if delivered:
                TITO_FORWARDED.inc(len(batch))
            else:
                TITO_DROPPED.inc(len(batch))
            with self._idle:
                self._busy -= len(batch)
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
