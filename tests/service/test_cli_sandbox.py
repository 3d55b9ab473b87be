"""The sandbox the coding-CLI loops run in (services.task.cli_loops.sandbox_argv): a real
bubblewrap process whose only network is a loopback port bridged to the gateway, with the task's
``gyre-task`` command and nothing of the harness's environment or files."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.task.cli_loops import PORT, sandbox_argv
from services.task.netbridge import UnixToTcp
from services.task.tool_shell import TaskSocket, install_client

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed (make install)")

PROBE = r"""
import os, socket, subprocess, sys
out = []
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10)   # the bridge
s.sendall(b"ping\n"); out.append("bridge:" + s.makefile().readline().strip())
for host, port in (("127.0.0.1", int(sys.argv[2])), ("10.255.255.1", 80)):   # the host's port, elsewhere
    try:
        socket.create_connection((host, port), timeout=3); out.append("reached:" + host)
    except OSError as exc:
        out.append("refused:" + type(exc).__name__)
task = subprocess.run(["gyre-task", "open_module", "m1"], capture_output=True, text=True)
out.append("task:" + task.stdout.strip())
out.append("secret:" + os.environ.get("GYRE_TEST_SECRET", "absent"))
for path in sys.argv[3:]:   # the harness's files (not bound), the system (read-only), the host's /tmp
    try:
        open(path, "w").write("x"); out.append("wrote:" + path)
    except OSError:
        out.append("denied")
open("made-here.txt", "w").write("ok")
print("|".join(out))
"""


@pytest.fixture
def echo_server() -> Iterator[int]:
    """A TCP server on the host's loopback that echoes a line (the gateway stand-in for the bridge)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                conn.sendall(b"echo " + conn.makefile("rb").readline())

    threading.Thread(target=serve, daemon=True).start()
    yield int(listener.getsockname()[1])
    listener.close()


def test_the_cli_sandbox_reaches_the_gateway_and_the_task_and_nothing_else(tmp_path: Path, echo_server: int,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GYRE_TEST_SECRET", "s3cret")  # in the harness's environment, never in the sandbox's
    root = tmp_path / "root"
    work, home, bin_dir, elsewhere = root / "work", root / "home", root / "bin", tmp_path / "elsewhere"
    for d in (work, home, elsewhere):
        d.mkdir(parents=True)
    install_client(bin_dir)
    seen: list[list[str]] = []
    task = TaskSocket(bin_dir / "task.sock", lambda argv: (seen.append(argv), "m1 opened . next write_line")[1])
    bridge = UnixToTcp(root / "gateway.sock", "127.0.0.1", echo_server)
    probe = elsewhere / "probe.py"
    probe.write_text(PROBE)
    python = Path(sys.base_prefix) / "bin" / "python3"
    try:
        argv = sandbox_argv(root, bin_dir, work, home, [elsewhere], {"LANG": "C.UTF-8"},
                            [str(python), str(probe), str(PORT), str(echo_server), str(Path.cwd() / "escape.txt"),
                             "/usr/escape.txt", str(tmp_path / "escape.txt")])
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=dict(os.environ))
    finally:
        bridge.close()
        task.close()
    assert proc.returncode == 0, proc.stderr[-2000:]
    fields = proc.stdout.strip().split("|")
    assert fields == ["bridge:echo ping", "refused:ConnectionRefusedError", fields[2], "task:m1 opened . next write_line",
                      "secret:absent", "denied", "denied", f"wrote:{tmp_path / 'escape.txt'}"], proc.stdout
    assert fields[2].startswith("refused:"), fields  # no route out of the namespace
    assert seen == [["open_module", "m1"]] and bridge.connections == 1
    # its working directory is the CLI's; the /tmp it wrote to was its own
    assert (work / "made-here.txt").read_text() == "ok" and not (tmp_path / "escape.txt").exists()
    assert not (Path.cwd() / "escape.txt").exists() and not Path("/usr/escape.txt").exists()
