"""Tree-packed forward == per-path causal forwards (log-probs and gradients), and the masks.

The tiny model (Qwen3 architecture, 2 layers, hidden 64, vocab 512) runs one packed forest with
position ids = depth and the tree mask; each target's log-prob must equal the one a plain causal
forward of its root-to-leaf path gives (fp32, rel err <= 1e-5), and the gradient of the step loss
must equal the per-path gradient with weights split over the paths sharing a node.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask

from services.trainer.model import build_model
from services.algorithm import ObjectiveConfig, policy_loss
from services.trainer.synthetic import SyntheticStep, make_step
from services.trainer.tree_forward import (TreePolicy, TreeTensors, head_logprobs, tree_block_mask,
                                           tree_mask_dense, tree_mask_mod)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_model("tiny", seed=1)


@pytest.fixture(scope="module")
def step() -> SyntheticStep:
    # 3 executions, each a binary tree of segments 2 levels deep, all in one micro-batch.
    return make_step(5, num_executions=3, depth=2, branching=2, micro_batch_tokens=100_000)


def _path_batch(step: SyntheticStep) -> tuple[torch.Tensor, torch.Tensor]:
    lens = torch.tensor([len(p.input_ids) for p in step.paths])
    paths = torch.zeros(len(step.paths), int(lens.max()), dtype=torch.long)
    for i, p in enumerate(step.paths):
        paths[i, : len(p.input_ids)] = torch.as_tensor(p.input_ids)
    return paths, lens


def _batch_offsets(step: SyntheticStep) -> np.ndarray:
    ex = step.batches[0].execution_index
    return np.searchsorted(ex, np.arange(ex.max() + 1))


def test_packed_tree_logprobs_equal_per_path(model: torch.nn.Module, step: SyntheticStep) -> None:
    assert len(step.batches) == 1 and step.path_tokens > 1.5 * step.tree_tokens  # real sharing
    policy = TreePolicy(model, attention="sdpa")
    t = TreeTensors.from_batch(step.batches[0])
    with torch.no_grad():
        tree_lp, _ = policy.target_logprobs(t)
        paths, lens = _path_batch(step)
        path_lp = policy.path_logprobs(paths, lens)
    by_node = dict(zip(t.target_index.tolist(), tree_lp.tolist()))
    offsets = _batch_offsets(step)
    checked = 0
    for i, p in enumerate(step.paths):
        assert p.nodes is not None
        for k in np.flatnonzero(p.trainable):
            node = int(offsets[p.execution] + p.nodes[k])
            got, want = by_node[node], float(path_lp[i, k - 1])
            assert abs(got - want) <= 1e-5 * abs(want), (i, k, got, want)
            checked += 1
    assert checked > t.num_targets  # shared targets were compared against several paths


def test_tree_mask_takes_effect(model: torch.nn.Module, step: SyntheticStep) -> None:
    """Negative control: the same packed sequence under a plain causal mask gives other log-probs."""
    policy = TreePolicy(model, attention="sdpa")
    t = TreeTensors.from_batch(step.batches[0])
    with torch.no_grad():
        tree_lp, _ = policy.target_logprobs(t)
        causal_end = torch.full_like(t.subtree_end, t.num_tokens)  # every later token sees everything before
        causal = TreeTensors(**{**t.__dict__, "subtree_end": causal_end})
        causal_lp, _ = policy.target_logprobs(causal)
    assert (tree_lp - causal_lp).abs().max() > 1e-2


def test_gradient_tree_equals_paths(model: torch.nn.Module, step: SyntheticStep) -> None:
    cfg = ObjectiveConfig(eps_low=0.2, eps_high=0.28)
    policy = TreePolicy(model, attention="sdpa")
    params = [p for p in model.parameters()]

    model.zero_grad(set_to_none=True)
    t = TreeTensors.from_batch(step.batches[0])
    lp, _ = policy.target_logprobs(t)
    policy_loss(lp, t.old_logprobs, t.advantages, t.loss_weights, config=cfg).loss.backward()
    tree_grads = [p.grad.clone() for p in params]  # type: ignore[union-attr]

    model.zero_grad(set_to_none=True)
    paths, lens = _path_batch(step)
    plp = policy.path_logprobs(paths, lens)
    sel = torch.zeros_like(plp, dtype=torch.bool)
    old = torch.zeros_like(plp)
    adv = torch.zeros_like(plp)
    w = torch.zeros_like(plp)
    for i, p in enumerate(step.paths):
        n = len(p.input_ids) - 1
        sel[i, :n] = torch.as_tensor(p.trainable[1:])
        old[i, :n] = torch.as_tensor(p.old_logprobs[1:])
        adv[i, :n] = torch.as_tensor(p.advantages[1:])
        w[i, :n] = torch.as_tensor(p.loss_weights[1:])
    policy_loss(plp[sel], old[sel], adv[sel], w[sel], config=cfg).loss.backward()
    for (name, _), g_tree, p in zip(model.named_parameters(), tree_grads, params):
        assert p.grad is not None
        torch.testing.assert_close(g_tree, p.grad, rtol=1e-4, atol=1e-7, msg=name)
    assert sum(float(g.abs().sum()) for g in tree_grads) > 0


def _random_forest_end(rng: np.random.Generator, n: int, pop: float = 0.3) -> torch.Tensor:
    """subtree_end of a random forest in DFS order (``pop``: chance to close an open ancestor)."""
    parent = np.full(n, -1)
    stack: list[int] = []
    for i in range(n):
        while stack and rng.random() < pop:
            stack.pop()
        parent[i] = stack[-1] if stack else -1
        stack.append(i)
    end = np.arange(1, n + 1)
    for i in range(n - 1, -1, -1):  # test helper: children end before parents
        if parent[i] >= 0:
            end[parent[i]] = max(end[parent[i]], end[i])
    return torch.as_tensor(end)


@pytest.mark.parametrize("n,block", [(200, 16), (257, 32), (64, 128), (1000, 128)])
def test_block_mask_matches_mask_mod(n: int, block: int) -> None:
    end = _random_forest_end(np.random.default_rng(n), n)
    ours = tree_block_mask(end, block_size=block)
    padded = torch.nn.functional.pad(end.int(), (0, (-n) % block))
    ref = create_block_mask(tree_mask_mod(padded), None, None, n, n, device="cpu", BLOCK_SIZE=block)
    assert torch.equal(ours.to_dense(), ref.to_dense())
    # And the block structure is exactly the dense mask's.
    dense = tree_mask_dense(end)[0, 0]
    nb = (n + block - 1) // block
    padded_dense = torch.zeros(nb * block, nb * block, dtype=torch.bool)
    padded_dense[:n, :n] = dense
    touched = padded_dense.view(nb, block, nb, block).any(dim=3).any(dim=1)
    assert torch.equal(ours.to_dense()[0, 0].bool(), touched)


def test_block_mask_is_linear_in_tokens() -> None:
    """64K tokens of many small trees: built from block statistics (nb^2 ints), never N x N."""
    n = 65_536
    end = _random_forest_end(np.random.default_rng(0), n, pop=0.9)
    bm = tree_block_mask(end, block_size=128)
    assert bm.kv_num_blocks.shape == (1, 1, n // 128)
    assert bm.sparsity() > 95.0  # mostly block-diagonal: compute scales with tokens, not tokens^2


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_forward_equals_sdpa(model: torch.nn.Module, step: SyntheticStep) -> None:
    """flex_attention with the tree BlockMask (eager on CPU: forward only in torch 2.13)."""
    t = TreeTensors.from_batch(step.batches[0])
    with torch.no_grad():
        sdpa_lp, sdpa_ent = TreePolicy(model, attention="sdpa").target_logprobs(t)
        flex_lp, flex_ent = TreePolicy(model, attention="flex", flex_block_size=32).target_logprobs(t)
    torch.testing.assert_close(flex_lp, sdpa_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flex_ent, sdpa_ent, rtol=1e-5, atol=1e-5)
    model.set_attn_implementation("sdpa")


def test_chunked_head_equals_unchunked(model: torch.nn.Module) -> None:
    head = model.get_output_embeddings()
    h = torch.randn(37, model.config.hidden_size, requires_grad=True)
    ids = torch.randint(0, model.config.vocab_size, (37,))
    lp1, e1 = head_logprobs(head, h, ids, chunk_tokens=1000)
    g1 = torch.autograd.grad((lp1.sum() + e1.sum()), h)[0]
    lp2, e2 = head_logprobs(head, h, ids, chunk_tokens=8, temperature=1.0)
    g2 = torch.autograd.grad((lp2.sum() + e2.sum()), h)[0]
    torch.testing.assert_close(lp1, lp2)
    torch.testing.assert_close(e1, e2)
    torch.testing.assert_close(g1, g2)


def test_temperature_scales_logits(model: torch.nn.Module) -> None:
    head = model.get_output_embeddings()
    h = torch.randn(5, model.config.hidden_size)
    ids = torch.randint(0, model.config.vocab_size, (5,))
    with torch.no_grad():
        lp, _ = head_logprobs(head, h, ids, temperature=0.5)
        want = torch.log_softmax(head(h) / 0.5, dim=-1).gather(-1, ids[:, None])[:, 0]
    torch.testing.assert_close(lp, want)


# --- block-sparse tree attention (any device, forward and backward) ------------------------------
@pytest.mark.parametrize("n,block,pop", [(200, 16, 0.3), (1000, 128, 0.3), (3000, 256, 0.05), (2048, 256, 0.0),
                                         (8192, 512, 0.02)])
def test_block_sparse_attention_equals_dense_with_gradients(n: int, block: int, pop: float) -> None:
    from services.trainer.tree_attention import tree_block_attention, tree_blocks

    end = _random_forest_end(np.random.default_rng(n), n, pop)  # pop 0: one path, the causal triangle
    g = torch.Generator().manual_seed(n)
    q, k, v = (torch.randn(1, h, n, 16, generator=g, requires_grad=True) for h in (4, 2, 2))
    w = torch.randn(1, 4, n, 16, generator=g)
    blocks = tree_blocks(end, block_size=block)
    out = tree_block_attention(q, k, v, blocks, 0.25)
    (out * w).sum().backward()
    grads = [x.grad for x in (q, k, v)]
    q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q2, k2, v2, attn_mask=tree_mask_dense(end), scale=0.25,
                                                           enable_gqa=True)
    (ref * w).sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, (q2.grad, k2.grad, v2.grad)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if pop == 0.0:  # a single path computes its causal triangle in blocks, not the square
        assert blocks.visited_fraction() < 0.5 + block / n


def test_block_sparse_skips_what_no_query_sees() -> None:
    from services.trainer.tree_attention import tree_blocks

    n = 65_536
    end = _random_forest_end(np.random.default_rng(0), n, pop=0.9)  # many small trees
    blocks = tree_blocks(end, block_size=256)
    assert len(blocks.runs) == n // 256 and blocks.visited_fraction() < 0.02


def test_policy_blocks_backend_equals_sdpa_in_loss_and_gradients(model: torch.nn.Module,
                                                                 step: SyntheticStep) -> None:
    t = TreeTensors.from_batch(step.batches[0])
    results = []
    for attention in ("sdpa", "blocks"):
        model.zero_grad(set_to_none=True)
        lp, ent = TreePolicy(model, attention=attention, sparse_block_tokens=32).target_logprobs(t)
        (lp.sum() + 0.1 * ent.sum()).backward()
        results.append((lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (lp_d, g_d), (lp_b, g_b) = results
    torch.testing.assert_close(lp_b, lp_d, rtol=1e-5, atol=1e-5)
    assert g_d.keys() == g_b.keys() and g_d
    for name in g_d:
        torch.testing.assert_close(g_b[name], g_d[name], rtol=1e-4, atol=1e-5, msg=name)
    model.set_attn_implementation("sdpa")


def test_auto_trains_past_the_dense_limit_on_cpu(model: torch.nn.Module, step: SyntheticStep) -> None:
    t = TreeTensors.from_batch(step.batches[0])
    policy = TreePolicy(model, attention="auto", max_dense_tokens=t.num_tokens - 1, sparse_block_tokens=32)
    assert policy.backend_for(t.num_tokens) == "blocks" and policy.backend_for(64) == "sdpa"
    lp, _ = policy.target_logprobs(t)
    lp.sum().backward()
    assert torch.isfinite(lp).all()
    model.zero_grad(set_to_none=True)
    model.set_attn_implementation("sdpa")


@pytest.mark.parametrize("attention", ["sdpa", "blocks"])
def test_activation_checkpointing_keeps_loss_and_gradients_and_saves_less(attention: str,
                                                                          step: SyntheticStep) -> None:
    """Decoder layers checkpointed: the same log-probs and parameter gradients, while autograd
    keeps fewer bytes of activations for the backward (counted through saved-tensor hooks)."""
    t = TreeTensors.from_batch(step.batches[0])
    results = []
    for checkpointing in (False, True):
        net = build_model("tiny", seed=1)
        net.train()
        policy = TreePolicy(net, attention=attention, sparse_block_tokens=32, checkpoint_layers=checkpointing)
        saved = [0]

        def pack(x: torch.Tensor) -> torch.Tensor:
            saved[0] += x.numel() * x.element_size()
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            lp, ent = policy.target_logprobs(t)
        (lp.sum() + 0.1 * ent.sum()).backward()
        grads = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
        results.append((lp.detach(), grads, saved[0]))
    (lp0, g0, saved0), (lp1, g1, saved1) = results
    torch.testing.assert_close(lp1, lp0, rtol=1e-5, atol=1e-5)
    assert g0.keys() == g1.keys() and g0
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-5, msg=name)
    assert saved1 < 0.7 * saved0, (saved1, saved0)


def _chain(n: int, seed: int = 0) -> TreeTensors:
    """One path of ``n`` tokens, every token after the first a target with random weights."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 512, (n,), generator=g)
    tgt = torch.arange(1, n)
    return TreeTensors(input_ids=ids, position_ids=torch.arange(n), subtree_end=torch.full((n,), n),
                       target_index=tgt, target_parent=tgt - 1, target_ids=ids[1:],
                       old_logprobs=-torch.rand(n - 1, generator=g) * 5, advantages=torch.randn(n - 1, generator=g),
                       loss_weights=torch.rand(n - 1, generator=g) / n,
                       weight_version=torch.zeros(n - 1, dtype=torch.int64))


