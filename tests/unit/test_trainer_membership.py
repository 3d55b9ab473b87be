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
    pg = "gyre/j/step/0/pg"  # a new process group: no participant held one
    assert out["b"] == Seal(step=0, rank=1, world_size=3, group_prefix="gyre/j/step/0", pg_prefix=pg)
    assert out["a"] == Seal(step=0, rank=2, world_size=3, group_prefix="gyre/j/step/0", pg_prefix=pg)


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


def test_a_late_joiner_done_before_the_core_opens_the_next_step_waits_for_it() -> None:
    """A replica joins while step 0 is sealed (so it is in step 1), trains its share of step 1 and
    reports done while the core still publishes step 0: it waits for step 1 to open, then is sealed
    into it, instead of failing ("not the trainer's current step")."""
    m = _membership()
    assert m.core_done(0).world_size == 1
    assert m.join("late", "cell-x").step == 1
    out: dict[str, object] = {}
    t = _done_async(m, "late", 1, out)
    time.sleep(0.1)
    assert t.is_alive() and "late" not in out  # waiting for step 1 to open
    m.open_step(1, 1)
    assert m.core_done(1).world_size == 2
    t.join(5)
    assert out["late"] == Seal(step=1, rank=1, world_size=2, group_prefix="gyre/j/step/1", pg_prefix="gyre/j/step/1/pg")


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


def _store():  # noqa: ANN202 - a real TCPStore master on a free port
    import datetime

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=30))


def _arrive_async(store, seal: Seal, out: dict[str, object], name: str, gone=None) -> threading.Thread:  # noqa: ANN001
    from services.trainer.elastic import arrive

    def run() -> None:
        try:
            arrive(store, seal, timeout_s=30, gone=gone)
            out[name] = "go"
        except Exception as exc:  # collected for the assertion
            out[name] = exc

    t = threading.Thread(target=run)
    t.start()
    return t


def test_arrival_goes_ahead_when_every_participant_is_there() -> None:
    store = _store()
    out: dict[str, object] = {}
    seals = [Seal(step=0, rank=r, world_size=3, group_prefix="gyre/j/step/0") for r in range(3)]
    threads = [_arrive_async(store, s, out, f"r{s.rank}", gone=(lambda: "") if s.rank == 0 else None) for s in seals]
    for t in threads:
        t.join(30)
    assert out == {"r0": "go", "r1": "go", "r2": "go"}
    # a late "off" (a death noticed after everyone arrived) does not undo the verdict
    store.compare_set("gyre/j/step/0/verdict", "", "off:late")
    assert store.get("gyre/j/step/0/verdict") == b"go"


def test_a_participant_gone_after_the_seal_calls_the_reduce_off_for_everyone() -> None:
    """Rank 2 was sealed in and died before reaching the group: the core (rank 0) sees it gone and
    calls the reduce off; rank 1, which arrived, learns it at once (not after collective_timeout_s)."""
    from services.trainer.elastic import ReduceCalledOff

    store = _store()
    out: dict[str, object] = {}
    dead = threading.Event()
    seals = [Seal(step=4, rank=r, world_size=3, group_prefix="gyre/j/step/4") for r in range(2)]
    t1 = _arrive_async(store, seals[1], out, "r1")
    t0 = _arrive_async(store, seals[0], out, "r0", gone=lambda: "replica r2 (its process exited)" if dead.is_set()
                       else "")
    time.sleep(0.2)
    assert not out  # both wait for rank 2
    t_dead = time.monotonic()
    dead.set()
    t0.join(10)
    t1.join(10)
    assert time.monotonic() - t_dead < 5
    for name in ("r0", "r1"):
        assert isinstance(out[name], ReduceCalledOff) and "its process exited" in str(out[name]), out
    # rank 2 coming back late finds the verdict too, instead of building a group nobody else joins
    late: dict[str, object] = {}
    _arrive_async(store, Seal(step=4, rank=2, world_size=3, group_prefix="gyre/j/step/4"), late, "r2").join(10)
    assert isinstance(late["r2"], ReduceCalledOff)


def test_call_off_evicts_the_sealed_participants() -> None:
    m = _membership()
    m.join("a", "cell-a")
    m.join("b", "cell-b")
    out: dict[str, object] = {}
    threads = [_done_async(m, r, 0, out) for r in ("a", "b")]
    assert m.core_done(0).world_size == 3
    for t in threads:
        t.join(5)
    alive = {"a": True, "b": False}
    m.is_alive = lambda rid: alive.get(rid)
    assert "replica b (its process exited)" == m.sealed_gone(0)
    assert m.call_off(0) == ["a", "b"]
    assert m.evicted(0) == ["a", "b"] and m.sealed_gone(0) == ""


def test_the_process_group_is_kept_while_the_participants_stay_and_all_hold_it() -> None:
    m = _membership()

    def step(s: int, held: dict[str, str], core_held: str) -> str:
        if s:
            m.open_step(s, s)
        for rid in held:
            assert m.join(rid, f"cell-{rid}").step == s
        out: dict[str, object] = {}
        threads = [threading.Thread(target=lambda r=rid: out.setdefault(r, m.done(r, s, timeout_s=10,
                                                                                 held_pg=held[r])))
                   for rid in held]
        for t in threads:
            t.start()
        core = m.core_done(s, held_pg=core_held)
        for t in threads:
            t.join(5)
        assert all(out[r].pg_prefix == core.pg_prefix for r in held)  # type: ignore[attr-defined]
        return core.pg_prefix

    p0 = step(0, {"a": ""}, "")
    assert p0 == "gyre/j/step/0/pg"
    assert step(1, {"a": p0}, p0) == p0                       # the same participants, all holding it: kept
    assert step(2, {"a": ""}, p0) == "gyre/j/step/2/pg"       # a holds none (a new process): built again
    p2 = "gyre/j/step/2/pg"
    assert step(3, {"a": p2, "b": ""}, p2) == "gyre/j/step/3/pg"  # b joined: another group
    p3 = "gyre/j/step/3/pg"
    m.open_step(4, 4)
    assert m.join("a", "cell-a").step == 4
    done = threading.Thread(target=lambda: m.done("a", 4, timeout_s=10, held_pg=p3))
    done.start()
    assert m.core_done(4, held_pg=p3).pg_prefix == "gyre/j/step/4/pg"  # b left: another group
    done.join(5)
    m.call_off(4)                                             # that reduce never happened
    assert step(5, {"a": "gyre/j/step/4/pg"}, "gyre/j/step/4/pg") == "gyre/j/step/5/pg"
    assert step(6, {}, "gyre/j/step/5/pg") == ""              # the core alone: no group
