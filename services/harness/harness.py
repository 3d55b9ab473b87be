"""The built-in task's harness process: leases executions, runs the agent, reports to reward.

    gyre-harness --scheduler ADDR --gateway ADDR --reward ADDR --concurrency N
    (python -m services.harness ...; every HarnessConfig field is a --flag, TOML [harness])

Each of N execution threads loops:

    scheduler.LeaseExecution ──> payload {"task_id": ...} ──> agent (services.task.agent)
        │  heartbeat thread: Heartbeat every lease_ttl/3; `cancelled` stops the agent
        │  model calls ──> rollout gateway (TITO gRPC; prompts delta-encoded against the
        │                  agent's previous call, the gateway records every call)
        │  after each module ──> reward.SubmitWorkspace (the workspace is preserved as it grows)
        └─ end ──> reward.SubmitWorkspace + Score(status, the job's timeout policy)
                   ──> scheduler.CompleteExecution(status)

It is the same path an external harness takes: nothing here knows about cells, migrations or
training. A model-call failure that survives the retries ends the execution as `failed`.

The task id's family (services.task.registry, by the id's first segment) picks the runner:
``xlong-v1/...`` runs the XLong agent with the built-in tokenizer (or ``model_dir``'s),
``arith-v1/...`` the multi-turn arithmetic chat through ``model_dir``'s tokenizer and chat template
(a real instruct model). A runner is ``fn(harness, lease, task_id, *, preserve, cancelled) ->
RunOutcome`` (services/task/runner.py: the harness is the runner's `RunnerHost`); see
services/task/families/. This package sits above the task package: it imports task code, never the
other way round.
"""

from __future__ import annotations

import json
import random
import secrets
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any


from services.common import errors
from services.common.config import load_config
from services.common.logging import get_logger, setup_logging
from services.harness.config import HarnessConfig
from services.task import registry
from services.task.gateway_client import GatewayModelClient
from services.task.runner import RunnerHost
from services.task.tokenizer import Codec
from services.task.tool_agent import ToolAgentConfig
from services.task.tool_tokenizer import ToolCodec

log = get_logger(__name__)

__all__ = ["HarnessConfig", "Harness", "main"]


