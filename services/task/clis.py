"""Third-party agent CLIs from their registries, pinned, installed once per checkout.

``pip_cli(package, version, binary)`` installs ``package==version`` in a virtual environment of its
own under ``clis_dir()`` (its dependencies, e.g. litellm's openai, never touch Gyre's) and returns
the path of its ``binary``; ``npm_cli`` does the same for an npm package. A file lock guards
concurrent installers (harness workers, test processes); ``CliUnavailable`` says why not when npm
is missing or the registry cannot be reached from here.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

__all__ = ["CLAUDE_CODE", "CODEX", "MINI_SWE_AGENT", "CliUnavailable", "clis_dir", "npm_cli", "pip_cli"]

CLAUDE_CODE = ("@anthropic-ai/claude-code", "2.1.328", "claude")
CODEX = ("@openai/codex", "0.169.0", "codex")
MINI_SWE_AGENT = ("mini-swe-agent", "2.4.6", "mini")

# an install that failed for one of these reasons says the registry cannot be reached from here
UNREACHABLE = ("ENOTFOUND", "EAI_AGAIN", "ETIMEDOUT", "ECONNREFUSED", "ECONNRESET", "getaddrinfo",
               "Temporary failure in name resolution", "Failed to establish a new connection", "No route to host")


class CliUnavailable(RuntimeError):
    """This host cannot install the CLI (no npm, or the registry is unreachable): not a failure of
    the package or of Gyre."""


def clis_dir() -> Path:
    """Where the CLIs live: ``$GYRE_CLIS_DIR``, else ``.gyre/clis`` in the current directory."""
    return Path(os.environ.get("GYRE_CLIS_DIR") or ".gyre/clis").resolve()


def _install_once(where: Path, exe: Path, install: Callable[[], subprocess.CompletedProcess], what: str) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    with open(where / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (where / ".complete").exists():
            proc = install()
            if proc.returncode != 0 or not exe.exists():
                shutil.rmtree(where / "node_modules", ignore_errors=True)
                if any(s in proc.stderr + proc.stdout for s in UNREACHABLE):
                    raise CliUnavailable(f"installing {what}: the registry is unreachable from here")
                raise RuntimeError(f"installing {what} failed: {proc.stderr[-2000:]}")
            (where / ".complete").touch()
    return exe


def npm_cli(package: str, version: str, binary: str, *, root: Path | None = None) -> Path:
    npm = shutil.which("npm")
    if npm is None:
        raise CliUnavailable("npm is not installed (the CLIs come from the npm registry)")
    where = (root or clis_dir()) / f"{package.replace('/', '+')}@{version}"
    exe = where / "node_modules" / ".bin" / binary
    return _install_once(where, exe, lambda: subprocess.run(
        [npm, "install", "--prefix", str(where), "--no-audit", "--no-fund", "--no-save", f"{package}@{version}"],
        capture_output=True, text=True, timeout=900), f"{package}@{version}")


def pip_cli(package: str, version: str, binary: str, *, root: Path | None = None) -> Path:
    where = (root or clis_dir()) / f"{package}@{version}"
    exe = where / "bin" / binary

    def install() -> subprocess.CompletedProcess:
        made = subprocess.run([sys.executable, "-m", "venv", str(where)], capture_output=True, text=True)
        if made.returncode != 0:
            return made
        return subprocess.run([str(where / "bin" / "pip"), "install", "--quiet", f"{package}=={version}"],
                              capture_output=True, text=True, timeout=900)

    return _install_once(where, exe, install, f"{package}=={version}")
