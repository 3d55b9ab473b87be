"""Config of the built-in harness process: TOML section ``[harness]``, env ``GYRE_HARNESS_<FIELD>``,
or ``--field value`` flags (see ``services.common.config``)."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import check, setting
from services.task.agent import AgentConfig
from services.task.loops import LOOPS


@dataclass(frozen=True, kw_only=True)
class HarnessConfig:
    """The built-in harness process."""

    scheduler: str = setting("127.0.0.1:50050", "host:port of the scheduler (its Harnesses API).")
    gateway: str = setting("127.0.0.1:50052", "host:port of the rollout gateway (TITO gRPC).")
    reward: str = setting("127.0.0.1:50053", "host:port of the reward service.")
    auth_token_file: str = setting("", "File holding this harness's credential (a harness token; see "
                                       "`gyre credentials`); empty = none (local stacks).")
    tls_ca_file: str = setting("", "CA (PEM) the services' TLS certificates are checked against; empty = plaintext.")
    concurrency: int = setting(4, "Executions run at once (one thread each).")
    job_id: str = setting("", "Lease only this job's executions; empty = any job.")
    harness_id: str = setting("", "Stable name of this harness process, shown in the scheduler. When set, the process "
                                 "first gives up the leases this id still holds (its predecessor died holding "
                                 "them), so they run again at once instead of after their lease TTL; two live "
                                 "harness processes must never share one. Empty = host + a random suffix (no release).")
    model_dir: str = setting("", "Tokenizer directory of the served model; empty = the built-in tokenizer.")
    lease_wait_s: float = setting(5.0, "Long-poll wait for work, seconds.")
    call_timeout_s: float = setting(300.0, "Longest one model call may take, seconds.")
    call_retries: int = setting(3, "Retries of a model call the gateway answered UNAVAILABLE.")
    reward_retry_s: float = setting(300.0, "How long an ended execution's workspace and score are retried while "
                                           "the reward service is unreachable (its lease kept meanwhile).")
    complete_retry_s: float = setting(300.0, "How long an execution's completion is retried while the scheduler is "
                                             "unreachable (a restart; its lease kept meanwhile).")
    max_executions: int = setting(0, "Exit after this many executions (0 = run until SIGTERM).")
    context_limit_tokens: int = setting(192, "Agent context limit before compaction, tokens.")
    loop: str = setting("builtin", "Agent loop of tool-calling tasks (xlong-tools-v1): builtin (the tool agent, "
                                    "with compaction, sub-agents and retries), openai-agents, smolagents, "
                                    "mini-swe-agent, claude-code or codex (those packages' own loops, unmodified, "
                                    "against the lease's session base URL; mini-swe-agent acts through the "
                                    "gyre-task command in bubblewrap, the Claude Code and Codex CLIs run in "
                                    "bubblewrap with the gateway their only network).")
    tool_context_limit_tokens: int = setting(512, "Tool agent's context limit before compaction, tokens "
                                                  "(xlong-tools tasks; its system turn lists the tools).")
    fix_turns: int = setting(1, "Attempts after a failing test report, per module.")
    retries: int = setting(1, "Fresh branches from the pre-attempt context after failed fixes.")
    delegate_every: int = setting(3, "Every n-th module goes to a sub-agent (0 = never).")
    temperature: float = setting(1.0, "Sampling temperature (0 = greedy, for evaluation).")
    timeout_s: float = setting(3600.0, "Own cap on one execution, seconds (the lease deadline also applies).")
    log_json: bool = setting(True, "Log one JSON object per line.")
    log_level: str = setting("INFO", "DEBUG, INFO, WARNING or ERROR.")

    def __post_init__(self) -> None:
        check(1 <= self.concurrency <= 1024, "concurrency", self.concurrency, "between 1 and 1024")
        check(self.lease_wait_s >= 0, "lease_wait_s", self.lease_wait_s, ">= 0 seconds")
        check(self.call_timeout_s > 0, "call_timeout_s", self.call_timeout_s, "> 0 seconds")
        check(self.call_retries >= 0, "call_retries", self.call_retries, ">= 0")
        check(self.reward_retry_s >= 0, "reward_retry_s", self.reward_retry_s, ">= 0 seconds")
        check(self.complete_retry_s >= 0, "complete_retry_s", self.complete_retry_s, ">= 0 seconds")
        check(self.max_executions >= 0, "max_executions", self.max_executions, ">= 0")
        for name in ("scheduler", "gateway", "reward"):
            value = getattr(self, name)
            check(":" in value, name, value, "host:port")
        self.agent  # validates the agent knobs
        check(self.loop in LOOPS, "loop", self.loop, " or ".join(LOOPS))
        check(self.tool_context_limit_tokens >= 256, "tool_context_limit_tokens", self.tool_context_limit_tokens,
              ">= 256")

    @property
    def agent(self) -> AgentConfig:
        return AgentConfig(context_limit_tokens=self.context_limit_tokens, fix_turns=self.fix_turns,
                           retries=self.retries, delegate_every=self.delegate_every,
                           temperature=self.temperature, timeout_s=self.timeout_s)
