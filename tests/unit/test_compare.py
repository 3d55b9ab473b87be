"""Mode comparison arithmetic: utilization from role intervals, time to a held-out target."""

from __future__ import annotations

import pytest

from services.compare import time_to, utilization
from services.run import RunResult


def _result(roles: list[dict], evals: list[dict]) -> RunResult:
    return RunResult(job_id="j", mode="elastic", steps=[], evals=evals, roles=roles, switches=[], wall_s=10.0,
                     report=None, final_state="completed")


def test_utilization_counts_rollout_and_train_only() -> None:
    roles = [{"cell_id": "c1", "role": "rollout", "start_s": 0, "end_s": 6},
             {"cell_id": "c1", "role": "switching", "start_s": 6, "end_s": 8},
             {"cell_id": "c1", "role": "train", "start_s": 8, "end_s": 10},
             {"cell_id": "c2", "role": "idle", "start_s": 0, "end_s": 10}]
    assert utilization(_result(roles, [])) == 8 / 20


def test_time_to_target() -> None:
    evals = [{"step": 0, "time_s": 1.0, "heldout_pass_rate": 0.3}, {"step": 2, "time_s": 50.0, "heldout_pass_rate": 0.6},
             {"step": 4, "time_s": 90.0, "heldout_pass_rate": 0.7}]
    assert time_to(_result([], evals), 0.6) == 50.0
    assert time_to(_result([], evals), 0.8) is None


def _row(last: float, wall: float, by_step: dict[int, float], state: str = "completed") -> dict:
    return {"heldout_last": last, "wall_s": wall, "heldout_by_step": by_step, "state": state}


def test_spread() -> None:
    from services.compare import spread

    assert spread([0.5, 0.7, 0.6]) == {"mean": 0.6, "min": 0.5, "max": 0.7, "std": 0.0816}
    assert spread([3.0]) == {"mean": 3.0, "min": 3.0, "max": 3.0, "std": 0.0}


def test_across_seeds_compares_at_equal_steps_and_checks_elastic_against_colocate() -> None:
    from services.compare import _seed_lines, across_seeds

    rows = {
        0: {"colocate": _row(0.50, 100, {0: 0.1, 4: 0.3, 8: 0.50}), "elastic": _row(0.55, 90, {0: 0.1, 4: 0.35, 8: 0.55})},
        1: {"colocate": _row(0.60, 110, {0: 0.1, 4: 0.40, 8: 0.60}), "elastic": _row(0.58, 95, {0: 0.1, 8: 0.58})},
    }
    agg = across_seeds(rows)
    assert agg["seeds"] == [0, 1] and list(agg["modes"]) == ["colocate", "elastic"]
    assert list(agg["modes"]["elastic"]["heldout_by_step"]) == [0, 8]  # step 4 was not evaluated in every run
    assert list(agg["modes"]["colocate"]["heldout_by_step"]) == [0, 4, 8]
    assert agg["modes"]["colocate"]["heldout_last"]["min"] == 0.5 and agg["modes"]["colocate"]["wall_s"]["mean"] == 105
    assert agg["elastic_within_colocate_spread"] is True  # 0.565 in 0.50..0.60
    assert agg["elastic_against_colocate_spread"] == "within"
    assert "is within colocate's spread" in "\n".join(_seed_lines(agg))
    rows[1]["elastic"] = _row(0.90, 95, {0: 0.1, 8: 0.90})
    agg = across_seeds(rows)
    assert agg["elastic_within_colocate_spread"] is False  # 0.725 is above colocate's 0.60
    assert agg["elastic_against_colocate_spread"] == "above"
    assert "is ABOVE (outside) colocate's spread" in "\n".join(_seed_lines(agg))
    rows[1]["elastic"] = _row(0.20, 95, {0: 0.1, 8: 0.20})
    agg = across_seeds(rows)
    assert agg["elastic_against_colocate_spread"] == "below"  # 0.375 is below colocate's 0.50
    assert "is BELOW (outside) colocate's spread" in "\n".join(_seed_lines(agg))


def test_compare_refuses_a_bad_seed_count(capsys: object) -> None:
    from services.compare import compare_main

    assert compare_main(["--seeds", "many"]) == 2
    assert compare_main(["--seeds", "0"]) == 2
    assert compare_main(["--seeds"]) == 2


