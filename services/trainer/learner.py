"""Gradient accumulation over streamed micro-batches, and the optimizer update (core only).

Every replica (core included) runs a ``Learner``: for each micro-batch it validates the batch,
runs the tree-packed forward, and back-propagates loss = sum_i w_i * loss_i, so ``.grad`` holds
gradient *sums*. Because the trajectory service normalizes ``loss_weights`` over the whole step,
the sum over every micro-batch of the step (on every replica) is exactly the step loss, and the
all-reduce SUM of the replicas' gradients is exactly its gradient - whoever processed which batch.

Lifecycle per step:  begin_step(step, version) -> train(batch) x k -> flat buffer -> all-reduce
                     -> (core) Updater.apply() -> version + 1

Metrics ride in the same all-reduce: ``StepStats`` packs the objective's weighted sums, token
counts and the staleness histogram into one float64 vector appended to the gradient buckets.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from services.trainer.batch import PackedBatchLike, staleness, validate_batch
from services.algorithm import LR_SCHEDULES, SUM_METRICS, ObjectiveConfig, policy_loss
from services.trainer.tree_forward import TreePolicy, TreeTensors

# Staleness histogram buckets (versions behind): 0, 1, 2, 3, 4-7, 8+.
STALENESS_EDGES: tuple[int, ...] = (0, 1, 2, 3, 4, 8)
STALENESS_LABELS: tuple[str, ...] = ("0", "1", "2", "3", "4-7", "8+")
_COUNTS: tuple[str, ...] = ("tokens", "micro_batches")
# Names of the statistics tensors inside a gradient hand-off (not parameters).
STATS_KEY = "gyre.stats"
EXTREMA_KEY = "gyre.extrema"


@dataclass
class StepStats:
    """Additive statistics of a step (one replica's share until all-reduced)."""

    sums: dict[str, float] = field(default_factory=lambda: dict.fromkeys(SUM_METRICS, 0.0))
    counts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(_COUNTS, 0.0))
    staleness_hist: np.ndarray = field(default_factory=lambda: np.zeros(len(STALENESS_EDGES)))
    ratio_max: float = -math.inf
    ratio_min: float = math.inf
    fresh_logp_dev: float = 0.0  # largest |trainer - behaviour| log-prob gap of a fresh target
    # seconds this participant spent training its micro-batches; reduced with MAX, the step's
    # longest share: what the update's parallel compute took, whoever trained the batches
    compute_s: float = 0.0

    def vector(self) -> torch.Tensor:
        """The additive part as one float64 tensor (order fixed by SUM_METRICS/_COUNTS)."""
        vals = [self.sums[k] for k in SUM_METRICS] + [self.counts[k] for k in _COUNTS]
        return torch.tensor(vals + list(self.staleness_hist), dtype=torch.float64)

    def load_vector(self, vec: torch.Tensor) -> None:
        v = vec.tolist()
        ns, nc = len(SUM_METRICS), len(_COUNTS)
        self.sums = dict(zip(SUM_METRICS, v[:ns]))
        self.counts = dict(zip(_COUNTS, v[ns:ns + nc]))
        self.staleness_hist = np.asarray(v[ns + nc:])

    def extrema(self) -> torch.Tensor:
        """[max ratio, -min ratio, max fresh log-prob gap, compute seconds]: reduce with MAX."""
        return torch.tensor([self.ratio_max, -self.ratio_min, self.fresh_logp_dev, self.compute_s],
                            dtype=torch.float64)

    def merge(self, vec: torch.Tensor, extrema: torch.Tensor) -> None:
        """Add another replica's additive stats and extrema (a mid-step hand-off)."""
        self.load_vector(self.vector() + vec.to(torch.float64))
        self.load_extrema(torch.maximum(self.extrema(), extrema.to(torch.float64)))

    def load_extrema(self, vec: torch.Tensor) -> None:
        self.ratio_max, neg_min, self.fresh_logp_dev, self.compute_s = vec.tolist()
        self.ratio_min = -neg_min

    def add_extrema(self, ratio_max: float, ratio_min: float, fresh_logp_dev: float) -> None:
        self.ratio_max = max(self.ratio_max, ratio_max)
        self.ratio_min = min(self.ratio_min, ratio_min)
        self.fresh_logp_dev = max(self.fresh_logp_dev, fresh_logp_dev)

    def as_dict(self) -> dict[str, float]:
        """Step-level metrics: the weighted sums already are per-execution means (weights sum to 1)."""
        out = {k: float(v) for k, v in self.sums.items()}
        out.update({k: float(v) for k, v in self.counts.items()})
        out["ratio_max"] = self.ratio_max
        out["ratio_min"] = self.ratio_min
        # the mismatch split: fresh targets (sampled by the weights trained) show the engine's own
        # numerical gap to the trainer; stale ones add the policy's change since they were sampled
        fw, fresh_kl = out.pop("fresh_weight"), out.pop("mismatch_kl_fresh")
        sw = out["weight_sum"] - fw
        out["mismatch_kl_fresh"] = fresh_kl / fw if fw > 0 else 0.0
        out["mismatch_kl_stale"] = (out["mismatch_kl"] - fresh_kl) / sw if sw > 1e-12 else 0.0
        out["fresh_logp_dev_max"] = self.fresh_logp_dev
        out["compute_s_max"] = self.compute_s
        total = float(self.staleness_hist.sum())
        for label, c in zip(STALENESS_LABELS, self.staleness_hist):
            out[f"staleness_{label}"] = float(c)
        out["staleness_mean_frac_fresh"] = float(self.staleness_hist[0] / total) if total else 1.0
        return out


