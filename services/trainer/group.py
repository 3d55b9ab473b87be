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
      publish(path)           the full state dict a tensor at a time; rank 0 writes each into a
                              safetensors file (the published version) as it comes
      save(path) / load(path) a DCP checkpoint, every rank its shards (load: any world size saved it)
      reduce(seal)            rank r of every group taking part in the step (the core group and
                              replica groups: HSDP) all-reduces its gradient shards and statistics
                              in the step's process group for shard r
      handoff                 a leaving replica group's gradient sums gathered onto its rank 0
      add_grads               rank 0's whole gradient sums (a hand-off) added to every rank's shards
      weights                 rank 0's whole weights (a version a replica group pulled) into the shards
      stop                    the ranks exit

A replica group (``role="replica"``, services.trainer.replica) is the same machinery on a freed
cell: its rank 0 is the replica process, which pulls version v, starts its ranks and joins the
core's step; it trains rounds of the same queue and carries no optimizer state.

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
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from services.common.logging import get_logger
from services.trainer.elastic import KeptGroup
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
    prefix: str = ""   # reduce: the step's store prefix; this group's rank in it, and the groups
    rank: int = 0
    world: int = 0


def peak_rss_mib() -> float:
    """This process's peak resident set, MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def rank_device(job: TrainerJob, rank: int, base: str = "") -> torch.device:
    """A rank's device: CUDA ranks take one device each (``cuda:<first + rank>`` from ``base``, the
    group's first device, by default the job's), CPU ranks the CPU."""
    device = torch.device(base or job.device)
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def backend_of(device: torch.device) -> str:
    # objects (operations, micro-batches, statistics) travel over gloo on every device type
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def check_group(job: TrainerJob, base: str = "") -> None:
    """Refuse a group this host cannot hold (one sentence), before anything starts; ``base``: the
    group's first device (a replica group's cell), by default the job's."""
    if job.shards <= 1:
        return
    where = base or job.device
    device = torch.device(where)
    if device.type == "cuda":
        first = device.index or 0
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if first + job.shards > have:
            raise ValueError(f"a group of {job.shards} ranks from {where} needs {first + job.shards} CUDA "
                             f"devices; this host has {have}")
    elif device.type != "cpu":
        raise ValueError(f"sharded trainer groups run on 'cpu' or 'cuda', not {where!r}")


