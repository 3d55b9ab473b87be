"""Batched token sampling with a counter-based per-request RNG (torch, no Python loop per request).

Why not one ``torch.Generator`` per request: drawing from B generators is B Python calls per step,
and a generator's state is an opaque blob tied to how many numbers each op consumed. Instead each
request's i-th draw is ``u_i = splitmix64(seed, i)``, a pure function of (seed, number of tokens
drawn so far). So:

- the same seed gives the same uniforms whatever else is in the batch;
- the RNG state is two integers (``pack_rng_state``), exact after a migration, and derivable
  from the seed and the generated length when a request is re-prefilled from its TITO record.

Sampling of row r (``temperature > 0``): ``p = softmax(logits / T)``; with ``top_k > 0`` or
``top_p < 1`` the vocabulary is sorted by ``p`` and cut (top-k first, then the smallest prefix whose
mass reaches ``top_p``); the token is the inverse CDF of the kept, renormalized mass at ``u``.
Whether a row sorts depends only on its own params, so its token never depends on its neighbours.

Log-probabilities (documented contract): ``log_softmax(logits / T)[token]`` over the full
vocabulary, i.e. the temperature-scaled policy before the top-k/top-p cut (what a trainer
recomputes from the same logits); greedy rows (``T == 0``) report ``log_softmax(logits)[token]``.
"""

from __future__ import annotations

import struct

import numpy as np
import torch

_MASK64 = (1 << 64) - 1
_RNG_MAGIC = b"GYR1"
_RNG_STRUCT = struct.Struct("<4sQQ")


def pack_rng_state(seed: int, counter: int) -> bytes:
    """Serialize a request's RNG state: its seed and how many draws it has made."""
    return _RNG_STRUCT.pack(_RNG_MAGIC, seed & _MASK64, counter)


def unpack_rng_state(state: bytes) -> tuple[int, int]:
    """Inverse of ``pack_rng_state``; ValueError on anything else."""
    if len(state) != _RNG_STRUCT.size:
        raise ValueError(f"rng_state must be {_RNG_STRUCT.size} bytes from this engine, got {len(state)}")
    magic, seed, counter = _RNG_STRUCT.unpack(state)
    if magic != _RNG_MAGIC:
        raise ValueError("rng_state was not produced by a Gyre torch engine (bad magic)")
    return int(seed), int(counter)


def counter_uniforms(seeds: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """float64[B] uniforms in [0, 1): splitmix64 of (seed, counter), vectorized over requests."""
    with np.errstate(over="ignore"):
        z = seeds.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + counters.astype(np.uint64)
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    # top 53 bits -> exactly representable double in [0, 1)
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row. logits [B, V] (any float dtype), params [B]; returns (int64[B], float32[B]).

    ``temperature == 0`` rows are greedy (argmax), others sample as in the module docstring.
    """
    logits = logits.float()
    bsz, vocab = logits.shape
    tokens = torch.empty(bsz, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(bsz, dtype=torch.float32, device=logits.device)

    greedy = temperature == 0
    if bool(greedy.any()):
        rows = greedy.nonzero(as_tuple=True)[0]
        lg = logits[rows]
        tok = lg.argmax(dim=-1)
        tokens[rows] = tok
        logprobs[rows] = torch.log_softmax(lg, dim=-1).gather(1, tok[:, None])[:, 0]

    sampled = ~greedy
    if bool(sampled.any()):
        cut = sampled & ((top_k > 0) & (top_k < vocab) | (top_p < 1.0))
        plain = sampled & ~cut
        for rows_mask, truncate in ((plain, False), (cut, True)):
            if not bool(rows_mask.any()):
                continue
            rows = rows_mask.nonzero(as_tuple=True)[0]
            scaled = logits[rows] / temperature[rows, None]
            logp = torch.log_softmax(scaled, dim=-1)
            u = uniforms[rows]
            if truncate:
                tok = _sample_truncated(logp, top_p[rows], top_k[rows], u)
            else:
                cdf = torch.cumsum(logp.double().exp(), dim=-1)
                tok = _inverse_cdf(cdf, u)
            tokens[rows] = tok
            logprobs[rows] = logp.gather(1, tok[:, None])[:, 0]
    return tokens, logprobs


def _inverse_cdf(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """First index whose cumulative mass exceeds u * total (per row), clamped into the support."""
    target = (u.double() * cdf[:, -1])[:, None]
    idx = torch.searchsorted(cdf, target, right=True)[:, 0]
    return idx.clamp_(max=cdf.shape[1] - 1)


def _sample_truncated(logp: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    vocab = logp.shape[1]
    sorted_logp, order = torch.sort(logp, dim=-1, descending=True, stable=True)
    probs = sorted_logp.double().exp()
    ranks = torch.arange(vocab, device=logp.device)[None, :]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)[:, None]
    keep = ranks < k
    probs = probs * keep
    # nucleus over the top-k survivors: keep a token while the mass before it is < top_p of their total
    before = torch.cumsum(probs, dim=-1) - probs
    keep = keep & (before < top_p.double()[:, None] * probs.sum(dim=-1, keepdim=True))
    keep[:, 0] = True
    cdf = torch.cumsum(probs * keep, dim=-1)
    pos = _inverse_cdf(cdf, u)
    # pos may land past the last kept rank only through rounding; pull it back into the support
    last_kept = keep.sum(dim=-1) - 1
    pos = torch.minimum(pos, last_kept)
    return order.gather(1, pos[:, None])[:, 0]


def top_logprobs(logits: torch.Tensor, temperatures: list[float],
                 ks: list[int]) -> list[tuple[np.ndarray, np.ndarray] | None]:
    """Per row with ``ks[row] > 0``: the ids and logprobs (int32[k], float32[k]) of its k most
    likely tokens under the distribution its token's own logprob is reported from
    (``log_softmax(logits / T)``; greedy rows: of the logits); None for the other rows."""
    out: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(ks)
    rows = [i for i, k in enumerate(ks) if k]
    if not rows:
        return out
    dev = logits.device
    t = torch.tensor([temperatures[i] or 1.0 for i in rows], dtype=torch.float32, device=dev)
    lp = torch.log_softmax(logits[torch.tensor(rows, device=dev)].float() / t[:, None], dim=-1)
    values, ids = lp.topk(max(ks[i] for i in rows), dim=-1)
    values_np, ids_np = values.cpu().numpy(), ids.cpu().numpy().astype(np.int32)
    for j, row in enumerate(rows):
        out[row] = (ids_np[j, : ks[row]], values_np[j, : ks[row]].astype(np.float32))
    return out
