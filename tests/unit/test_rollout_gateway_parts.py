"""Pure parts of the rollout gateway/engine host: routing, prompt deltas, weight chunks, TITO
forwarding, request channels."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.common.errors import InvalidArgument, NotFound, Unavailable
from services.rollout.call_cache import CallCache
from services.rollout.engine import TokenEvent
from services.rollout.host import RequestChannel
from services.rollout.router import DEAD, DRAINING, READY, Router
from services.rollout.tito import TitoForwarder, record_bytes
from services.common.weights import WeightAssembler, chunk_state_dict
from services.trajectory.records import TitoCall


# -- router -------------------------------------------------------------------------------------
def test_router_is_load_aware_and_sticky_within_slack() -> None:
    r = Router(sticky_slack=1)
    r.register("a", "h:1")
    r.register("b", "h:2")
    first = r.pick(("ex", "agent")).cell_id
    other = "b" if first == "a" else "a"
    assert r.pick(("ex2", "agent")).cell_id == other  # least loaded
    assert r.pick(("ex", "agent")).cell_id == first  # sticky: 1 vs 1
    assert r.pick(("ex", "agent")).cell_id == first  # sticky: 2 vs 1 is within the slack of 1
    assert r.pick(("ex", "agent")).cell_id == other  # 3 vs 1: beyond the slack, moves
    assert r.pick(("ex", "agent")).cell_id == other  # and sticks to its new engine
    r.release(first)
    assert r.get(first).in_flight == 2


def test_a_new_agent_of_an_execution_starts_on_that_executions_engine() -> None:
    """A sub-agent's or a summarizer's first call goes where its execution's contexts are cached
    (within the slack), then sticks to its own engine like any agent."""
    r = Router(sticky_slack=1)
    r.register("a", "h:1")
    r.register("b", "h:2")
    main = r.pick(("ex", "main")).cell_id
    other = "b" if main == "a" else "a"
    assert r.pick(("ex", "summarizer")).cell_id == main  # 1 vs 0: within the slack
    assert r.pick(("ex", "search")).cell_id == other  # 2 vs 0: beyond it, the least loaded
    assert r.pick(("ex", "search")).cell_id == other  # and its own engine from then on


def test_router_skips_draining_and_dead_engines_and_revives_on_probe() -> None:
    r = Router()
    r.register("a", "h:1")
    r.register("b", "h:2")
    r.set_state("a", DRAINING)
    assert {r.pick(None).cell_id for _ in range(3)} == {"b"}
    for _ in range(3):
        r.record_probe("b", ok=False)
    assert r.get("b").state == DEAD
    with pytest.raises(Unavailable, match="a=draining, b=dead"):
        r.pick(None)
    r.record_probe("b", ok=True, vocab_size=512)
    assert r.get("b").state == READY and r.get("b").vocab_size == 512
    r.record_probe("b", ok=True, draining=True)
    assert r.get("b").state == DRAINING
    r.register("b", "h:2")
    assert r.get("b").state == READY


def test_router_plans_targets_by_load_without_side_effects() -> None:
    r = Router()
    for c in "abc":
        r.register(c, f"h:{ord(c)}")
    r.pick(None, exclude={"b", "c"})  # a has one in flight
    assert r.plan(4, exclude={"c"}) == ["b", "a", "b", "a"]
    assert r.get("a").in_flight == 1 and r.get("b").in_flight == 0
    assert r.plan(2, exclude={"a", "b", "c"}) == []
    with pytest.raises(NotFound):
        r.deregister("zz")
    with pytest.raises(ValueError, match="host:port"):
        r.register("x", "nohost")


def test_router_sends_no_new_call_to_a_cordoned_cell_while_another_can_take_it() -> None:
    r = Router()
    for c in "ab":
        r.register(c, f"h:{ord(c)}")
    assert r.pick(("e1", "main"), exclude=()).cell_id == "a"  # e1's context lives on a
    assert r.set_cordoned({"a"}) and not r.set_cordoned({"a"})
    # neither a new context nor e1's next call (it re-prefills on b), nor a migration, goes to a
    assert {r.pick(("e1", "main")).cell_id for _ in range(3)} == {"b"}
    assert r.pick(None).cell_id == "b" and r.plan(2) == ["b", "b"]
    r.register("c", "h:99")  # registered later: still uncordoned; a cell cordoned before it registers is
    r.set_cordoned({"a", "d"})
    assert r.register("d", "h:100").cordoned and r.pick(None).cell_id == "c"
    r.set_state("b", DEAD)
    r.set_state("c", DEAD)
    assert r.pick(None).cell_id in {"a", "d"}  # only cordoned engines are ready: they still serve
    r.set_cordoned(())
    assert not r.get("a").cordoned


# -- prompt deltas ------------------------------------------------------------------------------
def test_call_cache_resolves_deltas_and_stays_bounded() -> None:
    cache = CallCache(max_calls_per_execution=2, max_tokens=100)
    cache.put("ex", "c1", np.arange(10))
    got = cache.resolve("ex", "c1", 4, np.array([50, 51]))
    np.testing.assert_array_equal(got, [0, 1, 2, 3, 50, 51])
    np.testing.assert_array_equal(cache.resolve("ex", "", 0, np.array([7])), [7])
    with pytest.raises(InvalidArgument, match="outside"):
        cache.resolve("ex", "c1", 11, np.array([1]))
    with pytest.raises(NotFound, match="unknown session"):
        cache.resolve("other", "c1", 1, np.array([1]))
    cache.put("ex", "c2", np.arange(10))
    cache.put("ex", "c3", np.arange(10))  # c1 falls out (2 calls per execution)
    with pytest.raises(NotFound):
        cache.resolve("ex", "c1", 1, np.array([1]))
    for i in range(20):
        cache.put(f"e{i}", "c", np.arange(10))
    assert cache.tokens <= 100


# -- weights ------------------------------------------------------------------------------------
def test_weight_chunks_round_trip_any_chunking() -> None:
    sd = {"w": torch.randn(7, 5), "b": torch.arange(3, dtype=torch.bfloat16), "s": torch.tensor(2.5)}
    for chunk_bytes in (1, 13, 1 << 20):
        asm = WeightAssembler()
        chunks = list(chunk_state_dict(sd, 3, chunk_bytes=chunk_bytes))
        for c in reversed(chunks[:-1]):  # order does not matter, only `last` comes last
            asm.add(**{**c, "shape": tuple(c["shape"])})  # type: ignore[arg-type]
        assert not asm.complete
        asm.add(**{**chunks[-1], "shape": tuple(chunks[-1]["shape"])})  # type: ignore[arg-type]
        out = asm.state_dict()
        assert asm.version == 3 and set(out) == set(sd)
        for name in sd:
            assert out[name].dtype == sd[name].dtype and torch.equal(out[name], sd[name])


def test_weight_assembler_rejects_inconsistent_chunks() -> None:
    base = dict(version=1, name="w", dtype="float32", shape=(2,), data=b"\0" * 4, offset_bytes=0,
                total_bytes=8, last=False)
    asm = WeightAssembler()
    asm.add(**base)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="overlaps"):
        asm.add(**base)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="version 2"):
        asm.add(**{**base, "version": 2, "offset_bytes": 4})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="outside"):
        asm.add(**{**base, "offset_bytes": 6})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="total_bytes 12"):
        asm.add(**{**base, "name": "v", "total_bytes": 12})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="without a chunk marked last"):
        asm.state_dict()


# -- TITO forwarding ----------------------------------------------------------------------------
def call(i: int, prompt_tokens: int = 2) -> TitoCall:
    return TitoCall(execution_id="ex", call_id=f"c{i}", agent_id="a", role="main", output_ids=np.array([1]),
                    output_logprobs=np.array([-0.5]), weight_version=0, prompt_ids=np.arange(prompt_tokens) % 7)


def test_forwarder_retries_until_delivered_and_drops_when_full() -> None:
    delivered: list[str] = []
    failures = [2]

    def sink(batch: list[TitoCall]) -> None:
        if failures[0]:
            failures[0] -= 1
            raise ConnectionError("trajectory restarting")
        delivered.extend(c.call_id for c in batch)

    fwd = TitoForwarder(sink, max_queue_bytes=3 * record_bytes(call(0)), batch_size=2, backoff_s=0.01)
    accepted = [fwd.submit(call(i)) for i in range(6)]  # not started yet: the bounded queue overflows
    assert accepted == [True] * 3 + [False] * 3
    fwd.start()
    assert fwd.flush(timeout_s=10)
    fwd.stop()
    assert sorted(delivered) == sorted(f"c{i}" for i, ok in enumerate(accepted) if ok)
    assert not fwd.submit(call(99))


def test_forwarder_queue_is_bounded_by_bytes_not_records() -> None:
    delivered: list[str] = []
    small, big = call(0), call(1, prompt_tokens=100_000)  # a long context's call: ~400 KB of prompt ids
    assert record_bytes(big) > 100 * record_bytes(small)
    fwd = TitoForwarder(lambda batch: delivered.extend(c.call_id for c in batch),
                        max_queue_bytes=record_bytes(big) // 2, batch_size=4)
    assert fwd.submit(small) and fwd.submit(call(2))  # many short records fit the budget
    assert not fwd.submit(big)  # this one does not fit beside them
    fwd.start()
    assert fwd.flush(timeout_s=10)
    assert fwd.submit(big)  # nothing queued: a record over the whole budget still goes, alone
    assert fwd.flush(timeout_s=10)
    fwd.stop()
    assert delivered == ["c0", "c2", "c1"]


# -- request channels ---------------------------------------------------------------------------
def ev(ids: list[int], offset: int, version: int = 0, finished: bool = False, reason: str | None = None) -> TokenEvent:
    return TokenEvent("r", np.array(ids, np.int32), np.full(len(ids), -1.0, np.float32), finished, reason,
                      version, offset=offset, seed=5)


def test_channel_coalesces_events_but_never_across_weight_versions() -> None:
    ch = RequestChannel("r", seed=5)
    for e in (ev([1], 0), ev([2], 1), ev([3], 2, version=1), ev([4], 3, version=1, finished=True, reason="stop")):
        ch.on_event(e)
    pieces = list(ch.pieces())
    assert [p.token_ids.tolist() for p in pieces] == [[1, 2], [3, 4]]
    assert [p.offset for p in pieces] == [0, 2] and [p.weight_version for p in pieces] == [0, 1]
    assert pieces[-1].finished and pieces[-1].finish_reason == "stop" and ch.delivered


def test_channel_hides_the_export_event_and_ends_with_the_migration_marker() -> None:
    ch = RequestChannel("r", seed=5)
    ch.on_event(ev([1, 2], 0))
    ch.on_event(ev([], 2, finished=True, reason="migrated"))
    ch.put_migrated("host:7")
    pieces = list(ch.pieces())
    assert pieces[0].token_ids.tolist() == [1, 2] and not pieces[0].finished
    assert pieces[-1].migrated_to == "host:7" and not pieces[-1].finished
