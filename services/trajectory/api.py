"""Trajectory service logic (no gRPC): records in, packed micro-batches out, durable throughout.

Per step::

    ingest(records) ---------> ExecutionTree per execution (incremental), records stored as deltas
    complete(outcome) -------> group complete? --> advantages --> selected tree --> chunks --> pool
    pool --(budget full, or step sealed)--> PackedBatch --> spool + Redis --> StepQueue
    stream(consumer) / ack --> StepQueue (work queue; see steps.py)

A group is released when ``group_size`` of its outcomes arrived (declared by ``open_step``) or
when the step is sealed; the step is sealed by ``close_step`` or when its declared
``num_executions`` outcomes arrived. Loss weights need the step's execution count: the declared
one, else the number of trained executions, known at sealing.

Locks: step lock -> execution lock, never the reverse; a StepQueue has its own condition.
Restart: ``recover()`` rebuilds executions, steps, batches and acks from Redis; trees are
rebuilt lazily from the spool; chunks of released groups not yet in a batch are recomputed
(deterministic, with the step's recorded budget and path cap).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field, replace

import numpy as np
import redis
from prometheus_client import Counter, Histogram

from services.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from services.common.logging import get_logger
from services.common.metrics import REGISTRY
from services.algorithm import DEFAULT_ADVANTAGE_EPS, outcome_advantages, token_weight
from services.trajectory.config import TrajectoryConfig
from services.trajectory.packing import Chunk, PackedBatch, assemble, pack_sizes, split_tree
from services.trajectory.records import IngestSummary, Outcome, TitoCall
from services.trajectory.steps import DONE, LeaseConflict, StepPlan, StepQueue
from services.trajectory.store import BatchMeta, StepSpec, TrajectoryStore
from services.trajectory.tree import ConflictingRecord, ExecutionTree, TreeStats, UnknownBaseCall

log = get_logger(__name__)

DEFAULT_JOB = "default"

RECORDS = Counter("gyre_trajectory_records_total", "TITO records, by result.", ["result"], registry=REGISTRY)
UNIQUE_TOKENS = Counter("gyre_trajectory_unique_tokens_total", "Trie nodes created by records.", registry=REGISTRY)
RECORD_TOKENS = Counter("gyre_trajectory_record_tokens_total", "Tokens carried by records (delta form).",
                        registry=REGISTRY)
BATCHES = Counter("gyre_trajectory_batches_total", "Micro-batches packed.", registry=REGISTRY)
BATCH_TOKENS = Counter("gyre_trajectory_batch_tokens_total", "Tokens in packed micro-batches, by kind.", ["kind"],
                       registry=REGISTRY)
PACK_SECONDS = Histogram("gyre_trajectory_release_seconds", "Time to turn a released group into batches.",
                         registry=REGISTRY, buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
REHANDED = Counter("gyre_trajectory_rehanded_batches_total", "Batches returned to the queue (consumer gone).",
                   registry=REGISTRY)


@dataclass(frozen=True)
class ExecutionView:
    job_id: str
    execution_id: str
    stats: TreeStats
    num_calls: int
    unique_tokens: int
    complete: bool
    packed: bool
    outcome: Outcome | None = None  # how it ended and its reward, once in


@dataclass
class _Execution:
    job_id: str
    execution_id: str
    lock: threading.Lock = field(default_factory=threading.Lock)
    tree: ExecutionTree | None = None
    num_calls: int = 0
    outcome: Outcome | None = None
    packed: bool = False
    stats: TreeStats | None = None
    known_calls: set[str] | None = None  # call ids, kept once the tree is dropped
    attempt: int | None = None  # lease attempt of its records (None: not read from storage yet)


@dataclass
class _Ready:
    """A released, trained execution whose chunks are (being) packed."""

    advantage: float
    num_trainable: int


@dataclass
class _Step:
    job_id: str
    step: int
    spec: StepSpec
    queue: StepQueue
    lock: threading.RLock = field(default_factory=threading.RLock)
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    groups: dict[str, list[str]] = field(default_factory=dict)
    released: set[str] = field(default_factory=set)
    ready: dict[str, _Ready] = field(default_factory=dict)
    pool: list[tuple[str, int, Chunk]] = field(default_factory=list)
    next_batch: int = 0
    num_tokens: int = 0
    context_tokens: int = 0
    collected: bool = False
    settled: bool = False  # the trainer declared the step's result final (payloads may go)


class TrajectoryApi:
    """The service's state and operations. Thread-safe. Lifecycle: construct -> ``recover()`` -> use."""

    def __init__(self, config: TrajectoryConfig, store: TrajectoryStore, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = config
        self.store = store
        self._clock = clock
        self._lock = threading.Lock()
        self._executions: dict[tuple[str, str], _Execution] = {}
        self._steps: dict[tuple[str, int], _Step] = {}

    # ================================================================= records
    def ingest(self, calls: Iterable[TitoCall]) -> IngestSummary:
        """Validate, insert and store records (see trajectory.proto IngestRecords)."""
        accepted = duplicates = new_tokens = record_tokens = 0
        touched: set[tuple[str, str]] = set()
        for call in calls:
            self._check_limits(call)
            job = call.job_id or DEFAULT_JOB
            ex = self._execution(job, call.execution_id)
            touched.add((job, call.execution_id))
            with ex.lock:
                if ex.packed:
                    if call.call_id in self._known_calls(ex):  # a resend of a record that made it in time
                        duplicates += 1
                        RECORDS.labels("duplicate").inc()
                        continue
                    raise FailedPrecondition(
                        f"execution {call.execution_id!r} of job {job!r} was already packed for training; "
                        f"record {call.call_id!r} arrived too late")
                if call.attempt:
                    self._check_attempt(ex, call)
                tree = self._tree(ex)
                try:
                    ins = tree.add(call)
                except ConflictingRecord as exc:
                    RECORDS.labels("conflict").inc()
                    raise AlreadyExists(str(exc)) from None
                except UnknownBaseCall as exc:
                    RECORDS.labels("unknown_base").inc()
                    raise FailedPrecondition(str(exc)) from None
                if ins.duplicate:
                    duplicates += 1
                    RECORDS.labels("duplicate").inc()
                    continue
                try:
                    self.store.append_call(job, call, ins.index, ins.delta)
                except (redis.RedisError, OSError) as exc:
                    ex.tree = None  # the in-memory tree is ahead of storage: rebuild it from storage next time
                    raise Unavailable(f"cannot store record {call.call_id!r}: {exc}") from None
                ex.num_calls += 1
                if ins.retry:
                    log.info("a model call was retried after its answer was lost; both outputs are kept",
                             job_id=job, execution_id=call.execution_id, call_id=call.call_id)
            accepted += 1
            new_tokens += ins.new_nodes
            record_tokens += len(ins.delta.new_ids) + len(call.output_ids)
            RECORDS.labels("retry" if ins.retry else "accepted").inc()
        UNIQUE_TOKENS.inc(new_tokens)
        RECORD_TOKENS.inc(record_tokens)
        return IngestSummary(accepted, duplicates, new_tokens, record_tokens, len(touched))

    def _check_attempt(self, ex: _Execution, call: TitoCall) -> None:
        """A record of a later lease attempt starts the execution over; one of an earlier attempt
        is refused (that attempt was superseded: its process may still be sending). Holds ex.lock."""
        if ex.attempt is None:
            ex.attempt = self.store.attempt(ex.job_id, ex.execution_id)
        if call.attempt < ex.attempt:
            RECORDS.labels("superseded").inc()
            raise FailedPrecondition(
                f"record {call.call_id!r} is from attempt {call.attempt} of execution {ex.execution_id!r}, "
                f"which attempt {ex.attempt} superseded; it is not recorded")
        if call.attempt == ex.attempt:
            return
        if ex.outcome is not None:
            raise FailedPrecondition(
                f"execution {ex.execution_id!r} has ended (attempt {ex.attempt}); a record of attempt "
                f"{call.attempt} cannot start it over")
        dropped = ex.num_calls if ex.tree is not None else self.store.num_calls(ex.job_id, ex.execution_id)
        self.store.start_attempt(ex.job_id, ex.execution_id, call.attempt, drop=dropped > 0)
        if dropped:
            log.warning("records of an earlier attempt superseded", job_id=ex.job_id, execution_id=ex.execution_id,
                        attempt=call.attempt, previous=ex.attempt, dropped_records=dropped)
        ex.attempt, ex.tree, ex.num_calls, ex.known_calls, ex.stats = call.attempt, None, 0, None, None

    def _check_limits(self, call: TitoCall) -> None:
        if call.stored_tokens > self.cfg.max_record_tokens:
            raise InvalidArgument(
                f"record {call.call_id!r} carries {call.stored_tokens} tokens, more than max_record_tokens "
                f"({self.cfg.max_record_tokens}); send the prompt delta-encoded")
        if self.cfg.vocab_size:
            head = call.prompt_ids if call.prompt_ids is not None else call.delta.new_ids  # type: ignore[union-attr]
            for what, arr in (("prompt", head), ("output", call.output_ids)):
                if arr.size and int(arr.max()) >= self.cfg.vocab_size:
                    raise InvalidArgument(
                        f"record {call.call_id!r}: {what} token id {int(arr.max())} is outside the vocabulary "
                        f"(vocab_size {self.cfg.vocab_size})")

    def _execution(self, job: str, eid: str) -> _Execution:
        with self._lock:
            ex = self._executions.get((job, eid))
            if ex is None:
                ex = self._executions[(job, eid)] = _Execution(job, eid)
            return ex

    def _known_calls(self, ex: _Execution) -> set[str]:
        """Call ids of a packed execution (its tree is gone; resends are recognised by id only)."""
        if ex.known_calls is None:
            ex.known_calls = self.store.call_ids(ex.job_id, ex.execution_id)
        return ex.known_calls

    def _tree(self, ex: _Execution) -> ExecutionTree:
        """The execution's tree, rebuilt from storage when not in memory. Caller holds ex.lock."""
        if ex.tree is None:
            ex.tree = self._load_tree(ex.job_id, ex.execution_id)
            ex.num_calls = len(ex.tree.calls)
        return ex.tree

    def _load_tree(self, job: str, eid: str) -> ExecutionTree:
        calls = self.store.load_calls(job, eid)
        tree = ExecutionTree(eid, capacity=max(1024, sum(c.stored_tokens for c in calls)))
        for c in calls:
            tree.add(c)
        return tree

    # ================================================================= outcomes and stats
    def complete(self, outcome: Outcome) -> tuple[bool, StepPlan]:
        """Record the end of an execution; releases its group / seals its step when complete."""
        job = outcome.job_id or DEFAULT_JOB
        outcome = replace(outcome, job_id=job)
        st = self._step(job, outcome.step)
        with st.lock:
            ex = self._execution(job, outcome.execution_id)
            with ex.lock:
                if ex.outcome is not None:
                    if ex.outcome == outcome:
                        return True, self._plan(st)
                    raise AlreadyExists(
                        f"execution {outcome.execution_id!r} of job {job!r} already completed with a different "
                        f"outcome ({_describe(ex.outcome)}); got ({_describe(outcome)})")
                if st.spec.sealed:
                    raise FailedPrecondition(
                        f"step {outcome.step} of job {job!r} is closed; the outcome of {outcome.execution_id!r} "
                        "came too late for it")
                if outcome.group_id in st.released:
                    raise FailedPrecondition(
                        f"group {outcome.group_id!r} of step {outcome.step} was already released with "
                        f"{st.spec.group_size} executions; {outcome.execution_id!r} would exceed group_size")
                self.store.put_outcome(job, outcome)
                ex.outcome = outcome
            self._add_outcome(st, outcome)
            self._advance(st)
            return False, self._plan(st)

    def execution_stats(self, job: str, eid: str, max_paths: int = 0) -> ExecutionView:
        job = job or DEFAULT_JOB
        with self._lock:
            ex = self._executions.get((job, eid))
        if ex is None:
            raise NotFound(f"execution {eid!r} of job {job!r} has no records and no outcome")
        cap = max_paths or self.cfg.path_cap
        with ex.lock:
            if ex.tree is not None or not ex.packed:
                tree = self._tree(ex)
                return ExecutionView(job, eid, tree.stats(cap), len(tree.calls), tree.num_nodes,
                                     ex.outcome is not None, ex.packed, ex.outcome)
            cached = self.store.stats(job, eid)
            if cached is not None and cap == _cap(cached.get("max_paths", 0)):
                stats = TreeStats(cached["paths"], cached["naive_tokens"], cached["tree_tokens"],
                                  cached["trainable_tokens"])
                return ExecutionView(job, eid, stats, ex.num_calls, cached["unique_tokens"], True, True, ex.outcome)
            if ex.num_calls and not self.store.num_calls(job, eid):
                raise FailedPrecondition(
                    f"the records of execution {eid!r} were deleted after its step was consumed; only its stats "
                    "for the path cap it was trained with remain")
            tree = self._load_tree(job, eid)  # packed and evicted: rebuild a temporary tree
            return ExecutionView(job, eid, tree.stats(cap), len(tree.calls), tree.num_nodes, True, True, ex.outcome)

    # ================================================================= steps
    def open_step(self, job: str, step: int, *, num_executions: int = 0, group_size: int = 0,
                  token_budget: int = 0, normalize_advantages: bool = False, advantage_eps: float = 0.0) -> StepPlan:
        job = job or DEFAULT_JOB
        if num_executions < 0 or group_size < 0 or token_budget < 0 or step < 0:
            raise InvalidArgument("step, num_executions, group_size and token_budget must be >= 0")
        if group_size and num_executions and num_executions % group_size:
            raise InvalidArgument(f"num_executions ({num_executions}) must be a multiple of group_size ({group_size})")
        if token_budget and token_budget < 16:
            raise InvalidArgument(f"token_budget {token_budget} is too small; use at least 16 tokens")
        if not (advantage_eps >= 0 and math.isfinite(advantage_eps)):
            raise InvalidArgument(f"advantage_eps is {advantage_eps}; expected a finite number >= 0 (0: the default)")
        st = self._step(job, step)
        with st.lock:
            spec = st.spec
            wanted = replace(spec, num_executions=num_executions or spec.num_executions,
                             group_size=group_size or spec.group_size, token_budget=token_budget or spec.token_budget,
                             normalize_advantages=normalize_advantages or spec.normalize_advantages,
                             advantage_eps=advantage_eps or spec.advantage_eps)
            changed = [f for f in ("num_executions", "group_size", "token_budget")
                       if getattr(spec, f) and getattr(spec, f) != getattr(wanted, f)]
            if changed or (spec.sealed and wanted != spec):
                raise FailedPrecondition(
                    f"step {step} of job {job!r} is already open with num_executions={spec.num_executions}, "
                    f"group_size={spec.group_size}, token_budget={spec.token_budget}, sealed={spec.sealed}; "
                    f"cannot change {', '.join(changed) or 'a sealed step'}")
            if wanted.num_executions and wanted.num_executions < len(st.outcomes):
                raise FailedPrecondition(
                    f"step {step} of job {job!r} already has {len(st.outcomes)} outcomes; it cannot be declared with "
                    f"num_executions={wanted.num_executions}")
            if wanted != spec:
                st.spec = wanted
                self.store.put_step(job, step, wanted)
            self._advance(st)
            return self._plan(st)

    def close_step(self, job: str, step: int) -> StepPlan:
        job = job or DEFAULT_JOB
        st = self._step(job, step)
        with st.lock:
            if not st.spec.sealed:
                self._seal(st)
            return self._plan(st)

    def plan(self, job: str, step: int) -> StepPlan:
        st = self._step(job or DEFAULT_JOB, step)
        with st.lock:
            return self._plan(st)

    def _step(self, job: str, step: int) -> _Step:
        if step < 0:
            raise InvalidArgument(f"step {step} must be >= 0")
        with self._lock:
            st = self._steps.get((job, step))
            if st is None:
                queue = StepQueue(lease_s=self.cfg.batch_lease_s, max_in_flight=self.cfg.max_in_flight,
                                  clock=self._clock)
                st = self._steps[(job, step)] = _Step(job, step, StepSpec(), queue)
            return st

    def _add_outcome(self, st: _Step, outcome: Outcome) -> None:
        st.outcomes[outcome.execution_id] = outcome
        st.groups.setdefault(outcome.group_id, []).append(outcome.execution_id)

    def _advance(self, st: _Step) -> None:
        """Release complete groups and seal a fully reported step. Caller holds st.lock."""
        spec = st.spec
        if spec.sealed:
            return
        if spec.group_size and spec.num_executions:
            full = [g for g, members in st.groups.items() if g not in st.released and len(members) >= spec.group_size]
            if full:
                self._release(st, full)
                self._emit(st, final=False)
        if spec.num_executions and len(st.outcomes) >= spec.num_executions:
            self._seal(st)

    def _seal(self, st: _Step) -> None:
        pending = [g for g in st.groups if g not in st.released]
        if pending:
            self._release(st, pending)
        st.spec = replace(st.spec, sealed=True, token_budget=self._budget(st))
        self.store.put_step(st.job_id, st.step, st.spec)
        self._emit(st, final=True)
        st.queue.seal()
        log.info("step sealed", job_id=st.job_id, step=st.step, batches=st.next_batch, executions=len(st.outcomes),
                 trained=len(st.ready))
        self._maybe_collect(st)

    def _budget(self, st: _Step) -> int:
        return st.spec.token_budget or self.cfg.token_budget

    def _kv_budget(self, st: _Step) -> int:
        """The step's kv budget: its own once fixed, else the service's (never below its token budget)."""
        kv = st.spec.kv_budget_tokens if st.spec.kv_budget_tokens >= 0 else self.cfg.kv_budget_tokens
        return max(kv, self._budget(st)) if kv else 0

    def _release(self, st: _Step, groups: list[str]) -> None:
        """Pack the executions of complete ``groups`` into the step's pool. Caller holds st.lock."""
        t0 = time.perf_counter()
        if not st.spec.token_budget or not st.spec.max_paths or not st.spec.tree_split or st.spec.kv_budget_tokens < 0:
            # fix budget, path cap (-1 = all paths) and split at the first release, so a restart
            # recomputes identical chunks
            st.spec = replace(st.spec, token_budget=self._budget(st),
                              max_paths=st.spec.max_paths or self.cfg.max_paths or -1,
                              tree_split=st.spec.tree_split or self.cfg.tree_split,
                              kv_budget_tokens=self._kv_budget(st))
            self.store.put_step(st.job_id, st.step, st.spec)
        self.store.mark_released(st.job_id, st.step, groups)
        for g in groups:
            self._prepare(st, g, emitted=frozenset())
        PACK_SECONDS.observe(time.perf_counter() - t0)
        log.info("groups released", job_id=st.job_id, step=st.step, groups=groups, pool_chunks=len(st.pool))

    def _prepare(self, st: _Step, group: str, *, emitted: frozenset[tuple[str, int]]) -> None:
        """Advantages, selected trees and chunks of one group's executions (chunks not in ``emitted``)."""
        st.released.add(group)
        members = [st.outcomes[e] for e in st.groups.get(group, [])]
        adv = outcome_advantages(members, normalize_std=st.spec.normalize_advantages,
                                 eps=st.spec.advantage_eps or DEFAULT_ADVANTAGE_EPS)
        cap = _cap(st.spec.max_paths)
        for o in members:
            ex = self._execution(st.job_id, o.execution_id)
            with ex.lock:
                arrays = None
                if o.trained:
                    tree = ex.tree if ex.tree is not None else self._load_tree(st.job_id, o.execution_id)
                    arrays = tree.arrays(cap)
                    ex.stats = tree.stats(cap)
                    self.store.put_stats(st.job_id, o.execution_id, {
                        **ex.stats.as_dict(), "unique_tokens": tree.num_nodes, "max_paths": st.spec.max_paths})
                ex.packed = True
                if ex.tree is not None:
                    ex.known_calls = {c.call_id for c in ex.tree.calls}
                ex.tree = None  # trained or not, its records are no longer needed in memory
            if arrays is None or not arrays.num_trainable:
                if o.trained:
                    log.warning("trained execution has no generated tokens; nothing to train on", job_id=st.job_id,
                                step=st.step, execution_id=o.execution_id, calls=ex.num_calls)
                continue
            st.ready[o.execution_id] = _Ready(adv[o.execution_id], arrays.num_trainable)
            split = st.spec.tree_split or self.cfg.tree_split
            for i, chunk in enumerate(split_tree(o.execution_id, arrays, self._budget(st), split=split,
                                                 kv_budget=self._kv_budget(st))):
                if (o.execution_id, i) not in emitted:
                    st.pool.append((o.execution_id, i, chunk))

    def _denominator(self, st: _Step) -> int:
        if st.spec.num_executions:
            return st.spec.num_executions
        return len(st.ready) if st.spec.sealed else 0

    def _emit(self, st: _Step, *, final: bool) -> None:
        """Pack the pool into micro-batches; unless ``final``, the least-filled bin waits for more chunks."""
        if not st.pool:
            return
        budget = self._budget(st)
        denom = self._denominator(st)
        if denom == 0:
            return
        bins = pack_sizes([c.size for _, _, c in st.pool], budget)
        keep: list[int] = []
        if not final:
            fill = [sum(st.pool[i][2].size for i in b) for b in bins]
            low = int(np.argmin(fill))
            if fill[low] < budget:
                keep = bins.pop(low)
        for b in bins:
            entries = [st.pool[i] for i in b]
            chunks = [c for _, _, c in entries]
            eids = {e for e, _, _ in entries}
            batch = assemble(chunks, step=st.step, advantages={e: st.ready[e].advantage for e in eids},
                             token_weights={e: token_weight(st.ready[e].num_trainable, denom) for e in eids},
                             token_budget=budget)
            batch.validate()
            context = sum(len(c.context) for c in chunks)
            batch_id = f"s{st.step}-b{st.next_batch:05d}"
            meta = BatchMeta(batch_id, self.store.batch_blob_key(st.job_id, st.step, batch_id), len(batch),
                             int(batch.trainable.sum()), context, batch.execution_ids,
                             tuple((e, i) for e, i, _ in entries))
            self.store.add_batch(st.job_id, st.step, meta, batch.to_bytes())
            st.queue.add(meta)
            st.next_batch += 1
            st.num_tokens += len(batch)
            st.context_tokens += context
            BATCHES.inc()
            BATCH_TOKENS.labels("context").inc(context)
            BATCH_TOKENS.labels("tree").inc(len(batch) - context)
        st.pool = [st.pool[i] for i in keep]

    def _plan(self, st: _Step) -> StepPlan:
        _, _, acked = st.queue.counts()
        trained = sum(1 for o in st.outcomes.values() if o.trained)
        return StepPlan(st.job_id, st.step, self._denominator(st), len(st.outcomes), trained, st.next_batch, acked, st.spec.sealed,
                        st.queue.done, self._budget(st), st.num_tokens, st.context_tokens, st.spec.group_size,
                        st.queue.acked_tokens())

    # ================================================================= trainer side
    def stream(self, job: str, step: int, consumer: str, token_budget: int = 0, *,
               is_active: Callable[[], bool] = lambda: True) -> Generator[tuple[BatchMeta, PackedBatch, int], None, None]:
        """Micro-batches of a step for ``consumer`` as (meta, batch, loss-weight denominator) until the
        step is consumed. Closing the iterator returns the consumer's unacknowledged batches."""
        job = job or DEFAULT_JOB
        if not consumer:
            raise InvalidArgument("consumer_id is required (a stable id of the trainer replica)")
        if token_budget < 0:
            raise InvalidArgument(f"token_budget {token_budget} must be >= 0")
        st = self._step(job, step)
        with st.lock:
            if token_budget:
                if not st.spec.token_budget and not st.next_batch:
                    st.spec = replace(st.spec, token_budget=max(16, token_budget))
                    self.store.put_step(job, step, st.spec)
                elif token_budget < self._budget(st):
                    raise InvalidArgument(
                        f"step {step} of job {job!r} is packed with token_budget {self._budget(st)}; consumer "
                        f"{consumer!r} accepts only {token_budget}")
        return self._stream(st, consumer, is_active)

    def _stream(self, st: _Step, consumer: str,
                is_active: Callable[[], bool]) -> Generator[tuple[BatchMeta, PackedBatch, int], None, None]:
        bound = log.bind(job_id=st.job_id, step=st.step, consumer_id=consumer)
        try:
            while is_active():
                item = st.queue.lease(consumer, timeout_s=self.cfg.stream_poll_s)
                if item is DONE:
                    return
                if item is None:
                    continue
                assert isinstance(item, BatchMeta)
                batch = PackedBatch.from_bytes(self.store.load_batch(item))
                yield item, batch, self._denominator(st)
        finally:
            returned = st.queue.release(consumer)
            if returned:
                REHANDED.inc(returned)
                bound.warning("consumer left with unacknowledged batches; re-queued", batches=returned)

    def ack(self, job: str, step: int, batch_id: str, consumer: str) -> tuple[bool, StepPlan]:
        job = job or DEFAULT_JOB
        st = self._step(job, step)
        try:
            fresh = st.queue.ack(batch_id, consumer)
        except KeyError:
            raise NotFound(f"step {step} of job {job!r} has no batch {batch_id!r}") from None
        except LeaseConflict as exc:
            raise FailedPrecondition(str(exc)) from None
        if fresh:
            self.store.ack(job, step, batch_id)
        with st.lock:
            self._maybe_collect(st)
            return fresh, self._plan(st)

    def settle(self, job: str, step: int, reopen: Iterable[str] = ()) -> tuple[int, StepPlan]:
        """The trainer's verdict on a consumed step (see ``SettleStep``): reopen the batches the
        given consumers acknowledged, or (none given) mark the step final and collect it."""
        job = job or DEFAULT_JOB
        if step < 0:
            raise InvalidArgument(f"step {step} must be >= 0")
        with self._lock:
            st = self._steps.get((job, step))  # recover() rebuilt every step a restart knew
        if st is None:
            raise NotFound(f"step {step} of job {job!r} was never opened here; nothing to settle")
        consumers = {c for c in reopen if c}
        with st.lock:
            if not consumers:
                st.settled = True
                self._maybe_collect(st)
                return 0, self._plan(st)
            if st.collected:
                raise FailedPrecondition(f"step {step} of job {job!r} is settled and its payloads are collected; "
                                         f"its batches cannot be reopened")
            ids = st.queue.reopen(consumers)
            self.store.unack(job, step, ids)
            if ids:
                REHANDED.inc(len(ids))
                log.warning("batches of lost consumers reopened", job_id=job, step=step, batches=len(ids),
                            consumers=sorted(consumers))
            return len(ids), self._plan(st)

    def _maybe_collect(self, st: _Step) -> None:
        if self.cfg.collect_done_steps and st.queue.done and st.settled and not st.collected:
            st.collected = True
            n = self.store.collect_step(st.job_id, st.step, list(st.outcomes), st.queue.metas.values())
            log.info("step consumed; spool payloads deleted", job_id=st.job_id, step=st.step, blobs=n)

    # ================================================================= restart
    def recover(self) -> None:
        """Rebuild the in-memory view from Redis (call once, before serving)."""
        for job in self.store.jobs():
            for eid in self.store.executions(job):
                ex = self._execution(job, eid)
                ex.num_calls = self.store.num_calls(job, eid)
                ex.outcome = self.store.outcome(job, eid)
            for step in self.store.steps(job):
                try:
                    self._recover_step(job, step)
                except (KeyError, OSError) as exc:
                    # Its spool payloads are gone (another spool dir, a wiped disk): that step cannot
                    # be rebuilt, but every other job and step can, so the service still starts.
                    log.error("step cannot be rebuilt: its spool payloads are missing; it is left as is",
                              job_id=job, step=step, spool=str(self.store.blobs.root), error=str(exc))
        log.info("recovered", executions=len(self._executions), steps=len(self._steps))

    def _recover_step(self, job: str, step: int) -> None:
        st = self._step(job, step)
        with st.lock:
            st.spec = self.store.step_spec(job, step) or StepSpec()
            with self._lock:
                mine = [ex.outcome for (j, _), ex in self._executions.items()
                        if j == job and ex.outcome is not None and ex.outcome.step == step]
            for o in mine:
                self._add_outcome(st, o)
            metas = self.store.batches(job, step)
            acked = self.store.acked(job, step)
            for m in metas:
                st.queue.add(m, acked=m.batch_id in acked)
                st.num_tokens += m.num_tokens
                st.context_tokens += m.context_tokens
            st.next_batch = len(metas)
            released = self.store.released(job, step)
            if st.spec.sealed and len(acked) == len(metas):  # consumed: nothing to rebuild
                st.released = released
                for o in mine:
                    self._execution(job, o.execution_id).packed = True
                st.queue.seal()
                # settled before the restart iff its payloads are gone (settling collects them)
                st.collected = bool(metas) and not self.store.blobs.exists(metas[0].blob_key)
                st.settled = st.collected
                return
            emitted = frozenset(ref for m in metas for ref in m.chunks)
            for g in sorted(released):
                self._prepare(st, g, emitted=emitted)
            if st.spec.sealed:
                self._emit(st, final=True)
                st.queue.seal()
            else:
                self._emit(st, final=False)
                self._advance(st)


def _cap(max_paths: int) -> int | None:
    """A stored path cap (0 = not fixed, -1 = all paths) as the tree API takes it."""
    return max_paths if max_paths > 0 else None


def _describe(o: Outcome) -> str:
    return (f"group {o.group_id!r}, status {o.status.name.lower()}, reward {o.reward}, excluded {o.excluded}, "
            f"step {o.step}")
