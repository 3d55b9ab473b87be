"""`gyre run` on the real stack (every service a process, own redis-server), kept short.

Asserts the pipeline, not the learning (that is `make run`'s job, measured in its report):
executions complete, TITO records arrive and are packed as trees, steps are applied and the weight
version advances, cells switch ROLLOUT->TRAIN mid-run, and in-flight requests are migrated (an
operator's `cordon` of a busy rollout cell makes the policy drain one, see tests/support/cordoner.py).

A background client keeps long generations in flight on the gateway, as a long-context harness
call would, so a drain has something to migrate (that a migrated continuation is token-identical
is tested in tests/service/test_rollout_migration.py); each of its calls must still complete.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from services.run import TASK_FILES, RunConfig, run_job
from services.scheduler.jobfile import load_job
from tests.support.cordoner import Cordoner
from tests.support.jobs import SMALL_TASKS
from tests.support.longcalls import LongCalls


@pytest.mark.timeout(900)
def test_gyre_run_elastic_small(tmp_path: Path) -> None:
    cfg = RunConfig(engines=2, harness_concurrency=8, time_budget_s=600, report_dir=str(tmp_path / "report"),
                    data_dir=str(tmp_path / "data"), quiet=True)
    spec = load_job(TASK_FILES["xlong"][0], [*SMALL_TASKS, "--mode", "elastic", "--num_steps", "2", "--groups_per_step", "4",
                                             "--group_size", "2", "--evaluation.tasks", "4", "--evaluation.every", "1"])
    lines: list[str] = []
    long_calls = LongCalls()
    # an operator cordons a busy rollout cell mid-step: the policy drains it (its requests migrate)
    # and moves it to training, whether or not it would have freed a busy cell on its own
    cordoner = Cordoner(long_calls=long_calls)
    result = run_job(cfg, spec, echo=lambda m: (lines.append(m), long_calls.maybe_start(m), cordoner.on_line(m)))
    long_calls.stop()
    cordoner.stop()

    assert result.final_state == "completed", lines
    assert len(result.steps) == spec.num_steps
    assert result.weight_version == spec.num_steps  # one published version per step
    for row in result.steps:
        assert row["tree_tokens"] > 0 and row["naive_tokens"] >= row["tree_tokens"]
    assert any(s["from"] == "rollout" and s["to"] == "train" for s in result.switches), result.switches
    assert all(s["duration_s"] > 0 for s in result.switches), result.switches
    assert not cordoner.error and cordoner.migrated >= 1, (cordoner.error, cordoner.cordons)
    assert sum(result.migrations.values()) >= 1, result.migrations
    assert long_calls.completed >= 1 and long_calls.failed == 0
    assert [e["step"] for e in result.evals] == [0, 1, 2]  # the scheduler's rounds: start, each step, end
    assert all(0.0 <= e["heldout_pass_rate"] <= 1.0 and e["tasks"] == 4 for e in result.evals)
    report = Path(result.report or "")
    assert report.exists() and (report.parent / "cell_timeline.png").exists()
    kinds = [json.loads(x)["kind"] for x in (report.parent / "metrics.jsonl").read_text().splitlines()]
    assert "switch" in kinds and kinds.count("step") == spec.num_steps
    # the trained policy: a model directory with the trainer's last checkpoint's weights
    from safetensors.torch import load_file

    assert result.policy == tmp_path / "report" / "policy", lines
    info = json.loads((result.policy / "gyre_policy.json").read_text())
    assert info["job_id"] == result.job_id and info["weight_version"] == spec.num_steps
    from services.trainer.checkpoint import load_weights

    got, want = load_file(str(result.policy / "model.safetensors")), load_weights(info["checkpoint"])
    assert got.keys() == want.keys() and all(got[k].equal(want[k]) for k in want)
    assert any(line.startswith(f"policy: {result.policy}") for line in lines), lines
    # the stack's KV migration key signed every migration above and is in no log line
    data = tmp_path / "data" / "elastic"
    key = (data / "secrets" / "kv.key").read_text().strip()
    assert len(key) == 64 and (data / "secrets" / "kv.key").stat().st_mode & 0o077 == 0
    logs = list((data / "logs").glob("*.log"))
    assert logs and not [p.name for p in logs if key in p.read_text(errors="replace")]
    assert all(line.startswith("{") for p in logs if p.name != "redis.log"
               for line in p.read_text(errors="replace").splitlines() if line.strip()), "a log line is not JSON"


@pytest.mark.timeout(900)
def test_gyre_run_arith_task_pipeline(tmp_path: Path) -> None:
    """`--task arith` on the real stack: the harness runs the arithmetic chat through the served
    model's chat template, the reward service grades answers.json with the builtin arith-v1 scorer
    (partial credit per turn), trees are packed and a step is applied. The built-in tiny model
    stands in for SmolLM2 here (same code path, seconds instead of minutes): its word-level
    tokenizer maps the questions' words to <unk>, which the pipeline does not care about."""
    from services.reward.client import RewardClient

    job_file, config = TASK_FILES["arith"]
    cfg = RunConfig(engines=2, harness_concurrency=4, time_budget_s=600, report_dir=str(tmp_path / "report"),
                    data_dir=str(tmp_path / "data"), quiet=True)
    spec = load_job(job_file, ["--model", "builtin-tiny", "--tasks.params.turns", "2", "--tasks.params.max_operand",
                               "9", "--num_steps", "1", "--groups_per_step", "2", "--group_size", "2",
                               "--evaluation.tasks", "2", "--evaluation.every", "1",
                               "--algorithm.learning_rate", "1e-4"])
    lines: list[str] = []
    reward_address: list[str] = []
    scores: list[object] = []

    def echo(m: str) -> None:
        lines.append(m)
        if m.startswith("reward "):
            reward_address.append(m.split()[1])
        if m.startswith("report: "):  # the job is over, the stack still up: read the scores
            with RewardClient(reward_address[0]) as rew:
                scores.extend(rew.get_score(f"{spec.job_id}.s0.g{g}.e{e}") for g in range(2) for e in range(2))

    result = run_job(cfg, spec, echo=echo, config_path=config)
    assert result.final_state == "completed", lines
    assert len(result.steps) == 1 and result.weight_version == 1
    assert result.steps[0]["tree_tokens"] > 0
    assert len(scores) == 4
    for s in scores:
        assert s.scorer == "builtin:arith-v1" and s.status == "finished"  # type: ignore[attr-defined]
        assert s.reward in (0.0, 0.5, 1.0) and s.outcome_reported  # type: ignore[attr-defined]
    assert [e["step"] for e in result.evals] == [0, 1] and all(e["tasks"] == 2 for e in result.evals)


