"""Wire <-> domain conversions of the trainer (protobuf messages only; no grpc).

Light to import (no torch: the typed client uses it); building a job or a gradient dict imports
the torch modules that define them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from protos.gyre.v1 import common_pb2, trainer_pb2
from services.trainer.job import TrainerJob

if TYPE_CHECKING:
    import torch

    from services.algorithm import ObjectiveConfig


def _opt(msg: Any, name: str) -> Any:
    return getattr(msg, name) if msg.HasField(name) else None


def _coerce(value: str, current: Any, name: str) -> Any:
    try:
        if isinstance(current, bool):
            low = value.strip().lower()
            if low not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError
            return low in ("1", "true", "yes")
        if isinstance(current, int):
            return int(value)
        if isinstance(current, float) or current is None:
            return float(value)
        if isinstance(current, tuple):
            return tuple(p.strip() for p in value.split(",") if p.strip())
        return value
    except ValueError:
        raise ValueError(f"job option {name}={value!r} is not a valid {type(current).__name__}") from None


def _default(cls: type, name: str) -> Any:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    return f.default if f.default is not dataclasses.MISSING else ""


def job_from_proto(spec: trainer_pb2.TrainerJobSpec) -> TrainerJob:
    """TrainerJob from the wire; unset fields take the dataclass defaults, ``options`` apply last."""
    from services.trainer.learner import OptimConfig
    from services.algorithm import ObjectiveConfig

    o = spec.objective
    obj: dict[str, Any] = {k: v for k in ("eps_low", "eps_high", "tis_cap", "kl_coef", "entropy_coef", "dual_clip")
                           if (v := _opt(o, k)) is not None}
    if o.kl_estimator:
        obj["kl_estimator"] = o.kl_estimator
    p = spec.optim
    opt: dict[str, Any] = {k: v for k in ("lr", "weight_decay", "max_grad_norm", "warmup_steps", "min_lr_ratio", "eps")
                           if (v := _opt(p, k)) is not None}
    if p.schedule:
        opt["schedule"] = p.schedule
    opt["total_steps"] = spec.num_steps or 1
    if p.HasField("beta1") or p.HasField("beta2"):
        opt["betas"] = (p.beta1 if p.HasField("beta1") else 0.9, p.beta2 if p.HasField("beta2") else 0.999)
    job: dict[str, Any] = {
        "job_id": spec.job_id, "model": spec.model or "tiny", "source": spec.source or "trajectory",
        "trajectory_address": spec.trajectory_address, "engine_addresses": tuple(spec.engine_addresses),
        "scheduler_address": spec.scheduler_address, "num_steps": spec.num_steps or 1,
        "start_step": spec.start_step, "attention": spec.attention or "auto", "dtype": spec.dtype or "float32",
        "device": spec.device or "cpu", "seed": spec.seed, "checkpoint_dir": spec.checkpoint_dir,
        "checkpoint_every": spec.checkpoint_every or 1, "checkpoint_keep": spec.checkpoint_keep or 2,
        "resume": not spec.no_resume, "max_dense_tokens": spec.max_dense_tokens or 8192,
        "kl_reference": o.kl_reference or "behaviour", "shards": spec.shards or 1,
    }
    if o.HasField("temperature"):
        job["temperature"] = o.temperature
    # Opaque options (the scheduler's algorithm map): route each name to the config that has it.
    obj_fields = {f.name for f in dataclasses.fields(ObjectiveConfig)}
    opt_fields = {f.name for f in dataclasses.fields(OptimConfig)}
    job_fields = {f.name for f in dataclasses.fields(TrainerJob)} - {"objective", "optim"}
    defaults_obj, defaults_opt = ObjectiveConfig(), OptimConfig()
    for name, value in spec.options.items():
        if name in obj_fields:
            obj[name] = _coerce(value, getattr(defaults_obj, name), name)
        elif name in opt_fields:
            cur = getattr(defaults_opt, name)
            opt[name] = tuple(float(x) for x in value.split(",")) if name == "betas" else _coerce(value, cur, name)
        elif name in job_fields:
            job[name] = _coerce(value, job.get(name, _default(TrainerJob, name)), name)
        else:
            raise ValueError(f"unknown job option {name!r}")
    return TrainerJob(objective=ObjectiveConfig(**obj), optim=OptimConfig(**opt), **job)


def objective_params(o: ObjectiveConfig, *, temperature: float, kl_reference: str) -> trainer_pb2.ObjectiveParams:
    """The wire form of a loss (``job_from_proto`` reads it back): the trainer's own job spec and the
    scheduler's mapping of a job's ``[job.algorithm]`` both send it."""
    objective = trainer_pb2.ObjectiveParams(eps_low=o.eps_low, eps_high=o.eps_high, kl_coef=o.kl_coef,
                                            entropy_coef=o.entropy_coef, kl_reference=kl_reference,
                                            temperature=temperature, kl_estimator=o.kl_estimator)
    if o.tis_cap is not None:
        objective.tis_cap = o.tis_cap
    if o.dual_clip is not None:
        objective.dual_clip = o.dual_clip
    return objective


def job_to_proto(job: TrainerJob) -> trainer_pb2.TrainerJobSpec:
    o, p = job.objective, job.optim
    objective = objective_params(o, temperature=job.temperature, kl_reference=job.kl_reference)
    optim = trainer_pb2.OptimParams(lr=p.lr, beta1=p.betas[0], beta2=p.betas[1], weight_decay=p.weight_decay,
                                    max_grad_norm=p.max_grad_norm, warmup_steps=p.warmup_steps,
                                    schedule=p.schedule, min_lr_ratio=p.min_lr_ratio, eps=p.eps)
    return trainer_pb2.TrainerJobSpec(
        job_id=job.job_id, model=job.model, source=job.source, trajectory_address=job.trajectory_address,
        engine_addresses=list(job.engine_addresses), scheduler_address=job.scheduler_address,
        num_steps=job.num_steps, start_step=job.start_step, objective=objective, optim=optim,
        attention=job.attention, dtype=job.dtype, device=job.device, seed=job.seed,
        checkpoint_dir=job.checkpoint_dir, checkpoint_every=job.checkpoint_every,
        checkpoint_keep=job.checkpoint_keep, no_resume=not job.resume, max_dense_tokens=job.max_dense_tokens,
        shards=job.shards, options={"model_cache_dir": job.model_cache_dir,
                 "activation_checkpointing": str(job.activation_checkpointing).lower(),
                 "chunk_tokens": str(job.chunk_tokens)})


def chunk_to_dict(c: common_pb2.WeightChunk) -> dict[str, Any]:
    return {"version": c.version, "name": c.name, "dtype": c.dtype, "shape": tuple(c.shape), "data": c.data,
            "offset_bytes": c.offset_bytes, "total_bytes": c.total_bytes, "last": c.last}


def chunks_from_dicts(chunks: Iterable[Mapping[str, Any]]) -> Iterator[common_pb2.WeightChunk]:
    for c in chunks:
        yield common_pb2.WeightChunk(**c)


def gradients_from_stream(stream: Iterable[trainer_pb2.GradientChunk]) -> tuple[str, int, dict[str, torch.Tensor]]:
    """(replica_id, step, grads) from a HandOffGradients stream (ids taken from the first chunk)."""
    from services.trainer.weights import assemble

    head: dict[str, Any] = {}

    def chunks() -> Iterator[dict[str, Any]]:
        for g in stream:
            if not head:
                head.update(replica_id=g.replica_id, step=g.step)
            yield chunk_to_dict(g.chunk)

    _version, grads = assemble(chunks())
    if not head.get("replica_id"):
        raise ValueError("HandOffGradients: the first chunk must carry replica_id")
    return str(head["replica_id"]), int(head["step"]), grads


def replica_info(m: Mapping[str, Any], pid: int = 0) -> trainer_pb2.ReplicaInfo:
    return trainer_pb2.ReplicaInfo(replica_id=str(m["replica_id"]), cell_id=str(m["cell_id"]), step=int(m["step"]),
                                   done=bool(m["done"]), left=bool(m["left"]), evicted=bool(m["evicted"]),
                                   rank=int(m["rank"]), release=bool(m["release"]), pid=pid)


def step_report_to_proto(report: Any) -> trainer_pb2.StepReport:
    if report is None:
        return trainer_pb2.StepReport(finished=False)
    return trainer_pb2.StepReport(step=report.step, weight_version=report.version,
                                  metrics={k: float(v) for k, v in report.metrics.items()},
                                  participants=list(report.participants), finished=True)
