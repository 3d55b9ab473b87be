"""Third-party coding CLIs from their registries, pinned, installed once per checkout under
``.gyre/clis`` (services.task.clis installs them; tests name this checkout's directory)."""

from __future__ import annotations

from pathlib import Path

from services.task import clis as _clis
from services.task.clis import CLAUDE_CODE, CODEX, MINI_SWE_AGENT, UNREACHABLE, CliUnavailable

REPO = Path(__file__).resolve().parents[2]
CLIS = REPO / ".gyre" / "clis"

__all__ = ["REPO", "CLIS", "CLAUDE_CODE", "CODEX", "MINI_SWE_AGENT", "UNREACHABLE", "CliUnavailable", "npm_cli",
           "pip_cli"]


def npm_cli(package: str, version: str, binary: str) -> Path:
    return _clis.npm_cli(package, version, binary, root=CLIS)


def pip_cli(package: str, version: str, binary: str) -> Path:
    return _clis.pip_cli(package, version, binary, root=CLIS)
