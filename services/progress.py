"""Live progress of one job (``gyre run``, ``gyre watch``): a rich table on a terminal, else a
plain line every 10 s. Fed by a ``JobView`` (events) plus ``GetJob`` (queue counts).

While the table is live it owns the terminal: this process's log lines go to ``log_path`` instead
of stderr (``services.common.logging.logs_to_file``) and the table counts them."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from services.jobwatch import JobView, training_line, usage_line


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = int(width * min(done, total) / max(total, 1))
    return "█" * filled + "░" * (width - filled)


class Progress:
    def __init__(self, scheduler: Any, view: JobView, *, quiet: bool = False,
                 echo: Callable[[str], None] = print, line_every_s: float = 10.0,
                 log_path: str | Path | None = None) -> None:
        from rich.console import Console

        self.scheduler, self.view, self.echo = scheduler, view, echo
        self.console = Console(stderr=False)
        self.live: Any = None
        self.quiet = quiet
        self.line_every_s = line_every_s
        self._last_line = 0.0
        self._last_poll = 0.0
        self._job: Any = None
        self.log_path = Path(log_path) if log_path else None
        self._logs: Any = None  # the sink counting the lines diverted to log_path
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Progress:
        if not self.quiet and self.console.is_terminal:
            from rich.live import Live

            from services.common.logging import logs_to_file

            if self.log_path is not None:
                self._logs = self._stack.enter_context(logs_to_file(self.log_path))
            self.live = Live(self._table(), console=self.console, refresh_per_second=2)
            self.live.start()
        return self

    def __exit__(self, *_exc: Any) -> None:
        if self.live is not None:
            self.live.stop()
        self._stack.close()
        if self._logs is not None and self._logs.lines:
            self.echo(f"{self._logs.lines} log line(s) of this command are in {self.log_path}")

    def update(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_poll < 0.5:
            return
        self._last_poll = now
        try:
            self._job = self.scheduler.get_job(self.view.job_id)
        except Exception:  # deliberate: a restarting scheduler; show the last known figures
            pass
        if self.live is not None:
            self.live.update(self._table())
        elif force or now - self._last_line >= self.line_every_s:
            self._last_line = now
            self.echo(self.line())

    def line(self) -> str:
        v, job = self.view, self._job
        spec = job.spec if job is not None else None
        steps = f"{len(v.steps)}/{spec.num_steps}" if spec else str(len(v.steps))
        counts = (f" done {job.done_in_step}/{spec.step_size} running {job.running} queued {job.queued}"
                  if job is not None and spec is not None else "")
        last_eval = (f" held-out {v.evals[-1]['heldout_pass_rate']:.3f} (after {v.evals[-1]['step']})"
                     if v.evals else "")
        u = v.usage()
        calls = (f" calls {u['calls']:,.0f} context {u['last_context']:,.0f}/{u['max_context']:,.0f} "
                 f"reuse {u['reuse']:.0%}" + (f" {u['output_tok_s']:,.0f} tok/s" if "output_tok_s" in u else "")
                 if u is not None else "")
        trainer = f" trainer: {training_line(v.last_training)}" if v.last_training else ""
        return (f"[{v.job_id}] {v.state} step {steps} v{v.weight_version}{counts}{calls} switches {len(v.switches)} "
                f"outcomes {dict(v.outcomes)}{last_eval}{trainer}")

    def _table(self) -> Any:
        from rich.table import Table

        v, job = self.view, self._job
        spec = job.spec if job is not None else None
        t = Table(title=f"gyre  {v.job_id}  ({spec.mode.value if spec else '?'})", show_header=False)
        total = spec.num_steps if spec else max(len(v.steps), 1)
        t.add_row("state", v.state + (f" ({v.message})" if v.message else ""))
        t.add_row("step", _bar(len(v.steps), total) + f" {len(v.steps)}/{total}  (weight version {v.weight_version})")
        if job is not None and spec is not None:
            t.add_row("executions", _bar(job.done_in_step, spec.step_size) +
                      f" {job.done_in_step}/{spec.step_size} of step {job.current_step}, {job.running} in flight, "
                      f"{job.queued} queued")
        m = v.last_metrics
        if m:
            t.add_row("cells", f"{m.get('rollout_cells', '?')} rollout, {m.get('train_cells', '?')} train, "
                               f"{m.get('switching_cells', '?')} switching   switches: {len(v.switches)}")
        u = v.usage()
        if u is not None:
            t.add_row("model calls", usage_line(u))
        if v.last_training:
            t.add_row("trainer", training_line(v.last_training))
        t.add_row("outcomes", ", ".join(f"{k} {n}" for k, n in sorted(v.outcomes.items())) or "-")
        if v.evals:
            t.add_row("held-out", "  ".join(f"{e['step']}: {e['heldout_pass_rate']:.2f}" for e in v.evals))
        if v.errors:
            t.add_row("warnings", f"{len(v.errors)} (last: {v.errors[-1][:90]})")
        if self._logs is not None and self._logs.lines:
            t.add_row("log lines", f"{self._logs.lines} (warnings and errors of this command, in {self.log_path})")
        return t
