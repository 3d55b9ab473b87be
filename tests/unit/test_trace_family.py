"""The replay extension of the scheduler trace format and the trace-v1 task family (generator,
scorer); the live replay is tests/e2e/test_replay_trace.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.task.traces import load_trace, save_trace
from services.task import registry
from services.task.families.trace import generate, score
from tests.support.traces import agent_turns, write_trace


def test_extended_turns_round_trip_and_plain_traces_stay_plain(tmp_path: Path) -> None:
    trace = load_trace(write_trace(tmp_path / "t.jsonl", steps=2, per_step=3))
    e = trace[0]
    assert e.agents == ("main", "search", "main", "compactor", "main", "main")
    assert e.roles == ("main", "subagent", "main", "summary", "main", "main")
    assert list(e.compact_to) == [-1, -1, -1, 12, -1, -1]
    save_trace(trace, tmp_path / "back.jsonl")
    assert [json.loads(x) for x in (tmp_path / "back.jsonl").read_text().splitlines()][0]["turns"][3] == \
        {"prompt_tokens": 20, "gen_tokens": 16, "env_s": 0.0, "agent": "compactor", "role": "summary",
         "compact_to": 12}
    plain = load_trace(Path(__file__).resolve().parents[2] / "bench" / "traces" / "heavy_tail.jsonl")
    assert plain[0].agents is None and plain[0].compact_to is None


@pytest.mark.parametrize("turn,says", [
    ({"role": "boss"}, "role must be one of"),
    ({"agent": "helper", "role": "main"}, "the agent 'main' and only it"),
    ({"compact_to": 3}, "compact_to is only for summary turns"),
    ({"agent": "s", "role": "summary", "compact_to": 20}, "between 0 and the summary's 12"),
    ({"agent": "a/b"}, "without '/'"),
    ({"gen_tokens": -1}, "must be >= 0"),
])
def test_bad_turns_name_the_line_and_the_turn(tmp_path: Path, turn: dict, says: str) -> None:
    path = write_trace(tmp_path / "t.jsonl", steps=1, per_step=1,
                       turns=[{"prompt_tokens": 100, "gen_tokens": 12, "env_s": 0.0},
                              {"prompt_tokens": 5, "gen_tokens": 12, "env_s": 0.0, **turn}])
    with pytest.raises(ValueError, match=f"{path}:1: turn 1: .*{says}"):
        load_trace(path)


def test_generator_gives_each_trace_execution_as_a_payload(tmp_path: Path) -> None:
    path = str(write_trace(tmp_path / "t.jsonl", steps=2, per_step=3))
    fam = registry.get_family("trace-v1")
    assert fam.default_scorer == "trace-v1" and fam.runner
    payloads = [json.loads(p) for p in generate({"path": path, "time_scale": "0.5"}, 1, 3)]
    assert [p["task_id"] for p in payloads] == ["trace-v1/s1-e0", "trace-v1/s1-e1", "trace-v1/s1-e2"]
    assert payloads[0]["time_scale"] == 0.5 and payloads[0]["turns"][3]["compact_to"] == 12
    assert generate({"path": path}, 0, 3) == generate({"path": path}, 0, 3)  # deterministic
    with pytest.raises(ValueError, match="step 1 has 3 executions; the job asks for 2"):
        generate({"path": path}, 1, 2)
    with pytest.raises(ValueError, match="no step 5"):
        generate({"path": path}, 5, 3)
    with pytest.raises(ValueError, match="not 'seed'"):
        generate({"path": path, "seed": "1"}, 0, 3)
    with pytest.raises(ValueError, match="cannot be read"):
        generate({"path": str(tmp_path / "missing.jsonl")}, 0, 3)


def test_score_is_the_share_of_turns_played() -> None:
    def files(done: int) -> dict[str, bytes]:
        return {"trace.json": json.dumps({"turns_done": done, "turns": len(agent_turns()), "calls": done}).encode()}

    assert score(files(6), "trace-v1/x", "finished")["score"] == 1.0
    assert score(files(3), "trace-v1/x", "timeout")["score"] == 0.5
    assert score({}, "trace-v1/x", "failed")["score"] == 0.0
