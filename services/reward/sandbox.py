"""Scorers run in sandboxed worker processes, so a hostile, hanging or crashing scorer (or the
agent-written code it runs) can neither reach what the service holds nor take it down.

    ScorerPool ──(4-byte length + pickle: spec, input)──> worker stdin
               <──(4-byte length + JSON: output | error)── worker protocol fd
    time limit passed  -> SIGKILL the worker (its whole sandbox dies), raise ScorerError("timeout")
    worker died / EOF  -> start a fresh one, raise ScorerError("error", exit code)

The sandbox (``sandbox = "bwrap"``, the default) is bubblewrap: a worker is
``bwrap ... python -m services.reward.scorer_worker``, started as an unprivileged user (when the
service runs as root: a uid of its own per worker, from ``uid_base``), with

- every namespace unshared: no network at all (a loopback of its own, down: Redis, the other
  services and the internet are unreachable), its own PID namespace (it sees only its own
  processes in /proc; when the worker dies, everything in it dies), IPC, UTS, cgroup;
- a clean environment: PATH, HOME, TMPDIR, LANG, PYTHONPATH and the names in ``env`` only (no
  REDIS_URL, no token, nothing of the service's environment);
- a filesystem of read-only binds (/usr and the libraries, the interpreter, the virtualenv, the
  ``services`` package and the ``paths`` an operator adds for scorer code) and two size-capped
  tmpfs (``/ws``: each scoring's workspace files in a fresh directory, its working directory;
  ``/tmp``). The service's data directory, its secrets, other jobs' workspaces, /root and /home
  are not in it;
- rlimits in the worker: address space, file size, open files, processes, and CPU time per
  scoring (each scoring is a forked child; what it leaves behind is killed after it).

Why bubblewrap and not only a network namespace: a netns alone still shows the host's files and
processes to the scorer; bubblewrap sets up the mount, PID and network namespaces in one audited
setuid-free tool (unprivileged user namespaces), with ``--die-with-parent``. It is the Debian
package ``bubblewrap`` (``make install`` installs it when root). ``sandbox = "none"`` runs workers
without it, as the service's own user (same limits, clean environment and fresh directories, but
the host's network, files and processes): for machines where user namespaces are disabled, and
logged as a warning at every start.

Workers are reused between scorings of the same job (imports stay warm) and never across jobs:
each job has its own idle workers; the pool holds at most ``size`` workers in all, killing idle
workers of other jobs to make room.

Lifecycle: ScorerPool(size, sandbox) -> score(...) from any thread -> close().
"""

from __future__ import annotations

import json
import os
import pickle
import select
import shutil
import struct
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from services.common.bwrap import SYSTEM_PATHS, existing_paths
from services.common.logging import get_logger
from services.reward.scorers import ScoreInput, ScorerError, ScorerOutput, ScorerSpec, parse_output

__all__ = ["ScorerPool", "SandboxSpec", "SANDBOXES"]

log = get_logger(__name__)

_REPO = Path(__file__).resolve().parents[2]
_HEADER = struct.Struct("<I")
MAX_REPLY_BYTES = 8 << 20
SANDBOXES = ("bwrap", "none")
_BASE_ENV = ("PATH", "HOME", "TMPDIR", "LANG", "PYTHONPATH", "PYTHONDONTWRITEBYTECODE", "PYTHONNOUSERSITE")


