"""Mode comparison arithmetic: utilization from role intervals, time to a held-out target."""

from __future__ import annotations

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