@pytest.mark.timeout(600)
def test_gyre_run_colocate_alternates_the_whole_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Colocate on the real stack: the pool goes ROLLOUT -> TRAIN after each step's rollouts and
    back for the next step, although the trainer opens the next step (and the replicas on the
    pool join it) right after publishing: the release must not wait for that step's end, whose
    batches only these cells can produce.

    The cell daemons heartbeat every 6 s here, so when a step's rollouts end the cells' reported
    in-flight counts are still those of the calls just finished (what a loaded CI machine made
    happen by chance): the whole pool must move on the job's own counters, not on those.

    The scheduler ticks every 50 ms here (0.5 s by default). A step of this small job can end, train
    its last micro-batch on the core and publish within one 0.5 s tick; the policy then rightly moves
    nothing (the update is done), and a run whose steps all did that had no switch to check (CI, once).
    Publishing takes more than 50 ms (the last micro-batch, the optimizer, the weights to both
    engines), so every step's idle moment is seen."""
    monkeypatch.setenv("GYRE_CELL_DAEMON_HEARTBEAT_INTERVAL_S", "6")
    monkeypatch.setenv("GYRE_SCHEDULER_TICK_INTERVAL_S", "0.05")
    cfg = RunConfig(engines=2, harness_concurrency=8, time_budget_s=500, report_dir=str(tmp_path / "report"),
                    data_dir=str(tmp_path / "data"), quiet=True)
    spec = load_job(TASK_FILES["xlong"][0], [*SMALL_TASKS, "--mode", "colocate", "--staleness_bound", "0",
                                             "--num_steps", "2",
                                             "--groups_per_step", "4", "--group_size", "4", "--evaluation.tasks", "2",
                                             "--evaluation.every", "1"])
    lines: list[str] = []
    result = run_job(cfg, spec, echo=lines.append)
    assert result.final_state == "completed", lines
    assert len(result.steps) == 2 and result.weight_version >= 2
    back = [s for s in result.switches if s["from"] == "train" and s["to"] == "rollout"]
    assert any(s["from"] == "rollout" and s["to"] == "train" for s in result.switches), result.switches
    assert len(back) >= 2, result.switches
    # a pool held in TRAIN would leave the next step's calls without an engine until they fail
    assert result.outcomes == {"finished": 2 * 16}, result.outcomes


