"""``gyre-cell-daemon``: a cell's daemon process (serves ``CellDaemon``, reports to the scheduler).

    python -m services.scheduler.daemon_main --scheduler-address 127.0.0.1:50070 --cell-id cell-1 \
        --role rollout --kv-capacity-tokens 65536 --rollout-command "python -m services.rollout.engine_main ..."

It registers the cell, then heartbeats every ``heartbeat_interval_s`` with the role it runs and
its load (from the cell's engine when ``engine_address`` is set), re-registering if the scheduler
forgot it. On SIGTERM it deregisters and stops its role process.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from protos.gyre.v1 import scheduler_pb2_grpc
from services.common.entry import Built, run_service
from services.common.errors import GyreError, NotFound
from services.common.logging import get_logger
from services.common.server import advertised_host, build_server
from services.scheduler.cell_daemon import CellDaemon
from services.scheduler.client import SchedulerClient
from services.scheduler.config import CellDaemonConfig
from services.common.roles import CellRole
from services.scheduler.servicer import DAEMON_SERVICE_NAMES, CellDaemonServicer

log = get_logger("services.scheduler.daemon")


class Reporter:
    """Registers the cell and heartbeats its role and load until stopped."""

    def __init__(self, cfg: CellDaemonConfig, daemon: CellDaemon, address: str) -> None:
        self.cfg = cfg
        self.daemon = daemon
        self.address = address
        self.client = SchedulerClient(cfg.scheduler_address, timeout_s=10.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cell-reporter", daemon=True)

    def start(self) -> Reporter:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10.0)
        try:
            self.client.deregister_cell(self.cfg.cell_id)
        except GyreError as exc:  # deliberate: mid-switch or scheduler gone; the cell just ages out
            log.warning("deregister failed", cell_id=self.cfg.cell_id, error=str(exc))
        self.client.close()

    def _register(self) -> None:
        cfg = self.cfg
        self.client.register_cell(cell_id=cfg.cell_id, address=self.address, role=self.daemon.role,
                                  host=self.address.rsplit(":", 1)[0], is_core=cfg.is_core,
                                  kv_capacity_tokens=cfg.kv_capacity_tokens, num_accelerators=cfg.num_accelerators,
                                  engine_address=cfg.engine_address,
                                  hosts_replica=bool(cfg.train_command) and not cfg.is_core)
        log.info("cell registered", cell_id=cfg.cell_id, address=self.address, role=self.daemon.role.value)

    def _load(self) -> tuple[int, int, int, int]:
        """(inflight, kv_used, kv_capacity, weight_version) of the cell's engine, or idle values."""
        if self.cfg.engine_address and self.daemon.role is CellRole.ROLLOUT:
            from services.rollout.client import EngineClient

            engine = EngineClient(self.cfg.engine_address, timeout_s=5.0)
            try:
                load = engine.get_load()
                return load.active, load.kv_tokens, load.capacity_tokens, load.weight_version
            finally:
                engine.close()
        return 0, 0, self.cfg.kv_capacity_tokens, 0

    def _run(self) -> None:
        registered = False
        while not self._stop.is_set():
            try:
                if not registered:
                    self._register()
                    registered = True
                inflight, kv_used, kv_cap, version = self._load()
                self.client.cell_heartbeat(self.cfg.cell_id, role=self.daemon.role, inflight=inflight,
                                           kv_used_tokens=kv_used, kv_capacity_tokens=kv_cap, weight_version=version)
            except NotFound:
                registered = False  # the scheduler's Redis forgot us: register again
                continue
            except GyreError as exc:  # deliberate: retry on the next beat
                log.warning("heartbeat failed", cell_id=self.cfg.cell_id, error=str(exc))
            self._stop.wait(self.cfg.heartbeat_interval_s)


def build_daemon(cfg: CellDaemonConfig) -> Built:
    daemon = CellDaemon(cell_id=cfg.cell_id, role=CellRole(cfg.role),
                       commands={CellRole.ROLLOUT: cfg.rollout_command, CellRole.TRAIN: cfg.train_command},
                       stop_grace_s=cfg.stop_grace_s, switch_delay_s=cfg.switch_delay_s).start()
    servicer = CellDaemonServicer(daemon)
    server = build_server("cell-daemon", [(scheduler_pb2_grpc.add_CellDaemonServicer_to_server, servicer)],
                          service_names=DAEMON_SERVICE_NAMES, host=cfg.host, port=cfg.port,
                          max_message_mb=cfg.max_message_mb, max_workers=cfg.max_workers)
    host = advertised_host(cfg.host, cfg.advertise_host, towards=cfg.scheduler_address)  # who dials us
    reporter = Reporter(cfg, daemon, f"{host}:{server.port}").start()

    def on_shutdown() -> None:
        reporter.stop()
        daemon.stop()

    return server, on_shutdown


def main(argv: Sequence[str] | None = None) -> int:
    return run_service("cell-daemon", CellDaemonConfig, build_daemon, argv)


if __name__ == "__main__":
    raise SystemExit(main())
