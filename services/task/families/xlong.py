"""``xlong-v1``: the built-in XLong family (tasks in services.task.spec, grading in
services.task.scoring, the agent in services.task.agent) and its harness runner.

Payload ``{"task_id": "xlong-v1/<split>/<seed>/<knobs>"}``; the harness and the scorers rebuild the
task from its id.
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
    """One execution: the XLong agent with the harness's codec (the built-in tokenizer or model_dir's)."""
    import dataclasses

    from services.task.agent import run_execution
    from services.task.runner import RunOutcome
    from services.task.spec import task_from_id

    if harness.cfg.loop != "builtin":
        raise ValueError(f"the {harness.cfg.loop} loop runs the tool-calling family xlong-tools-v1, not the "
                         "word-level xlong-v1 (gyre run --task tools)")
    task = task_from_id(task_id)
    config = dataclasses.replace(harness.cfg.agent, temperature=harness.temperature(lease))
    result = run_execution(task, harness.model, codec=harness.codec_for(lease), config=config, job_id=harness.record_job(lease),
                           execution_id=lease.execution_id, deadline_s=lease.deadline_s, clock=time.time,
                           on_progress=preserve, cancelled=cancelled)
    return RunOutcome(status=result.status, error=result.error, files=result.files,
                      log={"calls": dict(result.calls), "events": dict(result.events),
                           "prompt_tokens": result.prompt_tokens, "output_tokens": result.output_tokens})


FAMILY = TaskFamily(
    name="xlong-v1",
    generator="services.task.spec:task_generator",
    heldout="services.task.spec:heldout_tasks",
    scorer="services.task.scoring:score",
    other_scorers={"xlong-v1-tests": "services.task.scoring:score_tests"},
    runner="services.task.families.xlong:run",
)
