"""Experiment trackers fed by a job's event log: TensorBoard, Weights & Biases, MLflow.

Every figure a job produces is a job event first (``WatchJob``); a tracker is one more consumer of
that stream, for ``gyre run --logger ...`` and ``gyre watch JOB --logger ...`` alike, so a job
somebody else submitted can be tracked from any machine that reaches its scheduler::

    trackers = Trackers.open("tensorboard,wandb,mlflow", out_dir, job_id=..., config=spec.to_dict())
    for event in follow(scheduler, view):
        trackers.add(event)          # StepFigures folds it; a finished step or evaluation is logged
    trackers.close()

What is logged, at the step it belongs to (``StepFigures``): the trainer's figures of each update
(``trainer/loss``, ``trainer/entropy``, ``trainer/mismatch_kl``, ``trainer/clip_frac``,
``trainer/tokens_per_s``, ... as the step_trained event carries them), the step's executions by
how they ended (``rollout/executions``, ``rollout/timeout``, ``rollout/failed``), role
switches since the last step (``cells/switches``, ``cells/switch_s``), the gateway's model calls
(``rollout/prefix_reuse``, ``rollout/output_tok_s``) and held-out evaluations
(``heldout/pass_rate``, ``heldout/reward``, at the step after which they ran).

Where it goes: TensorBoard event files in ``<out>/tensorboard``; W&B offline in ``<out>/wandb``
unless the user's own ``WANDB_MODE`` says otherwise (nothing leaves the machine by default);
MLflow's file store ``<out>/mlruns`` unless ``MLFLOW_TRACKING_URI`` names another.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from services.common.logging import get_logger

log = get_logger(__name__)

LOGGERS = ("tensorboard", "wandb", "mlflow")


def parse_loggers(spec: str) -> tuple[str, ...]:
    """``"tensorboard,wandb"`` -> the tracker names, in order, once each; ValueError in one sentence."""
    names = tuple(dict.fromkeys(x.strip().lower() for x in spec.split(",") if x.strip()))
    unknown = [n for n in names if n not in LOGGERS]
    if unknown:
        raise ValueError(f"logger {unknown[0]!r} is not one of {', '.join(LOGGERS)}")
    return names


class StepFigures:
    """Folds a job's events into per-step figures: ``add(event)`` returns what became final with
    it, as ``[(step, {name: value})]`` (a published step, an evaluation round), else ``[]``."""

    def __init__(self) -> None:
        self._rollout: dict[int, list[str]] = {}  # step -> end statuses of its executions
        self._switches: list[float] = []  # durations of the switches since the last published step
        self._usage: tuple[float, Mapping[str, str]] | None = None
        self._usage_before: tuple[float, Mapping[str, str]] | None = None

    def add(self, ev: Any) -> list[tuple[int, dict[str, float]]]:
        a = ev.attrs
        kind = ev.kind
        if kind == "execution_completed" and not a.get("evaluation"):
            self._rollout.setdefault(int(a.get("step", -1)), []).append(str(a.get("status", "")))
        elif kind == "switch_finished":
            self._switches.append(float(a.get("duration_ms", 0) or 0) / 1000.0)
        elif kind == "metrics" and "calls" in a:
            self._usage_before, self._usage = self._usage, (ev.ts_s, dict(a))
        elif kind == "step_trained":
            return [(int(a["step"]), self._step(int(a["step"]), a))]
        elif kind == "evaluation":
            figures = {"heldout/pass_rate": _float(a.get("pass_rate")), "heldout/reward": _float(a.get("mean_reward")),
                       "heldout/tasks": _float(a.get("tasks"))}
            return [(int(a["after_step"]), {k: v for k, v in figures.items() if v is not None})]
        return []

    def _step(self, step: int, a: Mapping[str, str]) -> dict[str, float]:
        out: dict[str, float] = {}
        for key, value in a.items():
            if key.startswith("trainer."):
                v = _float(value)
                if v is not None:
                    out[f"trainer/{key[len('trainer.'):]}"] = v
        statuses = self._rollout.pop(step, [])
        out["rollout/executions"] = float(len(statuses))
        for status in ("timeout", "failed"):
            out[f"rollout/{status}"] = float(statuses.count(status))
        out["cells/switches"] = float(len(self._switches))
        out["cells/switch_s"] = sum(self._switches)
        self._switches = []
        if self._usage is not None:
            at, u = self._usage
            prompt, cached = _float(u.get("prompt_tokens")) or 0.0, _float(u.get("cached_tokens")) or 0.0
            out["rollout/calls"] = _float(u.get("calls")) or 0.0
            out["rollout/prefix_reuse"] = cached / prompt if prompt else 0.0
            out["rollout/max_context"] = _float(u.get("max_context")) or 0.0
            if self._usage_before is not None and at > self._usage_before[0]:
                before = _float(self._usage_before[1].get("output_tokens")) or 0.0
                out["rollout/output_tok_s"] = ((_float(u.get("output_tokens")) or 0.0) - before) / (
                    at - self._usage_before[0])
        return out


def _float(value: Any) -> float | None:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


class Tracker(Protocol):
    def log(self, step: int, figures: Mapping[str, float]) -> None: ...
    def close(self) -> None: ...


class TensorBoardTracker:
    """Scalars into TensorBoard event files (``torch.utils.tensorboard``)."""

    def __init__(self, out: Path, *, job_id: str, config: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.dir = out / "tensorboard" / job_id
        self.writer = SummaryWriter(log_dir=str(self.dir))
        self.writer.add_text("job", "\n".join(f"    {k}: {v}" for k, v in sorted(_flat(config).items())), 0)

    def log(self, step: int, figures: Mapping[str, float]) -> None:
        for name, value in figures.items():
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    """A W&B run, offline unless the user's WANDB_MODE says otherwise."""

    def __init__(self, out: Path, *, job_id: str, config: Mapping[str, Any]) -> None:
        import wandb

        (out / "wandb").mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "gyre"), name=job_id, id=_wandb_id(job_id),
                              dir=str(out), mode=os.environ.get("WANDB_MODE", "offline"),  # type: ignore[arg-type]
                              config=_flat(config), resume="allow", reinit="create_new")

    def log(self, step: int, figures: Mapping[str, float]) -> None:
        self.run.log(dict(figures), step=step)

    def close(self) -> None:
        self.run.finish()


