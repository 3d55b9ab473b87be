"""The built-in tool-calling agent: one execution of a built-in task through its tools.

The same loop any tool-calling harness runs (system + tools, the task message, then model call ->
tool call -> tool result until the model replies without a call), on token ids: each turn is
rendered as the tool model's chat template renders it (services.task.tool_tokenizer) and the
model's output ids go into the next prompt verbatim. Around the loop, the harness mechanisms of
an XLong execution, as in the word-level agent (services.task.agent):

    main agent ──open_module m1──> write_line per step ──run_tests──> result ──> open_module m2 ...
         │             └─(fail, fix turns used) RETRY: back to the prompt that opened the module
         ├──open_module of every `delegate_every`-th module──> SUB-AGENT (own context, that module
         │                                                     only) ──> "subagent m3 pass 2 / 2"
         └──context over `context_limit_tokens`──> SUMMARY call ──> fresh context: system, task,
                                                   the summary's ids, the pending tool result
    past the deadline: stop, status `timeout`; the workspace so far is scored partially.

A reply without a call ends that agent (the main agent's ends the execution). A malformed call
gets an ``error`` tool result and the loop goes on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from services.common.roles import AgentRoleName
from services.task.agent import (
    ExecutionCancelled,
    ExecutionResult,
    ExecutionTimeout,
    ModelCaller,
    ModelClient,
)
from services.task.spec import TaskSpec
from services.task.tool_env import (
    INSTRUCTIONS,
    TOOLS,
    Scope,
    ToolTask,
    parse_call,
    subagent_message,
    task_message,
)
from services.task.tool_tokenizer import IM_END, IM_START, ToolCodec, render_system, render_turn

__all__ = ["ToolAgentConfig", "run_tool_execution", "SUMMARIZE"]

SUMMARIZE = "summarize"


@dataclass(frozen=True, kw_only=True)
class ToolAgentConfig:
    """Knobs of the tool-calling agent (with the task's knobs they set the horizon)."""

    context_limit_tokens: int = 512
    """A context longer than this is compacted (summary call, then a fresh context)."""
    max_new_tokens: int = 48
    """Generation cap of a tool call (the longest well-formed one is about 30 tokens)."""
    summary_max_new_tokens: int = 32
    """Generation cap of a summary call."""
    fix_turns: int = 1
    """Failing test runs per module that point back at it (the agent reopens and rewrites it)."""
    retries: int = 1
    """Fresh branches from the prompt that opened a module, after its fix turns failed."""
    delegate_every: int = 3
    """Every n-th module is built by a sub-agent with its own context; 0 disables delegation."""
    temperature: float = 1.0
    """Sampling temperature; 0 is greedy (then retries are skipped: they would repeat themselves)."""
    timeout_s: float = 120.0
    """Wall-clock budget of one execution; past it the execution ends as `timeout`."""
    calls_per_step: int = 6
    """An agent stops after this many calls per step of its modules (a model that never replies
    without a call cannot loop forever)."""

    def __post_init__(self) -> None:
        if self.context_limit_tokens < 256:
            raise ValueError(f"context_limit_tokens must be >= 256, got {self.context_limit_tokens}.")
        if not 8 <= self.max_new_tokens <= 1024 or not 1 <= self.summary_max_new_tokens <= 1024:
            raise ValueError("max_new_tokens must be in [8, 1024] and summary_max_new_tokens in [1, 1024].")
        if self.fix_turns < 0 or self.retries < 0 or self.delegate_every < 0 or self.calls_per_step < 2:
            raise ValueError("fix_turns, retries and delegate_every must be >= 0, calls_per_step >= 2.")
        if self.temperature < 0 or self.timeout_s <= 0:
            raise ValueError("temperature must be >= 0 and timeout_s > 0.")


class _ToolExecution:
    def __init__(self, task: TaskSpec, codec: ToolCodec, config: ToolAgentConfig, caller: ModelCaller,
                 on_progress: Callable[[dict[str, bytes]], None] | None) -> None:
        self.task, self.codec, self.cfg, self.call = task, codec, config, caller
        self.result = caller.result
        self.on_progress = on_progress
        self.env = ToolTask(task, fix_turns=config.fix_turns, delegate_every=config.delegate_every)
        self.system = codec.encode(render_system(INSTRUCTIONS, TOOLS))

    def _append(self, ctx: np.ndarray, head: np.ndarray, turn: str, agent_id: str) -> np.ndarray:
        """``ctx`` (ending in the model's end-of-turn id) + the newline and ``turn``, compacted
        first when that would pass the context limit."""
        piece = self.codec.encode(turn)
        if len(ctx) + 1 + len(piece) + self.cfg.max_new_tokens <= self.cfg.context_limit_tokens:
            return np.concatenate([ctx, self.codec.encode("\n"), piece])
        ask = np.concatenate([ctx, self.codec.encode("\n" + render_turn("user", SUMMARIZE, generation_prompt=True))])
        summary = self.call(ask, agent_id, "summary", self.cfg.summary_max_new_tokens)
        self.result.events["compactions"] += 1
        return np.concatenate([head, self.codec.encode(f"{IM_START}user\nsummary "), summary[:-1],
                               self.codec.encode(f"{IM_END}\n"), piece])

    def agent(self, scope: Scope, message: str, agent_id: str, role: AgentRoleName) -> None:
        """One agent's loop until it replies without a call (or runs out of calls)."""
        head = np.concatenate([self.system, self.codec.encode(render_turn("user", message))])
        ctx = np.concatenate([head, self.codec.encode(f"{IM_START}assistant\n")])
        opened: dict[str, np.ndarray] = {}  # module -> the prompt of the call that opened it
        branches: dict[str, int] = {}
        steps = sum(len(self.task.module(m).steps) + 2 for m in scope.modules)
        for _ in range(self.cfg.calls_per_step * steps):
            out = self.call(ctx, agent_id, role, self.cfg.max_new_tokens)
            prompt, ctx = ctx, np.concatenate([ctx, out])
            text = self.codec.decode(out)
            call = parse_call(text)
            if call is None:
                if "<tool_call>" not in text:
                    return  # a reply without a call: this agent is done
                self.result.events["bad_calls"] += 1
                result = f"error : the call is not valid json . {self.env.hint(scope)}"
            else:
                name, args = call
                res = self.env.call(name, args, scope)
                module = res.module
                if name == "open_module" and module and not res.delegate:
                    opened.setdefault(module, prompt)
                if res.delegate:
                    self.result.events["subagents"] += 1
                    sub = self.task.module(module)
                    self.agent(Scope((module,), subagent=True), subagent_message(sub), f"sub-{module}", "subagent")
                    result = f"{self.env.subagent_report(module)} . {self.env.after(module, scope)}"
                elif (res.final_fail and branches.get(module, 0) < self.cfg.retries and self.cfg.temperature > 0
                      and module in opened):
                    branches[module] = branches.get(module, 0) + 1
                    self.result.events["retries"] += 1
                    self.env.restart_branch(module)
                    ctx = opened[module]  # same prefix, a new branch
                    continue
                else:
                    result = res.text
                    if res.run is not None and res.run.passed < res.run.total and not res.final_fail:
                        self.result.events["fix_turns"] += 1
                if res.run is not None or res.delegate:
                    self._progress()
            ctx = self._append(ctx, head, render_turn("tool", result, generation_prompt=True), agent_id)
        self.result.events["call_cap"] += 1

    def _progress(self) -> None:
        self.env.export(self.result)
        if self.on_progress is not None:
            # Preserve the workspace as it grows: a timeout or a crash later is scored on it.
            self.on_progress(dict(self.result.files))

    def run(self) -> ExecutionResult:
        try:
            self.agent(Scope(tuple(m.name for m in self.task.modules)), task_message(self.task), "main", "main")
        except ExecutionTimeout:
            self.result.status = "timeout"
        except ExecutionCancelled:
            self.result.status = "failed"
            self.result.error = "cancelled"
        self.env.export(self.result)
        return self.result


def run_tool_execution(
    task: TaskSpec,
    client: ModelClient,
    *,
    codec: ToolCodec,
    config: ToolAgentConfig = ToolAgentConfig(),
    job_id: str = "",
    execution_id: str,
    deadline_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    on_progress: Callable[[dict[str, bytes]], None] | None = None,
    cancelled: threading.Event | None = None,
) -> ExecutionResult:
    """Run one execution to its end (finished, timeout, or failed when `cancelled` is set); errors
    of the client propagate. `deadline_s` is on `clock`'s scale (default now + config.timeout_s,
    the earlier of the two when both are given); `on_progress(files)` after each test run."""
    own = clock() + config.timeout_s
    deadline_s = own if deadline_s is None else min(deadline_s, own)
    result = ExecutionResult(status="finished", files={})
    caller = ModelCaller(client=client, eos_id=codec.eos_id, temperature=config.temperature, job_id=job_id,
                         execution_id=execution_id, deadline_s=deadline_s, clock=clock, cancelled=cancelled,
                         result=result)
    return _ToolExecution(task, codec, config, caller, on_progress).run()
