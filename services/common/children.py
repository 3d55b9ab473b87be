"""Child processes and scratch directories that do not outlive the process that made them.

A harness runs third-party CLIs (mini-swe-agent) in sessions of their own, so that a deadline can
kill each one's whole process group; a SIGKILL of the harness, though, runs no cleanup. Two
safeguards cover that case:

- `tied`: the child's argv is prefixed with util-linux ``setpriv --pdeathsig KILL``, so the kernel
  kills it when the thread that started it dies (with its process, SIGKILL included); bubblewrap
  sandboxes below it already die with it (``--die-with-parent``).
- `scratch_dir` writes the owner's pid and start time into each directory it makes, and
  `sweep_scratch` (called before making a new one) deletes the directories with that prefix whose
  owner is gone, so a killed harness's workspaces go with its next start.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["tied", "scratch_dir", "sweep_scratch"]

_OWNER = ".gyre-owner"


def tied(argv: list[str]) -> list[str]:
    """``argv`` run so that it is killed when its parent thread dies (unchanged where util-linux's
    setpriv is missing: not Linux, or a minimal image). A parent killed in the microseconds before
    setpriv sets the signal leaves the child untied; `sweep_scratch` still removes its directory."""
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--", *argv] if setpriv else list(argv)


def _start_time(pid: int) -> str:
    """The process's start time in clock ticks since boot ("" when it is gone or unknown)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[-1].split()[19]  # field 22; the command name may hold spaces


def scratch_dir(prefix: str) -> Path:
    """A new directory under the temp dir, owned by this process (see `sweep_scratch`)."""
    sweep_scratch(prefix)
    root = Path(tempfile.mkdtemp(prefix=prefix))
    (root / _OWNER).write_text(f"{os.getpid()} {_start_time(os.getpid())}\n")
    return root


def _alive(owner: Path) -> bool:
    try:
        pid_text, start = owner.read_text().split()
        pid = int(pid_text)
    except (OSError, ValueError):
        return True  # being written, or not ours to judge: leave it
    return _start_time(pid) == start  # a reused pid has another start time


def sweep_scratch(prefix: str) -> list[Path]:
    """Delete the directories ``prefix*`` under the temp dir whose owning process is gone; returns them."""
    gone = []
    for path in Path(tempfile.gettempdir()).glob(prefix + "*"):
        owner = path / _OWNER
        if path.is_dir() and owner.is_file() and not _alive(owner):
            shutil.rmtree(path, ignore_errors=True)
            gone.append(path)
    return gone
