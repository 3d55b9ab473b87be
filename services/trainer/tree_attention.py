"""Block-sparse tree attention: forward and backward with memory linear in tokens, on any device.

A packed forest (DFS order) lets token j attend to token i iff ``i <= j < subtree_end[i]``. The
dense backend builds that as an ``N x N`` mask (64 MiB of bools at 8K tokens, 16 GiB at 128K) and
flex attention has no backward on CPU. This backend never builds more than one query block's
mask:

    for each query block [qs, qe):
        KV blocks it touches = the blocks holding one of its tokens' ancestors (from block
                               statistics: a KV block's tokens are attended by queries in
                               [its start, max subtree_end in it), a contiguous range)
        keys  = those blocks (adjacent ones merged into runs; a path is one run, a view)
        out   = sdpa(q block, keys, values, mask of q block x its keys)     (exact)

Blocks no query of the block can see are skipped: a forest of short trees costs its blocks'
diagonal, a deep path costs its causal triangle in blocks. Each block runs under activation
checkpointing and gathers its keys inside the checkpoint, so autograd keeps only views of the
layer's own q/k/v (no per-block copies): memory is linear in tokens, and the backward recomputes
each block once (about the cost of a second forward of the attention).

``TreeBlocks`` reaches the attention function as a keyword argument (transformers passes unknown
forward kwargs down to it); the attention mask argument is unused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

ATTN_IMPLEMENTATION = "gyre_blocks"
_REGISTERED = False


@dataclass(frozen=True)
class TreeBlocks:
    """The block structure of one packed forest's tree mask (built from block statistics only)."""

    subtree_end: torch.Tensor  # int64 [N], on the model's device
    block_size: int
    runs: tuple[tuple[tuple[int, int], ...], ...]  # per query block: KV token ranges [start, stop) it may see

    @property
    def num_tokens(self) -> int:
        return int(self.subtree_end.shape[0])

    def visited_fraction(self) -> float:
        """Query x key pairs computed, over the N x N a dense mask would (1.0 = dense)."""
        n, b = self.num_tokens, self.block_size
        pairs = sum(min(b, n - q * b) * sum(e - s for s, e in r) for q, r in enumerate(self.runs))
        return pairs / max(n * n, 1)


