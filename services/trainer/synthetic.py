"""Synthetic branching executions, packed into the trajectory service's ``PackedBatch``.

For tests and benchmarks of the trainer alone (the real packer is ``services.trajectory.packing``):
an execution is a tree of *segments* (a segment = some context tokens appended by the harness,
untrainable, then tokens the model generated, trainable), e.g. a main trunk with retries or
sub-agent branches. ``make_step`` builds a step's executions, computes the loss weights the
trajectory contract promises (sum over the step = mean over executions of the mean over that
execution's trainable nodes), packs whole executions into micro-batches by token budget, and
also expands every root-to-leaf path (the per-path baseline) with weights split over the paths
that share a node, so per-path and tree training have the same gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from services.trajectory.packing import PackedBatch


@dataclass(frozen=True)
class PathSample:
    """One root-to-leaf path as a causal sequence; arrays are per token, ``trainable[0]`` is False."""

    input_ids: np.ndarray
    trainable: np.ndarray
    old_logprobs: np.ndarray
    advantages: np.ndarray
    loss_weights: np.ndarray  # the node's weight divided by the number of paths through the node
    execution: int = 0        # index of the execution in the step
    nodes: np.ndarray | None = None  # tree-local DFS index of each token (its node in the packed tree)


@dataclass
class _Tree:
    """An execution as flat DFS arrays (one tree)."""

    input_ids: np.ndarray
    parent: np.ndarray
    subtree_end: np.ndarray
    position_ids: np.ndarray
    trainable: np.ndarray
    old_logprobs: np.ndarray
    leaves: list[int] = field(default_factory=list)


def make_tree(rng: np.random.Generator, *, vocab: int, depth: int, branching: int, context_tokens: int,
              generated_tokens: int, root_tokens: int | None = None) -> _Tree:
    """A full ``branching``-ary tree of segments, ``depth`` levels below the root segment.

    The root segment is ``root_tokens`` of prompt + ``generated_tokens``; every other segment is
    ``context_tokens`` (untrainable) + ``generated_tokens`` (trainable).
    """
    ids: list[np.ndarray] = []
    par: list[np.ndarray] = []
    pos: list[np.ndarray] = []
    train: list[np.ndarray] = []
    seg_ranges: list[tuple[int, int, int]] = []  # (start, length, subtree end) of each segment
    leaves: list[int] = []
    cursor = 0

    def emit(level: int, parent_idx: int, parent_depth: int) -> None:
        nonlocal cursor
        ctx = root_tokens if (level == 0 and root_tokens is not None) else context_tokens
        n = ctx + generated_tokens
        start = cursor
        ids.append(rng.integers(0, vocab, size=n, dtype=np.int64))
        p = np.arange(start - 1, start + n - 1, dtype=np.int64)
        p[0] = parent_idx
        par.append(p)
        pos.append(parent_depth + 1 + np.arange(n, dtype=np.int64))
        t = np.zeros(n, dtype=bool)
        t[ctx:] = True
        if parent_idx < 0:
            t[0] = False
        train.append(t)
        cursor += n
        slot = len(seg_ranges)
        seg_ranges.append((start, n, -1))
        if level < depth:
            for _ in range(branching):
                emit(level + 1, start + n - 1, parent_depth + n)
        else:
            leaves.append(start + n - 1)
        seg_ranges[slot] = (start, n, cursor)

    emit(0, -1, -1)
    input_ids = np.concatenate(ids)
    subtree_end = np.empty(cursor, dtype=np.int64)
    for start, length, end in seg_ranges:
        # A segment is a chain: each of its tokens is an ancestor of the rest of the segment's subtree.
        subtree_end[start:start + length] = end
    return _Tree(input_ids=input_ids, parent=np.concatenate(par), subtree_end=subtree_end,
                 position_ids=np.concatenate(pos), trainable=np.concatenate(train),
                 # Near a random-init model's log-probs (-log vocab), like an on-policy rollout of it.
                 old_logprobs=(-np.log(vocab) + rng.normal(0.0, 0.05, size=cursor)).astype(np.float32),
                 leaves=leaves)


@dataclass(frozen=True)
class SyntheticStep:
    batches: list[PackedBatch]
    paths: list[PathSample]
    tree_tokens: int
    path_tokens: int


def make_step(seed: int, *, step: int = 0, num_executions: int = 4, vocab: int = 512, depth: int = 2,
              branching: int = 2, context_tokens: int = 8, generated_tokens: int = 8, root_tokens: int = 16,
              micro_batch_tokens: int = 256, weight_version: int = 0) -> SyntheticStep:
    """A step's worth of branching executions, packed into micro-batches of whole executions."""
    rng = np.random.default_rng(seed)
    trees = [make_tree(rng, vocab=vocab, depth=depth, branching=branching, context_tokens=context_tokens,
                       generated_tokens=generated_tokens, root_tokens=root_tokens) for _ in range(num_executions)]
    adv = rng.normal(size=num_executions).astype(np.float32)
    weights = []
    for tr in trees:
        w = np.zeros(len(tr.input_ids), dtype=np.float32)
        w[tr.trainable] = 1.0 / (num_executions * max(int(tr.trainable.sum()), 1))
        weights.append(w)
    ex_ids = tuple(f"s{step}-e{i}" for i in range(num_executions))

    batches: list[PackedBatch] = []
    group: list[int] = []

    def flush() -> None:
        if group:
            batches.append(_pack([trees[i] for i in group], [adv[i] for i in group], [weights[i] for i in group],
                                 [ex_ids[i] for i in group], step, weight_version))
            group.clear()

    size = 0
    for i, tr in enumerate(trees):
        if group and size + len(tr.input_ids) > micro_batch_tokens:
            flush()
            size = 0
        group.append(i)
        size += len(tr.input_ids)
    flush()

    paths = [p for i, tr in enumerate(trees) for p in _paths(tr, float(adv[i]), weights[i], i)]
    return SyntheticStep(batches=batches, paths=paths, tree_tokens=sum(len(t.input_ids) for t in trees),
                         path_tokens=sum(len(p.input_ids) for p in paths))


