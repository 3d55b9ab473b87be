"""The built-in task's tools as a shell command, for coding CLIs whose only tool is bash.

mini-swe-agent, Claude Code and Codex act through a shell. For them the task's four tools
(services.task.tool_env) are one command, ``gyre-task``, run in the agent's sandbox:

    gyre-task open_module m1          gyre-task write_line m1 '2 -'
    gyre-task run_tests m1            gyre-task read_file src/m1.gs

The command is a few lines of standard-library Python (`CLIENT`) that sends its argv over a Unix
socket to the harness, which holds the execution's `ToolTask` in memory (`TaskSocket`): the task's
hidden tests and the scorer's state never enter the sandbox, and the harness sees each call as it
happens (progress, cancellation, the deadline), as for any other loop. Results are the tools'
texts with the hints written as commands (``next gyre-task write_line m1 step sub 2``, ``next echo
COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``: mini-swe-agent's way to end a task).

`SHELL_INSTRUCTIONS`, `BASH_TOOL` and `shell_task_message` are what the warm start's shell
demonstrations (services.task.tool_demos) show the model, and what the mini-swe-agent loop
(services.task.loops) configures that agent with, so the model meets the same prompt it learned.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from services.task.spec import TaskSpec
from services.task.tool_env import INSTRUCTIONS

__all__ = ["COMMAND", "SUBMIT", "BASH_TOOL", "SHELL_INSTRUCTIONS", "CLIENT", "shell_task_message", "shell_text",
           "shell_command", "parse_argv", "answer", "TaskSocket", "install_client"]

COMMAND = "gyre-task"
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
"""The command that ends a mini-swe-agent run (its first output line is the submission marker)."""

# mini-swe-agent's bash tool (minisweagent.models.utils.actions_toolcall.BASH_TOOL, 2.4.6), as the
# gateway renders it into the system turn; a test checks it against the installed package.
BASH_TOOL: dict[str, Any] = {
    "name": "bash",
    "description": "Execute a bash command",
    "parameters": {
        "type": "object",
        "properties": {"command": {"type": "string", "description": "The bash command to execute"}},
        "required": ["command"],
    },
}

SHELL_INSTRUCTIONS = (f"{INSTRUCTIONS} Act with bash: {COMMAND} open_module m1 , {COMMAND} write_line m1 'code' , "
                      f"{COMMAND} run_tests m1 . Each result says the next command.")

_HINT_RE = re.compile(r"\bnext (open_module|write_line|run_tests|read_file)\b")
_USAGE = {"open_module": ("module",), "run_tests": ("module",), "read_file": ("path",),
          "write_line": ("module", "code")}


def shell_task_message(task: TaskSpec) -> str:
    """The task as the shell agent's first user message."""
    names = " ".join(m.name for m in task.modules)
    return f"task modules {names} . next {COMMAND} open_module {task.modules[0].name}"


def shell_text(text: str) -> str:
    """A tool result with its hint written as the command to run."""
    text = _HINT_RE.sub(rf"next {COMMAND} \1", text)
    return re.sub(r"\breply done$", f"next {SUBMIT}", text)


def shell_command(name: str, arguments: dict[str, Any]) -> str:
    """The command line of one tool call (``code`` quoted: ``2 *`` must not glob)."""
    if name == "write_line":
        return f"{COMMAND} write_line {arguments['module']} {shlex.quote(str(arguments['code']))}"
    key = "path" if name == "read_file" else "module"
    return f"{COMMAND} {name} {arguments[key]}"


def parse_argv(argv: Sequence[str]) -> tuple[str, dict[str, str]] | str:
    """``gyre-task``'s arguments as a tool call (name, arguments), or the usage error to show."""
    if not argv or argv[0] not in _USAGE:
        return f"error : usage {COMMAND} {' | '.join(_USAGE)} ARGS"
    name, params = argv[0], _USAGE[argv[0]]
    rest = list(argv[1:])
    if name == "write_line" and len(rest) >= 2:
        rest = [rest[0], " ".join(rest[1:])]
    if len(rest) != len(params):
        return f"error : usage {COMMAND} {name} {' '.join(p.upper() for p in params)}"
    return name, dict(zip(params, rest, strict=True))


def answer(argv: Sequence[str], call: Callable[[str, dict[str, str]], str], hint: Callable[[], str]) -> str:
    """What ``gyre-task ARGV`` prints: the result of the tool call it names (``call(name,
    arguments)``), or its usage error and where the agent stands (``hint()``); hints as commands."""
    parsed = parse_argv(argv)
    return shell_text(f"{parsed} . {hint()}" if isinstance(parsed, str) else call(*parsed))


# The command inside the sandbox: standard library only, any python3 on PATH.
CLIENT = '''#!/usr/bin/env python3
"""gyre-task TOOL ARGS: a tool of the Gyre task (open_module, write_line, run_tests, read_file)."""
import json, os, socket, sys
path = os.environ.get("GYRE_TASK_SOCKET") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "task.sock")
try:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        s.sendall(json.dumps({"argv": sys.argv[1:]}).encode() + b"\\n")
        s.shutdown(socket.SHUT_WR)
        reply = b"".join(iter(lambda: s.recv(65536), b""))
except OSError as exc:
    print(f"gyre-task: the task is not reachable ({exc})", file=sys.stderr)
    sys.exit(2)
print(reply.decode("utf-8", "replace"))
'''


def install_client(bin_dir: Path) -> Path:
    """Write the ``gyre-task`` command into ``bin_dir`` (executable); its socket is ``bin_dir/task.sock``."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    exe = bin_dir / COMMAND
    exe.write_text(CLIENT)
    exe.chmod(0o755)
    return exe


class TaskSocket:
    """Serves ``gyre-task`` calls on a Unix socket: each connection carries one argv (a JSON line)
    and gets ``handle(argv)``'s text back. Lifecycle: TaskSocket(path, handle) -> close()."""

    MAX_REQUEST = 64 * 1024

    def __init__(self, path: Path, handle: Callable[[list[str]], str]) -> None:
        self.path, self.handle = path, handle
        self.calls = 0
        self._lock = threading.Lock()  # one tool call at a time (commands may run concurrently)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(str(path))
        os.chmod(path, 0o666)  # the sandbox may run the command as another (mapped) user
        self._sock.listen(16)
        self._thread = threading.Thread(target=self._serve, name="gyre-task-socket", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            with conn:
                conn.settimeout(10.0)
                try:
                    conn.sendall(self._answer(conn).encode())
                except OSError:
                    pass  # the command was killed meanwhile (its timeout): nothing to answer

    def _answer(self, conn: socket.socket) -> str:
        data = b""
        while len(data) <= self.MAX_REQUEST and (chunk := conn.recv(65536)):
            data += chunk
        try:
            argv = json.loads(data.decode())["argv"]
            if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
                raise ValueError
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return f"error : {COMMAND} sent a request this harness cannot read"
        with self._lock:
            self.calls += 1
            return self.handle(argv)

    def close(self) -> None:
        self._sock.close()
        self._thread.join(timeout=5)
        self.path.unlink(missing_ok=True)
