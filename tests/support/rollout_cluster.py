"""Real rollout servers for tests: tiny TorchEngines behind Engine gRPC servers, a gateway, engine
processes and a tiny checkpoint (all built locally, nothing downloaded)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from protos.gyre.v1 import rollout_pb2_grpc
from services.common.server import GyreServer, build_server
from services.rollout.client import EngineClient, GatewayClient
from services.rollout.gateway import Gateway
from services.rollout.host import EngineHost
from services.rollout.router import Router
from services.rollout.servicer import EngineServicer, GatewayServicer
from services.rollout.torch_engine import TorchEngine, build_tiny_model
from tests.support.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
MAX_CONTEXT = 1024


def varied_tiny_model(seed: int = 0) -> torch.nn.Module:
    """The tiny random Qwen3 with sharpened weights, so greedy outputs vary (not one repeated id)."""
    model = build_tiny_model(seed=seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(4.0)
    return model


def save_tiny_checkpoint(path: Path, seed: int = 0) -> Path:
    varied_tiny_model(seed).save_pretrained(str(path))
    return path


@dataclass
class LocalEngine:
    cell_id: str
    server: GyreServer
    host: EngineHost

    @property
    def address(self) -> str:
        return self.server.address

    def stop(self) -> None:
        self.server.stop(0)
        self.host.stop()


def start_engine(cell_id: str, *, model: torch.nn.Module | None = None, checkpoint: Path | None = None,
                 kv_kinds: tuple[str, ...] = ("tcp",), max_batch_size: int = 16,
                 max_context: int = MAX_CONTEXT, engine: TorchEngine | None = None) -> LocalEngine:
    """An engine gRPC server: ``engine`` as given, or one built from ``checkpoint`` or ``model``."""
    if engine is not None:
        pass
    elif checkpoint is not None:
        engine = TorchEngine.from_pretrained(str(checkpoint), device="cpu", max_context=max_context,
                                             max_batch_size=max_batch_size)
    else:
        engine = TorchEngine(model if model is not None else varied_tiny_model(), device="cpu",
                             max_context=max_context, max_batch_size=max_batch_size)
    host = EngineHost(engine, cell_id=cell_id, kv_kinds=kv_kinds)
    server = build_server(f"engine-{cell_id}", [(rollout_pb2_grpc.add_EngineServicer_to_server,
                                                 EngineServicer(host, attach_wait_s=20.0))],
                          service_names=["gyre.v1.Engine"], max_workers=128)
    host.address = server.address
    host.start()
    server.start()
    server.set_serving(True)
    return LocalEngine(cell_id, server, host)


@dataclass
class LocalGateway:
    server: GyreServer
    gateway: Gateway
    records: list[Any] = field(default_factory=list)
    _clients: list[GatewayClient] = field(default_factory=list)

    @property
    def address(self) -> str:
        return self.server.address

    def client(self, **kw: Any) -> GatewayClient:
        c = GatewayClient(self.address, **kw)
        self._clients.append(c)
        return c

    def stop(self) -> None:
        for c in self._clients:
            c.close()
        self.server.stop(0)
        self.gateway.stop()


def start_gateway(on_record: Callable[[Any], Any] | None = None, *, max_message_mb: int = 256,
                  probe_interval_s: float = 0.5) -> LocalGateway:
    records: list[Any] = []
    gateway = Gateway(connect=EngineClient, router=Router(), on_record=on_record or records.append,
                      attach_wait_s=20.0, probe_interval_s=probe_interval_s).start()
    server = build_server("gateway", [(rollout_pb2_grpc.add_GatewayServicer_to_server, GatewayServicer(gateway))],
                          service_names=["gyre.v1.Gateway"], max_workers=256, max_message_mb=max_message_mb)
    server.start()
    server.set_serving(True)
    return LocalGateway(server, gateway, records)


@dataclass
class EngineProcess:
    """``python -m services.rollout.engine_main`` as a child process."""

    cell_id: str
    proc: subprocess.Popen[bytes]
    address: str
    log_path: Path
    port_file: Path

    def wait_ready(self, timeout_s: float = 180.0) -> str:
        try:  # its port file, or its end
            wait_until(lambda: self.port_file.exists() or self.proc.poll() is not None, timeout_s,
                       f"engine {self.cell_id} to write its port file", poll_s=0.1)
        except AssertionError:
            pass  # reported below, as an end is
        if not self.port_file.exists():
            self.kill()
            raise RuntimeError(f"engine {self.cell_id} did not start:\n{self.log_path.read_text()[-3000:]}")
        self.address = f"127.0.0.1:{json.loads(self.port_file.read_text())['port']}"
        return self.address

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


def spawn_engine(cell_id: str, checkpoint: Path, tmp: Path) -> EngineProcess:
    """Start the process; ``wait_ready`` once every process of a test was spawned (they load in parallel)."""
    port_file = tmp / f"{cell_id}.port"
    log_path = tmp / f"{cell_id}.log"
    cmd = [sys.executable, "-m", "services.rollout.engine_main", "--cell-id", cell_id, "--model", str(checkpoint),
           "--device", "cpu", "--torch-threads", "1", "--max-context-tokens", str(MAX_CONTEXT),
           "--max-batch-size", "16", "--kv-transports", "tcp", "--log-json", "false", "--port-file", str(port_file)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    return EngineProcess(cell_id, proc, "", log_path, port_file)