def _pack(trees: list[_Tree], advs: list[np.float32], weights: list[np.ndarray], ex_ids: list[str], step: int,
          weight_version: int) -> PackedBatch:
    offsets = np.cumsum([0] + [len(t.input_ids) for t in trees])
    parent = np.concatenate([np.where(t.parent >= 0, t.parent + o, -1) for t, o in zip(trees, offsets)])
    trainable = np.concatenate([t.trainable for t in trees])
    return PackedBatch(
        input_ids=np.concatenate([t.input_ids for t in trees]),
        position_ids=np.concatenate([t.position_ids for t in trees]),
        subtree_end=np.concatenate([t.subtree_end + o for t, o in zip(trees, offsets)]).astype(np.int32),
        parent=parent.astype(np.int32),
        trainable=trainable,
        old_logprobs=np.where(trainable, np.concatenate([t.old_logprobs for t in trees]), 0).astype(np.float32),
        advantages=np.where(trainable, np.concatenate([np.full(len(t.input_ids), a, np.float32)
                                                       for t, a in zip(trees, advs)]), 0).astype(np.float32),
        loss_weights=np.concatenate(weights),
        weight_version=np.where(trainable, weight_version, -1).astype(np.int64),
        execution_index=np.concatenate([np.full(len(t.input_ids), k, np.int32) for k, t in enumerate(trees)]),
        execution_ids=tuple(ex_ids),
        step=step,
    )


def _paths(tree: _Tree, adv: float, weights: np.ndarray, execution: int) -> list[PathSample]:
    """Root-to-leaf paths of one tree, node weights split over the paths through each node."""
    chains = []
    for leaf in tree.leaves:
        chain = [leaf]
        while tree.parent[chain[-1]] >= 0:
            chain.append(int(tree.parent[chain[-1]]))
        chains.append(np.array(chain[::-1], dtype=np.int64))
    through = np.bincount(np.concatenate(chains), minlength=len(tree.input_ids)).astype(np.float32)
    out = []
    for c in chains:
        out.append(PathSample(input_ids=tree.input_ids[c], trainable=tree.trainable[c],
                              old_logprobs=tree.old_logprobs[c], advantages=np.full(len(c), adv, np.float32),
                              loss_weights=weights[c] / through[c], execution=execution, nodes=c))
    return out


def pack_paths(paths: list[PathSample], *, step: int = 0, micro_batch_tokens: int = 256,
               weight_version: int = 0) -> list[PackedBatch]:
    """The per-path baseline packed with the same machinery: every path is its own chain-shaped tree.

    Same kernels, same mask construction, same budget as the tree batches - only the shared
    prefixes are duplicated - so timing tree vs these isolates the deduplication.
    """
    batches: list[PackedBatch] = []
    group: list[PathSample] = []

    def flush() -> None:
        if not group:
            return
        chains = []
        for p in group:
            n = len(p.input_ids)
            chains.append(_Tree(input_ids=p.input_ids, parent=np.arange(-1, n - 1, dtype=np.int64),
                                subtree_end=np.full(n, n, dtype=np.int64), position_ids=np.arange(n, dtype=np.int64),
                                trainable=p.trainable, old_logprobs=p.old_logprobs))
        batches.append(_pack(chains, [np.float32(p.advantages[0]) for p in group], [p.loss_weights for p in group],
                             [f"path{len(batches)}-{i}" for i in range(len(group))], step, weight_version))
        group.clear()

    size = 0
    for p in paths:
        if group and size + len(p.input_ids) > micro_batch_tokens:
            flush()
            size = 0
        group.append(p)
        size += len(p.input_ids)
    flush()
    return batches
