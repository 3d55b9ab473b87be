"""The built-in harness end to end over real services: a real scheduler (job with the xlong-v1
task source), a real rollout gateway + TorchEngine serving a quickly warm-started built-in model,
a real reward service and a real trajectory service. The gateway's TITO records must show the
branching the harness exists for: compaction (summary calls and fresh contexts), sub-agents
(own contexts) and retries (a prompt repeated exactly: same prefix, new branch)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from services.reward.client import RewardClient
from services.reward.config import RewardConfig
from services.reward.main import build_reward
from services.scheduler.jobs import ExecState, Mode, TaskSource, TimeoutPolicy
from services.scheduler.orchestrator import Orchestrator
from services.harness.config import HarnessConfig
from services.harness.harness import Harness
from services.task.gateway_client import common_prefix_len
from services.task.model import BuiltinModelSpec, ensure_builtin_model
from services.task.tokenizer import Codec
from services.common.roles import AgentRole
from services.trajectory.config import TrajectoryConfig
from services.trajectory.main import build_trajectory
from tests.service.scheduler_support import in_process_scheduler, job_spec, wait_until
from tests.support.rollout_cluster import start_engine, start_gateway

torch.set_num_threads(1)


class _NoActuator:
    def switch(self, *args: object, **kw: object) -> None:
        raise AssertionError("no switch expected: no cells are registered")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A short warm start: good enough to follow the format, bad enough to fail and retry often.
    return ensure_builtin_model(tmp_path_factory.mktemp("models"),
                                spec=BuiltinModelSpec(demo_tasks=40, snippet_steps=20, sft_steps=20, batch_size=16))


@pytest.fixture(scope="module")
def tool_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from services.task.tool_model import ToolModelSpec, ensure_tool_model

    # A short warm start: it writes well-formed calls often enough, and fails and retries often.
    return ensure_tool_model(tmp_path_factory.mktemp("models"),
                             spec=ToolModelSpec(corpus_tasks=20, demo_tasks=40, snippet_steps=40, sft_steps=20,
                                               shell_demo_tasks=0, smolagents_demo_tasks=0, claude_code_demo_tasks=0))


@pytest.fixture
def stack(redis_url: str, tmp_path: Path, model_dir: Path) -> Iterator[dict]:
    yield from _stack(redis_url, tmp_path, model_dir)


@pytest.fixture
def tool_stack(redis_url: str, tmp_path: Path, tool_model_dir: Path) -> Iterator[dict]:
    yield from _stack(redis_url, tmp_path, tool_model_dir)


def _stack(redis_url: str, tmp_path: Path, model_dir: Path) -> Iterator[dict]:
    tcfg = TrajectoryConfig(redis_url=redis_url, spool_dir=str(tmp_path / "tspool"), port=0, log_json=False)
    traj, _ = build_trajectory(tcfg)
    traj.start()
    traj.set_serving(True)
    rcfg = RewardConfig(redis_url=redis_url, spool_dir=str(tmp_path / "rspool"), port=0, scorer_workers=1,
                        trajectory_address=traj.address, log_json=False)
    reward, reward_shutdown = build_reward(rcfg)
    reward.start()
    reward.set_serving(True)
    engine = start_engine("cell-h", checkpoint=model_dir)
    gw = start_gateway()
    gw.client().register_engine(engine.cell_id, engine.address)
    with in_process_scheduler(redis_url) as sched:
        yield {"scheduler": sched, "gateway": gw, "reward": reward.address, "trajectory": traj.address}
    gw.stop()
    engine.stop()
    reward_shutdown()
    reward.stop(0)
    traj.stop(0)


def test_harness_runs_executions_with_compaction_subagents_and_retries(stack: dict, model_dir: Path) -> None:
    sched, gw = stack["scheduler"], stack["gateway"]
    spec = job_spec("hj", model=str(model_dir), num_steps=1, groups_per_step=2, group_size=2, mode=Mode.COLOCATE,
                    timeout_policy=TimeoutPolicy.ZERO,
                    tasks=TaskSource(generator="xlong-v1", params=(("num_modules", "4"), ("min_ops", "2"))))
    sched.client.submit_job(spec)
    # The orchestrator enqueues the step's executions (no cells are registered: no switches).
    orch = Orchestrator(sched.state, _NoActuator(), instance_id="t", metrics_event_interval_s=3600)
    assert orch.tick()
    # this harness id's predecessor died holding a lease (its TTL is 30 s): the harness gives it up first
    dead = sched.client.lease("hj-harness", job_id="hj")
    assert dead is not None
    cfg = HarnessConfig(scheduler=sched.server.address, gateway=gw.address, reward=stack["reward"], concurrency=2,
                        job_id="hj", harness_id="hj-harness", lease_wait_s=0.5, max_executions=4, context_limit_tokens=96,
                        delegate_every=2, fix_turns=1, retries=1, temperature=1.0, log_json=False)
    from services.rollout.client import GatewayClient
    from services.scheduler.client import SchedulerClient

    harness = Harness(cfg, scheduler=SchedulerClient(cfg.scheduler), gateway=GatewayClient(cfg.gateway),
                      reward=RewardClient(cfg.reward), codec=Codec.from_dir(model_dir)).start()
    orch.tick()  # the reaper re-queues the released lease
    wait_until(lambda: harness.done >= 4, timeout_s=180, what="4 executions")
    assert sched.client.get_execution(dead.execution_id).attempt == 2  # ran again at once, not after its TTL
    harness.stop()
    harness.join(30)

    by_exec: dict[str, list] = defaultdict(list)
    for rec in gw.records:
        by_exec[rec.execution_id].append(rec)
    assert len(by_exec) == 4
    reward = RewardClient(stack["reward"])
    summaries = subagent_calls = repeats = 0
    for eid, recs in by_exec.items():
        roles = [r.role for r in recs]
        summaries += roles.count(AgentRole.SUMMARY)
        subagent_calls += roles.count(AgentRole.SUBAGENT)
        keys = [r.prompt_ids.tobytes() for r in recs]
        repeats += len(keys) - len(set(keys))
        for r in recs:
            assert len(r.output_ids) == len(r.output_logprobs) and r.weight_version == 0
        # The scheduler saw the end, the reward service scored the preserved workspace.
        assert sched.client.get_execution(eid).state in (ExecState.FINISHED, ExecState.TIMEOUT)
        score = reward.get_score(eid)
        assert score.state == "ok" and score.tests_total == 16 and score.outcome_reported
        assert score.timeout_policy == "zero"  # the job's policy, read from its spec
        assert score.reward is not None and 0.0 <= score.reward <= 1.0
    assert summaries >= 4, "context limit 96 forces at least one compaction per execution"
    assert subagent_calls > 0
    assert repeats > 0, "a failed module is retried from its earlier context (an identical prompt)"
    # After a compaction the next context starts with the summary's own output ids (no re-tokenizing).
    recs = next(iter(by_exec.values()))
    i = next(k for k, r in enumerate(recs) if r.role == AgentRole.SUMMARY)
    out = recs[i].output_ids
    out = out[:-1] if len(out) and out[-1] == Codec.from_dir(model_dir).eos_id else out
    later = [r for r in recs[i + 1:] if not np.array_equal(r.prompt_ids[:len(recs[i].prompt_ids)], recs[i].prompt_ids)]
    assert any(out.tobytes() in r.prompt_ids.tobytes() for r in later)
    # Calls of one agent share their context prefix (delta-encoded on the wire, whole here).
    assert common_prefix_len(recs[0].prompt_ids, recs[1].prompt_ids) > 0


def test_harness_runs_tool_executions_through_the_gateway(tool_stack: dict, tool_model_dir: Path) -> None:
    """xlong-tools-v1: the tool agent's calls reach the engine as ChatML + <tool_call> ids, each
    agent's prompts extend its earlier calls exactly, and reward grades the workspace."""
    from services.rollout.client import GatewayClient
    from services.scheduler.client import SchedulerClient
    from services.task.tool_tokenizer import ToolCodec

    sched, gw = tool_stack["scheduler"], tool_stack["gateway"]
    spec = job_spec("tj", model=str(tool_model_dir), num_steps=1, groups_per_step=2, group_size=1,
                    mode=Mode.COLOCATE, tasks=TaskSource(generator="xlong-tools-v1", params=(("num_modules", "3"),)))
    sched.client.submit_job(spec)
    orch = Orchestrator(sched.state, _NoActuator(), instance_id="t", metrics_event_interval_s=3600)
    assert orch.tick()
    cfg = HarnessConfig(scheduler=sched.server.address, gateway=gw.address, reward=tool_stack["reward"],
                        concurrency=2, job_id="tj", lease_wait_s=0.5, max_executions=2, tool_context_limit_tokens=600,
                        delegate_every=2, temperature=1.0, log_json=False, model_dir=str(tool_model_dir))
    harness = Harness(cfg, scheduler=SchedulerClient(cfg.scheduler), gateway=GatewayClient(cfg.gateway),
                      reward=RewardClient(cfg.reward)).start()
    wait_until(lambda: harness.done >= 2, timeout_s=300, what="2 tool executions")
    harness.stop()
    harness.join(30)
    codec = ToolCodec.from_dir(tool_model_dir)
    by_exec: dict[str, list] = defaultdict(list)
    for rec in gw.records:
        by_exec[rec.execution_id].append(rec)
    assert len(by_exec) == 2
    reward = RewardClient(tool_stack["reward"])
    calls = 0
    for eid, recs in by_exec.items():
        assert sched.client.get_execution(eid).state in (ExecState.FINISHED, ExecState.TIMEOUT)
        score = reward.get_score(eid)
        assert score.state == "ok" and score.tests_total == 12
        first = codec.tok.decode(recs[0].prompt_ids.tolist(), skip_special_tokens=False)
        assert first.startswith("<|im_start|>system\nYou write GyreStack modules") and "<tools>" in first
        assert first.endswith("next open_module m1<|im_end|>\n<|im_start|>assistant\n")
        calls += sum("<tool_call>" in codec.decode(r.output_ids) for r in recs)
        main = [r for r in recs if r.role == AgentRole.MAIN]
        for prev, cur in zip(main, main[1:]):
            full = np.concatenate([prev.prompt_ids, prev.output_ids])
            # the next call extends this one, or restarts from a compaction / a retry's earlier prompt
            assert (common_prefix_len(full, cur.prompt_ids) == len(full)
                    or common_prefix_len(recs[0].prompt_ids, cur.prompt_ids) > 0)
    assert calls > 0


