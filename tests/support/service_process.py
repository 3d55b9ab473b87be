"""Real Gyre service processes for deploy, security and reliability tests.

``ServiceProcess`` runs ``python -m <module> --port 0 --port-file F ...`` (the launcher's command
shape), waits for the port file and health SERVING, and stops it with SIGTERM (or SIGKILL for
crash tests). Output goes to a log file in the test's tmp dir; ``tail()`` shows it on failure.

    procs = [ServiceProcess.start("trajectory", "services.trajectory.main", tmp, [...]), ...]
    for p in procs: p.wait_ready()        # the processes boot in parallel
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.common.security import Security, open_channel
from tests.support.waiting import wait_until

if TYPE_CHECKING:
    from services.launcher import ServiceSpec

REPO = Path(__file__).resolve().parents[2]


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment of a service child: repo on the path, one torch thread, no GYRE_* leaking in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GYRE_")}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env.update(extra or {})
    return env


@dataclass
class ServiceProcess:
    """One service process; lifecycle: start() -> wait_ready() -> terminate()/kill() [-> restart()]."""

    name: str
    module: str
    workdir: Path
    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    port: int = 0
    metrics_port: int | None = None
    starts: int = 0

    @classmethod
    def start(cls, name: str, module: str, workdir: Path, args: Sequence[str], *, port: int = 0,
              env: Mapping[str, str] | None = None) -> "ServiceProcess":
        sp = cls(name, module, Path(workdir), list(args), dict(env or {}))
        sp.port = port
        sp.launch()
        return sp

    @property
    def port_file(self) -> Path:
        return self.workdir / f"{self.name}.port"

    @property
    def log_file(self) -> Path:
        return self.workdir / f"{self.name}.log"

    @property
    def address(self) -> str:
        assert self.port, f"{self.name} has no port yet"
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def launch(self) -> None:
        """Start the process (again): a restart keeps a fixed port when one was bound before."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port_file.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", self.module, "--port", str(self.port), "--port-file", str(self.port_file),
               "--log-json", "false", *self.args]
        self.starts += 1
        with open(self.log_file, "ab") as log:
            log.write(f"--- start {self.starts}: {' '.join(cmd)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                         env=child_env(self.env), start_new_session=True)

    def wait_ready(self, timeout_s: float = 120.0, *, security: Security | None = None) -> "ServiceProcess":
        deadline = time.monotonic() + timeout_s  # one cap for both waits
        proc = self.proc
        assert proc is not None
        try:  # its port file, or its end
            wait_until(lambda: self.port_file.exists() or proc.poll() is not None, timeout_s,
                       f"{self.name} to write its port file")
        except AssertionError:
            raise AssertionError(f"{self.name} wrote no port file within {timeout_s:.0f}s:\n{self.tail()}") from None
        if not self.port_file.exists():
            raise AssertionError(f"{self.name} exited with {proc.returncode} at start:\n{self.tail()}")
        info = json.loads(self.port_file.read_text())
        self.port = int(info["port"])
        self.metrics_port = info.get("metrics_port")
        try:
            wait_until(lambda: health(self.address, security=security) == health_pb2.HealthCheckResponse.SERVING,
                       max(0.0, deadline - time.monotonic()), f"{self.name} to be SERVING", poll_s=0.1)
        except AssertionError:
            raise AssertionError(f"{self.name} is not SERVING after {timeout_s:.0f}s:\n{self.tail()}") from None
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self, timeout_s: float = 30.0) -> int:
        """SIGTERM and wait; returns the exit code (raises if it does not exit within timeout_s)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.name} did not exit within {timeout_s:.0f}s of SIGTERM:\n{self.tail()}")

    def kill(self) -> None:
        """SIGKILL the process group (a crash: no handler runs, children die too)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)

    def restart(self, timeout_s: float = 120.0) -> "ServiceProcess":
        """Start again on the same port. The kernel may not have released the killed process's
        listening port yet; like systemd's Restart=, try again a few times when the bind fails."""
        for attempt in range(5):
            self.launch()
            try:
                return self.wait_ready(timeout_s)
            except AssertionError as exc:
                if attempt == 4 or "bind" not in str(exc).lower():
                    raise
                time.sleep(1.0)
        raise AssertionError("unreachable")

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def stop_all(procs: Sequence[ServiceProcess], timeout_s: float = 20.0) -> None:
    """Cleanup for fixtures: SIGTERM everyone, then SIGKILL stragglers after ``timeout_s``."""
    for p in procs:
        if p.alive():
            assert p.proc is not None
            p.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        if p.proc is None:
            continue
        try:
            p.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()


def run_once(module: str, args: Sequence[str], *, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    """Run a service command that is expected to exit by itself (bad flags, unreachable Redis)."""
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=child_env(), capture_output=True,
                          text=True, timeout=timeout_s)


def health(address: str, service: str = "", *, security: Security | None = None) -> int:
    """Health status of ``address`` (UNKNOWN when it does not answer)."""
    with open_channel(address, security=security or Security()) as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                        timeout=2).status
        except grpc.RpcError:
            return health_pb2.HealthCheckResponse.UNKNOWN


def reflected_services(address: str) -> set[str]:
    with grpc.insecure_channel(address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                              timeout=10)
        return {s.name for r in responses for s in r.list_services_response.service}


def launcher_args(spec: "ServiceSpec", *, config: Path, redis_url: str, spool_dir: Path,
                  addresses: Mapping[str, str]) -> list[str]:
    """The launcher's flags for ``spec`` (everything after ``python -m <module>``)."""
    from services.launcher import service_command

    cmd = service_command(spec, config=config, redis_url=redis_url, spool_dir=spool_dir, addresses=addresses)
    assert cmd[1:3] == ["-m", spec.module]
    return cmd[3:]


def spawn(module: str, args: Sequence[str], log_file: Path) -> subprocess.Popen[bytes]:
    """A plain worker process (no port, no health), logging to ``log_file``; kill with ``kill_group``."""
    with open(log_file, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO, env=child_env(), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
