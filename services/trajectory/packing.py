"""Packing execution trees into micro-batches under a token budget (the trainer's input).

A ``PackedBatch`` is a forest of (sub)trees in DFS order, concatenated. Its mask is implicit and
linear in size: token j attends to token i iff ``i <= j < subtree_end[i]`` (i is j or one of j's
ancestors) -- usable directly as a flex_attention ``mask_mod``, as a block mask, or expanded to a
dense bool mask for small batches (``dense_mask``).

Splitting (``split_tree``), two ways for a tree larger than the budget (``TREE_SPLITS``):

- ``pieces`` (the default): the whole tree is one chunk, packed alone, and its micro-batch carries a
  piece plan (``piece_starts``: consecutive DFS ranges of at most ``token_budget`` tokens). The
  trainer runs one forward per piece, each attending to its ancestors' keys/values kept from earlier
  pieces (DFS: a token's ancestors all come before it), their gradients sent back
  (``TreePolicy.train_chunked``). Every tree token is computed once, at any depth; what grows with
  the tree is the kept keys/values, not the activations.
- ``context``: a tree larger than the budget is cut into contiguous DFS ranges
``[a, b)``. Every ancestor outside the range of a node in ``[a, b)`` is an ancestor of ``a``
(DFS property), so a chunk is its range plus the root path of ``a`` as non-trainable context:
``depth(a) + (b - a)`` tokens. Cuts prefer starts of branches (shallow context) and otherwise
cut inside a run; the context copies are the split overhead (``Chunk.context``). A path deeper
than the budget cannot be split this way (its deepest token needs the whole path as context):
such a chunk is packed alone, and its micro-batch carries a piece plan instead (``piece_starts``:
consecutive DFS ranges of at most ``token_budget`` tokens each). The trainer runs one forward per
piece, the keys/values of earlier pieces kept and their gradients sent back
(``TreePolicy.train_chunked``): the same gradient as one forward over the whole path, the
activations of one piece. So no forward the packer asks for is longer than the budget, at any depth.

Packing (``pack_chunks``): first-fit decreasing into bins of ``token_budget``.

Loss weights: every trainable node is owned by exactly one chunk and weighted
``1 / (trainable_nodes(execution) * num_executions_in_step)``, so summing ``w_i * loss_i`` over all
micro-batches of a step gives the mean over executions of the per-execution token mean.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from services.trajectory.tree import TreeArrays

_ARRAYS = ("input_ids", "position_ids", "subtree_end", "parent", "trainable", "old_logprobs", "advantages",
           "loss_weights", "weight_version", "execution_index")
DTYPES: dict[str, type] = {
    "input_ids": np.int64, "position_ids": np.int64, "subtree_end": np.int32, "parent": np.int32,
    "trainable": np.bool_, "old_logprobs": np.float32, "advantages": np.float32,
    "loss_weights": np.float32, "weight_version": np.int64, "execution_index": np.int32,
}


@dataclass(frozen=True)
class PackedBatch:            # one micro-batch: a forest of (sub)trees in DFS order, concatenated
    input_ids: np.ndarray      # int64[N]
    position_ids: np.ndarray   # int64[N]  depth from the root of its tree (root token = 0)
    subtree_end: np.ndarray    # int32[N]  DFS order; token j attends to token i iff i <= j < subtree_end[i]
    parent: np.ndarray         # int32[N]  index of the parent token in this batch, -1 for a root
    trainable: np.ndarray      # bool[N]   token i is a target: its logprob comes from logits at parent[i]
    old_logprobs: np.ndarray   # float32[N] rollout logprob of token i (0 where not trainable)
    advantages: np.ndarray     # float32[N] (0 where not trainable)
    loss_weights: np.ndarray   # float32[N] so that sum_i w_i * token_loss_i == mean over executions of
                               #   (mean over that execution's trainable nodes); 0 where not trainable
    weight_version: np.ndarray # int64[N] weight version that generated token i (-1 where not trainable)
    execution_index: np.ndarray# int32[N] index into execution_ids
    execution_ids: tuple[str, ...]
    step: int
    # int64[K]: starts of the pieces the trainer runs a forward over, in order (first 0, each piece at
    # most the step's token budget, later pieces attend to earlier ones' keys/values); empty: one piece
    piece_starts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def __len__(self) -> int:
        return len(self.input_ids)

    def validate(self) -> None:
        """Assert every invariant of the layout and the training fields."""
        n = len(self.input_ids)
        for name in _ARRAYS:
            arr = getattr(self, name)
            assert isinstance(arr, np.ndarray) and arr.ndim == 1 and len(arr) == n, f"{name}: shape"
            assert arr.dtype == DTYPES[name], f"{name}: dtype {arr.dtype}, expected {np.dtype(DTYPES[name])}"
        if n == 0:
            return
        idx = np.arange(n)
        par, se, pos = self.parent.astype(np.int64), self.subtree_end.astype(np.int64), self.position_ids
        assert (self.input_ids >= 0).all(), "negative token id"
        assert ((se > idx) & (se <= n)).all(), "subtree_end out of range"
        assert ((par >= -1) & (par < idx)).all(), "parent must precede its child"
        roots = par < 0
        assert (pos[roots] == 0).all(), "roots have position 0"
        kid = ~roots
        p = par[kid]
        assert (pos[kid] == pos[p] + 1).all(), "position = parent position + 1"
        assert (idx[kid] < se[p]).all() and (se[kid] <= se[p]).all(), "a subtree lies inside its parent's"
        # DFS contiguity: j follows its parent directly iff j is inside the subtree of j-1
        inside_prev = se[:-1] > idx[1:]
        assert np.array_equal(inside_prev, par[1:] == idx[1:] - 1), "not a DFS order"
        # sizes add up: |subtree(i)| = 1 + sum of children's subtree sizes
        size = se - idx
        child_sum = np.bincount(p, weights=size[kid], minlength=n)
        assert np.array_equal(size, 1 + child_sum.astype(np.int64)), "subtree sizes do not add up"
        r = idx[roots]
        assert r[0] == 0 and np.array_equal(se[r][:-1], r[1:]) and se[r][-1] == n, "roots do not tile"
        t = self.trainable
        assert not (t & roots).any(), "a root token cannot be a target (no logits before it)"
        off = ~t
        assert (self.old_logprobs[off] == 0).all() and (self.advantages[off] == 0).all(), "non-target values"
        assert (self.loss_weights[off] == 0).all() and (self.weight_version[off] == -1).all(), "non-target values"
        assert (self.loss_weights >= 0).all() and np.isfinite(self.loss_weights).all(), "loss weights"
        assert np.isfinite(self.old_logprobs).all() and np.isfinite(self.advantages).all(), "non-finite values"
        assert (self.weight_version[t] >= 0).all(), "targets carry their weight version"
        ps = self.piece_starts
        assert ps.dtype == np.int64 and ps.ndim == 1, "piece_starts: int64[K]"
        assert len(ps) == 0 or (ps[0] == 0 and (np.diff(ps) > 0).all() and ps[-1] < n), "piece_starts out of order"
        ei = self.execution_index
        assert ((ei >= 0) & (ei < len(self.execution_ids))).all(), "execution_index out of range"
        assert len(set(self.execution_ids)) == len(self.execution_ids), "duplicate execution ids"

    def dense_mask(self) -> np.ndarray:
        """``mask[j, i]`` = token j may attend to token i (bool [N, N]; for small batches and tests only)."""
        n = len(self.input_ids)
        i = np.arange(n)
        return (i[None, :] <= i[:, None]) & (i[:, None] < self.subtree_end[None, :])

    def to_bytes(self) -> bytes:
        """npz form for the blob spool."""
        buf = io.BytesIO()
        arrays = {name: getattr(self, name) for name in _ARRAYS}
        np.savez(buf, **arrays, execution_ids=np.asarray(self.execution_ids, dtype=np.str_),
                 step=np.asarray(self.step, dtype=np.int64), piece_starts=self.piece_starts)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> PackedBatch:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            fields = {name: z[name] for name in _ARRAYS}
            pieces = z["piece_starts"] if "piece_starts" in z.files else np.zeros(0, np.int64)  # spooled before pieces
            return cls(**fields, execution_ids=tuple(str(x) for x in z["execution_ids"]), step=int(z["step"]),
                       piece_starts=pieces.astype(np.int64, copy=False))


# --------------------------------------------------------------------------- splitting
@dataclass(frozen=True)
class Chunk:
    """DFS range ``[start, stop)`` of one execution's tree plus the root path of ``start`` as context."""

    execution_id: str
    tree: TreeArrays
    start: int
    stop: int
    context: np.ndarray  # DFS positions of the ancestors of `start`, root first (len == depth(start))

    @property
    def size(self) -> int:
        return len(self.context) + self.stop - self.start

    @property
    def num_trainable(self) -> int:
        return int(self.tree.trainable[self.start : self.stop].sum())


