"""`gyre replay --trace` as a user runs it: a small agent-shaped trace (a sub-agent, a compaction)
played on a live stack it brings up and takes down; every model call recorded and trained on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.traces import agent_turns, write_trace

REPO = Path(__file__).resolve().parents[2]


def replay(tmp_path: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "services.cli", "replay", *args, "--quiet", "true",
                           "--data-dir", str(tmp_path / "data"), "--report-dir", str(tmp_path / "report")],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(900)
def test_replay_plays_a_trace_on_the_live_stack_and_trains_on_it(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "agents.jsonl", steps=2, per_step=2)
    proc = replay(tmp_path, "--trace", str(trace), "--time-scale", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["state"] == "completed" and summary["steps"] == 2 and summary["weight_version"] == 2
    assert summary["outcomes"] == {"finished": 4} and summary["trained_tokens"] > 0
    # each execution played every turn: 5 model calls (one turn calls no model), exactly its tokens
    turns = agent_turns()
    logs = tmp_path / "data" / "elastic" / "logs"
    ended = [json.loads(x) for x in (logs / "harness.log").read_text().splitlines()
             if '"execution ended"' in x]
    assert len(ended) == 4, ended
    for e in ended:
        assert e["family"] == "trace-v1" and e["status"] == "finished" and e["turns"] == len(turns)
        assert e["calls"] == 5 and e["output_tokens"] == sum(t["gen_tokens"] for t in turns)
        # system 32 + the contexts: main 92, sub-agent 72, main 134, summary 164, compacted main 94
        assert e["prompt_tokens"] == 556
    # the job's log ends with the gateway's totals of its calls: in the output and the report
    assert "model calls: 20 calls (0 in flight)" in proc.stdout, proc.stdout[-3000:]
    assert "2,224 prompt tokens" in proc.stdout and "224 generated" in proc.stdout
    report = next((tmp_path / "report").rglob("report.html")).read_text()
    assert "20 calls (0 in flight)" in report
    # per step, from the trajectory service's outcomes: every execution played all its turns (reward 1)
    assert "5.0 calls (max 5)" in report
    rows = [json.loads(x) for x in next((tmp_path / "report").rglob("metrics.jsonl")).read_text().splitlines()]
    steps = [r for r in rows if r["kind"] == "step"]
    assert [r["train_pass_rate"] for r in steps] == [1.0, 1.0] and all(r["timeouts"] == 0 for r in steps)
    assert [r["execution_calls"] for r in steps] == [[5, 5], [5, 5]]
    # and the trajectory service took every call's record (none refused)
    refused = [x for x in (logs / "trajectory.log").read_text().splitlines() if "rpc rejected" in x]
    assert not refused, refused[:3]


def test_a_bad_trace_is_one_sentence_naming_its_line_and_starts_nothing(tmp_path: Path) -> None:
    turns = agent_turns()
    cases = {  # the main context is 72 tokens when the summary would keep 100 of it
        "negative": ([{**turns[0], "prompt_tokens": -5}], "must be >= 0"),
        "unknown": ([{**turns[0], "tool": "grep"}], "unknown field 'tool'"),
        "compaction": ([turns[0], {**turns[3], "compact_to": 100, "gen_tokens": 500}],
                       "not shorter than the main context"),
    }
    for name, (bad, says) in cases.items():
        trace = write_trace(tmp_path / f"{name}.jsonl", steps=1, per_step=1)
        lines = trace.read_text().splitlines()
        row = json.loads(lines[0])
        row["turns"] = bad
        trace.write_text(json.dumps(row) + "\n")
        proc = replay(tmp_path, "--trace", str(trace), timeout=120)
        assert proc.returncode == 2, (name, proc.stdout, proc.stderr)
        err = proc.stderr.strip()
        assert len(err.splitlines()) == 1 and f"{trace}:1" in err and says in err, (name, err)
        assert not (tmp_path / "data").exists(), name  # nothing started
    missing = replay(tmp_path, "--trace", str(tmp_path / "missing.jsonl"), timeout=120)
    assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
        f"gyre replay: cannot read the trace {tmp_path / 'missing.jsonl'}: No such file or directory"]
