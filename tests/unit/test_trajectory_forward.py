"""The key equivalence: ONE forward over a packed tree gives the same log-probs for every trainable
node as separate forwards over every root-to-leaf path (small transformers model, fp32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from services.trajectory.packing import PackedBatch, assemble, pack_chunks, split_tree
from services.trajectory.tree import ExecutionTree
from tests.unit.trajectory_reference import NaiveTree, random_execution

VOCAB = 96


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa", torch_dtype=torch.float32).eval()


def packed_logprobs(model: LlamaForCausalLM, batch: PackedBatch) -> np.ndarray:
    """Log-prob of every token from logits at its parent, with the tree mask (i <= j < subtree_end[i])."""
    mask = torch.from_numpy(batch.dense_mask())
    additive = torch.zeros(mask.shape, dtype=torch.float32).masked_fill(~mask, torch.finfo(torch.float32).min)
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(batch.input_ids)[None],
                       position_ids=torch.from_numpy(batch.position_ids)[None],
                       attention_mask=additive[None, None]).logits[0]
    logp = torch.log_softmax(logits.double(), dim=-1)
    parent = torch.from_numpy(np.maximum(batch.parent, 0).astype(np.int64))
    return logp[parent, torch.from_numpy(batch.input_ids)].numpy()


def path_logprobs(model: LlamaForCausalLM, seq: np.ndarray) -> dict[tuple[int, ...], float]:
    ids = torch.from_numpy(seq.astype(np.int64))[None]
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
    toks = seq.tolist()
    return {tuple(toks[: d + 1]): float(logp[d - 1, toks[d]]) for d in range(1, len(toks))}


@pytest.mark.parametrize("budget", [10_000, 40])
def test_packed_tree_forward_equals_per_path_forwards(model: LlamaForCausalLM, budget: int) -> None:
    rng = np.random.default_rng(3)
    trees = {}
    for e in range(3):
        calls = random_execution(rng, 12, 6, execution_id=f"e{e}", max_new=8)
        tree = ExecutionTree(f"e{e}")
        for c in calls:
            tree.add(c)
        trees[f"e{e}"] = tree
    arrays = {eid: t.arrays() for eid, t in trees.items()}
    chunks = [c for eid, a in arrays.items() for c in split_tree(eid, a, budget)]
    weights = {eid: 1.0 / max(a.num_trainable, 1) for eid, a in arrays.items()}
    batches = [assemble(b, step=0, advantages=dict.fromkeys(arrays, 0.0), token_weights=weights)
               for b in pack_chunks(chunks, budget)]
    assert (len(batches) > 1) == (budget < 100)

    # per-path reference: every selected path in its own forward
    reference: dict[tuple[str, tuple[int, ...]], list[float]] = {}
    naive_tokens = 0
    for eid, tree in trees.items():
        for seq in tree.path_sequences():
            naive_tokens += len(seq)
            for key, lp in path_logprobs(model, seq).items():
                reference.setdefault((eid, key), []).append(lp)

    checked = 0
    packed_tokens = 0
    for batch in batches:
        batch.validate()
        packed_tokens += len(batch)
        got = packed_logprobs(model, batch)
        for i, p in enumerate(NaiveTree.layout_paths(batch.parent, batch.input_ids)):
            if not batch.trainable[i]:
                continue
            eid = batch.execution_ids[batch.execution_index[i]]
            for want in reference[(eid, p)]:  # the same node on several paths: all agree
                assert abs(got[i] - want) <= 1e-5 * abs(want), (eid, p, got[i], want)
            checked += 1
    assert checked == sum(a.num_trainable for a in arrays.values())
    assert packed_tokens < naive_tokens  # shared prefixes are computed once
