"""What a micro-batch source hands out (``Delivery``) and the ``BatchSource`` protocol.

The interface alone: implementations (``services.trainer.sources``,
``services.trainer.trajectory_source``) import it, and the factory that picks one
(``sources.open_source``) sits beside them, so no module here imports upward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from services.trainer.batch import PackedBatchLike


@dataclass(frozen=True)
class Delivery:
    """A micro-batch handed to one consumer.

    ``ack()`` is called after the forward, right before the backward; it returns False when the
    queue refuses it (the batch was meanwhile handed to another consumer): discard the result.
    ``give_back()`` returns an unacknowledged batch to the queue at once, for another consumer (a
    replica that gave up its forward); None where the queue does that by itself (the trajectory
    service, when the consumer's stream is cancelled).
    """

    batch: PackedBatchLike
    ack: Callable[[], bool]
    reject: Callable[[str], None]
    batch_id: str = ""
    give_back: Callable[[], None] | None = None


class BatchSource(Protocol):
    def next(self, step: int) -> Delivery | None:
        """The next micro-batch of ``step`` for this consumer, or None once the step is consumed."""

    def close(self) -> None: ...
