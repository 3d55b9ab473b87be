"""A process in a network namespace of its own whose only reachable address is the gateway.

Coding CLIs (Claude Code, Codex) run as agent loops in a sandbox with no network; the model they
call is the gateway. Outside (the harness): ``UnixToTcp`` serves a Unix socket and forwards every
connection to the gateway's TCP address. Inside: this file, run as a script by the sandbox's own
interpreter (standard library only: nothing of Gyre's enters the sandbox),

    python3 netbridge.py PORT SOCKET -- CMD...

listens on ``127.0.0.1:PORT`` (bringing loopback up where the namespace left it down), forwards
every connection to ``SOCKET`` (a filesystem object, so it crosses the namespace boundary), runs
``CMD`` and exits with its status. The CLI's whole network is that loopback: the vendor's API,
telemetry and update checks are unreachable, and ``UnixToTcp.connections`` counts what reached
the gateway. Bytes pass through unchanged (TLS included).
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable

__all__ = ["UnixToTcp", "inside"]


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


def serve(listener: socket.socket, connect: Callable[[], socket.socket],
          on_accept: Callable[[], None] | None = None) -> None:
    """Accept on ``listener`` until it closes; splice each connection to a ``connect()`` one."""
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

    def __init__(self, path: str | os.PathLike[str], host: str, port: int) -> None:
        self.path = str(path)
        self.connections = 0
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(64)

        def count() -> None:
            self.connections += 1

        threading.Thread(target=serve, args=(self._listener, lambda: socket.create_connection((host, port)), count),
                         name="gateway-bridge", daemon=True).start()

    def close(self) -> None:
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()


def _loopback_up() -> None:
    """Bring loopback up where the namespace left it down (``unshare --net`` does; bubblewrap
    brings it up itself): bound while down, 127.0.0.1 accepts no connection (they hang)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # this namespace's lo (sysfs may show another's)
        request = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s.fileno(), 0x8913, request))[1]  # SIOCGIFFLAGS
    if not flags & 0x1:  # IFF_UP
        subprocess.run(["ip", "link", "set", "lo", "up"], check=True)


def _listen(port: int) -> socket.socket:
    _loopback_up()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(64)
    return listener


def inside(argv: list[str]) -> int:
    """``PORT SOCKET -- CMD...``: run CMD with ``127.0.0.1:PORT`` forwarded to ``SOCKET``."""
    if len(argv) < 4 or argv[2] != "--":
        print("usage: netbridge.py PORT SOCKET -- CMD...", file=sys.stderr)
        return 2
    port, sock, cmd = int(argv[0]), argv[1], argv[3:]
    listener = _listen(port)

    def to_unix() -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(sock)
        return s

    threading.Thread(target=serve, args=(listener, to_unix), daemon=True).start()
    try:
        return subprocess.run(cmd, env=os.environ).returncode
    except FileNotFoundError as exc:
        print(f"netbridge: {exc}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(inside(sys.argv[1:]))