class GroupRank:
    """What every rank runs, rank 0 included: the learner on its shard and the operations.

    Lifecycle: GroupRank(job, rank) (builds the whole model, seeded) -> shard() (after the process
    group exists: FSDP units, the optimizer on the shards of a core group) -> run(op, ...) ... -> stop.
    ``store``: a client of the core's TCPStore (the steps' cross-group process groups meet there)."""

    def __init__(self, job: TrainerJob, rank: int, *, base: str = "", role: str = "core") -> None:
        from services.trainer.build import build_learner  # late: torch's model code

        if role not in ("core", "replica"):
            raise ValueError(f"a group's role is 'core' or 'replica', not {role!r}")
        self.job = job
        self.rank = rank
        self.role = role
        self.store: Any = None  # set when the group forms: the core's store, its address, the timeout
        self.store_addr = ("", 0)
        self.timeout_s = 600.0
        self.kept = KeptGroup()  # the cross-group process group, kept while the step's seals name it
        self.device = rank_device(job, rank, base)
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
        if self.role == "core":  # replica groups carry no optimizer state
            self.updater = Updater(model, self.job.optim)

    def forwards_of(self, batch: PackedBatchLike) -> int:
        return self.learner.policy.forwards_of(len(batch.input_ids), tuple(int(x) for x in batch.piece_starts))

    def run(self, op: Op, batch: PackedBatchLike | None = None, payload: Any = None) -> Any:
        """Run ``op`` (every rank in step); ``payload``: rank 0's whole tensors of weights/add_grads."""
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
        if op.kind == "publish":
            from services.trainer.sharding import write_full_state

            write_full_state(self.learner.model, Path(op.path) if self.rank == 0 else None)
            return None
        if op.kind in ("save", "load"):
            from services.trainer import checkpoint as ckpt

            if op.kind == "save":
                ckpt.save_state(Path(op.path), self.learner.model, self.updater.optimizer, distributed=True)
            else:
                ckpt.load_into(op.path, self.learner.model, self.updater.optimizer, distributed=True)
            return None
        if op.kind == "reduce":
            return self._reduce(op)
        if op.kind == "handoff":
            return self._handoff()
        if op.kind in ("weights", "add_grads"):
            from services.trainer.sharding import add_full_grads, send_from_rank0

            fn = send_from_rank0 if op.kind == "weights" else add_full_grads
            fn(self.learner.model, payload if self.rank == 0 else None, device=self.device)
            return None
        raise ValueError(f"unknown group operation {op.kind!r}")


    def _reduce(self, op: Op) -> bool:
        """This rank's part of the step's all-reduce across groups: with rank ``self.rank`` of every
        other group, in the process group of shard ``self.rank`` under ``op.prefix`` (kept while the
        step's seal names the same one); True if it was built for this step."""
        from services.trainer.elastic import Seal, all_reduce_step, open_group

        assert self.store is not None, "a group rank needs the core's store to reduce across groups"
        seal = Seal(step=op.step, rank=op.rank, world_size=op.world, group_prefix=f"{op.prefix}/shard{self.rank}")
        pg, built = self.kept.get(op.prefix, lambda: open_group(
            seal, store_host=self.store_addr[0], store_port=self.store_addr[1],
            backend="nccl" if self.device.type == "cuda" else "gloo", store=self.store, timeout_s=self.timeout_s))
        stats = self.learner.stats
        vec, ext = all_reduce_step(pg, list(self.learner.grad_buckets()), stats.vector(), stats.extrema())
        stats.load_vector(vec)
        stats.load_extrema(ext)
        return built

    def _handoff(self) -> dict[str, torch.Tensor]:
        """The group's gradient sums and statistics as one whole-model hand-off (kept on rank 0)."""
        import torch.distributed as dist

        from services.trainer.learner import EXTREMA_KEY, STATS_KEY
        from services.trainer.sharding import gather_grads

        stats = self.learner.stats
        vec, ext = stats.vector(), stats.extrema()
        dist.all_reduce(vec, op=dist.ReduceOp.SUM)
        dist.all_reduce(ext, op=dist.ReduceOp.MAX)
        grads = gather_grads(self.learner.model, keep=self.rank == 0)
        return {**grads, STATS_KEY: vec, EXTREMA_KEY: ext} if self.rank == 0 else {}


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
    begin / train (drain) / reduce / finish / publish per step -> close() (stops the ranks, or kills
    them after a failure, and destroys the process group). ``base``: the group's first device;
    ``role``: "core" (the optimizer's group) or "replica" (a freed cell's, no optimizer state)."""

    def __init__(self, job: TrainerJob, *, store: Any, store_host: str, store_port: int, log_dir: str,
                 timeout_s: float, base: str = "", role: str = "core") -> None:
        self.job = job
        self.base = base
        self.role = role
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
        rank0.store, rank0.store_addr, rank0.timeout_s = self.store, (self.store_host, self.store_port), self.timeout_s
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for rank in range(1, self.world):
            cmd = [sys.executable, "-m", "services.trainer.group", "--store", f"{self.store_host}:{self.store_port}",
                   "--prefix", self.prefix, "--rank", str(rank), "--world-size", str(self.world),
                   "--role", self.role, "--timeout-s", str(self.timeout_s)]
            if self.base:
                cmd += ["--device", self.base]
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
        log.info("trainer group formed", job_id=self.job.job_id, ranks=self.world, role=self.role,
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
        role = "" if self.role == "core" else f"-replica{os.getpid()}"
        return self.log_dir / f"trainer-{self.job.job_id}{role}-rank{rank}.log"

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
    def _run(self, op: Op, batches: Sequence[PackedBatchLike | None] | None = None, payload: Any = None) -> Any:
        assert self.rank0 is not None
        _broadcast(op)
        mine = _scatter(batches) if op.kind == "round" else None
        return self.rank0.run(op, mine, payload)

    def begin(self, step: int, version: int) -> None:
        self._run(Op("begin", step=step, version=version))

    def train(self, batches: Sequence[PackedBatchLike]) -> None:
        """Train up to N micro-batches (already acknowledged), one per rank, in one round."""
        assert self.rank0 is not None and 0 < len(batches) <= self.world
        forwards = max(self.rank0.forwards_of(b) for b in batches)
        padded: list[PackedBatchLike | None] = [*batches, *([None] * (self.world - len(batches)))]
        self._run(Op("round", forwards=forwards), padded)

    def drain(self, source: Any, step: int, *, journal: Any, log: Any,
              stop: threading.Event | None = None) -> tuple[int, float]:
        """Train what the step's queue hands this group until it is dry (or ``stop`` is set: a
        replica group given back trains the round it holds, then stops), a round at a time, one
        micro-batch per rank (the last round padded), each validated, journaled and acknowledged by
        rank 0 first: (micro-batches trained, seconds spent training them)."""
        from services.trainer import metrics as m
        from services.trainer.sources import claim_delivery

        assert self.rank0 is not None
        trained, seconds, dry = 0, 0.0, False
        while not dry:
            batches: list[Any] = []
            while len(batches) < self.world:
                if (stop is not None and stop.is_set()) or (d := source.next(step)) is None:
                    dry = True
                    break
                if (batch := claim_delivery(self.rank0.learner, d, step=step, journal=journal, log=log)) is not None:
                    batches.append(batch)
            if not batches:
                continue
            t0 = time.perf_counter()
            self.train(batches)
            elapsed = time.perf_counter() - t0
            seconds += elapsed
            trained += len(batches)
            tokens = sum(len(b.input_ids) for b in batches)
            m.MICRO_BATCHES.inc(len(batches))
            m.TOKENS.inc(tokens)
            log.info("micro-batches trained by the group", step=step, micro_batches=len(batches), ranks=self.world,
                     tokens=tokens, seconds=round(elapsed, 3), tok_s=round(tokens / max(elapsed, 1e-9), 1))
        return trained, seconds

    def reduce(self, seal: Any) -> bool:
        """The step's all-reduce across groups (HSDP): every rank with the same rank of the other
        groups, this group being ``seal.rank`` of ``seal.world_size``; statistics included. The
        process groups are kept while seals name them; True if they were built for this step."""
        prefix = seal.pg_prefix or seal.group_prefix
        return bool(self._run(Op("reduce", step=seal.step, prefix=prefix, rank=seal.rank, world=seal.world_size)))

    @property
    def held_pg(self) -> str:
        """The cross-group process groups this group kept from its last all-reduce ("": none)."""
        return self.rank0.kept.held if self.rank0 is not None else ""

    def handoff_state(self) -> dict[str, torch.Tensor]:
        """The group's gradient sums (whole, by parameter name) and statistics, for a hand-off."""
        return self._run(Op("handoff"))  # type: ignore[no-any-return]

    def add_grads(self, grads: dict[str, torch.Tensor]) -> None:
        """Add a whole-model gradient sum (a leaving replica's hand-off) to the ranks' shards."""
        self._run(Op("add_grads"), payload=grads)

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Load whole weights (a version pulled from the core) into every rank's shards."""
        self._run(Op("weights"), payload=state)

    def finish(self, step: int) -> float:
        """Reduce the step's statistics over the ranks and apply the update; the gradient norm."""
        norm, rss = self._run(Op("finish", step=step))
        self.peak_rss_mib = rss
        return float(norm)

    def publish(self, path: Path) -> Path:
        """Write the whole weights into the safetensors file ``path``, gathered a tensor at a time."""
        self._run(Op("publish", path=str(path)))
        return path

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
    p.add_argument("--device", default="", help="the group's first device (default: the job's)")
    p.add_argument("--role", default="core", choices=("core", "replica"))
    args = p.parse_args(argv)
    setup_logging(json=True, service=f"trainer-rank{args.rank}")
    host, _, port = args.store.rpartition(":")
    timeout = datetime.timedelta(seconds=args.timeout_s)
    raw = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    store = dist.PrefixStore(args.prefix, raw)
    spec = trainer_pb2.TrainerJobSpec()
    spec.ParseFromString(store.get("job"))
    job = wire.job_from_proto(spec)
    rank = GroupRank(job, args.rank, base=args.device, role=args.role)
    rank.store, rank.store_addr, rank.timeout_s = raw, (host, int(port)), args.timeout_s
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
