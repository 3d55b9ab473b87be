"""A job's learner: the policy model, its tree forward and the loss (the same on every trainer process:
the core, each rank of a sharded group, each replica)."""

from __future__ import annotations

import copy

import torch

from services.trainer.job import TrainerJob
from services.trainer.learner import Learner
from services.trainer.model import build_model
from services.trainer.tree_forward import TreePolicy


def build_learner(job: TrainerJob, device: str | torch.device, *, meta: bool = False) -> Learner:
    """Model + tree policy + learner for ``job`` (the same on the core and on every replica);
    ``meta``: the model's shapes only (a sharded group's rank > 0, given its shards by rank 0)."""
    model = build_model(job.model, dtype=torch.float32, device=device, seed=job.seed,
                        attention="flex" if job.attention == "flex" else "sdpa", model_cache_dir=job.model_cache_dir,
                        meta=meta)
    policy = TreePolicy(model, attention=job.attention, temperature=job.temperature,
                        max_dense_tokens=job.max_dense_tokens, checkpoint_layers=job.activation_checkpointing,
                        chunk_tokens=job.chunk_tokens)
    ref = None
    if job.kl_reference == "initial" and job.objective.kl_coef > 0:
        ref_model = copy.deepcopy(model).eval()
        for p in ref_model.parameters():
            p.requires_grad_(False)
        ref = TreePolicy(ref_model, attention=job.attention, temperature=job.temperature,
                         max_dense_tokens=job.max_dense_tokens)
    vocab = int(model.config.vocab_size)  # type: ignore[union-attr, arg-type]
    return Learner(policy, job.objective, vocab_size=vocab, ref_policy=ref, compute_dtype=job.torch_dtype)


__all__ = ["build_learner"]
