"""Gyre as a service: a `gyre up` stack trains jobs that clients submit through the scheduler's API.

Everything here goes through what a user has: the `gyre` command (up, submit, watch, jobs, cancel,
report, status, down) as processes, a client built only from grpcio and stubs generated from
protos/ (tests/support/proto_only_client.py, no Gyre package), and the example external harness
(examples/openai_harness.py, the official openai client) for a job whose executions an external
harness runs. The scheduler alone drives each job: steps, trainer, reward, evaluations.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cli import gyre
from tests.support.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
SMALL = ["--num_steps", "2", "--groups_per_step", "2", "--group_size", "2", "--execution_timeout_s", "60",
         "--tasks.params.num_modules", "2", "--tasks.params.long_pct", "0", "--evaluation.tasks", "2", "--evaluation.every", "1"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    data = tmp_path_factory.mktemp("stack")
    gyre(data, "up", "--engines", "2", "--harness-concurrency", "8")
    try:
        yield data
    finally:
        gyre(data, "down", check=False)


def status(data: Path) -> dict:
    return json.loads(gyre(data, "status", "--json", check=False).stdout)


@pytest.mark.timeout(900)
def test_a_client_with_only_grpc_stubs_trains_a_job(stack: Path) -> None:
    scheduler = status(stack)["services"]["scheduler"]["address"]
    job = {"model": "builtin-tiny", "num_steps": 2, "groups_per_step": 2, "group_size": 2, "generator": "xlong-v1",
           "params": {"num_modules": "2", "split": "train"}, "learning_rate": 1e-3, "execution_timeout_s": 60.0,
           "eval_tasks": 2, "eval_every": 1, "timeout_s": 600}
    out = subprocess.run([PY, "-I", str(REPO / "tests" / "support" / "proto_only_client.py"), str(REPO), scheduler,
                          json.dumps(job)], capture_output=True, text=True, timeout=700, cwd="/")
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["repo_modules"] == [] and res["protos_from"].startswith(res["stubs_dir"])
    assert res["state"] == "JOB_STATE_COMPLETED", res
    assert res["weight_version"] == 2
    kinds = res["kinds"]
    assert kinds["step_trained"] == 2 and kinds["job_prepared"] == 1 and kinds["execution_completed"] >= 8
    assert sorted(int(e["after_step"]) for e in res["evaluations"]) == [0, 1, 2]  # rounds may end out of order
    assert all(0.0 <= float(e["pass_rate"]) <= 1.0 and int(e["tasks"]) == 2 for e in res["evaluations"])
    # the same job through the CLI: listed, watchable after the fact, reportable
    jobs = json.loads(gyre(stack, "jobs", "--json").stdout)
    assert any(j["job_id"] == res["job_id"] and j["state"] == "completed" for j in jobs)
    last = json.loads(gyre(stack, "watch", res["job_id"], "--json").stdout.strip().splitlines()[-1])
    assert last["state"] == "completed" and last["weight_version"] == 2
    # watched after the fact into trackers: the figures every step_trained event carries
    gyre(stack, "watch", res["job_id"], "--quiet", "--logger", "tensorboard,mlflow", "--logger-dir",
         str(stack / "tracked"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(stack / "tracked" / "tensorboard" / res["job_id"]))
    acc.Reload()
    assert [s.step for s in acc.Scalars("trainer/loss")] == [0, 1]
    assert sorted(s.step for s in acc.Scalars("heldout/pass_rate")) == [0, 1, 2]
    assert (stack / "tracked" / "mlruns").is_dir()
    bad = gyre(stack, "watch", res["job_id"], "--logger", "comet", check=False)
    assert bad.returncode != 0 and "logger 'comet' is not one of tensorboard, wandb, mlflow" in bad.stderr
    report = gyre(stack, "report", res["job_id"], "--out", str(stack / "report")).stdout
    assert "report:" in report and (stack / "report" / "report.html").exists()
    lines = (stack / "report" / "metrics.jsonl").read_text().splitlines()
    assert sum(json.loads(x)["kind"] == "step" for x in lines) == 2
    assert sum(json.loads(x)["kind"] == "eval" for x in lines) == 3


@pytest.mark.timeout(900)
def test_the_external_harness_example_runs_a_submitted_job_and_it_is_trained(stack: Path) -> None:
    sub = gyre(stack, "submit", str(REPO / "deploy" / "config" / "job.toml"), *SMALL, "--num_steps", "1",
               "--evaluation.tasks", "0", "--harness", "external")
    job_id = sub.stdout.strip().splitlines()[-1]
    services = status(stack)["services"]
    # an unreachable shared URL: every call must go to the session base URL its lease carries
    base_url = "http://127.0.0.1:9/v1"
    harness = subprocess.run(
        [PY, str(REPO / "examples" / "openai_harness.py"), "--base-url", base_url,
         "--scheduler", services["scheduler"]["address"], "--reward", services["reward"]["address"],
         "--job-id", job_id, "--max-executions", "4"], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert harness.returncode == 0, harness.stderr[-3000:]
    assert harness.stdout.count(": finished") + harness.stdout.count(": timeout") + \
        harness.stdout.count(": failed") == 4, harness.stdout
    watched = gyre(stack, "watch", job_id, "--json", timeout=600).stdout.strip().splitlines()
    last = json.loads(watched[-1])
    assert last["state"] == "completed" and last["weight_version"] == 1, watched[-5:]
    trained = [json.loads(x) for x in watched[:-1] if json.loads(x)["kind"] == "step_trained"]
    assert [int(e["step"]) for e in trained] == [0]
    # the trainer reported what the update measured (the elastic policy's cost model reads it)
    assert float(trained[0]["trained_tokens"]) > 0 and float(trained[0]["compute_s"]) > 0, trained
    assert int(trained[0]["world_size"]) >= 1, trained
    # the gateway keeps no per-execution state past an execution's end: its delta encoder drops
    # the job's four ended executions and holds nothing more
    port = status(stack)["services"]["gateway"]["metrics_port"]
    wait_until(lambda: (_gauge(port, "gyre_gateway_tito_forgotten_executions_total") or 0) >= 4
               and _gauge(port, "gyre_gateway_tito_encoder_tokens") == 0.0,
               120, "the gateway to drop the state of ended executions", poll_s=0.5)


@pytest.mark.timeout(900)
def _gauge(port: int, name: str) -> float | None:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")]
    return values[0] if values else None


def test_a_job_of_another_checkpoint_has_the_engines_load_it(stack: Path, tmp_path: Path) -> None:
    """The engines were brought up serving builtin-tiny; a job naming a checkpoint directory (a copy
    of it: the architecture this 2-core test can afford twice) has every engine load that model before
    its first rollout, and is trained on it."""
    import shutil

    ckpt = tmp_path / "my-checkpoint"
    shutil.copytree(REPO / ".gyre" / "models" / "builtin-tiny", ckpt)
    job = str(REPO / "deploy" / "config" / "job.toml")
    job_id = gyre(stack, "submit", job, *SMALL, "--num_steps", "1", "--evaluation.tasks", "0",
                  "--model", str(ckpt)).stdout.strip().splitlines()[-1]
    events = [json.loads(x) for x in gyre(stack, "watch", job_id, "--json").stdout.strip().splitlines()]
    loaded = [e for e in events if e["kind"] == "engine_model"]
    assert len(loaded) == 2 and all(e["model"] == str(ckpt) for e in loaded), loaded
    assert events[-1]["state"] == "completed" and events[-1]["weight_version"] == 1
    kinds = [e["kind"] for e in events]
    assert kinds.index("engine_model") < kinds.index("job_prepared") < kinds.index("step_started")


@pytest.mark.timeout(600)
def test_bad_job_files_are_refused_in_one_sentence_and_nothing_is_written(stack: Path, tmp_path: Path) -> None:
    before = json.loads(gyre(stack, "jobs", "--json").stdout)
    job = REPO / "deploy" / "config" / "job.toml"
    cases = [
        (["--learning_rat", "1"], "unknown job flag"),
        (["--tasks.generator", "nope-v9"], "unknown task generator 'nope-v9'"),
        (["--num_steps", "0"], "num_steps is 0"),
        (["--model", "/nonexistent/model"], "does not resolve"),
        (["--scorer", "builtin:nope"], "nope"),
    ]
    for flags, needle in cases:
        proc = gyre(stack, "submit", str(job), *flags, check=False)
        assert proc.returncode == 2, (flags, proc.stdout, proc.stderr)
        err = proc.stderr.strip()
        assert needle in err and len(err.splitlines()) == 1 and "Traceback" not in err, (flags, err)
    extra = tmp_path / "extra.toml"
    extra.write_text(job.read_text().replace("[job]\n", "[job]\ncolour = \"blue\"\n"))
    proc = gyre(stack, "submit", str(extra), check=False)
    assert proc.returncode == 2 and "unknown job field(s) colour" in proc.stderr
    assert json.loads(gyre(stack, "jobs", "--json").stdout) == before


@pytest.mark.timeout(600)
def test_a_cancelled_job_stops_its_trainer_and_the_next_job_runs(stack: Path) -> None:
    job = str(REPO / "deploy" / "config" / "job.toml")
    long_id = gyre(stack, "submit", job, *SMALL, "--num_steps", "50").stdout.strip().splitlines()[-1]
    next_id = gyre(stack, "submit", job, *SMALL, "--num_steps", "1", "--evaluation.tasks", "0").stdout.strip() \
        .splitlines()[-1]
    jobs = {j["job_id"]: j for j in json.loads(gyre(stack, "jobs", "--json").stdout)}
    assert jobs[next_id]["state"] == "pending"  # the run queue: one job holds the cells at a time
    gyre(stack, "cancel", long_id, "--reason", "test")
    last = json.loads(gyre(stack, "watch", next_id, "--json").stdout.strip().splitlines()[-1])
    assert last["state"] == "completed" and last["weight_version"] == 1
    jobs = {j["job_id"]: j for j in json.loads(gyre(stack, "jobs", "--json").stdout)}
    assert jobs[long_id]["state"] == "cancelled"


@pytest.mark.timeout(900)
def test_a_scheduler_killed_mid_job_is_restarted_and_the_job_goes_on(stack: Path) -> None:
    """SIGKILL of the scheduler after the job's first published step; the same command (on the
    same port, as systemd would restart it) picks the job up from Redis: the trainer's lost report
    is applied, the harness leases again, and the job completes with every step published once."""
    import signal

    job = str(REPO / "deploy" / "config" / "job.toml")
    job_id = gyre(stack, "submit", job, *SMALL, "--num_steps", "3").stdout.strip().splitlines()[-1]
    state_file = stack / "run" / "state.json"
    sched = json.loads(state_file.read_text())["services"]["scheduler"]
    watch = subprocess.Popen([PY, "-m", "services.cli", "--data-dir", str(stack), "watch", job_id, "--json"],
                             cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert watch.stdout is not None
    events = []
    for line in watch.stdout:
        events.append(json.loads(line))
        if events[-1]["kind"] == "step_trained":
            break
    os.kill(sched["pid"], signal.SIGKILL)
    port = sched["address"].rsplit(":", 1)[1]
    with open(sched["log"], "ab") as log:
        proc = subprocess.Popen([*sched["command"], "--port", port], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    state = json.loads(state_file.read_text())
    state["services"]["scheduler"]["pid"] = proc.pid  # so `gyre down` stops the new one
    state_file.write_text(json.dumps(state))
    try:
        events += [json.loads(line) for line in watch.stdout]  # the watcher resumes by event id
        assert watch.wait(timeout=600) == 0
        last = events[-1]
        assert last["kind"] == "end" and last["state"] == "completed" and last["weight_version"] == 3, last
        trained = [int(e["step"]) for e in events if e["kind"] == "step_trained"]
        assert trained == [0, 1, 2]  # each step once, in order, across the restart
        ended = [e["execution_id"] for e in events if e["kind"] == "execution_completed" and not e.get("evaluation")]
        assert len(ended) == len(set(ended)) == 3 * 4
    finally:  # the stack, this scheduler included, goes down with the module's fixture
        if watch.poll() is None:
            watch.kill()
