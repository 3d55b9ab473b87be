"""Malformed micro-batches are rejected with precise errors before they touch the model."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from services.common.errors import FailedPrecondition, InvalidArgument
from services.trainer.batch import validate_batch
from services.trainer.build import build_learner
from services.trainer.job import TrainerJob
from services.trainer.synthetic import make_step
from services.trainer.tree_forward import TreeTensors
from services.trajectory.packing import PackedBatch, plan_pieces

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def batch() -> PackedBatch:
    b = make_step(2, num_executions=2, micro_batch_tokens=10_000, step=3).batches[0]
    b.validate()  # the trajectory service's own invariants hold for the synthetic packer too
    return b


def _with(batch: PackedBatch, **arrays: np.ndarray) -> PackedBatch:
    return dataclasses.replace(batch, **arrays)


def test_valid_batch_passes(batch: PackedBatch) -> None:
    validate_batch(batch, vocab_size=512, step=3, current_version=0)


def _edit(batch: PackedBatch, name: str, index: int, value: object) -> PackedBatch:
    arr = getattr(batch, name).copy()
    arr[index] = value
    return _with(batch, **{name: arr})


def _first_target(batch: PackedBatch) -> int:
    return int(np.flatnonzero(batch.trainable)[0])


@pytest.mark.parametrize("case,match", [
    ("short_array", "shape"),
    ("out_of_vocab", "outside the vocabulary"),
    ("negative_id", "outside the vocabulary"),
    ("nan_logprob", "not finite"),
    ("inf_advantage", "not finite"),
    ("nan_weight", "not finite"),
    ("negative_weight", "negative"),
    ("positive_logprob", "positive log-probability"),
    ("bad_subtree_end", "subtree_end"),
    ("parent_after_child", "parent"),
    ("not_dfs", "DFS"),
    ("bad_position", "position_ids"),
    ("trainable_root", "root"),
    ("future_version", "newer than"),
    ("float_ids", "integer"),
    ("bad_execution_index", "execution_index"),
    ("pieces_not_from_0", "piece_starts"),
    ("pieces_out_of_order", "piece_starts"),
    ("piece_past_the_end", "piece_starts"),
])
def test_malformed_batches_rejected(batch: PackedBatch, case: str, match: str) -> None:
    t = _first_target(batch)
    n = len(batch.input_ids)
    end, par = batch.subtree_end, batch.parent
    # a token with a later sibling: growing its subtree by one swallows that sibling
    sib = int(np.flatnonzero((par >= 0) & (end < end[np.maximum(par, 0)]))[0])
    bad = {
        "short_array": lambda: _with(batch, advantages=batch.advantages[:-1]),
        "out_of_vocab": lambda: _edit(batch, "input_ids", 5, 512),
        "negative_id": lambda: _edit(batch, "input_ids", 0, -1),
        "nan_logprob": lambda: _edit(batch, "old_logprobs", t, np.nan),
        "inf_advantage": lambda: _edit(batch, "advantages", t, np.inf),
        "nan_weight": lambda: _edit(batch, "loss_weights", t, np.nan),
        "negative_weight": lambda: _edit(batch, "loss_weights", t, -0.1),
        "positive_logprob": lambda: _edit(batch, "old_logprobs", t, 0.5),
        "bad_subtree_end": lambda: _edit(batch, "subtree_end", 3, n + 1),
        "parent_after_child": lambda: _edit(batch, "parent", 3, 7),
        # A token claims a bigger subtree than its descendants: the layout is not a DFS.
        "not_dfs": lambda: _edit(batch, "subtree_end", sib, int(batch.subtree_end[sib]) + 1),
        "bad_position": lambda: _edit(batch, "position_ids", 4, 9),
        "trainable_root": lambda: _edit(batch, "trainable", 0, True),
        "future_version": lambda: _edit(batch, "weight_version", t, 5),
        "float_ids": lambda: _with(batch, input_ids=batch.input_ids.astype(np.float32)),
        "bad_execution_index": lambda: _edit(batch, "execution_index", 0, 7),
        "pieces_not_from_0": lambda: _with(batch, piece_starts=np.array([5, 20], np.int64)),
        "pieces_out_of_order": lambda: _with(batch, piece_starts=np.array([0, 20, 20], np.int64)),
        "piece_past_the_end": lambda: _with(batch, piece_starts=np.array([0, n], np.int64)),
    }[case]()
    with pytest.raises(InvalidArgument, match=match):
        validate_batch(bad, vocab_size=512, step=3, current_version=0)


def test_unknown_step_is_failed_precondition(batch: PackedBatch) -> None:
    with pytest.raises(FailedPrecondition, match="step 3.*step 4"):
        validate_batch(batch, vocab_size=512, step=4)


def test_learner_rejects_before_touching_gradients(batch: PackedBatch) -> None:
    learner = build_learner(TrainerJob(job_id="j", model="tiny", source="synthetic"), "cpu")
    learner.begin_step(3, 0)
    with pytest.raises(InvalidArgument):
        learner.train(_edit(batch, "old_logprobs", _first_target(batch), np.nan))
    assert all(float(p.grad.abs().sum()) == 0.0 for p in learner.params)  # type: ignore[union-attr]
    assert learner.stats.counts["micro_batches"] == 0
    assert learner.train(batch)
    assert learner.stats.counts["micro_batches"] == 1
    # A refused ack (re-handed batch) discards the result: no gradient, no statistics.
    before = [p.grad.clone() for p in learner.params]  # type: ignore[union-attr]
    assert not learner.train(batch, commit=lambda: False)
    assert all(torch.equal(a, p.grad) for a, p in zip(before, learner.params))
    assert learner.stats.counts["micro_batches"] == 1


def test_a_steps_compute_time_is_its_longest_share_whoever_trained(batch: PackedBatch) -> None:
    """Each participant times the micro-batches it trains; the step's statistics carry the longest
    share through a hand-off or the all-reduce (MAX), so a step whose every micro-batch a replica
    trained, the core none, still measures what its compute took (the scheduler's cost sample)."""
    replica = build_learner(TrainerJob(job_id="j", model="tiny", source="synthetic"), "cpu")
    replica.begin_step(3, 0)
    assert replica.train(batch)
    took = replica.stats.compute_s
    assert took > 0
    assert not replica.train(batch, commit=lambda: False)  # a refused ack's forward took time too
    assert replica.stats.compute_s > took
    core = build_learner(TrainerJob(job_id="j", model="tiny", source="synthetic"), "cpu")
    core.begin_step(3, 0)  # trains nothing itself
    core.stats.merge(replica.stats.vector(), replica.stats.extrema())
    shorter = type(core.stats)(compute_s=replica.stats.compute_s / 4)  # a third participant's share
    core.stats.merge(shorter.vector(), shorter.extrema())
    d = core.stats.as_dict()
    assert d["compute_s_max"] == replica.stats.compute_s and d["micro_batches"] == 1
    replica.begin_step(4, 1)
    assert replica.stats.compute_s == 0.0  # per step


def test_learner_trains_a_long_batch_in_chunks_to_the_same_sums(batch: PackedBatch) -> None:
    """A job's chunk_tokens below the batch's length, or the packer's piece plan (pieces that start
    inside attention blocks): the learner trains it in chunks and reaches the same gradient sums and
    step statistics as in one piece; a refused ack still leaves none."""
    results = []
    planned = _with(batch, piece_starts=plan_pieces(len(batch.input_ids), 100))
    assert len(planned.piece_starts) > 2
    for chunk, b in ((0, batch), (64, batch), (0, planned)):
        job = TrainerJob(job_id="j", model="tiny", source="synthetic", attention="blocks", chunk_tokens=chunk,
                         objective=dataclasses.replace(TrainerJob(job_id="j", source="synthetic").objective,
                                                       entropy_coef=0.01))
        learner = build_learner(job, "cpu")
        learner.policy.sparse_block_tokens, learner.policy.chunk_tokens = 32, chunk  # this batch is small
        learner.begin_step(3, 0)
        assert learner.policy.chunked(TreeTensors.from_batch(b)) == (chunk > 0 or b is planned)
        assert learner.train(b)
        results.append(({n: p.grad.clone() for n, p in learner.model.named_parameters()},
                        dict(learner.stats.sums), learner.stats.ratio_max, learner.stats.counts["tokens"]))
        before = [p.grad.clone() for p in learner.params]  # type: ignore[union-attr]
        assert not learner.train(b, commit=lambda: False)
        assert all(torch.equal(a, p.grad) for a, p in zip(before, learner.params))
    (g0, s0, r0, n0) = results[0]
    for g1, s1, r1, n1 in results[1:]:
        assert n0 == n1 == len(batch.input_ids) and r1 == pytest.approx(r0, rel=1e-5)
        for k in s0:
            assert s1[k] == pytest.approx(s0[k], rel=1e-4, abs=1e-7), k
        for name in g0:
            torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_kl_anchored_to_the_initial_weights_holds_on_policy(batch: PackedBatch) -> None:
    """kl_reference="initial": a frozen copy of the starting weights is the KL's reference, so the term
    is 0 until the policy moves and pulls it back after (the behaviour reference is ~0 on-policy)."""
    batch = _with(batch, advantages=np.zeros_like(batch.advantages))  # the KL term's gradient alone
    objective = dataclasses.replace(TrainerJob(job_id="j", source="synthetic").objective, kl_coef=0.5)
    job = TrainerJob(job_id="j", model="tiny", source="synthetic", objective=objective, kl_reference="initial")
    learner = build_learner(job, "cpu")
    assert learner.ref_policy is not None
    assert build_learner(dataclasses.replace(job, kl_reference="behaviour"), "cpu").ref_policy is None
    learner.begin_step(3, 0)
    assert learner.train(batch)
    assert learner.stats.sums["kl"] == pytest.approx(0.0, abs=1e-6)  # the policy is still the initial weights
    torch.manual_seed(0)
    with torch.no_grad():
        for p in learner.params:
            p.add_(0.05 * torch.randn_like(p))  # as an update would
    learner.begin_step(3, 0)
    assert learner.train(batch)
    assert learner.stats.sums["kl"] > 1e-3
    moved = dict(learner.model.named_parameters())
    frozen = dict(learner.ref_policy.model.named_parameters())
    assert not any(p.requires_grad for p in frozen.values())
    assert any(not torch.equal(moved[n], frozen[n]) for n in moved)
    # its gradient points back to the reference: a small step along -grad lowers the KL
    with torch.no_grad():
        for p in learner.params:
            p.sub_(1e-2 * p.grad / (p.grad.norm() + 1e-12))  # type: ignore[operator, union-attr]
    before = learner.stats.sums["kl"]
    learner.begin_step(3, 0)
    assert learner.train(batch)
    assert learner.stats.sums["kl"] < before


@pytest.mark.parametrize("chunked", [False, True])
def test_a_released_replica_gives_its_forward_up_at_the_next_layer(batch: PackedBatch, chunked: bool) -> None:
    """``abort_on``: once the event is set, the running forward stops at its next decoder layer
    (``MicroBatchAborted``), before its commit, leaving no gradient and no statistics; set during the
    commit (the batch is acknowledged) it cuts nothing: the backward, which runs checkpointed layers'
    forward again, completes to the same sums. ``train_delivery`` hands a given-up batch back."""
    import threading

    from services.common.logging import get_logger
    from services.trainer.delivery import Delivery
    from services.trainer.learner import MicroBatchAborted
    from services.trainer.sources import train_delivery

    job = TrainerJob(job_id="j", model="tiny", source="synthetic", attention="blocks", activation_checkpointing=True,
                     chunk_tokens=64 if chunked else 0)
    learner = build_learner(job, "cpu")
    learner.policy.sparse_block_tokens = 32
    learner.policy.chunk_tokens = 64 if chunked else 0
    assert learner.policy.chunked(TreeTensors.from_batch(batch)) == chunked
    reference = build_learner(job, "cpu")
    reference.model.load_state_dict(learner.model.state_dict())
    reference.policy.sparse_block_tokens, reference.policy.chunk_tokens = 32, learner.policy.chunk_tokens
    reference.begin_step(3, 0)
    assert reference.train(batch)

    release = threading.Event()
    learner.abort_on(release)
    layers = [m for m in learner.model.modules() if isinstance(m, torch.nn.ModuleList)][0]
    seen: list[int] = []
    for i, layer in enumerate(layers):
        layer.register_forward_hook(lambda mod, args, out, i=i: seen.append(i))
    # the release arrives while the first layer runs: the second never starts
    first = layers[0].register_forward_hook(lambda mod, args, out: release.set())
    learner.begin_step(3, 0)
    commits: list[bool] = []
    with pytest.raises(MicroBatchAborted):
        learner.train(batch, commit=lambda: commits.append(True) or True)
    assert seen == [0] and commits == []
    assert all(float(p.grad.abs().sum()) == 0.0 for p in learner.params)  # type: ignore[union-attr]
    assert learner.stats.counts["micro_batches"] == 0
    first.remove()

    # through train_delivery: the batch goes back to its queue, unacknowledged
    given_back: list[str] = []
    d = Delivery(batch=batch, ack=lambda: True, reject=lambda why: None, batch_id="3/0",
                 give_back=lambda: given_back.append("3/0"))
    assert not train_delivery(learner, d, step=3, journal=None, log=get_logger("test"))
    assert given_back == ["3/0"]

    # set during the commit: the acknowledged batch trains to its end, to the reference's sums
    release.clear()
    assert learner.train(batch, commit=lambda: release.set() or True)
    assert learner.stats.counts["micro_batches"] == 1
    for (name, p), q in zip(learner.model.named_parameters(), reference.model.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
    learner.abort_on(None)  # a learner without an event never aborts
    assert learner.train(batch)
