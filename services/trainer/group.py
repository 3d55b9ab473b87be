"""A sharded trainer group: N ranks that shard the policy's parameters, gradients and AdamW state.

Rank 0 is the core (``CoreTrainer``, in the trainer service); it starts ranks 1..N-1 as processes
(``python -m services.trainer.group``) and drives every operation. FSDP issues collectives in every
forward and backward (a unit's parameters gathered, its gradients reduce-scattered), so the ranks
run the same sequence of forwards and backwards, in lockstep::

    rank 0 (core)                                        rank r = 1..N-1
    spawn ranks, job spec in the store ───────────────>  build the model's shapes (meta device)
    build the model; wait for every "ready/<r>"    <───  ready/<r>
    init_process_group (gloo; cpu:gloo,cuda:nccl) ─────  init_process_group; shard (fully_shard)
    shard; send each tensor ──────────────────────────>  keep its shard of it (one whole tensor at a time)
    then for each operation, broadcast it ────────────>  run it (the same collectives)
      begin(step, version)    zero the gradient shards and statistics
      round(forwards)         one micro-batch per rank, scattered (None: padding); every rank runs
                              ``forwards`` forward pieces per pass, its own and one-token padding
      finish(step)            statistics all-reduced (SUM; extrema MAX); clip + AdamW on each shard
      gather                  the full state dict a tensor at a time; rank 0 keeps it (publishing)
      save(path) / load(path) a DCP checkpoint, every rank its shards (load: any world size saved it)
      stop                    the ranks exit

Rank 0 validates, journals and acknowledges each micro-batch before it is scattered (the queue's
consumer is the group). A rank that dies fails the running operation on every other rank (gloo
reports the closed peer) and so the job, loudly; never a hang past ``collective_timeout_s``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.common.logging import get_logger
from services.trainer.batch import PackedBatchLike
from services.trainer.job import TrainerJob

log = get_logger(__name__)
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Op:
    """One operation every rank runs (broadcast by rank 0)."""

    kind: str
    step: int = -1
    version: int = 0
    forwards: int = 0  # round: forward pieces per pass
    path: str = ""     # save / load: the checkpoint's DCP folder / directory


def peak_rss_mib() -> float:
    """This process's peak resident set, MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def rank_device(job: TrainerJob, rank: int) -> torch.device:
    """A rank's device: CUDA ranks take one device each (``cuda:<first + rank>``), CPU ranks the CPU."""
    device = torch.device(job.device)
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def backend_of(device: torch.device) -> str:
    # objects (operations, micro-batches, statistics) travel over gloo on every device type
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def check_group(job: TrainerJob) -> None:
    """Refuse a group this host cannot hold (one sentence), before anything starts."""
    if job.shards <= 1:
        return
    device = torch.device(job.device)
    if device.type == "cuda":
        first = device.index or 0
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if first + job.shards > have:
            raise ValueError(f"a group of {job.shards} ranks from {job.device} needs {first + job.shards} CUDA "
                             f"devices; this host has {have}")
    elif device.type != "cpu":
        raise ValueError(f"sharded trainer groups run on 'cpu' or 'cuda', not {job.device!r}")


class GroupRank:
    """What every rank runs, rank 0 included: the learner on its shard and the operations.

    Lifecycle: GroupRank(job, rank) (builds the whole model, seeded) -> shard() (after the process
    group exists: FSDP units, the optimizer on the shards) -> run(op, batch) ... -> stop."""

    def __init__(self, job: TrainerJob, rank: int) -> None:
        from services.trainer.build import build_learner  # late: torch's model code

        self.job = job
        self.rank = rank
        self.device = rank_device(job, rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        torch.manual_seed(job.seed)
        # rank 0 builds (or reads) the whole model; the others its shapes, and get their shards from it
        self.learner = build_learner(job, self.device, meta=rank > 0)
        self.updater: Any = None

    def shard(self) -> None:
        from services.trainer.learner import Updater
        from services.trainer.sharding import send_from_rank0, shard_model

        model = self.learner.model
        full = dict(model.state_dict()) if self.rank == 0 else None
        shard_model(model, device=self.device, bf16=self.job.dtype == "bfloat16")
        send_from_rank0(model, full, device=self.device)
        del full  # rank 0's whole tensors: its shards are copies
        self.updater = Updater(model, self.job.optim)

    def forwards_of(self, batch: PackedBatchLike) -> int:
        return self.learner.policy.forwards_of(len(batch.input_ids), tuple(int(x) for x in batch.piece_starts))

    def run(self, op: Op, batch: PackedBatchLike | None = None) -> Any:
        import torch.distributed as dist

        if op.kind == "begin":
            self.learner.begin_step(op.step, op.version)
            return None
        if op.kind == "round":
            return self.learner.train_in_round(batch, op.forwards)
        if op.kind == "finish":
            stats = self.learner.stats
            vec, ext = stats.vector(), stats.extrema()
            dist.all_reduce(vec, op=dist.ReduceOp.SUM)
            dist.all_reduce(ext, op=dist.ReduceOp.MAX)
            stats.load_vector(vec)
            stats.load_extrema(ext)
            rss = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
            dist.all_gather(rss, torch.tensor([peak_rss_mib()], dtype=torch.float64))
            norm = self.updater.apply(op.step)
            return norm, [float(x) for x in torch.cat(rss)]
        if op.kind == "gather":
            from services.trainer.sharding import gather_state

            return gather_state(self.learner.model, keep=self.rank == 0)
        if op.kind in ("save", "load"):
            from services.trainer import checkpoint as ckpt

            if op.kind == "save":
                ckpt.save_state(Path(op.path), self.learner.model, self.updater.optimizer, distributed=True)
            else:
                ckpt.load_into(op.path, self.learner.model, self.updater.optimizer, distributed=True)
            return None
        raise ValueError(f"unknown group operation {op.kind!r}")


def _broadcast(obj: Any) -> Any:
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0, device=torch.device("cpu"))
    return box[0]