class Harness:
    """N execution threads leasing and running executions until `stop()` (or max_executions)."""

    def __init__(self, cfg: HarnessConfig, *, scheduler: Any, gateway: Any, reward: Any,
                 codec: Codec | None = None) -> None:
        self.cfg = cfg
        self.scheduler, self.reward = scheduler, reward
        self._codec = codec
        self.model = GatewayModelClient(gateway, retries=cfg.call_retries)
        self.harness_id = cfg.harness_id or f"{socket.gethostname()}-{secrets.token_hex(3)}"
        self.stopping = threading.Event()
        self._policies: dict[str, str] = {}
        self.done = 0
        self._done_lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._chat_tokenizer: Any = None
        self._model_dirs: dict[str, str] = {}  # a lease's model spec -> its directory
        self._codecs: dict[str, Codec] = {}
        self._tool_codecs: dict[str, ToolCodec] = {}
        self._chats: dict[str, Any] = {}
        self._tokenizer_lock = threading.Lock()

    def start(self) -> Harness:
        if self.cfg.harness_id:
            self._release_predecessor()
        for i in range(self.cfg.concurrency):
            t = threading.Thread(target=self._run_executions, name=f"harness-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self.stopping.set()

    def _release_predecessor(self) -> None:
        """Under a stable harness id, first give up the leases that id still holds: a predecessor
        process died holding them (a crash, a supervisor restart), so they run again now rather
        than after their lease TTL. Before any thread leases, so only the dead process's go."""
        pause = 0.5
        while not self.stopping.is_set():
            try:
                released = self.scheduler.release_harness(self.harness_id, reason="the harness process (re)started")
            except errors.GyreError as exc:
                log.warning("releasing the predecessor's leases failed; retrying", harness_id=self.harness_id,
                            error=str(exc))
                self.stopping.wait(pause)
                pause = min(pause * 2, 5.0)
                continue
            if released:
                log.info("predecessor's leases released", harness_id=self.harness_id, executions=released)
            return

    def join(self, timeout_s: float | None = None) -> None:
        for t in self._threads:
            t.join(timeout_s)

    def _run_executions(self) -> None:
        request_id = ""
        while not self.stopping.is_set():
            # kept across failed attempts: an answer lost in a scheduler crash is given again
            request_id = request_id or secrets.token_hex(12)
            try:
                # without a job id: any running job whose executions built-in harnesses run
                lease = self.scheduler.lease(self.harness_id, job_id=self.cfg.job_id, wait_s=self.cfg.lease_wait_s,
                                             harness="" if self.cfg.job_id else "builtin", request_id=request_id)
            except errors.GyreError as exc:
                log.warning("lease failed", error=str(exc))
                self.stopping.wait(1.0 + random.random())
                continue
            request_id = ""
            if lease is None:
                continue
            self._run(lease)
            with self._done_lock:
                self.done += 1
                if self.cfg.max_executions and self.done >= self.cfg.max_executions:
                    self.stopping.set()

    @property
    def codec(self) -> Codec:
        """The XLong agent's tokenizer view (xlong tasks), built on first use: a model whose
        tokenizer lacks the task's tokens (an instruct model serving arith) fails only xlong tasks."""
        with self._tokenizer_lock:
            if self._codec is None:
                self._codec = Codec.from_dir(self.cfg.model_dir) if self.cfg.model_dir else Codec()
            return self._codec

    def chat_tokenizer(self) -> Any:
        """The served model's HF tokenizer with its chat template (arith tasks), loaded once."""
        with self._tokenizer_lock:
            if self._chat_tokenizer is None:
                if not self.cfg.model_dir:
                    raise ValueError("arith-v1 tasks need the served model's tokenizer: set --model-dir")
                from transformers import AutoTokenizer

                self._chat_tokenizer = AutoTokenizer.from_pretrained(self.cfg.model_dir)
            return self._chat_tokenizer

    def _model_dir(self, lease: Any) -> str:
        """The directory of the model a lease's job trains (the engines serve it), else ours."""
        model = getattr(lease, "model", "") or ""
        if not model or model == self.cfg.model_dir:
            return self.cfg.model_dir
        with self._tokenizer_lock:
            if model not in self._model_dirs:
                from services.models.source import resolve_model

                self._model_dirs[model] = str(resolve_model(model))
            return self._model_dirs[model]

    def codec_for(self, lease: Any) -> Codec:
        """The XLong agent's tokenizer for the lease's model (see ``codec``)."""
        path = self._model_dir(lease)
        if path == self.cfg.model_dir:
            return self.codec
        with self._tokenizer_lock:
            if path not in self._codecs:
                self._codecs[path] = Codec.from_dir(path)
            return self._codecs[path]

    def tool_codec_for(self, lease: Any) -> ToolCodec:
        """The tool agent's tokenizer (xlong-tools tasks): the lease's model's, else model_dir's."""
        path = self._model_dir(lease)
        if not path:
            raise ValueError("xlong-tools-v1 tasks need the served model's tokenizer: set --model-dir or a job model")
        with self._tokenizer_lock:
            if path not in self._tool_codecs:
                self._tool_codecs[path] = ToolCodec.from_dir(path)
            return self._tool_codecs[path]

    def tool_agent_config(self, *, temperature: float) -> ToolAgentConfig:
        """The tool agent's knobs from this harness's config."""
        cfg = self.cfg
        return ToolAgentConfig(context_limit_tokens=cfg.tool_context_limit_tokens, fix_turns=cfg.fix_turns,
                               retries=cfg.retries, delegate_every=cfg.delegate_every, temperature=temperature,
                               timeout_s=cfg.timeout_s)

    def chat_tokenizer_for(self, lease: Any) -> Any:
        """The chat tokenizer of the lease's model (see ``chat_tokenizer``)."""
        path = self._model_dir(lease)
        if path == self.cfg.model_dir:
            return self.chat_tokenizer()
        with self._tokenizer_lock:
            if path not in self._chats:
                from transformers import AutoTokenizer

                self._chats[path] = AutoTokenizer.from_pretrained(path)
            return self._chats[path]

    def temperature(self, lease: Any) -> float:
        """Sampling temperature of one execution: the job's (0 for a greedy evaluation), else ours."""
        t = getattr(lease, "temperature", None)
        return self.cfg.temperature if t is None else float(t)

    @staticmethod
    def record_job(lease: Any) -> str:
        """The job id an execution's calls and score are recorded under (evaluations: ``<job>-eval``,
        kept out of training)."""
        return getattr(lease, "record_job_id", "") or lease.job_id

    def _timeout_policy(self, job_id: str) -> str:
        """The job's timeout policy (from its spec, once per job); "" lets reward use its default."""
        if job_id not in self._policies:
            try:
                policy = self.scheduler.get_job(job_id).spec.timeout_policy
                self._policies[job_id] = str(getattr(policy, "value", policy) or "")
            except errors.GyreError as exc:
                log.warning("job spec unavailable; reward applies its default timeout policy", job_id=job_id,
                            error=str(exc))
                return ""
        return self._policies[job_id]

    def _heartbeat(self, lease: Any, cancelled: threading.Event, ended: threading.Event) -> None:
        every = max(0.5, lease.lease_ttl_s / 3)
        while not ended.wait(every):
            try:
                _deadline, _expires, job_cancelled = self.scheduler.heartbeat(lease.execution_id, lease.lease_token)
            except errors.GyreError as exc:
                log.warning("heartbeat failed", execution_id=lease.execution_id, error=str(exc))
                continue
            if job_cancelled or self.stopping.is_set():
                cancelled.set()

    def _run(self, lease: Any) -> None:
        from services.scheduler.jobs import ExecState

        eid = lease.execution_id
        job = self.record_job(lease)
        begin = getattr(self.model, "begin", None)  # a model client that records calls under the lease's attempt
        if begin is not None:
            begin(eid, int(lease.attempt))
        blog = log.bind(job_id=lease.job_id, execution_id=eid, evaluation=bool(getattr(lease, "evaluation", False)))
        cancelled, ended = threading.Event(), threading.Event()
        beat = threading.Thread(target=self._heartbeat, args=(lease, cancelled, ended), daemon=True)
        beat.start()
        status, reason, task_id = "failed", "", ""
        files: dict[str, bytes] = {}
        started = time.monotonic()
        try:
            task_id = str(json.loads(lease.payload)["task_id"])

            def preserve(snapshot: dict[str, bytes]) -> None:
                # best effort: a snapshot lets a timed-out run be scored partially; the final one counts
                try:
                    self._retry_call("preserve workspace", lambda: self.reward.submit_workspace(
                        job, eid, snapshot, task_id=task_id), blog, budget_s=10.0, service="reward")
                except errors.GyreError as exc:
                    blog.warning("workspace snapshot not preserved; the execution goes on", error=str(exc))

            family = registry.family_of_task(task_id)
            if not family.runner:
                raise ValueError(f"task family {family.name!r} has no harness runner")
            host: RunnerHost = self  # what a runner may use of the harness (checked by mypy)
            outcome = registry.load(family.runner)(host, lease, task_id, preserve=preserve, cancelled=cancelled)
            status, reason, files = outcome.status, outcome.error, outcome.files
            blog.info("execution ended", status=status, family=family.name,
                      wall_s=round(time.monotonic() - started, 3), **outcome.log)
        except (ValueError, KeyError, TypeError) as exc:
            reason = f"bad task payload: {exc}"
            blog.warning("bad task payload", error=str(exc))
        except errors.GyreError as exc:
            reason = f"{type(exc).__name__}: {exc}"
            blog.warning("execution failed", error=reason)
        except Exception as exc:  # noqa: BLE001 -- a fault barrier: a runner's (or a third-party loop's) own
            # error ends this execution as failed; left to propagate it would kill the execution thread and
            # leave the lease renewed by the heartbeat forever, stalling the job
            reason = f"runner error: {type(exc).__name__}: {exc}"[:500]
            blog.exception("execution failed in its runner", error=reason)
        finally:
            self.model.forget(eid)
        # The score must be stored before the execution is completed: a completed, unscored
        # execution would never reach its training step. The lease keeps being renewed meanwhile.
        try:
            if files:
                self._retry_call("submit workspace", lambda: self.reward.submit_workspace(
                    job, eid, files, task_id=task_id), blog, budget_s=self.cfg.reward_retry_s, service="reward")
            self._retry_call("score", lambda: self.reward.score(
                job, eid, status, timeout_policy=self._timeout_policy(lease.job_id), group_id=lease.group_id,
                step=lease.step, task_id=task_id), blog, budget_s=self.cfg.reward_retry_s, service="reward")
        except errors.FailedPrecondition:
            pass  # already scored (a re-leased attempt of an execution that another attempt finished)
        except errors.GyreError as exc:  # its lease (no longer renewed) expires: run again, or a timeout
            ended.set()  # stop renewing the lease
            blog.warning("reward unreachable; the execution is left to its lease (run again, or scored as a "
                         "timeout from its preserved workspace)", error=str(exc))
            return
        # Retried while the scheduler restarts (CompleteExecution is idempotent per lease token),
        # the lease still renewed: a finished execution is never run again because one answer was lost.
        try:
            self._retry_call("complete", lambda: self.scheduler.complete(eid, lease.lease_token, ExecState(status),
                                                                           reason[:500]),
                             blog, budget_s=self.cfg.complete_retry_s, service="scheduler")
        except errors.GyreError as exc:
            blog.warning("complete failed; the execution is left to its lease", error=str(exc))
        finally:
            ended.set()  # stop renewing the lease

    def _retry_call(self, what: str, fn: Any, blog: Any, *, budget_s: float, service: str) -> Any:
        """``fn()`` retried with backoff and jitter while ``service`` is unreachable (a restart),
        for up to ``budget_s``; each retry logged."""
        deadline = time.monotonic() + budget_s
        pause = 0.2
        attempt = 0
        while True:
            try:
                return fn()
            except (errors.Unavailable, errors.DeadlineExceeded) as exc:
                attempt += 1
                if time.monotonic() + pause > deadline or self.stopping.is_set():
                    raise
                blog.warning(f"{service} unavailable; retrying", call=what, attempt=attempt, error=str(exc))
                time.sleep(pause * (0.5 + random.random()))
                pause = min(5.0, pause * 2)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "-h" in args or "--help" in args:
        from services.common.entry import usage

        print(usage("harness", HarnessConfig).replace("gyre-harness [--config FILE.toml] [--port-file F]",
                                                      "gyre-harness [--config FILE.toml]"))
        return 0
    path = None
    if "--config" in args:
        i = args.index("--config")
        path = args[i + 1] if i + 1 < len(args) else None
        del args[i : i + 2]
    try:
        cfg = load_config(HarnessConfig, path=path, section="harness", env_prefix="GYRE_HARNESS_", argv=args)
    except ValueError as exc:
        print(f"gyre-harness: {exc}", file=sys.stderr)
        return 2
    setup_logging(json=cfg.log_json, level=cfg.log_level, service="harness")
    if cfg.auth_token_file or cfg.tls_ca_file:
        from pathlib import Path

        from services.common import security

        token = Path(cfg.auth_token_file).read_text().strip() if cfg.auth_token_file else ""
        security.configure(security.Security(auth_token=token, tls_ca_file=cfg.tls_ca_file))
    from services.reward.client import RewardClient
    from services.rollout.client import GatewayClient
    from services.scheduler.client import SchedulerClient

    harness = Harness(cfg, scheduler=SchedulerClient(cfg.scheduler), reward=RewardClient(cfg.reward),
                      gateway=GatewayClient(cfg.gateway, timeout_s=cfg.call_timeout_s))

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("shutdown requested", signal=signal.Signals(signum).name)
        harness.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    harness.start()
    log.info("harness running", harness_id=harness.harness_id, concurrency=cfg.concurrency)
    while not harness.stopping.wait(0.5):
        pass
    harness.join(timeout_s=cfg.call_timeout_s)
    log.info("harness stopped", executions=harness.done)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