@pytest.mark.timeout(900)
def test_gyre_run_harness_openai_agents(tmp_path: Path) -> None:
    """`gyre run --harness openai-agents`: the built-in harness workers hand each execution of the
    tool-calling task to an unmodified openai-agents Agent (its chat-completions model, pointed at
    the lease's session base URL; the task's tools executed on the workspace). Its calls are
    recorded as TITO, packed and trained; reward grades the workspaces it wrote. A quickly
    warm-started tool model stands in for builtin-tools (same code path)."""
    from services.run import load_run
    from services.task.tool_model import ToolModelSpec

    result, ended = _run_through_loop(tmp_path, "openai-agents", ToolModelSpec(
        corpus_tasks=20, demo_tasks=40, snippet_steps=40, sft_steps=20, shell_demo_tasks=0,
        smolagents_demo_tasks=0, claude_code_demo_tasks=0))
    assert [e["step"] for e in result.evals] == [0, 1]
    assert sum(e["tool_calls"] for e in ended) > 0  # the Agent called the task's tools
    with pytest.raises(ValueError, match="not available"):
        load_run(["--harness", "aider"])


@pytest.mark.timeout(900)
def test_gyre_run_harness_smolagents(tmp_path: Path) -> None:
    """`gyre run --harness smolagents`: each execution is run by smolagents' unmodified
    ToolCallingAgent (its OpenAIServerModel pointed at the lease's session URL; tool_choice
    required every turn, so every reply goes through the engine's grammar for a forced call). A
    quickly warm-started tool model that has seen that loop's conversation stands in for
    builtin-tools. Its calls are recorded as TITO, packed and trained; and its forced calls come
    back as calls of the task's tools, not just smolagents' final_answer (a grammar that forced
    another argument order than the tool's ended every execution after one call)."""
    from services.task.tool_model import ToolModelSpec

    _, ended = _run_through_loop(tmp_path, "smolagents", ToolModelSpec(
        corpus_tasks=20, demo_tasks=20, snippet_steps=40, sft_steps=30, shell_demo_tasks=0,
        smolagents_demo_tasks=10, claude_code_demo_tasks=0))
    assert sum(e["tool_calls"] for e in ended) > 0, ended  # the task's tools ran on the workspaces
    assert all(e["status"] in ("finished", "timeout") for e in ended), ended


@pytest.mark.timeout(900)
def test_gyre_run_harness_mini_swe_agent(tmp_path: Path) -> None:
    """`gyre run --harness mini-swe-agent`: each execution of the tool-calling task is run by the
    pinned, unmodified mini-swe-agent CLI (its own process, its model the lease's session URL) whose
    bash commands run in bubblewrap, where ``gyre-task`` reaches the execution's tools. Its calls
    are recorded as TITO, packed and trained; reward grades the workspaces its commands wrote. A
    quickly warm-started tool model (with shell demonstrations) stands in for builtin-tools."""
    import shutil

    from services.task.clis import MINI_SWE_AGENT, CliUnavailable
    from services.task.tool_model import ToolModelSpec
    from tests.support.clis import pip_cli

    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (make install)")
    try:
        pip_cli(*MINI_SWE_AGENT)  # installed once per checkout (the loop would install it on first use)
    except CliUnavailable as exc:
        pytest.skip(str(exc))
    _, ended = _run_through_loop(tmp_path, "mini-swe-agent", ToolModelSpec(
        corpus_tasks=20, demo_tasks=20, snippet_steps=40, sft_steps=30, shell_demo_tasks=40,
        smolagents_demo_tasks=0, claude_code_demo_tasks=0))
    # its model's bash calls ran gyre-task in the sandbox (a model this briefly warm-started often
    # gets the arguments wrong: those get the usage error, and count here too)
    assert sum(e["events"].get("gyre_task_commands", 0) for e in ended) > 0, ended
    assert all(e["status"] in ("finished", "timeout") for e in ended), ended


@pytest.mark.timeout(900)
def test_gyre_run_harness_claude_code(tmp_path: Path) -> None:
    """`gyre run --harness claude-code`: each execution is run by the pinned, unmodified Claude
    Code CLI (`claude -p`, its Anthropic base URL the lease's session URL) in bubblewrap, where its
    only network is a loopback port bridged to the gateway and ``gyre-task`` reaches the
    execution's tools. Its Messages calls are recorded as TITO, packed and trained, and reward
    grades the workspaces. A quickly warm-started tool model that has seen that CLI's conversation
    (services.task.claude_code_dialect) stands in for builtin-tools."""
    import shutil

    from services.task.clis import CLAUDE_CODE, CliUnavailable
    from services.task.tool_model import ToolModelSpec
    from tests.support.clis import npm_cli

    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (make install)")
    try:
        npm_cli(*CLAUDE_CODE)  # installed once per checkout (the loop would install it on first use)
    except CliUnavailable as exc:
        pytest.skip(str(exc))
    result, ended = _run_through_loop(tmp_path, "claude-code", ToolModelSpec(
        corpus_tasks=20, demo_tasks=20, snippet_steps=40, sft_steps=40, shell_demo_tasks=0,
        smolagents_demo_tasks=0, claude_code_demo_tasks=30))
    assert all(e["status"] in ("finished", "timeout") for e in ended), ended
    # every execution's CLI called the model through the bridge and ended by its own rules: its
    # reply (exit 0) or its --max-turns (exit 1, error_max_turns: a greedy held-out execution of a
    # model this briefly warm-started can repeat a command until then); never an API error
    assert all(e["events"].get("final_reply", 0) + e["events"].get("turn_cap", 0) == 1
               and e["events"].get("claude-code_exit_0", 0) + e["events"].get("claude-code_exit_1", 0) == 1
               for e in ended), ended
    # (whether this briefly warm-started model's Bash calls reach gyre-task varies from build to build:
    # tests/service/test_cli_sandbox.py checks the sandbox's gyre-task and bridge deterministically)
    assert [e["step"] for e in result.evals] == [0, 1] and result.steps[0]["tree_tokens"] > 0


