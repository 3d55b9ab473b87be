"""Entry point of the reward service (``gyre-reward``).

    python -m services.reward.main --config deploy/config/local.toml --port 50053 \\
        --redis-url redis://127.0.0.1:6379/0 --spool-dir .gyre/spool --trajectory-address 127.0.0.1:50051

Builds the core on Redis + the blob spool with a pool of sandboxed scorer workers, reporting
outcomes to the trajectory service when an address is given; serves until SIGTERM, then stops
the scorer workers.
"""

from __future__ import annotations

import threading

from collections.abc import Sequence
from pathlib import Path

from protos.gyre.v1 import reward_pb2_grpc
from services.common.blobs import BlobStore
from services.common.entry import Built, run_service
from services.common.redis_store import connect
from services.common.security import Security
from services.common.server import build_server
from services.reward.client import ExternalScorerClient
from services.reward.config import RewardConfig
from services.reward.sandbox import ScorerPool
from services.reward.service import RewardService, ScoreRecord
from services.reward.servicer import SERVICE_NAME, RewardServicer, outcome_to_proto


def build_reward(cfg: RewardConfig) -> Built:
    blobs = BlobStore(cfg.spool_dir)
    pool = ScorerPool(size=cfg.scorer_workers, sandbox=cfg.sandbox, cpu_s=int(cfg.scorer_timeout_s) + 1)
    # external scorers get their own credential, never this service's token or client certificate
    token = Path(cfg.external_scorer_token_file).read_text().strip() if cfg.external_scorer_token_file else ""
    external = ExternalScorerClient(max_message_mb=cfg.max_message_mb,
                                    security=Security(tls_ca_file=cfg.external_scorer_ca_file, auth_token=token))
    report = None
    if cfg.trajectory_address:
        from services.trajectory.client import TrajectoryClient

        trajectory = TrajectoryClient(cfg.trajectory_address, max_message_mb=cfg.max_message_mb)

        def report(record: ScoreRecord) -> None:
            trajectory.complete_execution(outcome_to_proto(record))

    core = RewardService(
        redis_client=connect(cfg.redis_url), blobs=blobs, pool=pool, limits=cfg.limits,
        default_scorer=cfg.scorer_spec, default_timeout_policy=cfg.default_timeout_policy,
        scorer_timeout_s=cfg.scorer_timeout_s, retention_s=cfg.retention_s, external_score=external,
        report_outcome=report, allowlist=cfg.allowlist,
    )
    server = build_server("reward", [(reward_pb2_grpc.add_RewardServicer_to_server, RewardServicer(core))],
                          service_names=[SERVICE_NAME], host=cfg.host, port=cfg.port,
                          max_message_mb=cfg.max_message_mb, max_workers=cfg.max_workers)

    # outcomes the trajectory service missed (down when they were scored) are delivered later
    stop_retries = threading.Event()
    threading.Thread(target=core.run_report_retries, args=(stop_retries,), name="outcome-retries",
                     daemon=True).start()

    def on_shutdown() -> None:
        stop_retries.set()
        pool.close()
        external.close()

    return server, on_shutdown


def main(argv: Sequence[str] | None = None) -> int:
    return run_service("reward", RewardConfig, build_reward, argv)


if __name__ == "__main__":
    raise SystemExit(main())
