"""Naive reference for the trajectory tree (a dict of root paths) and random executions for property tests.

Quadratic and slow on purpose: it expands every call's full sequence and every path, exactly as the
semantics in issue #3 read, so the vectorized implementation can be checked against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.trajectory.records import TitoCall

from services.common.roles import AgentRole


def full_sequences(calls: list[TitoCall]) -> dict[str, np.ndarray]:
    """prompt + output of every call, resolving delta-encoded prompts."""
    full: dict[str, np.ndarray] = {}
    for c in calls:
        if c.prompt_ids is not None:
            prompt = c.prompt_ids
        else:
            d = c.delta
            base = full[d.base_call_id][: d.shared_prefix_len] if d.base_call_id else np.zeros(0, np.int32)
            prompt = np.concatenate((base, d.new_ids))
        full[c.call_id] = np.concatenate((prompt, c.output_ids)).astype(np.int32)
    return full


@dataclass
class NaiveNode:
    gen: int | None = None
    logprob: float = 0.0
    version: int = -1


class NaiveTree:
    def __init__(self, calls: list[TitoCall]) -> None:
        full = full_sequences(calls)
        self.nodes: dict[tuple[int, ...], NaiveNode] = {}
        ends: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        for idx, c in enumerate(calls):
            seq = tuple(full[c.call_id].tolist())
            p_len = c.prompt_len
            for d in range(len(seq)):
                node = self.nodes.setdefault(seq[: d + 1], NaiveNode())
                if d >= p_len and node.gen is None:
                    node.gen, node.logprob, node.version = idx, float(c.output_logprobs[d - p_len]), c.weight_version
            ends.setdefault(seq, []).append((int(c.role), idx))
        inner = {p[:-1] for p in self.nodes}
        leaves = [p for p in self.nodes if p not in inner]
        self.ranked = sorted(leaves, key=lambda p: (min(r for r, _ in ends[p]), min(i for _, i in ends[p])))

    def chosen(self, max_paths: int | None) -> list[tuple[int, ...]]:
        return self.ranked if max_paths is None else self.ranked[:max_paths]

    def union(self, max_paths: int | None) -> set[tuple[int, ...]]:
        return {leaf[: d + 1] for leaf in self.chosen(max_paths) for d in range(len(leaf))}

    def stats(self, max_paths: int | None) -> dict[str, int]:
        chosen = self.chosen(max_paths)
        union = self.union(max_paths)
        return {"paths": len(chosen), "naive_tokens": sum(len(p) for p in chosen), "tree_tokens": len(union),
                "trainable_tokens": sum(self.nodes[p].gen is not None for p in union)}

    @staticmethod
    def layout_paths(parent: np.ndarray, tokens: np.ndarray) -> list[tuple[int, ...]]:
        """Root path (tokens) of every position of a DFS layout, from its parent pointers."""
        paths: list[tuple[int, ...]] = []
        for i in range(len(tokens)):
            p = int(parent[i])
            paths.append((paths[p] if p >= 0 else ()) + (int(tokens[i]),))
        return paths


def random_execution(rng: np.random.Generator, n_calls: int, vocab: int, *, execution_id: str = "E",
                     max_new: int = 4) -> list[TitoCall]:
    """Calls that extend, retry, compact, branch and repeat earlier calls over a tiny vocabulary
    (so accidental matches and re-rendered outputs happen often)."""
    calls: list[TitoCall] = []
    fulls: list[np.ndarray] = []
    prompts: list[np.ndarray] = []
    roles = [AgentRole.MAIN, AgentRole.SUBAGENT, AgentRole.SUMMARY]
    for i in range(n_calls):
        kind = int(rng.integers(5))
        new = rng.integers(0, vocab, int(rng.integers(0, max_new)))
        if not fulls or kind == 0:
            prompt = rng.integers(0, vocab, int(rng.integers(1, max_new + 1)))
        elif kind == 1:  # identical retry of an earlier prompt
            prompt = prompts[int(rng.integers(len(prompts)))]
        elif kind == 2:  # continue an earlier call (linear loop)
            prompt = np.concatenate((fulls[int(rng.integers(len(fulls)))], new))
        else:  # branch from inside an earlier call (retry from a point, compaction, sub-agent)
            base = fulls[int(rng.integers(len(fulls)))]
            prompt = np.concatenate((base[: int(rng.integers(0, len(base) + 1))], new))
        if len(prompt) == 0:
            prompt = rng.integers(0, vocab, 1)
        out = rng.integers(0, vocab, int(rng.integers(0, max_new + 1)))
        lp = -rng.random(len(out)).astype(np.float32) - 0.01
        calls.append(TitoCall(execution_id, f"c{i}", f"a{int(rng.integers(3))}", roles[int(rng.integers(3))],
                              out, lp, int(rng.integers(4)), prompt_ids=prompt))
        prompts.append(prompt)
        fulls.append(np.concatenate((prompt, out)))
    return calls
