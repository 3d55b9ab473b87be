"""`gyre trajectory stats` on JSONL records (full and delta prompts, execution lines, errors)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from services.trajectory.cli import stats_main
from services.trajectory.records import DeltaEncoder, call_to_json, read_jsonl
from tests.unit.trajectory_reference import NaiveTree, random_execution


def write(path: Path, objs: list[dict]) -> str:
    path.write_text("\n".join(json.dumps(o) for o in objs) + "\n")
    return str(path)


@pytest.mark.parametrize("max_paths", [None, 1, 3])
def test_stats_match_the_naive_expansion(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         max_paths: int | None) -> None:
    rng = np.random.default_rng(5)
    lines, want = [], {}
    enc = DeltaEncoder()
    for e in range(3):
        calls = random_execution(rng, 10, 4, execution_id=f"x{e}")
        want[f"x{e}"] = NaiveTree(calls).stats(max_paths)
        # execution x1 is given delta-encoded, the others with full prompts
        lines += [call_to_json(enc.encode_call(c) if e == 1 else c) for c in calls]
        lines.append({"execution_id": f"x{e}", "group_id": "g", "status": "finished", "reward": 1.0})
    lines.append({"execution_id": "empty", "group_id": "g", "status": "failed", "reward": 0.0})
    argv = ["--records", write(tmp_path / "r.jsonl", lines)]
    if max_paths:
        argv += ["--max-paths", str(max_paths)]
    assert stats_main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == ["x0", "x1", "x2", "empty"]
    assert {k: out[k] for k in want} == want
    assert out["empty"] == {"paths": 0, "naive_tokens": 0, "tree_tokens": 0, "trainable_tokens": 0}


def test_reward_on_the_last_call_and_lenient_defaults() -> None:
    calls, execs = read_jsonl([
        '{"execution_id": "a", "prompt_ids": [1, 2], "output_ids": [3]}',
        '{"execution_id": "a", "call_id": "c2", "prompt_ids": [1, 2, 3], "output_ids": [4], "reward": 0.5}',
    ])
    assert [c.call_id for c in calls] == ["line-1", "c2"] and calls[0].role.name == "MAIN"
    assert execs["a"].reward == 0.5


@pytest.mark.parametrize("line, message", [
    ('{"execution_id": "a", "call_id": "c", "prompt_ids": [1], "output_ids": [2, 3], "output_logprobs": [-1]}',
     "line 1: .*equally long"),
    ('{"execution_id": "a", "call_id": "c", "role": "robot", "prompt_ids": [1], "output_ids": [2]}', "line 1: role"),
    ('{"execution_id": "a", "call_id": "c", "prompt_ids": [1, -2], "output_ids": [2]}', "negative token id"),
    ("not json", "line 1: not valid JSON"),
    ('{"execution_id": "a", "group_id": "g", "status": "exploded"}', "status 'exploded' is unknown"),
])
def test_bad_lines_exit_2_with_one_sentence(tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str,
                                            message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    assert stats_main(["--records", str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1
    assert re.search(message, err)


def test_missing_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert stats_main(["--records", "/nonexistent.jsonl"]) == 2
    assert "does not exist" in capsys.readouterr().err
