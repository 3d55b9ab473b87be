"""`gyre run`'s command line: stack flags, job flags and the task's own files; job files parse."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.run import DEFAULT_RUN_CONFIG, TASK_FILES, load_run
from services.scheduler.jobfile import DEFAULT_JOB_FILE, load_job, read_job_table
from services.scheduler.jobs import JobSpec, Mode

REPO = Path(__file__).resolve().parents[2]


def test_default_is_the_builtin_job_on_the_default_stack() -> None:
    run, spec, path = load_run([])
    assert path == DEFAULT_RUN_CONFIG and run.engines == 2
    assert spec.model == "builtin-tiny" and spec.tasks.generator == "xlong-v1" and spec.mode is Mode.ELASTIC
    assert spec.evaluation.tasks == 128 and spec.evaluation.after_steps(spec.num_steps) == (0, 4, 8)
    params = dict(spec.tasks.params)  # XLong-shaped: a heavy tail of long tasks the deadline cuts
    assert params["num_modules"] == "8" and params["long_pct"] == "25" and spec.timeout_policy.value == "partial"


def test_task_arith_reads_its_own_files_and_flags_still_win() -> None:
    run, spec, path = load_run(["--task", "arith", "--num-steps", "2", "--engines", "1", "--quiet"])
    assert path == TASK_FILES["arith"][1] and run.engines == 1 and run.quiet
    assert spec.tasks.generator == "arith-v1" and spec.num_steps == 2 and spec.model == "smollm2-135m-instruct"
    assert spec.algorithm.learning_rate < 1e-4  # a pretrained model's step size, not the tiny model's


def test_nested_job_flags() -> None:
    spec = load_job(DEFAULT_JOB_FILE, ["--algorithm.kl-coef", "0.01", "--algorithm.kl-reference", "initial",
                                       "--algorithm.kl-estimator", "k2", "--evaluation.every", "3", "--tasks.params.num_modules", "3",
                                       "--mode", "colocate", "--staleness-bound", "0"])
    assert spec.algorithm.kl_coef == 0.01 and spec.evaluation.every == 3 and spec.mode is Mode.COLOCATE
    assert (spec.algorithm.kl_reference, spec.algorithm.kl_estimator) == ("initial", "k2")
    assert dict(spec.tasks.params)["num_modules"] == "3"


@pytest.mark.parametrize("path", sorted((REPO / "deploy" / "config").glob("job*.toml")))
def test_every_shipped_job_file_parses_and_round_trips(path: Path) -> None:
    spec = load_job(path)
    assert JobSpec.from_json(spec.to_json()) == spec
    assert set(read_job_table(path)) <= set(spec.to_dict())


@pytest.mark.parametrize("argv, message", [
    (["--task", "chess"], "task"), (["--config"], "needs a value"), (["--num-steps", "many"], "not a valid int"),
    (["--algorithm.lr", "1"], "unknown job flag"), (["--stepz", "1"], "unknown job flag"), (["--num-steps", "0"], "num_steps is 0"),
    (["--evaluation.every", "-1"], "evaluation.every"), (["--harness", "mine"], "harness"),
])
def test_bad_command_lines_get_one_clear_sentence(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_run(argv)


def test_short_flags_of_earlier_versions_still_work() -> None:
    spec = load_job(DEFAULT_JOB_FILE, ["--steps", "3", "--learning-rate", "3e-4", "--eval-tasks", "0"])
    assert spec.num_steps == 3 and spec.algorithm.learning_rate == 3e-4 and spec.evaluation.tasks == 0


def test_unknown_fields_in_a_job_file(tmp_path: Path) -> None:
    f = tmp_path / "job.toml"
    f.write_text(DEFAULT_JOB_FILE.read_text().replace("[job.algorithm]\n", "[job.algorithm]\nlr = 1\n"))
    with pytest.raises(ValueError, match=r"unknown algorithm field\(s\) lr"):
        load_job(f)
    f.write_text("[jobs]\n")
    with pytest.raises(ValueError, match="no \\[job\\] table"):
        load_job(f)


def test_save_policy_is_on_by_default_and_can_be_turned_off() -> None:
    assert load_run([])[0].save_policy
    run, _spec, _path = load_run(["--save-policy", "false", "--num-steps", "2"])
    assert not run.save_policy and _spec.num_steps == 2