def tree_blocks(subtree_end: torch.Tensor, *, block_size: int = 256) -> TreeBlocks:
    """``TreeBlocks`` of a forest: O(N + (N / block_size)^2) work, never N x N."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    end = subtree_end.detach().cpu().numpy().astype(np.int64)
    n = len(end)
    nb = -(-n // block_size)
    starts = np.arange(nb) * block_size
    stops = np.minimum(starts + block_size, n)
    padded = np.zeros(nb * block_size, np.int64)
    padded[:n] = end
    max_end = padded.reshape(nb, block_size).max(axis=1)  # queries seeing KV block k lie in [start_k, max_end_k)
    # query block q touches KV block k iff k <= q (keys never follow their queries) and q starts before max_end_k
    touch = (np.arange(nb)[None, :] <= np.arange(nb)[:, None]) & (starts[:, None] < max_end[None, :])
    runs = []
    for q in range(nb):  # one pass per block, vectorized within it
        ks = np.flatnonzero(touch[q])
        breaks = np.flatnonzero(np.diff(ks) > 1)
        firsts = np.concatenate([ks[:1], ks[breaks + 1]])
        lasts = np.concatenate([ks[breaks], ks[-1:]])
        runs.append(tuple((int(starts[a]), int(min(stops[z], stops[q]))) for a, z in zip(firsts, lasts)))
    return TreeBlocks(subtree_end=subtree_end.to(torch.int64), block_size=block_size, runs=tuple(runs))


def _block(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, subtree_end: torch.Tensor,
           runs: tuple[tuple[int, int], ...], qs: int, scale: float, gqa: bool) -> torch.Tensor:
    """Attention of one query block over the KV runs it may see, with their exact tree mask."""
    if len(runs) == 1:
        s, e = runs[0]
        k, v = key[:, :, s:e], value[:, :, s:e]
        kv_idx = torch.arange(s, e, device=key.device)
    else:
        k = torch.cat([key[:, :, s:e] for s, e in runs], dim=2)
        v = torch.cat([value[:, :, s:e] for s, e in runs], dim=2)
        kv_idx = torch.cat([torch.arange(s, e, device=key.device) for s, e in runs])
    q_idx = torch.arange(qs, qs + query.shape[2], device=key.device)[:, None]
    mask = (kv_idx[None, :] <= q_idx) & (q_idx < subtree_end[kv_idx][None, :])
    return F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)


def tree_block_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, blocks: TreeBlocks,
                         scale: float, q_offset: int = 0) -> torch.Tensor:
    """``[1, heads, Q, d]`` queries over ``[1, kv_heads, K, d]`` keys/values under the tree mask.

    The queries are tokens ``[q_offset, q_offset + Q)`` of the forest and the keys its first
    ``K = q_offset + Q`` tokens (all of them: ``q_offset`` 0; a piece of a long batch: its own and
    every earlier token's, see ``TreePolicy``). A piece may start and end inside a block: its first
    and last query blocks are cut to the piece, and their key runs to the keys given."""
    gqa = query.shape[1] != key.shape[1]
    b = blocks.block_size
    stop = q_offset + query.shape[2]
    if q_offset < 0 or key.shape[2] != stop:
        raise ValueError(f"queries at {q_offset} (+{query.shape[2]}) need keys of the {stop} tokens up to their "
                         f"end; got {key.shape[2]} keys")
    grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    outs = []
    for q in range(q_offset // b, -(-stop // b)):  # a loop over blocks of tokens, not over tokens
        qs, qe = max(q * b, q_offset), min((q + 1) * b, stop)
        # keys after the block's last query are invisible to it (causal) and, in a piece, not given
        runs = tuple((s, min(e, qe)) for s, e in blocks.runs[q] if s < qe)
        q_blk = query[:, :, qs - q_offset:qe - q_offset]
        if grad:
            outs.append(checkpoint(_block, q_blk, key, value, blocks.subtree_end, runs, qs, scale, gqa,
                                   use_reentrant=False))
        else:
            outs.append(_block(q_blk, key, value, blocks.subtree_end, runs, qs, scale, gqa))
    return torch.cat(outs, dim=2)


class ChunkKV:
    """Keys/values across the chunks of one long micro-batch (``TreePolicy``'s chunked training):
    ``past[layer]`` = (keys, values) of every token before the chunk, prepended to the chunk's own;
    the attention stores the chunk's own (post-RoPE, before any GQA repeat) in ``own[layer]``.

    A plain class, not a dataclass: FSDP's forward hooks rebuild the dataclasses and dicts they find
    in a module's arguments (to wrap their tensors), so every decoder layer of a sharded model would
    store its keys in a copy; an object of a plain class reaches every layer as itself."""

    __slots__ = ("past", "own")

    def __init__(self, *, past: dict[int, tuple[torch.Tensor, torch.Tensor]],
                 own: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.past = past
        self.own = own


def _attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: Any, scaling: float | None = None, dropout: float = 0.0,
               gyre_tree_blocks: TreeBlocks | None = None, gyre_chunk_kv: ChunkKV | None = None,
               **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention function; the forward must be given ``gyre_tree_blocks=`` (and, for a
    chunk of a long batch, ``gyre_chunk_kv=``)."""
    if gyre_tree_blocks is None:
        raise ValueError(f"attn_implementation {ATTN_IMPLEMENTATION!r} needs gyre_tree_blocks=tree_blocks(...)")
    if query.shape[0] != 1:
        raise ValueError("tree attention runs one packed forest at a time (batch size 1)")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    offset = 0
    if gyre_chunk_kv is not None:
        layer = int(getattr(module, "layer_idx"))
        gyre_chunk_kv.own[layer] = (key, value)
        past = gyre_chunk_kv.past.get(layer)
        if past is not None and past[0].shape[2]:
            offset = past[0].shape[2]
            key, value = torch.cat([past[0], key], dim=2), torch.cat([past[1], value], dim=2)
    out = tree_block_attention(query, key, value, gyre_tree_blocks, scale, q_offset=offset)
    return out.transpose(1, 2).contiguous(), None


def register_block_attention() -> None:
    """Register ``gyre_blocks`` with transformers' AttentionInterface (idempotent)."""
    global _REGISTERED
    if not _REGISTERED:
        from transformers import AttentionInterface

        AttentionInterface.register(ATTN_IMPLEMENTATION, _attention)
        _REGISTERED = True


__all__ = ["ATTN_IMPLEMENTATION", "ChunkKV", "TreeBlocks", "tree_blocks", "tree_block_attention", "register_block_attention"]