def _wandb_id(job_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in job_id)[:64]


class MlflowTracker:
    """An MLflow run in experiment "gyre" (a file store under ``out`` unless MLFLOW_TRACKING_URI is set)."""

    def __init__(self, out: Path, *, job_id: str, config: Mapping[str, Any]) -> None:
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI", "")
        if not uri:
            # MLflow's file store: no server, no database library; MLflow 3 asks for the opt-in
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (out / "mlruns").resolve().as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name("gyre")
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment("gyre")
        self.run_id = self.client.create_run(experiment_id, run_name=job_id, tags={"gyre.job_id": job_id}).info.run_id
        from mlflow.entities import Param

        params = [Param(k[:250], str(v)[:500]) for k, v in sorted(_flat(config).items())[:100]]  # MLflow caps a batch
        self.client.log_batch(self.run_id, params=params)

    def log(self, step: int, figures: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key=name.replace("/", "."), value=value, timestamp=now, step=step)
                   for name, value in figures.items()]
        for i in range(0, len(metrics), 500):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 500])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flat(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in config.items():
        if isinstance(v, Mapping):
            out.update(_flat(v, f"{prefix}{k}."))
        elif isinstance(v, (list, tuple)) and len(v) > 8:
            out[f"{prefix}{k}"] = f"[{len(v)} items]"
        else:
            out[f"{prefix}{k}"] = v
    return out


_TRACKERS: dict[str, Any] = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker, "mlflow": MlflowTracker}


class Trackers:
    """The trackers a command logs to, fed the job's events (``add``). Lifecycle: ``open`` ->
    ``add(event)`` for each event -> ``close()``. A tracker that fails to start or to log is reported
    once and dropped: tracking never stops the job or the command watching it."""

    def __init__(self, trackers: Sequence[tuple[str, Tracker]]) -> None:
        self.trackers = list(trackers)
        self.figures = StepFigures()
        self.logged = 0  # (step, figures) points written

    @classmethod
    def open(cls, spec: str, out_dir: str | Path, *, job_id: str, config: Mapping[str, Any]) -> "Trackers":
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        names = parse_loggers(spec)  # an unknown name: ValueError before anything opens
        opened: list[tuple[str, Tracker]] = []
        for name in names:
            try:
                opened.append((name, _TRACKERS[name](out, job_id=job_id, config=config)))
            except Exception as exc:  # deliberate: a tracker that cannot start leaves the job and the others be
                log.error("tracker could not start; the job goes on without it", tracker=name, error=str(exc))
        return cls(opened)

    def add(self, ev: Any) -> None:
        for step, figures in self.figures.add(ev):
            if not figures:
                continue
            self.logged += 1
            for name, tracker in list(self.trackers):
                try:
                    tracker.log(step, figures)
                except Exception as exc:  # deliberate: a tracker's failure must not stop the job's watch
                    log.error("tracker failed; no more figures go to it", tracker=name, error=str(exc))
                    self.trackers.remove((name, tracker))

    def close(self) -> None:
        for name, tracker in self.trackers:
            try:
                tracker.close()
            except Exception as exc:  # deliberate: closing the others matters more
                log.error("closing a tracker failed", tracker=name, error=str(exc))
        self.trackers = []
