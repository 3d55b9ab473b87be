"""Helpers of the scheduler's service tests: an in-process server, and real subprocesses
(scheduler, cell daemons) started the way the launcher starts them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from services.common.redis_store import connect
from services.common.server import GyreServer, build_server
from services.scheduler.api import SchedulerApi
from services.scheduler.client import SchedulerClient
from services.scheduler.jobs import JobSpec, Mode, TaskSource
from services.scheduler.servicer import SERVICE_NAMES, registrations
from services.scheduler.state import SchedulerState
from tests.support.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
__all__ = ["InProcess", "Proc", "in_process_scheduler", "job_spec", "start_daemon", "start_scheduler", "wait_until"]


@dataclass
class InProcess:
    state: SchedulerState
    api: SchedulerApi
    server: GyreServer
    client: SchedulerClient


@contextmanager
def in_process_scheduler(redis_url: str, *, lease_ttl_s: float = 30.0, cell_dead_after_s: float = 30.0,
                         ) -> Iterator[InProcess]:
    state = SchedulerState(connect(redis_url))
    api = SchedulerApi(state, lease_ttl_s=lease_ttl_s, cell_dead_after_s=cell_dead_after_s)
    server = build_server("scheduler", registrations(api), service_names=SERVICE_NAMES, max_workers=16).start()
    server.set_serving(True)
    client = SchedulerClient(server.address, timeout_s=20.0)
    try:
        yield InProcess(state, api, server, client)
    finally:
        client.close()
        server.stop(0)


def job_spec(job_id: str = "j1", **kw: object) -> JobSpec:
    base: dict[str, object] = dict(job_id=job_id, model="tiny", tasks=TaskSource(payloads=(b"task-a", b"task-b")),
                                   num_steps=2, groups_per_step=2, group_size=2, mode=Mode.COLOCATE,
                                   staleness_bound=0, execution_timeout_s=600.0)
    base.update(kw)
    return JobSpec(**base)  # type: ignore[arg-type]


class Proc:
    """A service subprocess with a port file; ``kill()`` is kill -9."""

    def __init__(self, module: str, args: list[str], workdir: Path, name: str) -> None:
        self.port_file = workdir / f"{name}.port"
        self.port_file.unlink(missing_ok=True)
        self.log_path = workdir / f"{name}.log"
        self.log = open(self.log_path, "ab")
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", module, *args, "--port-file", str(self.port_file),
                                      "--log-json", "false"],
                                     stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                     start_new_session=True)
        self.port = 0

    def wait_port(self, timeout_s: float = 30.0) -> int:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"process exited {self.proc.returncode}: {self.log_path.read_text()[-2000:]}")
            return self.port_file.exists()

        wait_until(ready, timeout_s, f"{self.log_path.name} to serve")
        import json

        self.port = int(json.loads(self.port_file.read_text())["port"])
        return self.port

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()


def start_scheduler(redis_url: str, workdir: Path, *extra: str, name: str = "scheduler") -> Proc:
    p = Proc("services.scheduler.main",
             ["--redis-url", redis_url, "--actuator", "daemon", "--tick-interval-s", "0.1", "--leader-ttl-s", "1.0",
              "--grace-s", "1", *extra], workdir, name)
    p.wait_port()
    return p


def start_daemon(scheduler_address: str, workdir: Path, cell_id: str, *extra: str) -> Proc:
    p = Proc("services.scheduler.daemon_main",
             ["--scheduler-address", scheduler_address, "--cell-id", cell_id, "--heartbeat-interval-s", "0.2",
              "--grace-s", "1", *extra], workdir, f"daemon-{cell_id}")
    p.wait_port()
    return p
