"""The `gyre` command as a user runs it (a process in the repository), for e2e tests."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def gyre(data_dir: Path, *args: str, timeout: float = 600, check: bool = True,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``gyre --data-dir DATA ARGS...`` (``env``: more environment, e.g. GYRE_<SECTION>_<FIELD>
    settings for the stack `gyre up` starts); with ``check``, a non-zero exit fails with its output."""
    env = {**os.environ, "GYRE_MODEL_CACHE": str(REPO / ".gyre" / "models"), **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "services.cli", "--data-dir", str(data_dir), *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"gyre {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc
