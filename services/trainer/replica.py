"""An elastic data-parallel replica: the trainer process on a freed cell.

    gyre-trainer --replica --core HOST:PORT --cell-id cell-3

Loop (one iteration per step it takes part in):

    JoinStep                -> step s, weight version v, the core's TCPStore, the job
    GetWeights(v)           (skipped when it already holds v, i.e. it stayed from step s-1)
    pull micro-batches of s from the shared queue, accumulate gradient sums, ack each
    AwaitReduce(s)          -> rank, world (blocks until the core sealed the step)
    all-reduce SUM in the step's fresh process group
    released / max steps reached -> exit (the cell is free); else JoinStep again

While it is a member, a thread of its own calls ReplicaAlive every ticket.heartbeat_interval_s:
the core evicts a replica whose heartbeats stop (its process or host died) without waiting out
member_timeout_s, wherever the replica runs.

SIGTERM (the orchestrator wants the cell now): give the current micro-batch's forward up at its
next decoder layer and hand the batch back to the queue (one already acknowledged is finished),
then hand the gradient sum accumulated so far to the core (HandOffGradients) - or just LeaveStep
if it trained nothing - and exit. Once the step is sealed the replica completes the all-reduce
first (the others are waiting for it), then exits.

A job trained by a sharded core group (``shards = N``) is joined by a *replica group* of the same
shape (services.trainer.group, HSDP): this process is its rank 0; it pulls version v whole, starts
ranks 1..N-1 and hands each its shards; the group takes micro-batches a round at a time (one per
rank, the forward never given up mid-round: the ranks run in lockstep); at the seal each rank
all-reduces its gradient shards with the same rank of every other group; a leaving group hands off
its gradient sums gathered whole. A rank that dies fails this process, so the core evicts the group
and trains its share again. The group is kept across the job's steps (the next version is loaded
into its shards).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from services.common.errors import FailedPrecondition, GyreError
from services.common.logging import get_logger
from services.common.memory import release_free_memory, rss_bytes
from services.trainer.client import Interrupted, TrainerClient
from services.trainer.core import backend_for
from services.trainer.build import build_learner
from services.trainer.elastic import JoinTicket, KeptGroup, ReduceCalledOff, all_reduce_step, arrive, open_group
from services.trainer.group import GroupRank, ShardGroup, check_group
from services.trainer.job import TrainerJob
from services.trainer.learner import Learner
from services.trainer.journal import journal_for
from services.trainer.sources import BatchSource, open_source, train_delivery
from services.trainer.weights import load_state


JOIN_WAIT_S = 60.0  # how long a replica waits for a step to join before it gives up
COLLECTIVE_TIMEOUT_S = 600.0  # a step's arrival and process group: the core decides sooner when one is gone


@dataclass
class ReplicaStats:
    steps: int = 0
    micro_batches: int = 0
    join_latency_s: float = 0.0  # first JoinStep -> ready to train (weights loaded)
    per_step_batches: dict[int, int] | None = None


class Replica:
    """One replica process's loop; ``stop_event`` requests a graceful leave."""

    def __init__(self, core: TrainerClient, *, replica_id: str, cell_id: str, device: str = "",
                 max_steps: int = 0, stop_event: threading.Event | None = None,
                 reuse: tuple[Learner, TrainerJob] | None = None, rank_log_dir: str = ".gyre/logs") -> None:
        self.core = core
        self.replica_id = replica_id
        self.cell_id = cell_id
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.max_steps = max_steps
        self.stop_event = stop_event or threading.Event()
        self.stats = ReplicaStats(per_step_batches={})
        self.log = get_logger(__name__, replica_id=replica_id, cell_id=cell_id)
        # a pool process's previous replica's model (``reusable()``): kept when the job is the same
        self._learner: Learner | None = reuse[0] if reuse is not None else None
        self._job: TrainerJob | None = reuse[1] if reuse is not None else None
        self._source: BatchSource | None = None
        self._group: ShardGroup | None = None  # a sharded job's replica group (this process is its rank 0)
        self.rank_log_dir = rank_log_dir
        self._kept = KeptGroup()  # the all-reduce's process group, kept while the participants stay
        self._alive_stop = threading.Event()
        self._alive: threading.Thread | None = None
        self._store: tuple[tuple[str, int], Any] | None = None
        self._interrupted_at: float | None = None
        self._phase = "starting"  # what it was doing, for the release's log line
        self._interrupted_in = ""

    def interrupt(self) -> None:
        """Give the cell back now (SIGTERM): leave at once, also when waiting for batches that have not
        been produced yet (the rollouts may need this cell); a micro-batch's forward stops at its next
        decoder layer and the batch goes back to the queue (one already acknowledged is finished)."""
        if self._interrupted_at is None:
            self._interrupted_at = time.perf_counter()
            self._interrupted_in = self._phase
        self.stop_event.set()
        interrupt = getattr(self._source, "interrupt", None)
        if interrupt is not None:
            interrupt()

    def run(self) -> ReplicaStats:
        clean = False
        try:
            stats = self._run()
            clean = True
            return stats
        except Exception:
            ended = self._group.ended_ranks() if self._group is not None else ""
            if ended:  # the cause, in one line, before the collective's error
                self.log.error("the replica group lost a rank; this replica fails and the core trains its share",
                               ranks=ended)
            raise
        finally:
            self._alive_stop.set()
            self._close_group(clean=clean)

    def _close_group(self, *, clean: bool) -> None:
        """Stop this replica's group (``clean``: its ranks wait for an operation), or kill its ranks."""
        group, self._group = self._group, None
        if group is None:
            return
        try:
            group.close(clean=clean)
        except Exception as exc:  # deliberate: the ranks were killed; the replica's outcome stands
            self.log.error("closing the replica group failed", error=str(exc))
        self._learner = None

    def _store_for(self, host: str, port: int) -> Any:
        """A client of the core's rendezvous store (one per core address, kept across steps)."""
        import datetime

        import torch.distributed as dist

        if self._store is None or self._store[0] != (host, port):
            store = dist.TCPStore(host, port, is_master=False,
                                  timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
            self._store = ((host, port), store)
        return self._store[1]

    def reusable(self) -> tuple[Learner, TrainerJob] | None:
        """The model this replica trained (weights are pulled again): the next replica of a pool
        process starts from it when it trains the same job."""
        if self._group is not None or self._learner is None or self._job is None:
            return None  # a replica group's ranks end with it
        return self._learner, self._job

    def _heartbeat(self, interval_s: float) -> None:
        """Tell the core this replica lives, every ``interval_s``, until ``run`` returns."""
        while not self._alive_stop.wait(interval_s):
            try:
                self.core.replica_alive(self.replica_id, timeout_s=max(interval_s, 1.0))
            except GyreError as exc:  # the core restarting: the next one may get through
                self.log.debug("heartbeat failed", error=str(exc))

    def _run(self) -> ReplicaStats:
        t0 = time.perf_counter()
        held_version = -1
        while not self.stop_event.is_set():
            self._phase = "joining a step"
            joined = self._join()
            if joined is None:
                break
            ticket, job, backend = joined
            log = self.log.bind(job_id=job.job_id, step=ticket.step)
            if self._alive is None and ticket.heartbeat_interval_s > 0:
                self._alive = threading.Thread(target=self._heartbeat, args=(ticket.heartbeat_interval_s,),
                                               name="replica-alive", daemon=True)
                self._alive.start()
            if self._job is None or self._job.job_id != job.job_id:
                if self._source is not None:
                    self._source.close()
                    self._source = None
                self._close_group(clean=True)
                self._learner, self._job, held_version = None, job, -1
            if self._source is None:
                self._source = open_source(job.source, store_host=ticket.store_host, store_port=ticket.store_port,
                                           job_id=job.job_id, consumer_id=self.replica_id,
                                           trajectory_address=job.trajectory_address)
            source = self._source
            if job.shards > 1 and self._group is None:
                try:  # before pulling weights it could not use
                    check_group(job, str(self.device))
                except ValueError as exc:
                    self.core.leave_step(self.replica_id)
                    raise FailedPrecondition(f"this cell cannot hold a replica group of job {job.job_id!r}: "
                                             f"{exc}") from None
            if held_version != ticket.weight_version:
                self._phase = "loading weights"
                try:
                    _, state = self.core.get_weights(ticket.weight_version, wait_s=3600.0, stop=self.stop_event)
                except Interrupted:
                    self._leave(ticket, 0, lambda: {})  # its cell is wanted back: no weights it will not use
                    break
                self._load(job, ticket, state)
                held_version = ticket.weight_version
            learner, group = self._learner, self._group
            assert learner is not None
            if self.stats.steps == 0:
                self.stats.join_latency_s = time.perf_counter() - t0
                log.info("replica ready", join_latency_s=round(self.stats.join_latency_s, 3),
                         weight_version=held_version)
            journal = journal_for(job.checkpoint_dir, job.job_id)
            if group is not None:
                group.begin(ticket.step, ticket.weight_version)
                self._phase = "training rounds"
                trained, _ = group.drain(source, ticket.step, journal=journal, log=log, stop=self.stop_event)
            else:
                learner.begin_step(ticket.step, ticket.weight_version)
                trained = 0
                while not self.stop_event.is_set():
                    self._phase = "waiting for a micro-batch"
                    d = source.next(ticket.step)  # None at the step's end, or after interrupt()
                    if d is None:
                        break
                    self._phase = "training a micro-batch"
                    trained += train_delivery(learner, d, step=ticket.step, journal=journal, log=log)
            self.stats.micro_batches += trained
            assert self.stats.per_step_batches is not None
            self.stats.per_step_batches[ticket.step] = trained
            leaving = self.stop_event.is_set()
            if leaving:
                try:
                    self._leave(ticket, trained, group.handoff_state if group is not None else learner.handoff_state)
                    break
                except FailedPrecondition as exc:
                    if "is sealed" not in str(exc):
                        raise
                    # asked to go just as the step was sealed with it: the others wait for its
                    # gradient in the all-reduce, so it takes part first and then exits
                    log.info("released at the step's seal; all-reducing before leaving")
            self._phase = "all-reducing"
            seal = self.core.await_reduce(self.replica_id, ticket.step,
                                          held_pg=group.held_pg if group is not None else self._kept.held)
            if seal.world_size > 1:
                store = self._store_for(ticket.store_host, ticket.store_port)
                ended = group.ended_ranks(wait_s=0) if group is not None else ""
                if ended:  # before arriving: the core sees this process gone and calls the reduce off
                    raise RuntimeError(f"this replica's group lost a rank: {ended}")
                try:
                    arrive(store, seal, timeout_s=COLLECTIVE_TIMEOUT_S)
                except ReduceCalledOff as exc:
                    # another participant died after the seal: the core trains this replica's
                    # micro-batches again (its gradient sum is dropped); it stays for the next step
                    log.warning("all-reduce called off; the core trains this step's share again", error=str(exc))
                    self._kept.drop()
                    if leaving or seal.release or ticket.step + 1 >= job.num_steps:
                        break
                    continue
                if group is not None:
                    group.reduce(seal)
                else:
                    pg_seal = seal.pg
                    pg, _ = self._kept.get(pg_seal.group_prefix, lambda: open_group(
                        pg_seal, store_host=ticket.store_host, store_port=ticket.store_port,
                        backend=backend or backend_for(self.device), store=store))
                    all_reduce_step(pg, list(learner.grad_buckets()), learner.stats.vector(), learner.stats.extrema())
            self.stats.steps += 1
            held_version = ticket.weight_version  # the core's update makes it stale; next join pulls v+1
            release_free_memory()  # the step's activations are freed: their pages go back to the OS
            log.info("replica step done", micro_batches=trained, rank=seal.rank, world=seal.world_size,
                     release=seal.release, rss_mb=rss_bytes() >> 20)
            if leaving or seal.release or (self.max_steps and self.stats.steps >= self.max_steps):
                break
            if ticket.step + 1 >= job.num_steps:
                break
        if self._source is not None:
            self._source.close()
            self._source = None
        self.log.info("replica exits", steps=self.stats.steps, micro_batches=self.stats.micro_batches)
        return self.stats

    def _join(self) -> tuple | None:
        """JoinStep, waiting while the core has no step to join (its job is ending, the next one not
        started yet: a warm replica handed its cell at that moment is there before it); None when
        asked to stop meanwhile. Gives up (raises) after JOIN_WAIT_S."""
        deadline = time.monotonic() + JOIN_WAIT_S
        while True:
            try:
                return self.core.join_step(self.replica_id, self.cell_id)
            except FailedPrecondition as exc:
                if time.monotonic() > deadline:
                    raise
                self.log.info("no step to join yet; waiting", error=str(exc))
            if self.stop_event.wait(0.5):
                return None

    def _load(self, job: TrainerJob, ticket: JoinTicket, state: dict[str, torch.Tensor]) -> None:
        """Load pulled weights: into this process's model, or the replica group's shards (the group
        forms on its first version)."""
        if job.shards <= 1:
            if self._learner is None:
                self._learner = build_learner(job, self.device)
            # a release gives the running forward up at its next layer (never after its ack)
            self._learner.abort_on(self.stop_event)
            load_state(self._learner.model, state)
            return
        if self._group is not None:
            self._group.load_weights(state)
            return
        rank0 = GroupRank(job, 0, base=str(self.device), role="replica")
        load_state(rank0.learner.model, state)
        del state
        self._group = ShardGroup(job, store=self._store_for(ticket.store_host, ticket.store_port),
                                 store_host=ticket.store_host, store_port=ticket.store_port, log_dir=self.rank_log_dir,
                                 timeout_s=COLLECTIVE_TIMEOUT_S, base=str(self.device), role="replica")
        self._group.start(rank0)
        self._learner = rank0.learner

    def _leave(self, ticket: JoinTicket, trained: int, state_of: Callable[[], dict[str, torch.Tensor]]) -> None:
        """Leave the ticket's step mid-way; the log line times the release's parts: ``finish_s`` from the
        interrupt to here (what it was doing: ``interrupted_in``), ``handoff_s`` the hand-off itself."""
        step = ticket.step
        t0 = time.perf_counter()
        finish_s = round(t0 - self._interrupted_at, 3) if self._interrupted_at is not None else None
        if trained:
            state = state_of()
            shared = self.core.hand_off_shared(
                self.replica_id, step, state, folder=ticket.handoff_dir, token=ticket.handoff_token) is not None
            if not shared:
                self.core.hand_off_gradients(self.replica_id, step, state)
            self.log.info("left mid-step with hand-off", step=step, micro_batches=trained, finish_s=finish_s,
                          interrupted_in=self._interrupted_in,
                          handoff_s=round(time.perf_counter() - t0, 3), shared_memory=shared,
                          handoff_mb=round(sum(t.numel() * t.element_size() for t in state.values()) / 2**20, 1))
        else:
            self.core.leave_step(self.replica_id)
            self.log.info("left mid-step", step=step, finish_s=finish_s, interrupted_in=self._interrupted_in,
                          leave_s=round(time.perf_counter() - t0, 3))


def default_replica_id(cell_id: str) -> str:
    return f"{cell_id}-{os.getpid()}"
