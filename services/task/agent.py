"""The built-in XLong agent: one execution of one task, talking to the model through `ModelClient`.

The agent builds each context as a token array (prompts are never re-tokenized: a model's output
ids go into the next prompt verbatim) and works module by module:

    main context ──module m1──> one call per step (code lines) ──run tests──> report
         │                                             ──(fail) fix m1──> the steps again ──> ...
         │                                             └─(still failing) RETRY: back to the
         │                                               context before the attempt, new branch
         ├──every `delegate_every`-th module──> SUB-AGENT (own context, same loop) ──> report
         └──context over `context_limit_tokens`──> SUMMARY call ──> fresh context that starts
                                                   with the summary's ids
    the whole execution runs against a deadline: past it, stop and report `timeout`;
    the workspace so far is kept (the reward service scores it partially).

A call's branch structure is visible in its TITO records: a retry's prompt is a prefix of the
abandoned branch, a sub-agent's prompts start with its own system segment, a summary call has
role `summary`. A harness never sees cells or migrations; all it needs is `ModelClient`.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from services.common.roles import AgentRoleName
from services.task import prompts
from services.task.dsl import DslError, run_program
from services.task.scoring import ATTEMPTS_PATH
from services.task.spec import ModuleSpec, TaskSpec
from services.task.tokenizer import Codec

__all__ = [
    "AgentConfig",
    "CallContext",
    "Sampling",
    "Generation",
    "ModelClient",
    "ExecutionResult",
    "ExecutionTimeout",
    "ExecutionCancelled",
    "run_execution",
    "run_visible_tests",
    "ModelCaller",
    "TestRun",
]

EndStatus = Literal["finished", "timeout", "failed"]


@dataclass(frozen=True, kw_only=True)
class CallContext:
    """Identifies one model call (the gateway records it as a TITO record under these ids)."""

    job_id: str
    execution_id: str
    call_id: str
    agent_id: str
    role: AgentRoleName


@dataclass(frozen=True, kw_only=True)
class Sampling:
    temperature: float
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    # a fresh grammar matcher the output must follow (services.rollout.grammar.Constraint, as the
    # engine applies a request's grammar); None: unconstrained. Clients that cannot mask ignore it.
    constraint: Any = field(default=None, compare=False)


@dataclass(frozen=True, kw_only=True)
class Generation:
    """What a model call returns. Invariant: len(output_ids) == len(logprobs)."""

    output_ids: np.ndarray
    logprobs: np.ndarray
    weight_version: int
    finish_reason: str

    def __post_init__(self) -> None:
        assert len(self.output_ids) == len(self.logprobs), "one logprob per output token"


class ModelClient(Protocol):
    """The only way the agent reaches a model (the real one is the rollout gateway's TITO client)."""

    def generate(
        self, context: CallContext, prompt_ids: np.ndarray, sampling: Sampling, *, timeout_s: float
    ) -> Generation: ...


class ExecutionTimeout(Exception):
    """The execution's deadline passed; the workspace so far is what gets scored."""


class ExecutionCancelled(Exception):
    """The harness was told to stop (job cancelled, shutdown); the execution ends as failed."""


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """Harness knobs: together with TaskParams they set the horizon (turns, tokens)."""

    context_limit_tokens: int = 192
    """A context longer than this is compacted (summary call, then a fresh context)."""
    max_new_tokens: int = 6
    """Generation cap of a code-line call (a reference line is at most 3 tokens plus <eos>)."""
    summary_max_new_tokens: int = 24
    """Generation cap of a summary call."""
    fix_turns: int = 1
    """Attempts after a failure that see the failing test report, in the same context."""
    retries: int = 1
    """Fresh branches from the context before the first attempt, after all fix turns failed."""
    delegate_every: int = 3
    """Every n-th module is built by a sub-agent with its own context; 0 disables delegation."""
    temperature: float = 1.0
    """Sampling temperature; 0 is greedy (then retries are skipped: they would repeat themselves)."""
    timeout_s: float = 120.0
    """Wall-clock budget of one execution; past it the execution ends as `timeout`."""

    def __post_init__(self) -> None:
        if self.context_limit_tokens < 64:
            raise ValueError(f"context_limit_tokens must be >= 64, got {self.context_limit_tokens}.")
        if not 1 <= self.max_new_tokens <= 256 or not 1 <= self.summary_max_new_tokens <= 256:
            raise ValueError("max_new_tokens and summary_max_new_tokens must be in [1, 256].")
        if self.fix_turns < 0 or self.retries < 0 or self.delegate_every < 0:
            raise ValueError("fix_turns, retries and delegate_every must be >= 0.")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}.")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}.")


