"""Trackers fed by a job's events: every step's figures land in TensorBoard, W&B (offline) and MLflow,
each read back with the library's own reader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.scheduler.jobs import Event
from services.tracking import StepFigures, Trackers, parse_loggers


def _events() -> list[Event]:
    n = iter(range(1_000_000))

    def ev(kind: str, ts: float, **attrs: object) -> Event:
        return Event(event_id=f"{next(n)}-0", kind=kind, ts_s=ts, job_id="job-1",
                     attrs={k: str(v) for k, v in attrs.items()})

    out = [ev("job_state", 0.0, state="running"),
           ev("metrics", 1.0, calls=10, prompt_tokens=1000, cached_tokens=600, output_tokens=200, max_context=300),
           ev("execution_completed", 2.0, execution_id="a", step=0, status="finished"),
           ev("execution_completed", 2.1, execution_id="b", step=0, status="timeout"),
           ev("execution_completed", 2.2, execution_id="e1", step=0, status="finished", evaluation=0),
           ev("switch_finished", 3.0, cell_id="c1", duration_ms=1500),
           ev("metrics", 3.5, calls=20, prompt_tokens=2000, cached_tokens=1500, output_tokens=450, max_context=400),
           ev("step_trained", 4.0, step=0, weight_version=1, **{"trainer.loss": 0.5, "trainer.entropy": 1.25,
                                                                "trainer.clip_frac": 0.0}),
           ev("evaluation", 5.0, round=1, after_step=0, pass_rate=0.25, mean_reward=0.4, tasks=4),
           ev("execution_completed", 6.0, execution_id="c", step=1, status="failed"),
           ev("step_trained", 7.0, step=1, weight_version=2, **{"trainer.loss": 0.25, "trainer.entropy": 1.0,
                                                                "trainer.clip_frac": 0.125})]
    return out


def test_step_figures_fold_events_into_each_steps_figures() -> None:
    figures = StepFigures()
    got = [x for ev in _events() for x in figures.add(ev)]
    assert [step for step, _ in got] == [0, 0, 1]
    step0, heldout, step1 = (f for _, f in got)
    assert step0["trainer/loss"] == 0.5 and step0["trainer/entropy"] == 1.25
    assert (step0["rollout/executions"], step0["rollout/timeout"], step0["rollout/failed"]) == (2, 1, 0)
    assert step0["cells/switches"] == 1 and step0["cells/switch_s"] == 1.5
    assert step0["rollout/prefix_reuse"] == 0.75 and step0["rollout/output_tok_s"] == pytest.approx(250 / 2.5)
    assert heldout == {"heldout/pass_rate": 0.25, "heldout/reward": 0.4, "heldout/tasks": 4}
    assert step1["trainer/clip_frac"] == 0.125 and step1["rollout/failed"] == 1 and step1["cells/switches"] == 0


def test_every_tracker_writes_what_its_own_reader_reads_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    trackers = Trackers.open("tensorboard,wandb,mlflow", tmp_path, job_id="job-1",
                             config={"mode": "elastic", "algorithm": {"learning_rate": 0.001}})
    for ev in _events():
        trackers.add(ev)
    trackers.close()
    assert trackers.logged == 3

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard" / "job-1"))
    acc.Reload()
    assert [(s.step, s.value) for s in acc.Scalars("trainer/loss")] == [(0, 0.5), (1, 0.25)]
    assert [(s.step, s.value) for s in acc.Scalars("heldout/pass_rate")] == [(0, 0.25)]

    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # what the tracker set for its file store
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("gyre").experiment_id])
    assert run.info.run_name == "job-1" and run.info.status == "FINISHED"
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "trainer.loss")] == [(0, 0.5),
                                                                                                      (1, 0.25)]
    assert run.data.params["algorithm.learning_rate"] == "0.001"

    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")  # offline: nothing left the machine
    history = [(int(row["_step"]), row) for row in _wandb_history(run_file)]
    assert [(step, row["trainer/loss"]) for step, row in history if "trainer/loss" in row] == [(0, 0.5), (1, 0.25)]
    assert [(step, row["heldout/pass_rate"]) for step, row in history if "heldout/pass_rate" in row] == [(0, 0.25)]


def _wandb_history(path: Path) -> list[dict[str, float]]:
    """The history rows of an offline W&B run file: W&B's own record messages (``wandb_internal_pb2``)
    in its append-only log (a 7-byte file header, 32 KiB blocks of records each behind a 7-byte
    header: CRC-32, length, type FULL / FIRST / MIDDLE / LAST)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, rows, pending = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the rest of a block too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            break
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(pending)
            if rec.WhichOneof("record_type") == "history":
                rows.append({("/".join(i.nested_key) or i.key): json.loads(i.value_json) for i in rec.history.item})
    return rows


def test_an_unknown_logger_is_one_sentence() -> None:
    assert parse_loggers(" TensorBoard, mlflow,tensorboard ") == ("tensorboard", "mlflow")
    with pytest.raises(ValueError, match="logger 'comet' is not one of tensorboard, wandb, mlflow"):
        parse_loggers("tensorboard,comet")


def test_gyre_watch_shows_the_last_steps_trainer_figures_and_a_sharded_groups_ranks() -> None:
    from services.jobwatch import JobView
    from services.progress import Progress

    view = JobView(job_id="job-1")
    for ev in _events():
        view.add(ev)
    assert view.last_training == {"loss": 0.25, "entropy": 1.0, "clip_frac": 0.125}
    view.add(Event(event_id="99-0", kind="step_trained", ts_s=9.0, job_id="job-1",
                   attrs={"step": "2", "weight_version": "3", "trainer.loss": "0.125", "trainer.tokens_per_s": "512",
                          "trainer.world_size": "3", "trainer.shards": "2", "trainer.peak_rss_mib_rank0": "8576.5",
                          "trainer.peak_rss_mib_rank1": "8715.6"}))
    line = Progress(scheduler=None, view=view, quiet=True, echo=lambda _m: None).line()
    assert "trainer: loss 0.1250, 512 tok/s, world 3, 2 ranks, peak RSS 8,576, 8,716 MiB" in line