def _scatter(batches: Sequence[PackedBatchLike | None] | None) -> PackedBatchLike | None:
    import torch.distributed as dist

    out: list[Any] = [None]
    dist.scatter_object_list(out, list(batches) if batches is not None else None, src=0)
    return out[0]  # type: ignore[no-any-return]


class ShardGroup:
    """Rank 0's side of a group: starts ranks 1..N-1, builds the process group, drives operations.

    Lifecycle: ShardGroup(job, ...) -> start(rank0) (spawns, waits for every rank, shards) ->
    begin / train / finish / gather per step -> close() (stops the ranks, or kills them after a
    failure, and destroys the process group)."""

    def __init__(self, job: TrainerJob, *, store: Any, store_host: str, store_port: int, log_dir: str,
                 timeout_s: float) -> None:
        self.job = job
        self.world = job.shards
        self.store = store
        self.store_host, self.store_port = store_host, store_port
        self.prefix = f"gyre/group/{job.job_id}/{os.getpid()}-{time.monotonic_ns()}/"
        self.log_dir = Path(log_dir)
        self.timeout_s = timeout_s
        self.procs: list[subprocess.Popen[bytes]] = []
        self.rank0: GroupRank | None = None
        self.peak_rss_mib: list[float] = []
        self._formed = False

    # -- start / stop -----------------------------------------------------------------------------
    def start(self, rank0: GroupRank) -> None:
        import torch.distributed as dist

        from services.trainer import wire

        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a process group (one sharded job at a time)")
        store = dist.PrefixStore(self.prefix, self.store)
        store.set("job", wire.job_to_proto(self.job).SerializeToString())
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for rank in range(1, self.world):
            cmd = [sys.executable, "-m", "services.trainer.group", "--store", f"{self.store_host}:{self.store_port}",
                   "--prefix", self.prefix, "--rank", str(rank), "--world-size", str(self.world)]
            with open(self._log(rank), "ab") as out:
                # the core's working directory: relative paths of the job (model cache) mean the same
                env = {**os.environ, "OMP_NUM_THREADS": str(self._threads()),
                       "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH", "")]))}
                self.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env))
        deadline = time.monotonic() + self.timeout_s
        for rank, proc in enumerate(self.procs, start=1):
            while not store.check([f"ready/{rank}"]):
                if proc.poll() is not None:
                    why = self._last_error(rank)
                    raise RuntimeError(f"trainer rank {rank} exited with code {proc.returncode} before joining the "
                                       f"group{f' ({why})' if why else ''}; its log: {self._log(rank)}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"trainer rank {rank} did not join the group within {self.timeout_s:.0f}s")
                time.sleep(0.05)
        torch.set_num_threads(self._threads())
        dist.init_process_group(backend_of(rank0.device), store=store, rank=0, world_size=self.world,
                                timeout=datetime.timedelta(seconds=self.timeout_s))
        self._formed = True
        rank0.shard()
        self.rank0 = rank0
        log.info("trainer group formed", job_id=self.job.job_id, ranks=self.world,
                 pids=[os.getpid()] + [p.pid for p in self.procs])

    def _threads(self) -> int:
        return max(1, (os.cpu_count() or 1) // self.world)

    def ranks(self) -> list[dict[str, Any]]:
        """Each rank's pid, last measured peak RSS and whether its process runs (rank 0: this one)."""
        pids = [os.getpid()] + [p.pid for p in self.procs]
        alive = [True] + [p.poll() is None for p in self.procs]
        rss = self.peak_rss_mib or [0.0] * self.world
        return [{"rank": r, "pid": pids[r], "peak_rss_mib": rss[r], "alive": alive[r]} for r in range(len(pids))]

    def ended_ranks(self, wait_s: float = 5.0) -> str:
        """The ranks whose processes ended, one clause each ('' if none did): why a step of the group
        failed. A rank whose peer connection broke may still be exiting: give it ``wait_s``."""
        ended = []
        for rank, proc in enumerate(self.procs, start=1):
            try:
                code = proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
            how = f"died (signal {-code})" if code < 0 else f"exited with code {code}"
            why = self._last_error(rank) if code > 0 else ""
            ended.append(f"trainer rank {rank} (pid {proc.pid}) {how}{f' ({why})' if why else ''}")
        return "; ".join(ended)

    def _log(self, rank: int) -> Path:
        return self.log_dir / f"trainer-{self.job.job_id}-rank{rank}.log"

    def _last_error(self, rank: int) -> str:
        """The last line of the last exception in a rank's log (its JSON lines), if any."""
        import json

        try:
            lines = self._log(rank).read_text(errors="replace").splitlines()
        except OSError:
            return ""
        for line in reversed(lines):
            start = line.find("{")
            if '"exception"' not in line or start < 0:
                continue
            try:
                trace = str(json.loads(line[start:]).get("exception", ""))
            except ValueError:
                continue
            return trace.strip().splitlines()[-1] if trace.strip() else ""
        return ""

    def close(self, *, clean: bool) -> None:
        """Stop the ranks (``clean``: they are waiting for an operation) or kill them (after a failure
        they may sit in a collective), then leave the process group."""
        import torch.distributed as dist

        if self._formed and clean:
            try:
                _broadcast(Op("stop"))
            except Exception as exc:  # deliberate: the ranks are killed below
                log.warning("stopping the trainer group failed", job_id=self.job.job_id, error=str(exc))
                clean = False
        for proc in self.procs:
            if not clean and proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._formed:
            dist.destroy_process_group()
            self._formed = False

    # -- operations -------------------------------------------------------------------------------
    def _run(self, op: Op, batches: Sequence[PackedBatchLike | None] | None = None) -> Any:
        assert self.rank0 is not None
        _broadcast(op)
        mine = _scatter(batches) if op.kind == "round" else None
        return self.rank0.run(op, mine)

    def begin(self, step: int, version: int) -> None:
        self._run(Op("begin", step=step, version=version))

    def train(self, batches: Sequence[PackedBatchLike]) -> None:
        """Train up to N micro-batches (already acknowledged), one per rank, in one round."""
        assert self.rank0 is not None and 0 < len(batches) <= self.world
        forwards = max(self.rank0.forwards_of(b) for b in batches)
        padded: list[PackedBatchLike | None] = [*batches, *([None] * (self.world - len(batches)))]
        self._run(Op("round", forwards=forwards), padded)

    def finish(self, step: int) -> float:
        """Reduce the step's statistics over the ranks and apply the update; the gradient norm."""
        norm, rss = self._run(Op("finish", step=step))
        self.peak_rss_mib = rss
        return float(norm)

    def gather(self) -> dict[str, torch.Tensor]:
        return self._run(Op("gather"))  # type: ignore[no-any-return]

    def save(self, path: Path) -> None:
        """Every rank writes its shards of the model and optimizer into the DCP folder ``path``."""
        self._run(Op("save", path=str(path)))

    def load(self, checkpoint: Path) -> None:
        """Every rank loads its shards from the checkpoint directory (saved at any world size)."""
        self._run(Op("load", path=str(checkpoint)))


def rank_main(argv: Sequence[str] | None = None) -> int:
    """A rank r > 0 of a group: join, then run what rank 0 broadcasts until it says stop."""
    import torch.distributed as dist

    from protos.gyre.v1 import trainer_pb2
    from services.common.logging import setup_logging
    from services.trainer import wire

    p = argparse.ArgumentParser(prog="python -m services.trainer.group", description=rank_main.__doc__)
    p.add_argument("--store", required=True, help="host:port of the core's TCPStore")
    p.add_argument("--prefix", required=True, help="the group's key prefix in the store")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--timeout-s", type=float, default=600.0)
    args = p.parse_args(argv)
    setup_logging(json=True, service=f"trainer-rank{args.rank}")
    host, _, port = args.store.rpartition(":")
    timeout = datetime.timedelta(seconds=args.timeout_s)
    store = dist.PrefixStore(args.prefix, dist.TCPStore(host, int(port), is_master=False, timeout=timeout))
    spec = trainer_pb2.TrainerJobSpec()
    spec.ParseFromString(store.get("job"))
    job = wire.job_from_proto(spec)
    rank = GroupRank(job, args.rank)
    store.set(f"ready/{args.rank}", "1")
    dist.init_process_group(backend_of(rank.device), store=store, rank=args.rank, world_size=args.world_size,
                            timeout=timeout)
    rank.shard()
    log.info("joined the trainer group", job_id=job.job_id, rank=args.rank, world=args.world_size)
    while (op := _broadcast(None)).kind != "stop":
        rank.run(op, _scatter(None) if op.kind == "round" else None)
    dist.destroy_process_group()
    log.info("left the trainer group", job_id=job.job_id, rank=args.rank, peak_rss_mib=round(peak_rss_mib(), 1))
    return 0


if __name__ == "__main__":
    sys.exit(rank_main())
