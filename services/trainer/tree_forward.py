"""Tree-packed forward: one packed sequence, position ids = depth, a tree attention mask.

A micro-batch is a forest in DFS order: token j may attend to token i iff

    i <= j < subtree_end[i]          (i is j itself or one of j's ancestors)

so every token sees exactly its root-to-token path, and the log-prob of each target equals the
one a per-path causal forward would give, while shared prefixes are computed once.

Three mask backends:

* ``sdpa``  - a dense bool mask (1, 1, N, N) for torch SDPA. O(N^2) memory: only for small N
  (``max_dense_tokens``, default 8192 -> 64 MiB of bools; tests and CPU runs).
* ``blocks`` - block-sparse attention query block by query block over only the KV blocks it
  touches (``tree_attention.py``), forward and backward, memory linear in tokens on any device:
  what CPU batches above ``max_dense_tokens`` use.
* ``flex``  - a flex_attention ``BlockMask`` built *directly* from the block structure of the
  tree in O((N/B)^2) (no N x N tensor is ever materialized), used through the attention function
  ``gyre_flex`` registered with transformers. On CUDA it runs the compiled block-sparse kernel
  (``compile_flex``, dynamic shapes: one compile for every batch length), CUDA's default; on CPU, torch 2.13 supports flex_attention both eagerly (the reference
  implementation, which materializes scores per head: correct, not memory-saving) and compiled
  (a C++ template; ~30 s compile), so CPU defaults to eager flex for correctness checks only.

Target log-probs: hidden state at parent[i] -> lm_head -> log_softmax -> gather input_ids[i],
computed in chunks of ``logits_chunk_tokens`` targets under activation checkpointing, so the
(T x vocab) logits never exist at once (memory linear in tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from services.trainer.batch import PackedBatchLike
from services.trainer.tree_attention import ATTN_IMPLEMENTATION as BLOCKS_IMPLEMENTATION
from services.trainer.tree_attention import ChunkKV, register_block_attention, tree_blocks

_REGISTERED = False
_COMPILED_FLEX: Any = None


# --- masks ---------------------------------------------------------------------------------------

def tree_mask_dense(subtree_end: torch.Tensor) -> torch.Tensor:
    """(1, 1, N, N) bool: [q, kv] = kv <= q < subtree_end[kv]. O(N^2): small N only."""
    n = subtree_end.shape[0]
    idx = torch.arange(n, device=subtree_end.device)
    q = idx[:, None]
    kv = idx[None, :]
    return ((kv <= q) & (q < subtree_end[None, :].to(idx.dtype)))[None, None]


def tree_mask_mod(subtree_end: torch.Tensor) -> Any:
    """flex_attention mask_mod of the tree mask; ``subtree_end`` padded to the block grid with 0."""

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx <= q_idx) & (q_idx < subtree_end[kv_idx])

    return mask_mod


def tree_block_mask(subtree_end: torch.Tensor, *, block_size: int = 128) -> Any:
    """flex_attention BlockMask of the tree mask, from block statistics only (no N x N tensor).

    For a KV block, the queries attending any of its tokens form one contiguous range
    [first token, max subtree_end) (each token's range starts at itself and starts are
    consecutive), so query block qb touches KV block kb iff it intersects that range. The pair is
    *full* (no mask_mod needed) iff qb > kb and every token's subtree in kb reaches past qb's end.
    """
    from torch.nn.attention.flex_attention import BlockMask

    n = subtree_end.shape[0]
    device = subtree_end.device
    nb = (n + block_size - 1) // block_size
    padded = nb * block_size
    end = subtree_end.to(torch.int64)
    end_pad0 = torch.zeros(padded, dtype=torch.int64, device=device)
    end_pad0[:n] = end
    end_padbig = torch.full((padded,), padded + 1, dtype=torch.int64, device=device)
    end_padbig[:n] = end
    max_end = end_pad0.view(nb, block_size).max(dim=1).values
    min_end = end_padbig.view(nb, block_size).min(dim=1).values
    blocks = torch.arange(nb, device=device)
    q_start = blocks * block_size
    q_stop = torch.clamp(q_start + block_size, max=n)
    kv_start = blocks * block_size
    touch = (q_start[:, None] < max_end[None, :]) & (q_stop[:, None] > kv_start[None, :])
    full = (blocks[:, None] > blocks[None, :]) & (q_stop[:, None] <= min_end[None, :])
    partial = touch & ~full

    def as_kv(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = sel.sum(dim=1, dtype=torch.int32)
        # Stable sort puts the selected block indices first, in increasing order.
        order = torch.argsort((~sel).to(torch.int8), dim=1, stable=True).to(torch.int32)
        return counts[None, None], order[None, None]

    kv_num, kv_idx = as_kv(partial)
    full_num, full_idx = as_kv(full)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size,
        mask_mod=tree_mask_mod(end_pad0.to(torch.int32)), seq_lengths=(n, n),
    )


# --- attention function registered with transformers -------------------------------------------

def _flex_fn(device_type: str, compile_flex: bool) -> Any:
    global _COMPILED_FLEX
    from torch.nn.attention.flex_attention import flex_attention

    if not compile_flex:
        return flex_attention
    if _COMPILED_FLEX is None:
        # dynamic: one compile serves every batch length (a static compile recompiles for each new
        # length, 4-7 s apiece on an H200, and after 8 lengths torch gives up: bench/results/cuda.md)
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=True)
    return _COMPILED_FLEX


def _gyre_flex_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
                         **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function: flex_attention with the tree BlockMask passed as the mask."""
    from torch.nn.attention.flex_attention import BlockMask

    if not isinstance(attention_mask, BlockMask):
        raise ValueError("attn_implementation 'gyre_flex' needs a BlockMask (tree_block_mask) as attention_mask")
    compile_flex = bool(getattr(module.config, "gyre_compile_flex", query.device.type == "cuda"))
    fn = _flex_fn(query.device.type, compile_flex)
    out = fn(query, key, value, block_mask=attention_mask, scale=scaling,
             enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    """Register ``gyre_flex`` with transformers' AttentionInterface (idempotent)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from transformers import AttentionInterface

    AttentionInterface.register("gyre_flex", _gyre_flex_attention)
    _REGISTERED = True


def enable_layer_checkpointing(model: torch.nn.Module) -> None:
    """Checkpoint every decoder layer of a transformers model (non-reentrant). transformers 5.2x
    names it ``activation_checkpointing_enable`` (the old name warns); earlier 5.x releases, which
    the pin allows, have only ``gradient_checkpointing_enable``."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(  # type: ignore[operator]
            gradient_checkpointing_kwargs={"use_reentrant": False})


