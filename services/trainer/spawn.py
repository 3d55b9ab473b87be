"""Replica processes the core starts for the orchestrator (``AddReplica`` / ``ReleaseReplica``).

On a single host (``gyre up``, the services actuator) the core itself starts
``python -m services.trainer.main --replica --core <self> --cell-id X`` for a freed cell and
reports when the replica has joined a step; with cell daemons, the daemon runs the same command
on the cell's host instead. Idempotent per switch id (a retried switch returns the same replica).

Most replicas come from a *pool*: a pooled process does its imports and runs a model once, then
waits for a cell on its stdin (one JSON line); when its cell is given back (ReleaseReplica, or the
replica leaves at a step's seal or the job's end) it does not exit but tells the core "free" on its
status pipe and waits for the next cell, keeping its model when the next cell trains the same job.
So a cell that alternates ROLLOUT <-> TRAIN (colocate, elastic) starts a process once, not at every
switch, and its release waits for a leave, not for an exit.

    core                                   pooled process
    start: pipe(status), Popen(stdin=PIPE) imports, warm-up model run
                           <── "ready" ──  (status pipe)
    AddReplica(cell):  {"cell_id", "replica_id"} ──> stdin: run the replica loop
    ReleaseReplica:    {"release": id} ──> stdin: that replica leaves now (hand-off), then
                           <── "free" ───  back to reading stdin
    stop / retire:     close stdin ──────>  exit (SIGTERM: leave if busy, then exit)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
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
    pooled: bool = False  # a pool process: back in the pool once this replica's cell is given back


@dataclass
class _Pooled:
    proc: subprocess.Popen[bytes]
    started: int  # order of start (oldest first when none is ready)
    state: str = "warming"  # warming -> idle <-> busy; dead once its status pipe closes
    replica_id: str = ""  # the replica it runs while busy
    assignments: int = 0
    reader: threading.Thread | None = field(default=None, repr=False)


class ReplicaProcesses:
    """The replica processes started by this core, by cell, and its pool: ``warm`` processes started
    ahead (imports and a model run, ~5 s on two cores, most of a cold replica's start), each back in
    the pool when its cell is given back; when more cells train at once than the pool holds, it
    grows by a process started for the extra cell, up to the most cells that trained at once
    (``warm`` = 0: no pool, every replica a process of its own that exits with it)."""

    def __init__(self, core_address: str, *, log_dir: str, extra_args: tuple[str, ...] = (), warm: int = 0) -> None:
        self.core_address = core_address
        self.log_dir = Path(log_dir)
        self.extra_args = extra_args
        self.warm = warm
        self._cv = threading.Condition()
        self._by_cell: dict[str, Spawned] = {}
        self._pool: dict[int, _Pooled] = {}  # by pid
        self._started = 0
        self._peak_busy = 0
        self._closed = False
        self._refill()

    def _command(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "services.trainer.main", "--replica", "--core", self.core_address, *args,
                "--log-json", "true", "--replica-log-dir", str(self.log_dir), *self.extra_args]

    def _popen(self, cmd: list[str], log_name: str, *, stdin: int | None = None,
               pass_fds: tuple[int, ...] = ()) -> subprocess.Popen[bytes]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / log_name, "ab") as out:
            return subprocess.Popen(cmd, stdin=stdin, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                    env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True,
                                    pass_fds=pass_fds)

    # -- the pool ---------------------------------------------------------------------------------
    def _refill(self) -> None:
        """Start pool processes until the pool has ``warm`` (none once closed). Busy ones count:
        they come back when their cell is given back."""
        with self._cv:
            while not self._closed and sum(1 for p in self._pool.values() if p.state != "retiring") < self.warm:
                self._start_pooled()

    def _waiting(self) -> int:
        return sum(1 for p in self._pool.values() if p.state in ("warming", "idle"))

    def _start_pooled(self) -> _Pooled:
        """(caller holds the lock)"""
        r, w = os.pipe()
        try:
            proc = self._popen(self._command("--cell-id", "", "--replica-warm", "true", "--replica-status-fd", str(w)),
                               "replica-warm.log", stdin=subprocess.PIPE, pass_fds=(w,))
        finally:
            os.close(w)
        self._started += 1
        p = _Pooled(proc=proc, started=self._started)
        self._pool[proc.pid] = p
        p.reader = threading.Thread(target=self._read_status, args=(p, r), name=f"replica-status-{proc.pid}",
                                    daemon=True)
        p.reader.start()
        log.info("warm replica process started", pid=proc.pid)
        return p

    def _read_status(self, p: _Pooled, fd: int) -> None:
        """Follow one pool process's status pipe until it closes (the process exited)."""
        with os.fdopen(fd, "rb") as pipe:
            for raw in pipe:
                line = raw.decode(errors="replace").strip()
                with self._cv:
                    if line == "ready" and p.state == "warming":
                        p.state = "idle"
                    elif line == "free" and p.state == "busy":
                        log.info("replica process back in the pool", pid=p.proc.pid, replica_id=p.replica_id)
                        p.state, p.replica_id = "idle", ""
                        if self._closed:
                            self._retire(p)
                        elif self._waiting() > max(self.warm, self._peak_busy):
                            # one too many waits now: retire the least ready (one still warming, else
                            # one that never had a cell, so holds no model; the newest first)
                            extra = max((q for q in self._pool.values() if q.state in ("warming", "idle")),
                                        key=lambda q: (q.state == "warming", q.assignments == 0, q.started))
                            self._retire(extra)
                    self._cv.notify_all()
        p.proc.wait()
        with self._cv:
            p.state, p.replica_id = "dead", ""
            self._pool.pop(p.proc.pid, None)
            self._cv.notify_all()
        if p.proc.returncode not in (0, -signal.SIGTERM):
            log.warning("replica process exited", pid=p.proc.pid, code=p.proc.returncode)
        self._refill()

    def _retire(self, p: _Pooled) -> None:
        """End of its stdin: a pool process waiting for a cell exits (caller holds the lock)."""
        p.state = "retiring"
        if p.proc.stdin is not None:
            try:
                p.proc.stdin.close()
            except OSError:
                pass

    def warm_pids(self) -> list[int]:
        """Pids of the pool processes waiting for a cell (warming up or ready)."""
        with self._cv:
            return [pid for pid, p in self._pool.items() if p.state in ("warming", "idle") and p.proc.poll() is None]

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait until ``warm`` pool processes have warmed up (tests, benchmarks)."""
        with self._cv:
            return self._cv.wait_for(
                lambda: sum(1 for p in self._pool.values() if p.state == "idle") >= self.warm, timeout=timeout_s)

    def _take_pooled(self, cell_id: str, replica_id: str) -> _Pooled | None:
        """Hand a pool process the cell (caller holds the lock): a ready one first, else the one
        that started first (it is ready soonest, sooner than a new process); None when none waits."""
        waiting = sorted((p for p in self._pool.values() if p.state in ("idle", "warming")),
                         key=lambda p: (p.state != "idle", p.started))
        for p in waiting:
            if p.proc.poll() is not None or p.proc.stdin is None:
                continue
            try:
                p.proc.stdin.write(json.dumps({"cell_id": cell_id, "replica_id": replica_id}).encode() + b"\n")
                p.proc.stdin.flush()
            except OSError:  # it died meanwhile
                p.proc.kill()
                continue
            log.info("pool process takes the cell", pid=p.proc.pid, cell_id=cell_id, replica_id=replica_id,
                     ready=p.state == "idle", earlier_cells=p.assignments)
            p.state, p.replica_id = "busy", replica_id
            p.assignments += 1
            self._peak_busy = max(self._peak_busy, sum(1 for q in self._pool.values() if q.state == "busy"))
            return p
        return None

    # -- replicas by cell -------------------------------------------------------------------------
    def start(self, cell_id: str, switch_id: str) -> Spawned:
        with self._cv:
            cur = self._by_cell.get(cell_id)
            if cur is not None and self._runs(cur):
                return cur  # already running here (a retried switch, or a duplicate request)
            replica_id = f"{cell_id}-{switch_id or os.urandom(3).hex()}"
            pooled = self._take_pooled(cell_id, replica_id)
            if pooled is None and self.warm > 0 and not self._closed:
                # none waits: the pool grows by one, started for this cell (a cold start this once;
                # the process stays in the pool, so the cell finds it ready next time)
                self._start_pooled()
                pooled = self._take_pooled(cell_id, replica_id)
            if pooled is not None:
                proc, log_name = pooled.proc, "replica-warm.log"
            else:
                log_name = f"replica-{cell_id}.log"
                proc = self._popen(self._command("--cell-id", cell_id, "--replica-id", replica_id), log_name)
            spawned = Spawned(replica_id=replica_id, cell_id=cell_id, switch_id=switch_id, proc=proc,
                              log=str(self.log_dir / log_name), pooled=pooled is not None)
            self._by_cell[cell_id] = spawned
            log.info("replica process started", cell_id=cell_id, replica_id=replica_id, pid=proc.pid,
                     warm=pooled is not None)
        return spawned

    def _runs(self, s: Spawned) -> bool:
        """Whether replica ``s`` still runs (caller holds the lock): its process is alive and, for a
        pool process, still busy with this replica."""
        if s.proc.poll() is not None:
            return False
        if not s.pooled:
            return True
        p = self._pool.get(s.proc.pid)
        return p is not None and p.state == "busy" and p.replica_id == s.replica_id

    def get(self, cell_id: str) -> Spawned:
        with self._cv:
            s = self._by_cell.get(cell_id)
        if s is None:
            raise NotFound(f"no replica process was started for cell {cell_id!r}")
        return s

    def alive(self, replica_id: str) -> bool | None:
        """Whether replica ``replica_id`` runs; None for a replica this core did not start."""
        with self._cv:
            for s in self._by_cell.values():
                if s.replica_id == replica_id:
                    return self._runs(s)
        return None

    def pid_of(self, replica_id: str) -> int:
        """The process of ``replica_id`` when this core started it and it runs; 0 otherwise."""
        with self._cv:
            for s in self._by_cell.values():
                if s.replica_id == replica_id and self._runs(s):
                    return s.proc.pid
        return 0

    def replica_of(self, cell_id: str) -> str | None:
        with self._cv:
            s = self._by_cell.get(cell_id)
            return None if s is None else s.replica_id

    def terminate(self, cell_id: str) -> None:
        """Give the cell back now: its replica leaves its step (gradient hand-off); a pool process
        (a release line on its stdin, after the line that handed the cell over, so the release
        is never lost however early it comes) then waits for its next cell, any other exits
        (SIGTERM)."""
        s = self.get(cell_id)
        with self._cv:
            if not self._runs(s):
                return
            stdin = s.proc.stdin
            if not s.pooled or stdin is None:
                s.proc.send_signal(signal.SIGTERM)
                return
            try:
                stdin.write(json.dumps({"release": s.replica_id}).encode() + b"\n")
                stdin.flush()
            except OSError:  # it died meanwhile: nothing left to release
                pass

    def wait_exit(self, cell_id: str, timeout_s: float) -> bool:
        """Wait until the cell's replica has ended: left its step and, for a pool process, told the
        core it is free (or exited); any other process exited. False after ``timeout_s``."""
        s = self.get(cell_id)
        if s.pooled:
            with self._cv:
                return self._cv.wait_for(lambda: not self._runs(s), timeout=timeout_s)
        try:
            s.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def stop_all(self, timeout_s: float = 10.0) -> None:
        with self._cv:
            self._closed = True
            for p in self._pool.values():  # end of its stdin: a pool process waiting for a cell exits
                self._retire(p)
            procs = [s.proc for s in self._by_cell.values() if s.proc.poll() is None]
            procs += [p.proc for p in self._pool.values() if p.proc.poll() is None]
        for proc in set(procs):
            proc.terminate()
        for proc in set(procs):
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
