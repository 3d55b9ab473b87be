"""``gyre-scheduler``: the scheduler process (job, harness and cell APIs + orchestration loop).

    python -m services.scheduler.main --config deploy/config/local.toml --redis-url redis://... \
        --gateway-address 127.0.0.1:50051 --trainer-address 127.0.0.1:50061

Everything it knows lives in Redis, so it can be killed and restarted at any time: the API is
stateless and the orchestrator resumes (or rolls back) switches that were in flight.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.common.entry import Built, run_service
from services.common.logging import get_logger
from services.common.redis_store import connect
from services.common.server import build_server
from services.scheduler.config import SchedulerConfig

log = get_logger("services.scheduler")


def build_scheduler(cfg: SchedulerConfig) -> Built:
    from services.scheduler.actuators import DaemonActuator, ServicesActuator
    from services.scheduler.api import SchedulerApi
    from services.scheduler.orchestrator import Orchestrator
    from services.scheduler.servicer import SERVICE_NAMES, registrations
    from services.scheduler.state import SchedulerState

    state = SchedulerState(connect(cfg.redis_url), event_maxlen=cfg.event_maxlen,
                           retention_s=cfg.execution_retention_s)
    api = SchedulerApi(state, lease_ttl_s=cfg.lease_ttl_s, cell_dead_after_s=cfg.cell_dead_after_s)
    server = build_server("scheduler", registrations(api), service_names=SERVICE_NAMES, host=cfg.host,
                          port=cfg.port, max_message_mb=cfg.max_message_mb, max_workers=cfg.max_workers)
    if not cfg.orchestrate:
        return server, None
    actuator: DaemonActuator | ServicesActuator
    if cfg.actuator == "daemon":
        actuator = DaemonActuator(gateway_address=cfg.gateway_address, timeout_s=cfg.actuator_timeout_s)
    else:
        actuator = ServicesActuator(gateway_address=cfg.gateway_address, trainer_address=cfg.trainer_address,
                                    timeout_s=cfg.actuator_timeout_s)
    reward = None
    timeout_scorer = None
    if cfg.reward_address:
        from services.common.errors import Unavailable
        from services.reward.client import RewardClient

        reward = RewardClient(cfg.reward_address, timeout_s=cfg.actuator_timeout_s)

        def timeout_scorer(*, job_id: str, execution_id: str, step: int, group_id: str, timeout_policy: str) -> None:
            assert reward is not None
            result = reward.score(job_id, execution_id, "timeout", timeout_policy=timeout_policy,
                                  group_id=group_id, step=step)
            if not result.outcome_reported:  # the next Score of it re-sends the outcome
                raise Unavailable(f"execution {execution_id!r} scored but its outcome did not reach trajectory yet")
    # host:port is stable across restarts and unique among live instances (the port is bound, no
    # SO_REUSEPORT): a restarted scheduler takes its own leadership back at once instead of
    # waiting out the lock's TTL
    instance_id = cfg.instance_id or f"{socket.gethostname()}:{server.port}"
    controller, clients = _job_controller(cfg, state, reward, server.port, instance_id)
    usage_client = None
    usage = None
    if cfg.gateway_address:
        import dataclasses

        from services.rollout.client import GatewayClient

        usage_client = GatewayClient(cfg.gateway_address, timeout_s=5.0)

        def usage(job_id: str) -> dict | None:
            assert usage_client is not None
            u = usage_client.job_usage([job_id], timeout_s=2.0).get(job_id)
            return dataclasses.asdict(u) if u is not None else None
    orchestrator = Orchestrator(
        state, actuator, instance_id=instance_id,
        tick_interval_s=cfg.tick_interval_s, leader_ttl_s=cfg.leader_ttl_s, cell_dead_after_s=cfg.cell_dead_after_s,
        switch_timeout_s=cfg.switch_timeout_s, restore_timeout_s=cfg.restore_timeout_s,
        switch_workers=cfg.switch_workers,
        metrics_event_interval_s=cfg.metrics_event_interval_s, lease_ttl_s=cfg.lease_ttl_s,
        timeout_scorer=timeout_scorer, controller=controller, usage=usage).start()
    api.before_last_publish = orchestrator.last_metrics_event
    if controller is not None:
        controller.start()
    log.info("orchestrator started", actuator=cfg.actuator, instance_id=orchestrator.instance_id,
             job_controller=controller is not None)

    def on_shutdown() -> None:
        if controller is not None:
            controller.stop(cfg.grace_s)
        orchestrator.stop(cfg.grace_s)
        actuator.close()
        if usage_client is not None:
            usage_client.close()
        for c in clients:
            c.close()
        if reward is not None:
            reward.close()

    return server, on_shutdown


def _job_controller(cfg: SchedulerConfig, state: Any, reward: Any, port: int,
                    instance_id: str) -> tuple[Any, list[Any]]:
    """The job controller when the scheduler knows the trainer, trajectory and reward services."""
    if not (cfg.job_controller and cfg.trainer_address and cfg.trajectory_address and reward is not None):
        return None, []
    from services.scheduler.controller import JobController
    from services.trainer.client import TrainerClient
    from services.trajectory.client import TrajectoryClient

    trainer = TrainerClient(cfg.trainer_address, timeout_s=cfg.actuator_timeout_s)
    trajectory = TrajectoryClient(cfg.trajectory_address)
    from services.common.server import advertised_host

    # the trainer reports progress here: a wildcard bind advertises the interface towards it
    advertise = cfg.advertise_address or f"{advertised_host(cfg.host, towards=cfg.trainer_address)}:{port}"
    root = cfg.checkpoint_dir or str(Path(cfg.spool_dir).resolve() / "checkpoints")
    controller = JobController(state, trainer=trainer, trajectory=trajectory, reward=reward,
                               trajectory_address=cfg.trajectory_address, scheduler_address=advertise, checkpoint_root=root,
                               is_leader=lambda: state.leader() == instance_id, tick_interval_s=cfg.tick_interval_s)
    return controller, [trainer, trajectory]


def main(argv: Sequence[str] | None = None) -> int:
    return run_service("scheduler", SchedulerConfig, build_scheduler, argv)


if __name__ == "__main__":
    raise SystemExit(main())
