"""A real redis-server process for tests: free port, own data dir, append-only persistence."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import redis

from services.common.server import free_port
from tests.support.waiting import wait_until


class RedisServer:
    """Start/stop/restart a redis-server on a fixed free port with AOF in ``data_dir``."""

    def __init__(self, data_dir: Path, port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed; run `make install` (installs the Debian "
                               "package redis-server when run as root)")
        self.binary = binary
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir),
             "--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--protected-mode", "yes",
             "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        proc = self.proc
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)

        def answers() -> bool:
            try:
                return bool(client.ping())
            except redis.exceptions.ConnectionError:
                if proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {proc.returncode}") from None
                return False

        try:
            wait_until(answers, 10, "redis-server to answer")
        except AssertionError:
            raise RuntimeError("redis-server did not answer within 10s") from None
        client.close()
        return self

    def stop(self, *, kill: bool = False) -> None:
        if self.proc is None:
            return
        if kill:
            self.proc.kill()
        else:
            self.proc.terminate()
        self.proc.wait(timeout=10)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()