def test_variants_of_one_job_field_are_compared_against_the_first() -> None:
    """``--vary timeout-policy=partial,zero``: rows keep the order given, and each later value's mean
    last held-out is set against the first value's spread (the elastic check is for modes only)."""
    from services.compare import across_seeds, parse_vary

    assert parse_vary("timeout-policy=partial,zero") == ("timeout-policy", ["partial", "zero"])
    assert parse_vary("--algorithm.learning-rate=1e-3, 3e-4") == ("algorithm.learning-rate", ["1e-3", "3e-4"])
    assert parse_vary("timeout-policy=zero") == ("timeout-policy", ["zero"])  # one value: repeats over seeds
    for bad in ("timeout-policy=", "timeout-policy", "=a,b", "timeout-policy=a,,b", "timeout-policy=a,a"):
        try:
            parse_vary(bad)
        except ValueError as exc:
            assert "--vary" in str(exc)
        else:
            raise AssertionError(f"{bad!r} was accepted")
    rows = {
        0: {"timeout_policy=partial": _row(0.30, 100, {0: 0.1, 8: 0.30}), "timeout_policy=zero": _row(0.20, 90, {0: 0.1, 8: 0.20})},
        1: {"timeout_policy=partial": _row(0.34, 110, {0: 0.1, 8: 0.34}), "timeout_policy=zero": _row(0.24, 95, {0: 0.1, 8: 0.24})},
    }
    agg = across_seeds(rows)
    assert list(agg["modes"]) == ["timeout_policy=partial", "timeout_policy=zero"]
    assert "elastic_within_colocate_spread" not in agg
    zero = agg["against_first"]["timeout_policy=zero"]
    assert zero["difference"] == -0.1 and zero["outside_first_spread"] is True  # 0.22 below 0.30..0.34
    assert zero["against_first_spread"] == "below"
    rows[1]["timeout_policy=zero"] = _row(0.40, 95, {0: 0.1, 8: 0.40})
    assert across_seeds(rows)["against_first"]["timeout_policy=zero"]["outside_first_spread"] is False  # 0.30
    assert across_seeds(rows)["against_first"]["timeout_policy=zero"]["against_first_spread"] == "within"
    rows[1]["timeout_policy=zero"] = _row(0.60, 95, {0: 0.1, 8: 0.60})
    assert across_seeds(rows)["against_first"]["timeout_policy=zero"]["against_first_spread"] == "above"  # 0.40


def test_compare_refuses_a_bad_variation(capsys) -> None:
    from services.compare import compare_main

    assert compare_main(["--vary"]) == 2
    assert compare_main(["--vary", "timeout-policy="]) == 2
    assert compare_main(["--vary", "nonsense=a,b"]) == 2
    assert "unknown job flag '--nonsense'" in capsys.readouterr().err
    assert compare_main(["--vary", "timeout-policy=partial,bogus"]) == 2
    assert "timeout_policy is 'bogus'" in capsys.readouterr().err


def test_a_variant_job_id_is_a_valid_job_id_for_any_field() -> None:
    from services.compare import _job_id
    from services.scheduler.jobs import ID_RE, MAX_JOB_ID
    from tests.service.scheduler_support import job_spec

    base = "job-20261205-215048-fedb"
    assert _job_id(base, "algorithm.learning_rate=1e-3", "-seed0") == f"{base}-algorithm-learning_rate-1e-3-seed0"
    assert _job_id(base, "colocate", "") == f"{base}-colocate"
    long_a = _job_id(base, "tasks.params.a_rather_long_parameter_name=0.25", "-seed2")
    long_b = _job_id(base, "tasks.params.a_rather_long_parameter_name=0.5", "-seed2")
    assert long_a != long_b and long_a.endswith("-seed2") and long_b.endswith("-seed2")
    # the id of a run that failed to start: 64 characters, past the 59 a job may have
    low_var = _job_id(base, "algorithm.kl_estimator=low_var_kl", "-seed0")
    ids = (long_a, long_b, low_var, _job_id("j" * 64, "x=y", "-seed10"))
    assert all(ID_RE.match(j) and len(j) <= MAX_JOB_ID for j in ids)
    assert low_var.startswith(f"{base}-algorithm-kl") and low_var.endswith("-seed0")
    for j in ids:
        assert job_spec(j).job_id == j  # the scheduler takes it


