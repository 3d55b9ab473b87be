"""Hostile entry-point scorers (and what agent-written code could do inside one): each tries to
reach something outside its sandbox and reports what it got, so the tests can check it got nothing.
``task_id`` carries the test's target (a path, a host:port)."""

from __future__ import annotations

import json
import os
import socket


def _report(found: object, score: float = 0.0) -> dict:
    return {"score": score, "detail": json.dumps(found)[:1000]}


def read_env(files: dict[str, bytes], task_id: str, status: str) -> dict:
    return _report(dict(os.environ))


def leaked_env(files: dict[str, bytes], task_id: str, status: str) -> float:
    """1.0 when anything of a service's environment reached the scorer (Redis, Gyre settings, tokens)."""
    return float(any(k.startswith(("REDIS", "GYRE")) or "TOKEN" in k or "SECRET" in k for k in os.environ))


def read_file(files: dict[str, bytes], task_id: str, status: str) -> dict:
    """``task_id``: a path outside the workspace."""
    try:
        with open(task_id, "rb") as fh:
            return _report({"read": fh.read(100).decode(errors="replace")})
    except OSError as exc:
        return _report({"error": type(exc).__name__})


def look_around(files: dict[str, bytes], task_id: str, status: str) -> dict:
    """What the filesystem shows: the working directory, /, /root, /home, the repository, /proc."""
    seen: dict[str, object] = {"cwd": os.getcwd(), "workspace": sorted(os.listdir("."))}
    for path in ("/", "/root", "/home", "/tmp", os.path.dirname(os.path.dirname(os.path.dirname(__file__)))):
        try:
            seen[path] = sorted(os.listdir(path))
        except OSError as exc:
            seen[path] = type(exc).__name__
    seen["pids"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    try:
        with open("/proc/1/environ", "rb") as fh:
            seen["init_environ"] = fh.read().decode(errors="replace")
    except OSError as exc:
        seen["init_environ"] = type(exc).__name__
    seen["uid"] = os.getuid()
    return _report(seen)


def write_outside(files: dict[str, bytes], task_id: str, status: str) -> dict:
    """``task_id``: a path outside the workspace to create."""
    try:
        with open(task_id, "wb") as fh:
            fh.write(b"owned")
        return _report({"wrote": task_id})
    except OSError as exc:
        return _report({"error": type(exc).__name__})


def connect(files: dict[str, bytes], task_id: str, status: str) -> dict:
    """``task_id``: host:port to open a TCP connection to (Redis)."""
    host, _, port = task_id.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=2) as s:
            s.sendall(b"PING\r\n")
            return _report({"reply": s.recv(16).decode(errors="replace")})
    except OSError as exc:
        return _report({"error": type(exc).__name__})


def fork_bomb(files: dict[str, bytes], task_id: str, status: str) -> float:
    while True:
        try:
            if os.fork() == 0:
                os.setsid()  # escape the process group: the sandbox still ends it
        except OSError:
            pass


def busy_loop(files: dict[str, bytes], task_id: str, status: str) -> float:
    n = 0
    while True:
        n += 1


def huge_output(files: dict[str, bytes], task_id: str, status: str) -> float:
    chunk = "y" * (1 << 20)
    for _ in range(64):  # 64 MiB on stdout and stderr: must not reach the service or corrupt the protocol
        print(chunk)
    return 0.5


def huge_answer(files: dict[str, bytes], task_id: str, status: str) -> dict:
    return {"score": 1.0, "metrics": {f"metric-{i}": 1.0 for i in range(1_000_000)}}  # ~20 MB of JSON


def huge_file(files: dict[str, bytes], task_id: str, status: str) -> dict:
    try:
        with open("big.bin", "wb") as fh:
            for _ in range(512):
                fh.write(b"\0" * (1 << 20))
        return _report({"wrote_mb": 512})
    except OSError as exc:
        return _report({"error": type(exc).__name__})


_MARK: list[str] = []


def leave_mark(files: dict[str, bytes], task_id: str, status: str) -> float:
    """Leave state behind (a module global, a file in /tmp and in the workspace directory)."""
    _MARK.append(task_id)
    for path in ("/tmp/mark", "mark"):
        with open(path, "w") as fh:
            fh.write(task_id)
    return 1.0


def find_mark(files: dict[str, bytes], task_id: str, status: str) -> dict:
    return _report({"global": list(_MARK), "tmp": os.path.exists("/tmp/mark"), "cwd": os.path.exists("mark"),
                    "workspace": sorted(files)})
