"""The core trainer (rank 0): authoritative weights and optimizer, the step loop, publishing.

One step, top to bottom (``CoreTrainer.run_step``):

    open the step (replicas may join: they pull version v and the same micro-batch queue)
    pull micro-batches until the step's batch is consumed; accumulate gradient sums
    wait for the step's members, seal the world (core = rank 0), all-reduce SUM (gloo / NCCL)
    add gradients handed off by replicas that left mid-step
    clip + AdamW step (once per step)  ->  version v+1
    snapshot v+1 for GetWeights, push it to the rollout engines, report, checkpoint

Lifecycle: CoreTrainer(...)  ->  start(job) (builds the model, resumes from the latest complete
checkpoint, runs the steps in a background thread)  ->  stop(). The TCPStore that replicas
rendezvous on lives as long as the CoreTrainer.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from services.common.errors import FailedPrecondition, InvalidArgument
from services.common.logging import get_logger
from services.common.memory import release_free_memory, rss_bytes
from services.trainer import checkpoint as ckpt
from services.trainer import metrics as m
from services.trainer.group import GroupRank, ShardGroup, check_group
from services.trainer.elastic import (KeptGroup, ReduceCalledOff, Seal, StepMembership, all_reduce_step, arrive,
                                     open_group)
from services.trainer.job import TrainerJob
from services.trainer.build import build_learner
from services.trainer.learner import EXTREMA_KEY, STATS_KEY, Learner, Updater
from services.trainer.journal import StepJournal, journal_for
from services.trainer.sources import BatchSource, open_source, train_delivery
from services.trainer.weights import PublishedFile, PublishReport, WeightStore, push_to_engines, state_bytes

log = get_logger(__name__)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


@dataclass(frozen=True)
class StepReport:
    """What one step did (returned by WaitStep and logged)."""

    step: int
    version: int                      # weight version published by this step (= step + 1)
    metrics: dict[str, float]
    participants: tuple[str, ...]     # replica ids in the all-reduce besides the core
    publish: PublishReport | None = None


@dataclass
class _JobState:
    job: TrainerJob
    learner: Learner
    updater: Updater
    source: BatchSource
    step: int
    version: int
    reports: list[StepReport] = field(default_factory=list)
    handoffs: dict[int, list[dict[str, torch.Tensor]]] = field(default_factory=dict)
    journal: StepJournal | None = None
    group: ShardGroup | None = None  # job.shards > 1: the sharded trainer group this core is rank 0 of
    phase: str = "starting"
    error: str = ""


def _unknown_replica(_replica_id: str) -> bool | None:
    return None  # liveness not known here: the member timeout decides


class CoreTrainer:
    """Rank 0 of every step; thread-safe facade used by the gRPC servicer."""

    def __init__(self, *, store_host: str = "127.0.0.1", store_port: int = 0, advertise_host: str = "",
                 member_timeout_s: float = 300.0, replica_silence_s: float = 20.0,
                 collective_timeout_s: float = 600.0,
                 publish_chunk_bytes: int = 4 << 20, rank_log_dir: str = ".gyre/logs",
                 reporter: Callable[..., None] | None = None) -> None:
        # replica id -> False once its process is known dead (the servicer wires the replicas it spawned)
        self.replica_alive: Callable[[str], bool | None] = _unknown_replica
        import torch.distributed as dist

        self.store = dist.TCPStore(store_host, store_port, is_master=True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=collective_timeout_s))
        self.store_host = advertise_host or store_host
        self.store_port = int(self.store.port)
        self.member_timeout_s = member_timeout_s
        self.replica_silence_s = replica_silence_s
        self.collective_timeout_s = collective_timeout_s
        self.publish_chunk_bytes = publish_chunk_bytes
        self.rank_log_dir = rank_log_dir  # logs of a sharded group's ranks 1..N-1
        self.reporter = reporter
        self.weights = WeightStore()
        self.membership: StepMembership | None = None
        self._state: _JobState | None = None
        self._lock = threading.RLock()
        self._cv = threading.Condition(self._lock)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._spool_dir: Path | None = None
        self._kept = KeptGroup()  # the all-reduce's process group with whole replicas, kept while they stay

    # -- job lifecycle ----------------------------------------------------------------------------
    def start(self, job: TrainerJob, *, background: bool = True) -> None:
        """Build the model, resume if a checkpoint exists, and run the job's steps."""
        with self._lock:
            if self._state is not None and self._state.phase not in ("done", "failed", "stopped"):
                raise FailedPrecondition(f"job {self._state.job.job_id!r} is still running")
            torch.manual_seed(job.seed)
            if job.shards > 1:
                try:
                    check_group(job)
                except ValueError as exc:
                    raise InvalidArgument(str(exc)) from None
            # rank 0's learner (the whole model until the group shards it), or the whole learner
            rank0 = GroupRank(job, 0) if job.shards > 1 else None
            learner = rank0.learner if rank0 is not None else build_learner(job, torch.device(job.device))
            step, version = job.start_step, job.start_step
            path = ckpt.latest_checkpoint(job.checkpoint_dir) if job.checkpoint_dir and job.resume else None
            if path is not None:
                try:  # before any other rank starts
                    ckpt.check_model(path, learner.model)
                except ValueError as exc:
                    raise InvalidArgument(str(exc)) from None
            group = self._start_group(job, rank0) if rank0 is not None else None
            try:
                updater = group.rank0.updater if group is not None and group.rank0 is not None \
                    else Updater(learner.model, job.optim)
                if path is not None:
                    c = ckpt.load_checkpoint(path)  # the record, and the RNG restored
                    if group is not None:  # every rank loads its shards, whatever world size saved them
                        group.load(path)
                    else:
                        ckpt.load_into(path, learner.model, updater.optimizer)
                    step, version = c.step, c.version
                    log.info("resumed", job_id=job.job_id, path=str(path), step=step, version=version,
                             shards=job.shards)
                self.membership = StepMembership(job_id=job.job_id, store_host=self.store_host,
                                                 store_port=self.store_port, member_timeout_s=self.member_timeout_s,
                                                 silence_s=self.replica_silence_s,
                                                 is_alive=lambda rid: self.replica_alive(rid))
                # The source gets its own store connection: a TCPStore client serializes requests, and
                # a consumer blocked in store.wait must not block the step's process-group setup.
                source = open_source(job.source, store_host=self.store_host, store_port=self.store_port,
                                     job_id=job.job_id, consumer_id="core", trajectory_address=job.trajectory_address)
                journal = journal_for(job.checkpoint_dir, job.job_id)
                if journal is not None and not job.resume:
                    journal.clear()
                self._kept = KeptGroup()
                self._state = _JobState(job=job, learner=learner, updater=updater, source=source, step=step,
                                        version=version, journal=journal, group=group)
                # versions count per job: a previous job's must not answer for this one's
                self.weights.reset()
                snapshot = self._publish(self._state, version)
                self._stop.clear()
            except BaseException:  # the job does not start: neither do its ranks
                if group is not None:
                    group.close(clean=False)
                raise
        if job.engine_addresses:
            # The engines serve this job's weights from its first call on: the job's model (a
            # checkpoint of the architecture they run), or after a resume the checkpoint's weights.
            # A restart lineage: the engines may hold a higher version of the previous job.
            self._push(snapshot, version, job, restart=True)
        if background:
            self._thread = threading.Thread(target=self._run, name=f"trainer-{job.job_id}", daemon=True)
            self._thread.start()

    def _start_group(self, job: TrainerJob, rank0: GroupRank) -> ShardGroup:
        """A sharded group of which ``rank0`` (this process) is rank 0: the others started, joined,
        every rank's model sharded."""
        group = ShardGroup(job, store=self.store, store_host=self.store_host, store_port=self.store_port,
                           log_dir=self.rank_log_dir, timeout_s=self.collective_timeout_s)
        try:
            group.start(rank0)
        except BaseException:
            group.close(clean=False)
            raise
        return group

    @staticmethod
    def _close_group(st: _JobState, *, clean: bool) -> None:
        if st.group is None:
            return
        try:
            st.group.close(clean=clean)
        except Exception as exc:  # deliberate: the job's outcome stands; the ranks were killed
            log.error("closing the trainer group failed", job_id=st.job.job_id, error=str(exc))

    def _publish(self, st: _JobState, version: int) -> Mapping[str, torch.Tensor]:
        """Keep the weights as ``version`` (GetWeights serves it; returns what is pushed to engines):
        a copy of the whole model's, or a sharded group's gathered a tensor at a time into a file."""
        if st.group is None:
            return self.weights.publish_state(st.learner.model.state_dict(), version)
        folder = Path(st.job.checkpoint_dir) / "published" if st.job.checkpoint_dir else self._spool()
        path = st.group.publish(folder / f"{st.job.job_id}-v{version}.safetensors")
        return self.weights.publish_state(PublishedFile(path), version)

    def _spool(self) -> Path:
        """This trainer's own folder for published versions of jobs without a checkpoint directory."""
        if self._spool_dir is None:
            self._spool_dir = Path(tempfile.mkdtemp(prefix="gyre-published-"))
            # kept while the process lives: a reader may hold the last version after the job stopped
            atexit.register(shutil.rmtree, self._spool_dir, ignore_errors=True)
        return self._spool_dir

    def _run(self) -> None:
        st = self._require()
        # this job's: once the phase says done, the next StartJob may already have replaced it
        membership = self.membership
        try:
            while st.step < st.job.num_steps and not self._stop.is_set():
                self.run_step()
            self._close_group(st, clean=True)  # before the phase: the next job may form its own at once
            self._set_phase("stopped" if self._stop.is_set() else "done")
        except Exception as exc:  # the job fails loudly; the service stays up to report it
            log.exception("trainer job failed", job_id=st.job.job_id, step=st.step)
            ended = st.group.ended_ranks() if st.group is not None else ""  # a rank that died fails the step
            st.error = f"{ended + ': ' if ended else ''}{type(exc).__name__}: {exc}"
            self._close_group(st, clean=False)
            self._set_phase("failed")
        finally:
            if membership is not None:
                membership.close()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Finish the running step (never half-apply an update), then stop. Replicas still in the
        step are not waited for (a stopped job's batches stop coming; they would wait out
        ``member_timeout_s``): the core evicts them and trains their share itself."""
        self._stop.set()
        if self.membership is not None:
            self.membership.close()
        if self._thread is not None:
            self._thread.join(timeout_s)
        st = self._state
        if st is not None:
            if self._thread is None or not self._thread.is_alive():
                self._close_group(st, clean=True)
            st.source.close()

    def wait(self, timeout_s: float | None = None) -> bool:
        if self._thread is None:
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # -- one step ---------------------------------------------------------------------------------
    def run_step(self) -> StepReport:
        st = self._require()
        assert self.membership is not None
        job, learner, step, version = st.job, st.learner, st.step, st.version
        start = time.perf_counter()
        # Batches taken before a restart: committed in the journal before anyone can pull this step.
        replay = st.journal.replay(step) if st.journal is not None else []
        self.membership.open_step(step, version)
        if st.group is not None:
            st.group.begin(step, version)
        else:
            learner.begin_step(step, version)
        self._set_phase("training")
        self._report(job, step, "started", version)
        width = st.group.world if st.group is not None else 1
        for i in range(0, len(replay), width):
            chunk = replay[i:i + width]
            if st.group is not None:
                st.group.train([batch for _, batch in chunk])
            else:
                learner.train(chunk[0][1])
            log.info("replayed journaled micro-batches", job_id=job.job_id, step=step,
                     batch_ids=[batch_id for batch_id, _ in chunk])
        slog = log.bind(job_id=job.job_id)
        _, compute_s = self._drain(st, step, slog)  # compute_s: training, not waiting for the step's rollouts
        train_s = time.perf_counter() - start
        own_tokens = float(learner.stats.as_dict().get("tokens", 0.0))  # the core's share, before the reduce

        seal = self.membership.core_done(step, held_pg=st.group.held_pg if st.group is not None else self._kept.held)
        self._set_phase("reducing")
        stats = learner.stats
        participants = tuple(str(x["replica_id"]) for x in self.membership.members()
                             if x["step"] == step and x["rank"] > 0 and not x["evicted"])
        try:
            reduce_s, built = self._reduce(seal, st)
        except ReduceCalledOff as exc:  # a participant died after the seal: train its share here
            slog.warning("all-reduce called off", step=step, error=str(exc))
            self.membership.call_off(step)
            self._kept.drop()
            participants, reduce_s, built = (), 0.0, False
            seal = dataclasses.replace(seal, world_size=1)
        evicted = sum(1 for x in self.membership.members() if x["step"] == step and x["evicted"])
        m.EVICTED.inc(evicted)
        for grads in st.handoffs.pop(step, []):
            stats_vec, extrema = grads.pop(STATS_KEY, None), grads.pop(EXTREMA_KEY, None)
            if st.group is not None:  # into every rank's shards; the statistics once, on rank 0
                st.group.add_grads(grads)
            else:
                learner.add_grads(grads)
            if stats_vec is not None and extrema is not None:
                learner.stats.merge(stats_vec, extrema)
        handed = [x for x in self.membership.members() if x["step"] == step and x["left"]]
        retrained, handed_back = self._retrain_lost(st, step, slog)

        self._set_phase("updating")
        if st.group is not None:  # statistics reduced over the ranks, each rank's shard updated
            grad_norm = st.group.finish(step)
            own_tokens = float(learner.stats.as_dict().get("tokens", 0.0))  # the group trains as one
        else:
            grad_norm = st.updater.apply(step)
        new_version = version + 1
        snap_t0 = time.perf_counter()
        snapshot = self._publish(st, new_version)
        publish = self._push(snapshot, new_version, job, snapshot_s=time.perf_counter() - snap_t0)
        step_s = time.perf_counter() - start
        with self._lock:
            st.step, st.version = step + 1, new_version
        metrics = stats.as_dict()
        metrics.update(grad_norm=grad_norm, step_time_s=step_s, train_time_s=train_s, allreduce_s=reduce_s,
                       world_size=float(seal.world_size), handed_off=float(len(handed)),
                       lr=st.updater.config.lr_at(step),
                       tokens_per_s=metrics.get("tokens", 0.0) / step_s if step_s > 0 else 0.0,
                       compute_s=compute_s, train_tokens_per_s=own_tokens / compute_s if compute_s > 0 else 0.0,
                       weight_version=float(new_version), publish_s=publish.engines_s,
                       snapshot_s=publish.snapshot_s,
                       evicted=float(evicted), retrained=float(retrained), handed_back=float(handed_back),
                       publish_mb=publish.num_bytes / 1e6, shards=float(job.shards),
                       process_group_built=float(built))
        if st.group is not None:
            metrics.update({f"peak_rss_mib_rank{r}": v for r, v in enumerate(st.group.peak_rss_mib)})
        m.record_step(metrics)
        m.REDUCE_TIME.observe(reduce_s)
        report = StepReport(step=step, version=new_version, metrics=metrics, participants=participants,
                            publish=publish)
        with self._cv:
            st.reports.append(report)
            self._cv.notify_all()
        # what the policy weighs against switch costs: every participant's tokens over the longest
        # time one of them computed (waits for rollouts left out; replicas may have trained every
        # micro-batch while the core trained none), and the world that shared them
        self._report(job, step, "published", new_version,
                     {"tokens": float(metrics.get("tokens", 0.0)),
                      "compute_s": max(compute_s, metrics.get("compute_s_max", 0.0)),
                      "world_size": float(seal.world_size)}, metrics)
        settle = getattr(st.source, "settle", None)
        if settle is not None:
            try:
                settle(step)  # the update is applied: the step's batches are final
            except Exception as exc:  # deliberate: the payloads only stay longer; the step is done
                log.warning("settling the step failed", job_id=job.job_id, step=step, error=str(exc))
        if job.checkpoint_dir and (step + 1) % job.checkpoint_every == 0:
            ckpt.save_checkpoint(job.checkpoint_dir, step=step + 1, version=new_version, model=learner.model,
                                 optimizer=st.updater.optimizer, extra={"job_id": job.job_id, "shards": job.shards},
                                 write_state=st.group.save if st.group is not None else None)
            ckpt.prune_checkpoints(job.checkpoint_dir, job.checkpoint_keep)
            if st.journal is not None:
                st.journal.forget_before(step + 1)  # those updates are durable now
        # the step's activations, batches and chunk KV are freed: give their pages back to the OS,
        # so the trainer's RSS does not stay at the deepest step's peak
        release_free_memory()
        log.info("step done", job_id=job.job_id, step=step, version=new_version, world=seal.world_size,
                 loss=round(metrics.get("loss", 0.0), 6), grad_norm=round(grad_norm, 6),
                 tokens=metrics.get("tokens"), step_s=round(step_s, 3), compute_s=round(compute_s, 3),
                 train_tok_s=round(metrics["train_tokens_per_s"], 1), rss_mb=rss_bytes() >> 20)
        return report

    def _drain(self, st: _JobState, step: int, slog: Any) -> tuple[int, float]:
        """Train what the step's queue hands this trainer until it is dry: (micro-batches trained,
        seconds spent training them). A sharded group takes them a round at a time (``ShardGroup.drain``)."""
        trained, seconds = 0, 0.0
        if st.group is None:
            while (d := st.source.next(step)) is not None:
                t0 = time.perf_counter()
                trained += train_delivery(st.learner, d, step=step, journal=st.journal, log=slog)
                seconds += time.perf_counter() - t0
            return trained, seconds
        return st.group.drain(st.source, step, journal=st.journal, log=slog)

    def _retrain_lost(self, st: _JobState, step: int, slog: Any) -> tuple[int, int]:
        """Train here what left the step untrained: the micro-batches evicted replicas (dead, or
        silent past member_timeout_s) had acknowledged -- their gradient sums died with them -- and
        those a leaving replica handed back after giving up their forward (it may have done so
        after this core found the queue dry). Gradients add up, so the core's share after the
        all-reduce plus these batches is the same update. Returns the micro-batches trained here
        (those of evicted replicas, those handed back; a handed-back batch the core met in its own
        loop was counted there)."""
        assert self.membership is not None
        lost = self.membership.evicted(step)
        reopened = 0
        if lost:
            reopen = getattr(st.source, "reopen", None)
            if reopen is None:
                log.error("evicted replicas' micro-batches are lost: this source cannot reopen them",
                          job_id=st.job.job_id, step=step, replicas=lost)
            else:
                reopened = int(reopen(step, lost))
        trained, _ = self._drain(st, step, slog)
        retrained, handed_back = min(trained, reopened), max(0, trained - reopened)
        if lost:
            log.warning("retrained the micro-batches of evicted replicas", job_id=st.job.job_id, step=step,
                        replicas=lost, reopened=reopened, retrained=retrained)
        if handed_back:
            log.info("trained micro-batches handed back by leaving replicas", job_id=st.job.job_id, step=step,
                     handed_back=handed_back)
        return retrained, handed_back

    def _reduce(self, seal: Seal, st: _JobState) -> tuple[float, bool]:
        """The step's all-reduce with the replicas (replica groups of a sharded job: each rank with
        the same rank of every group); the statistics too. (seconds, whether its process group was
        built for this step rather than kept from the last one)."""
        if seal.world_size <= 1:
            return 0.0, False
        start = time.perf_counter()
        assert self.membership is not None
        membership = self.membership
        # every participant arrives first: one that died after the seal calls the reduce off
        # instead of leaving the group's setup waiting for it until collective_timeout_s
        arrive(self.store, seal, timeout_s=self.collective_timeout_s, gone=lambda: membership.sealed_gone(seal.step))
        if st.group is not None:
            built = st.group.reduce(seal)
            return time.perf_counter() - start, built
        learner = st.learner
        pg = seal.pg
        group, built = self._kept.get(pg.group_prefix, lambda: open_group(
            pg, store_host=self.store_host, store_port=self.store_port, backend=backend_for(learner.policy.device),
            timeout_s=self.collective_timeout_s, store=self.store))
        stats, ext = all_reduce_step(group, list(learner.grad_buckets()), learner.stats.vector(),
                                     learner.stats.extrema())
        learner.stats.load_vector(stats)
        learner.stats.load_extrema(ext)
        return time.perf_counter() - start, built

    def _push(self, snapshot: Mapping[str, torch.Tensor], version: int, job: TrainerJob,
              snapshot_s: float = 0.0, restart: bool = False) -> PublishReport:
        nbytes = state_bytes(snapshot)
        secs, ok, failed = push_to_engines(snapshot, version, job.engine_addresses,
                                           chunk_bytes=self.publish_chunk_bytes, restart=restart)
        if job.engine_addresses:
            m.PUBLISH_TIME.observe(secs)
        return PublishReport(version=version, num_bytes=nbytes, snapshot_s=snapshot_s, engines_s=secs, engines_ok=ok,
                             engines_failed=tuple(failed))

    def _report(self, job: TrainerJob, step: int, phase: str, version: int,
                measured: dict[str, float] | None = None, metrics: dict[str, float] | None = None) -> None:
        """Tell the scheduler (``reporter``, wired in main) that a step started / was published
        (``measured``: the update's tokens, compute seconds and world size; ``metrics``: all its figures,
        for the job's event log)."""
        if self.reporter is None:
            return
        try:
            self.reporter(job, step, phase, version, measured, metrics)
        except Exception as exc:  # progress reports are advisory; training goes on
            log.warning("step report failed", job_id=job.job_id, step=step, phase=phase, error=str(exc))

    # -- replica-facing operations (called by the servicer) ---------------------------------------
    def hand_off(self, replica_id: str, step: int, grads: dict[str, torch.Tensor]) -> None:
        """Take the gradient sum of a replica leaving ``step`` mid-way, then drop it from the step."""
        st = self._require()
        assert self.membership is not None
        with self._lock:
            cur = self.membership.current_step()
            if cur is None or cur[0] != step or cur[2]:
                raise FailedPrecondition(f"cannot hand off gradients of step {step}: the trainer is at "
                                         f"{'no step' if cur is None else f'step {cur[0]}'}"
                                         f"{' (sealed)' if cur and cur[2] else ''}")
            named = dict(st.learner.model.named_parameters())
            for name, g in grads.items():
                if name in (STATS_KEY, EXTREMA_KEY):
                    continue
                if name not in named or tuple(g.shape) != tuple(named[name].shape):
                    raise InvalidArgument(f"handed-off gradient {name!r} does not match a model parameter")
            st.handoffs.setdefault(step, []).append(grads)
            self.membership.leave(replica_id)
        log.info("gradients handed off", replica_id=replica_id, step=step, tensors=len(grads))

    # -- views ------------------------------------------------------------------------------------
    def _require(self) -> _JobState:
        st = self._state
        if st is None:
            raise FailedPrecondition("no job has been started on this trainer")
        return st

    @property
    def job(self) -> TrainerJob:
        return self._require().job

    def _set_phase(self, phase: str) -> None:
        with self._cv:
            if self._state is not None:
                self._state.phase = phase
            self._cv.notify_all()

    def status(self) -> dict[str, Any]:
        st = self._state
        if st is None:
            return {"phase": "idle", "job_id": "", "step": -1, "weight_version": self.weights.latest,
                    "members": [], "error": ""}
        return {"phase": st.phase, "job_id": st.job.job_id, "step": st.step, "weight_version": st.version,
                "members": self.membership.members() if self.membership else [], "error": st.error,
                "num_steps": st.job.num_steps, "last": st.reports[-1].metrics if st.reports else {},
                "group": st.group.ranks() if st.group is not None else []}

    def wait_step(self, step: int, timeout_s: float) -> StepReport | None:
        """Block until ``step`` has been published (or the job ended); its report or None."""
        st = self._require()
        with self._cv:
            self._cv.wait_for(lambda: any(r.step == step for r in st.reports) or
                              st.phase in ("done", "failed", "stopped"), timeout=timeout_s)
            for r in st.reports:
                if r.step == step:
                    return r
        return None

    def model(self) -> torch.nn.Module:
        return self._require().learner.model