def _run_through_loop(tmp_path: Path, loop: str, model_spec: Any) -> tuple[Any, list[dict[str, Any]]]:
    """`gyre run --harness LOOP` on a quickly warm-started tool model (standing in for
    builtin-tools, same code path): one step of 2 groups x 2 on 2-module tasks, 2 held-out tasks
    before and after. Checks the job completed and trained one step, and that every execution
    (4 trained + 2 x 2 held-out) ended through ``loop``; returns the result and those log lines."""
    import dataclasses

    from services.run import load_run
    from services.task.tool_model import ensure_tool_model

    model = ensure_tool_model(tmp_path / "models", spec=model_spec)
    run, spec, config = load_run(["--harness", loop, "--model", str(model), "--num_steps", "1",
                                  "--groups_per_step", "2", "--group_size", "2", "--evaluation.tasks", "2",
                                  "--evaluation.every", "1", "--tasks.params.num_modules", "2"])
    assert run.harness_loop == loop and spec.tasks.generator == "xlong-tools-v1"  # --task tools implied
    assert spec.harness == "builtin"  # the built-in workers run the executions, through that loop
    run = dataclasses.replace(run, engines=1, harness_concurrency=4, time_budget_s=600, quiet=True,
                              report_dir=str(tmp_path / "report"), data_dir=str(tmp_path / "data"))
    lines: list[str] = []
    result = run_job(run, spec, echo=lines.append, config_path=config)
    assert result.final_state == "completed", lines
    assert len(result.steps) == 1 and result.weight_version == 1 and result.steps[0]["tree_tokens"] > 0
    ended = [json.loads(x) for x in (tmp_path / "data" / "elastic" / "logs" / "harness.log").read_text().splitlines()
             if '"execution ended"' in x]
    assert len(ended) == 4 + 2 * 2 and all(e["loop"] == loop for e in ended), ended
    return result, ended


@pytest.mark.timeout(900)
def test_gyre_run_sharded_trains_on_a_group_and_cells_join_as_replica_groups(tmp_path: Path) -> None:
    """`gyre run --shards 2` in colocate mode: the trainer is a group of 2 ranks (FSDP2), and the pool's
    cells, moved to training after each step's rollouts, join as replica groups of 2 ranks each."""
    from services.run import load_run

    cfg, spec, _ = load_run(["--shards", "2", "--mode", "colocate", "--staleness_bound", "0", *SMALL_TASKS,
                             "--num_steps", "2", "--groups_per_step", "4", "--group_size", "2",
                             "--evaluation.tasks", "2", "--evaluation.every", "2", "--engines", "2",
                             "--harness_concurrency", "8", "--quiet", "true", "--logger", "tensorboard,mlflow"])
    cfg = dataclasses.replace(cfg, time_budget_s=600, report_dir=str(tmp_path / "report"),
                              data_dir=str(tmp_path / "data"))
    assert spec.shards == 2
    lines: list[str] = []
    result = run_job(cfg, spec, echo=lines.append)
    assert result.final_state == "completed", lines
    assert len(result.steps) == 2 and result.weight_version == 2
    assert any(s["from"] == "rollout" and s["to"] == "train" for s in result.switches), result.switches
    logs = tmp_path / "data" / "colocate" / "logs"
    ranks = sorted(p.name for p in logs.rglob("trainer-*-rank1.log"))
    assert any("-replica" not in n for n in ranks) and any("-replica" in n for n in ranks), ranks
    worlds = [int(row.get("world_size", 0)) for row in result.steps]
    assert max(worlds) >= 2, result.steps  # a replica group took part in a step's all-reduce
    # the trainer's figures of each step went into the job's events, and from them into the trackers
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "report" / "tensorboard" / result.job_id))
    acc.Reload()
    assert [s.step for s in acc.Scalars("trainer/loss")] == [0, 1]
    assert [s.value for s in acc.Scalars("trainer/shards")] == [2.0, 2.0]
    assert [s.step for s in acc.Scalars("heldout/pass_rate")] == [0, 2]
    assert (tmp_path / "report" / "mlruns").is_dir()
