"""An external harness: the official ``openai`` client against Gyre's OpenAI-compatible endpoint.

This is what a harness written outside Gyre looks like. It leases executions from the scheduler's
Harnesses API, talks to the model only through ``/v1/chat/completions`` at the lease's
``session_base_url`` (an unmodified OpenAI client given only that base URL: the gateway records
every call as TITO under the session's execution, agent, role and attempt), keeps its own
workspace, and reports the workspace and end status to the reward service over gRPC. Optionally it
also grades its own work: ``--serve-scorer`` starts an ``ExternalScorer`` gRPC server and points
the job's scorer at it, so the reward service calls back here for every execution (its operator
allows it: ``scorer_allowlist = ["external:HARNESS_HOST:PORT"]``, or ``HARNESS_HOST:*``).

It solves the built-in XLong task with a plain chat loop (no compaction or sub-agents; the
built-in harness in services/harness/harness.py shows those):

    system  "task modules m1 m2 ..."
    user    "module m1 tests 8 -> 4 8 , ..."      then, per step:
    user    "step sub 2"   ->  assistant "2 -"      (one chat completion per step)
    tool    "m1 pass 2 / 2"  (or fail + " fix m1", then the steps again, once)

    python examples/openai_harness.py --base-url http://127.0.0.1:8000/v1 \\
        --scheduler 127.0.0.1:50050 --reward 127.0.0.1:50053 [--job-id J] [--serve-scorer 0]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import openai  # noqa: E402

from services.reward.client import RewardClient  # noqa: E402
from services.reward.scorers import ScorerSpec  # noqa: E402
from services.scheduler.client import SchedulerClient  # noqa: E402
from services.scheduler.jobs import ExecState  # noqa: E402
from services.task.agent import run_visible_tests  # noqa: E402
from services.task.spec import TaskSpec, task_from_id  # noqa: E402


@dataclass
class Episode:
    """One execution's chat and workspace."""

    job_id: str
    execution_id: str
    task: TaskSpec
    messages: list[dict[str, str]] = field(default_factory=list)
    files: dict[str, bytes] = field(default_factory=dict)
    codes: dict[str, str] = field(default_factory=dict)
    calls: int = 0
    attempt: int = 1  # the lease's attempt: a re-leased execution's calls replace the earlier attempt's
    session: bool = False  # calls go to the lease's session base URL (the gateway knows who calls)


def chat_step(client: openai.OpenAI, ep: Episode, *, model: str, temperature: float) -> str:
    """One model call: the whole chat so far; the reply is appended as the assistant turn."""
    ep.calls += 1
    headers = {} if ep.session else {  # no session URL (an old scheduler): name the execution in headers
        "x-gyre-job-id": ep.job_id, "x-gyre-execution-id": ep.execution_id, "x-gyre-agent-id": "main",
        "x-gyre-role": "main", "x-gyre-call-id": f"main/{ep.calls}", "x-gyre-attempt": str(ep.attempt)}
    reply = client.chat.completions.create(model=model, messages=ep.messages, max_tokens=6,  # type: ignore[arg-type]
                                           temperature=temperature, extra_headers=headers)
    text = reply.choices[0].message.content or ""
    ep.messages.append({"role": "assistant", "content": text})
    return text


def solve(client: openai.OpenAI, ep: Episode, *, model: str, temperature: float, deadline_s: float) -> str:
    """Write every module (one fix turn each); returns the end status."""
    names = " ".join(m.name for m in ep.task.modules)
    ep.messages = [{"role": "system", "content": f"task modules {names}"}]
    for module in ep.task.modules:
        tests = " , ".join(f"{x} -> {y}" for x, y in module.visible_tests)
        ep.messages.append({"role": "user", "content": f"module {module.name} tests {tests}"})
        for turn in range(2):
            lines = []
            for step in module.steps:
                if time.time() > deadline_s:
                    return "timeout"
                ep.messages.append({"role": "user", "content": f"step {step}"})
                lines.append(chat_step(client, ep, model=model, temperature=temperature))
            code = " ".join(lines)
            run = run_visible_tests(module, {**ep.codes, module.name: code})
            if turn == 0 or run.passed >= 1:
                ep.codes[module.name] = code
                ep.files[ep.task.module_path(module.name)] = code.encode()
            verdict = "pass" if run.passed == run.total else "fail"
            report = f"{module.name} {verdict} {run.passed} / {run.total}"
            if verdict == "pass":
                ep.messages.append({"role": "tool", "content": report})
                break
            ep.messages.append({"role": "tool", "content": f"{report} : {run.failure} fix {module.name}"})
    return "finished"


