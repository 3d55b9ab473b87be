"""Elastic data parallelism: per-step membership, sealing, and the gradient all-reduce.

The weights are fixed during a step (one update at its end), so a replica that joins mid-step
only needs the current weights; it then pulls micro-batches from the same work queue as
everyone else and accumulates gradient *sums*. When the step's batch is consumed, the step's
participants arrive (under the prefix ``gyre/<job>/step/<s>`` of the core's TCPStore) and all-reduce
(SUM) their gradients in a process group (gloo on CPU, NCCL on GPU); the core applies the optimizer
and publishes version s+1. The process group is kept while the participants stay the same: the
seal names the previous one (``Seal.pg_prefix``) when every participant says it holds it
(``KeptGroup``), else a new one under ``<step prefix>/pg`` (building an NCCL group costs seconds).

    core (rank 0)                         replica R (joined mid-step)
    open_step(s, v) ─────────────┐        JoinStep ─> ticket(step s, version v, store addr)
    train micro-batches          │        GetWeights(v); train micro-batches
    queue exhausted: core_done(s)│        queue exhausted: AwaitReduce(s) (blocks)
      waits for every member  <──┴──────── done(R, s)
      seal: ranks 0..k, world ─────────────> (rank, world)
    all-reduce SUM  <══════════ gloo/NCCL ══════════> all-reduce SUM
    optimizer.step, publish v+1           re-JoinStep for s+1 (GetWeights v+1) or leave

A sharded job's participants are groups of N ranks (services.trainer.group): the membership and
the arrival are the groups' rank 0 processes'; the all-reduce is N process groups, one per shard
index r, under ``<prefix>/shard<r>``, each of one rank per group (HSDP).

``StepMembership`` lifecycle per step: OPEN (joins land in this step) -> SEALED (world fixed;
joins land in the next step) -> next ``open_step``. A member that leaves before the seal is
dropped (it hands its gradient sum to the core first, see ``Learner.add_grads``). A member whose
process is gone is evicted once the core is done: at once when the core knows its process died
(one it started), after ``silence_s`` without a ReplicaAlive heartbeat (any replica, on any host:
every replica heartbeats every ``heartbeat_interval_s`` from a thread of its own), and in any case
when it has not reported within ``member_timeout_s`` of the core being done.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from services.common.errors import Aborted, FailedPrecondition, NotFound, Unavailable
from services.common.logging import get_logger

log = get_logger(__name__)


@dataclass(frozen=True)
class JoinTicket:
    """What a joining replica needs: which step it is in and which weights to pull."""

    step: int
    weight_version: int
    store_host: str
    store_port: int
    group_prefix: str
    heartbeat_interval_s: float = 0.0  # call ReplicaAlive this often (0: the core expects none)
    handoff_dir: str = ""  # the core's shared-memory hand-off folder and its token ("": stream)
    handoff_token: str = ""


@dataclass(frozen=True)
class Seal:
    """A participant's place in the step's process group."""

    step: int
    rank: int
    world_size: int
    group_prefix: str
    release: bool = False  # the orchestrator asked for this replica's cell back after the step
    pg_prefix: str = ""  # the process group's store prefix ("": the step's own, group_prefix)

    @property
    def pg(self) -> "Seal":
        """This seal with the process group's prefix as its prefix (what ``open_group`` builds, and
        what ``KeptGroup`` keeps it under)."""
        return Seal(step=self.step, rank=self.rank, world_size=self.world_size,
                    group_prefix=self.pg_prefix or self.group_prefix, release=self.release)


@dataclass
class _Member:
    replica_id: str
    cell_id: str
    step: int
    joined_at: float
    heard_at: float = 0.0  # last sign of life (join, ReplicaAlive), monotonic
    done: bool = False
    left: bool = False
    evicted: bool = False
    release: bool = False
    rank: int = -1
    held_pg: str = ""  # the process group it kept from its last all-reduce (its report at done)


@dataclass
class _StepState:
    step: int
    version: int
    sealed: bool = False
    core_done: bool = False
    world: int = 0
    pg_prefix: str = ""
    members: dict[str, _Member] = field(default_factory=dict)


class StepMembership:
    """Thread-safe registry of the replicas taking part in each step (lives in the core)."""

    def __init__(self, *, job_id: str, store_host: str, store_port: int, member_timeout_s: float = 300.0,
                 silence_s: float = 20.0, is_alive: Callable[[str], bool | None] = lambda _rid: None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.job_id = job_id
        # a member not heard from this long is gone (0: never judged by silence)
        self.silence_s = silence_s
        self.clock = clock
        # replica id -> False once its process is known dead (True / None: alive / not known here)
        self.is_alive = is_alive
        self.store_host = store_host
        self.store_port = store_port
        self.member_timeout_s = member_timeout_s
        self._cv = threading.Condition()
        self._current: _StepState | None = None
        self._next: dict[str, _Member] = {}  # joined while the current step was sealed
        self._released: set[str] = set()
        self._closed = False
        # the last sealed all-reduce's process group and participants (a group kept while they stay)
        self._pg_prefix = ""
        self._pg_members: tuple[str, ...] = ()

    def prefix(self, step: int) -> str:
        return f"gyre/{self.job_id}/step/{step}"

    # -- core side --------------------------------------------------------------------------------
    def open_step(self, step: int, version: int) -> None:
        """Start ``step`` with weights ``version``; replicas that joined during the seal move in."""
        with self._cv:
            state = _StepState(step=step, version=version)
            for m in self._next.values():
                m.step = step
                state.members[m.replica_id] = m
            self._next = {}
            self._current = state
            self._cv.notify_all()

    def core_done(self, step: int, held_pg: str = "") -> Seal:
        """The core consumed its share: wait for every member, seal the world, return rank 0's seal
        (``held_pg``: the process group the core kept from its last all-reduce)."""
        with self._cv:
            state = self._state(step)
            state.core_done = True
            deadline = time.monotonic() + self.member_timeout_s
            while True:
                for m in state.members.values():
                    # its process died (also after reporting done: it cannot all-reduce): no waiting
                    gone = None if (m.left or m.evicted) else self._gone(m)
                    if gone:
                        m.evicted = True
                        log.warning("replica evicted", replica_id=m.replica_id, cell_id=m.cell_id, step=step,
                                    reason=gone)
                pending = [m for m in state.members.values() if not (m.done or m.left or m.evicted)]
                if not pending:
                    break
                if self._closed:  # the job is stopping: nothing more will come for them to train
                    for m in pending:
                        m.evicted = True
                        log.warning("replica evicted", replica_id=m.replica_id, cell_id=m.cell_id, step=step,
                                    reason="the trainer job is stopping")
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    for m in pending:
                        m.evicted = True
                        log.warning("replica evicted", replica_id=m.replica_id, cell_id=m.cell_id, step=step,
                                    reason=f"no report within {self.member_timeout_s}s")
                    break
                self._cv.wait(timeout=min(left, 1.0))
            ranked = sorted((m for m in state.members.values() if m.done and not (m.left or m.evicted)),
                            key=lambda m: (m.joined_at, m.replica_id))
            for rank, m in enumerate(ranked, start=1):
                m.rank = rank
                m.release = m.replica_id in self._released
            state.world = len(ranked) + 1
            state.sealed = True
            members = tuple(m.replica_id for m in ranked)
            kept = bool(members) and members == self._pg_members and bool(self._pg_prefix) and \
                held_pg == self._pg_prefix and all(m.held_pg == self._pg_prefix for m in ranked)
            self._pg_prefix = (self._pg_prefix if kept else f"{self.prefix(step)}/pg") if members else ""
            self._pg_members = members
            state.pg_prefix = self._pg_prefix
            self._cv.notify_all()
            return Seal(step=step, rank=0, world_size=state.world, group_prefix=self.prefix(step),
                        pg_prefix=state.pg_prefix)

    # -- replica side (called from the gRPC servicer) ---------------------------------------------
    def join(self, replica_id: str, cell_id: str) -> JoinTicket:
        """Register ``replica_id`` in the current step if it is open, else in the next one."""
        if not replica_id:
            raise ValueError("replica_id must be non-empty")
        with self._cv:
            if self._closed:
                raise FailedPrecondition("the trainer job is stopping; no new replicas")
            state = self._current
            if state is None:
                raise FailedPrecondition("no step is running yet; start a job first")
            if replica_id in state.members and not (state.members[replica_id].left or state.sealed):
                return self._ticket(state.step, state.version)  # idempotent retry
            now = self.clock()
            member = _Member(replica_id=replica_id, cell_id=cell_id, step=state.step, joined_at=now, heard_at=now)
            if state.sealed:
                member.step = state.step + 1
                self._next[replica_id] = member
                log.info("replica joined next step", replica_id=replica_id, cell_id=cell_id, step=member.step)
                return self._ticket(state.step + 1, state.version + 1)
            state.members[replica_id] = member
            log.info("replica joined", replica_id=replica_id, cell_id=cell_id, step=state.step)
            return self._ticket(state.step, state.version)

    def heard(self, replica_id: str) -> bool:
        """A ReplicaAlive heartbeat of ``replica_id``; False when it is in no open or next step."""
        with self._cv:
            m = self._member(replica_id)
            if m is None:
                return False
            m.heard_at = self.clock()
            return True

    def done(self, replica_id: str, step: int, timeout_s: float | None = None, held_pg: str = "") -> Seal:
        """A replica consumed its share of ``step``: block until the world is sealed, return its rank
        (``held_pg``: the process group it kept from its last all-reduce)."""
        with self._cv:
            nxt = self._next.get(replica_id)
            if nxt is not None and nxt.step == step:
                # it joined the next step while the current one was sealed and consumed its share
                # before the core opened that step (the core still reduces and publishes the
                # sealed one): wait for the core to open it, which moves the replica in
                self._cv.wait_for(lambda: self._closed or replica_id not in self._next, timeout=timeout_s)
            state = self._state(step)
            m = state.members.get(replica_id)
            if m is None:
                raise NotFound(f"replica {replica_id!r} is not a member of step {step}")
            if m.evicted or m.left:
                raise FailedPrecondition(f"replica {replica_id!r} was {'evicted from' if m.evicted else 'left'} "
                                         f"step {step}")
            m.done = True
            m.held_pg = held_pg
            self._cv.notify_all()
            ok = self._cv.wait_for(lambda: state.sealed or self._closed, timeout=timeout_s)
            if not ok or not state.sealed:
                raise Unavailable(f"step {step} was not sealed in time")
            if m.evicted:
                raise FailedPrecondition(f"replica {replica_id!r} was evicted from step {step}")
            return Seal(step=step, rank=m.rank, world_size=state.world, group_prefix=self.prefix(step),
                        release=m.release, pg_prefix=state.pg_prefix)

    def leave(self, replica_id: str) -> int:
        """Drop ``replica_id`` from the open step (and the next); returns the step it left."""
        with self._cv:
            nxt = self._next.pop(replica_id, None)
            self._released.discard(replica_id)
            if nxt is not None:
                # it joined the next step after taking part in the sealed one's all-reduce (a
                # replica joins again only after its reduce): nothing of the sealed step waits on it
                self._cv.notify_all()
                log.info("replica left", replica_id=replica_id, step=nxt.step)
                return nxt.step
            state = self._current
            if state is None or replica_id not in state.members:
                return -1
            m = state.members[replica_id]
            if state.sealed and m.done and not m.evicted:
                raise FailedPrecondition(f"step {state.step} is sealed with replica {replica_id!r} in it; "
                                         f"it must take part in the all-reduce before leaving")
            m.left = True
            self._cv.notify_all()
            log.info("replica left", replica_id=replica_id, step=state.step)
            return state.step

    def release(self, replica_id: str) -> bool:
        """Ask for ``replica_id``'s cell back after the step it is in; False if unknown. (A replica
        process this core started is also SIGTERMed by ReleaseReplica, so it leaves at once.)"""
        with self._cv:
            known = self._member(replica_id) is not None
            if known:
                self._released.add(replica_id)
            return known

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def sealed_gone(self, step: int) -> str:
        """Why a participant of sealed ``step`` cannot reach the all-reduce ("" while all can)."""
        with self._cv:
            s = self._current
            if s is None or s.step != step or not s.sealed:
                return ""
            for m in s.members.values():
                if m.rank > 0 and not (m.left or m.evicted):
                    why = self._gone(m)
                    if why:
                        return f"replica {m.replica_id} ({why})"
            return ""

    def call_off(self, step: int) -> list[str]:
        """The all-reduce of ``step`` was called off: every participant is evicted (their gradient
        sums never reach the core, which trains their micro-batches again); returns them."""
        with self._cv:
            s = self._current
            if s is None or s.step != step:
                return []
            out = []
            for m in s.members.values():
                if m.rank > 0 and not (m.left or m.evicted):
                    m.evicted = True
                    out.append(m.replica_id)
            self._pg_prefix, self._pg_members = "", ()  # whoever built or kept it: a new one next time
            self._cv.notify_all()
            log.warning("step's all-reduce called off; its replicas evicted", step=step, replicas=out)
            return sorted(out)

    # -- views ------------------------------------------------------------------------------------
    def members(self) -> list[dict[str, Any]]:
        with self._cv:
            out = []
            state = self._current
            groups = [(state.members.values() if state else []), self._next.values()]
            for group in groups:
                for m in group:
                    out.append({"replica_id": m.replica_id, "cell_id": m.cell_id, "step": m.step, "done": m.done,
                                "left": m.left, "evicted": m.evicted, "rank": m.rank,
                                "release": m.replica_id in self._released})
            return out

    def evicted(self, step: int) -> list[str]:
        """Replicas evicted from ``step`` (dead or silent): what they had trained never reached us."""
        with self._cv:
            s = self._current
            if s is None or s.step != step:
                return []
            return sorted(m.replica_id for m in s.members.values() if m.evicted)

    def current_step(self) -> tuple[int, int, bool] | None:
        with self._cv:
            s = self._current
            return None if s is None else (s.step, s.version, s.sealed)

    def _member(self, replica_id: str) -> _Member | None:
        s = self._current
        if s is not None and replica_id in s.members and not s.members[replica_id].left:
            return s.members[replica_id]
        return self._next.get(replica_id)

    def _state(self, step: int) -> _StepState:
        s = self._current
        if s is None or s.step != step:
            raise FailedPrecondition(f"step {step} is not the trainer's current step "
                                     f"({None if s is None else s.step})")
        return s

    def _gone(self, m: _Member) -> str:
        """Why member ``m`` can no longer take part ("" while it may)."""
        if self.is_alive(m.replica_id) is False:
            return "its process exited"
        silent = self.clock() - m.heard_at
        if self.silence_s and silent > self.silence_s:
            return f"no heartbeat for {silent:.1f}s (its process or host is gone)"
        return ""

    def _ticket(self, step: int, version: int) -> JoinTicket:
        return JoinTicket(step=step, weight_version=version, store_host=self.store_host, store_port=self.store_port,
                          group_prefix=self.prefix(step), heartbeat_interval_s=self.silence_s / 8)


# --- the collective ------------------------------------------------------------------------------

class ReduceCalledOff(Aborted):
    """A participant of the sealed step died (or went silent) before everyone reached the
    all-reduce: the core calls it off, evicts the step's replicas and trains their micro-batches
    again itself; the surviving replicas drop their gradient sums and join the next step."""


def arrive(store: Any, seal: Seal, *, timeout_s: float, gone: Callable[[], str] | None = None,
           poll_s: float = 0.01) -> None:
    """Wait until every participant of the sealed step is here, before the process group is built.

    Building a gloo/NCCL group waits for every rank's address: a rank that died after the seal
    would leave the others there until ``collective_timeout_s`` (600 s). Here each participant
    counts itself in ``<prefix>/arrived`` and polls ``<prefix>/verdict``, which is written once
    (the store's compare-and-set): "go" by the last to arrive, or "off" by the core when a sealed
    member is ``gone`` (why, "" while every one may still come) or by anyone after ``timeout_s``.
    Whichever is first stands for everyone; "off" raises ReduceCalledOff."""
    verdict = f"{seal.group_prefix}/verdict"
    if int(store.add(f"{seal.group_prefix}/arrived", 1)) >= seal.world_size:
        store.compare_set(verdict, "", "go")
    deadline = time.monotonic() + timeout_s
    while True:
        if store.check([verdict]):
            value = store.get(verdict).decode()
            if value == "go":
                return
            raise ReduceCalledOff(f"the all-reduce of step {seal.step} was called off: {value[4:]}")
        why = gone() if gone is not None else ""
        if not why and time.monotonic() > deadline:
            why = f"not every participant arrived within {timeout_s:g}s"
        if why:
            store.compare_set(verdict, "", f"off:{why}")
            continue
        time.sleep(poll_s)


class KeptGroup:
    """A participant's process group of the last all-reduce, reused while the seal names it.

    ``held`` (the kept group's prefix, "" for none) goes to the core (``core_done`` /
    ``AwaitReduce``); ``get(prefix, build)`` returns the kept group when ``prefix`` is its prefix,
    else one ``build()`` makes, kept under ``prefix``, and whether it was built (each build costs a
    rendezvous; NCCL: seconds). ``drop()`` after a failed or called-off reduce."""

    def __init__(self) -> None:
        self._prefix = ""
        self._group: object | None = None

    @property
    def held(self) -> str:
        return self._prefix

    def get(self, prefix: str, build: Callable[[], object]) -> tuple[object, bool]:
        built = self._group is None or prefix != self._prefix
        if built:
            self.drop()  # the previous one's participants changed: it goes before the new one forms
            self._group, self._prefix = build(), prefix
        return self._group, built

    def drop(self) -> None:
        self._prefix, self._group = "", None


def open_group(seal: Seal, *, store_host: str, store_port: int, backend: str,
               timeout_s: float = 600.0, store: object | None = None) -> object:
    """A fresh process group of the step's participants (no global torch.distributed state)."""
    import torch.distributed as dist

    if store is None:
        store = dist.TCPStore(store_host, store_port, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
    prefixed = dist.PrefixStore(seal.group_prefix, store)  # type: ignore[arg-type]
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "nccl":
        # As torch.distributed builds it (distributed_c10d._new_process_group_helper).
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, seal.rank, seal.world_size, opts)
    if backend != "gloo":
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    # As torch.distributed builds it, with the device chosen here (torch's stubs omit _Options).
    gloo_opts: Any = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    gloo_opts._timeout = timeout
    gloo_opts._devices = [gloo_device(store_host, store_port)]
    return dist.ProcessGroupGloo(prefixed, seal.rank, seal.world_size, gloo_opts)


def gloo_device(store_host: str, store_port: int) -> object:
    """Gloo's transport device on the interface that reaches the rendezvous store.

    Gloo's default resolves this machine's hostname, which is often 127.0.0.1 in /etc/hosts: peers
    on other hosts would then be told to dial their own loopback. GLOO_SOCKET_IFNAME, when set,
    still wins (as in torch.distributed).
    """
    import torch.distributed as dist

    from services.common.server import local_address_towards

    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "")
    if ifname:
        return dist.ProcessGroupGloo.create_device(interface=ifname.split(",")[0])
    return dist.ProcessGroupGloo.create_device(hostname=local_address_towards(store_host, store_port))


def all_reduce_step(group: object, buckets: list[list[torch.Tensor]], stats_vec: torch.Tensor,
                    extrema: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SUM the gradient buckets in place (flattened per bucket) plus the stats; MAX the extrema."""
    import torch.distributed as dist

    pg = group
    for grads in buckets:
        flat = torch.cat([g.reshape(-1) for g in grads])
        pg.allreduce([flat]).wait()  # type: ignore[attr-defined]
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset:offset + n].view_as(g))
            offset += n
    device = buckets[0][0].device if buckets else torch.device("cpu")
    stats = stats_vec.to(device)
    pg.allreduce([stats]).wait()  # type: ignore[attr-defined]
    ext = extrema.to(device)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]
    pg.allreduce([ext], opts).wait()  # type: ignore[attr-defined]
    return stats.cpu(), ext.cpu()
