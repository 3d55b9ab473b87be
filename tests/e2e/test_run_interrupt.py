"""`gyre run` stopped by signals (a `timeout`, a process-group kill, ^C twice) takes down every
process it started: the services run in their own sessions, so a teardown cut short by a second
signal would leave them all running (and holding memory) after `gyre run` is gone."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.launcher import REPO
from tests.support.waiting import wait_until


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes (its parent was the run process, now reaped or dead)
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(300)
@pytest.mark.parametrize("compare", [False, True], ids=["run", "compare"])
def test_two_sigterms_mid_run_still_stop_every_service(tmp_path: Path, compare: bool) -> None:
    """`gyre run`, and `gyre run --compare` in its first mode's run."""
    out = tmp_path / "out.txt"
    with open(out, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "run", *(["--compare"] if compare else []), "--num-steps", "50",
             "--evaluation.tasks", "0", "--quiet",
             "--data-dir", str(tmp_path / "data"), "--report-dir", str(tmp_path / "report")],
            cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        try:  # the built-in harness started (the last process), or the run ended
            wait_until(lambda: re.search(r"^harness +no gRPC \(pid \d+", out.read_text(), re.M) is not None
                       or proc.poll() is not None, 240, "the built-in harness to start", poll_s=0.2)
        except AssertionError as exc:
            raise AssertionError(f"{exc}:\n{out.read_text()}") from None
        assert proc.poll() is None, out.read_text()
        pids = [int(p) for p in re.findall(r"\bpid (\d+)", out.read_text())]
        assert len(pids) >= 8 and all(_alive(p) for p in pids)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # a second signal while the teardown runs
        assert proc.wait(timeout=120) == 130, out.read_text()
        assert "interrupted; every service it started was stopped" in out.read_text()
        left = [p for p in pids if _alive(p)]
        assert left == [], f"still running after gyre run exited: {left}\n{out.read_text()[-2000:]}"
    finally:
        if proc.poll() is None:
            proc.kill()