def grade(files: dict[str, bytes], task_id: str, status: str) -> dict[str, Any]:
    """This harness's own scorer (served over gRPC with --serve-scorer): plain fraction of tests."""
    from services.task.scoring import score_workspace

    s = score_workspace(task_from_id(task_id), files, discount=1.0)
    return {"score": s.tests_fraction, "tests_passed": s.passed, "tests_total": s.total,
            "modules": [[m.name, m.passed, m.total, m.error] for m in s.modules],
            "metrics": {"all_passed": float(s.all_passed)}}


def serve_scorer(port: int) -> Any:
    """Start an ExternalScorer gRPC server for `grade`; returns the started server."""
    from protos.gyre.v1 import reward_pb2, reward_pb2_grpc
    from services.common.server import build_server
    from services.reward.servicer import FunctionScorerServicer

    name = reward_pb2.DESCRIPTOR.services_by_name["ExternalScorer"].full_name
    server = build_server("openai-harness-scorer",
                          [(reward_pb2_grpc.add_ExternalScorerServicer_to_server, FunctionScorerServicer(grade))],
                          service_names=[name], port=port)
    server.start()
    server.set_serving(True)
    return server


def run(*, base_url: str, scheduler: str, reward: str, job_id: str = "", model: str = "gyre",
        temperature: float = 1.0, max_executions: int = 0, idle_exit_s: float = 0.0,
        scorer_address: str = "") -> int:
    """Lease and run executions one at a time; returns how many ran."""
    shared = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=2, timeout=300)
    sched, rew = SchedulerClient(scheduler), RewardClient(reward)
    configured: set[str] = set()
    done, idle_since = 0, time.monotonic()
    try:
        while not max_executions or done < max_executions:
            lease = sched.lease("openai-harness", job_id=job_id, wait_s=2.0)
            if lease is None:
                if idle_exit_s and time.monotonic() - idle_since > idle_exit_s:
                    break
                continue
            if scorer_address and lease.job_id not in configured:
                rew.configure_job(lease.job_id, ScorerSpec(kind="external", target=scorer_address))
                configured.add(lease.job_id)
            task_id = json.loads(lease.payload)["task_id"]
            ep = Episode(lease.job_id, lease.execution_id, task_from_id(task_id), attempt=lease.attempt,
                         session=bool(lease.session_base_url))
            # the lease's own base URL, as a harness that reads only OPENAI_BASE_URL would get it
            client = (openai.OpenAI(base_url=lease.session_base_url, api_key="unused", max_retries=2, timeout=300)
                      if ep.session else shared)
            try:
                status = solve(client, ep, model=model, temperature=temperature, deadline_s=lease.deadline_s)
            except openai.OpenAIError as exc:
                print(f"execution {lease.execution_id} failed: {exc}", file=sys.stderr)
                status = "failed"
            if ep.files:
                rew.submit_workspace(lease.job_id, lease.execution_id, ep.files, task_id=task_id)
            score = rew.score(lease.job_id, lease.execution_id, status, group_id=lease.group_id, step=lease.step,
                              task_id=task_id)
            sched.complete(lease.execution_id, lease.lease_token, ExecState(status))
            print(f"{lease.execution_id}: {status} reward={score.reward} tests={score.tests_passed}/"
                  f"{score.tests_total} calls={ep.calls}")
            done += 1
            idle_since = time.monotonic()
    finally:
        sched.close()
        rew.close()
    return done


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-url", required=True, help="the gateway's OpenAI endpoint, e.g. http://127.0.0.1:8000/v1 "
                   "(used only for leases without a session_base_url)")
    p.add_argument("--scheduler", required=True, help="host:port of the scheduler (its Harnesses API)")
    p.add_argument("--reward", required=True, help="host:port of the reward service")
    p.add_argument("--job-id", default="", help="lease only this job's executions")
    p.add_argument("--model", default="gyre", help="model name the endpoint serves")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-executions", type=int, default=0, help="stop after this many (0 = run on)")
    p.add_argument("--serve-scorer", type=int, default=-1, metavar="PORT",
                   help="grade our own workspaces: serve an ExternalScorer on PORT (0 = any) and use it")
    args = p.parse_args()
    scorer = serve_scorer(args.serve_scorer) if args.serve_scorer >= 0 else None
    try:
        run(base_url=args.base_url, scheduler=args.scheduler, reward=args.reward, job_id=args.job_id,
            model=args.model, temperature=args.temperature, max_executions=args.max_executions,
            scorer_address=scorer.address if scorer else "")
    finally:
        if scorer is not None:
            scorer.stop(1.0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
