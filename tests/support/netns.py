"""Run a third-party CLI in a network namespace whose only reachable address is the test's gateway.

Outside (the test process): ``UnixToTcp`` serves a Unix socket and forwards every connection to the
gateway's TCP address. Inside: ``python -m tests.support.netns PORT SOCKET -- CMD...``, started
under ``unshare --net``, brings up loopback, listens on ``127.0.0.1:PORT`` forwarding every
connection to the Unix socket (a filesystem object, so it crosses the namespace boundary), then
runs ``CMD`` and exits with its status. The CLI's own network is that loopback: every other
address (the vendor's API, telemetry, update checks) is unreachable, and ``UnixToTcp.connections``
counts what reached the gateway.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path


def _pipe(a: socket.socket, b: socket.socket) -> None:
    """Copy ``a`` -> ``b`` until ``a`` closes, then half-close ``b``."""
    try:
        while chunk := a.recv(1 << 16):
            b.sendall(chunk)
    except OSError:
        pass
    finally:
        try:
            b.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def _splice(a: socket.socket, b: socket.socket) -> None:
    t = threading.Thread(target=_pipe, args=(b, a), daemon=True)
    t.start()
    _pipe(a, b)
    t.join()
    a.close()
    b.close()


def _serve(listener: socket.socket, connect: Callable[[], socket.socket],
           on_accept: Callable[[], None] | None = None) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        if on_accept is not None:
            on_accept()
        try:
            upstream = connect()
        except OSError:
            conn.close()
            continue
        threading.Thread(target=_splice, args=(conn, upstream), daemon=True).start()


class UnixToTcp:
    """A Unix socket at ``path`` whose connections go to ``host:port`` (the gateway)."""

    def __init__(self, path: Path, host: str, port: int) -> None:
        self.path = path
        self.connections = 0
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        self._listener.listen(64)

        def count() -> None:
            self.connections += 1

        threading.Thread(target=_serve, args=(self._listener, lambda: socket.create_connection((host, port)), count),
                         daemon=True).start()

    def close(self) -> None:
        self._listener.close()


def netns_available() -> str:
    """'' when ``unshare --net`` works here, else why not."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "unshare or ip (util-linux, iproute2) is not installed"
    probe = subprocess.run(["unshare", "--net", "true"], capture_output=True, text=True)
    return "" if probe.returncode == 0 else f"unshare --net is not permitted here: {probe.stderr.strip()}"


def command(port: int, sock: Path, cmd: list[str]) -> list[str]:
    """The argv that runs ``cmd`` in a fresh network namespace reaching only ``sock`` at ``127.0.0.1:port``."""
    return ["unshare", "--net", "--", sys.executable, "-m", "tests.support.netns", str(port), str(sock), "--", *cmd]


def main(argv: list[str]) -> int:
    port, sock, sep, *cmd = argv
    assert sep == "--" and cmd, "usage: python -m tests.support.netns PORT SOCKET -- CMD..."
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", int(port)))
    listener.listen(64)

    def to_unix() -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(sock)
        return s

    threading.Thread(target=_serve, args=(listener, to_unix), daemon=True).start()
    return subprocess.run(cmd, env=os.environ).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
