"""Sharded trainer groups (FSDP2 over gloo): N real rank processes train the step one process trains.

The rank processes are the ones the trainer service starts (``python -m services.trainer.group``);
the core is rank 0. Micro-batches of different depths train chunked (``chunk_tokens``), so the
ranks of a round run different numbers of forward pieces and pad to the longest, and the last round
of a step has fewer micro-batches than ranks.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from services.common.errors import InvalidArgument
from services.trainer.core import CoreTrainer
from services.trainer.job import TrainerJob

# 7 executions of 430 tokens in micro-batches of <= 900 tokens: three of two executions (four
# 256-token chunks each) and one of a single execution (two chunks)
SOURCE = "synthetic:seed=3,executions=7,tokens=900,depth=2,branching=2,context=30,generated=30,root=40"


def _train(tmp_path: Path, shards: int, *, steps: int = 2, **kw: Any) -> tuple[list[dict[str, float]],
                                                                               dict[str, torch.Tensor]]:
    core = CoreTrainer(rank_log_dir=str(tmp_path / "logs"))
    job = TrainerJob(job_id=f"g{shards}", model="tiny", source=SOURCE, num_steps=steps, shards=shards,
                     chunk_tokens=256, attention="blocks", seed=5, **kw)
    try:
        core.start(job)
        assert core.wait(600), "the job did not end"
        status = core.status()
        assert status["phase"] == "done", status["error"]
        return [r.metrics for r in core._require().reports], core.weights.get(-1)
    finally:
        core.stop()


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, float]], dict[str, torch.Tensor]]:
    """The same job trained by one process holding the whole model."""
    return _train(tmp_path_factory.mktemp("whole"), 1)


@pytest.mark.parametrize("shards", [2, 4])
def test_a_sharded_group_trains_what_one_process_trains(
        shards: int, whole: tuple[list[dict[str, float]], dict[str, torch.Tensor]], tmp_path: Path) -> None:
    ref_metrics, ref_weights = whole
    metrics, weights = _train(tmp_path, shards)
    assert len(metrics) == len(ref_metrics) == 2
    for got, ref in zip(metrics, ref_metrics):
        assert got["tokens"] == ref["tokens"] and got["micro_batches"] == ref["micro_batches"] == 4
        assert got["shards"] == shards and ref["shards"] == 1
        for name in ("loss", "grad_norm", "entropy", "clip_frac"):
            assert got[name] == pytest.approx(ref[name], rel=1e-4, abs=1e-7), name
        # every rank reported its peak resident set
        assert all(got[f"peak_rss_mib_rank{r}"] > 0 for r in range(shards))
    # two updates later the published weights (gathered from the shards) are the whole model's
    assert weights.keys() == ref_weights.keys()
    for name, value in ref_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-4, atol=1e-6, msg=name)


def test_each_rank_holds_a_shard_of_the_parameters_and_optimizer_state(tmp_path: Path) -> None:
    from torch.distributed.tensor import DTensor

    core = CoreTrainer(rank_log_dir=str(tmp_path / "logs"))
    job = TrainerJob(job_id="held", model="tiny", source=SOURCE, num_steps=1, shards=2, chunk_tokens=256)
    try:
        core.start(job, background=False)
        core.run_step()
        st = core._require()
        params = list(st.learner.model.parameters())
        assert params and all(isinstance(p, DTensor) for p in params)
        total = sum(p.numel() for p in params)
        local = sum(p.to_local().numel() for p in params)
        assert local <= total // 2 + 64 * len(params)  # half of every tensor (rows split over 2 ranks)
        moments = [s["exp_avg"] for s in st.updater.optimizer.state.values()]
        assert len(moments) == len(params)
        assert sum(m.to_local().numel() for m in moments) == local
    finally:
        core.stop()
    assert all(p.poll() is not None for p in st.group.procs)  # type: ignore[union-attr]


def test_a_rank_killed_mid_job_fails_the_job_with_one_sentence_never_a_hang(tmp_path: Path) -> None:
    core = CoreTrainer(rank_log_dir=str(tmp_path / "logs"), collective_timeout_s=120)
    job = TrainerJob(job_id="kill", model="tiny", source=SOURCE, num_steps=1000, shards=2, chunk_tokens=256)
    try:
        core.start(job)
        assert core.wait_step(0, 300) is not None
        group = core._require().group
        assert group is not None
        os.kill(group.procs[0].pid, signal.SIGKILL)
        assert core.wait(120), "the group's step hung after a rank died"
        status = core.status()
        assert status["phase"] == "failed"
        assert f"trainer rank 1 (pid {group.procs[0].pid}) died (signal 9)" in status["error"]
        assert all(p.poll() is not None for p in group.procs)
        # the next job forms a group of its own in the same process
        core.start(TrainerJob(job_id="after", model="tiny", source=SOURCE, num_steps=1, shards=2))
        assert core.wait(300) and core.status()["phase"] == "done"
    finally:
        core.stop()


def test_a_group_this_host_cannot_hold_is_refused_before_anything_starts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="shards must be >= 1"):
        TrainerJob(job_id="j", source=SOURCE, shards=0)
    core = CoreTrainer(rank_log_dir=str(tmp_path / "logs"))
    if not torch.cuda.is_available():
        with pytest.raises(InvalidArgument, match="needs 2 CUDA devices; this host has 0"):
            core.start(TrainerJob(job_id="j", source=SOURCE, shards=2, device="cuda"))
        assert core.status()["phase"] == "idle" and not (tmp_path / "logs").exists()  # nothing started


def _resume(tmp_path: Path, root: Path, shards: int, steps: int) -> tuple[list[dict[str, float]],
                                                                          dict[str, torch.Tensor]]:
    core = CoreTrainer(rank_log_dir=str(tmp_path / "logs"))
    job = TrainerJob(job_id="dcp", model="tiny", source=SOURCE, num_steps=steps, shards=shards, chunk_tokens=256,
                     attention="blocks", seed=5, checkpoint_dir=str(root))
    try:
        core.start(job, background=False)
        reports = []
        while core._require().step < steps:
            reports.append(core.run_step().metrics)
        return reports, core.weights.get(-1)
    finally:
        core.stop()


def test_a_checkpoint_saved_by_2_ranks_resumes_at_1_and_at_3(tmp_path: Path) -> None:
    import shutil

    straight, want = _resume(tmp_path, tmp_path / "straight", 1, 3)
    saved, _ = _resume(tmp_path, tmp_path / "two", 2, 2)                 # a DCP folder of 2 ranks' shards
    assert [round(m["loss"], 5) for m in saved] == [round(m["loss"], 5) for m in straight[:2]]
    files = sorted(p.name for p in (tmp_path / "two" / "step-000002" / "state").iterdir())
    assert files == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    shutil.copytree(tmp_path / "two", tmp_path / "two-again")
    for shards, root in ((1, tmp_path / "two"), (3, tmp_path / "two-again")):
        (third,), got = _resume(tmp_path, root, shards, 3)              # step 2 only, from the checkpoint
        assert third["loss"] == pytest.approx(straight[2]["loss"], rel=1e-4), shards
        assert third["grad_norm"] == pytest.approx(straight[2]["grad_norm"], rel=1e-4), shards
        # the update of step 2 used the loaded Adam moments: the weights after it are the straight run's
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-6, msg=f"{shards} ranks: {name}")


def test_a_checkpoint_of_another_model_is_one_sentence_and_changes_nothing(tmp_path: Path) -> None:
    _resume(tmp_path / "first", tmp_path / "ck", 2, 1)
    core = CoreTrainer(rank_log_dir=str(tmp_path / "logs"))
    job = TrainerJob(job_id="dcp", model="tiny:hidden=128", source=SOURCE, shards=2, checkpoint_dir=str(tmp_path / "ck"))
    with pytest.raises(InvalidArgument, match=r"is of another model: it holds 'lm_head.weight' of shape "
                                              r"\[512, 64\], this model's is \[512, 128\]"):
        core.start(job)
    assert core.status()["phase"] == "idle" and not list((tmp_path / "logs").glob("trainer-dcp-rank*"))
    assert sorted(p.name for p in (tmp_path / "ck").glob("step-*")) == ["step-000001"]
    core.stop()


def test_a_bf16_group_keeps_bf16_parameters_in_compute_and_matches_one_process(tmp_path: Path) -> None:
    """dtype bfloat16: the group's units gather bfloat16 parameters for forward and backward and
    reduce the gradients in fp32 (MixedPrecisionPolicy); the shards and AdamW stay fp32."""
    whole, _ = _train(tmp_path / "one", 1, dtype="bfloat16")
    group, _ = _train(tmp_path / "two", 2, dtype="bfloat16")
    for got, ref in zip(group, whole):
        assert got["loss"] == pytest.approx(ref["loss"], rel=2e-3, abs=1e-4)
