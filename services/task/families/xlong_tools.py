"""``xlong-tools-v1``: the built-in XLong tasks solved through tools (services.task.tool_env) by the
tool-calling agent (services.task.tool_agent), for a model that writes tool calls (``builtin-tools``
or any checkpoint whose tokenizer has the ChatML + ``<tool_call>`` tokens).

Payload ``{"task_id": "xlong-tools-v1/<split>/<seed>/<knobs>"}``: the task with a seed is the
``xlong-v1`` task with that seed, graded by the same scorers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from services.task.registry import TaskFamily

if TYPE_CHECKING:
    from services.task.runner import RunnerHost, RunOutcome


def run(harness: RunnerHost, lease: Any, task_id: str, *, preserve: Callable[[dict[str, bytes]], None],
        cancelled: threading.Event) -> RunOutcome:
    """One execution: the built-in tool agent with the served model's tokenizer, or the harness's
    third-party loop (``loop``) against the lease's session base URL."""
    from services.task.runner import RunOutcome
    from services.task.spec import task_from_id
    from services.task.tool_agent import run_tool_execution

    task = task_from_id(task_id)
    if harness.cfg.loop != "builtin":
        from services.task.loops import run_third_party

        deadline = min(lease.deadline_s, time.time() + harness.cfg.timeout_s) if lease.deadline_s else (
            time.time() + harness.cfg.timeout_s)
        result = run_third_party(harness.cfg.loop, task, base_url=lease.session_base_url,
                                 temperature=harness.temperature(lease), fix_turns=harness.cfg.fix_turns,
                                 deadline_s=deadline, on_progress=preserve, cancelled=cancelled)
        return RunOutcome(status=result.status, error=result.error, files=result.files,
                          log={"loop": harness.cfg.loop, "tool_calls": result.calls["tool"],
                               "events": dict(result.events)})
    config = harness.tool_agent_config(temperature=harness.temperature(lease))
    result = run_tool_execution(task, harness.model, codec=harness.tool_codec_for(lease), config=config,
                                job_id=harness.record_job(lease), execution_id=lease.execution_id,
                                deadline_s=lease.deadline_s, clock=time.time, on_progress=preserve,
                                cancelled=cancelled)
    return RunOutcome(status=result.status, error=result.error, files=result.files,
                      log={"calls": dict(result.calls), "events": dict(result.events),
                           "prompt_tokens": result.prompt_tokens, "output_tokens": result.output_tokens})


FAMILY = TaskFamily(
    name="xlong-tools-v1",
    generator="services.task.spec:tool_task_generator",
    heldout="services.task.spec:tool_heldout_tasks",
    scorer="services.task.scoring:score",
    other_scorers={"xlong-tools-v1-tests": "services.task.scoring:score_tests"},
    runner="services.task.families.xlong_tools:run",
)
