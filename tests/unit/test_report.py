"""The run report renders every figure and a metrics.jsonl that round-trips."""

from __future__ import annotations

import json
from pathlib import Path

from services.report import write_report


def test_report_files(tmp_path: Path) -> None:
    steps = [{"step": i, "time_s": 10.0 * i, "train_pass_rate": 0.2 + 0.1 * i, "naive_tokens": 900, "tree_tokens": 300,
              "execution_calls": [3, 5, 40], "execution_tokens": [300, 500, 4000], "timeouts": i,
              "step_time_s": 5.0, "train_time_s": 4.0, "compute_s": 1.5, "allreduce_s": 0.2, "switch_cell_s": 0.5 * i,
              **({"timeout_reward": 0.5} if i else {})} for i in range(3)]
    evals = [{"step": 0, "time_s": 0.0, "heldout_pass_rate": 0.25}, {"step": 2, "time_s": 20.0, "heldout_pass_rate": 0.5}]
    roles = [{"cell_id": "cell-0", "role": "train", "start_s": 0, "end_s": 30},
             {"cell_id": "cell-1", "role": "rollout", "start_s": 0, "end_s": 12},
             {"cell_id": "cell-1", "role": "switching", "start_s": 12, "end_s": 13},
             {"cell_id": "cell-1", "role": "train", "start_s": 13, "end_s": 30}]
    switches = [{"cell_id": "cell-1", "from": "rollout", "to": "train", "duration_s": 1.0, "at_s": 12, "migrated": 2,
                 "reason": "elastic: consolidate, rollout demand 1; the update ends ~4.5 s sooner with 2 TRAIN cells"}]
    page = write_report(tmp_path / "r", steps=steps, evals=evals, roles=roles, switches=switches,
                        meta={"mode": "elastic", "seed": 0})
    text = page.read_text()
    for png in ("learning_curve.png", "cell_timeline.png", "tokens.png", "switch_durations.png", "executions.png",
                "timeouts.png", "step_time.png"):
        assert (tmp_path / "r" / png).stat().st_size > 1000 and png in text
    assert "0.250 -&gt; 0.500" in text and "3.00x" in text and "elastic" in text
    assert "Role switches and why" in text and "~4.5 s sooner with 2 TRAIN cells" in text  # each switch's reason
    assert "16.0 calls (max 40)" in text and "3 executions, mean partial reward 0.500" in text
    kinds = [json.loads(line)["kind"] for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert kinds.count("step") == 3 and kinds.count("switch") == 1 and kinds.count("role") == 4


def test_step_rows_count_the_switches_of_each_step() -> None:
    """Switches end in the step whose window (previous publication, this one] holds their end; the
    cell-seconds spent switching are clipped to each step (one straddling two steps is split)."""
    from services.jobwatch import JobView, step_rows

    view = JobView("j")
    view.steps = {0: 10.0, 1: 20.0, 2: 30.0}
    view.switches = [{"cell_id": "cell-1", "from": "rollout", "to": "train", "duration_s": 2.0, "at_s": 5.0},
                     {"cell_id": "cell-2", "from": "train", "to": "rollout", "duration_s": 4.0, "at_s": 12.0},
                     {"cell_id": "cell-1", "from": "train", "to": "rollout", "duration_s": 1.0, "at_s": 19.0}]
    rows = step_rows(view)
    assert [r["switches"] for r in rows] == [1, 2, 0]
    assert [r["switch_cell_s"] for r in rows] == [2.0 + 2.0, 2.0 + 1.0, 0.0]