TREE_SPLITS = ("pieces", "context")


def split_tree(execution_id: str, tree: TreeArrays, token_budget: int, *, split: str = "context",
               kv_budget: int = 0) -> list[Chunk]:
    """The chunks ``tree`` trains in (see module docstring): the whole tree (``split="pieces"``), or
    chunks of at most ``token_budget`` tokens each with their root paths as context.

    ``kv_budget`` (pieces; 0 = none): the most tokens whose keys/values the trainer keeps for later
    pieces. A tree larger than that is cut, as ``context`` cuts, into chunks of at most ``kv_budget``
    tokens (each again trained in pieces): its chunks' root paths are recomputed as context instead
    of kept, which bounds the kept keys/values at the cost of those copies. It cannot bound them
    below a tree's depth: a chunk holding a token holds its whole root path (a path deeper than the
    budget is cut as ``context`` cuts it, each chunk carrying the path above it)."""
    if token_budget < 1:
        raise ValueError(f"token_budget is {token_budget}; it must be >= 1")
    if split not in TREE_SPLITS:
        raise ValueError(f"split is {split!r}; expected {' or '.join(TREE_SPLITS)}")
    if kv_budget < 0 or 0 < kv_budget < token_budget:
        raise ValueError(f"kv_budget is {kv_budget}; expected 0 (no limit) or at least the token budget "
                         f"({token_budget})")
    n = len(tree)
    empty = np.zeros(0, dtype=np.int64)
    if split == "pieces":
        if not kv_budget or n <= kv_budget:
            return [Chunk(execution_id, tree, 0, n, empty)] if n else []
        token_budget = kv_budget  # cut as context does, into chunks the trainer may keep whole
    if n <= token_budget:
        return [Chunk(execution_id, tree, 0, n, empty)] if n else []
    idx = np.arange(n, dtype=np.int64)
    parent = tree.parent.astype(np.int64)
    depth = tree.depth.astype(np.int64)
    starts_run = parent != idx - 1  # a run = a chain of consecutive DFS positions
    boundaries = np.flatnonzero(starts_run)
    run_start = np.maximum.accumulate(np.where(starts_run, idx, 0))

    def ancestors(a: int) -> np.ndarray:
        runs = []
        j = int(parent[a])
        while j >= 0:
            s = int(run_start[j])
            runs.append((s, j))
            j = int(parent[s])
        if not runs:
            return empty
        return np.concatenate([np.arange(s, j + 1, dtype=np.int64) for s, j in reversed(runs)])

    chunks: list[Chunk] = []
    a = 0
    while a < n:
        cap = token_budget - int(depth[a])
        if n - a <= cap:
            b = n
        else:
            limit = a + cap
            i = int(np.searchsorted(boundaries, limit, side="right")) - 1
            best = int(boundaries[i]) if i >= 0 and boundaries[i] > a else -1
            if best > a and (best - a) * 4 >= cap:
                b = best  # a branch start: the next chunk's context is shallow
            elif cap > 0 and depth[limit] <= token_budget // 2:
                b = limit  # cut inside a run; the next chunk still has half a budget for targets
            elif best > a:
                b = best
            else:  # a path deeper than the budget: the smallest chunk ending at a run boundary (pieces)
                j = int(np.searchsorted(boundaries, max(a, limit), side="right"))
                b = int(boundaries[j]) if j < len(boundaries) else n
        chunks.append(Chunk(execution_id, tree, a, b, ancestors(a)))
        a = b
    return chunks


