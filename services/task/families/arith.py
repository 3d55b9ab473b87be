"""``arith-v1``: multi-turn arithmetic chat for real instruct models (services.task.arith) and its
harness runner, which talks through the served model's tokenizer and chat template.

Payload ``{"task_id": "arith-v1/<split>/<seed>/n<turns>.v<max_operand>"}``.
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
    """One execution: ask every turn through the chat template, within the lease's deadline."""
    from services.task.arith import ArithConfig, run_arith_execution, task_from_id
    from services.task.runner import RunOutcome

    task = task_from_id(task_id)
    cfg = harness.cfg
    config = ArithConfig(temperature=harness.temperature(lease), timeout_s=cfg.timeout_s)
    deadline = min(lease.deadline_s, time.time() + cfg.timeout_s) if lease.deadline_s else None
    result = run_arith_execution(task, harness.model, harness.chat_tokenizer_for(lease), config=config,
                                 job_id=harness.record_job(lease),
                                 execution_id=lease.execution_id, deadline_s=deadline, clock=time.time,
                                 on_progress=preserve, cancelled=cancelled)
    return RunOutcome(status=result.status, error=result.error, files=result.files,
                      log={"turns": len(result.replies), "reward": result.reward,
                           "prompt_tokens": result.prompt_tokens, "output_tokens": result.output_tokens})


FAMILY = TaskFamily(
    name="arith-v1",
    generator="services.task.arith:task_generator",
    heldout="services.task.arith:heldout_tasks",
    scorer="services.task.arith:score",
    runner="services.task.families.arith:run",
)
