"""Scorers run in sandboxed worker processes, so a hanging or crashing scorer cannot take the
reward service down.

    ScorerPool ──(4-byte length + pickle: spec, input)──> worker stdin
               <──(4-byte length + JSON: output | error)── worker protocol fd
    time limit passed  -> SIGKILL the worker, start a fresh one, raise ScorerError("timeout")
    worker died / EOF  -> start a fresh one, raise ScorerError("error", exit code)

Workers are ``python -m services.reward.scorer_worker``: they cap their own address space and
file sizes (``resource.setrlimit``), send the scorer's stray prints to stderr (/dev/null), and
answer in JSON only, so a compromised scorer cannot feed the service a pickle. Workers are
reused between scorings (imports stay warm); the pool holds at most `size` of them.

Lifecycle: ScorerPool(size) -> score(...) from any thread -> close().
"""

from __future__ import annotations

import json
import os
import pickle
import queue
import select
import struct
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from services.reward.scorers import ScoreInput, ScorerError, ScorerOutput, ScorerSpec, parse_output

__all__ = ["ScorerPool"]

_REPO = Path(__file__).resolve().parents[2]
_HEADER = struct.Struct("<I")
MAX_REPLY_BYTES = 8 << 20


class _Worker:
    def __init__(self, memory_mb: int) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_REPO), os.environ.get("PYTHONPATH")]))}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "services.reward.scorer_worker", "--memory-mb", str(memory_mb)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd=str(_REPO),
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
    """At most `size` concurrent scorings, each in a worker process with a time limit."""

    def __init__(self, *, size: int = 2, memory_mb: int = 1024) -> None:
        if size < 1:
            raise ValueError(f"scorer pool size must be >= 1, got {size}.")
        self.memory_mb = memory_mb
        self._idle: queue.LifoQueue[_Worker] = queue.LifoQueue()
        self._slots = threading.BoundedSemaphore(size)
        self._closed = False
        self._lock = threading.Lock()
        self._all: set[_Worker] = set()

    def _take(self) -> _Worker:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            w = _Worker(self.memory_mb)
            with self._lock:
                self._all.add(w)
            return w

    def _discard(self, w: _Worker) -> None:
        w.kill()
        with self._lock:
            self._all.discard(w)

    def score(self, spec: ScorerSpec, inp: ScoreInput, *, timeout_s: float) -> ScorerOutput:
        """Run `spec` on `inp` in a worker; raise ScorerError on timeout, crash or a bad answer."""
        if self._closed:
            raise RuntimeError("scorer pool is closed")
        payload = pickle.dumps((asdict(spec), {**asdict(inp), "files": dict(inp.files)}), protocol=5)
        with self._slots:
            w = self._take()
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
            self._idle.put(w)
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
