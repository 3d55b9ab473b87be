"""What bubblewrap sandboxes see of the host: the system's directories, read-only, at their paths.

Used by the reward service's scorer sandbox (services/reward/sandbox.py), the mini-swe-agent
loop's command sandbox (services/task/loops.py) and the coding CLIs' (services/task/cli_loops.py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import Path

__all__ = ["SYSTEM_PATHS", "existing_paths", "command_sandbox_args"]

SYSTEM_PATHS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc/alternatives", "/etc/ld.so.cache")
"""Where programs, their libraries and the loader's cache live."""


def existing_paths(paths: Iterable[str]) -> list[str]:
    """``paths`` that exist, in order, without repeats; a symlink also by its target (a merged
    /usr's /bin, an interpreter in a versioned directory), so binding each shows the same tree."""
    out: dict[str, None] = {}
    for path in paths:
        for p in (os.path.abspath(path), os.path.realpath(path)):
            if os.path.exists(p):
                out[p] = None
    return list(out)


def command_sandbox_args(bin_dir: Path) -> list[str]:
    """bubblewrap's arguments for an agent's commands (mini-swe-agent's ``wrapper_args``, which
    adds the working directory's bind and ``bash -c``; the coding CLIs' sandbox, services.task.
    cli_loops, which adds theirs): namespaces of its own (no network), no capabilities, a clean
    environment, a private /tmp, the system read-only, and ``bin_dir`` (``gyre-task`` and its socket)
    first on PATH."""
    if os.geteuid() == 0:  # no user namespace as root: namespaces of their own, no capabilities
        argv = ["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
                "--cap-drop", "ALL"]
    else:
        argv = ["--unshare-all", "--cap-drop", "ALL"]
    argv += ["--die-with-parent", "--new-session", "--hostname", "gyre-task", "--clearenv",
             "--setenv", "PATH", f"{bin_dir}:/usr/local/bin:/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8",
             "--setenv", "PAGER", "cat", "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]
    for path in existing_paths([*SYSTEM_PATHS, sys.base_prefix]):
        argv += ["--ro-bind", path, path]
    return argv + ["--bind", str(bin_dir), str(bin_dir)]