@dataclass(frozen=True, kw_only=True)
class SandboxSpec:
    """How scorer workers are confined (the reward service's ``scorer_*`` settings)."""

    sandbox: str = "bwrap"
    memory_mb: int = 1024
    max_procs: int = 64
    max_open_files: int = 256
    max_file_mb: int = 64
    scratch_mb: int = 256  # each of the /ws and /tmp tmpfs
    uid_base: int = 61000  # when the service runs as root: worker k runs as uid_base + k % 1000
    paths: tuple[str, ...] = ()  # read-only, importable (PYTHONPATH): scorer code an operator adds
    env: tuple[str, ...] = ()  # names of the service's environment variables a scorer may see

    def __post_init__(self) -> None:
        if self.sandbox not in SANDBOXES:
            raise ValueError(f"sandbox must be one of {', '.join(SANDBOXES)}, got {self.sandbox!r}")
        for name in self.env:
            if name in _BASE_ENV or not name.replace("_", "").isalnum():
                raise ValueError(f"scorer environment variable {name!r} cannot be passed to scorers")

    def read_only_paths(self) -> list[str]:
        """What the sandbox sees, read-only, at the same paths (those that exist; symlink targets too)."""
        return existing_paths([*SYSTEM_PATHS, sys.base_prefix, sys.prefix, str(_REPO / "services"), *self.paths])

    def command(self, uid: int, cpu_s: int) -> list[str]:
        """The worker's argv (bubblewrap around the interpreter, or the interpreter alone)."""
        scratch = "/ws" if self.sandbox == "bwrap" else ""
        worker = [sys.executable, "-m", "services.reward.scorer_worker", "--memory-mb", str(self.memory_mb),
                  "--cpu-s", str(cpu_s), "--max-procs", str(self.max_procs), "--max-open-files",
                  str(self.max_open_files), "--max-file-mb", str(self.max_file_mb)]
        if self.sandbox == "none":
            return worker
        bwrap = shutil.which("bwrap")
        if bwrap is None:
            raise ValueError("scorer sandbox 'bwrap' needs bubblewrap: install the Debian package "
                               "(apt-get install bubblewrap; `make install` does it as root), or set the reward "
                               "service's scorer_sandbox = 'none' to run scorers unconfined")
        if os.geteuid() == 0:
            # bubblewrap as root makes the namespaces without a user namespace; the worker then
            # drops to ``uid`` (a plain unprivileged user on the host) before it reads anything
            argv = [bwrap, "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
            worker += ["--uid", str(uid)]
        else:  # an unprivileged service: a user namespace (bubblewrap drops every capability)
            argv = [bwrap, "--unshare-all", "--cap-drop", "ALL"]
        argv += ["--die-with-parent", "--new-session", "--hostname", "gyre-scorer", "--clearenv"]
        for name, value in self.environment(uid).items():
            argv += ["--setenv", name, value]
        # the scratch tmpfs first: binds below /tmp (a checkout in /tmp) are mounted over it, not hidden
        size = str(self.scratch_mb << 20)
        argv += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/tmp", "--size", size,
                 "--tmpfs", "/ws"]
        ro = self.read_only_paths()
        parents = sorted({str(q) for p in ro for q in Path(p).parents if str(q) != "/"} - set(ro))
        for parent in parents:  # traversable by the sandbox's user (bubblewrap would make them 0700)
            argv += ["--perms", "0755", "--dir", parent]
        for path in ro:
            argv += ["--ro-bind", path, path]
        argv += ["--chdir", "/ws"]
        return argv + worker + ["--scratch", scratch, "--reap"]

    def environment(self, uid: int) -> dict[str, str]:
        home = "/ws" if self.sandbox == "bwrap" else ""
        pythonpath = os.pathsep.join([str(_REPO), *self.paths])
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONPATH": pythonpath,
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONNOUSERSITE": "1"}
        if home:
            env.update(HOME=home, TMPDIR="/tmp")
        env.update({name: os.environ[name] for name in self.env if name in os.environ})
        return env


