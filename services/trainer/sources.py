"""Where micro-batches come from: a work queue shared by all replicas of a step (``open_source``).

Every replica (core included) calls ``next(step)`` until it returns None (the step's batch is
consumed); each micro-batch goes to exactly one caller and is acknowledged after its gradient was
accumulated. Pulling on demand is what keeps replicas in phase: a fast replica simply takes more
micro-batches, and since micro-batches are sized by a token budget, the last one any replica is
still working on when the queue runs dry is at most one micro-batch of work - all replicas reach
the all-reduce within about one micro-batch time of each other.

Implementations:
  * ``TrajectorySource`` (services/trainer/trajectory_source.py) - the trajectory service's
    ``StreamBatches`` work queue (production).
  * ``ListSource`` - an in-process list per step (unit tests, single-process benches).
  * ``StoreQueueSource`` - deterministic synthetic steps shared by *processes* through the core's
    TCPStore (an atomic counter hands out indices): multi-process DP tests and benches without
    the trajectory service. Spec: ``synthetic:seed=1,executions=8,tokens=256,...``.

The interface (``Delivery``, ``BatchSource``) lives in services/trainer/delivery.py, which every
implementation imports; this module picks one (imports flow one way: here -> implementations ->
interface).
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.trainer.batch import PackedBatchLike
from services.trainer.delivery import BatchSource, Delivery
from services.trainer.trajectory_source import TrajectorySource


class ListSource:
    """Micro-batches given up front, per step; thread-safe (several in-process consumers)."""

    def __init__(self, steps: Mapping[int, Sequence[PackedBatchLike]]) -> None:
        self._queues = {s: list(b) for s, b in steps.items()}
        self._lock = threading.Lock()
        self.acked: list[tuple[int, int]] = []
        self.rejected: list[tuple[int, int, str]] = []
        self._handed: dict[int, int] = {}

    def next(self, step: int) -> Delivery | None:
        with self._lock:
            i = self._handed.get(step, 0)
            q = self._queues.get(step, [])
            if i >= len(q):
                return None
            self._handed[step] = i + 1
        def ack() -> bool:
            self.acked.append((step, i))
            return True

        return Delivery(batch=q[i], ack=ack,
                        reject=lambda why: self.rejected.append((step, i, why)), batch_id=f"{step}/{i}")

    def close(self) -> None:
        return None


@dataclass(frozen=True)
class SyntheticSpec:
    """Parameters of ``synthetic.make_step`` (parsed from ``synthetic:k=v,...``)."""

    seed: int = 0
    executions: int = 4
    tokens: int = 256          # micro-batch token budget
    depth: int = 2
    branching: int = 2
    context: int = 8
    generated: int = 8
    root: int = 16
    vocab: int = 512

    @classmethod
    def parse(cls, spec: str) -> "SyntheticSpec":
        kind, _, rest = spec.partition(":")
        if kind != "synthetic":
            raise ValueError(f"not a synthetic source spec: {spec!r}")
        kwargs: dict[str, int] = {}
        fields = set(cls.__dataclass_fields__)
        for part in filter(None, (p.strip() for p in rest.split(","))):
            key, eq, value = part.partition("=")
            if not eq or key not in fields:
                raise ValueError(f"synthetic source spec {spec!r}: unknown or malformed {part!r}; "
                                 f"known keys: {sorted(fields)}")
            try:
                kwargs[key] = int(value)
            except ValueError:
                raise ValueError(f"synthetic source spec {spec!r}: {key} must be an integer") from None
        return cls(**kwargs)

    def make(self, step: int, weight_version: int = 0) -> Any:
        from services.trainer.synthetic import make_step

        return make_step(self.seed * 1_000_003 + step, step=step, num_executions=self.executions,
                         vocab=self.vocab, depth=self.depth, branching=self.branching,
                         context_tokens=self.context, generated_tokens=self.generated, root_tokens=self.root,
                         micro_batch_tokens=self.tokens, weight_version=weight_version)


class StoreQueueSource:
    """Synthetic steps shared across processes: a TCPStore counter hands out micro-batch indices.

    Test hook (deterministic join points): if the store holds ``<prefix>/hold/<step>`` = k, indices
    >= k of that step are handed out only once ``<prefix>/release/<step>`` is set; each consumer
    that blocks there adds 1 to ``<prefix>/waiting/<step>``. ``k0,k1,...``: indices >= k_i also
    wait for ``<prefix>/release/<step>/<i>`` (i >= 1), a second gate for a later point of the step.
    Acks count per consumer under ``<prefix>/acked/<step>/<consumer_id>``.
    """

    def __init__(self, spec: SyntheticSpec, *, store: Any, prefix: str, consumer_id: str = "",
                 timeout_s: float = 300.0) -> None:
        self.spec = spec
        self.consumer_id = consumer_id
        self.store = store
        self.prefix = prefix
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._cache: dict[int, Any] = {}
        self._redo_seen: dict[int, int] = {}  # per step: redo slots below this are claimed

    @classmethod
    def connect(cls, spec: SyntheticSpec, *, host: str, port: int, prefix: str,
                consumer_id: str = "") -> "StoreQueueSource":
        import torch.distributed as dist

        return cls(spec, store=dist.TCPStore(host, port, is_master=False), prefix=prefix, consumer_id=consumer_id)

    def _step(self, step: int) -> Any:
        if step not in self._cache:
            # Every process regenerates the same step from the seed; weight_version is the step's
            # own (synthetic data is on-policy) so staleness is 0.
            self._cache = {step: self.spec.make(step, weight_version=step)}
        return self._cache[step]

    def next(self, step: int) -> Delivery | None:
        batches = self._step(step).batches
        idx = self._redo(step)
        if idx is None:
            idx = int(self.store.add(f"{self.prefix}/next/{step}", 1)) - 1
            if idx >= len(batches):
                return None
        self.store.append(self._taken_key(step), f"{idx},")
        self._hold(step, idx)
        key = f"{self.prefix}/acked/{step}/{self.consumer_id}"
        return Delivery(batch=batches[idx], ack=lambda: self.store.add(key, 1) > 0,
                        reject=lambda why: self.store.add(f"{self.prefix}/rejected/{step}", 1),
                        batch_id=f"{step}/{idx}", give_back=lambda: self._give_back(step, idx))

    def _hold(self, step: int, idx: int) -> None:
        """The test hook: wait at each of ``step``'s hold thresholds ``idx`` reached."""
        hold = f"{self.prefix}/hold/{step}"
        if not self.store.check([hold]):
            return
        for i, threshold in enumerate(int(x) for x in self.store.get(hold).decode().split(",") if x):
            release = f"{self.prefix}/release/{step}" + (f"/{i}" if i else "")
            if idx >= threshold and not self.store.check([release]):
                self.store.add(f"{self.prefix}/waiting/{step}", 1)
                self.store.wait([release], self.timeout)

    def _taken_key(self, step: int) -> str:
        return f"{self.prefix}/taken/{step}/{self.consumer_id}"

    def _push_redo(self, step: int, idx: int) -> None:
        """Queue index ``idx`` of ``step`` to be handed out again (to exactly one consumer)."""
        n = int(self.store.add(f"{self.prefix}/redo_n/{step}", 1)) - 1
        self.store.set(f"{self.prefix}/redo/{step}/{n}", str(idx))

    def _redo(self, step: int) -> int | None:
        """The next index of ``step`` handed back (``give_back``) or reopened (``reopen``) that no
        consumer has claimed yet; None when there is none. Each slot is claimed by the first
        consumer whose ``add`` on its claim counter returns 1."""
        n = int(self.store.add(f"{self.prefix}/redo_n/{step}", 0))
        k = self._redo_seen.get(step, 0)
        while k < n:
            claimed = int(self.store.add(f"{self.prefix}/redo_claim/{step}/{k}", 1)) == 1
            k += 1
            self._redo_seen[step] = k  # a claimed slot stays claimed: never asked again
            if claimed:
                return int(self.store.get(f"{self.prefix}/redo/{step}/{k - 1}"))
        return None

    def _give_back(self, step: int, idx: int) -> None:
        """This consumer gave index ``idx`` up before its ack: off its taken list (a later eviction
        must not reopen it twice), onto the redo list for whoever asks next."""
        key = self._taken_key(step)
        taken = self._taken(key)
        if idx in taken:
            taken.remove(idx)
        self.store.set(key, "".join(f"{x}," for x in taken))  # only this consumer writes its list
        self._push_redo(step, idx)

    def _taken(self, key: str) -> list[int]:
        """The indices a ``taken`` list holds (empty when it was never written)."""
        return [int(x) for x in self.store.get(key).decode().split(",") if x] if self.store.check([key]) else []

    def reopen(self, step: int, consumers: list[str]) -> int:
        """Hand out again every index of ``step`` the dead ``consumers`` took (acknowledged or
        not: their gradients died with them). Called by the core once the step's queue is dry."""
        idx = [x for c in consumers for x in self._taken(f"{self.prefix}/taken/{step}/{c}")]
        for x in idx:
            self._push_redo(step, x)
        return len(idx)

    def close(self) -> None:
        return None