def _explode(harness: Harness, lease: object, task_id: str, **_kw: object) -> object:
    raise RuntimeError("a third-party loop blew up")


def test_a_runner_that_raises_ends_its_execution_as_failed(stack: dict) -> None:
    """A fault barrier: an unexpected error in a family's runner (a third-party loop's own
    exception) ends that execution as failed with the reason, and the harness goes on leasing; it
    must not die while its heartbeat renews the lease forever (which stalled a job)."""
    import json

    from services.rollout.client import GatewayClient
    from services.scheduler.client import SchedulerClient
    from services.task.registry import TaskFamily, register

    register(TaskFamily(name="explode-v1", generator="services.task.families.numbered:generate",
                        runner=f"{__name__}:_explode"))
    sched = stack["scheduler"]
    payloads = tuple(json.dumps({"task_id": f"explode-v1/{i}"}).encode() for i in range(2))
    sched.client.submit_job(job_spec("xj", num_steps=1, groups_per_step=2, group_size=1, mode=Mode.COLOCATE,
                                     tasks=TaskSource(payloads=payloads)))
    orch = Orchestrator(sched.state, _NoActuator(), instance_id="t", metrics_event_interval_s=3600)
    assert orch.tick()
    cfg = HarnessConfig(scheduler=sched.server.address, gateway=stack["gateway"].address, reward=stack["reward"],
                        concurrency=1, job_id="xj", lease_wait_s=0.5, max_executions=2, log_json=False)
    harness = Harness(cfg, scheduler=SchedulerClient(cfg.scheduler), gateway=GatewayClient(cfg.gateway),
                      reward=RewardClient(cfg.reward)).start()
    wait_until(lambda: harness.done >= 2, timeout_s=60, what="both executions ended by the one worker")
    harness.join(30)
    for ex in (f"xj.s0.g{g}.e0" for g in range(2)):
        got = sched.client.get_execution(ex)
        assert got.state == ExecState.FAILED and "a third-party loop blew up" in got.reason
