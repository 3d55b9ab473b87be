"""The local launcher notices a service that died under it (a crash, the OOM killer), so `gyre run`
stops with that news instead of waiting out its time budget."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from services.launcher import DEFAULT_CONFIG, Launcher, ServiceSpec


def test_exited_reports_a_killed_service_with_its_log_tail(tmp_path: Path) -> None:
    launcher = Launcher(tmp_path / "gyre", DEFAULT_CONFIG)
    specs = [ServiceSpec("trajectory", "services.trajectory.main", "trajectory"),
             ServiceSpec("reward", "services.reward.main", "reward",
                         deps=lambda a: ["--trajectory-address", a["trajectory"]])]
    try:
        up = launcher.up(specs, echo=lambda _m: None)
        assert launcher.exited() == {}
        os.kill(up["reward"].pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not launcher.exited() and time.monotonic() < deadline:
            time.sleep(0.05)
        dead = launcher.exited()
        assert list(dead) == ["reward"]  # the trajectory service still runs
        assert "serving" in dead["reward"]  # the tail of its log, for the operator
    finally:
        launcher.down(echo=lambda _m: None)
