"""Local launcher: ``gyre up`` / ``gyre status`` / ``gyre down``.

Starts a redis-server of its own (free port, append-only persistence under the data dir) unless
``REDIS_URL`` is set, then every service as a separate process with the same command systemd and
compose use (``python -m services.<svc>.main --config deploy/config/local.toml ...``), waits for
each one's gRPC health to be SERVING, and records pids and addresses in ``<data>/run/state.json``
so ``status`` and ``down`` work from another shell.

    redis-server --> trajectory --> reward --> trainer --> engine x N --> gateway --> scheduler
    (each later service gets the addresses of the earlier ones as flags)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any
from pathlib import Path

import redis

from services.common.server import free_port, wait_for_ready

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = REPO / "deploy" / "config" / "local.toml"


@dataclass(frozen=True)
class ServiceSpec:
    """How to start one service process; ``deps`` maps earlier services' addresses to flags."""

    name: str
    module: str
    section: str
    deps: Callable[[Mapping[str, str]], list[str]] = lambda _a: []
    extra: tuple[str, ...] = ()
    serves: bool = True
    """False for processes that serve no gRPC (the built-in harness) and take no service flags."""


@dataclass
class Running:
    name: str
    pid: int
    address: str
    metrics_port: int | None
    log: str
    command: list[str] = field(default_factory=list)
    info: dict[str, str] = field(default_factory=dict)  # extra endpoints the service announced (gateway: "http")


def service_command(spec: ServiceSpec, *, config: Path, redis_url: str, spool_dir: Path,
                    addresses: Mapping[str, str], port_file: Path | None = None) -> list[str]:
    """The exact command line of a service; deploy/ units and compose use the same shape."""
    if not spec.serves:
        return [sys.executable, "-m", spec.module, "--config", str(config), *spec.deps(addresses), *spec.extra]
    cmd = [sys.executable, "-m", spec.module, "--config", str(config),
           "--redis-url", redis_url, "--spool-dir", str(spool_dir), *spec.deps(addresses), *spec.extra]
    if port_file is not None:
        cmd += ["--port-file", str(port_file)]
    return cmd


def default_specs(num_engines: int = 2, *, model: str = "builtin-tiny", job_id: str = "",
                  torch_threads: int = 1) -> list[ServiceSpec]:
    """Every service of one Gyre stack: the processes `gyre up` and `gyre run` start.

    Cells: ``cell-0`` is the trainer core (never leaves TRAIN); ``cell-1..N`` host rollout
    engines. A cell daemon per cell registers it with the scheduler and heartbeats; the scheduler
    switches roles through the gateway (drain + migrate) and the trainer (add/release replica).
    """
    threads = ("--torch-threads", str(torch_threads))
    engines = [f"engine-{i + 1}" for i in range(num_engines)]
    job = ("--job-id", job_id) if job_id else ()
    specs = [
        ServiceSpec("trajectory", "services.trajectory.main", "trajectory"),
        ServiceSpec("reward", "services.reward.main", "reward",
                    deps=lambda a: ["--trajectory-address", a["trajectory"]]),
        ServiceSpec("trainer", "services.trainer.main", "trainer",
                    deps=lambda a: ["--trajectory-address", a["trajectory"]]),
    ]
    for i, name in enumerate(engines):
        specs.append(ServiceSpec(name, "services.rollout.engine_main", "engine",
                                 extra=("--cell-id", f"cell-{i + 1}", "--model", model, *threads)))
    specs += [
        ServiceSpec("gateway", "services.rollout.gateway_main", "gateway",
                    deps=lambda a: ["--trajectory-address", a["trajectory"], "--engine-addresses",
                                    ",".join(a[e] for e in engines), "--tokenizer-path", model, *job]),
        ServiceSpec("scheduler", "services.scheduler.main", "scheduler",
                    deps=lambda a: ["--gateway-address", a["gateway"], "--trainer-address", a["trainer"],
                                    "--reward-address", a["reward"], "--trajectory-address", a["trajectory"],
                                    "--actuator", "services"]),
        ServiceSpec("cell-0", "services.scheduler.daemon_main", "cell-daemon",
                    deps=lambda a: ["--scheduler-address", a["scheduler"], "--cell-id", "cell-0",
                                    "--role", "train", "--is-core"]),
    ]
    for i, name in enumerate(engines):
        specs.append(ServiceSpec(f"cell-{i + 1}", "services.scheduler.daemon_main", "cell-daemon",
                                 deps=_rollout_cell_deps(f"cell-{i + 1}", name)))
    return specs


def _rollout_cell_deps(cell_id: str, engine: str) -> Callable[[Mapping[str, str]], list[str]]:
    """Flags of a rollout cell's daemon: its scheduler and the engine it reports on."""
    return lambda a: ["--scheduler-address", a["scheduler"], "--cell-id", cell_id, "--role", "rollout",
                      "--engine-address", a[engine]]