@dataclass
class ExecutionResult:
    """End of one execution: status, the workspace to submit, and counters for logs and tests."""

    status: EndStatus
    files: dict[str, bytes]
    module_passed: dict[str, bool] = field(default_factory=dict)
    attempts: Counter[str] = field(default_factory=Counter)
    calls: Counter[str] = field(default_factory=Counter)
    events: Counter[str] = field(default_factory=Counter)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""


@dataclass(frozen=True)
class TestRun:
    passed: int
    total: int
    failure: str


def run_visible_tests(module: ModuleSpec, codes: dict[str, str]) -> TestRun:
    """Run a module's visible tests against the current workspace code of every module."""
    passed, failure = 0, ""
    code = codes.get(module.name, "")
    for x, want in module.visible_tests:
        try:
            got = run_program(code, x, modules=codes, name=module.name)
            error = None
        except DslError as e:
            got, error = None, e.reason
        if error is None and got == want:
            passed += 1
        elif not failure:
            failure = prompts.failure_text(x, got, want, error)
    return TestRun(passed, len(module.visible_tests), failure)


class _Context:
    """One agent's running context: a token array plus the segments' bookkeeping."""

    def __init__(self, codec: Codec, agent_id: str, role: AgentRoleName, system: str) -> None:
        self.codec = codec
        self.agent_id = agent_id
        self.role: AgentRoleName = role
        self.system = system
        self.ids = codec.encode(system)

    def append_text(self, text: str) -> None:
        self.ids = np.concatenate([self.ids, self.codec.encode(text)])

    def append_ids(self, ids: np.ndarray) -> None:
        self.ids = np.concatenate([self.ids, ids.astype(np.int32, copy=False)])


