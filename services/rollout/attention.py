"""The engine's attention: no dense mask on prefill, none on decode unless rows differ in length.

transformers builds a ``chunk x context`` mask whenever a chunk of queries meets a cache that
already holds earlier tokens (sdpa's ``is_causal`` aligns the triangle top-left, which is wrong
when there are more keys than queries). At 64K positions a 4K chunk's mask is 256 MB per
forward. Registered under ``ATTN_IMPLEMENTATION`` (a name transformers has no mask builder for,
so it builds none and passes the engine's own decode mask through untouched), this function
computes the same attention without one:

    queries [P, P+L) vs keys [0, P+L)   (bottom-right causal)
      = merge( queries vs keys [0, P)     no mask: every past key is visible
               queries vs keys [P, P+L)   square causal: sdpa's is_causal is exact )

The two halves are combined by their log-sum-exps (the flash-attention rescaling), so memory is
linear in the context. The past half runs on the key/value heads directly: the query heads of one
group are stacked as more queries (no mask there), so the cached keys are never copied per head.
On CUDA, torch's lower-right ``CausalBias`` dispatches to fused kernels without a mask instead.

Decode steps pass a ``[rows, 1, 1, keys]`` bool length mask only when the batch mixes lengths
(``SlotKV.begin_step``); a single row or equal lengths attend to every key with no mask.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

ATTN_IMPLEMENTATION = "gyre_engine"


def _with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CPU flash attention returning (out [b, h, q, d], log-sum-exp [b, h, q]) in float32."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out.float(), lse.float()


def lower_right_causal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """Attention of ``L`` queries that are the last ``L`` of ``S`` keys, each seeing its own key and
    every earlier one. Shapes ``[b, heads, L, d]`` and ``[b, kv_heads, S, d]``; no ``L x S`` mask."""
    b, heads, q_len, d = query.shape
    kv_heads, s = key.shape[1], key.shape[2]
    rep = heads // kv_heads
    if q_len == s:
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale,
                                              enable_gqa=rep > 1)
    if query.device.type != "cpu":
        return F.scaled_dot_product_attention(query, key, value, attn_mask=causal_lower_right(q_len, s),
                                              scale=scale, enable_gqa=rep > 1)
    past = s - q_len
    # past keys, no mask: the `rep` query heads of a kv head are stacked as rep * L queries
    q_past = query.reshape(b, kv_heads, rep * q_len, d)
    out_a, lse_a = _with_lse(q_past, key[:, :, :past], value[:, :, :past], causal=False, scale=scale)
    out_a, lse_a = out_a.reshape(b, heads, q_len, d), lse_a.reshape(b, heads, q_len)
    # the chunk's own keys, square causal (only L keys: repeating them per head is cheap)
    k_self, v_self = key[:, :, past:], value[:, :, past:]
    if rep > 1:
        k_self, v_self = k_self.repeat_interleave(rep, dim=1), v_self.repeat_interleave(rep, dim=1)
    out_b, lse_b = _with_lse(query, k_self, v_self, causal=True, scale=scale)
    top = torch.maximum(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - top)[..., None], torch.exp(lse_b - top)[..., None]
    return ((out_a * w_a + out_b * w_b) / (w_a + w_b)).to(query.dtype)


def engine_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention interface: returns ``[b, L, heads, d]`` and no weights."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    rep = query.shape[1] // key.shape[1]
    if attention_mask is not None or query.shape[2] == 1:  # decode: a length mask, or none needed
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scale,
                                             enable_gqa=rep > 1)
    else:
        out = lower_right_causal(query, key, value, scale)
    return out.transpose(1, 2).contiguous(), None


def use_engine_attention(model: torch.nn.Module) -> None:
    """Register ``engine_attention`` and switch ``model`` (every sub-config) to it."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, engine_attention)
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = ATTN_IMPLEMENTATION


__all__ = ["ATTN_IMPLEMENTATION", "engine_attention", "lower_right_causal", "use_engine_attention"]
