"""Configuration of the scheduler process (``[scheduler]`` in deploy/config/*.toml)."""

from __future__ import annotations

import dataclasses

from services.common.config import ServerConfig, check, setting

ACTUATORS = ("services", "daemon")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SchedulerConfig(ServerConfig):
    """The scheduler: job/cell/lease API plus the orchestration loop that drives role switches."""

    gateway_address: str = setting("", "Rollout gateway (DrainEngine/RegisterEngine) for the 'services' actuator.")
    trainer_address: str = setting("", "Trainer (replica join/leave) for the 'services' actuator.")
    reward_address: str = setting(
        "", "Reward service: scores executions whose last lease expired (as timeouts, under the job's policy).")
    trajectory_address: str = setting(
        "", "Trajectory service: the job controller opens each job's steps there (with trainer_address and "
            "reward_address set, the scheduler drives every job's lifecycle).")
    advertise_address: str = setting(
        "", "host:port other services reach this scheduler at (the trainer reports progress there); empty: "
            "host:port of this server.")
    checkpoint_dir: str = setting(
        "", "Root of the trainer's per-job checkpoint directories (must be visible to the trainer host); empty: "
            "<spool_dir>/checkpoints.")
    job_controller: bool = setting(
        True, "Drive every job's lifecycle (reward, trainer, trajectory steps, evaluations) when the three "
              "service addresses are set; false: the client does it.")
    actuator: str = setting(
        "services",
        "How role switches are carried out: 'services' (gateway + trainer RPCs) or 'daemon' (each cell's "
        "CellDaemon at its registered address).")
    orchestrate: bool = setting(True, "Run the orchestration loop (false: API-only replica).")
    instance_id: str = setting("", "Name of this scheduler for leadership; empty: host:port (stable across restarts, "
                                   "so a restarted instance leads again at once). Never share one between two live "
                                   "instances.")
    tick_interval_s: float = setting(0.5, "Seconds between orchestration ticks (decide, reap, enqueue).")
    leader_ttl_s: float = setting(10.0, "Orchestrator leadership lease; a dead leader is replaced after it.")
    lease_ttl_s: float = setting(60.0, "An execution lease expires this long after its last heartbeat.")
    cell_dead_after_s: float = setting(30.0, "A cell without a heartbeat this long is left out of decisions.")
    switch_timeout_s: float = setting(600.0, "A role switch not done after this long is rolled back.")
    restore_timeout_s: float = setting(120.0, "A failed switch's rollback that finds a service unreachable "
                                       "(restarting) is tried again this long, the cell SWITCHING meanwhile.")
    switch_workers: int = setting(8, "Role switches carried out concurrently.")
    metrics_event_interval_s: float = setting(5.0, "Seconds between 'metrics' events in each job's log.")
    event_maxlen: int = setting(100_000, "Events kept per job stream (older ones are trimmed).")
    execution_retention_s: float = setting(86_400.0, "Ended executions stay queryable this long.")
    actuator_timeout_s: float = setting(600.0, "Deadline of one actuator RPC (drain, join, set role), seconds.")

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.actuator in ACTUATORS, "actuator", self.actuator, "'services' or 'daemon'")
        check(self.tick_interval_s > 0, "tick_interval_s", self.tick_interval_s, "a positive number of seconds")
        check(self.leader_ttl_s > self.tick_interval_s, "leader_ttl_s", self.leader_ttl_s,
              "more seconds than tick_interval_s")
        check(self.lease_ttl_s > 0, "lease_ttl_s", self.lease_ttl_s, "a positive number of seconds")
        check(self.cell_dead_after_s > 0, "cell_dead_after_s", self.cell_dead_after_s, "a positive number of seconds")
        check(self.switch_timeout_s > 0, "switch_timeout_s", self.switch_timeout_s, "a positive number of seconds")
        check(self.restore_timeout_s >= 0, "restore_timeout_s", self.restore_timeout_s,
              "a non-negative number of seconds")
        check(self.switch_workers >= 1, "switch_workers", self.switch_workers, "at least 1")
        check(self.metrics_event_interval_s > 0, "metrics_event_interval_s", self.metrics_event_interval_s,
              "a positive number of seconds")
        check(self.event_maxlen >= 100, "event_maxlen", self.event_maxlen, "at least 100")
        check(self.execution_retention_s >= 0, "execution_retention_s", self.execution_retention_s,
              "a non-negative number of seconds")
        check(self.actuator_timeout_s > 0, "actuator_timeout_s", self.actuator_timeout_s,
              "a positive number of seconds")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CellDaemonConfig(ServerConfig):
    """A cell's daemon: registers the cell, heartbeats its load, runs its role's process."""

    scheduler_address: str = setting("", "Scheduler to register with and heartbeat to (required).")
    cell_id: str = setting("", "Id of this cell (required).")
    role: str = setting("rollout", "Role at start: rollout, train or idle (the core cell: train).")
    is_core: bool = setting(False, "This cell holds the authoritative weights and never leaves training.")
    advertise_host: str = setting("", "Host the scheduler dials for this daemon; empty: the bind host.")
    kv_capacity_tokens: int = setting(0, "KV-cache capacity of the cell's engine, tokens (when no engine reports).")
    num_accelerators: int = setting(1, "Accelerators in this cell.")
    heartbeat_interval_s: float = setting(2.0, "Seconds between heartbeats to the scheduler.")
    engine_address: str = setting("", "The cell's rollout Engine; its GetLoad gives inflight and KV use.")
    rollout_command: str = setting("", "Command run while in ROLLOUT ({cell_id} {job_id} {step} {weight_version} "
                                       "{switch_id}).")
    train_command: str = setting("", "Command run while in TRAIN (same placeholders). Set on a rollout cell, it "
                                     "runs the trainer replica on this cell's host (the services actuator then "
                                     "only waits for it to join), e.g. 'python -m services.trainer.main --replica "
                                     "--core TRAINER:PORT --cell-id {cell_id} --replica-id {cell_id}-{switch_id}'.")
    stop_grace_s: float = setting(10.0, "SIGTERM grace of a role process before SIGKILL, seconds.")
    switch_delay_s: float = setting(0.0, "Extra seconds each switch takes (demos, crash tests).")

    def __post_init__(self) -> None:
        super().__post_init__()
        check(bool(self.scheduler_address), "scheduler_address", self.scheduler_address, "host:port of the scheduler")
        check(bool(self.cell_id), "cell_id", self.cell_id, "a cell id")
        check(self.role in ("rollout", "train", "idle"), "role", self.role, "rollout, train or idle")
        check(not self.is_core or self.role == "train", "role", self.role, "train for the core cell")
        check(self.kv_capacity_tokens >= 0, "kv_capacity_tokens", self.kv_capacity_tokens, "a count >= 0")
        check(self.num_accelerators >= 1, "num_accelerators", self.num_accelerators, "at least 1")
        check(self.heartbeat_interval_s > 0, "heartbeat_interval_s", self.heartbeat_interval_s, "a positive number")
        check(self.stop_grace_s >= 0, "stop_grace_s", self.stop_grace_s, "a non-negative number of seconds")
        check(self.switch_delay_s >= 0, "switch_delay_s", self.switch_delay_s, "a non-negative number of seconds")
