"""The trainer's view of a packed micro-batch, and its validation.

A micro-batch is a forest of (sub)trees of tokens in DFS order, concatenated into one sequence
(``services.trajectory.packing.PackedBatch``). The trainer only relies on the fields listed in
``PackedBatchLike``; ``validate_batch`` checks every structural invariant with vectorized numpy
(O(N), no per-token Python) before a batch can touch the model, so a malformed batch is rejected
with a precise message instead of silently training on garbage:

    i < subtree_end[i] <= N              the subtree of i is [i, subtree_end[i])
    parent[i] < i < subtree_end[parent[i]] and subtree_end[i] <= subtree_end[parent[i]]
    subtree_end[i] - i == 1 + sum of the children's sizes   (so the interval of i is exactly
                                          i and its descendants: a real DFS layout)
    position_ids[i] == position_ids[parent[i]] + 1, roots >= 0
    trainable tokens have a parent (their logits come from it), finite floats, weight_version >= 0
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from services.common.errors import FailedPrecondition, InvalidArgument


class PackedBatchLike(Protocol):
    """Fields of ``services.trajectory.packing.PackedBatch`` the trainer reads (read-only)."""

    @property
    def input_ids(self) -> np.ndarray: ...

    @property
    def position_ids(self) -> np.ndarray: ...

    @property
    def subtree_end(self) -> np.ndarray: ...

    @property
    def parent(self) -> np.ndarray: ...

    @property
    def trainable(self) -> np.ndarray: ...

    @property
    def old_logprobs(self) -> np.ndarray: ...

    @property
    def advantages(self) -> np.ndarray: ...

    @property
    def loss_weights(self) -> np.ndarray: ...

    @property
    def weight_version(self) -> np.ndarray: ...

    @property
    def execution_index(self) -> np.ndarray: ...

    @property
    def execution_ids(self) -> tuple[str, ...]: ...

    @property
    def step(self) -> int: ...

    @property
    def piece_starts(self) -> np.ndarray: ...


_INT_FIELDS = ("input_ids", "position_ids", "subtree_end", "parent", "weight_version", "execution_index")
_FLOAT_FIELDS = ("old_logprobs", "advantages", "loss_weights")


def validate_batch(batch: PackedBatchLike, *, vocab_size: int, step: int | None = None,
                   current_version: int | None = None) -> None:
    """Raise ``InvalidArgument`` (or ``FailedPrecondition`` for a wrong step) if ``batch`` is malformed."""
    if step is not None and int(batch.step) != step:
        raise FailedPrecondition(f"micro-batch belongs to step {batch.step}, but the trainer is in step {step}")
    n = int(np.asarray(batch.input_ids).shape[0]) if np.ndim(batch.input_ids) == 1 else -1
    if n <= 0:
        raise InvalidArgument(f"input_ids must be a non-empty 1-D array, got shape {np.shape(batch.input_ids)}")
    for name in (*_INT_FIELDS, *_FLOAT_FIELDS, "trainable"):
        arr = np.asarray(getattr(batch, name))
        if arr.shape != (n,):
            raise InvalidArgument(f"{name} has shape {arr.shape}; expected ({n},) like input_ids")
        if name in _INT_FIELDS and arr.dtype.kind not in "iu":
            raise InvalidArgument(f"{name} must be an integer array, got dtype {arr.dtype}")
        if name in _FLOAT_FIELDS and arr.dtype.kind != "f":
            raise InvalidArgument(f"{name} must be a float array, got dtype {arr.dtype}")
    if np.asarray(batch.trainable).dtype != np.bool_:
        raise InvalidArgument(f"trainable must be a bool array, got dtype {np.asarray(batch.trainable).dtype}")

    ids = np.asarray(batch.input_ids, dtype=np.int64)
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if bad.size:
        raise InvalidArgument(f"token id {int(ids[bad[0]])} at index {int(bad[0])} is outside the vocabulary "
                              f"[0, {vocab_size}) ({bad.size} such tokens)")
    _validate_tree(batch, n)
    _validate_targets(batch, n, current_version)
    _validate_pieces(np.asarray(batch.piece_starts), n)


def _validate_pieces(starts: np.ndarray, n: int) -> None:
    if starts.ndim != 1 or (starts.size and starts.dtype.kind not in "iu"):
        raise InvalidArgument(f"piece_starts must be a 1-D integer array, got shape {starts.shape} dtype {starts.dtype}")
    if starts.size and (starts[0] != 0 or (np.diff(starts) <= 0).any() or starts[-1] >= n):
        raise InvalidArgument(f"piece_starts must start at 0 and increase strictly below {n} tokens, "
                              f"got {starts[:8].tolist()}{'...' if starts.size > 8 else ''}")


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _validate_tree(batch: PackedBatchLike, n: int) -> None:
    idx = np.arange(n, dtype=np.int64)
    end = np.asarray(batch.subtree_end, dtype=np.int64)
    parent = np.asarray(batch.parent, dtype=np.int64)
    pos = np.asarray(batch.position_ids, dtype=np.int64)
    bad = (end <= idx) | (end > n)
    if bad.any():
        i = _first(bad)
        raise InvalidArgument(f"subtree_end[{i}] = {int(end[i])} is outside ({i}, {n}]")
    bad = (parent < -1) | (parent >= idx)
    if bad.any():
        i = _first(bad)
        raise InvalidArgument(f"parent[{i}] = {int(parent[i])} must be -1 or an earlier index (DFS order)")
    child = parent >= 0
    p = np.where(child, parent, 0)
    bad = child & ((idx >= end[p]) | (end > end[p]))
    if bad.any():
        i = _first(bad)
        raise InvalidArgument(f"token {i} (subtree [{i}, {int(end[i])})) is not inside the subtree of its parent "
                              f"{int(parent[i])} ([{int(parent[i])}, {int(end[parent[i]])}))")
    size = end - idx
    children_size = np.bincount(p[child], weights=size[child], minlength=n)
    bad = children_size.astype(np.int64) + 1 != size
    if bad.any():
        i = _first(bad)
        raise InvalidArgument(f"subtree of token {i} spans {int(size[i])} tokens but it has "
                              f"{int(children_size[i])} descendants: subtree_end/parent are not a DFS layout")
    bad = (child & (pos != pos[p] + 1)) | (~child & (pos < 0))
    if bad.any():
        i = _first(bad)
        raise InvalidArgument(f"position_ids[{i}] = {int(pos[i])} is not its depth (parent {int(parent[i])} "
                              f"has position {int(pos[p[i]]) if parent[i] >= 0 else 'none'})")


def _validate_targets(batch: PackedBatchLike, n: int, current_version: int | None) -> None:
    trainable = np.asarray(batch.trainable)
    parent = np.asarray(batch.parent)
    bad = trainable & (parent < 0)
    if bad.any():
        raise InvalidArgument(f"token {_first(bad)} is trainable but is a root: a target needs a parent's logits")
    for name in _FLOAT_FIELDS:
        arr = np.asarray(getattr(batch, name))
        bad = trainable & ~np.isfinite(arr)
        if bad.any():
            i = _first(bad)
            raise InvalidArgument(f"{name}[{i}] = {arr[i]} is not finite (trainable token)")
    old = np.asarray(batch.old_logprobs)
    bad = trainable & (old > 1e-4)
    if bad.any():
        i = _first(bad)
        raise InvalidArgument(f"old_logprobs[{i}] = {old[i]} is a positive log-probability")
    w = np.asarray(batch.loss_weights)
    bad = trainable & (w < 0)
    if bad.any():
        i = _first(bad)
        raise InvalidArgument(f"loss_weights[{i}] = {w[i]} is negative")
    ver = np.asarray(batch.weight_version)
    bad = trainable & (ver < 0)
    if bad.any():
        raise InvalidArgument(f"weight_version[{_first(bad)}] is negative on a trainable token")
    if current_version is not None:
        bad = trainable & (ver > current_version)
        if bad.any():
            i = _first(bad)
            raise InvalidArgument(f"token {i} was generated by weight version {int(ver[i])}, newer than the "
                                  f"trainer's version {current_version}")
    ex = np.asarray(batch.execution_index)
    n_ex = len(batch.execution_ids)
    bad = (ex < 0) | (ex >= n_ex)
    if bad.any():
        i = _first(bad)
        raise InvalidArgument(f"execution_index[{i}] = {int(ex[i])} is outside [0, {n_ex}) execution ids")


def staleness(batch: PackedBatchLike, current_version: int) -> np.ndarray:
    """Versions between the trained policy and the policy that generated each target token."""
    trainable = np.asarray(batch.trainable)
    return current_version - np.asarray(batch.weight_version, dtype=np.int64)[trainable]
