"""The built-in task as a shell command (``gyre-task``) for bash-only agents: argv parsing and the
command lines the demonstrations write, hints written as commands, the real command run in the
real bubblewrap sandbox the mini-swe-agent loop gives its commands (no network, the task's tools
reached over the Unix socket), and the shell demonstrations' conversation."""

from __future__ import annotations

import json
import random
import shlex
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from services.task.agent import ExecutionResult
from services.task.demos import DemoNoise, sloppy_line
from services.common.bwrap import command_sandbox_args
from services.task.loops import Tools
from services.task.spec import TaskParams, generate_task
from services.task.tool_agent import ToolAgentConfig
from services.task.tool_demos import ToolDemonstrator, decide_shell, run_shell_demo
from services.task.tool_env import parse_call
from services.task.tool_shell import (BASH_TOOL, COMMAND, SUBMIT, TaskSocket, answer, install_client, parse_argv,
                                      shell_command, shell_task_message, shell_text)
from services.task.tool_tokenizer import ToolCodec, train_tokenizer


def test_argv_parses_to_tool_calls_and_bad_argv_gets_usage() -> None:
    assert parse_argv(["open_module", "m1"]) == ("open_module", {"module": "m1"})
    assert parse_argv(["write_line", "m1", "2", "-"]) == ("write_line", {"module": "m1", "code": "2 -"})
    assert parse_argv(["write_line", "m1", "4 swap -"]) == ("write_line", {"module": "m1", "code": "4 swap -"})
    assert parse_argv(["read_file", "src/m1.gs"]) == ("read_file", {"path": "src/m1.gs"})
    assert parse_argv([]) == parse_argv(["rm", "-rf"]) == (
        f"error : usage {COMMAND} open_module | run_tests | read_file | write_line ARGS")
    assert parse_argv(["run_tests"]) == f"error : usage {COMMAND} run_tests MODULE"
    assert parse_argv(["write_line", "m1"]) == f"error : usage {COMMAND} write_line MODULE CODE"


@pytest.mark.parametrize("code", ["x", "2 -", "3 *", "4 swap -", "x m2", "12 +"])
def test_command_lines_round_trip_through_the_shell(code: str) -> None:
    line = shell_command("write_line", {"module": "m3", "code": code})
    argv = shlex.split(line)
    assert argv[0] == COMMAND and parse_argv(argv[1:]) == ("write_line", {"module": "m3", "code": code})
    assert shell_command("run_tests", {"module": "m2"}) == f"{COMMAND} run_tests m2"
    assert shell_command("read_file", {"path": "src/m1.gs"}) == f"{COMMAND} read_file src/m1.gs"


def test_hints_are_written_as_commands() -> None:
    assert shell_text("ok . next write_line m1 step sub 2") == f"ok . next {COMMAND} write_line m1 step sub 2"
    assert shell_text("m1 fail 1 / 2 : 4 -> 2 want 6 . next open_module m1") == (
        f"m1 fail 1 / 2 : 4 -> 2 want 6 . next {COMMAND} open_module m1")
    assert shell_text("m2 pass 2 / 2 . reply done") == f"m2 pass 2 / 2 . next {SUBMIT}"
    task = generate_task(3, TaskParams(num_modules=2))
    assert shell_task_message(task) == f"task modules m1 m2 . next {COMMAND} open_module m1"


