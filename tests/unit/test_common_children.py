"""Children and scratch directories that do not outlive their (SIGKILLed) owner."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.children import scratch_dir, sweep_scratch, tied
from tests.support.waiting import wait_until


def _gone(pid: int) -> bool:
    """The process is gone or a zombie (killed, not yet reaped by whoever adopted it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


@pytest.mark.skipif(not Path("/usr/bin/setpriv").exists() and not Path("/bin/setpriv").exists(),
                    reason="util-linux setpriv is missing")
def test_a_tied_child_dies_with_its_sigkilled_parent() -> None:
    # The parent starts the child in a session of its own (as the mini-swe-agent loop does, so a
    # process-group kill reaches its tree), from a worker thread, then is SIGKILLed: no cleanup runs.
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, threading, time\n"
        "from services.common.children import tied\n"
        "def run():\n"
        "    p = subprocess.Popen(tied(['sleep', '600']), start_new_session=True)\n"
        "    print(p.pid, flush=True)\n"
        "    p.wait()\n"
        "threading.Thread(target=run).start()\n"
        "time.sleep(600)\n")], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        # setpriv sets the parent-death signal, then execs the command: once the child is `sleep`,
        # it is tied (a parent killed before that moment would leave it untied: a window of
        # microseconds in a harness, but not in a test that kills the parent at once).
        wait_until(lambda: Path(f"/proc/{child}/comm").read_text().strip() == "sleep", 20, "the child to exec")
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        wait_until(lambda: _gone(child), 20, "the tied child to die with its parent")
    finally:
        if parent.poll() is None:
            parent.kill()


def test_untied_when_setpriv_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    assert tied(["mini", "-y"]) == ["mini", "-y"]


def test_sweep_deletes_the_scratch_of_a_dead_owner_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    # A process that made a scratch dir and ended (as a SIGKILLed harness would, without cleanup).
    out = subprocess.run([sys.executable, "-c", "from services.common.children import scratch_dir;"
                          "print(scratch_dir('gyre-test-'))"], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[2], env={**os.environ, "TMPDIR": str(tmp_path)})
    dead = Path(out.stdout.strip())
    (dead / "work").mkdir()
    (dead / "work" / "file").write_text("x")
    mine = scratch_dir("gyre-test-")  # sweeps first: the dead owner's goes
    assert not dead.exists()
    assert mine.is_dir() and mine.parent == tmp_path
    foreign = tmp_path / "gyre-test-foreign"  # no owner file: not ours to judge
    foreign.mkdir()
    other_prefix = tmp_path / "other-x"
    other_prefix.mkdir()
    assert sweep_scratch("gyre-test-") == []
    assert mine.is_dir() and foreign.is_dir() and other_prefix.is_dir()