def test_the_report_lists_each_runs_policy_in_seed_order() -> None:
    from services.compare import policy_lines

    lines = policy_lines({"timeout_policy=partial": ["r/partial-seed0/policy", "r/partial-seed1/policy"],
                          "timeout_policy=zero": ["r/zero-seed0/policy", None]})
    assert lines[-2] == "- timeout_policy=partial: r/partial-seed0/policy, r/partial-seed1/policy"
    assert lines[-1] == "- timeout_policy=zero: r/zero-seed0/policy, none (no step trained)"
    assert any("gyre run --model DIR" in line for line in lines)
    assert policy_lines({"elastic": [None], "colocate": [None]}) == []  # --save-policy false: no section
    assert policy_lines({}) == []


def test_modes_picks_some_of_the_modes_in_their_usual_order(capsys) -> None:
    """``--modes elastic,colocate``: only those two runs, colocate on-policy first; a bad list is refused."""
    from services.compare import compare_main, mode_variants, parse_modes
    from services.run import load_run

    assert parse_modes("elastic, colocate") == ("elastic", "colocate")
    run, spec, _ = load_run([])
    variants = mode_variants(spec, run, parse_modes("elastic,colocate"))
    assert [label for label, _ in variants] == ["colocate", "elastic"]
    assert [(v.mode.value, v.staleness_bound) for _, v in variants] == [("colocate", 0), ("elastic", 1)]
    assert [label for label, _ in mode_variants(spec, run)] == ["colocate", "async", "elastic"]
    for bad in ("", "colocate,", "colocate,bogus", "elastic,elastic"):
        with pytest.raises(ValueError, match="--modes"):
            parse_modes(bad)
    assert compare_main(["--modes", "colocate,bogus"]) == 2
    assert "--modes lists scheduling modes from colocate, async, elastic" in capsys.readouterr().err
    assert compare_main(["--modes"]) == 2
    assert compare_main(["--modes", "colocate,elastic", "--vary", "timeout-policy=partial,zero"]) == 2
    assert "do not go together" in capsys.readouterr().err


def test_the_report_has_a_row_per_run_with_its_timeouts_entropy_and_first_update() -> None:
    """Each run's row: held-out after each evaluated step and the rise, timed-out training executions
    per step, token entropy first -> last, the step-1 trainer/behaviour KL (a k3 estimate a hair below
    0 on-policy shows as 0), and a run that did not complete says so."""
    from services.compare import run_facts, run_lines

    steps = [{"step": 1, "timeouts": 8, "entropy": 0.32, "mismatch_kl": -2e-10},
             {"step": 0, "timeouts": 4, "entropy": 0.42, "mismatch_kl": 0.0},
             {"step": 2, "timeouts": 0, "entropy": 0.14}]
    evals = [{"step": 0, "time_s": 5.0, "heldout_pass_rate": 0.078125}, {"step": 3, "time_s": 90.0, "heldout_pass_rate": 0.4453125}]
    r = RunResult(job_id="j", mode="colocate", steps=steps, evals=evals, roles=[], switches=[], wall_s=388.2,
                  report=None, final_state="completed")
    facts = run_facts("colocate", 0, r)
    assert facts["timeouts_by_step"] == [4, 8, 0] and facts["rise_points"] == 36.7
    assert (facts["entropy_first"], facts["entropy_last"], facts["mismatch_kl_step1"]) == (0.42, 0.14, -2e-10)
    stalled = RunResult(job_id="k", mode="elastic", steps=[], evals=[], roles=[], switches=[], wall_s=12.0,
                        report=None, final_state="failed")
    lines = run_lines([facts, run_facts("elastic", 1, stalled)])
    assert "| colocate seed 0 | 0: 0.078; 3: 0.445 | +36.7 | 4, 8, 0 | 0.42 -> 0.14 | 0 | 388 |" in lines
    assert "| elastic seed 1 (failed) | - | - | - | - -> - | - | 12 |" in lines
    assert run_lines([]) == []