def test_bash_tool_is_mini_swe_agents() -> None:
    """The bash tool the demonstrations render is the one mini-swe-agent sends (the pinned package)."""
    from services.task.clis import MINI_SWE_AGENT, CliUnavailable
    from tests.support.clis import pip_cli

    try:
        exe = pip_cli(*MINI_SWE_AGENT)
    except CliUnavailable as exc:
        pytest.skip(str(exc))
    code = "import json; from minisweagent.models.utils.actions_toolcall import BASH_TOOL; print(json.dumps(BASH_TOOL))"
    out = subprocess.run([str(exe.parent / "python"), "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.splitlines()[-1]) == {"type": "function", "function": BASH_TOOL}  # after its banner


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (make install)")
def test_the_command_in_the_sandbox_reaches_the_task_and_nothing_else(tmp_path: Path) -> None:
    task = generate_task(5, TaskParams(num_modules=2, call_pct=0))
    result = ExecutionResult(status="finished", files={})
    tools = Tools(task, fix_turns=1, on_progress=None, cancelled=None, result=result)

    def handle(argv: list[str]) -> str:  # as the mini-swe-agent loop answers
        return answer(argv, tools.call, lambda: tools.env.hint(tools.scope))

    work, bin_dir = tmp_path / "work", tmp_path / "bin"
    work.mkdir()
    install_client(bin_dir)
    server = TaskSocket(bin_dir / "task.sock", handle)

    def run(command: str) -> subprocess.CompletedProcess[str]:
        argv = ["bwrap", *command_sandbox_args(bin_dir), "--bind", str(work), str(work), "--chdir", str(work),
                "bash", "-c", command]
        return subprocess.run(argv, capture_output=True, text=True, timeout=60)

    try:
        m1 = task.module("m1")
        opened = run(f"{COMMAND} open_module m1")
        assert opened.returncode == 0 and opened.stdout.strip().endswith(
            f"next {COMMAND} write_line m1 step {m1.steps[0]}"), opened
        for step in m1.steps:
            run(shell_command("write_line", {"module": "m1", "code": sloppy_line(step, random.Random(0), None)}))
        assert result.calls["tool"] == 1 + len(m1.steps) == server.calls
        tested = run(f"{COMMAND} run_tests m1")
        assert tested.stdout.startswith("m1 pass") and tested.stdout.strip().endswith(f"next {COMMAND} open_module m2")
        assert result.files["src/m1.gs"].decode().split() == m1.reference_code.split()  # exported to the result
        assert run(f"{COMMAND} bogus").stdout.startswith(f"error : usage {COMMAND}")
        # no network in the sandbox; the host's files are not there; what it writes stays in work/
        probe = ("import socket\ntry:\n socket.create_connection(('127.0.0.1', 1), timeout=5)\n"
                 "except OSError as e:\n print(e.errno)")
        net = run(f"python3 -c \"{probe}\"")
        assert net.stdout.strip() in ("101", "111"), net  # ENETUNREACH (no interface) or refused on its own lo
        assert run("ls /root /home 2>&1; echo made > out.txt").returncode == 0
        assert (work / "out.txt").read_text() == "made\n" and not run("ls /root").stdout
    finally:
        server.close()
    assert not (bin_dir / "task.sock").exists()


def test_the_socket_refuses_a_request_it_cannot_read(tmp_path: Path) -> None:
    server = TaskSocket(tmp_path / "task.sock", lambda argv: "unreachable")
    try:
        for raw in (b"not json\n", b'{"argv": [1, 2]}\n', b'{"other": 1}\n'):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(str(tmp_path / "task.sock"))
                s.sendall(raw)
                s.shutdown(socket.SHUT_WR)
                assert s.recv(4096).decode() == f"error : {COMMAND} sent a request this harness cannot read"
        assert server.calls == 0
    finally:
        server.close()


def test_shell_demonstrations_run_the_task_through_bash_calls() -> None:
    boot = ToolCodec(train_tokenizer([], vocab_size=300))
    task = generate_task(11, TaskParams(num_modules=3))
    demo = ToolDemonstrator(boot, DemoNoise(), "shell")
    run_shell_demo(task, demo, codec=boot, fix_turns=1, max_turns=200, max_new_tokens=1024, rng=random.Random(0))
    calls = [parse_call(boot.decode(c.output_ids)) for c in demo.calls]
    assert all(c is not None and c[0] == "bash" and set(c[1]) == {"command"} for c in calls)
    commands = [c[1]["command"] for c in calls if c is not None]
    assert commands[0] == f"{COMMAND} open_module m1" and commands[-1] == SUBMIT
    assert all(shlex.split(c)[0] == COMMAND for c in commands[:-1])
    opened = [shlex.split(c)[2] for c in commands if shlex.split(c)[1] == "open_module"]
    assert set(opened) == {"m1", "m2", "m3"}  # every module, some twice (the demonstrator's sloppy sub)
    # each later call's prompt extends the earlier one (one conversation, no compaction)
    for a, b in zip(demo.calls, demo.calls[1:]):
        assert len(b.prompt_ids) > len(a.prompt_ids) and (b.prompt_ids[:len(a.prompt_ids)] == a.prompt_ids).all()
    text = boot.tok.decode([int(i) for i in demo.calls[-1].prompt_ids], skip_special_tokens=False)
    assert '"name": "bash"' in text and f"next {SUBMIT}" in text
    assert ToolAgentConfig().max_new_tokens >= 8
    # decide_shell's answer to a submit hint, and to a write hint after a failure of that module
    assert parse_call(decide_shell(f"<|im_start|>tool\nm1 pass 2 / 2 . next {SUBMIT}<|im_end|>\n<|im_start|>assistant\n",
                                   random.Random(0), DemoNoise())) == ("bash", {"command": SUBMIT})
