"""Prometheus metrics of the trainer (``gyre_trainer_*``) and the per-step metrics record.

Per-step values (loss, grad norm, entropy, clip fraction, KL, tokens/s, step time...) are set as
gauges after each update and returned as a plain dict (``StepReport.metrics``) for logs, the run
report and ``WaitStep``. Staleness is a counter per bucket of "versions behind" (a histogram over
target tokens: prometheus' Histogram cannot observe a whole vector at once, and per-token
observe() calls would be a Python loop over tokens).
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from services.common.metrics import REGISTRY
from services.trainer.learner import STALENESS_LABELS

STEP_GAUGES: dict[str, Gauge] = {
    name: Gauge(f"gyre_trainer_{name}", doc, registry=REGISTRY)
    for name, doc in (
        ("loss", "Loss of the last step (mean over executions of the per-token loss)."),
        ("pg_loss", "Policy-gradient part of the last step's loss."),
        ("grad_norm", "Global gradient norm of the last step, before clipping."),
        ("lr", "Learning rate of the last step's update (after its warmup factor)."),
        ("entropy", "Mean token entropy of the last step."),
        ("clip_frac", "Fraction (weighted) of target tokens whose ratio was clipped, last step."),
        ("kl", "k3 KL against the reference (or behaviour) policy, last step (whatever kl_estimator the loss uses)."),
        ("mismatch_kl", "k3 KL between trainer and behaviour policy (engine mismatch + staleness)."),
        ("mismatch_kl_fresh", "k3 KL between trainer and engine on targets sampled by the weights trained: the "
                              "engine's own numerical mismatch, last step."),
        ("mismatch_kl_stale", "k3 KL between trainer and behaviour policy on targets sampled by older weights, "
                              "last step."),
        ("fresh_logp_dev_max", "Largest |trainer - engine| log-prob gap of a target sampled by the weights "
                               "trained, last step."),
        ("tis_trunc_frac", "Fraction (weighted) of targets whose TIS weight was truncated, last step."),
        ("tokens_per_s", "Packed tokens trained per second of step wall time, last step."),
        ("train_tokens_per_s", "The core's tokens trained per second of its training time (waits for rollouts "
                               "left out), last step."),
        ("compute_s_max", "Longest time one participant (core or replica) spent training its micro-batches, "
                          "last step, seconds."),
        ("step_time_s", "Wall time of the last step, seconds (first micro-batch to publish)."),
        ("world_size", "Replicas (core included) in the last step's all-reduce."),
        ("weight_version", "Latest published weight version."),
    )
}
STEPS = Counter("gyre_trainer_steps_total", "Optimizer updates applied.", registry=REGISTRY)
TOKENS = Counter("gyre_trainer_tokens_total", "Packed tokens trained (this process).", registry=REGISTRY)
MICRO_BATCHES = Counter("gyre_trainer_micro_batches_total", "Micro-batches trained (this process).",
                        registry=REGISTRY)
REJECTED = Counter("gyre_trainer_rejected_batches_total", "Micro-batches rejected as malformed.", ["reason"],
                   registry=REGISTRY)
STALENESS = Counter("gyre_trainer_target_tokens_total", "Target tokens trained, by staleness "
                    "(weight versions behind the trained policy).", ["staleness"], registry=REGISTRY)
STEP_TIME = Histogram("gyre_trainer_step_seconds", "Step wall time, seconds.", registry=REGISTRY,
                      buckets=(0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800))
PUBLISH_TIME = Histogram("gyre_trainer_publish_seconds", "Time to push a weight version to all engines.",
                         registry=REGISTRY, buckets=(0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 300))
REDUCE_TIME = Histogram("gyre_trainer_allreduce_seconds", "Gradient all-reduce time per step.",
                        registry=REGISTRY, buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 60))
EVICTED = Counter("gyre_trainer_evicted_replicas_total", "Replicas evicted from a step (no report in time).",
                  registry=REGISTRY)
HANDOFFS = Counter("gyre_trainer_handoffs_total", "Gradient sums of replicas that left mid-step, taken by the core, "
                   "by way: shared_memory (a replica on this host) or stream (gRPC).", ["via"], registry=REGISTRY)


def record_step(metrics: dict[str, float]) -> None:
    """Export one step's metrics dict (from ``CoreTrainer.run_step``)."""
    for name, gauge in STEP_GAUGES.items():
        if name in metrics:
            gauge.set(metrics[name])
    STEPS.inc()
    if "step_time_s" in metrics:
        STEP_TIME.observe(metrics["step_time_s"])
    for label in STALENESS_LABELS:
        count = metrics.get(f"staleness_{label}", 0.0)
        if count:
            STALENESS.labels(staleness=label).inc(count)
