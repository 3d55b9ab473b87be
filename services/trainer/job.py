"""A training job as the trainer core runs it (``StartJob``), validated at construction.

Light to import (no torch), so clients and the scheduler can name jobs: the loss and optimizer
configs live beside the torch code that uses them and are imported when a job is built.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from services.trainer.learner import OptimConfig
    from services.algorithm import ObjectiveConfig

DTYPES: tuple[str, ...] = ("float32", "bfloat16")
"""Compute dtypes, by their torch names."""
_DEVICE = re.compile(r"(cpu|cuda|mps)(:\d+)?")


def _objective() -> ObjectiveConfig:
    from services.algorithm import ObjectiveConfig

    return ObjectiveConfig()


def _optim() -> OptimConfig:
    from services.trainer.learner import OptimConfig

    return OptimConfig()


@dataclass(frozen=True, kw_only=True)
class TrainerJob:
    """Everything the core (and, through JoinStep, every replica) needs to train a job."""

    job_id: str
    """Job id (scheduler's); prefixes store keys and checkpoints."""
    model: str = "tiny"
    """Model spec: 'tiny[:k=v]', 'qwen3-0.6b', a local model dir or config.json (services.trainer.model)."""
    model_cache_dir: str = ".gyre/models"
    """Where the 'builtin-tiny' model is built/cached (shared with the rollout engines)."""
    source: str = "trajectory"
    """Micro-batch source: 'trajectory' (the trajectory service) or 'synthetic:k=v,...'."""
    trajectory_address: str = ""
    """host:port of the trajectory service (source 'trajectory')."""
    engine_addresses: tuple[str, ...] = ()
    """Rollout engines that receive every new weight version (Engine.UpdateWeights)."""
    scheduler_address: str = ""
    """Scheduler to report step progress to (ReportTraining); empty = do not report."""
    num_steps: int = 1
    """Optimizer updates to run; the job ends after step num_steps - 1."""
    start_step: int = 0
    """First step (weights are version start_step); ignored when resuming from a checkpoint."""
    objective: ObjectiveConfig = field(default_factory=_objective)
    """Policy-gradient loss hyper-parameters."""
    optim: OptimConfig = field(default_factory=_optim)
    """AdamW hyper-parameters."""
    temperature: float = 1.0
    """Sampling temperature the engines used: trainer logits are divided by it."""
    kl_reference: str = "behaviour"
    """KL term reference: 'behaviour' (the rollout log-probs) or 'initial' (a frozen copy of the
    initial weights; costs one extra forward per micro-batch)."""
    attention: str = "auto"
    """Tree mask backend: 'sdpa' (dense, small N), 'flex' (BlockMask), 'blocks' (block-sparse, memory
    linear in tokens, any device) or 'auto' (CPU: blocks; CUDA: sdpa up to max_dense_tokens, then flex)."""
    dtype: str = "float32"
    """Compute dtype: 'float32', or 'bfloat16' (autocast forward; parameters, gradient sums, the
    all-reduce and the optimizer state stay fp32, so the update is as exact as fp32 allows)."""
    device: str = "cpu"
    """torch device of the core; replicas use their own (cuda if present)."""
    seed: int = 0
    """Seed of the random init (tiny / config models) and of torch's RNG."""
    checkpoint_dir: str = ""
    """Directory of atomic checkpoints; empty = no checkpoints."""
    checkpoint_every: int = 1
    """Save after every this many updates."""
    checkpoint_keep: int = 2
    """Complete checkpoints kept."""
    resume: bool = True
    """Resume from the latest complete checkpoint in checkpoint_dir if there is one."""
    max_dense_tokens: int = 8192
    """Largest micro-batch (tokens) the dense SDPA tree mask is used for ('auto' on CUDA; larger ones
    go flex); this bounds the mask's memory, not the batch."""

    chunk_tokens: int = 8192
    """Largest forward, in tokens, when a micro-batch trains in chunks with the exact gradient
    (keys/values of the earlier chunks kept, their gradients sent back; one more forward). A batch
    with the trajectory service's piece plan (a path deeper than the step's token budget) trains
    piece by piece, each piece cut further to this; a batch without a plan longer than this trains in
    chunks of about this many tokens. Activation memory follows the chunk, not the batch or the
    depth of its paths (0: no cap)."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward instead of keeping them (less
    memory per micro-batch token, about one more forward of compute)."""
    shards: int = 1
    """Ranks of the core's trainer group, which shard parameters, gradients and optimizer state
    (FSDP2): per-rank memory ~ 1/shards of the training state. 1: one process holds the whole
    model. CPU ranks share the host's cores; CUDA ranks take one device each from ``device`` on."""

    def __post_init__(self) -> None:
        if not self.job_id or "/" in self.job_id:
            raise ValueError(f"job_id must be non-empty and contain no '/', got {self.job_id!r}")
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        if self.start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {self.start_step}")
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature}")
        if self.kl_reference not in ("behaviour", "initial"):
            raise ValueError(f"kl_reference must be 'behaviour' or 'initial', got {self.kl_reference!r}")
        if self.attention not in ("auto", "sdpa", "flex", "blocks"):
            raise ValueError(f"attention must be 'auto', 'sdpa', 'flex' or 'blocks', got {self.attention!r}")
        if not _DEVICE.fullmatch(self.device):
            raise ValueError(f"device {self.device!r} is not a torch device ('cpu', 'cuda', 'cuda:1', 'mps')")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.checkpoint_every < 1 or self.checkpoint_keep < 1:
            raise ValueError("checkpoint_every and checkpoint_keep must be >= 1")
        if self.source == "trajectory" and not self.trajectory_address:
            raise ValueError("source 'trajectory' needs trajectory_address")
        if not (self.source == "trajectory" or self.source.startswith("synthetic")):
            raise ValueError(f"source must be 'trajectory' or 'synthetic:k=v,...', got {self.source!r}")
        if self.chunk_tokens < 0:
            raise ValueError(f"chunk_tokens must be >= 0 (0: never chunk), got {self.chunk_tokens}")
        if self.max_dense_tokens < 1:
            raise ValueError(f"max_dense_tokens must be >= 1, got {self.max_dense_tokens}")
        if self.shards < 1:
            raise ValueError(f"shards must be >= 1 (ranks of the trainer group), got {self.shards}")
        if self.shards > 1 and self.kl_reference == "initial" and self.objective.kl_coef > 0:
            raise ValueError("a KL term to the initial weights is not built yet for a sharded trainer group: use "
                             "kl_reference 'behaviour', or shards = 1")

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)  # DTYPES are torch attribute names
