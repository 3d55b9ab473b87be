"""Token trie of one execution, stored as flat numpy arrays that grow in place.

Nodes are allocated in *segments*. Inserting a sequence walks the existing trie, comparing the
new tokens against contiguous node runs with numpy, and appends the unmatched remainder as ONE
new segment of consecutive node ids. Hence, with no Python object per token:

- node ``n + 1`` is the child of ``n`` iff both lie in the same segment (the "continuation");
- every other child starts a segment; those are kept in a dict only at branch points:
  ``branches[node][token] -> first node of the child segment`` (``ROOT`` = -1 is the root);
- ``depth(n) = seg_depth[s] + (n - seg_start[s])`` (position id = depth, the root token is 0).

An insert costs O(tokens of the sequence) numpy work plus O(segments crossed) Python steps; a
delta-encoded record starts at its base call's node at the shared prefix length, so it never
re-reads the shared prefix.

Example (three calls)::

    seg 0: [sys prompt1 out1]                 call 0
    seg 1:                   [tool2 out2]     call 1 (extends call 0: attached at the end of seg 0)
    seg 2:      [summary-request out3]        call 2 (compaction: attached inside seg 0)

Layout for training (``layout``): depth-first order that visits a node's continuation before its
branch children, so every segment stays contiguous and every subtree is the DFS range
``[i, subtree_end[i])``.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import numpy as np

ROOT = -1
_NO_CHILDREN: dict[int, int] = {}


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two equally long 1-D arrays (vectorized)."""
    k = len(a)
    head = min(k, 64)  # most compares stop early: look at a short head before the whole run
    ne = np.flatnonzero(a[:head] != b[:head])
    if ne.size:
        return int(ne[0])
    if k == head:
        return k
    rest = a[head:] != b[head:]
    i = int(rest.argmax())
    return head + i if rest[i] else k


@dataclass(frozen=True)
class TrieLayout:
    """A forest of kept nodes in DFS order (all arrays have one entry per kept node)."""

    nodes: np.ndarray  # int64: trie node id at each DFS position
    depth: np.ndarray  # int32: depth from the root of its tree (root token = 0)
    parent: np.ndarray  # int32: DFS position of the parent, -1 for a root
    subtree_end: np.ndarray  # int32: node j is in the subtree of i iff i <= j < subtree_end[i]


