"""What bubblewrap sandboxes see of the host: the system's directories, read-only, at their paths.

Used by the reward service's scorer sandbox (services/reward/sandbox.py) and the mini-swe-agent
loop's command sandbox (services/task/loops.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

__all__ = ["SYSTEM_PATHS", "existing_paths"]

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