def open_source(spec: str, *, store_host: str, store_port: int, job_id: str, consumer_id: str,
                trajectory_address: str = "", store: Any = None) -> BatchSource:
    """Build the source named by a job's ``source`` field for one consumer (core or replica)."""
    if spec.startswith("synthetic"):
        s = SyntheticSpec.parse(spec)
        prefix = f"gyre/{job_id}/synthetic"
        if store is not None:
            return StoreQueueSource(s, store=store, prefix=prefix, consumer_id=consumer_id)
        return StoreQueueSource.connect(s, host=store_host, port=store_port, prefix=prefix, consumer_id=consumer_id)
    if spec == "trajectory":
        if not trajectory_address:
            raise ValueError("source 'trajectory' needs the trajectory service address")
        return TrajectorySource(trajectory_address, job_id=job_id, consumer_id=consumer_id)
    raise ValueError(f"unknown batch source {spec!r}; use 'trajectory' or 'synthetic:k=v,...'")


def train_delivery(learner: Any, d: Delivery, *, step: int, journal: Any, log: Any) -> bool:
    """Train one handed-out micro-batch on ``learner`` (core and replicas alike); True if trained.

    Skips (acks) a batch the step journal says was already trained (replayed after a restart);
    journals it before the ack (``journal.journaled_ack``); refuses a malformed one. A forward the
    learner gave up (``MicroBatchAborted``: the replica's cell is wanted back) hands the batch back
    to the queue unacknowledged.
    """
    from services.common.errors import FailedPrecondition, InvalidArgument
    from services.trainer import metrics as m
    from services.trainer.journal import journaled_ack
    from services.trainer.learner import MicroBatchAborted

    if _already_trained(d, step=step, journal=journal, log=log):
        return False
    t0 = time.perf_counter()
    try:
        if not learner.train(d.batch, commit=journaled_ack(journal, step, d.batch_id, d.batch, d.ack)):
            log.warning("micro-batch re-handed before its ack; result discarded", batch_id=d.batch_id, step=step)
            return False
    except MicroBatchAborted:
        if d.give_back is not None:
            d.give_back()
        log.info("micro-batch given up mid-forward; handed back", batch_id=d.batch_id, step=step,
                 seconds=round(time.perf_counter() - t0, 3))
        return False
    except (InvalidArgument, FailedPrecondition) as exc:
        _reject(d, exc, step=step, log=log)
        return False
    m.MICRO_BATCHES.inc()
    m.TOKENS.inc(len(d.batch.input_ids))
    seconds = time.perf_counter() - t0
    # progress on long work: a deep micro-batch trains for minutes
    log.info("micro-batch trained", batch_id=d.batch_id, step=step, tokens=len(d.batch.input_ids),
             seconds=round(seconds, 3), tok_s=round(len(d.batch.input_ids) / max(seconds, 1e-9), 1))
    return True