class _Worker:
    def __init__(self, spec: SandboxSpec, uid: int, cpu_s: int, job_id: str) -> None:
        self.job_id = job_id
        env = spec.environment(uid)
        self.home: str | None = None
        if spec.sandbox == "none":  # no namespaces and the service's own user: limits and environment only
            import tempfile

            self.home = tempfile.mkdtemp(prefix="gyre-scorer-")
            env.update(HOME=self.home, TMPDIR=self.home)
        # (bubblewrap as root makes the namespaces itself; the worker drops to uid inside)
        self.proc = subprocess.Popen(
            spec.command(uid, cpu_s) + (["--scratch", self.home] if self.home else []),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd=self.home or "/",
            env=env,
            start_new_session=True,  # its own process group: killing it kills any children too
        )

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 9)
            except ProcessLookupError:
                pass
        self.proc.wait()
        for fh in (self.proc.stdin, self.proc.stdout):
            if fh is not None:
                fh.close()
        if self.home:
            shutil.rmtree(self.home, ignore_errors=True)

    def _read_exact(self, n: int, deadline: float) -> bytes:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        chunks: list[bytes] = []
        got = 0
        while got < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError
            ready, _, _ = select.select([fd], [], [], remaining)
            if not ready:
                raise TimeoutError
            chunk = os.read(fd, min(n - got, 1 << 20))
            if not chunk:
                raise EOFError
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks)

    def call(self, payload: bytes, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdin is not None
        deadline = time.monotonic() + timeout_s
        self.proc.stdin.write(_HEADER.pack(len(payload)) + payload)
        self.proc.stdin.flush()
        (size,) = _HEADER.unpack(self._read_exact(_HEADER.size, deadline))
        if size > MAX_REPLY_BYTES:
            raise ValueError(f"scorer reply of {size} bytes exceeds {MAX_REPLY_BYTES}")
        reply = json.loads(self._read_exact(size, deadline))
        if not isinstance(reply, dict):
            raise ValueError("scorer reply is not a JSON object")
        return reply


class ScorerPool:
    """At most `size` concurrent scorings, each in a sandboxed worker with a time limit; a worker
    serves one job only."""

    def __init__(self, *, size: int = 2, memory_mb: int = 1024, sandbox: SandboxSpec | None = None,
                 cpu_s: int = 31) -> None:
        if size < 1:
            raise ValueError(f"scorer pool size must be >= 1, got {size}.")
        self.size = size
        self.sandbox = sandbox or SandboxSpec(memory_mb=memory_mb)
        self.cpu_s = cpu_s
        if self.sandbox.sandbox == "none":
            log.warning("scorers run without a sandbox (scorer_sandbox = 'none'): they see this host's network "
                        "and files")
        else:
            self.sandbox.command(self.sandbox.uid_base, cpu_s)  # bubblewrap is installed, or a clear error now
        self._idle: OrderedDict[str, list[_Worker]] = OrderedDict()  # job -> idle workers, least recent first
        self._slots = threading.BoundedSemaphore(size)
        self._closed = False
        self._lock = threading.Lock()
        self._all: set[_Worker] = set()
        self._started = 0

    def _take(self, job_id: str) -> _Worker:
        evict: list[_Worker] = []
        with self._lock:
            idle = self._idle.get(job_id)
            if idle:
                self._idle.move_to_end(job_id)
                return idle.pop()
            while len(self._all) >= self.size and self._idle:  # room: the least recent job's idle worker
                other, workers = next(iter(self._idle.items()))
                evict.append(workers.pop(0))
                self._all.discard(evict[-1])
                if not workers:
                    del self._idle[other]
            uid = self.sandbox.uid_base + self._started % 1000
            self._started += 1
        for w in evict:
            w.kill()
        w = _Worker(self.sandbox, uid, self.cpu_s, job_id)
        with self._lock:
            self._all.add(w)
        return w

    def _give_back(self, w: _Worker) -> None:
        with self._lock:
            self._idle.setdefault(w.job_id, []).append(w)
            self._idle.move_to_end(w.job_id)

    def forget_job(self, job_id: str) -> None:
        """Kill the idle workers of ``job_id`` (its scorings are over)."""
        with self._lock:
            workers = self._idle.pop(job_id, [])
            self._all.difference_update(workers)
        for w in workers:
            w.kill()

    def _discard(self, w: _Worker) -> None:
        w.kill()
        with self._lock:
            self._all.discard(w)

    def score(self, spec: ScorerSpec, inp: ScoreInput, *, timeout_s: float) -> ScorerOutput:
        """Run `spec` on `inp` in a worker; raise ScorerError on timeout, crash or a bad answer."""
        if self._closed:
            raise RuntimeError("scorer pool is closed")
        cpu_s = int(timeout_s) + 1  # CPU time per scoring: a busy loop ends even before the wall limit
        payload = pickle.dumps((asdict(spec), {**asdict(inp), "files": dict(inp.files)}, cpu_s), protocol=5)
        with self._slots:
            w = self._take(inp.job_id)
            try:
                reply = w.call(payload, timeout_s)
            except TimeoutError:
                self._discard(w)
                raise ScorerError("timeout", f"scorer {spec.name} exceeded its {timeout_s:g}s time limit") from None
            except (EOFError, BrokenPipeError, OSError) as exc:
                code = w.proc.poll()
                self._discard(w)
                how = f"exit code {code}" if code is not None and code >= 0 else f"signal {-(code or 0)}"
                raise ScorerError("error", f"scorer {spec.name} crashed ({how}; {type(exc).__name__})") from None
            except ValueError as exc:
                self._discard(w)
                raise ScorerError("error", f"scorer {spec.name} answered garbage: {exc}") from None
            self._give_back(w)
        if "error" in reply:
            raise ScorerError("error", f"scorer {spec.name} failed: {str(reply['error'])[:2000]}")
        try:
            return parse_output(reply.get("output"))
        except (ValueError, TypeError) as exc:
            raise ScorerError("error", f"scorer {spec.name} returned an invalid result: {exc}") from None

    def close(self) -> None:
        self._closed = True
        with self._lock:
            workers = list(self._all)
            self._all.clear()
        for w in workers:
            w.kill()
