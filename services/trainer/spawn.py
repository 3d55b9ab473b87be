"""Replica processes the core starts for the orchestrator (``AddReplica`` / ``ReleaseReplica``).

On a single host (``gyre up``, the services actuator) the core itself starts
``python -m services.trainer.main --replica --core <self> --cell-id X`` for a freed cell and
reports when the replica has joined a step; with cell agents, the agent runs the same command
on the cell's host instead. Idempotent per switch id (a retried switch returns the same replica).
"""

from __future__ import annotations

import json
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
    log: str = ""  # its log file


class ReplicaProcesses:
    """The replica processes started by this core, by cell, and ``warm`` more kept started for
    the next AddReplica: a warm process has done its imports and run a model once (~5 s on two
    cores, most of a cold replica's start), then waits for its cell on stdin; handing it one is a
    line written to a pipe. Each one taken is replaced in the background."""

    def __init__(self, core_address: str, *, log_dir: str, extra_args: tuple[str, ...] = (), warm: int = 0) -> None:
        self.core_address = core_address
        self.log_dir = Path(log_dir)
        self.extra_args = extra_args
        self.warm = warm
        self._lock = threading.Lock()
        self._by_cell: dict[str, Spawned] = {}
        self._warm: list[subprocess.Popen[bytes]] = []
        self._closed = False
        self._refill()

    def _command(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "services.trainer.main", "--replica", "--core", self.core_address, *args,
                "--log-json", "true", *self.extra_args]

    def _popen(self, cmd: list[str], log_name: str, *, stdin: int | None = None) -> subprocess.Popen[bytes]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / log_name, "ab") as out:
            return subprocess.Popen(cmd, stdin=stdin, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                    env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)

    def _refill(self) -> None:
        """Start warm processes until ``warm`` of them are alive (under the lock's protection)."""
        with self._lock:
            self._warm = [p for p in self._warm if p.poll() is None]
            while not self._closed and len(self._warm) < self.warm:
                proc = self._popen(self._command("--cell-id", "", "--replica-warm", "true"),
                                   "replica-warm.log", stdin=subprocess.PIPE)
                self._warm.append(proc)
                log.info("warm replica process started", pid=proc.pid)

    def warm_pids(self) -> list[int]:
        """Pids of the warm processes waiting for a cell."""
        with self._lock:
            return [p.pid for p in self._warm if p.poll() is None]

    def _take_warm(self, cell_id: str, replica_id: str) -> subprocess.Popen[bytes] | None:
        """Hand a warm process its cell (caller holds the lock); None when none is alive."""
        while self._warm:
            proc = self._warm.pop(0)
            if proc.poll() is not None or proc.stdin is None:
                continue
            try:
                proc.stdin.write(json.dumps({"cell_id": cell_id, "replica_id": replica_id}).encode() + b"\n")
                proc.stdin.close()
                return proc
            except OSError:  # it died meanwhile
                proc.kill()
        return None

    def start(self, cell_id: str, switch_id: str) -> Spawned:
        with self._lock:
            cur = self._by_cell.get(cell_id)
            if cur is not None and cur.proc.poll() is None:
                return cur  # already running here (a retried switch, or a duplicate request)
            replica_id = f"{cell_id}-{switch_id or os.urandom(3).hex()}"
            proc = self._take_warm(cell_id, replica_id)
            warm = proc is not None
            log_name = "replica-warm.log" if warm else f"replica-{cell_id}.log"
            if proc is None:
                proc = self._popen(self._command("--cell-id", cell_id, "--replica-id", replica_id), log_name)
            spawned = Spawned(replica_id=replica_id, cell_id=cell_id, switch_id=switch_id, proc=proc,
                              log=str(self.log_dir / log_name))
            self._by_cell[cell_id] = spawned
            log.info("replica process started", cell_id=cell_id, replica_id=replica_id, pid=proc.pid, warm=warm)
        if warm:
            threading.Thread(target=self._refill, name="warm-replicas", daemon=True).start()
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

    def pid_of(self, replica_id: str) -> int:
        """The process of ``replica_id`` when this core started it and it runs; 0 otherwise."""
        with self._lock:
            for s in self._by_cell.values():
                if s.replica_id == replica_id and s.proc.poll() is None:
                    return s.proc.pid
        return 0

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
            self._closed = True
            for p in self._warm:  # end of its stdin: a warm process that got no cell exits
                if p.stdin is not None:
                    try:
                        p.stdin.close()
                    except OSError:
                        pass
            procs = [s.proc for s in self._by_cell.values() if s.proc.poll() is None]
            procs += [p for p in self._warm if p.poll() is None]
            self._warm = []
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
