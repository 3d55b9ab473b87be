"""StepMembership: who is in a step, sealing, late joins, leaves, evictions, releases (threads)."""

from __future__ import annotations

import threading
import time

import pytest

from services.common.errors import FailedPrecondition, NotFound
from services.trainer.elastic import Seal, StepMembership


def _membership(timeout_s: float = 5.0) -> StepMembership:
    m = StepMembership(job_id="j", store_host="h", store_port=1, member_timeout_s=timeout_s)
    m.open_step(0, 0)
    return m


def _done_async(m: StepMembership, replica_id: str, step: int, out: dict[str, object]) -> threading.Thread:
    def run() -> None:
        try:
            out[replica_id] = m.done(replica_id, step, timeout_s=10)
        except Exception as exc:  # collected for the assertion
            out[replica_id] = exc

    t = threading.Thread(target=run)
    t.start()
    return t


def test_seal_waits_for_members_and_ranks_by_join_order() -> None:
    m = _membership()
    assert m.join("b", "cell-b").step == 0
    assert m.join("a", "cell-a").step == 0
    out: dict[str, object] = {}
    threads = [_done_async(m, "a", 0, out)]
    sealed: dict[str, Seal] = {}
    core = threading.Thread(target=lambda: sealed.setdefault("core", m.core_done(0)))
    core.start()
    time.sleep(0.1)
    assert core.is_alive()  # b has not reported yet
    threads.append(_done_async(m, "b", 0, out))
    core.join(5)
    for t in threads:
        t.join(5)
    assert sealed["core"].world_size == 3 and sealed["core"].rank == 0
    assert out["b"] == Seal(step=0, rank=1, world_size=3, group_prefix="gyre/j/step/0")
    assert out["a"] == Seal(step=0, rank=2, world_size=3, group_prefix="gyre/j/step/0")


def test_join_while_sealed_lands_in_next_step() -> None:
    m = _membership()
    assert m.core_done(0).world_size == 1
    ticket = m.join("late", "cell-x")
    assert (ticket.step, ticket.weight_version, ticket.group_prefix) == (1, 1, "gyre/j/step/1")
    m.open_step(1, 1)
    out: dict[str, object] = {}
    t = _done_async(m, "late", 1, out)
    assert m.core_done(1).world_size == 2
    t.join(5)
    assert isinstance(out["late"], Seal) and out["late"].rank == 1  # type: ignore[union-attr]


def test_leave_before_seal_shrinks_world() -> None:
    m = _membership()
    m.join("a", "cell-a")
    m.join("b", "cell-b")
    assert m.leave("b") == 0
    out: dict[str, object] = {}
    t = _done_async(m, "a", 0, out)
    assert m.core_done(0).world_size == 2
    t.join(5)
    with pytest.raises(FailedPrecondition, match="left"):
        m.done("b", 0)


def test_leave_after_reducing_a_sealed_step_leaves_the_next() -> None:
    """A replica that took part in step 0's all-reduce and joined step 1 while step 0 was still
    sealed (the core applying the update) is released: it leaves step 1, which is what it is in;
    step 0's seal no longer waits on it (CI's colocate run saw it refused and the replica crash)."""
    m = _membership()
    m.join("a", "cell-a")
    out: dict[str, object] = {}
    t = _done_async(m, "a", 0, out)
    assert m.core_done(0).world_size == 2
    t.join(5)
    assert m.join("a", "cell-a").step == 1  # step 0 still sealed: lands in the next one
    assert m.leave("a") == 1
    m.open_step(1, 1)
    assert m.core_done(1).world_size == 1  # not a member any more
    assert [x for x in m.members() if x["step"] == 1] == []


def test_silent_member_is_evicted() -> None:
    m = _membership(timeout_s=0.2)
    m.join("ghost", "cell-g")
    assert m.core_done(0).world_size == 1
    assert m.members()[0]["evicted"]
    with pytest.raises(FailedPrecondition, match="evicted"):
        m.done("ghost", 0)


def test_member_without_heartbeats_is_gone_before_member_timeout() -> None:
    now = [100.0]
    m = StepMembership(job_id="j", store_host="h", store_port=1, member_timeout_s=3600.0, silence_s=20.0,
                       clock=lambda: now[0])
    m.open_step(0, 0)
    assert m.join("live", "cell-l").heartbeat_interval_s == 2.5
    m.join("dead", "cell-d")  # its host went away: no heartbeat after the join
    assert not m.heard("never-joined")
    now[0] += 25.0
    assert m.heard("live")
    out: dict[str, object] = {}
    t = _done_async(m, "live", 0, out)
    while not any(x["done"] for x in m.members()):
        time.sleep(0.005)
    seal = m.core_done(0)  # "dead" is silent past 20 s: evicted now, not after member_timeout_s
    t.join(10)
    assert seal.world_size == 2 and isinstance(out["live"], Seal) and out["live"].rank == 1
    assert m.evicted(0) == ["dead"]


def test_release_flag_reaches_the_replica() -> None:
    m = _membership()
    m.join("a", "cell-a")
    assert m.release("a") and not m.release("nobody")
    out: dict[str, object] = {}
    t = _done_async(m, "a", 0, out)
    m.core_done(0)
    t.join(5)
    assert out["a"].release  # type: ignore[union-attr]


def test_errors_for_unknown_members_and_steps() -> None:
    m = _membership()
    with pytest.raises(NotFound):
        m.done("stranger", 0)
    with pytest.raises(FailedPrecondition, match="not the trainer's current step"):
        m.done("stranger", 5)
    with pytest.raises(ValueError):
        m.join("", "cell")
    fresh = StepMembership(job_id="j", store_host="h", store_port=1)
    with pytest.raises(FailedPrecondition, match="no step"):
        fresh.join("a", "c")
