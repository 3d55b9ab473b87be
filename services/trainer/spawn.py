"""Replica processes the core starts for the orchestrator (``AddReplica`` / ``ReleaseReplica``).

On a single host (``gyre up``, the services actuator) the core itself starts
``python -m services.trainer.main --replica --core <self> --cell-id X`` for a freed cell and
reports when the replica has joined a step; with cell agents, the agent runs the same command
on the cell's host instead. Idempotent per switch id (a retried switch returns the same replica).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from services.common.errors import NotFound
from services.common.logging import get_logger

log = get_logger(__name__)
REPO = Path(__file__).resolve().parents[2]


@dataclass
class Spawned:
    replica_id: str
    cell_id: str
    switch_id: str
    proc: subprocess.Popen[bytes]


class ReplicaProcesses:
    """The replica processes started by this core, by cell."""

    def __init__(self, core_address: str, *, log_dir: str, extra_args: tuple[str, ...] = ()) -> None:
        self.core_address = core_address
        self.log_dir = Path(log_dir)
        self.extra_args = extra_args
        self._lock = threading.Lock()
        self._by_cell: dict[str, Spawned] = {}

    def start(self, cell_id: str, switch_id: str) -> Spawned:
        with self._lock:
            cur = self._by_cell.get(cell_id)
            if cur is not None and cur.proc.poll() is None:
                return cur  # already running here (a retried switch, or a duplicate request)
            replica_id = f"{cell_id}-{switch_id or os.urandom(3).hex()}"
            self.log_dir.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "services.trainer.main", "--replica", "--core", self.core_address,
                   "--cell-id", cell_id, "--replica-id", replica_id, "--log-json", "true", *self.extra_args]
            with open(self.log_dir / f"replica-{cell_id}.log", "ab") as out:
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                        env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
            spawned = Spawned(replica_id=replica_id, cell_id=cell_id, switch_id=switch_id, proc=proc)
            self._by_cell[cell_id] = spawned
            log.info("replica process started", cell_id=cell_id, replica_id=replica_id, pid=proc.pid)
            return spawned

    def get(self, cell_id: str) -> Spawned:
        with self._lock:
            s = self._by_cell.get(cell_id)
        if s is None:
            raise NotFound(f"no replica process was started for cell {cell_id!r}")
        return s

    def alive(self, replica_id: str) -> bool | None:
        """Whether the process of ``replica_id`` runs; None for a replica this core did not start."""
        with self._lock:
            for s in self._by_cell.values():
                if s.replica_id == replica_id:
                    return s.proc.poll() is None
        return None

    def replica_of(self, cell_id: str) -> str | None:
        with self._lock:
            s = self._by_cell.get(cell_id)
            return None if s is None else s.replica_id

    def terminate(self, cell_id: str) -> None:
        """SIGTERM the cell's replica: it leaves its step now (gradient hand-off) and exits."""
        s = self.get(cell_id)
        if s.proc.poll() is None:
            s.proc.terminate()

    def wait_exit(self, cell_id: str, timeout_s: float) -> bool:
        s = self.get(cell_id)
        try:
            s.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def stop_all(self, timeout_s: float = 10.0) -> None:
        with self._lock:
            procs = [s.proc for s in self._by_cell.values() if s.proc.poll() is None]
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
