"""Coding CLIs as agent loops (``gyre run --harness claude-code`` / ``codex``), unmodified, sandboxed.

Each execution runs the CLI from its registry (pinned, services.task.clis) in bubblewrap: no
network but a loopback port that reaches the gateway alone (services.task.netbridge: a Unix
socket across the namespace boundary), the system read-only, a private /tmp, a fresh working
directory and home, and no environment but what is set here (the session URL is its only
credential). The CLI's own tools run there too; the task's tools are the ``gyre-task`` command
(services.task.tool_shell), whose socket leads to this execution's ``ToolTask`` in the harness,
so the task's hidden tests never enter the sandbox.

    lease ──> ToolTask ──gyre-task socket──> bwrap [ CLI ── 127.0.0.1:PORT ──netbridge──> ] ──> gateway
                                                                     session URL: every call recorded as TITO

What each CLI is told (its own flags and files, no patch):
- Claude Code: ``claude -p TASK --bare --system-prompt SHELL_INSTRUCTIONS --tools Bash
  --allowedTools Bash(gyre-task:*) --max-turns N --output-format json``; its other tools are not
  offered, and a Bash command other than ``gyre-task`` is refused by its own permission check.
- Codex: ``codex exec TASK`` with a model provider whose base URL is the session URL
  (``wire_api = "responses"``), ``AGENTS.md`` = SHELL_INSTRUCTIONS in its working directory, its
  own sandbox off (bubblewrap is the sandbox) and approvals never asked.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from services.common.bwrap import command_sandbox_args
from services.common.logging import get_logger

__all__ = ["CLI_LOOPS", "PORT", "run_cli", "wait_for_cli", "sandbox_argv", "claude_code_argv", "codex_argv"]

log = get_logger(__name__)

CLI_LOOPS = ("claude-code", "codex")
PORT = 8080  # the gateway, as the CLI sees it inside its namespace
BRIDGE = "/gyre/netbridge.py"
GATEWAY_SOCK = "/gyre/gateway.sock"
MAX_OUTPUT_TOKENS = 256  # per call: the longest command the task needs is ~50 tokens


def claude_code_argv(exe: Path, task_message: str, instructions: str, *, max_turns: int) -> list[str]:
    return [str(exe), "-p", task_message, "--bare", "--system-prompt", instructions, "--tools", "Bash",
            "--allowedTools", "Bash(gyre-task:*)", "--max-turns", str(max_turns), "--output-format", "json"]


def claude_code_env(session_url: str, served: str) -> dict[str, str]:
    return {"ANTHROPIC_BASE_URL": session_url, "ANTHROPIC_API_KEY": "gyre", "ANTHROPIC_MODEL": served,
            "ANTHROPIC_SMALL_FAST_MODEL": served, "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(MAX_OUTPUT_TOKENS),
            "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1", "DISABLE_AUTOUPDATER": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}


def codex_argv(exe: Path, task_message: str, *, session_url: str, served: str) -> list[str]:
    provider = (f'model_providers.gyre={{name="gyre", base_url="{session_url}/v1", wire_api="responses", '
                'env_key="OPENAI_API_KEY"}')
    return [str(exe), "exec", "--skip-git-repo-check", "--json", "-m", served, "-c", "model_provider=gyre",
            "-c", provider, "-c", "check_for_update_on_startup=false", "-c", 'approval_policy="never"',
            "-c", 'sandbox_mode="danger-full-access"', "-c", f"model_max_output_tokens={MAX_OUTPUT_TOKENS}",
            task_message]


def _claude_outcome(stdout: str) -> tuple[str, str]:
    """Claude Code's ``--output-format json`` result: how the run ended, and its error if any."""
    for line in reversed(stdout.splitlines()):
        try:
            result = json.loads(line)
        except ValueError:
            continue
        if isinstance(result, dict) and result.get("type") == "result":
            if result.get("subtype") == "error_max_turns":
                return "turn_cap", ""
            if result.get("is_error"):
                return "loop_gave_up", str(result.get("result") or result.get("terminal_reason") or "")[:300]
            return "final_reply", ""
    return "loop_gave_up", "no result on its stdout"