def harness_spec(*, model: str, concurrency: int, harness_id: str, job_id: str = "",
                 extra: Sequence[str] = ()) -> ServiceSpec:
    """The built-in harness process (serves no gRPC): leases the executions of any running job that
    built-in harnesses run (or only ``job_id``'s); ``extra``: more HarnessConfig flags.
    ``harness_id`` stays the same across the supervisor's restarts, so a restarted harness gives up
    the leases its killed predecessor held at once."""
    job = ["--job-id", job_id] if job_id else []
    return ServiceSpec("harness", "services.harness", "harness", serves=False, extra=tuple(extra),
                       deps=lambda a: ["--scheduler", a["scheduler"], "--gateway", a["gateway"],
                                       "--harness-id", harness_id,
                                       "--reward", a["reward"], *job, "--model-dir", model,
                                       "--concurrency", str(concurrency),
                                       # model calls wait (not fail) while every cell trains
                                       "--call-retries", "60"])


class Launcher:
    """Owns the data dir (``.gyre`` by default): redis data, spool, logs, run/state.json."""

    def __init__(self, data_dir: Path = REPO / ".gyre", config: Path = DEFAULT_CONFIG) -> None:
        self.data_dir = data_dir.resolve()
        self.config = config
        self.run_dir = self.data_dir / "run"
        self.state_file = self.run_dir / "state.json"

    # -- up -----------------------------------------------------------------------------------
    def _kv_key(self) -> Path:
        """This stack's KV migration key file (created on first use; never printed or logged)."""
        path = self.data_dir / "secrets" / "kv.key"
        if not path.exists():
            import secrets

            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(secrets.token_hex(32))
        return path

    def up(self, specs: Sequence[ServiceSpec], *, redis_url: str | None = None, timeout_s: float = 300.0,
           echo: Callable[[str], None] = print, env: Mapping[str, str] | None = None) -> dict[str, Running]:
        if self.state_file.exists() and self._alive(self._load()):
            raise ValueError(f"Gyre is already up (state in {self.state_file}); run `gyre down` first")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.data_dir / "logs").mkdir(parents=True, exist_ok=True)
        # the replicas the trainer core spawns log next to every other process of this stack; its
        # engines sign KV migrations with a key of its own (made once, mode 0600, in the data dir)
        env = {"GYRE_TRAINER_REPLICA_LOG_DIR": str(self.data_dir / "logs"),
               "GYRE_ENGINE_KV_AUTH_KEY_FILE": str(self._kv_key()),
               # grpc's C core logs outside Python's logging (not JSON): errors only
               "GRPC_VERBOSITY": os.environ.get("GRPC_VERBOSITY", "ERROR"),
               # a log file is no progress display: no tqdm bars from model loading in it
               "HF_HUB_DISABLE_PROGRESS_BARS": "1", **(env or {})}
        # env: what a restart (services/supervisor.py) starts a process with again
        state: dict = {"redis": None, "services": {}, "env": {"PYTHONPATH": str(REPO), **env},
                       "cwd": str(REPO)}
        self.env = {**os.environ, "PYTHONPATH": str(REPO), **env}
        if redis_url is None:
            redis_url, pid, command = self._start_redis()
            state["redis"] = {"url": redis_url, "pid": pid, "command": command,
                              "log": str(self.data_dir / "logs" / "redis.log")}
            echo(f"redis       {redis_url}  (own redis-server, pid {pid}, AOF in {self.data_dir / 'redis'})")
        else:
            self._check_redis(redis_url)
            state["redis"] = {"url": redis_url, "pid": None}
            echo(f"redis       {redis_url}  (external)")
        self._save(state)
        addresses: dict[str, str] = {}
        try:
            for spec in specs:
                running = self._start_service(spec, redis_url, addresses, timeout_s)
                addresses[spec.name] = running.address
                state["services"][spec.name] = asdict(running)
                self._save(state)
                echo(f"{spec.name:<11} {running.address}  (pid {running.pid}, log {running.log})")
        except BaseException:
            self.down(echo=lambda _m: None)
            raise
        return {k: Running(**v) for k, v in state["services"].items()}

    def _start_service(self, spec: ServiceSpec, redis_url: str, addresses: Mapping[str, str],
                       timeout_s: float) -> Running:
        port_file = self.run_dir / f"{spec.name}.port"
        port_file.unlink(missing_ok=True)
        log_path = self.data_dir / "logs" / f"{spec.name}.log"
        cmd = service_command(spec, config=self.config, redis_url=redis_url, spool_dir=self.data_dir / "spool",
                              addresses=addresses, port_file=port_file)
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                                    env=getattr(self, "env", None) or {**os.environ, "PYTHONPATH": str(REPO)})
        if not spec.serves:
            time.sleep(0.5)
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
                raise ValueError(f"{spec.name} exited with code {proc.returncode} at start: " + " | ".join(tail))
            return Running(spec.name, proc.pid, "", None, str(log_path), cmd)
        deadline = time.monotonic() + timeout_s
        while not port_file.exists():
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace").strip().splitlines()[-3:]
                raise ValueError(f"{spec.name} exited with code {proc.returncode} at start: " + " | ".join(tail))
            if time.monotonic() > deadline:
                proc.kill()
                raise TimeoutError(f"{spec.name} did not start within {timeout_s:.0f}s; see {log_path}")
            time.sleep(0.05)
        info = json.loads(port_file.read_text())
        address = f"127.0.0.1:{info['port']}"
        wait_for_ready(address, timeout_s=max(1.0, deadline - time.monotonic()))
        extra = {k: str(v) for k, v in info.items() if k not in ("port", "metrics_port", "pid")}
        return Running(spec.name, proc.pid, address, info.get("metrics_port"), str(log_path), cmd, extra)

    def start_harnesses(self, specs: Sequence[ServiceSpec], addresses: Mapping[str, str], *,
                        env: Mapping[str, str] | None = None, echo: Callable[[str], None] = print) -> None:
        """Start harness processes (no gRPC) after the services are up; recorded for ``down``."""
        state = self._load()
        if env:
            self.env = {**os.environ, "PYTHONPATH": str(REPO), **env}
        for spec in specs:
            running = self._start_service(spec, state["redis"]["url"], addresses, 30.0)
            state["services"][spec.name] = asdict(running)
            self._save(state)
            echo(f"{spec.name:<11} no gRPC (pid {running.pid}, log {running.log})")

    def start_supervisor(self) -> int:
        """A detached supervisor (services/supervisor.py) that restarts whatever dies, until `down`."""
        with open(self.data_dir / "logs" / "supervisor.log", "ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "services.supervisor", "--data-dir", str(self.data_dir)],
                                    stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                                    env={**os.environ, "PYTHONPATH": str(REPO)})
        state = self._load()
        state["supervisor"] = {"pid": proc.pid, "log": str(self.data_dir / "logs" / "supervisor.log")}
        self._save(state)
        return proc.pid

    def _start_redis(self) -> tuple[str, int, list[str]]:
        binary = shutil.which("redis-server")
        if binary is None:
            raise ValueError("redis-server is not installed: run `make install` as root (installs the Debian "
                             "package redis-server) or set REDIS_URL to a running Redis")
        port = free_port()
        rdir = self.data_dir / "redis"
        rdir.mkdir(parents=True, exist_ok=True)
        command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(rdir), "--appendonly", "yes",
                   "--save", "", "--daemonize", "no", "--logfile", str(self.data_dir / "logs" / "redis.log")]
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        url = f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis.from_url(url, socket_connect_timeout=0.2).ping()
                return url, proc.pid, command
            except redis.exceptions.ConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise ValueError(f"redis-server did not start; see {self.data_dir / 'logs' / 'redis.log'}")
                time.sleep(0.05)

    @staticmethod
    def _check_redis(url: str) -> None:
        from services.common.redis_store import connect

        connect(url, retries=1).close()

    # -- status / down ------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        if not self.state_file.exists():
            return {"up": False, "services": {}}
        state = self._load()
        services: dict[str, dict[str, Any]] = {}
        out: dict[str, Any] = {"up": True, "redis": state.get("redis"), "services": services}
        for name, svc in state["services"].items():
            alive = _pid_alive(svc["pid"])
            healthy = alive and not svc["address"]  # a harness serves no gRPC: alive is all there is
            if alive and svc["address"]:
                try:
                    wait_for_ready(svc["address"], timeout_s=1.0)
                    healthy = True
                except TimeoutError:
                    pass
            services[name] = {"address": svc["address"], "pid": svc["pid"], "alive": alive,
                              "serving": healthy, "restarts": svc.get("restarts", 0),
                              "metrics_port": svc.get("metrics_port"),
                              "last_exit": svc.get("last_exit", ""), **svc.get("info", {})}
        sup = state.get("supervisor")
        out["supervisor"] = {"pid": sup["pid"], "alive": _pid_alive(sup["pid"])} if sup else None
        out["failed"] = state.get("failed", {})
        return out

    def down(self, *, grace_s: float = 20.0, echo: Callable[[str], None] = print) -> None:
        if not self.state_file.exists():
            echo("Gyre is not up")
            return
        state = self._load()
        if state.get("supervisor"):  # first, so that nothing stopped here is started again
            _terminate(state["supervisor"]["pid"], grace_s)
        for name, svc in reversed(list(state["services"].items())):
            _terminate(svc["pid"], grace_s)
            echo(f"stopped {name}")
        if state.get("redis") and state["redis"].get("pid"):
            _terminate(state["redis"]["pid"], grace_s)
            echo("stopped redis")
        self.state_file.unlink(missing_ok=True)

    def _alive(self, state: dict) -> bool:
        return any(_pid_alive(s["pid"]) for s in state.get("services", {}).values())

    def _load(self) -> dict:
        return json.loads(self.state_file.read_text())

    def _save(self, state: dict) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(self.state_file)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie child still answers kill(0); check /proc
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _terminate(pid: int, grace_s: float) -> None:
    """SIGTERM, wait up to grace_s, then SIGKILL."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not _pid_alive(pid):
            _reap(pid)
            return
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _reap(pid)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
