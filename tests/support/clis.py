"""Third-party coding CLIs from their registries, pinned, installed once per checkout.

``npm_cli(package, version, binary)`` installs ``package@version`` under ``.gyre/clis/`` (a file
lock guards concurrent test processes) and returns the path of its ``binary``; ``None`` with the
reason when npm is not installed here.
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CLIS = REPO / ".gyre" / "clis"

CLAUDE_CODE = ("@anthropic-ai/claude-code", "2.1.328", "claude")
CODEX = ("@openai/codex", "0.169.0", "codex")


def npm_cli(package: str, version: str, binary: str) -> tuple[Path | None, str]:
    npm = shutil.which("npm")
    if npm is None:
        return None, "npm is not installed (the CLIs come from the npm registry)"
    where = CLIS / f"{package.replace('/', '+')}@{version}"
    exe = where / "node_modules" / ".bin" / binary
    where.mkdir(parents=True, exist_ok=True)
    with open(where / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (where / ".complete").exists():
            proc = subprocess.run([npm, "install", "--prefix", str(where), "--no-audit", "--no-fund", "--no-save",
                                   f"{package}@{version}"], capture_output=True, text=True, timeout=900)
            if proc.returncode != 0 or not exe.exists():
                raise RuntimeError(f"npm install {package}@{version} failed: {proc.stderr[-2000:]}")
            (where / ".complete").touch()
    return exe, ""
