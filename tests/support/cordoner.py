"""An operator's cordon during a `gyre run` (e2e): once the job's executions and the long calls
run, cordon the rollout cell with the most requests in flight, so that the policy drains it to
training and its requests migrate; then uncordon it. Repeated (at most ``attempts`` times) until
the job's event log shows a drain that migrated something, so the test does not hinge on the
policy freeing a busy cell on its own.

Given the job's ``LongCalls``, the cell it cordons is one hosting a long call that has just started
(asked of the engines themselves), so a call is still in flight when the drain comes: a cell busy
only with short calls finished them between the cordon and the drain (the gateway routes nothing
new to it meanwhile), migrated nothing, and stayed in training, leaving no second cell to try."""

from __future__ import annotations

import threading
import time

from tests.support.longcalls import LongCalls
from tests.support.waiting import wait_until


class Cordoner:
    def __init__(self, attempts: int = 4, timeout_s: float = 300.0, long_calls: LongCalls | None = None) -> None:
        self.long_calls = long_calls
        self.attempts = attempts
        self.timeout_s = timeout_s
        self.scheduler = ""
        self.gateway = ""
        self.migrated = 0
        self.cordons = 0
        self.error = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def on_line(self, line: str) -> None:
        """Feed `gyre run`'s echo lines: the scheduler's address, then the job id."""
        if line.startswith("scheduler ") and not self.scheduler:
            self.scheduler = line.split()[1]
        elif line.startswith("gateway ") and "worker" not in line and not self.gateway:
            self.gateway = line.split()[1]
        elif line.startswith("job: ") and self._thread is None and self.scheduler:
            self._thread = threading.Thread(target=self._run, args=(line.split()[1],), daemon=True)
            self._thread.start()
        elif line.startswith("report: "):
            self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)

    def _in_flight(self) -> dict[str, int]:
        """Requests in flight per cell at the gateway ({} before its address is known); with long
        calls: per cell, the long calls just started that its engine hosts now."""
        if not self.gateway:
            return {}
        try:
            if self.long_calls is not None:
                return _fresh_long_calls(self.gateway, self.long_calls)
            return _gateway_in_flight(self.gateway)
        except Exception:  # the registry's count serves meanwhile (a gateway restarting, say)
            return {}

    def _run(self, job_id: str) -> None:
        from services.scheduler.client import SchedulerClient

        try:
            with SchedulerClient(self.scheduler) as sched:
                deadline = time.monotonic() + self.timeout_s
                while not self._stop.is_set() and self.migrated == 0 and self.cordons < self.attempts:
                    assert time.monotonic() < deadline, "no busy rollout cell to cordon"
                    # requests in flight on each rollout cell now, as the gateway routes them (the
                    # registry's count lags: a cell it calls busy may have finished its calls)
                    live = self._in_flight()
                    fallback = (lambda c: 0) if self.long_calls is not None else (lambda c: c.cell.inflight)
                    rolling = sorted((live.get(c.cell.cell_id, fallback(c)), c.cell.cell_id)
                                     for c in sched.list_cells()
                                     if c.cell.role.value == "rollout" and not c.cell.is_core)
                    # another rollout cell must stay to take the work
                    if len(rolling) < 2 or rolling[-1][0] == 0 or sched.get_job(job_id).running == 0:
                        self._stop.wait(0.1)
                        continue
                    cell = rolling[-1][1]
                    sched.cordon_cell(cell, reason="e2e: drain a busy cell")
                    self.cordons += 1
                    try:
                        wait_until(lambda: self._stop.is_set() or _role(sched, cell) == "train",
                                   max(0.0, deadline - time.monotonic()), f"cordoned {cell} to move to training",
                                   poll_s=0.1)
                    finally:
                        sched.cordon_cell(cell, cordoned=False)
                    self.migrated = sum(int(e.attrs.get("migrated", "0")) for e in sched.watch(job_id, follow=False)
                                        if e.kind == "migration" and e.attrs.get("cell_id") == cell)
        except Exception as exc:  # reported by the test
            self.error = f"{type(exc).__name__}: {exc}"


def _gateway_in_flight(address: str) -> dict[str, int]:
    from services.rollout.client import GatewayClient

    with GatewayClient(address) as gateway:
        return {e.cell_id: int(e.in_flight) for e in gateway.list_engines()}


def _fresh_long_calls(address: str, long_calls: LongCalls) -> dict[str, int]:
    from services.rollout.client import EngineClient, GatewayClient

    with GatewayClient(address) as gateway:
        engines = [(e.cell_id, e.address) for e in gateway.list_engines() if e.state == "ready"]
    fresh = long_calls.fresh()
    out: dict[str, int] = {}
    for cell_id, engine_address in engines:
        with EngineClient(engine_address) as engine:
            out[cell_id] = len(fresh & set(engine.get_load(timeout_s=5.0).request_ids))
    return out


def _role(sched: object, cell_id: str) -> str:
    return next(c.cell.role.value for c in sched.list_cells() if c.cell.cell_id == cell_id)  # type: ignore[attr-defined]
