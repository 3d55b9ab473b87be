"""The production micro-batch source: the trajectory service's ``StreamBatches`` work queue.

One server stream per (step, consumer). Each batch goes to exactly one consumer; the trainer acks
it after the forward and before the backward (``Learner.train(commit=ack)``): an ack refused with
FAILED_PRECONDITION means the batch was re-handed to another consumer (our lease expired), so the
result is discarded without touching the gradient sums. The stream ends when the step is sealed
and every batch is acknowledged - that is "the step's batch is consumed".

A malformed batch is acknowledged without training (logged and counted as rejected): leaving it
unacknowledged would have it re-handed forever and the step would never close.
"""

from __future__ import annotations

from collections.abc import Iterator

from services.common.errors import FailedPrecondition
from services.common.logging import get_logger
from services.trainer.delivery import Delivery
from services.trajectory.client import BatchStream, StreamedBatch, TrajectoryClient

log = get_logger(__name__)


class TrajectorySource:
    def __init__(self, address: str, *, job_id: str, consumer_id: str, token_budget: int = 0) -> None:
        self.client = TrajectoryClient(address, timeout_s=60.0)
        self.job_id = job_id
        self.consumer_id = consumer_id
        self.token_budget = token_budget
        self._step: int | None = None
        self._stream: BatchStream | None = None
        self._items: Iterator[StreamedBatch] | None = None

    def next(self, step: int) -> Delivery | None:
        if self._step != step:
            if self._stream is not None:
                self._stream.cancel()
            self._stream = self.client.stream_batches(self.job_id, step, self.consumer_id,
                                                      token_budget=self.token_budget)
            self._items = iter(self._stream)
            self._step = step
        assert self._items is not None
        item = next(self._items, None)
        if item is None:
            return None

        def ack() -> bool:
            try:
                self.client.ack(self.job_id, step, item.batch_id, self.consumer_id)
            except FailedPrecondition:
                return False
            return True

        def reject(why: str) -> None:
            log.error("dropping malformed micro-batch", job_id=self.job_id, step=step, batch_id=item.batch_id,
                      consumer_id=self.consumer_id, error=why)
            try:
                self.client.ack(self.job_id, step, item.batch_id, self.consumer_id)
            except FailedPrecondition:
                pass

        return Delivery(batch=item.batch, ack=ack, reject=reject, batch_id=item.batch_id)

    def reopen(self, step: int, consumers: list[str]) -> int:
        """Put the batches ``consumers`` acknowledged in ``step`` back in the queue (their gradients
        were lost with their process); the next ``next(step)`` streams them again."""
        n, _ = self.client.settle_step(self.job_id, step, reopen=consumers)
        if self._stream is not None:
            self._stream.cancel()
        self._step, self._stream, self._items = None, None, None
        return n

    def settle(self, step: int) -> None:
        """The step's update is applied: its batches are final (the service may collect them)."""
        self.client.settle_step(self.job_id, step)

    def interrupt(self) -> None:
        """End a ``next`` blocked on the stream (any thread): it returns None."""
        stream = self._stream
        if stream is not None:
            stream.cancel()

    def close(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
        self.client.close()