class TokenTrie:
    """A prefix trie of token sequences (see module docstring).

    Extra per-node arrays (``add_field``) grow together with the token array; views returned by
    ``tokens``/``field`` are invalidated by the next insert.
    """

    def __init__(self, capacity: int = 1024) -> None:
        self._cap = max(16, int(capacity))
        self._tokens = np.empty(self._cap, dtype=np.int32)
        self._fields: dict[str, np.ndarray] = {}
        self._fills: dict[str, Any] = {}
        self.num_nodes = 0
        self.seg_start: list[int] = []
        self.seg_parent: list[int] = []
        self.seg_depth: list[int] = []
        self.seg_owner: list[int] = []
        self.branches: dict[int, dict[int, int]] = {}

    # ----------------------------------------------------------------- storage
    def add_field(self, name: str, dtype: Any, fill: Any) -> None:
        """Register a per-node array initialised to ``fill`` for every new node."""
        arr = np.empty(self._cap, dtype=dtype)
        arr[: self.num_nodes] = fill
        self._fields[name] = arr
        self._fills[name] = fill

    def field(self, name: str) -> np.ndarray:
        return self._fields[name][: self.num_nodes]

    @property
    def tokens(self) -> np.ndarray:
        return self._tokens[: self.num_nodes]

    @property
    def num_segments(self) -> int:
        return len(self.seg_start)

    def reserve(self, total_nodes: int) -> None:
        """Make room for ``total_nodes`` nodes (avoids repeated growth when the size is known)."""
        if total_nodes <= self._cap:
            return
        self._cap = int(total_nodes)
        self._tokens = _grown(self._tokens, self._cap, self.num_nodes)
        for name, arr in self._fields.items():
            self._fields[name] = _grown(arr, self._cap, self.num_nodes)

    def nbytes(self) -> int:
        return self._tokens.nbytes + sum(a.nbytes for a in self._fields.values())

    # ----------------------------------------------------------------- navigation
    def segment_of(self, node: int) -> int:
        return bisect.bisect_right(self.seg_start, node) - 1

    def segment_end(self, seg: int) -> int:
        """One past the last node of segment ``seg``."""
        return self.seg_start[seg + 1] if seg + 1 < len(self.seg_start) else self.num_nodes

    def depth(self, node: int) -> int:
        if node == ROOT:
            return -1
        s = self.segment_of(node)
        return self.seg_depth[s] + node - self.seg_start[s]

    def owner(self, node: int) -> int:
        """The owner tag of the segment holding ``node`` (the call that created it)."""
        return self.seg_owner[self.segment_of(node)]

    def ancestor(self, node: int, depth: int) -> int:
        """The node at ``depth`` on the root path of ``node`` (``ROOT`` for depth -1)."""
        if depth < 0:
            return ROOT
        while True:
            s = self.segment_of(node)
            d0 = self.seg_depth[s]
            if depth >= d0:
                assert depth <= d0 + node - self.seg_start[s], "ancestor deeper than the node"
                return self.seg_start[s] + depth - d0
            node = self.seg_parent[s]

    def path_runs(self, node: int, min_depth: int = 0) -> list[tuple[int, int, int]]:
        """Contiguous node runs ``(first, last, first_depth)`` covering depths ``[min_depth, depth(node)]``
        of the root path of ``node``, shallowest first."""
        runs: list[tuple[int, int, int]] = []
        while node != ROOT:
            s = self.segment_of(node)
            st, d0 = self.seg_start[s], self.seg_depth[s]
            if d0 + node - st < min_depth:
                break
            lo = max(d0, min_depth)
            runs.append((st + lo - d0, node, lo))
            if d0 <= min_depth:
                break
            node = self.seg_parent[s]
        runs.reverse()
        return runs

    def path_tokens(self, node: int) -> np.ndarray:
        """Tokens of the root path of ``node`` (empty for ``ROOT``)."""
        runs = self.path_runs(node, 0)
        if not runs:
            return np.empty(0, dtype=np.int32)
        return np.concatenate([self._tokens[a : b + 1] for a, b, _ in runs])

    def leaves(self) -> list[int]:
        """Nodes without children: segment ends that are not branch points."""
        out = []
        for s in range(len(self.seg_start)):
            end = self.segment_end(s) - 1
            if end not in self.branches:
                out.append(end)
        return out

    # ----------------------------------------------------------------- insertion
    def match(self, node: int, seq: np.ndarray, pos: int = 0) -> tuple[int, int]:
        """Follow ``seq[pos:]`` down from ``node``; returns (last matched node, position after it)."""
        tokens = self._tokens
        n_seq = len(seq)
        end = 0  # one past the current segment (meaningful when node != ROOT)
        if node != ROOT:
            end = self.segment_end(self.segment_of(node))
        while pos < n_seq:
            tok = int(seq[pos])
            if node != ROOT and node + 1 < end and tokens[node + 1] == tok:
                child = node + 1
            else:
                child = self.branches.get(node, _NO_CHILDREN).get(tok, -2)
                if child == -2:
                    break
                end = self.segment_end(self.segment_of(child))
            k = min(end - child, n_seq - pos)
            m = common_prefix_len(tokens[child : child + k], seq[pos : pos + k])
            node = child + m - 1
            pos += m
        return node, pos

    def extend(self, node: int, seq: np.ndarray, owner: int) -> int:
        """Append ``seq`` (non-empty, diverging at ``node``) as a new segment; returns its last node."""
        r = len(seq)
        assert r > 0
        first = int(seq[0])
        assert first not in self.branches.get(node, _NO_CHILDREN), "extend() must follow match()"
        start = self.num_nodes
        if start + r > self._cap:
            self.reserve(max(start + r, self._cap * 2))
        self._tokens[start : start + r] = seq
        for name, arr in self._fields.items():
            arr[start : start + r] = self._fills[name]
        self.seg_start.append(start)
        self.seg_parent.append(node)
        self.seg_depth.append(self.depth(node) + 1)
        self.seg_owner.append(owner)
        self.branches.setdefault(node, {})[first] = start
        self.num_nodes = start + r
        return start + r - 1

    def insert(self, node: int, seq: np.ndarray, owner: int) -> tuple[int, int]:
        """Insert ``seq`` below ``node``; returns (end node, number of tokens that already existed)."""
        end, pos = self.match(node, seq)
        if pos < len(seq):
            end = self.extend(end, seq[pos:], owner)
        return end, pos

    # ----------------------------------------------------------------- selection and layout
    def keep_paths(self, leaves: list[int]) -> np.ndarray:
        """For each segment, the last node kept by the union of the root paths of ``leaves``
        (``seg_start - 1`` where nothing is kept). Cost: O(segments), not O(tokens)."""
        kept = [s - 1 for s in self.seg_start]
        for node in leaves:
            while node != ROOT:
                s = self.segment_of(node)
                already = kept[s] >= self.seg_start[s]
                if node > kept[s]:
                    kept[s] = node
                if already:  # its ancestors are kept already
                    break
                node = self.seg_parent[s]
        return np.asarray(kept, dtype=np.int64)

    def keep_all(self) -> np.ndarray:
        return np.asarray([self.segment_end(s) - 1 for s in range(len(self.seg_start))], dtype=np.int64)

    def layout(self, kept_last: np.ndarray) -> TrieLayout:
        """DFS layout of the kept nodes (``kept_last`` as from ``keep_paths``/``keep_all``)."""
        starts = np.asarray(self.seg_start, dtype=np.int64)
        lens = np.maximum(kept_last - starts + 1, 0)
        seg_parent = np.asarray(self.seg_parent, dtype=np.int64)
        seg_depth = np.asarray(self.seg_depth, dtype=np.int64)
        keep = np.flatnonzero(lens > 0)
        # segment-level tree: parent segment and attach offset of each kept segment
        pseg = np.where(seg_parent >= 0, np.searchsorted(starts, seg_parent, side="right") - 1, -1)
        attach = np.where(seg_parent >= 0, seg_parent - starts[np.maximum(pseg, 0)], 0)
        # children sorted by (parent segment, deepest attach point first, creation order)
        kids = keep[np.lexsort((keep, -attach[keep], pseg[keep]))]
        children: dict[int, list[int]] = {}
        for s in kids.tolist():
            children.setdefault(int(pseg[s]), []).append(s)
        order: list[int] = []
        stack = list(reversed(children.get(-1, [])))
        while stack:
            s = stack.pop()
            order.append(s)
            stack.extend(reversed(children.get(s, ())))
        o = np.asarray(order, dtype=np.int64)
        olens = lens[o]
        total = int(olens.sum())
        pos = np.zeros(len(starts), dtype=np.int64)
        seg_off = np.concatenate(([0], np.cumsum(olens)[:-1])) if len(o) else np.zeros(0, np.int64)
        pos[o] = seg_off
        # subtree sizes: post-order accumulation over segments (O(segments))
        size = lens.copy()
        for s in reversed(order):
            p = pseg[s]
            if p >= 0:
                size[p] += size[s]
        # per-node arrays in DFS order
        local = np.arange(total, dtype=np.int64) - np.repeat(seg_off, olens)
        nodes = np.repeat(starts[o], olens) + local
        depth = np.repeat(seg_depth[o], olens) + local
        parent = np.arange(total, dtype=np.int64) - 1
        heads = seg_off
        has_parent = pseg[o] >= 0
        parent[heads] = np.where(has_parent, pos[np.maximum(pseg[o], 0)] + attach[o], -1)
        # subtree_end[i] = end of i's segment + sizes of child subtrees attached at or below i
        add = np.zeros(total + 1, dtype=np.int64)
        child_segs = o[has_parent]
        np.add.at(add, pos[pseg[child_segs]] + attach[child_segs], size[child_segs])
        csum = np.cumsum(add[:total])
        seg_end_pos = np.repeat(seg_off + olens, olens)
        below = csum[seg_end_pos - 1] - csum + add[:total]
        subtree_end = seg_end_pos + below
        return TrieLayout(
            nodes=nodes,
            depth=depth.astype(np.int32),
            parent=parent.astype(np.int32),
            subtree_end=subtree_end.astype(np.int32),
        )


def _grown(arr: np.ndarray, cap: int, used: int) -> np.ndarray:
    out = np.empty(cap, dtype=arr.dtype)
    out[:used] = arr[:used]
    return out
