"""Configuration of the trainer process (``[trainer]`` in deploy/config/*.toml).

One binary, two modes:
  core (default)  serves ``Trainer`` gRPC, hosts the rendezvous TCPStore, owns weights/optimizer
  --replica       a data-parallel replica on a freed cell: ``gyre-trainer --replica --core ADDR
                  --cell-id X`` joins the core's running step and exits when released
"""

from __future__ import annotations

import dataclasses

from services.common.config import ServerConfig, check, setting


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainerConfig(ServerConfig):
    """The trainer core (rank 0) or, with ``replica``, one elastic data-parallel replica."""

    trajectory_address: str = setting("", "Trajectory service; the default micro-batch source of jobs.")
    store_host: str = setting("127.0.0.1", "Interface of the rendezvous TCPStore (process groups per step).")
    store_port: int = setting(0, "Port of the rendezvous TCPStore; 0 picks a free port.")
    advertise_host: str = setting("", "Host replicas use to reach this core's store; empty = store_host.")
    member_timeout_s: float = setting(300.0, "A step member that has not reported this long after the core "
                                             "finished its share is evicted from the step, seconds.")
    replica_silence_s: float = setting(20.0, "A step member (a replica, on any host) that has sent no heartbeat "
                                              "this long is gone: evicted once the core is done, and its work "
                                              "trained again; 0 = judge members only by member_timeout_s, seconds.")
    collective_timeout_s: float = setting(600.0, "Timeout of one all-reduce / process-group setup, seconds.")
    activation_checkpointing: bool = setting(False, "Jobs that do not set it themselves recompute each decoder "
                                                     "layer's activations in the backward instead of keeping them "
                                                     "(less memory per micro-batch token, ~1 more forward).")
    attention: str = setting("auto", "Tree attention of jobs that do not choose one: 'auto' (CPU: block-sparse; "
                                     "CUDA: the compiled flex kernel, dense SDPA for tiny batches), 'blocks', 'sdpa' (dense "
                                     "N x N mask) or 'flex'.")
    publish_chunk_mb: int = setting(4, "Size of one WeightChunk when streaming weights, MiB.")
    shared_handoff: bool = setting(True, "Core: replicas on this host hand a leaving replica's gradient sum over "
                                         "through a private folder in /dev/shm (written once, mapped by the core) "
                                         "instead of streaming it over gRPC; replicas elsewhere stream.")
    replica: bool = setting(False, "Run as a data-parallel replica of the core at --core (no server).")
    core: str = setting("", "Replica mode: address host:port of the core trainer.")
    cell_id: str = setting("", "Replica mode: the cell this replica runs on.")
    replica_id: str = setting("", "Replica mode: id of this replica; empty = <cell_id>-<pid>.")
    replica_device: str = setting("", "Replica mode: torch device; empty = cuda if available, else cpu.")
    replica_max_steps: int = setting(0, "Replica mode: leave after this many steps (0 = until released).")
    replica_threads: int = setting(0, "Replica mode: torch intra-op threads (0 = torch's default).")
    replica_log_dir: str = setting(".gyre/logs", "Core: directory for logs of replicas it spawns (AddReplica); "
                                                 "replica: for logs of its group's ranks (a sharded job).")
    warm_replicas: int = setting(1, "Core: replica processes started ahead (imports done, a model run once) and "
                                    "reused: AddReplica hands one a cell, which then skips ~5 s of start-up, and "
                                    "it waits for the next cell once its cell is given back (the pool grows to "
                                    "the most cells training at once); 0 = a process of its own per replica.")
    replica_warm: bool = setting(False, "Replica mode: start up, then wait for the cell and replica id as one JSON "
                                        "line on stdin, and the next one after its cell is given back, until stdin "
                                        "ends (how the core's pool of replica processes is started).")
    replica_status_fd: int = setting(-1, "Replica mode, warm: file descriptor to write 'ready' (warmed up) and "
                                         "'free' (cell given back) lines to, for the core; -1 = none.")

    def __post_init__(self) -> None:
        super().__post_init__()
        check(0 <= self.store_port < 65536, "store_port", self.store_port, "an integer in [0, 65535]")
        check(self.member_timeout_s > 0, "member_timeout_s", self.member_timeout_s, "a positive number of seconds")
        check(self.replica_silence_s == 0 or self.replica_silence_s >= 2, "replica_silence_s",
              self.replica_silence_s, "0 (off) or at least 2 seconds")
        check(self.collective_timeout_s > 0, "collective_timeout_s", self.collective_timeout_s,
              "a positive number of seconds")
        check(1 <= self.publish_chunk_mb <= 256, "publish_chunk_mb", self.publish_chunk_mb, "between 1 and 256 MiB")
        check(self.attention in ("auto", "blocks", "sdpa", "flex"), "attention", self.attention,
              "one of auto, blocks, sdpa, flex")
        check(self.replica_max_steps >= 0, "replica_max_steps", self.replica_max_steps, "0 or more")
        check(self.replica_threads >= 0, "replica_threads", self.replica_threads, "0 or more")
        check(0 <= self.warm_replicas <= 16, "warm_replicas", self.warm_replicas, "between 0 and 16")
        if self.replica:
            check(bool(self.core), "core", self.core, "the core's host:port in replica mode")
            check(bool(self.cell_id) or self.replica_warm, "cell_id", self.cell_id, "a cell id in replica mode")
