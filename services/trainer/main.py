"""Entry point ``gyre-trainer``: the core trainer (serves ``Trainer``) or, with --replica, a replica.

    python -m services.trainer.main --port 50071 --trajectory-address 127.0.0.1:50051
    python -m services.trainer.main --replica --core 127.0.0.1:50071 --cell-id cell-3

Heavy imports (torch, transformers) happen inside the build functions, so ``--help`` is fast.
"""

from __future__ import annotations

import json
import math
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from protos.gyre.v1 import trainer_pb2, trainer_pb2_grpc
from services.common import security
from services.common.config import load_config
from services.common.entry import Built, run_service
from services.common.logging import get_logger, setup_logging
from services.common.server import build_server
from services.trainer.config import TrainerConfig

TRAINER_SERVICE = trainer_pb2.DESCRIPTOR.services_by_name["Trainer"].full_name


def build_trainer(cfg: TrainerConfig) -> Built:
    from services.trainer.core import CoreTrainer
    from services.trainer.servicer import TrainerServicer
    from services.trainer.spawn import ReplicaProcesses

    from services.common.server import advertised_host

    # replicas on other hosts dial the store and this server: a wildcard bind advertises the
    # interface towards the trajectory service (the deployment's network) unless told otherwise
    advertise = advertised_host(cfg.store_host, cfg.advertise_host,
                                towards=cfg.trajectory_address or cfg.redis_url)
    core = CoreTrainer(store_host=cfg.store_host, store_port=cfg.store_port, advertise_host=advertise,
                       member_timeout_s=cfg.member_timeout_s, replica_silence_s=cfg.replica_silence_s,
                       collective_timeout_s=cfg.collective_timeout_s,
                       publish_chunk_bytes=cfg.publish_chunk_mb << 20, rank_log_dir=cfg.replica_log_dir,
                       reporter=scheduler_reporter())
    from services.trainer.handoff import SharedHandoff

    handoff = SharedHandoff.open() if cfg.shared_handoff else None
    servicer = TrainerServicer(core, default_trajectory_address=cfg.trajectory_address,
                               chunk_bytes=cfg.publish_chunk_mb << 20,
                               activation_checkpointing=cfg.activation_checkpointing, attention=cfg.attention,
                               handoff=handoff)
    server = build_server("trainer", [(trainer_pb2_grpc.add_TrainerServicer_to_server, servicer)],
                          service_names=[TRAINER_SERVICE], host=cfg.host, port=cfg.port,
                          max_message_mb=cfg.max_message_mb, max_workers=cfg.max_workers)
    replicas = ReplicaProcesses(f"{advertised_host(cfg.host, cfg.advertise_host, towards=cfg.trajectory_address)}"
                                f":{server.port}", log_dir=cfg.replica_log_dir, warm=cfg.warm_replicas)
    servicer.replicas = replicas

    def on_shutdown() -> None:
        core.stop()
        replicas.stop_all()
        if handoff is not None:
            handoff.close()

    return server, on_shutdown


def scheduler_reporter() -> Callable[..., None]:
    """ReportTraining(started / published, with what a published update measured) to the job's
    scheduler, one client per address."""
    from services.scheduler.client import SchedulerClient

    clients: dict[str, SchedulerClient] = {}

    def report(job: Any, step: int, phase: str, version: int, measured: Mapping[str, float] | None = None,
               metrics: Mapping[str, float] | None = None) -> None:
        if not job.scheduler_address:
            return
        client = clients.get(job.scheduler_address)
        if client is None:
            client = clients[job.scheduler_address] = SchedulerClient(job.scheduler_address)
        m = measured or {}
        figures = {k: float(v) for k, v in (metrics or {}).items() if math.isfinite(v)}  # the event log's
        client.report_training(job.job_id, step, phase, version, trained_tokens=float(m.get("tokens", 0.0)),
                               compute_s=float(m.get("compute_s", 0.0)), world_size=int(m.get("world_size", 0)),
                               metrics=figures)

    return report


def run_replica(cfg: TrainerConfig) -> int:
    import torch

    setup_logging(json=cfg.log_json, level=cfg.log_level, service="trainer-replica")
    if cfg.replica_threads:
        torch.set_num_threads(cfg.replica_threads)
    if cfg.replica_warm:
        return _run_pooled(cfg)
    stop = threading.Event()
    from services.trainer.replica import Replica, default_replica_id

    with _core_client(cfg) as core:
        replica = Replica(core, replica_id=cfg.replica_id or default_replica_id(cfg.cell_id), cell_id=cfg.cell_id,
                          device=cfg.replica_device, max_steps=cfg.replica_max_steps, stop_event=stop,
                          rank_log_dir=cfg.replica_log_dir)
        # SIGTERM = give the cell back now: the running forward stops at its next layer (hand-off).
        signal.signal(signal.SIGTERM, lambda *_: replica.interrupt())
        signal.signal(signal.SIGINT, lambda *_: replica.interrupt())
        replica.run()
    return 0


def _core_client(cfg: TrainerConfig) -> Any:  # the client, imported lazily (torch)
    from services.trainer.client import TrainerClient

    return TrainerClient(cfg.core, max_message_mb=cfg.max_message_mb)