def disable_layer_checkpointing(model: torch.nn.Module) -> None:
    disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
    disable()  # type: ignore[operator]


# --- tensors of one micro-batch ------------------------------------------------------------------

@dataclass(frozen=True)
class TreeTensors:
    """A packed micro-batch as torch tensors on the model's device; ``target_*`` are per target."""

    input_ids: torch.Tensor        # int64 [N]
    position_ids: torch.Tensor     # int64 [N]
    subtree_end: torch.Tensor      # int64 [N]
    target_index: torch.Tensor     # int64 [T] positions of trainable tokens
    target_parent: torch.Tensor    # int64 [T] their parents (whose logits predict them)
    target_ids: torch.Tensor       # int64 [T]
    old_logprobs: torch.Tensor     # float32 [T]
    advantages: torch.Tensor       # float32 [T]
    loss_weights: torch.Tensor     # float32 [T]
    weight_version: torch.Tensor   # int64 [T]
    piece_starts: tuple[int, ...] = ()  # the packer's piece plan (PackedBatch.piece_starts); () = one piece

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_targets(self) -> int:
        return int(self.target_index.shape[0])

    @classmethod
    def from_batch(cls, batch: PackedBatchLike, device: str | torch.device = "cpu") -> "TreeTensors":
        tgt = np.flatnonzero(np.asarray(batch.trainable))

        def t(a: Any, dtype: torch.dtype) -> torch.Tensor:
            # A copy: wire batches are read-only views of the received bytes.
            return torch.tensor(np.asarray(a), dtype=dtype, device=device)

        ids = np.asarray(batch.input_ids)
        return cls(
            input_ids=t(ids, torch.int64), position_ids=t(batch.position_ids, torch.int64),
            subtree_end=t(batch.subtree_end, torch.int64), target_index=t(tgt, torch.int64),
            target_parent=t(np.asarray(batch.parent)[tgt], torch.int64), target_ids=t(ids[tgt], torch.int64),
            old_logprobs=t(np.asarray(batch.old_logprobs)[tgt], torch.float32),
            advantages=t(np.asarray(batch.advantages)[tgt], torch.float32),
            loss_weights=t(np.asarray(batch.loss_weights)[tgt], torch.float32),
            weight_version=t(np.asarray(batch.weight_version)[tgt], torch.int64),
            piece_starts=tuple(int(x) for x in np.asarray(batch.piece_starts)),
        )


