"""Run a third-party CLI in a network namespace whose only reachable address is the test's gateway.

The bridge is the product's (services.task.netbridge, which the CLI loops of ``gyre run --harness``
use in bubblewrap); here it runs under ``unshare --net``. Outside (the test process): ``UnixToTcp`` serves a Unix socket and forwards every connection to the
gateway's TCP address. Inside: ``python -m tests.support.netns PORT SOCKET -- CMD...``, started
under ``unshare --net``, brings up loopback, listens on ``127.0.0.1:PORT`` forwarding every
connection to the Unix socket (a filesystem object, so it crosses the namespace boundary), then
runs ``CMD`` and exits with its status. The CLI's own network is that loopback: every other
address (the vendor's API, telemetry, update checks) is unreachable, and ``UnixToTcp.connections``
counts what reached the gateway.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from services.task.netbridge import UnixToTcp, inside

__all__ = ["UnixToTcp", "netns_available", "command", "main"]


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
    assert len(argv) >= 4 and argv[2] == "--", "usage: python -m tests.support.netns PORT SOCKET -- CMD..."
    return inside(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