class ReleaseLatch:
    """Releases of a pool process's cells, by replica id (``{"release": id}`` lines on stdin, in
    order after the line that handed the cell over). A release may come before this process has
    made that replica (the core gives a cell back right after handing it over): it is held and
    applied the moment the replica starts, instead of being lost (the replica would then train a
    cell the policy had given back, and the switch would wait for it). A release of a replica
    that already ended is dropped (ids are unique per switch)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._replica: Any = None
        self._held: set[str] = set()

    def release(self, replica_id: str) -> None:
        with self._lock:
            if self._replica is not None and self._replica.replica_id == replica_id:
                self._replica.interrupt()
            else:
                self._held.add(replica_id)

    def started(self, replica: Any) -> None:
        with self._lock:
            self._replica = replica
            held, self._held = replica.replica_id in self._held, set()
        if held:
            replica.interrupt()

    def ended(self) -> None:
        with self._lock:
            self._replica = None


def _read_cells(stdin: Any, cells: "queue.Queue[dict | None]", release: ReleaseLatch) -> None:
    """A pool process's stdin: cells handed over go to ``cells``, releases to ``release``; None
    once it closes (the core retires this process) or a line does not parse.

    Everything the core has written so far is read before any cell of it is handed on, and the
    releases in it are latched first: a cell given back right after it was handed over (both lines
    in the pipe when this process reads) is released before its replica starts, so it never joins
    the step. Handing the cell on line by line raced the main thread (it could take the cell and
    join before this thread parsed the next line)."""
    import select

    fd = stdin.fileno()
    buf = b""
    ended = False
    while not ended:
        chunk = os.read(fd, 65536)
        ended = not chunk
        buf += chunk
        while not ended and select.select([fd], [], [], 0)[0]:  # the rest already written
            more = os.read(fd, 65536)
            ended = not more
            buf += more
        *lines, buf = buf.split(b"\n")
        if ended and buf.strip():
            lines.append(buf)
        handed: list[dict] = []
        for line in lines:
            if not line.strip():
                continue
            try:
                msg = json.loads(line)
                if "release" in msg:
                    release.release(str(msg["release"]))
                    continue
                handed.append({"cell_id": str(msg["cell_id"]), "replica_id": str(msg["replica_id"])})
            except (ValueError, KeyError, TypeError) as exc:
                print(f"gyre-trainer: a warm replica needs {{\"cell_id\", \"replica_id\"}} or {{\"release\"}} on "
                      f"stdin: {exc}", file=sys.stderr)
                ended = True
                break
        for cell in handed:
            cells.put(cell)
    cells.put(None)


def _run_pooled(cfg: TrainerConfig) -> int:
    """A pool process (see services/trainer/spawn.py): warm up, tell the core "ready" on the status
    pipe, then run one replica per cell handed over on stdin, telling "free" after each, until
    stdin ends. ``{"release": replica_id}`` on stdin: that replica leaves now (its cell is given
    back; ``ReleaseLatch``); SIGTERM: the current one leaves, then exit (at once when no cell is
    being trained)."""
    from services.trainer.replica import Replica

    slog = get_logger("services.trainer.main")
    warmed = _warm_up()
    status = open(cfg.replica_status_fd, "w", buffering=1, closefd=True) if cfg.replica_status_fd >= 0 else None

    def tell(what: str) -> None:
        if status is not None:
            status.write(what + "\n")

    current: list[Replica] = []
    exiting = threading.Event()
    release = ReleaseLatch()

    def on_term(*_: Any) -> None:
        exiting.set()
        if not current:
            # waiting for a cell, nothing to hand over: gone now (an exception raised here could
            # land in the interpreter's exit handlers when the signal comes twice)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        current[0].interrupt()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    handed: queue.Queue[dict | None] = queue.Queue()
    threading.Thread(target=_read_cells, args=(sys.stdin, handed, release), name="pool-stdin", daemon=True).start()
    tell("ready")
    kept: Any = None  # the previous replica's model, reused when the next cell trains the same job
    cells = 0
    while not exiting.is_set():
        task = handed.get()  # the core hands this process a cell, or closes the pipe
        if task is None:
            return 0
        cell_id, replica_id = task["cell_id"], task["replica_id"]
        cells += 1
        slog.info("warm replica assigned", cell_id=cell_id, replica_id=replica_id, warm_up_s=round(warmed, 3),
                  cells=cells)
        with _core_client(cfg) as core:
            replica = Replica(core, replica_id=replica_id, cell_id=cell_id, device=cfg.replica_device,
                              max_steps=cfg.replica_max_steps, stop_event=threading.Event(), reuse=kept,
                              rank_log_dir=cfg.replica_log_dir)
            current.append(replica)
            release.started(replica)
            if exiting.is_set():
                replica.interrupt()
            try:
                replica.run()
            finally:
                release.ended()
                current.clear()
        kept = replica.reusable()
        if exiting.is_set():
            return 0
        tell("free")
    return 0


def _warm_up() -> float:
    """What a replica pays before it can train, done ahead: the imports, and a throwaway model's
    forward and backward (kernels, the autograd engine, the tree attention registered)."""
    import torch

    from services.trainer.model import build_model

    t0 = time.perf_counter()
    model = build_model("tiny:layers=1,hidden=64,heads=2,kv_heads=1,intermediate=128,vocab=256")
    ids = torch.randint(0, 256, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    return time.perf_counter() - t0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--replica" in args and not ("-h" in args or "--help" in args):
        path = None
        if "--config" in args:
            i = args.index("--config")
            path, args = args[i + 1], args[:i] + args[i + 2:]
        try:
            cfg = load_config(TrainerConfig, path=path, section="trainer", env_prefix="GYRE_TRAINER_", argv=args)
            security.configure(security.security_from(cfg))
        except (ValueError, OSError) as exc:
            print(f"gyre-trainer: {exc}", file=sys.stderr)
            return 2
        return run_replica(cfg)
    return run_service("trainer", TrainerConfig, build_trainer, args)


if __name__ == "__main__":
    sys.exit(main())
