"""Step work queue: one consumer per batch, in-flight cap, re-handing on release and lease expiry."""

from __future__ import annotations

import threading

import pytest

from services.trajectory.steps import DONE, LeaseConflict, StepQueue
from services.trajectory.store import BatchMeta


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def meta(i: int) -> BatchMeta:
    return BatchMeta(f"b{i}", f"k{i}", 10, 5, 0, ("e",), (("e", i),))


def test_each_batch_goes_to_one_consumer_and_the_step_ends_when_all_are_acked() -> None:
    q = StepQueue(lease_s=100, max_in_flight=1)
    for i in range(3):
        q.add(meta(i))
    a = q.lease("A", 0)
    b = q.lease("B", 0)
    assert a.batch_id != b.batch_id
    assert q.lease("A", 0) is None  # in-flight cap: A must ack first
    assert q.ack(a.batch_id, "A") and not q.ack(a.batch_id, "A")
    c = q.lease("A", 0)
    q.seal()
    q.ack(b.batch_id, "B")
    assert q.lease("B", 0) is None  # c is still out
    q.ack(c.batch_id, "A")
    assert q.lease("B", 0) is DONE and q.done


def test_released_and_expired_leases_are_handed_again() -> None:
    clock = Clock()
    q = StepQueue(lease_s=10, max_in_flight=2, clock=clock)
    q.add(meta(0))
    q.add(meta(1))
    assert q.lease("A", 0).batch_id == "b0"
    assert q.release("A") == 1
    assert q.lease("B", 0).batch_id == "b0"  # back at the front
    with pytest.raises(LeaseConflict, match="leased to 'B'"):
        q.ack("b0", "A")
    clock.t = 11  # B's lease expires
    assert q.lease("C", 0).batch_id == "b0"
    with pytest.raises(LeaseConflict):
        q.ack("b0", "B")
    assert q.ack("b0", "C")
    with pytest.raises(LeaseConflict, match="acknowledged by consumer 'C'"):
        q.ack("b0", "B")
    with pytest.raises(KeyError):
        q.ack("nope", "C")


def test_a_waiting_consumer_wakes_up_when_a_batch_arrives() -> None:
    q = StepQueue(lease_s=100, max_in_flight=1)
    got = []
    t = threading.Thread(target=lambda: got.append(q.lease("A", 5.0)))
    t.start()
    q.add(meta(7))
    t.join(timeout=5)
    assert got and got[0].batch_id == "b7"
