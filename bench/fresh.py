"""One measurement in a fresh process, so its peak RSS is its own (the benches' ``--one`` mode)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def in_fresh_process(module: str, *args: str, timeout_s: float = 3600.0) -> dict:
    """Run ``python -m <module> --one ARGS`` in the repository, print and return the JSON object its
    last output line holds; RuntimeError with the end of its stderr when it fails."""
    out = subprocess.run([sys.executable, "-m", module, "--one", *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout_s)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    row: dict = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps(row), flush=True)
    return row
