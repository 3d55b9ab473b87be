"""The cell daemon: the process on a cell that holds its role and runs that role's process.

A cell runs either an inference engine (ROLLOUT) or a trainer replica (TRAIN). The daemon starts
the configured command of its role as a child process; ``set_role`` (called by the scheduler
through the ``CellDaemon`` RPC) stops the current child gracefully (SIGTERM, then SIGKILL after
``stop_grace_s``) and starts the new role's command. The scheduler drains a ROLLOUT cell through
the gateway *before* asking its daemon to switch, so stopping the engine interrupts nothing.

Commands are templates with ``{cell_id} {job_id} {step} {weight_version} {switch_id}``; an empty command
means the role needs no process on this cell (e.g. a trainer replica hosted elsewhere).

Lifecycle: built (role, no child) -> start() (child of the initial role) -> set_role()* -> stop().
``set_role`` is idempotent per switch id, so a scheduler that crashed mid-switch can repeat it.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Mapping

from services.common.errors import InvalidArgument
from services.common.logging import get_logger
from services.common.roles import CellRole

log = get_logger(__name__)


class CellDaemon:
    def __init__(self, *, cell_id: str, role: CellRole, commands: Mapping[CellRole, str], stop_grace_s: float = 10.0,
                 switch_delay_s: float = 0.0) -> None:
        if role is CellRole.SWITCHING:
            raise ValueError("a cell daemon starts as rollout, train or idle")
        self.cell_id = cell_id
        self._role: CellRole = role
        self.commands = dict(commands)
        self.stop_grace_s = stop_grace_s
        # Extra seconds each switch takes: models engine/replica start-up cost where the commands
        # are light (demos, crash tests that must catch a switch in flight).
        self.switch_delay_s = switch_delay_s
        self.last_switch_id = ""
        self.switches = 0
        self._child: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._context: dict[str, object] = {"job_id": "", "step": 0, "weight_version": 0, "switch_id": "start"}

    @property
    def role(self) -> CellRole:
        return self._role

    @property
    def child_pid(self) -> int | None:
        child = self._child
        return child.pid if child is not None and child.poll() is None else None

    def start(self) -> CellDaemon:
        with self._lock:
            self._launch()
        return self

    def stop(self) -> None:
        with self._lock:
            self._terminate()

    def set_role(self, role: CellRole, switch_id: str, *, job_id: str = "", step: int = 0,
                 weight_version: int = 0) -> tuple[CellRole, float]:
        """Switch to ``role``; returns (role, seconds taken). A repeated ``switch_id`` returns at once."""
        if role not in (CellRole.ROLLOUT, CellRole.TRAIN, CellRole.IDLE):
            raise InvalidArgument(f"a cell can be set to rollout, train or idle, not {role.value}")
        if not switch_id:
            raise InvalidArgument("switch_id is required (it makes the switch idempotent)")
        with self._lock:
            if switch_id == self.last_switch_id:
                return self._role, 0.0
            t0 = time.monotonic()
            bound = log.bind(cell_id=self.cell_id, switch_id=switch_id, job_id=job_id)
            if role is not self._role:
                bound.info("switching", from_role=self._role.value, to_role=role.value)
                self._terminate()
                if self.switch_delay_s > 0:
                    time.sleep(self.switch_delay_s)
                self._role = role
                self._context = {"job_id": job_id, "step": step, "weight_version": weight_version,
                                 "switch_id": switch_id}
                self._launch()
                self.switches += 1
            self.last_switch_id = switch_id
            took = time.monotonic() - t0
            bound.info("role set", role=role.value, duration_s=round(took, 3))
            return self._role, took

    def _launch(self) -> None:
        template = self.commands.get(self._role, "")
        if not template:
            self._child = None
            return
        argv = shlex.split(template.format(cell_id=self.cell_id, **self._context))
        self._child = subprocess.Popen(argv, start_new_session=True)
        log.info("role process started", cell_id=self.cell_id, role=self._role.value, pid=self._child.pid)

    def _terminate(self) -> None:
        child, self._child = self._child, None
        if child is None or child.poll() is not None:
            return
        os.killpg(child.pid, signal.SIGTERM)
        try:
            child.wait(timeout=self.stop_grace_s)
        except subprocess.TimeoutExpired:
            log.warning("role process ignored SIGTERM; killing", cell_id=self.cell_id, pid=child.pid)
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
