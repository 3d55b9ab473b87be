"""Supervision of a launched stack (services/supervisor.py): a service that dies (a crash, the OOM
killer) is started again on its address and serves again; past its restart budget it is left down
and named, with its log tail, so `gyre run` stops with that news."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

from services.common.server import wait_for_ready
from services.launcher import DEFAULT_CONFIG, Launcher, ServiceSpec
from services.supervisor import RestartPolicy, Supervisor
from tests.support.waiting import wait_until


def test_a_killed_service_is_restarted_on_its_address_until_its_budget_is_spent(tmp_path: Path) -> None:
    launcher = Launcher(tmp_path / "gyre", DEFAULT_CONFIG)
    specs = [ServiceSpec("trajectory", "services.trajectory.main", "trajectory"),
             ServiceSpec("reward", "services.reward.main", "reward",
                         deps=lambda a: ["--trajectory-address", a["trajectory"]])]
    lines: list[str] = []
    sup = Supervisor(launcher.state_file, policy=RestartPolicy(initial_backoff_s=0.01, budget=1), echo=lines.append)
    try:
        up = launcher.up(specs, echo=lambda _m: None)
        assert sup.check() == [] and sup.failed() == {}
        address = up["reward"].address
        os.kill(up["reward"].pid, signal.SIGKILL)
        assert wait_until(sup.check, 60, "the killed service to be restarted") == ["reward"]  # trajectory still runs
        status = launcher.status()["services"]
        assert status["reward"]["restarts"] == 1 and status["reward"]["address"] == address
        assert status["reward"]["serving"] and status["reward"]["pid"] != up["reward"].pid
        wait_for_ready(address, timeout_s=5)
        # the exit status, when this process still could reap it (Popen may have reaped it first)
        assert re.match(r"reward (killed by SIGKILL|exited); restarted \(pid \d+, restart 1", lines[-1]), lines
        os.kill(status["reward"]["pid"], signal.SIGKILL)  # a second death: past the budget of 1
        wait_until(lambda: sup.check() == [] and sup.failed(), 60, "the service to be left down past its budget")
        failed = sup.failed()
        assert list(failed) == ["reward"] and "restart budget" in failed["reward"]["reason"]
        assert "serving" in failed["reward"]["log_tail"]  # the tail of its log, for the operator
        assert launcher.status()["failed"] == failed
    finally:
        launcher.down(echo=lambda _m: None)