def pack_sizes(sizes: Sequence[int], token_budget: int) -> list[list[int]]:
    """First-fit decreasing of item ``sizes`` into bins of ``token_budget``; returns item indices per
    bin (an item larger than the budget gets a bin of its own)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        for k, free in enumerate(room):
            if sizes[i] <= free:
                bins[k].append(i)
                room[k] -= sizes[i]
                break
        else:
            bins.append([i])
            room.append(token_budget - sizes[i])
    return bins


def pack_chunks(chunks: Sequence[Chunk], token_budget: int) -> list[list[Chunk]]:
    """``pack_sizes`` over chunks."""
    return [[chunks[i] for i in b] for b in pack_sizes([c.size for c in chunks], token_budget)]


def plan_pieces(num_tokens: int, token_budget: int) -> np.ndarray:
    """Piece starts of a micro-batch of ``num_tokens``: empty when it fits ``token_budget``, else
    consecutive pieces of ``token_budget`` tokens (the last one shorter)."""
    if token_budget < 1:
        raise ValueError(f"token_budget is {token_budget}; it must be >= 1")
    if num_tokens <= token_budget:
        return np.zeros(0, np.int64)
    return np.arange(0, num_tokens, token_budget, dtype=np.int64)


def assemble(chunks: Sequence[Chunk], *, step: int, advantages: Mapping[str, float],
             token_weights: Mapping[str, float], token_budget: int = 0) -> PackedBatch:
    """One PackedBatch from ``chunks``; ``token_weights[e]`` is the loss weight of each trainable
    node of execution ``e`` (1 / (its trainable nodes * executions in the step)). With a
    ``token_budget``, a batch longer than it (a whole tree, or a chunk of a path deeper than the
    budget) gets a piece plan (``plan_pieces``)."""
    exec_ids: list[str] = []
    where: dict[str, int] = {}
    parts: dict[str, list[np.ndarray]] = {name: [] for name in _ARRAYS}
    offset = 0
    for c in chunks:
        t = c.tree
        k = where.setdefault(c.execution_id, len(exec_ids))
        if k == len(exec_ids):
            exec_ids.append(c.execution_id)
        m = len(c.context)
        a, b = c.start, c.stop
        size = m + b - a
        sel = np.concatenate((c.context, np.arange(a, b, dtype=np.int64)))
        ctx_parent = np.arange(m, dtype=np.int64) - 1 + offset
        if m:
            ctx_parent[0] = -1
        p = t.parent[a:b].astype(np.int64)
        body_parent = np.where(p >= a, p - a + m + offset, np.where(p >= 0, t.depth[a:b].astype(np.int64) - 1 + offset, -1))
        # an ancestor's subtree in the chunk = the part of its original DFS range inside [a, b)
        ends = np.minimum(t.subtree_end[sel].astype(np.int64), b) - a + m + offset
        trainable = np.concatenate((np.zeros(m, dtype=bool), t.trainable[a:b]))
        adv = np.float32(advantages[c.execution_id])
        w = np.float32(token_weights[c.execution_id])
        parts["input_ids"].append(t.tokens[sel].astype(np.int64))
        parts["position_ids"].append(t.depth[sel].astype(np.int64))
        parts["subtree_end"].append(ends)
        parts["parent"].append(np.concatenate((ctx_parent, body_parent)))
        parts["trainable"].append(trainable)
        parts["old_logprobs"].append(np.where(trainable, t.logprob[sel], np.float32(0)))
        parts["advantages"].append(np.where(trainable, adv, np.float32(0)))
        parts["loss_weights"].append(np.where(trainable, w, np.float32(0)))
        parts["weight_version"].append(np.where(trainable, t.version[sel], -1))
        parts["execution_index"].append(np.full(size, k, dtype=np.int32))
        offset += size
    fields: dict[str, np.ndarray] = {name: (np.concatenate(parts[name]) if parts[name] else np.zeros(0))
              .astype(DTYPES[name], copy=False) for name in _ARRAYS}
    pieces = plan_pieces(offset, token_budget) if token_budget else np.zeros(0, np.int64)
    return PackedBatch(**fields, execution_ids=tuple(exec_ids), step=step, piece_starts=pieces)
