"""Sandbox worker process of the reward service's ScorerPool (see services.reward.sandbox).

Runs inside the sandbox (bubblewrap: no network, its own PID namespace, a read-only view of the
interpreter and the scorer code, tmpfs scratch) as an unprivileged user. It caps its own address
space, open files, processes and file sizes, imports the scorer code once, then for each request
(4-byte length + pickle: scorer spec, score input, CPU seconds, on stdin) forks one child that

- writes the execution's workspace files into a fresh directory under ``/ws`` and works there,
- runs the scorer under a CPU-time limit (``--cpu-s``), its prints going to stderr (/dev/null),
- answers with length-prefixed JSON on a pipe (never a pickle: a compromised scorer cannot feed
  the service one);

then the worker removes the directory and kills whatever the scoring left running in the sandbox
(a fork bomb's survivors, a daemonized child), and answers on a private copy of stdout.

    python -m services.reward.scorer_worker --memory-mb 1024 --cpu-s 31 --max-procs 64 \
        --max-open-files 256 --max-file-mb 64 --scratch /ws --reap
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import resource
import shutil
import signal
import struct
import sys
import traceback
from pathlib import PurePosixPath
from typing import Any

_HEADER = struct.Struct("<I")
MAX_REPLY_BYTES = 8 << 20


def _limit(args: argparse.Namespace) -> None:
    def cap(which: int, value: int) -> None:
        resource.setrlimit(which, (value, value))

    cap(resource.RLIMIT_AS, args.memory_mb << 20)
    cap(resource.RLIMIT_FSIZE, args.max_file_mb << 20)
    cap(resource.RLIMIT_NOFILE, args.max_open_files)
    cap(resource.RLIMIT_NPROC, args.max_procs)
    cap(resource.RLIMIT_CORE, 0)


def _read_exact(fh: Any, n: int) -> bytes:
    data = fh.read(n)
    if len(data) != n:
        raise EOFError
    return bytes(data)


def _write_workspace(root: str, files: dict[str, bytes]) -> None:
    """The workspace as files under ``root`` (paths were checked by the service; checked again)."""
    for name, blob in files.items():
        path = PurePosixPath(name)
        if path.is_absolute() or ".." in path.parts or not path.parts:
            raise ValueError(f"workspace path {name[:80]!r} leaves the workspace")
        target = os.path.join(root, *path.parts)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "wb") as fh:
            fh.write(blob)


def _score(spec_d: dict[str, Any], inp_d: dict[str, Any], workdir: str, cpu_s: int) -> dict[str, Any]:
    """In the forked child: the scorer's verdict (or its error) as a JSON-able dict."""
    from services.reward.scorers import ScoreInput, ScorerSpec, run_local

    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    try:
        os.makedirs(workdir)
        _write_workspace(workdir, inp_d["files"])
        os.chdir(workdir)
        out = run_local(ScorerSpec(**spec_d), ScoreInput(**inp_d))
        return {"output": out.to_json()}
    except BaseException as exc:  # noqa: BLE001 - reported to the service, never fatal here
        tb = traceback.format_exception_only(type(exc), exc)
        return {"error": "".join(tb).strip()[-2000:]}


def _reap_leftovers() -> None:
    """Kill every process of the sandbox but this one and its init (what a scoring left behind)."""
    me = os.getpid()
    for _ in range(3):  # a fork bomb may fork while it is being killed
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, me)]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for _pid in pids:
            try:
                while os.waitpid(-1, os.WNOHANG)[0]:
                    pass
            except ChildProcessError:
                break


def _run_one(spec_d: dict[str, Any], inp_d: dict[str, Any], args: argparse.Namespace, n: int,
             cpu_s: int) -> dict[str, Any]:
    workdir = os.path.join(args.scratch, f"s{n}")
    r, w = os.pipe()
    try:
        pid = os.fork()
    except OSError as exc:  # the process cap is reached (a previous scoring's survivors were reaped)
        os.close(r)
        os.close(w)
        return {"error": f"cannot start the scoring: {exc}"}
    if pid == 0:  # the child: never returns
        code = 0
        try:
            os.close(r)
            os.setpgid(0, 0)
            blob = json.dumps(_score(spec_d, inp_d, workdir, cpu_s)).encode()
            with os.fdopen(w, "wb") as out:
                out.write(blob[:MAX_REPLY_BYTES + 1])
        except BaseException:  # noqa: BLE001 - the parent reports a child without an answer
            code = 1
        os._exit(code)
    os.close(w)
    chunks, size = [], 0
    with os.fdopen(r, "rb") as fh:
        while chunk := fh.read(1 << 20):
            size += len(chunk)
            if size > MAX_REPLY_BYTES:
                break
            chunks.append(chunk)
    try:
        os.killpg(pid, signal.SIGKILL)  # what it started in its group, and itself if it still runs
    except (ProcessLookupError, PermissionError):
        pass
    _, status = os.waitpid(pid, 0)
    if args.reap:
        _reap_leftovers()
    shutil.rmtree(workdir, ignore_errors=True)
    if size > MAX_REPLY_BYTES:
        return {"error": f"the scorer's answer exceeds {MAX_REPLY_BYTES} bytes"}
    if os.WIFSIGNALED(status) and not chunks:
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU:
            return {"error": f"the scorer exceeded its CPU time limit of {cpu_s}s"}
        return {"error": f"the scoring crashed (killed by signal {sig})"}
    try:
        reply = json.loads(b"".join(chunks))
    except ValueError:
        reply = None
    if not isinstance(reply, dict):
        return {"error": f"the scoring crashed without an answer (exit status {os.waitstatus_to_exitcode(status)})"}
    return reply


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="scorer_worker")
    p.add_argument("--memory-mb", type=int, default=1024)
    p.add_argument("--cpu-s", type=int, default=60)
    p.add_argument("--max-procs", type=int, default=64)
    p.add_argument("--max-open-files", type=int, default=256)
    p.add_argument("--max-file-mb", type=int, default=64)
    p.add_argument("--scratch", default="")
    p.add_argument("--uid", type=int, default=-1, help="started as root inside the sandbox: make the scratch "
                   "directories this user's and become it (no groups) before anything else")
    p.add_argument("--reap", action="store_true", help="after each scoring, kill every other process in "
                   "the sandbox (only inside its own PID namespace)")
    args = p.parse_args(argv)
    import services

    for key in services.SET_HERE:  # what importing Gyre added: scorers see only the sandbox's environment
        os.environ.pop(key, None)
    if not args.scratch:
        import tempfile

        args.scratch = tempfile.mkdtemp(prefix="gyre-scorer-")
    if args.uid >= 0 and os.getuid() == 0:
        for path in (args.scratch, "/tmp"):
            os.chown(path, args.uid, args.uid)
        os.setgroups([])
        os.setgid(args.uid)
        os.setuid(args.uid)
    proto_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    _limit(args)
    import services.reward.scorers  # noqa: F401 - warm imports, shared by every forked scoring
    from services.task import registry

    for target in registry.builtin_scorers().values():  # warm imports, shared by every forked scoring
        registry.load(target)

    stdin = sys.stdin.buffer
    n = 0
    while True:
        try:
            (size,) = _HEADER.unpack(_read_exact(stdin, _HEADER.size))
            spec_d, inp_d, cpu_s = pickle.loads(_read_exact(stdin, size))
        except EOFError:
            return 0
        n += 1
        blob = json.dumps(_run_one(spec_d, inp_d, args, n, int(cpu_s) or args.cpu_s)).encode()
        proto_out.write(_HEADER.pack(len(blob)) + blob)
        proto_out.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