# --- forward -------------------------------------------------------------------------------------

def _chunk_logprobs(lm_head: torch.nn.Module, hidden: torch.Tensor, target_ids: torch.Tensor,
                    inv_temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    logits = lm_head(hidden).float() * inv_temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, target_ids[:, None])[:, 0]
    entropy = -(logp_all.exp() * logp_all).sum(dim=-1)
    return logp, entropy


def head_logprobs(lm_head: torch.nn.Module, hidden: torch.Tensor, target_ids: torch.Tensor, *,
                  temperature: float = 1.0, chunk_tokens: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob and entropy of ``target_ids`` given the predicting hidden states [T, H], chunked."""
    inv_t = 1.0 / temperature
    if hidden.shape[0] <= chunk_tokens:
        return _chunk_logprobs(lm_head, hidden, target_ids, inv_t)
    outs = [
        checkpoint(_chunk_logprobs, lm_head, hidden[s:s + chunk_tokens], target_ids[s:s + chunk_tokens], inv_t,
                   use_reentrant=False)
        for s in range(0, hidden.shape[0], chunk_tokens)
    ]
    return torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])


class TreePolicy:
    """Runs a transformers causal LM on packed trees and returns per-target log-probs / entropies.

    ``attention``: "sdpa" (dense bool mask), "flex" (BlockMask), "blocks" (block-sparse, any
    device) or "auto" (CUDA: flex, compiled once for every length, but for batches of at most two flex
    blocks; CPU: blocks, but for
    batches of at most two blocks). The model's attn_implementation is switched per batch.
    ``checkpoint_layers``: activation checkpointing of the decoder layers. A batch with a piece
    plan (the packer's, for a path deeper than the step's budget) trains piece by piece
    (``train_chunked``); ``chunk_tokens`` caps a piece, and a batch without a plan longer than it
    trains in chunks of it (0: no cap).
    """

    def __init__(self, model: torch.nn.Module, *, attention: str = "auto", temperature: float = 1.0,
                 max_dense_tokens: int = 8192, flex_block_size: int = 128, logits_chunk_tokens: int = 4096,
                 sparse_block_tokens: int = 256, checkpoint_layers: bool = False, chunk_tokens: int = 0) -> None:
        if attention not in ("auto", "sdpa", "flex", "blocks"):
            raise ValueError(f"attention must be 'auto', 'sdpa', 'flex' or 'blocks', got {attention!r}")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        register_attention()
        register_block_attention()
        self.model = model
        self.attention = attention
        self.temperature = temperature
        self.max_dense_tokens = max_dense_tokens
        self.flex_block_size = flex_block_size
        self.sparse_block_tokens = sparse_block_tokens  # query/KV block of the "blocks" backend
        self.logits_chunk_tokens = logits_chunk_tokens
        self.lm_head = model.get_output_embeddings()  # type: ignore[operator]
        self.checkpoint_layers = checkpoint_layers
        if chunk_tokens < 0:
            raise ValueError(f"chunk_tokens must be >= 0 (0: never chunk), got {chunk_tokens}")
        # a batch longer than this trains in chunks of it (whole attention blocks), see train_chunked
        self.chunk_tokens = 0 if chunk_tokens == 0 else max(sparse_block_tokens,
                                                            chunk_tokens // sparse_block_tokens * sparse_block_tokens)
        if checkpoint_layers:
            # activation checkpointing of each decoder layer (training mode only): the backward
            # recomputes a layer's activations from its input instead of keeping them, so a micro-
            # batch holds one hidden state per layer, not every intermediate (non-reentrant, so
            # the tree attention's keyword arguments reach the layer; nests with the block-sparse
            # attention's own checkpoint)
            enable_layer_checkpointing(model)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def sharded(self) -> bool:
        """Whether the model is sharded over a trainer group (services.trainer.sharding)."""
        return hasattr(self.model, "gyre_decode")

    @property
    def decoder(self) -> Any:
        # a sharded model runs its decoder through ``gyre_decode``, a forward method FSDP knows of
        # (the root unit's parameters, embeddings and head, gathered before the embeddings run)
        return self.model.gyre_decode if self.sharded else self.model.get_decoder()  # type: ignore[operator]

    def backend_for(self, num_tokens: int) -> str:
        if self.attention != "auto":
            return self.attention
        if self.device.type == "cuda":
            # the compiled flex kernel beats the dense mask already at 8K tokens on an H200 (1.35x on a
            # path, 2.1x on packed small trees, with less memory: bench/results/cuda.md); a batch
            # of one or two flex blocks gains nothing from it
            return "sdpa" if num_tokens <= 2 * self.flex_block_size else "flex"
        # CPU: the block-sparse backend skips what no query sees (5-6x the dense mask's tokens/s on
        # 8K tokens of packed small trees, bench/results/long_train.md) and has a backward, which
        # flex lacks here; a batch of one or two blocks gains nothing from it
        return "sdpa" if num_tokens <= 2 * self.sparse_block_tokens else "blocks"

    def hidden_states(self, t: TreeTensors) -> torch.Tensor:
        """Last hidden states [N, H] of the packed forest under the tree mask."""
        backend = self.backend_for(t.num_tokens)
        extra: dict[str, Any] = {}
        if backend == "sdpa":
            if t.num_tokens > self.max_dense_tokens:
                raise ValueError(f"{t.num_tokens} tokens exceed max_dense_tokens={self.max_dense_tokens} for the "
                                 f"dense SDPA tree mask; use attention='blocks' or 'flex'")
            mask: Any = tree_mask_dense(t.subtree_end)
            impl = "sdpa"
        elif backend == "blocks":
            mask, impl = None, BLOCKS_IMPLEMENTATION
            extra["gyre_tree_blocks"] = tree_blocks(t.subtree_end, block_size=self.sparse_block_tokens)
        else:
            mask = tree_block_mask(t.subtree_end, block_size=self.flex_block_size)
            impl = "gyre_flex"
        if self.model.config._attn_implementation != impl:  # type: ignore[union-attr]
            self.model.set_attn_implementation(impl)  # type: ignore[operator]
        out = self.decoder(input_ids=t.input_ids[None], position_ids=t.position_ids[None],
                           attention_mask=mask, use_cache=False, **extra)
        return out.last_hidden_state[0]

    def target_logprobs(self, t: TreeTensors) -> tuple[torch.Tensor, torch.Tensor]:
        """(logprobs [T], entropy [T]) of the batch's targets, differentiable w.r.t. the model."""
        hidden = self.hidden_states(t)
        logp, entropy = head_logprobs(self.lm_head, hidden[t.target_parent], t.target_ids,
                                      temperature=self.temperature, chunk_tokens=self.logits_chunk_tokens)
        if self.sharded and torch.is_grad_enabled():
            logp = logp + self.touch(hidden)
        return logp, entropy

    def touch(self, hidden: torch.Tensor) -> torch.Tensor:
        """A zero that depends on every parameter (the head on one token): added to what a sharded
        rank back-propagates, so every parameter gets a gradient, zero or not, on every rank. FSDP
        reduce-scatters only the gradients that exist: ranks that left the head (a chunk without
        targets, padding) out would send buffers of another size."""
        return self.lm_head(hidden[..., :1, :]).float().sum() * 0.0

    # -- long batches in chunks ---------------------------------------------------------------------
    def chunked(self, t: TreeTensors) -> bool:
        """Whether ``t`` trains in chunks (a piece plan, or longer than ``chunk_tokens``)."""
        return len(t.piece_starts) > 1 or (self.chunk_tokens > 0 and t.num_tokens > self.chunk_tokens)

    def chunk_bounds(self, t: TreeTensors) -> list[tuple[int, int]]:
        """The ``[start, stop)`` token ranges ``train_chunked`` runs a forward over: the batch's
        pieces (one piece without a plan), each cut further into ``chunk_tokens`` if longer."""
        return self.bounds_of(t.num_tokens, t.piece_starts)

    def bounds_of(self, num_tokens: int, piece_starts: tuple[int, ...] | list[int]) -> list[tuple[int, int]]:
        """``chunk_bounds`` of a batch of ``num_tokens`` with the piece plan ``piece_starts``."""
        n, c = num_tokens, self.chunk_tokens
        starts = list(piece_starts) or [0]
        bounds = []
        for s, e in zip(starts, starts[1:] + [n]):
            step = c if c > 0 else e - s
            bounds += [(a, min(a + step, e)) for a in range(s, e, step)]
        return bounds

    def forwards_of(self, num_tokens: int, piece_starts: tuple[int, ...] | list[int]) -> int:
        """How many forward pieces a batch trains in: 1 unchunked, else its ``chunk_bounds``."""
        chunked = len(piece_starts) > 1 or (self.chunk_tokens > 0 and num_tokens > self.chunk_tokens)
        return len(self.bounds_of(num_tokens, piece_starts)) if chunked else 1

    def pad(self, *, forwards: int = 0, backwards: int = 0) -> None:
        """One-token forwards (no graph) and forward + backward passes whose loss is zero: what a
        rank of a sharded group runs where another rank trains a piece it has none of, so every rank
        issues the same collectives (FSDP gathers a unit's parameters in each forward and backward,
        and reduce-scatters its gradients after each backward). Adds nothing to any gradient."""
        device = self.device
        one = torch.zeros((1, 1), dtype=torch.int64, device=device)
        blocks = tree_blocks(torch.ones(1, dtype=torch.int64, device=device), block_size=self.sparse_block_tokens)
        if self.model.config._attn_implementation != BLOCKS_IMPLEMENTATION:  # type: ignore[union-attr]
            self.model.set_attn_implementation(BLOCKS_IMPLEMENTATION)  # type: ignore[operator]

        def forward() -> torch.Tensor:
            out = self.decoder(input_ids=one, position_ids=one, attention_mask=None, use_cache=False,
                               gyre_tree_blocks=blocks)
            return out.last_hidden_state  # type: ignore[no-any-return]

        with torch.no_grad():
            for _ in range(forwards):
                forward()
        for _ in range(backwards):
            self.touch(forward()).backward()

    def _chunk(self, t: TreeTensors, s: int, e: int, blocks: Any, kv: ChunkKV) -> torch.Tensor:
        """Last hidden states [e - s, H] of tokens [s, e), attending to ``kv.past`` (tokens < s)."""
        out = self.decoder(input_ids=t.input_ids[None, s:e], position_ids=t.position_ids[None, s:e],
                           attention_mask=None, use_cache=False, gyre_tree_blocks=blocks, gyre_chunk_kv=kv)
        return out.last_hidden_state[0]

    def train_chunked(self, t: TreeTensors, loss_of: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                      *, before_backward: Callable[[], bool] | None = None, pad_to: int = 0
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Accumulate the gradient of a batch in pieces (``chunk_bounds``), exactly, holding the
        activations of one chunk at a time; returns the targets' (logprobs, entropy), detached.

        The batch is cut into chunks along its token order (DFS: every token's ancestors come
        before it). First pass, without autograd: each chunk's keys/values in every layer, given
        all earlier ones (the KV of the whole batch is kept: ``2 x layers x kv_width`` per token).
        Second pass, last chunk first: the chunk again with autograd, its keys/values attending to
        the earlier tokens' as leaves; backward of ``loss_of(logprobs, entropy, targets)`` of the
        targets whose parent is in the chunk, plus what later chunks sent back to this chunk's
        keys/values; the leaves' gradients are added to what the earlier chunks will send. Since
        the loss is a sum over targets, the parameter gradient equals the unchunked batch's, at
        the cost of one more forward. ``before_backward`` runs between the passes (the queue's
        ack): False leaves the gradient sums untouched and returns None. ``pad_to``: a rank of a
        sharded group runs this many forwards in each pass (``pad``), whatever its own chunks."""
        n = t.num_tokens
        blocks = tree_blocks(t.subtree_end, block_size=self.sparse_block_tokens)
        if self.model.config._attn_implementation != BLOCKS_IMPLEMENTATION:  # type: ignore[union-attr]
            self.model.set_attn_implementation(BLOCKS_IMPLEMENTATION)  # type: ignore[operator]
        bounds = self.chunk_bounds(t)
        keys: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> ([1, kv_heads, N, d] x 2)
        with torch.no_grad():
            for s, e in bounds:
                kv = ChunkKV(past={layer: (k[:, :, :s], v[:, :, :s]) for layer, (k, v) in keys.items()}, own={})
                self._chunk(t, s, e, blocks, kv)
                for layer, (k, v) in kv.own.items():
                    if layer not in keys:
                        shape = (k.shape[0], k.shape[1], n, k.shape[3])
                        keys[layer] = (k.new_empty(shape), v.new_empty(shape))
                    keys[layer][0][:, :, s:e] = k
                    keys[layer][1][:, :, s:e] = v
        padding = max(0, pad_to - len(bounds))
        self.pad(forwards=padding)
        if before_backward is not None and not before_backward():
            assert not padding, "a sharded group's rank has no ack between the passes"
            return None
        sent = {layer: (torch.zeros_like(k), torch.zeros_like(v)) for layer, (k, v) in keys.items()}
        logp = torch.zeros(t.num_targets, device=t.input_ids.device)
        entropy = torch.zeros(t.num_targets, device=t.input_ids.device)
        parent = t.target_parent
        for s, e in reversed(bounds):
            past = {layer: (k[:, :, :s].detach().requires_grad_(True), v[:, :, :s].detach().requires_grad_(True))
                    for layer, (k, v) in keys.items()} if s > 0 else {}
            kv = ChunkKV(past=past, own={})
            hidden = self._chunk(t, s, e, blocks, kv)
            outputs: list[torch.Tensor] = []
            grads: list[torch.Tensor | None] = []
            sel = torch.nonzero((parent >= s) & (parent < e)).squeeze(1)
            if sel.numel():
                lp, ent = head_logprobs(self.lm_head, hidden[parent[sel] - s], t.target_ids[sel],
                                        temperature=self.temperature, chunk_tokens=self.logits_chunk_tokens)
                loss = loss_of(lp, ent, sel)
                logp[sel], entropy[sel] = lp.detach().float(), ent.detach().float()
                if loss.requires_grad:
                    outputs.append(loss)
                    grads.append(None)
            if self.sharded:
                # every chunk's backward runs through every FSDP unit (the root's and each layer's
                # pre-backward unshard, their post-backward reduce-scatter) and gives every
                # parameter a gradient, whichever outputs carry one: the ranks issue the same collectives
                outputs.append(self.touch(hidden))
                grads.append(None)
            if e < n:  # what the later chunks' losses send back through this chunk's keys/values
                for layer, (k, v) in kv.own.items():
                    outputs += [k, v]
                    grads += [sent[layer][0][:, :, s:e], sent[layer][1][:, :, s:e]]
            if outputs:
                torch.autograd.backward(outputs, grads)
            for layer, (pk, pv) in past.items():
                if pk.grad is not None:
                    sent[layer][0][:, :, :s] += pk.grad
                if pv.grad is not None:
                    sent[layer][1][:, :, :s] += pv.grad
        self.pad(backwards=padding)
        return logp, entropy

    def path_logprobs(self, paths: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Per-path causal baseline: [P, L] right-padded paths -> log-prob of token k given < k, [P, L-1].

        Positions past a path's length are garbage (masked by the caller). Used by tests and the
        per-path training baseline of the bench.
        """
        if self.model.config._attn_implementation != "sdpa":  # type: ignore[union-attr]
            self.model.set_attn_implementation("sdpa")  # type: ignore[operator]
        lmax = paths.shape[1]
        attn = (torch.arange(lmax, device=paths.device)[None, :] < lengths[:, None]).long()
        hidden = self.decoder(input_ids=paths, attention_mask=attn, use_cache=False).last_hidden_state
        h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
        logp, _ = head_logprobs(self.lm_head, h, paths[:, 1:].reshape(-1), temperature=self.temperature,
                                chunk_tokens=self.logits_chunk_tokens)
        return logp.view(paths.shape[0], lmax - 1)
