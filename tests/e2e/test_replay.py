"""`gyre replay --records` as a user runs it: recorded agent executions (growing main context,
retry, sub-agent, compaction) train through real trajectory and trainer processes, no engine."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.records import write_records

REPO = Path(__file__).resolve().parents[2]


def replay(tmp_path: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GYRE_MODEL_CACHE": str(REPO / ".gyre" / "models")}
    return subprocess.run([sys.executable, "-m", "services.cli", "replay", "--data-dir", str(tmp_path / "data"),
                           *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def steps_of(proc: subprocess.CompletedProcess[str]) -> list[dict]:
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]


def test_replay_trains_every_trainable_token_once_per_step(tmp_path: Path) -> None:
    records = write_records(tmp_path / "agents.jsonl", executions=4, turns=4)
    steps = steps_of(replay(tmp_path, "--records", str(records), "--steps", "2"))
    assert [s["step"] for s in steps] == [0, 1]
    for s in steps:
        assert s["executions"] == 4 and s["trainable_tokens"] == s["trained_tokens"] == 4 * 8 * 8
        assert math.isfinite(s["loss"]) and s["processed_tokens"] > s["trainable_tokens"]
        assert s["processed_tokens"] == s["tree_tokens"] < s["naive_tokens"]  # shared prefixes once
        assert set(s["peak_rss_mib"]) == {"trajectory", "trainer"} and all(s["peak_rss_mib"].values())
    # one path per branch kept: fewer paths, fewer trained tokens, still every kept one once
    (kept,) = steps_of(replay(tmp_path, "--records", str(records), "--max-paths", "1"))
    assert 0 < kept["trained_tokens"] == kept["trainable_tokens"] < steps[0]["trainable_tokens"]


def test_replay_trains_a_path_deeper_than_the_dense_mask_limit(tmp_path: Path) -> None:
    # one execution whose main context grows past 9K tokens: a micro-batch above 8,192 tokens,
    # which the trainer refused before block-sparse attention (decoder layers checkpointed here);
    # deeper than the 4,096-token budget, so the packer plans pieces of at most 4,096 tokens and
    # the trainer runs one forward per piece (exact gradient: tests/unit/test_trainer_batch.py)
    records = write_records(tmp_path / "deep.jsonl", executions=1, turns=15, tool_tokens=600, output_tokens=16)
    (step,) = steps_of(replay(tmp_path, "--records", str(records), "--token-budget", "4096",
                              "--activation-checkpointing"))
    assert step["processed_tokens"] > 8192 and step["trained_tokens"] == step["trainable_tokens"] > 0
    assert math.isfinite(step["loss"])


def test_replay_on_a_sharded_trainer_group_gives_the_losses_of_one_process(tmp_path: Path) -> None:
    # executions deeper than the 1,024-token budget (the packer plans pieces; --chunk-tokens cuts
    # further): trained by one process, then by a group of 2 ranks that shard the model (FSDP2)
    records = write_records(tmp_path / "agents.jsonl", executions=4, turns=6, tool_tokens=200, output_tokens=16)
    args = ("--records", str(records), "--steps", "2", "--token-budget", "1024", "--chunk-tokens", "512")
    one = steps_of(replay(tmp_path / "one", *args))
    two = steps_of(replay(tmp_path / "two", *args, "--shards", "2"))
    assert len(one) == len(two) == 2
    for a, b in zip(one, two):
        assert a["trained_tokens"] == b["trained_tokens"] == a["trainable_tokens"] > 0
        assert a["processed_tokens"] == b["processed_tokens"] > 1024
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
        assert set(b["peak_rss_mib"]) == {"trajectory", "trainer", "trainer/0", "trainer/1"}
        assert all(v > 0 for v in b["peak_rss_mib"].values())
    proc = replay(tmp_path / "bad", "--records", str(records), "--shards", "0")
    assert proc.returncode == 2 and proc.stderr.strip() == "gyre replay: --shards must be at least 1, got 0"


def test_deep_trees_train_at_tree_cost_in_pieces_with_the_losses_of_context_chunks(tmp_path: Path) -> None:
    # executions ~1,600 tokens deep with a retry of the last turn and a sub-agent forked from the whole
    # main context (branches far below the 512-token budget), beside a compaction: in DFS pieces every
    # tree token is computed once; cut into chunks, each chunk carries its root path again
    records = write_records(tmp_path / "deep.jsonl", executions=2, turns=7, tool_tokens=200, output_tokens=16,
                            deep=True)
    args = ("--records", str(records), "--token-budget", "512", "--chunk-tokens", "512")
    (pieces,) = steps_of(replay(tmp_path / "pieces", *args))
    (context,) = steps_of(replay(tmp_path / "context", *args, "--tree-split", "context"))
    assert pieces["processed_tokens"] == pieces["tree_tokens"] == context["tree_tokens"] < pieces["naive_tokens"]
    assert context["processed_tokens"] > 1.5 * context["tree_tokens"]  # the context copies
    assert pieces["trained_tokens"] == context["trained_tokens"] == pieces["trainable_tokens"] > 0
    assert pieces["loss"] == pytest.approx(context["loss"], rel=1e-4)
    # a kv budget below the trees' size (2,192 tokens, 1,927 deep): cut into chunks of at most 1,024
    # tokens whose root paths are recomputed instead of kept, each trained in pieces. The main context
    # is deeper than the budget, so every chunk of it carries its whole root path: what context
    # chunks of 1,024 cost (a token's keys/values need all its ancestors'); the same loss
    (capped,) = steps_of(replay(tmp_path / "capped", *args, "--kv-budget-tokens", "1024"))
    assert capped["processed_tokens"] == 2 * 5400 > pieces["processed_tokens"]
    assert capped["loss"] == pytest.approx(pieces["loss"], rel=1e-4)
    proc = replay(tmp_path / "bad", "--records", str(records), "--tree-split", "copies")
    assert proc.returncode == 2 and "--tree-split: invalid choice: 'copies'" in proc.stderr


def test_a_bad_record_is_one_sentence_naming_its_line_and_starts_nothing(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"execution_id": "a", "prompt_ids": [1, 2], "output_ids": [3], "reward": 1}\n'
                   '{"execution_id": "a", "call_id": "c", "prompt_ids": [1], "output_ids": [2, 3], '
                   '"output_logprobs": [-1]}\n')
    proc = replay(tmp_path, "--records", str(bad))
    assert proc.returncode == 2 and proc.stdout == ""
    assert "line 2" in proc.stderr and "equally long" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "data").exists()  # nothing was started
    unscored = tmp_path / "unscored.jsonl"
    unscored.write_text('{"execution_id": "a", "prompt_ids": [1, 2], "output_ids": [3]}\n')
    proc = replay(tmp_path, "--records", str(unscored))
    assert proc.returncode == 2 and "has no reward" in proc.stderr
