"""Per-job totals of what a gateway served (``Gateway.JobUsage``): calls, prompt / cached / output
tokens, the context reached. Every call through the gateway counts, whichever harness made it, so
the scheduler can show a job's progress inside its model calls (an XLong execution spends hours
in one step) and its prefix reuse, in ``gyre watch`` and the report.

Bounded: one small record per job, the ``max_jobs`` most recently active kept (nothing per
execution or per call outlives the call)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace


@dataclass
class Usage:
    job_id: str
    calls: int = 0
    in_flight: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    max_context_tokens: int = 0
    last_context_tokens: int = 0
    first_call_at_s: float = 0.0
    last_call_at_s: float = 0.0


class UsageBook:
    def __init__(self, max_jobs: int = 256, clock: Callable[[], float] = time.time) -> None:
        if max_jobs < 1:
            raise ValueError("max_jobs must be >= 1")
        self.max_jobs = max_jobs
        self.clock = clock
        self._jobs: OrderedDict[str, Usage] = OrderedDict()
        self._lock = threading.Lock()

    def _get(self, job_id: str) -> Usage:
        u = self._jobs.get(job_id)
        if u is None:
            u = self._jobs[job_id] = Usage(job_id, first_call_at_s=self.clock())
            while len(self._jobs) > self.max_jobs:
                self._jobs.popitem(last=False)
        else:
            self._jobs.move_to_end(job_id)
        return u

    def started(self, job_id: str) -> None:
        """A call of ``job_id`` starts streaming."""
        with self._lock:
            self._get(job_id).in_flight += 1

    def ended(self, job_id: str, *, prompt_tokens: int = 0, cached_tokens: int = 0, output_tokens: int = 0,
              finished: bool = True) -> None:
        """A call of ``job_id`` ended (``started`` came first); ``finished``: it produced its output
        (an error or a cancelled call counts no tokens)."""
        with self._lock:
            u = self._get(job_id)
            u.in_flight = max(u.in_flight - 1, 0)
            if not finished:
                return
            u.calls += 1
            u.prompt_tokens += prompt_tokens
            u.cached_tokens += cached_tokens
            u.output_tokens += output_tokens
            u.last_context_tokens = prompt_tokens + output_tokens
            u.max_context_tokens = max(u.max_context_tokens, u.last_context_tokens)
            u.last_call_at_s = self.clock()

    def snapshot(self, job_ids: Iterable[str] = ()) -> list[Usage]:
        """Copies of the records of ``job_ids`` that made a call (all kept ones when empty)."""
        with self._lock:
            wanted = list(job_ids)
            if not wanted:
                return [replace(u) for u in self._jobs.values()]
            return [replace(self._jobs[j]) for j in dict.fromkeys(wanted) if j in self._jobs]
