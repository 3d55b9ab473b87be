"""`gyre run`'s command line: the task picks its own defaults file unless --config is given."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.run import DEFAULT_RUN_CONFIG, TASK_CONFIGS, load_run_config


def test_default_is_the_xlong_task_from_run_toml() -> None:
    cfg, path = load_run_config([])
    assert path == DEFAULT_RUN_CONFIG and cfg.task == "xlong" and cfg.model == "builtin-tiny"


def test_task_arith_reads_its_own_defaults_and_flags_still_win() -> None:
    cfg, path = load_run_config(["--model", "smollm2-135m-instruct", "--task", "arith", "--steps", "2"])
    assert path == TASK_CONFIGS["arith"] and path.exists()
    assert cfg.task == "arith" and cfg.model == "smollm2-135m-instruct" and cfg.steps == 2
    assert cfg.learning_rate < 1e-4  # a pretrained model's step size, not the tiny model's
    assert set(cfg.knobs()) <= {"turns", "max_operand"}


def test_explicit_config_is_used_as_given(tmp_path: Path) -> None:
    f = tmp_path / "mine.toml"
    f.write_text('[run]\ntask = "arith"\nsteps = 3\n')
    cfg, path = load_run_config(["--config", str(f)])
    assert path == f and cfg.task == "arith" and cfg.steps == 3 and cfg.model == "builtin-tiny"


@pytest.mark.parametrize("argv, message", [(["--task", "chess"], "task"), (["--config"], "--config needs a file")])
def test_bad_command_lines_get_one_clear_sentence(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_run_config(argv)