def claim_delivery(learner: Any, d: Delivery, *, step: int, journal: Any, log: Any) -> PackedBatchLike | None:
    """Take a handed-out micro-batch for a sharded group's round: validated, journaled and
    acknowledged before any rank trains it (the group is the queue's consumer; its ranks cannot
    give a batch back mid-round). None for a batch already trained (journal replay: acked), a
    malformed one (rejected) or one the queue re-handed meanwhile (refused ack)."""
    from services.common.errors import FailedPrecondition, InvalidArgument
    from services.trainer.journal import journaled_ack

    if _already_trained(d, step=step, journal=journal, log=log):
        return None
    try:
        learner.check(d.batch)
    except (InvalidArgument, FailedPrecondition) as exc:
        _reject(d, exc, step=step, log=log)
        return None
    if not journaled_ack(journal, step, d.batch_id, d.batch, d.ack)():
        log.warning("micro-batch re-handed before its ack; not trained", batch_id=d.batch_id, step=step)
        return None
    return d.batch


def _already_trained(d: Delivery, *, step: int, journal: Any, log: Any) -> bool:
    """A batch the step journal says was trained before a restart: acked, not trained again."""
    if journal is None or not journal.committed(step, d.batch_id):
        return False
    d.ack()
    log.info("micro-batch already trained (journal replay); skipped", batch_id=d.batch_id, step=step)
    return True


def _reject(d: Delivery, exc: Exception, *, step: int, log: Any) -> None:
    """A malformed micro-batch is refused (never trained); the step continues without it."""
    from services.trainer import metrics as m

    m.REJECTED.labels(reason=type(exc).__name__).inc()
    log.error("micro-batch rejected", batch_id=d.batch_id, step=step, error=str(exc))
    d.reject(str(exc))
