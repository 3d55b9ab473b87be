"""Supervision of a stack's processes: whatever dies is started again, with backoff and a budget.

    gyre up    starts `python -m services.supervisor --data-dir D` (detached) beside the stack
    gyre run   runs a Supervisor thread in its own process
    systemd / compose do the same with Restart=on-failure / restart policies

Every process of ``<data-dir>/run/state.json`` (redis-server, services, cell daemons, harness
workers) is checked every ``interval_s``; a dead one is started again with the command it was
started with, on the same port (others know its address), and its restart is logged, counted in
state.json (``gyre status`` shows it) and in ``restarts`` of the process's entry. Restarts back off
(``initial_backoff_s`` doubling to ``max_backoff_s``); more than ``budget`` restarts of one process
within ``window_s`` exhausts its budget: it is left down and ``failed`` in state.json names it with
the last lines of its log (``gyre run`` stops with that sentence).

Lifecycle: built -> check()* (or run(stop) in a loop) ; the daemon ends on SIGTERM (``gyre down``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.logging import get_logger

log = get_logger(__name__)


@dataclass(frozen=True, kw_only=True)
class RestartPolicy:
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    budget: int = 5
    window_s: float = 600.0


@dataclass
class _Track:
    restarts: list[float] = field(default_factory=list)  # monotonic times of restarts within the window
    next_allowed: float = 0.0
    backoff_s: float = 0.0


def exit_reason(pid: int) -> str:
    """How ``pid`` ended, when it was our child (exit code or signal); else 'exited'."""
    try:
        got, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return "exited"
    if got == 0:
        return "exited"
    code = os.waitstatus_to_exitcode(status)
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def log_tail(path: str, lines: int = 8) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class Supervisor:
    def __init__(self, state_file: Path, *, policy: RestartPolicy = RestartPolicy(),
                 echo: Callable[[str], None] | None = None, ready_timeout_s: float = 180.0) -> None:
        self.state_file = state_file
        self.policy = policy
        self.echo = echo
        self.ready_timeout_s = ready_timeout_s
        self._tracks: dict[str, _Track] = {}

    # ---------------------------------------------------------------- state file
    def _load(self) -> dict[str, Any]:
        return json.loads(self.state_file.read_text())

    def _save(self, state: dict[str, Any]) -> None:
        tmp = self.state_file.with_suffix(".sup.tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(self.state_file)

    # ---------------------------------------------------------------- one pass
    def check(self) -> list[str]:
        """Restart every dead process whose backoff has passed; returns the names restarted."""
        from services.launcher import _pid_alive

        if not self.state_file.exists():
            return []
        state = self._load()
        restarted: list[str] = []
        failed = state.setdefault("failed", {})
        entries: list[tuple[str, dict[str, Any]]] = []
        if state.get("redis") and state["redis"].get("pid") and state["redis"].get("command"):
            entries.append(("redis", state["redis"]))
        entries += list(state.get("services", {}).items())
        for name, entry in entries:
            if name in failed or _pid_alive(int(entry["pid"])):
                continue
            track = self._tracks.setdefault(name, _Track())
            now = time.monotonic()
            if now < track.next_allowed:
                continue
            reason = exit_reason(int(entry["pid"]))
            track.restarts = [t for t in track.restarts if now - t < self.policy.window_s]
            if len(track.restarts) >= self.policy.budget:
                tail = log_tail(entry.get("log") or str(self.state_file.parent.parent / "logs" / f"{name}.log"))
                failed[name] = {"reason": f"{reason}; restarted {len(track.restarts)} times within "
                                          f"{self.policy.window_s:.0f}s, the restart budget", "log_tail": tail}
                self._say(f"{name} {reason} again; its restart budget ({self.policy.budget} in "
                          f"{self.policy.window_s:.0f}s) is spent: left down", name=name)
                self._save(state)
                continue
            track.backoff_s = min(self.policy.max_backoff_s, max(self.policy.initial_backoff_s, 2 * track.backoff_s))
            track.next_allowed = now + track.backoff_s
            track.restarts.append(now)
            try:
                pid = self._restart(name, entry, state)
            except Exception as exc:  # deliberate: counted against the budget, retried after the backoff
                self._say(f"restarting {name} failed: {exc}", name=name)
                continue
            entry["pid"] = pid
            entry["restarts"] = int(entry.get("restarts", 0)) + 1
            entry["last_exit"] = reason
            self._save(state)
            restarted.append(name)
            self._say(f"{name} {reason}; restarted (pid {pid}, restart {entry['restarts']}, next backoff "
                      f"{track.backoff_s:.1f}s)", name=name)
        return restarted

    def _restart(self, name: str, entry: dict[str, Any], state: dict[str, Any]) -> int:
        from services.common.server import wait_for_ready

        env = {**os.environ, **state.get("env", {})}
        cmd = list(entry["command"])
        if name == "redis":
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                    env=env)
            self._wait_redis(entry["url"], proc)
            return proc.pid
        port_file = None
        if entry.get("address"):
            cmd += ["--port", entry["address"].rsplit(":", 1)[1]]  # the address everyone else has
            http = entry.get("info", {}).get("http", "")
            if http:
                cmd += ["--http-port", http.rsplit(":", 1)[1].split("/", 1)[0]]
            if "--port-file" in cmd:
                port_file = Path(cmd[cmd.index("--port-file") + 1])
                port_file.unlink(missing_ok=True)
        with open(entry["log"], "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=state.get("cwd") or None,
                                    start_new_session=True, env=env)
        if entry.get("address"):
            deadline = time.monotonic() + self.ready_timeout_s
            while port_file is not None and not port_file.exists():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited again at start ({exit_reason(proc.pid)})")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} did not start within {self.ready_timeout_s:.0f}s")
                time.sleep(0.05)
            wait_for_ready(entry["address"], timeout_s=max(1.0, deadline - time.monotonic()))
        return proc.pid

    @staticmethod
    def _wait_redis(url: str, proc: subprocess.Popen[bytes]) -> None:
        import redis

        deadline = time.monotonic() + 30
        while True:
            try:
                redis.Redis.from_url(url, socket_connect_timeout=0.2).ping()
                return
            except redis.exceptions.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not come back") from None
                time.sleep(0.05)

    def _say(self, line: str, *, name: str) -> None:
        log.warning(line, process=name)
        if self.echo is not None:
            self.echo(line)

    def failed(self) -> dict[str, dict[str, str]]:
        """Processes whose restart budget is spent: {name: {reason, log_tail}}."""
        if not self.state_file.exists():
            return {}
        return dict(self._load().get("failed", {}))

    # ---------------------------------------------------------------- loops
    def run(self, stop: threading.Event, interval_s: float = 0.5) -> None:
        while not stop.wait(interval_s):
            try:
                self.check()
            except Exception:  # deliberate: a torn state file or a failed restart; next pass
                log.exception("supervision pass failed")

    def start_thread(self, stop: threading.Event, interval_s: float = 0.5) -> threading.Thread:
        t = threading.Thread(target=self.run, args=(stop, interval_s), name="supervisor", daemon=True)
        t.start()
        return t


def main(argv: list[str] | None = None) -> int:
    """The detached supervisor of a `gyre up` stack (until SIGTERM or the stack's state is gone)."""
    from services.common.logging import setup_logging

    p = argparse.ArgumentParser(prog="gyre-supervisor", description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", required=True)
    p.add_argument("--interval-s", type=float, default=0.5)
    args = p.parse_args(argv)
    setup_logging(json=True, level="INFO", service="supervisor")
    state_file = Path(args.data_dir) / "run" / "state.json"
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_a: stop.set())
    signal.signal(signal.SIGINT, lambda *_a: stop.set())
    sup = Supervisor(state_file)
    log.info("supervising", state_file=str(state_file))
    while not stop.wait(args.interval_s):
        if not state_file.exists():
            break
        try:
            sup.check()
        except Exception:  # deliberate: see Supervisor.run
            log.exception("supervision pass failed")
    log.info("supervisor stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
