"""What a task family's runner gets and gives: the harness it runs in, and how its execution ended.

A family's ``runner`` (services.task.registry.TaskFamily) is
``fn(host: RunnerHost, lease, task_id, *, preserve, cancelled) -> RunOutcome``. The built-in
harness process (services.harness) is the host; runners only see this interface, so the task
package never imports the harness (layers point down: the harness imports the task).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from services.task.agent import AgentConfig, ModelClient
from services.task.tokenizer import Codec
from services.task.tool_agent import ToolAgentConfig
from services.task.tool_tokenizer import ToolCodec

__all__ = ["RunOutcome", "RunnerConfig", "RunnerHost"]


@dataclass(frozen=True, kw_only=True)
class RunOutcome:
    """How one execution ended, as a family's runner reports it to the harness."""

    status: str
    """finished, timeout or failed (services.scheduler.jobs.ExecState)."""
    error: str = ""
    files: dict[str, bytes] = field(default_factory=dict)
    """The final workspace, sent to reward before scoring."""
    log: dict[str, Any] = field(default_factory=dict)
    """Extra fields of the "execution ended" log line (token counts, turns, ...)."""


class RunnerConfig(Protocol):
    """The harness settings runners read (services.harness.config.HarnessConfig has them)."""

    @property
    def timeout_s(self) -> float: ...
    @property
    def loop(self) -> str: ...
    @property
    def fix_turns(self) -> int: ...
    @property
    def agent(self) -> AgentConfig: ...


class RunnerHost(Protocol):
    """The harness a runner runs in (services.harness.harness.Harness)."""

    @property
    def cfg(self) -> RunnerConfig: ...
    @property
    def model(self) -> ModelClient: ...

    def temperature(self, lease: Any) -> float: ...
    def record_job(self, lease: Any) -> str: ...
    def codec_for(self, lease: Any) -> Codec: ...
    def tool_codec_for(self, lease: Any) -> ToolCodec: ...
    def chat_tokenizer_for(self, lease: Any) -> Any: ...
    def tool_agent_config(self, *, temperature: float) -> ToolAgentConfig: ...