def staleness_counts(values: np.ndarray) -> np.ndarray:
    """Histogram of staleness values over STALENESS_EDGES (vectorized)."""
    bucket = np.searchsorted(np.asarray(STALENESS_EDGES), np.asarray(values), side="right") - 1
    return np.bincount(np.clip(bucket, 0, len(STALENESS_EDGES) - 1), minlength=len(STALENESS_EDGES)).astype(float)


class MicroBatchAborted(Exception):
    """A micro-batch's forward given up before its commit: the learner's abort event was set (the
    replica's cell is wanted back). Nothing was added to the gradient sums or the statistics."""


class Learner:
    """Forward/backward over micro-batches with gradient-sum accumulation (no optimizer)."""

    def __init__(self, policy: TreePolicy, objective: ObjectiveConfig, *, vocab_size: int,
                 ref_policy: TreePolicy | None = None, compute_dtype: torch.dtype = torch.float32) -> None:
        self.policy = policy
        self.model = policy.model
        self.objective = objective
        self.vocab_size = vocab_size
        self.ref_policy = ref_policy
        self.compute_dtype = compute_dtype
        self.step = -1
        self.version = 0
        self.stats = StepStats()
        self._abort: threading.Event | None = None
        self._armed = False  # the abort may cut the running forward (until the batch's commit)
        self._hooked = False

    def abort_on(self, event: threading.Event | None) -> None:
        """Give up a micro-batch's forward at its next decoder layer once ``event`` is set (a replica
        whose cell is wanted back): ``train`` raises ``MicroBatchAborted``. Only before the batch's
        commit: once acknowledged, a batch is trained to its end (a backward, where checkpointed
        layers run their forward again, is never cut). None: never abort."""
        self._abort = event
        if event is None or self._hooked:
            return

        def check(module: torch.nn.Module, args: Any) -> None:
            abort = self._abort
            if self._armed and abort is not None and abort.is_set():
                raise MicroBatchAborted("micro-batch given up: the replica's cell is wanted back")

        for mod in self.model.modules():
            if isinstance(mod, torch.nn.ModuleList):
                for layer in mod:
                    layer.register_forward_pre_hook(check)
        self._hooked = True

    def _committing(self, commit: Callable[[], bool] | None) -> Callable[[], bool]:
        """``commit`` that first disarms the abort (the batch is trained to its end once acked)."""
        def run() -> bool:
            self._armed = False
            return commit() if commit is not None else True
        return run

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def begin_step(self, step: int, version: int) -> None:
        """Zero the gradient sums and statistics for ``step`` (weights are ``version``)."""
        self.step = step
        self.version = version
        self.stats = StepStats()
        for p in self.params:
            p.grad = torch.zeros_like(p, memory_format=torch.preserve_format)

    def check(self, batch: PackedBatchLike) -> None:
        """Validate a micro-batch for this step (raises InvalidArgument / FailedPrecondition)."""
        validate_batch(batch, vocab_size=self.vocab_size, step=self.step, current_version=self.version)

    def train(self, batch: PackedBatchLike, commit: Callable[[], bool] | None = None) -> bool:
        """Accumulate one micro-batch's gradient sum; False if ``commit`` refused it.

        ``commit`` (the work queue's ack) runs after the forward and before the backward: a batch
        the queue has meanwhile handed to another consumer (a late ack is refused) is discarded
        without ever touching the gradient sums or the statistics. Raises ``MicroBatchAborted``
        when the ``abort_on`` event is set before the commit (the forward stops at its next layer).
        """
        self.check(batch)
        start = time.perf_counter()
        t = TreeTensors.from_batch(batch, self.policy.device)
        self.model.train()
        self._armed = self._abort is not None
        commit = self._committing(commit)
        try:
            return self._train(batch, t, commit)
        finally:  # this participant's share of the step's compute, refused or aborted forwards too
            self._armed = False
            self.stats.compute_s += time.perf_counter() - start

    def train_in_round(self, batch: PackedBatchLike | None, forwards: int) -> bool:
        """This rank's part of a round of a sharded group (services.trainer.group): every rank runs
        ``forwards`` forward pieces (the most any rank's batch of the round needs) in each pass, its
        own batch's and padding (``TreePolicy.pad``; all of it without a batch), so the ranks issue
        the same collectives. The batch was validated and acknowledged by rank 0. True if trained."""
        start = time.perf_counter()
        self.model.train()
        try:
            if batch is None:
                self.policy.pad(forwards=forwards if forwards > 1 else 0, backwards=forwards)
                return False
            self.check(batch)
            t = TreeTensors.from_batch(batch, self.policy.device)
            if forwards == 1:
                assert not self.policy.chunked(t), "a chunked batch in a round of one forward"
                return self._train(batch, t, lambda: True)
            return self._train_chunked(batch, t, None, pad_to=forwards)
        finally:
            self.stats.compute_s += time.perf_counter() - start

    def _train(self, batch: PackedBatchLike, t: TreeTensors, commit: Callable[[], bool]) -> bool:
        device_type = self.policy.device.type
        if self.policy.chunked(t):
            return self._train_chunked(batch, t, commit)
        with torch.autocast(device_type, dtype=self.compute_dtype, enabled=self.compute_dtype != torch.float32):
            logp, ent = self.policy.target_logprobs(t)
            ref = None
            if self.ref_policy is not None:
                with torch.no_grad():
                    ref, _ = self.ref_policy.target_logprobs(t)
        out = policy_loss(logp, t.old_logprobs, t.advantages, t.loss_weights, config=self.objective,
                          entropy=ent, ref_logprobs=ref, fresh=t.weight_version == self.version)
        if not commit():
            return False
        out.loss.backward()
        s = self.stats
        for k, v in out.sums.items():
            s.sums[k] += float(v)
        s.counts["tokens"] += t.num_tokens
        s.counts["micro_batches"] += 1
        s.staleness_hist = s.staleness_hist + staleness_counts(staleness(batch, self.version))
        s.add_extrema(float(out.ratio_max), float(out.ratio_min), float(out.fresh_logp_dev))
        return True

    def _train_chunked(self, batch: PackedBatchLike, t: TreeTensors, commit: Callable[[], bool] | None,
                       pad_to: int = 0) -> bool:
        """``train`` for a batch longer than the policy's ``chunk_tokens``: the same gradient sum and
        statistics, one chunk's activations at a time (``TreePolicy.train_chunked``)."""
        device_type = self.policy.device.type
        autocast = dict(dtype=self.compute_dtype, enabled=self.compute_dtype != torch.float32)
        ref = None
        if self.ref_policy is not None:
            with torch.no_grad(), torch.autocast(device_type, **autocast):  # type: ignore[arg-type]
                ref, _ = self.ref_policy.target_logprobs(t)  # no graph: activations of one layer at a time
        sums: dict[str, float] = {}
        extrema = [-math.inf, math.inf, 0.0]
        fresh = t.weight_version == self.version

        def loss_of(lp: torch.Tensor, ent: torch.Tensor, sel: torch.Tensor) -> torch.Tensor:
            out = policy_loss(lp, t.old_logprobs[sel], t.advantages[sel], t.loss_weights[sel], config=self.objective,
                              entropy=ent, ref_logprobs=None if ref is None else ref[sel], fresh=fresh[sel])
            for k, v in out.sums.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            extrema[0], extrema[1] = max(extrema[0], float(out.ratio_max)), min(extrema[1], float(out.ratio_min))
            extrema[2] = max(extrema[2], float(out.fresh_logp_dev))
            return out.loss

        with torch.autocast(device_type, **autocast):  # type: ignore[arg-type]
            done = self.policy.train_chunked(t, loss_of, before_backward=commit, pad_to=pad_to)
        if done is None:
            return False
        s = self.stats
        for k, v in sums.items():
            s.sums[k] += v
        s.counts["tokens"] += t.num_tokens
        s.counts["micro_batches"] += 1
        s.staleness_hist = s.staleness_hist + staleness_counts(staleness(batch, self.version))
        s.add_extrema(*extrema)
        return True

    # -- gradient buffers for the all-reduce ------------------------------------------------------
    def grad_buckets(self, bucket_bytes: int = 64 << 20) -> Iterator[list[torch.Tensor]]:
        """The gradient sums grouped into buckets of about ``bucket_bytes``, for the step's all-reduce;
        a sharded model's are this rank's shards (what the same rank of another group holds too)."""
        bucket: list[torch.Tensor] = []
        size = 0
        for p in self.params:
            assert p.grad is not None, "begin_step gives every parameter a gradient"
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            bucket.append(grad)
            size += grad.numel() * grad.element_size()
            if size >= bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket

    def add_grads(self, grads: dict[str, torch.Tensor]) -> None:
        """Add a gradient sum handed off by a replica that left mid-step (by parameter name)."""
        named = dict(self.model.named_parameters())
        unknown = set(grads) - set(named)
        if unknown:
            raise ValueError(f"handed-off gradients name unknown parameters: {sorted(unknown)[:3]}")
        for name, g in grads.items():
            p = named[name]
            if g.shape != p.shape:
                raise ValueError(f"handed-off gradient {name} has shape {tuple(g.shape)}, expected {tuple(p.shape)}")
            assert p.grad is not None
            p.grad.add_(g.to(p.grad.device, p.grad.dtype))

    def grads_by_name(self) -> dict[str, torch.Tensor]:
        return {n: p.grad for n, p in self.model.named_parameters() if p.grad is not None}

    def handoff_state(self) -> dict[str, torch.Tensor]:
        """Gradient sums plus the step statistics, for handing this replica's share to the core."""
        return {**self.grads_by_name(), STATS_KEY: self.stats.vector(), EXTREMA_KEY: self.stats.extrema()}


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW hyper-parameters of the core's optimizer."""

    lr: float = 1e-5
    """Learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    eps: float = 1e-8
    """Adam epsilon."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0 = no clipping)."""
    warmup_steps: int = 0
    """Linear learning-rate warmup: step s < N uses lr * (s + 1) / (N + 1) (0 = none)."""
    schedule: str = "constant"
    """After the warmup: ``"constant"`` (lr) or ``"cosine"`` (a half cosine from lr at step N down to
    lr * min_lr_ratio at step total_steps - 1, the job's last)."""
    min_lr_ratio: float = 0.1
    """The cosine schedule's floor as a fraction of lr."""
    total_steps: int = 1
    """The job's step count, the cosine's horizon (the trainer sets it from the job's num_steps)."""

    def __post_init__(self) -> None:
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr}")
        if not all(0 <= b < 1 for b in self.betas) or len(self.betas) != 2:
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas}")
        if self.weight_decay < 0 or self.eps <= 0 or self.max_grad_norm < 0:
            raise ValueError("weight_decay and max_grad_norm must be >= 0 and eps > 0")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.schedule not in LR_SCHEDULES:
            raise ValueError(f"lr schedule {self.schedule!r} is not one of {', '.join(LR_SCHEDULES)}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {self.total_steps}")

    def lr_at(self, step: int) -> float:
        """The learning rate of the update that ends job step ``step`` (0-based; < 0: the full rate)."""
        n = self.warmup_steps
        if step < 0:
            return self.lr
        if step < n:
            return self.lr * (step + 1) / (n + 1)
        if self.schedule == "constant":
            return self.lr
        span = self.total_steps - 1 - n
        progress = min(1.0, (step - n) / span) if span > 0 else 0.0
        r = self.min_lr_ratio
        return self.lr * (r + (1.0 - r) * 0.5 * (1.0 + math.cos(math.pi * progress)))


class Updater:
    """The core's optimizer: applies the reduced gradient sums once per step."""

    def __init__(self, model: torch.nn.Module, config: OptimConfig) -> None:
        self.model = model
        self.config = config
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad], lr=config.lr, betas=config.betas,
            eps=config.eps, weight_decay=config.weight_decay, foreach=False)

    def apply(self, step: int = -1) -> float:
        """Clip, step, zero; returns the pre-clip global gradient norm. ``step``: the job step the
        update ends (the learning rate's warmup counts job steps, so a resumed job goes on where it
        was; -1: the full rate)."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.config.lr_at(step)
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.config.max_grad_norm if self.config.max_grad_norm > 0 else math.inf
        total = torch.nn.utils.clip_grad_norm_(params, max_norm)
        # a sharded group's gradients are DTensors: the norm is one too, over every rank's shards
        full_tensor = getattr(total, "full_tensor", None)
        norm = float(full_tensor() if full_tensor is not None else total)
        if not math.isfinite(norm):
            # A non-finite gradient would poison the weights; skip the update, keep the version.
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"gradient norm is {norm}; update skipped")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm
