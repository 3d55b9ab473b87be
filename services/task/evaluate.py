"""Held-out evaluation of a policy on the built-in task through any `ModelClient`.

    from services.task.evaluate import evaluate
    from services.task.gateway_client import GatewayModelClient
    report = evaluate(GatewayModelClient(GatewayClient(addr)), task_ids(100, split="heldout"))
    report.pass_rate, report.mean_reward

Greedy by default (temperature 0: the harness then skips retries, which would repeat
themselves). Executions run concurrently on threads so a batching engine sees them together;
their ids are ``eval/<tag>/<task id>`` (callers pick `tag`, e.g. the weight version).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from services.task.agent import AgentConfig, ExecutionResult, ModelClient, run_execution
from services.task.scoring import score_workspace
from services.task.spec import task_from_id
from services.task.tokenizer import Codec
from services.task.tool_agent import ToolAgentConfig, run_tool_execution
from services.task.tool_tokenizer import ToolCodec

__all__ = ["EvalReport", "evaluate"]


@dataclass(frozen=True)
class EvalReport:
    """Per-task results and their means. `passed[i]`: every test of task i passes."""

    task_ids: tuple[str, ...]
    passed: tuple[bool, ...]
    rewards: tuple[float, ...]
    tests_fraction: tuple[float, ...]
    timeouts: int

    @property
    def pass_rate(self) -> float:
        return sum(self.passed) / len(self.passed) if self.passed else 0.0

    @property
    def mean_reward(self) -> float:
        return sum(self.rewards) / len(self.rewards) if self.rewards else 0.0


def evaluate(
    client: ModelClient,
    task_ids: Sequence[str],
    *,
    codec: Codec | ToolCodec | None = None,
    config: AgentConfig | ToolAgentConfig | None = None,
    temperature: float = 0.0,
    concurrency: int = 8,
    job_id: str = "",
    tag: str = "0",
) -> EvalReport:
    """Run one execution per task and grade it with the built-in scorer (all tests). A `ToolCodec`
    (a tool-calling model's tokenizer) runs the tool agent, else the word-level agent runs."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    codec = codec or Codec()
    tools = isinstance(codec, ToolCodec)
    cfg = replace(config or (ToolAgentConfig() if tools else AgentConfig()), temperature=temperature)
    if tools != isinstance(cfg, ToolAgentConfig):
        raise ValueError("a ToolCodec goes with a ToolAgentConfig, a Codec with an AgentConfig")

    def one(task_id: str) -> tuple[bool, float, float, bool]:
        task = task_from_id(task_id)
        res: ExecutionResult
        if isinstance(codec, ToolCodec) and isinstance(cfg, ToolAgentConfig):
            res = run_tool_execution(task, client, codec=codec, config=cfg, job_id=job_id,
                                     execution_id=f"eval/{tag}/{task_id}")
        else:
            assert isinstance(codec, Codec) and isinstance(cfg, AgentConfig)
            res = run_execution(task, client, codec=codec, config=cfg, job_id=job_id,
                                execution_id=f"eval/{tag}/{task_id}")
        score = score_workspace(task, res.files)
        return score.all_passed, score.reward, score.tests_fraction, res.status == "timeout"

    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, task_ids))
    return EvalReport(
        task_ids=tuple(task_ids),
        passed=tuple(r[0] for r in results),
        rewards=tuple(r[1] for r in results),
        tests_fraction=tuple(r[2] for r in results),
        timeouts=sum(r[3] for r in results),
    )