class ModelCaller:
    """One execution's model calls: ids, seeds, the deadline and cancellation, the counters.

    Shared by the word-level agent below and the tool-calling agent (services.task.tool_agent)."""

    def __init__(self, *, client: ModelClient, eos_id: int, temperature: float, job_id: str, execution_id: str,
                 deadline_s: float, clock: Callable[[], float], cancelled: threading.Event | None,
                 result: ExecutionResult) -> None:
        self.client, self.eos_id, self.temperature = client, eos_id, temperature
        self.job_id, self.execution_id = job_id, execution_id
        self.deadline_s, self.clock, self.cancelled = deadline_s, clock, cancelled
        self.result = result
        self.n_calls = 0

    def seed(self, call_id: str) -> int:
        digest = hashlib.blake2b(f"{self.execution_id}/{call_id}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 1

    def __call__(self, prompt_ids: np.ndarray, agent_id: str, role: AgentRoleName, max_new_tokens: int) -> np.ndarray:
        """The output ids of one call, always closed by the end-of-turn id; raises ExecutionTimeout
        past the deadline and ExecutionCancelled when told to stop."""
        if self.cancelled is not None and self.cancelled.is_set():
            raise ExecutionCancelled()
        remaining = self.deadline_s - self.clock()
        if remaining <= 0:
            raise ExecutionTimeout()
        self.n_calls += 1
        agent_id = "summarizer" if role == "summary" else agent_id
        call_id = f"{agent_id}/{self.n_calls}"
        context = CallContext(
            job_id=self.job_id, execution_id=self.execution_id, call_id=call_id, agent_id=agent_id, role=role
        )
        sampling = Sampling(
            temperature=self.temperature,
            max_new_tokens=max_new_tokens,
            stop_token_ids=(self.eos_id,),
            seed=self.seed(call_id),
        )
        gen = self.client.generate(context, prompt_ids, sampling, timeout_s=remaining)
        self.result.calls[role] += 1
        self.result.prompt_tokens += len(prompt_ids)
        self.result.output_tokens += len(gen.output_ids)
        out = np.asarray(gen.output_ids, dtype=np.int32)
        # A cut-off generation still has to close its turn so the next segment starts cleanly.
        if len(out) == 0 or out[-1] != self.eos_id:
            out = np.concatenate([out, np.asarray([self.eos_id], dtype=np.int32)])
        if self.clock() > self.deadline_s:
            raise ExecutionTimeout()
        return out


class _Execution:
    def __init__(
        self,
        *,
        task: TaskSpec,
        client: ModelClient,
        codec: Codec,
        config: AgentConfig,
        job_id: str,
        execution_id: str,
        deadline_s: float,
        clock: Callable[[], float],
        on_progress: Callable[[dict[str, bytes]], None] | None,
        cancelled: threading.Event | None,
    ) -> None:
        self.task, self.codec, self.cfg = task, codec, config
        self.on_progress = on_progress
        self.codes: dict[str, str] = {}
        self.best: dict[str, int] = {}
        self.result = ExecutionResult(status="finished", files={})
        self.caller = ModelCaller(client=client, eos_id=codec.eos_id, temperature=config.temperature, job_id=job_id,
                                  execution_id=execution_id, deadline_s=deadline_s, clock=clock, cancelled=cancelled,
                                  result=self.result)

    # ---- model calls ------------------------------------------------------------------------
    def _call(self, ctx: _Context, role: AgentRoleName, max_new_tokens: int) -> np.ndarray:
        return self.caller(ctx.ids, ctx.agent_id, role, max_new_tokens)

    def _make_room(self, ctx: _Context, pending_tokens: int) -> bool:
        """Compact `ctx` when the next segment and its generation would pass the limit."""
        if len(ctx.ids) + pending_tokens <= self.cfg.context_limit_tokens:
            return False
        ctx.append_text(prompts.summary_request())
        summary = self._call(ctx, "summary", self.cfg.summary_max_new_tokens)
        self.result.events["compactions"] += 1
        fresh = _Context(self.codec, ctx.agent_id, ctx.role, ctx.system)
        fresh.append_text(prompts.summary_header())
        fresh.append_ids(summary[:-1])  # the summary's own ids, without its closing <eos>
        ctx.ids = fresh.ids
        return True

    # ---- the work loop ----------------------------------------------------------------------
    def _record(self, module: ModuleSpec, code: str, run: TestRun) -> None:
        """Keep the best attempt of each module in the workspace (later wins ties)."""
        if run.passed >= self.best.get(module.name, -1):
            self.best[module.name] = run.passed
            self.codes[module.name] = code
            self.result.files[TaskSpec.module_path(module.name)] = code.encode()
        self.result.module_passed[module.name] = self.best[module.name] == run.total

    def _attempt(self, ctx: _Context, module: ModuleSpec) -> str:
        """Write the module one line per step (one model call each); returns the whole code."""
        self.result.attempts[module.name] += 1
        self.result.files[ATTEMPTS_PATH] = json.dumps(dict(sorted(self.result.attempts.items()))).encode()
        lines = []
        for step in module.steps:
            ctx.append_text(prompts.step_request(step))
            out = self._call(ctx, ctx.role, self.cfg.max_new_tokens)
            ctx.append_ids(out)
            lines.append(self.codec.decode(out))
        return " ".join(lines)

    def _attempt_tokens(self, module: ModuleSpec) -> int:
        """Upper bound on the tokens one attempt at `module` appends (requests + generations)."""
        steps = sum(len(self.codec.encode(prompts.step_request(s))) for s in module.steps)
        return steps + len(module.steps) * self.cfg.max_new_tokens + 16

    def _solve(self, ctx: _Context, module: ModuleSpec) -> TestRun:
        header = prompts.module_header(module)
        attempt = self._attempt_tokens(module)
        self._make_room(ctx, len(self.codec.encode(header)) + attempt)
        ctx.append_text(header)
        checkpoint = ctx.ids
        run = TestRun(0, len(module.visible_tests), "")
        for branch in range(1 + self.cfg.retries):
            if branch:
                if self.cfg.temperature == 0:
                    break  # greedy: the same prefix would give the same answer
                ctx.ids = checkpoint  # retry from the earlier context: same prefix, new branch
                self.result.events["retries"] += 1
            for turn in range(1 + self.cfg.fix_turns):
                code = self._attempt(ctx, module)
                run = run_visible_tests(module, {**self.codes, module.name: code})
                self._record(module, code, run)
                report = prompts.test_report(module.name, run.passed, run.total, run.failure)
                if run.passed == run.total or turn == self.cfg.fix_turns:
                    ctx.append_text(report)
                    break
                fix = report + prompts.fix_request(module.name)
                self.result.events["fix_turns"] += 1
                if self._make_room(ctx, len(self.codec.encode(fix)) + attempt):
                    ctx.append_text(header)  # the report was summarized away: start the module afresh
                else:
                    ctx.append_text(fix)
            if run.passed == run.total:
                break
        return run

    def run(self) -> ExecutionResult:
        main = _Context(self.codec, "main", "main", prompts.system_main(self.task))
        try:
            for i, module in enumerate(self.task.modules):
                every = self.cfg.delegate_every
                if every and (i + 1) % every == 0:
                    self.result.events["subagents"] += 1
                    sub = _Context(self.codec, f"sub-{module.name}", "subagent", prompts.system_subagent(module))
                    run = self._solve(sub, module)
                    report = prompts.subagent_report(module.name, run.passed, run.total)
                    self._make_room(main, len(self.codec.encode(report)))
                    main.append_text(report)
                else:
                    self._solve(main, module)
                if self.on_progress is not None:
                    # Preserve the workspace as it grows: a timeout or a crash later is scored on it.
                    self.on_progress(dict(self.result.files))
        except ExecutionTimeout:
            self.result.status = "timeout"
        except ExecutionCancelled:
            self.result.status = "failed"
            self.result.error = "cancelled"
        return self.result


def run_execution(
    task: TaskSpec,
    client: ModelClient,
    *,
    codec: Codec,
    config: AgentConfig = AgentConfig(),
    job_id: str = "",
    execution_id: str,
    deadline_s: float | None = None,
    clock: Callable[[], float] = time.monotonic,
    on_progress: Callable[[dict[str, bytes]], None] | None = None,
    cancelled: threading.Event | None = None,
) -> ExecutionResult:
    """Run one execution to its end (finished, timeout, or failed when `cancelled` is set);
    errors of the client propagate.

    `deadline_s` is on `clock`'s scale; default: now + config.timeout_s (the earlier of the two
    when both are given). `on_progress(files)` is called after each module with the workspace.
    """
    own = clock() + config.timeout_s
    deadline_s = own if deadline_s is None else min(deadline_s, own)
    ex = _Execution(
        task=task,
        client=client,
        codec=codec,
        config=config,
        job_id=job_id,
        execution_id=execution_id,
        deadline_s=deadline_s,
        clock=clock,
        on_progress=on_progress,
        cancelled=cancelled,
    )
    return ex.run()