def _codex_outcome(stdout: str) -> tuple[str, str]:
    """Codex's ``--json`` events: a completed turn is its final reply; else its last error."""
    kinds, errors = [], []
    for line in stdout.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            kinds.append(event.get("type", ""))
            if event.get("type") in ("error", "turn.failed"):
                errors.append(str(event.get("message") or event.get("error") or "")[:300])
    if "turn.completed" in kinds:
        return "final_reply", ""
    return "loop_gave_up", errors[-1] if errors else "no completed turn on its stdout"


def sandbox_argv(root: Path, bin_dir: Path, work: Path, home: Path, ro_dirs: list[Path], env: dict[str, str],
                 cmd: list[str]) -> list[str]:
    """bubblewrap's argv that runs ``cmd`` with ``127.0.0.1:PORT`` reaching ``root/gateway.sock``
    (a ``UnixToTcp`` to the gateway) and no other network: mini-swe-agent's command sandbox (its
    own namespaces, no capabilities, the system read-only, a private /tmp, ``gyre-task`` in
    ``bin_dir``), plus ``ro_dirs`` read-only (the CLI's install), the bridge and its socket, a
    writable ``work`` (the working directory) and ``home``, and no environment but ``env``."""
    argv = ["bwrap", *command_sandbox_args(bin_dir)]
    for d in ro_dirs:
        argv += ["--ro-bind", str(d), str(d)]
    argv += ["--ro-bind", str(Path(__file__).with_name("netbridge.py")), BRIDGE,
             "--ro-bind", str(root / "gateway.sock"), GATEWAY_SOCK,
             "--bind", str(work), str(work), "--bind", str(home), str(home), "--chdir", str(work),
             "--setenv", "HOME", str(home), "--setenv", "SHELL", "/bin/bash", "--setenv", "TERM", "dumb"]
    for key, value in env.items():
        argv += ["--setenv", key, value]
    return [*argv, "--", _interpreter(), BRIDGE, str(PORT), GATEWAY_SOCK, "--", *cmd]


def _interpreter() -> str:
    """The sandbox's Python for the bridge: the base installation's (bound read-only), not the venv's."""
    for name in (f"python{sys.version_info.major}.{sys.version_info.minor}", "python3"):
        candidate = Path(sys.base_prefix) / "bin" / name
        if candidate.exists():
            return str(candidate)
    return sys.executable


def wait_for_cli(proc: subprocess.Popen, tools: Any, timeout_s: float, name: str) -> None:
    """Wait for an agent CLI's process (this one's, mini-swe-agent's); raises ExecutionCancelled
    when the execution is cancelled, TimeoutError past ``timeout_s``. The caller kills what is left."""
    from services.task.agent import ExecutionCancelled

    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        if tools.cancelled is not None and tools.cancelled.is_set():
            raise ExecutionCancelled()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} ran past the execution's deadline ({timeout_s:.0f} s)")
        try:
            proc.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass


def run_cli(loop: str, tools: Any, base_url: str, *, max_turns: int, timeout_s: float,
            served: Callable[[str, float], str]) -> str:
    """One execution through ``loop`` (``claude-code`` or ``codex``) on ``tools`` (the execution's
    ``services.task.loops.Tools``, which imports this module); returns how it ended
    (``final_reply``, ``turn_cap`` or ``loop_gave_up``). Raises TimeoutError past ``timeout_s``,
    ExecutionCancelled when the execution is cancelled."""
    from services.common.children import scratch_dir, tied
    from services.task.agent import ExecutionCancelled
    from services.task.clis import CLAUDE_CODE, CODEX, npm_cli
    from services.task.netbridge import UnixToTcp
    from services.task.tool_shell import SHELL_INSTRUCTIONS, TaskSocket, answer, install_client, shell_task_message

    if loop not in CLI_LOOPS:
        raise ValueError(f"loop {loop!r} is not a CLI loop; expected one of {', '.join(CLI_LOOPS)}")
    if shutil.which("bwrap") is None:
        raise RuntimeError(f"the {loop} loop runs the CLI in bubblewrap: install it "
                           "(apt-get install bubblewrap; `make install` does it as root)")
    url = urlsplit(base_url)
    if url.scheme != "http" or not url.hostname or not url.port or "/s/" not in url.path:
        raise ValueError(f"the {loop} loop needs a plain-HTTP session URL of the gateway "
                         f"(http://HOST:PORT/s/TOKEN/v1), got {base_url!r}")
    session_url = f"http://127.0.0.1:{PORT}{url.path.removesuffix('/').removesuffix('/v1')}"
    exe = npm_cli(*(CLAUDE_CODE if loop == "claude-code" else CODEX))
    cli_dir = exe.parents[2]  # <clis>/<package@version>, with node_modules/.bin/<binary> in it
    model = served(base_url, timeout_s)
    task_message = shell_task_message(tools.env.task)

    def handle(argv: list[str]) -> str:
        tools.result.events["gyre_task_commands"] += 1
        try:
            return answer(argv, tools.call, lambda: tools.env.hint(tools.scope))
        except ExecutionCancelled:  # the wait below sees the cancellation and ends the run
            return "error : the execution was cancelled"

    root = scratch_dir(f"gyre-{loop}-")  # a killed harness's are swept here
    work, bin_dir, home = root / "work", root / "bin", root / "home"
    for d in (work, home):
        d.mkdir()
    install_client(bin_dir)
    task_socket = TaskSocket(bin_dir / "task.sock", handle)
    bridge = UnixToTcp(root / "gateway.sock", url.hostname, url.port)
    if loop == "claude-code":
        env = claude_code_env(session_url, model)
        cmd = claude_code_argv(exe, task_message, SHELL_INSTRUCTIONS, max_turns=max_turns)
        outcome = _claude_outcome
    else:
        (home / ".codex").mkdir()
        env = {"CODEX_HOME": str(home / ".codex"), "OPENAI_API_KEY": "gyre", "RUST_LOG": "error"}
        (work / "AGENTS.md").write_text(SHELL_INSTRUCTIONS + "\n")
        cmd = codex_argv(exe, task_message, session_url=session_url, served=model)
        outcome = _codex_outcome
    argv = sandbox_argv(root, bin_dir, work, home, [cli_dir], env, cmd)
    out_file = open(root / "stdout", "wb")  # noqa: SIM115 -- closed in the finally below
    err_file = open(root / "stderr", "wb")  # noqa: SIM115
    # tied: the sandbox dies with this thread's process, even by SIGKILL
    proc = subprocess.Popen(tied(argv), cwd=work, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                            stdin=subprocess.DEVNULL, stdout=out_file, stderr=err_file, start_new_session=True)
    try:
        wait_for_cli(proc, tools, timeout_s, loop)
        stdout = (root / "stdout").read_text(errors="replace")
        if bridge.connections == 0:
            stderr = (root / "stderr").read_text(errors="replace")
            raise RuntimeError(f"{loop} exited {proc.returncode} without calling the model: "
                               f"{(stderr or stdout).strip()[-500:]}")
        tools.result.events[f"{loop}_exit_{proc.returncode}"] += 1
        ended, error = outcome(stdout)
        if error:  # the CLI's own words (e.g. a reply past its max output tokens): the run's log says why
            log.info("CLI run ended with an error", loop=loop, exit_code=proc.returncode, error=error,
                     calls=bridge.connections)
        return ended
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        out_file.close()
        err_file.close()
        bridge.close()
        task_socket.close()
        shutil.rmtree(root, ignore_errors=True)
