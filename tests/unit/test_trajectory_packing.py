"""Packing: subtree splitting under a budget, micro-batch invariants, loss weights, advantages."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.errors import InvalidArgument
from services.trajectory import wire
from services.algorithm import group_advantages, outcome_advantages
from services.trajectory.packing import PackedBatch, assemble, pack_chunks, split_tree
from services.trajectory.records import Outcome, Status, TitoCall
from services.common.roles import AgentRole
from services.trajectory.tree import ExecutionTree, TreeArrays
from tests.unit.trajectory_reference import NaiveTree, random_execution


def tree_of(calls: list[TitoCall]) -> ExecutionTree:
    tree = ExecutionTree(calls[0].execution_id)
    for c in calls:
        tree.add(c)
    return tree


def batch_paths(batch: PackedBatch) -> list[tuple[int, ...]]:
    return NaiveTree.layout_paths(batch.parent, batch.input_ids)


def pack_executions(trees: dict[str, TreeArrays], budget: int, *, step: int = 0,
                    num_executions: int | None = None, split: str = "context") -> tuple[list[PackedBatch], int]:
    chunks = [c for eid, t in trees.items() for c in split_tree(eid, t, budget, split=split)]
    d = num_executions or len(trees)
    weights = {eid: 1.0 / (t.num_trainable * d) for eid, t in trees.items()}
    adv = {eid: float(i) - 1.0 for i, eid in enumerate(trees)}
    batches = [assemble(b, step=step, advantages=adv, token_weights=weights, token_budget=budget)
               for b in pack_chunks(chunks, budget)]
    overhead = sum(len(c.context) for c in chunks)
    return batches, overhead


@settings(max_examples=120, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 12), st.integers(2, 6), st.integers(3, 40))
def test_split_and_pack_keep_every_target_once_with_its_context(seed: int, n_calls: int, vocab: int,
                                                                budget: int) -> None:
    rng = np.random.default_rng(seed)
    trees = {}
    naive = {}
    for e in range(3):
        calls = random_execution(rng, n_calls, vocab, execution_id=f"e{e}")
        trees[f"e{e}"] = tree_of(calls).arrays()
        naive[f"e{e}"] = NaiveTree(calls)
    trees = {k: v for k, v in trees.items() if v.num_trainable}
    if not trees:
        return
    batches, _ = pack_executions(trees, budget)
    seen: dict[tuple[str, tuple[int, ...]], int] = {}
    total_w = 0.0
    for b in batches:
        b.validate()
        assert max(pieces(b)) <= budget  # no forward longer than the budget, at any depth
        for i, p in enumerate(batch_paths(b)):
            eid = b.execution_ids[b.execution_index[i]]
            node = naive[eid].nodes[p]  # every token sits on its true root path
            if b.trainable[i]:
                key = (eid, p)
                seen[key] = seen.get(key, 0) + 1
                assert node.gen is not None
                assert b.old_logprobs[i] == pytest.approx(node.logprob)
                assert b.weight_version[i] == node.version
        total_w += float(b.loss_weights.sum())
    expected = {(eid, p) for eid in trees for p in naive[eid].union(None) if naive[eid].nodes[p].gen is not None}
    assert set(seen) == expected and set(seen.values()) == {1}
    assert total_w == pytest.approx(1.0, rel=1e-5)


def test_small_trees_share_a_batch_and_big_ones_split_with_context() -> None:
    sys_prompt = list(range(1, 9))
    small = tree_of([TitoCall("s", "c", "a", AgentRole.MAIN, np.array([50]), np.array([-1.0]), 0,
                              prompt_ids=np.array([1]))]).arrays()
    big_calls = [TitoCall("b", f"c{i}", "a", AgentRole.MAIN, np.array([60 + i] * 6), -np.ones(6), 0,
                          prompt_ids=np.array(sys_prompt + [100 + i])) for i in range(4)]
    big = tree_of(big_calls).arrays()
    assert len(big) == 8 + 4 * 7
    chunks = split_tree("b", big, 17)
    assert [c.size for c in chunks] == [15, 15, 15, 15]
    # branches start after the shared system prompt: chunks cut at branch starts carry it as context
    assert sum(len(c.context) for c in chunks) == 8 * (len(chunks) - 1)
    batches, overhead = pack_executions({"s": small, "b": big}, 17)
    assert overhead == 8 * (len(chunks) - 1)
    assert sum(len(b) for b in batches) == len(small) + len(big) + overhead
    assert any(len(b.execution_ids) == 2 for b in batches)  # the small tree fills a gap


def pieces(b: PackedBatch) -> list[int]:
    """Lengths of the forwards the trainer runs for ``b`` (its piece plan; the whole batch without one)."""
    return np.diff(np.append(b.piece_starts, len(b))).tolist() if len(b.piece_starts) else [len(b)]


def test_a_path_deeper_than_the_budget_becomes_pieces_within_the_budget() -> None:
    calls = [TitoCall("d", "c", "a", AgentRole.MAIN, np.arange(30, 60), -np.ones(30), 0, prompt_ids=np.arange(1, 21))]
    tree = tree_of(calls).arrays()
    chunks = split_tree("d", tree, 16)
    assert [c.size for c in chunks] == [50]  # the deepest token needs all 49 before it
    batches, _ = pack_executions({"d": tree}, 16)
    assert len(batches) == 1 and len(batches[0]) == 50
    batches[0].validate()
    assert batches[0].piece_starts.tolist() == [0, 16, 32, 48] and pieces(batches[0]) == [16, 16, 16, 2]
    again = PackedBatch.from_bytes(batches[0].to_bytes())
    assert again.piece_starts.tolist() == [0, 16, 32, 48]
    bad = PackedBatch(**{**batches[0].__dict__, "piece_starts": np.array([0, 32, 16], np.int64)})
    with pytest.raises(AssertionError, match="piece_starts"):
        bad.validate()
    # the plan travels to the trainer in the PackedBatch message
    msg = wire.to_proto(batches[0], batch_id="b")
    assert wire.from_proto(msg).piece_starts.tolist() == [0, 16, 32, 48]
    msg.piece_starts = msg.piece_starts[:-3]
    with pytest.raises(InvalidArgument, match="piece_starts"):
        wire.from_proto(msg)


def test_loss_weights_give_the_mean_over_executions_of_token_means() -> None:
    rng = np.random.default_rng(0)
    trees = {f"e{i}": tree_of(random_execution(rng, 10, 8, execution_id=f"e{i}")).arrays() for i in range(4)}
    trees = {k: v for k, v in trees.items() if v.num_trainable}
    batches, _ = pack_executions(trees, 12)
    token_loss = {eid: rng.random(len(t)) for eid, t in trees.items()}  # any per-node loss
    want = np.mean([token_loss[e][t.trainable].mean() for e, t in trees.items()])
    got = 0.0
    for b in batches:
        for i in np.flatnonzero(b.trainable):
            eid = b.execution_ids[b.execution_index[i]]
            # locate node i of the batch in its execution's layout by root path
            paths = {p: j for j, p in enumerate(NaiveTree.layout_paths(trees[eid].parent, trees[eid].tokens))}
            j = paths[batch_paths(b)[i]]
            got += b.loss_weights[i] * token_loss[eid][j]
    assert got == pytest.approx(want, rel=1e-5)


def test_packed_batch_roundtrips_through_bytes_and_validate_catches_corruption() -> None:
    rng = np.random.default_rng(1)
    tree = tree_of(random_execution(rng, 8, 4)).arrays()
    (batch,), _ = pack_executions({"E": tree}, 10_000, step=7)
    again = PackedBatch.from_bytes(batch.to_bytes())
    again.validate()
    assert again.step == 7 and again.execution_ids == ("E",)
    assert all(np.array_equal(getattr(batch, f), getattr(again, f)) for f in ("input_ids", "subtree_end", "parent"))
    bad = PackedBatch(**{**batch.__dict__, "subtree_end": batch.subtree_end[::-1].copy()})
    with pytest.raises(AssertionError):
        bad.validate()
    mask = batch.dense_mask()
    assert mask.sum() == int((batch.position_ids + 1).sum())  # each token sees itself and its ancestors


def test_group_advantages_and_outcome_filtering() -> None:
    assert group_advantages({"a": 1.0, "b": 0.0}) == {"a": 0.5, "b": -0.5}
    norm = group_advantages({"a": 1.0, "b": 0.0}, normalize_std=True)
    assert norm["a"] == pytest.approx(1.0, rel=1e-5) and norm["b"] == pytest.approx(-1.0, rel=1e-5)
    assert group_advantages({"a": 3.0}) == {"a": 0.0}
    outcomes = [
        Outcome("a", "g", Status.FINISHED, 1.0),
        Outcome("b", "g", Status.TIMEOUT, 0.4),  # partial reward of a timed-out execution counts
        Outcome("c", "g", Status.TIMEOUT, 0.0, excluded=True),  # excluded: dropped
        Outcome("d", "g", Status.FAILED, None),  # no reward: dropped
        Outcome("x", "h", Status.FINISHED, 2.0),
    ]
    adv = outcome_advantages(outcomes)
    assert set(adv) == {"a", "b", "x"}
    assert adv["a"] == pytest.approx(0.3) and adv["b"] == pytest.approx(-0.3) and adv["x"] == 0.0


def test_in_pieces_a_tree_larger_than_the_budget_is_one_batch_of_dfs_pieces_without_copies() -> None:
    """``split="pieces"``: every tree token once (no context copies), the tree's batch planned in DFS
    pieces of at most the budget; small trees still share batches; every target once, with its path."""
    sys_prompt = list(range(1, 9))
    big_calls = [TitoCall("b", f"c{i}", "a", AgentRole.MAIN, np.array([60 + i] * 6), -np.ones(6), 0,
                          prompt_ids=np.array(sys_prompt + [100 + i])) for i in range(4)]
    big = tree_of(big_calls).arrays()
    small = {f"s{i}": tree_of([TitoCall(f"s{i}", "c", "a", AgentRole.MAIN, np.array([50, 51]), -np.ones(2), 0,
                                        prompt_ids=np.array([1, 2]))]).arrays() for i in range(3)}
    (chunk,) = split_tree("b", big, 17, split="pieces")
    assert (chunk.start, chunk.stop, chunk.size, len(chunk.context)) == (0, len(big), len(big), 0)
    batches, overhead = pack_executions({"b": big, **small}, 17, split="pieces")
    assert overhead == 0 and sum(len(b) for b in batches) == len(big) + sum(len(t) for t in small.values())
    (whole,) = [b for b in batches if "b" in b.execution_ids]
    whole.validate()
    assert whole.execution_ids == ("b",) and len(whole) == len(big)
    assert whole.piece_starts.tolist() == [0, 17, 34] and pieces(whole) == [17, 17, 2]
    assert all(len(b.piece_starts) == 0 and len(b) <= 17 for b in batches if b is not whole)
    # the batch is the tree itself: every token's path is the tree's
    ref = NaiveTree.layout_paths(big.parent, big.tokens)
    assert batch_paths(whole) == ref and whole.trainable.sum() == big.num_trainable
    with pytest.raises(ValueError, match="split is 'copies'"):
        split_tree("b", big, 17, split="copies")


def test_a_kv_budget_cuts_trees_larger_than_it_into_chunks_trained_in_pieces() -> None:
    """``kv_budget``: a tree up to it trains whole (its keys/values kept); a larger one is cut into
    chunks of at most the kv budget, their root paths recomputed as context, each chunk in pieces."""
    rng = np.random.default_rng(7)
    calls = random_execution(rng, 40, 30, execution_id="k", max_new=12)
    tree = tree_of(calls).arrays()
    n = len(tree)
    assert n > 120
    (whole,) = split_tree("k", tree, 16, split="pieces", kv_budget=n)
    assert whole.size == n
    chunks = split_tree("k", tree, 16, split="pieces", kv_budget=64)
    assert len(chunks) > 1 and all(c.size <= 64 for c in chunks if len(c.context) < 64)
    assert sum(c.num_trainable for c in chunks) == tree.num_trainable  # every target once
    batches, overhead = pack_executions({"k": tree}, 16, split="pieces")
    capped = [assemble(b, step=0, advantages={"k": 0.0}, token_weights={"k": 1.0}, token_budget=16)
              for b in pack_chunks(chunks, 16)]
    processed = sum(len(b) for b in capped)
    copies = sum(len(c.context) for c in chunks)
    assert overhead == 0 and copies > 0 and processed == n + copies  # the root paths, recomputed
    for b in capped:
        b.validate()
        assert all(size <= 16 for size in pieces(b))
    with pytest.raises(ValueError, match="kv_budget is 8; expected 0 .no limit. or at least the token budget"):
        split_tree("k", tree, 16, split="pieces", kv_budget=8)