@pytest.mark.parametrize("kind,chunk,pieces", [
    ("path", 128, ()), ("path", 192, ()), ("forest", 64, ()), ("path-8k", 2048, ()),
    ("path", 0, (0, 100, 250, 333, 600)), ("path", 64, (0, 250, 333)), ("forest", 0, (0, 50, 130, 131))])
def test_chunked_training_equals_the_whole_batch(kind: str, chunk: int, pieces: tuple[int, ...],
                                                 step: SyntheticStep) -> None:
    """A batch trained in chunks (the second pass sends each chunk's key/value gradients back to
    the earlier chunks) gives the whole batch's log-probs and every parameter gradient, on one long
    path (also 8,192 tokens in 2,048-token chunks) and on a packed forest of branching trees
    (targets whose parent sits in an earlier chunk); also in the packer's pieces, which start and
    end inside attention blocks (alone, or cut further by ``chunk_tokens``)."""
    t = {"path": lambda: _chain(700), "path-8k": lambda: _chain(8192),
         "forest": lambda: TreeTensors.from_batch(step.batches[0])}[kind]()
    t = dataclasses.replace(t, piece_starts=pieces)
    assert t.num_tokens > 2 * max(chunk, 64)
    net = build_model("tiny", seed=3)
    net.train()
    cfg = ObjectiveConfig(entropy_coef=0.01)

    def loss_of(lp: torch.Tensor, ent: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
        return policy_loss(lp, t.old_logprobs[sel], t.advantages[sel], t.loss_weights[sel], config=cfg,
                           entropy=ent).loss

    whole = TreePolicy(net, attention="blocks", sparse_block_tokens=32)
    lp, ent = whole.target_logprobs(t)
    loss_of(lp, ent, torch.arange(t.num_targets)).backward()
    ref = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    net.zero_grad(set_to_none=True)

    policy = TreePolicy(net, attention="blocks", sparse_block_tokens=32, chunk_tokens=chunk)
    assert policy.chunked(t) and policy.chunk_tokens % 32 == 0
    bounds = policy.chunk_bounds(t)
    assert bounds[0][0] == 0 and bounds[-1][1] == t.num_tokens and all(a < b for a, b in bounds)
    assert all(b == c for (_, b), (c, _) in zip(bounds, bounds[1:]))
    assert set(pieces) <= {a for a, _ in bounds} and all(b - a <= (chunk or t.num_tokens) for a, b in bounds)
    got = policy.train_chunked(t, loss_of)
    assert got is not None
    torch.testing.assert_close(got[0], lp.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], ent.detach(), rtol=1e-5, atol=1e-5)
    grads = {n: p.grad for n, p in net.named_parameters() if p.grad is not None}
    assert grads.keys() == ref.keys() and ref
    for name in ref:
        torch.testing.assert_close(grads[name], ref[name], rtol=1e-4, atol=1e-6, msg=name)
    net.zero_grad(set_to_none=True)
    # the queue refusing the batch between the passes leaves no gradient behind
    assert policy.train_chunked(t, loss_of, before_backward=lambda: False) is None
    assert all(p.grad is None for p in net.parameters())
    net.set_attn_implementation("sdpa")


def test_padding_passes_add_nothing_and_plans_count_forward_pieces() -> None:
    """What a rank of a sharded group runs where another trains a piece: one-token forwards and
    zero-loss backwards leave every gradient as it was (here: exactly zero, but present)."""
    net = build_model("tiny", seed=3)
    policy = TreePolicy(net, attention="blocks", sparse_block_tokens=32, chunk_tokens=64)
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    policy.pad(forwards=2, backwards=3)
    assert all(p.grad is not None and not p.grad.any() for p in net.parameters())
    assert policy.forwards_of(64, ()) == 1 and policy.forwards_of(65, ()) == 2
    assert policy.forwards_of(700, (0, 250, 333)) == len(policy.bounds_of(700, (0, 250, 333))) == 4 + 2 + 6
