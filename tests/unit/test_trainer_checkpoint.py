"""Checkpoints: exact resume, and a process killed mid-save never damages the last good one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from services.trainer import checkpoint as ckpt
from services.trainer.core import CoreTrainer
from services.trainer.job import TrainerJob

REPO = Path(__file__).resolve().parents[2]
SOURCE = "synthetic:seed=4,executions=4,tokens=120,depth=1,branching=2"


def _job(ckpt_dir: str, num_steps: int) -> TrainerJob:
    return TrainerJob(job_id="ck", model="tiny", source=SOURCE, num_steps=num_steps, checkpoint_dir=ckpt_dir,
                      seed=11)


def _run(job: TrainerJob) -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
    core = CoreTrainer()
    core.start(job, background=False)
    reports = []
    while core._require().step < job.num_steps:
        reports.append(core.run_step().metrics)
    state = {k: v.detach().clone() for k, v in core.model().state_dict().items()}
    opt = core._require().updater.optimizer.state_dict()
    state.update({f"opt.{i}.{k}": v.clone() for i, s in opt["state"].items() for k, v in s.items()
                  if isinstance(v, torch.Tensor)})
    return state, reports


def test_resume_is_exact(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    straight, straight_metrics = _run(_job(str(tmp_path / "a"), 4))
    _run(_job(str(tmp_path / "b"), 2))                       # train 2 steps, checkpoint each
    latest = ckpt.latest_checkpoint(tmp_path / "b")
    assert latest is not None and latest.name == "step-000002"
    torch.manual_seed(12345)                                  # the checkpoint must restore the RNG
    resumed, resumed_metrics = _run(_job(str(tmp_path / "b"), 4))  # resume at step 2, train 2 more
    assert len(resumed_metrics) == 2
    assert straight.keys() == resumed.keys()
    for name, t in straight.items():
        assert torch.equal(t, resumed[name]), name           # bitwise: same ops in the same order
    for a, b in zip(straight_metrics[2:], resumed_metrics):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    assert [p.name for p in ckpt.complete_checkpoints(tmp_path / "b")] == ["step-000003", "step-000004"]


_SAVER = textwrap.dedent("""
    import sys, torch
    from services.trainer import checkpoint as ckpt
    root = sys.argv[1]
    model = torch.nn.Linear(1024, 2048)                 # ~8 MiB of weights, ~24 MiB per checkpoint
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 1024)).sum().backward()
    opt.step()
    version = 1
    while True:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(version))
        ckpt.save_checkpoint(root, step=version, version=version, model=model, optimizer=opt,
                             extra={"version": version})
        print(version, flush=True)
        version += 1
""")


def test_kill_during_save_never_corrupts_last_good(tmp_path: Path) -> None:
    root = tmp_path / "ck"
    interrupted = 0
    for attempt in range(5):
        proc = subprocess.Popen([sys.executable, "-c", _SAVER, str(root)], cwd=REPO, stdout=subprocess.PIPE,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        assert proc.stdout is not None
        proc.stdout.readline()                          # at least one complete checkpoint exists
        time.sleep(0.05 + 0.07 * attempt)               # then kill it at varying points of a save
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        interrupted += any(root.glob(".tmp-step-*"))
        latest = ckpt.latest_checkpoint(root)
        assert latest is not None
        c = ckpt.load_checkpoint(latest, restore_rng=False)
        v = c.version
        assert c.extra == {"version": v} and c.step == v
        assert all(torch.equal(t, torch.full_like(t, float(v))) for t in ckpt.load_weights(latest).values())
        model = torch.nn.Linear(1024, 2048)
        opt = torch.optim.AdamW(model.parameters())
        ckpt.load_into(latest, model, opt)
        assert all(torch.equal(p, torch.full_like(p, float(v))) for p in model.parameters())
        assert len(opt.state) == 2 and all(int(s["step"]) == 1 for s in opt.state.values())
        ckpt.prune_checkpoints(root, keep=1)            # removes the dead saver's tmp dir
        assert not any(root.glob(".tmp-step-*"))
        if interrupted and attempt >= 1:
            break
    assert interrupted >= 1, "no kill landed inside a save; the test did not exercise the crash path"


def test_damaged_latest_falls_back(tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    ckpt.save_checkpoint(tmp_path, step=1, version=1, model=model, optimizer=opt)
    second = ckpt.save_checkpoint(tmp_path, step=2, version=2, model=model, optimizer=opt)
    (second / "state" / "__0_0.distcp").write_bytes(b"garbage")   # torn write of the newest one
    latest = ckpt.latest_checkpoint(tmp_path)
    assert latest is not None and latest.name == "step-000001"
    with pytest.raises(ValueError, match="incomplete or damaged"):
        ckpt.load_checkpoint(second)
    manifest = json.loads((latest / "COMPLETE").read_text())
    assert set(manifest) == {"state/.metadata", "state/__0_0.distcp", "rng.safetensors", "state.json"}
