"""Trajectory service over real gRPC (port 0) with a real redis-server: ingest, streaming work queue,
restart recovery and error statuses."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from protos.gyre.v1 import common_pb2
from services.common import errors
from services.common.server import GyreServer
from services.trajectory.client import TrajectoryClient
from services.trajectory.config import TrajectoryConfig
from services.trajectory.main import build_trajectory
from services.trajectory.packing import PackedBatch
from services.trajectory.records import DeltaEncoder, Outcome, Status, TitoCall
from services.common.roles import AgentRole
from services.trajectory.tree import ExecutionTree
from tests.unit.trajectory_reference import NaiveTree, random_execution

JOB = "job-1"


@dataclass
class Service:
    server: GyreServer
    client: TrajectoryClient

    def stop(self) -> None:
        self.client.close()
        self.server.stop(0)


@pytest.fixture
def start(redis_url: str, tmp_path: Path) -> Iterator:
    running: list[Service] = []

    def _start(**overrides: object) -> Service:
        cfg = TrajectoryConfig(**{"redis_url": redis_url, "spool_dir": str(tmp_path / "spool"), "port": 0,
                                  "stream_poll_s": 0.05, "token_budget": 64, **overrides})
        server, _ = build_trajectory(cfg)
        server.start()
        server.set_serving(True)
        svc = Service(server, TrajectoryClient(f"127.0.0.1:{server.port}", timeout_s=20))
        running.append(svc)
        return svc

    yield _start
    for svc in running:
        svc.stop()


def execution(eid: str, seed: int, n_calls: int = 8) -> list[TitoCall]:
    calls = random_execution(np.random.default_rng(seed), n_calls, 5, execution_id=eid, max_new=6)
    return [TitoCall(**{**c.__dict__, "job_id": JOB}) for c in calls]


def outcome(eid: str, group: str, reward: float | None, step: int = 0, **kw: object) -> Outcome:
    return Outcome(eid, group, Status.FINISHED, reward, step=step, job_id=JOB, **kw)  # type: ignore[arg-type]


def test_ingest_is_durable_idempotent_and_stats_match_the_tree(start) -> None:
    svc = start()
    calls = execution("e1", 1, 12)
    summary = svc.client.ingest(calls, delta_encode=True)
    tree = ExecutionTree("e1")
    for c in calls:
        tree.add(c)
    assert summary.accepted == 12 and summary.duplicates == 0 and summary.new_tokens == tree.num_nodes
    again = svc.client.ingest(calls[:5])  # full prompts this time: same content -> duplicates
    assert again.accepted == 0 and again.duplicates == 5
    stats = svc.client.execution_stats("e1", job_id=JOB)
    assert (stats.paths, stats.naive_tokens, stats.tree_tokens, stats.trainable_tokens) == tuple(
        tree.stats().as_dict().values())
    assert stats.num_calls == 12 and stats.unique_tokens == tree.num_nodes and not stats.complete
    assert stats.status == "" and stats.reward is None  # no outcome yet
    capped = svc.client.execution_stats("e1", job_id=JOB, max_paths=1)
    assert capped.paths == min(1, stats.paths)

    # a restarted service rebuilds from Redis + spool and accepts deltas against old calls
    svc.stop()
    svc2 = start()
    assert svc2.client.execution_stats("e1", job_id=JOB).tree_tokens == stats.tree_tokens
    # an outcome in: the stats say how it ended and its reward (what the run report's per-step rates use)
    svc2.client.complete_execution(Outcome("e1", "g-e1", Status.TIMEOUT, 0.25, step=0, job_id=JOB))
    ended = svc2.client.execution_stats("e1", job_id=JOB)
    assert ended.complete and ended.status == "timeout" and ended.reward == 0.25
    full = calls[-1].prompt_ids.tolist() + calls[-1].output_ids.tolist()
    more = TitoCall("e1", "late", "a0", AgentRole.MAIN, np.array([1, 2]), np.array([-0.5, -0.5]), 1,
                    prompt_ids=np.array(full + [3]), job_id=JOB)
    s = svc2.client.ingest([more])
    assert s.accepted == 1 and s.record_tokens == 3  # stored as a 1-token delta + 2 output tokens


def test_bad_records_get_clear_statuses(start) -> None:
    svc = start(vocab_size=50)
    ok = TitoCall("e", "c1", "a", AgentRole.MAIN, np.array([5]), np.array([-0.1]), 0, prompt_ids=np.array([1, 2]),
                  job_id=JOB)
    svc.client.ingest([ok])
    with pytest.raises(errors.AlreadyExists, match="already recorded with different content"):
        svc.client.ingest([TitoCall(**{**ok.__dict__, "prompt_ids": np.array([1, 3])})])
    with pytest.raises(errors.InvalidArgument, match="outside the vocabulary"):
        svc.client.ingest([TitoCall(**{**ok.__dict__, "call_id": "c2", "output_ids": np.array([77])})])

    def raw(**kw: object) -> common_pb2.TitoRecord:
        rec = common_pb2.TitoRecord(context=common_pb2.CallContext(job_id=JOB, execution_id="e", call_id="r",
                                                                  agent_id="a", role=common_pb2.ROLE_MAIN),
                                    prompt_ids=[1, 2], output_ids=[3], output_logprobs=[-0.2])
        for k, v in kw.items():
            if k == "role":
                rec.context.role = v  # type: ignore[assignment]
            else:
                field = getattr(rec, k)
                del field[:]
                field.extend(v)  # type: ignore[arg-type]
        return rec

    cases = [
        (raw(output_logprobs=[-0.1, -0.2]), errors.InvalidArgument, "equally long"),
        (raw(role=common_pb2.ROLE_UNSPECIFIED), errors.InvalidArgument, "role 0 is not"),
        (raw(prompt_ids=[1, -4]), errors.InvalidArgument, "negative token id"),
        (raw(prompt_ids=[]), errors.InvalidArgument, "prompt is empty"),
    ]
    for rec, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            svc.client.ingest([rec])
    delta = raw(prompt_ids=[])
    delta.delta.base_call_id = "missing"
    delta.delta.shared_prefix_len = 1
    with pytest.raises(errors.FailedPrecondition, match="has not recorded"):
        svc.client.ingest([delta])
    with pytest.raises(errors.NotFound):
        svc.client.execution_stats("nope", job_id=JOB)


def _drain(client: TrajectoryClient, step: int, consumer: str, out: list, *, limit: int | None = None) -> None:
    for item in client.stream_batches(JOB, step, consumer):
        out.append(item)
        client.ack(JOB, step, item.batch_id, consumer)
        if limit is not None and len(out) >= limit:
            return


def test_groups_stream_before_the_step_ends_and_weights_average_over_executions(start) -> None:
    svc = start()
    runs = {f"e{i}": execution(f"e{i}", 10 + i) for i in range(4)}
    for calls in runs.values():
        svc.client.ingest(calls, delta_encode=True)
    plan = svc.client.open_step(JOB, 0, num_executions=4, group_size=2, token_budget=64)
    assert plan.num_executions == 4 and plan.num_micro_batches == 0

    rewards = {"e0": 1.0, "e1": 0.0, "e2": 0.25, "e3": 0.75}
    svc.client.complete_execution(outcome("e0", "gA", rewards["e0"]))
    _, plan = svc.client.complete_execution(outcome("e1", "gA", rewards["e1"]))
    assert plan.num_micro_batches >= 1 and not plan.sealed  # group A is out while group B still rolls out
    got: list = []
    t = threading.Thread(target=_drain, args=(svc.client, 0, "r0", got))
    t.start()
    svc.client.complete_execution(outcome("e2", "gB", rewards["e2"]))
    dup, plan = svc.client.complete_execution(outcome("e3", "gB", rewards["e3"]))
    assert not dup and plan.sealed
    t.join(timeout=20)
    assert not t.is_alive(), "the stream must end once the sealed step is fully acknowledged"
    plan = svc.client.step_plan(JOB, 0)
    assert plan.done and plan.num_acked == plan.num_micro_batches == len(got)
    assert plan.acked_tokens == plan.num_tokens == sum(len(item.batch.input_ids) for item in got) > 0

    advantage = {"e0": 0.5, "e1": -0.5, "e2": -0.25, "e3": 0.25}
    total_w = 0.0
    targets: dict[str, int] = {}
    for item in got:
        b: PackedBatch = item.batch
        b.validate()
        assert len(b) <= 64 and item.step_num_executions == 4
        for k, eid in enumerate(b.execution_ids):
            mine = (b.execution_index == k) & b.trainable
            assert np.allclose(b.advantages[mine], advantage[eid])
            targets[eid] = targets.get(eid, 0) + int(mine.sum())
        total_w += float(b.loss_weights.sum())
    assert total_w == pytest.approx(1.0, rel=1e-5)
    for eid, calls in runs.items():
        assert targets[eid] == NaiveTree(calls).stats(None)["trainable_tokens"]
    # records of a packed execution are refused; outcomes of a sealed step too
    with pytest.raises(errors.FailedPrecondition, match="already packed"):
        svc.client.ingest([TitoCall(**{**runs["e0"][0].__dict__, "call_id": "late"})])
    assert svc.client.ingest(runs["e0"][:2]).duplicates == 2  # resends of records that made it in time
    with pytest.raises(errors.FailedPrecondition, match="closed"):
        svc.client.complete_execution(outcome("e9", "gC", 1.0))
    assert svc.client.complete_execution(outcome("e0", "gA", 1.0))[0]  # identical resend
    with pytest.raises(errors.AlreadyExists, match="different outcome"):
        svc.client.complete_execution(outcome("e0", "gA", 0.0))


def test_work_queue_hands_each_batch_once_and_rehands_a_lost_consumers_batch(start) -> None:
    svc = start(max_in_flight=1)
    for i in range(6):
        svc.client.ingest(execution(f"w{i}", 100 + i, 10))
        svc.client.complete_execution(outcome(f"w{i}", f"g{i % 2}", float(i), step=3,
                                              excluded=(i == 5)))
    plan = svc.client.close_step(JOB, 3)  # no OpenStep: released at close, weights over 5 trained executions
    assert plan.sealed and plan.num_executions == 5 and plan.num_micro_batches >= 3

    # consumer "lost" takes one batch and disappears without acknowledging it
    lost = svc.client.stream_batches(JOB, 3, "lost")
    first = next(iter(lost))
    with pytest.raises(errors.FailedPrecondition, match="not leased to consumer 'other'"):
        svc.client.ack(JOB, 3, first.batch_id, "other")
    lost.cancel()

    a: list = []
    b: list = []
    ta = threading.Thread(target=_drain, args=(svc.client, 3, "A", a))
    tb = threading.Thread(target=_drain, args=(svc.client, 3, "B", b))
    ta.start()
    tb.start()
    ta.join(timeout=30)
    tb.join(timeout=30)
    assert not ta.is_alive() and not tb.is_alive()
    ids = [x.batch_id for x in a + b]
    assert len(ids) == len(set(ids)) == plan.num_micro_batches  # each batch exactly once ...
    assert first.batch_id in ids  # ... including the one the lost consumer never acknowledged
    assert {e for x in a + b for e in x.batch.execution_ids} == {f"w{i}" for i in range(5)}  # w5 excluded
    with pytest.raises(errors.FailedPrecondition, match="acknowledged by consumer"):
        svc.client.ack(JOB, 3, first.batch_id, "lost")  # too late: someone else trained on it

    # consumer A dies with its gradients: the trainer reopens what A acknowledged; C trains it again
    reopened, plan = svc.client.settle_step(JOB, 3, reopen=["A"])
    assert reopened == len(a) and not plan.done
    c: list = []
    _drain(svc.client, 3, "C", c)
    assert sorted(x.batch_id for x in c) == sorted(x.batch_id for x in a)
    assert svc.client.settle_step(JOB, 3)[0] == 0  # final: the payloads are collected
    with pytest.raises(errors.FailedPrecondition, match="cannot be reopened"):
        svc.client.settle_step(JOB, 3, reopen=["B"])
    with pytest.raises(errors.NotFound, match="never opened"):
        svc.client.settle_step(JOB, 99)
    with pytest.raises(errors.InvalidArgument, match="step -1"):
        svc.client.settle_step(JOB, -1)
    with pytest.raises(errors.InvalidArgument, match="reopen_consumer_ids"):
        svc.client.settle_step(JOB, 3, reopen=[""])


def test_restart_keeps_batches_acks_and_unreleased_groups(start) -> None:
    svc = start(collect_done_steps=False)
    for i in range(4):
        svc.client.ingest(execution(f"r{i}", 200 + i, 10))
    svc.client.open_step(JOB, 1, num_executions=4, group_size=2)
    svc.client.complete_execution(outcome("r0", "g0", 1.0, step=1))
    svc.client.complete_execution(outcome("r1", "g0", 0.0, step=1))
    svc.client.complete_execution(outcome("r2", "g1", 1.0, step=1))  # group g1 incomplete at the crash
    before = svc.client.step_plan(JOB, 1)
    got: list = []
    _drain(svc.client, 1, "c", got, limit=1)
    svc.stop()

    svc2 = start(collect_done_steps=False)
    plan = svc2.client.step_plan(JOB, 1)
    assert plan.num_micro_batches == before.num_micro_batches and plan.num_acked == 1 and not plan.sealed
    assert plan.acked_tokens == len(got[0].batch.input_ids) > 0  # the acknowledged batch's tokens survive the restart
    svc2.client.complete_execution(outcome("r3", "g1", 0.0, step=1))
    rest: list = []
    _drain(svc2.client, 1, "c", rest)
    assert got[0].batch_id not in {x.batch_id for x in rest}
    total = sum(float(x.batch.loss_weights.sum()) for x in got + rest)
    assert total == pytest.approx(1.0, rel=1e-5)
    assert svc2.client.step_plan(JOB, 1).done


def test_full_prompt_delta_encoder_matches_the_service(start) -> None:
    svc = start()
    calls = execution("d", 7, 10)
    enc = DeltaEncoder()
    encoded = [enc.encode_call(c) for c in calls]
    s = svc.client.ingest(encoded)
    assert s.record_tokens == sum(c.stored_tokens for c in encoded) < sum(c.stored_tokens for c in calls)


def test_step_declarations_are_validated(start) -> None:
    svc = start()
    with pytest.raises(errors.InvalidArgument, match="multiple of group_size"):
        svc.client.open_step(JOB, 5, num_executions=5, group_size=2)
    svc.client.open_step(JOB, 5, num_executions=4, group_size=2)
    assert svc.client.open_step(JOB, 5, num_executions=4).group_size == 2  # idempotent, fields merge
    with pytest.raises(errors.FailedPrecondition, match="cannot change num_executions"):
        svc.client.open_step(JOB, 5, num_executions=8)
    with pytest.raises(errors.InvalidArgument, match="consumer_id is required"):
        list(svc.client.stream_batches(JOB, 5, ""))
    svc.client.ingest(execution("s0", 1))
    svc.client.complete_execution(outcome("s0", "g", 1.0, step=6))
    svc.client.complete_execution(outcome("s1", "g", 0.0, step=6))  # no records at all: nothing to train
    with pytest.raises(errors.FailedPrecondition, match="already has 2 outcomes"):
        svc.client.open_step(JOB, 6, num_executions=1)
    plan = svc.client.close_step(JOB, 6)
    assert plan.sealed and plan.num_executions == 1 and plan.done is False


def test_restart_with_a_lost_spool_still_starts_and_serves(start, tmp_path: Path) -> None:
    svc = start(collect_done_steps=False)
    for i in range(2):
        svc.client.ingest(execution(f"l{i}", 300 + i, 6))
    svc.client.open_step(JOB, 2, num_executions=2, group_size=2)
    svc.client.complete_execution(outcome("l0", "g0", 1.0, step=2))
    svc.client.complete_execution(outcome("l1", "g0", 0.0, step=2))  # the group is released: trees built
    svc.stop()

    # Restarted against the same Redis but an empty spool (another host's disk, a wiped volume):
    # the step's payloads cannot be loaded, yet the service starts and serves other work.
    svc2 = start(collect_done_steps=False, spool_dir=str(tmp_path / "other-spool"))
    svc2.client.ingest(execution("n0", 400, 4))
    svc2.client.open_step(JOB, 3, num_executions=2, group_size=2)
    svc2.client.complete_execution(outcome("n0", "g0", 1.0, step=3))
    svc2.client.complete_execution(outcome("n1", "g0", 0.0, step=3))
    assert svc2.client.close_step(JOB, 3).num_executions == 2


def test_a_later_lease_attempt_supersedes_the_earlier_attempts_records(start) -> None:
    """An execution leased again after a crash runs from the start with the same call ids: its
    records replace the earlier attempt's (not refused as conflicting, not mixed into one tree), and
    a late record of the superseded attempt is refused. Through the client's delta encoder, as the
    gateway sends them: no delta of attempt 2 may point at an attempt-1 call."""
    svc = start()
    first = [TitoCall(**{**c.__dict__, "attempt": 1}) for c in execution("e-att", 3, 6)]
    assert svc.client.ingest(first[:4], delta_encode=True).accepted == 4
    second = [TitoCall(**{**c.__dict__, "attempt": 2}) for c in execution("e-att", 4, 3)]  # other content
    assert svc.client.ingest(second, delta_encode=True).accepted == 3
    tree = ExecutionTree("e-att")
    for c in second:
        tree.add(c)
    stats = svc.client.execution_stats("e-att", job_id=JOB)
    assert stats.num_calls == 3 and stats.tree_tokens == tree.stats().tree_tokens
    with pytest.raises(errors.FailedPrecondition, match="attempt 2 superseded"):
        svc.client.ingest(first[4:5])
    svc.stop()  # the attempt is durable: a restarted service still refuses attempt 1
    svc2 = start()
    with pytest.raises(errors.FailedPrecondition, match="superseded"):
        svc2.client.ingest(first[5:6])
    assert svc2.client.execution_stats("e-att", job_id=JOB).num_calls == 3


def test_grammar_forced_tokens_stay_context_across_a_restart(start) -> None:
    """A grammar-constrained record (forced flags, unmasked-policy logprobs) over the wire and into
    the store: its forced tokens are not trainable, also in the tree a restarted service rebuilds
    from Redis + spool."""
    svc = start()
    forced = np.array([False, True, True, False, True])
    call = TitoCall("g1", "c1", "a0", AgentRole.MAIN, np.arange(20, 25), np.array([-0.5, 0.0, 0.0, -0.2, 0.0]), 0,
                    prompt_ids=np.arange(1, 9), job_id=JOB, output_forced=forced,
                    output_policy_logprobs=np.array([-1.5, -2.0, -0.1, -0.9, -3.0]))
    assert svc.client.ingest([call]).accepted == 1
    assert svc.client.execution_stats("g1", job_id=JOB).trainable_tokens == 2
    svc.stop()
    svc2 = start()
    assert svc2.client.execution_stats("g1", job_id=JOB).trainable_tokens == 2
    assert svc2.client.ingest([call]).duplicates == 1  # the same record again: a duplicate, not a conflict


def test_the_jobs_advantage_normalisation_reaches_the_batches(start) -> None:
    """[job.algorithm] normalize_advantages travels with OpenStep: a group's advantages are divided
    by its reward std (rewards 1 and 0: +-1 instead of +-0.5); a bad eps is one sentence."""
    svc = start()
    for i in range(2):
        svc.client.ingest(execution(f"n{i}", 40 + i), delta_encode=True)
    svc.client.open_step(JOB, 0, num_executions=2, group_size=2, normalize_advantages=True)
    svc.client.complete_execution(outcome("n0", "gN", 1.0))
    svc.client.complete_execution(outcome("n1", "gN", 0.0))
    got: list = []
    _drain(svc.client, 0, "r0", got)
    for item in got:
        b = item.batch
        for k, eid in enumerate(b.execution_ids):
            mine = (b.execution_index == k) & b.trainable
            assert np.allclose(b.advantages[mine], 1.0 if eid == "n0" else -1.0, atol=1e-5)
    with pytest.raises(errors.InvalidArgument, match="advantage_eps"):
        svc.client.open_step(JOB, 1, advantage_eps=-1.0)


def test_the_scheduler_reads_how_much_of_an_update_is_trained(start) -> None:
    """The job controller's step progress (what elastic's work-left estimate takes off) is the
    trajectory service's count over gRPC: packed and acknowledged tokens, sealed or not; a service
    that cannot answer gives None, not an error."""
    from services.scheduler.controller import JobController

    svc = start()
    controller = JobController(None, trainer=None, trajectory=svc.client,  # type: ignore[arg-type]
                               reward=None, trajectory_address="", scheduler_address="", checkpoint_root="")
    for i in range(2):
        svc.client.ingest(execution(f"p{i}", 300 + i))
    svc.client.open_step(JOB, 0, num_executions=2, group_size=2, token_budget=64)
    progress = controller.step_progress(JOB, 0)
    assert progress is not None and (progress.packed_tokens, progress.trained_tokens, progress.sealed) == (0, 0, False)
    svc.client.complete_execution(outcome("p0", "g", 1.0))
    svc.client.complete_execution(outcome("p1", "g", 0.0))
    got: list = []
    _drain(svc.client, 0, "c", got, limit=1)
    progress = controller.step_progress(JOB, 0)
    plan = svc.client.step_plan(JOB, 0)
    assert progress is not None and progress.sealed and progress.packed_tokens == plan.num_tokens > 0
    assert progress.trained_tokens == len(got[0].batch.input_ids) == plan.acked_tokens
    svc.server.stop(0)  # the service gone: no count, and no error for the scheduler's tick
    assert controller.step_progress(JOB, 0) is None


def test_a_call_retried_after_a_lost_answer_is_recorded_and_survives_a_restart(start) -> None:
    """A gateway that died after recording a call and before answering: the caller re-sends the call
    (same call id) and the restarted gateway records another answer. Both are kept; resends of either
    are duplicates, before and after a restart of the trajectory service."""
    svc = start()
    first = TitoCall("e", "c1", "a", AgentRole.MAIN, np.array([5, 6]), np.array([-0.1, -0.2]), 0,
                     prompt_ids=np.array([1, 2]), job_id=JOB)
    retry = TitoCall(**{**first.__dict__, "output_ids": np.array([5, 7]), "weight_version": 1})
    assert svc.client.ingest([first]).accepted == 1
    s = svc.client.ingest([retry])
    assert (s.accepted, s.duplicates, s.new_tokens) == (1, 0, 1)
    nxt = TitoCall("e", "c2", "a", AgentRole.MAIN, np.array([3]), np.array([-0.3]), 1,
                   prompt_ids=np.array([1, 2, 5, 7, 9]), job_id=JOB)
    svc.client.ingest([nxt])
    stats = svc.client.execution_stats("e", job_id=JOB)
    assert (stats.num_calls, stats.paths, stats.trainable_tokens) == (3, 2, 4)
    svc.stop()
    svc2 = start()
    again = svc2.client.ingest([first, retry, nxt])
    assert (again.accepted, again.duplicates) == (0, 3)
    rebuilt = svc2.client.execution_stats("e", job_id=JOB)
    assert (rebuilt.num_calls, rebuilt.paths, rebuilt.tree_tokens, rebuilt.trainable_tokens) == (
        3, 2, stats.tree_tokens, 4)
