"""Entry point of the trajectory service (``gyre-trajectory``).

    python -m services.trajectory.main --config deploy/config/local.toml --port 50051 \\
        --redis-url redis://127.0.0.1:6379/0 --spool-dir .gyre/spool

Builds the service logic (``TrajectoryApi``) on Redis + the blob spool, rebuilds its state from
Redis (a restart loses no record, batch or acknowledgement), then serves until SIGTERM. On
shutdown, open batch streams end and their unacknowledged batches stay pending for the next start.
"""

from __future__ import annotations

from collections.abc import Sequence

from protos.gyre.v1 import trajectory_pb2_grpc
from services.common.blobs import BlobStore
from services.common.entry import Built, run_service
from services.common.redis_store import connect
from services.common.server import build_server
from services.trajectory.config import TrajectoryConfig
from services.trajectory.api import TrajectoryApi
from services.trajectory.servicer import SERVICE_NAME, TrajectoryServicer
from services.trajectory.store import TrajectoryStore


def build_trajectory(cfg: TrajectoryConfig) -> Built:
    blobs = BlobStore(cfg.spool_dir)
    blobs.sweep_tmp()
    api = TrajectoryApi(cfg, TrajectoryStore(connect(cfg.redis_url), blobs))
    api.recover()
    server = build_server("trajectory", [(trajectory_pb2_grpc.add_TrajectoryServicer_to_server,
                                          TrajectoryServicer(api))],
                          service_names=[SERVICE_NAME], host=cfg.host, port=cfg.port,
                          max_message_mb=cfg.max_message_mb, max_workers=cfg.max_workers)
    return server, None


def main(argv: Sequence[str] | None = None) -> int:
    return run_service("trajectory", TrajectoryConfig, build_trajectory, argv)


if __name__ == "__main__":
    raise SystemExit(main())
