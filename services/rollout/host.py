"""An inference engine hosted in a ROLLOUT cell: per-request event channels, migration in/out.

``EngineHost`` sits between the Engine gRPC servicer and an ``InferenceEngine`` (no gRPC here):

    GenerateStream ──submit──▶ RequestChannel ◀──on_event── engine loop thread
         ▲                           │ pieces() (coalesces queued events into one Piece)
         └───────────────────────────┘
    MigrateOut:  export_request ─▶ target.accept(kind) ─▶ kv_transport.send_state ─▶ marker
                 (UCX, then TCP, then state without KV = re-prefill on the target; all failed:
                  import back here so the caller's stream just continues)
    receiver:    on_state ─▶ new RequestChannel (offset = tokens already generated) ─▶ import
                 Attach(request_id) waits for that channel and streams it

Lifecycle: start() -> (submit | resume | attach | migrate_out | cancel)* -> drain() -> stop().
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any, Protocol

import numpy as np
from prometheus_client import Counter, Histogram

from services.common.errors import AlreadyExists, FailedPrecondition, NotFound, Unavailable
from services.common.logging import get_logger
from services.common.metrics import REGISTRY
from services.rollout.calls import FINISHED, MigrationReport, Piece, check_prompt, check_stop_ids, concat
from services.rollout.engine import MAX_SEED, GenRequest, InferenceEngine, MigrationState, TokenEvent

log = get_logger(__name__)

MIGRATIONS_OUT = Counter("gyre_rollout_engine_migrations_out_total",
                         "Requests this engine moved out, by transport used and outcome.",
                         ["transport", "ok"], registry=REGISTRY)
MIGRATIONS_IN = Counter("gyre_rollout_engine_migrations_in_total", "Requests imported, by kind.",
                        ["kind"], registry=REGISTRY)
MIGRATION_FALLBACKS = Counter("gyre_rollout_engine_migration_fallbacks_total",
                              "Transport attempts that failed and fell back to the next one.",
                              ["transport"], registry=REGISTRY)
MIGRATION_BYTES = Counter("gyre_rollout_engine_migration_bytes_total", "Bytes sent by migrations.",
                          ["transport"], registry=REGISTRY)
MIGRATION_SECONDS = Histogram("gyre_rollout_engine_migration_seconds",
                              "Export-to-sent time of one request.", ["transport"], registry=REGISTRY,
                              buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))

# Fallback chain per requested transport ("reprefill" = send the state without KV). UCX -> TCP
# happens inside kv_transport (same receiver); a refused or undeliverable state tries re-prefill.
CHAINS = {"auto": ("ucx", "reprefill"), "ucx": ("ucx", "reprefill"), "tcp": ("tcp", "reprefill"),
          "reprefill": ("reprefill",)}
# Finished channels nobody attached to are forgotten after this long.
UNCLAIMED_TTL_S = 120.0


class MigrationTarget(Protocol):
    """The target engine as the source sees it (servicer wires it to AcceptMigration over gRPC)."""

    address: str

    def accept(self, kind: str, request_ids: list[str]) -> tuple[str, str, str]:
        """Ask the target to receive ``kind`` ("ucx" | "tcp"); -> (kind it accepts, address, cell id)."""
        ...


class RequestChannel:
    """Ordered events of one request on this engine, for one consumer.

    The engine thread puts ``TokenEvent``s; the export path puts a migration marker; ``pieces()``
    blocks on the queue and yields coalesced ``Piece``s until the request finished or moved.
    """

    def __init__(self, request_id: str, seed: int) -> None:
        self.request_id = request_id
        self.seed = seed
        self.attached = False
        self.ended = False  # a terminal item is queued
        self.delivered = False  # the consumer got the terminal piece
        self.ended_at = 0.0
        self._q: queue.SimpleQueue[TokenEvent | str] = queue.SimpleQueue()

    def on_event(self, ev: TokenEvent) -> None:
        """Engine callback (must not block)."""
        if ev.finished and ev.finish_reason == "migrated":
            # Export ends the request here; the marker (or a local re-import) follows.
            if len(ev.token_ids):
                self._q.put(replace(ev, finished=False, finish_reason=None))
            return
        if ev.finished:
            self.ended, self.ended_at = True, time.monotonic()
        self._q.put(ev)

    def put_migrated(self, target_address: str) -> None:
        self.ended, self.ended_at = True, time.monotonic()
        self._q.put(target_address)

    def pieces(self) -> Iterator[Piece]:
        while True:
            items: list[TokenEvent | str] = [self._q.get()]
            while not self._terminal(items[-1]):
                try:
                    items.append(self._q.get_nowait())
                except queue.Empty:
                    break
            yield from self._coalesce(items)
            if self._terminal(items[-1]):
                self.delivered = True
                return

    @staticmethod
    def _terminal(item: TokenEvent | str) -> bool:
        return isinstance(item, str) or item.finished

    def _coalesce(self, items: list[TokenEvent | str]) -> Iterator[Piece]:
        """Merge consecutive events of the same weight version into one piece (fewer messages)."""
        run: list[TokenEvent] = []
        for item in items:
            if isinstance(item, str):
                yield from self._flush(run)
                run = []
                yield Piece(self.request_id, np.zeros(0, np.int32), np.zeros(0, np.float32), 0,
                            seed=self.seed, migrated_to=item)
                continue
            if run and run[-1].weight_version != item.weight_version:
                yield from self._flush(run)
                run = []
            run.append(item)
        yield from self._flush(run)

    def _flush(self, run: list[TokenEvent]) -> Iterator[Piece]:
        if not run:
            return
        last = run[-1]
        tops = [e.top_ids for e in run]
        has_tops = all(t is not None for t in tops) and any(len(e.token_ids) for e in run)
        constrained = any(e.forced is not None for e in run)
        yield Piece(self.request_id, concat([e.token_ids for e in run], np.int32),
                    concat([e.logprobs for e in run], np.float32), run[0].offset,
                    finished=last.finished, finish_reason=last.finish_reason or "",
                    weight_version=last.weight_version, seed=last.seed or self.seed,
                    top_ids=np.concatenate(tops) if has_tops else None,  # type: ignore[arg-type]
                    top_logprobs=np.concatenate([e.top_logprobs for e in run]) if has_tops else None,  # type: ignore[misc]
                    cached_tokens=max(e.cached_tokens for e in run),
                    forced=concat([_or(e.forced, np.zeros(len(e.token_ids), bool)) for e in run], np.bool_)
                    if constrained else None,
                    policy_logprobs=concat([_or(e.policy_logprobs, e.logprobs) for e in run], np.float32)
                    if constrained else None)


def _or(a: np.ndarray | None, default: np.ndarray) -> np.ndarray:
    return default if a is None else a


class EngineHost:
    """See module docstring. Thread-safe."""

    def __init__(self, engine: InferenceEngine, *, cell_id: str, address: str = "",
                 kv_kinds: tuple[str, ...] = ("ucx", "tcp"), kv_host: str = "127.0.0.1", model: str = "",
                 loader: Callable[[str], InferenceEngine] | None = None, kv_key: bytes = b"",
                 kv_pool_bytes: int = 512 << 20) -> None:
        self.engine = engine
        self.kv_pool_bytes = kv_pool_bytes  # idle receive memory its KV receivers keep
        self.kv_key = kv_key  # the deployment's KV migration key (b"": unsigned, local runs)
        self.model = model  # the spec the engine was loaded from ("" when built in code)
        self._loader = loader
        self.cell_id = cell_id
        self.address = address  # this engine's gRPC address, set once the server is bound
        self.kv_kinds = kv_kinds
        self.kv_host = kv_host  # interface the KV receivers bind and advertise
        self.draining = False
        self._channels: dict[str, RequestChannel] = {}
        self._receivers: dict[str, str] = {}
        self._cond = threading.Condition()
        self._recv_lock = threading.Lock()
        self.log = log.bind(cell_id=cell_id)

    def start(self) -> None:
        self.engine.start()

    def stop(self) -> None:
        self.close_receivers()
        self.engine.stop(drain=False)

    def load_model(self, model: str) -> bool:
        """Serve ``model`` instead (a new job's); False when it already does. Refused while any
        request is hosted: a running execution is never cut off to change models."""
        if model == self.model:
            return False
        if self._loader is None:
            raise FailedPrecondition("this engine was built without a model loader; restart it with --model")
        with self._cond:
            active = self.engine.active_requests()
            if active:
                raise FailedPrecondition(f"the engine hosts {len(active)} requests; drain it before loading "
                                         f"another model")
            was_draining, self.draining = self.draining, True  # nothing new starts on the old model meanwhile
        try:
            new = self._loader(model)  # ValueError: does not resolve
            new.start()
            old, self.engine, self.model = self.engine, new, model
            old.stop(drain=False)
        finally:
            self.draining = was_draining
        self.log.info("model loaded", model=model, model_name=new.model_name)
        return True

    # -- requests ----------------------------------------------------------------------------
    def submit(self, req: GenRequest) -> RequestChannel:
        return self._start(req, lambda ch, r: self.engine.submit(r, ch.on_event))

    def resume(self, req: GenRequest, generated_ids: np.ndarray, generated_logprobs: np.ndarray,
               rng_state: bytes | None, weight_version: int) -> RequestChannel:
        """Continue a request whose engine died, recomputing its KV from prompt + generated."""
        if len(generated_ids) >= req.params.max_new_tokens:
            raise FailedPrecondition(f"request {req.request_id!r} already generated "
                                     f"{len(generated_ids)} of {req.params.max_new_tokens} tokens")
        return self._start(req, lambda ch, r: self.engine.reprefill_request(
            r, generated_ids, generated_logprobs, rng_state, weight_version, ch.on_event))

    def _start(self, req: GenRequest, launch: Callable[[RequestChannel, GenRequest], None]) -> RequestChannel:
        check_prompt(req.prompt_ids, vocab_size=self.engine.vocab_size, max_context=self.engine.max_context)
        check_stop_ids(req.params.stop_token_ids, vocab_size=self.engine.vocab_size)
        if req.params.seed is None:
            # Pick the seed here so it can be reported and reused by a migration or re-prefill.
            req = replace(req, params=replace(req.params, seed=random.randint(0, MAX_SEED)))
        channel = RequestChannel(req.request_id, int(req.params.seed or 0))
        channel.attached = True
        with self._cond:
            if self.draining:
                raise Unavailable(f"engine {self.cell_id} is draining and accepts no new requests")
            self._sweep()
            if req.request_id in self._channels:
                raise AlreadyExists(f"request {req.request_id!r} is already active on {self.cell_id}")
            self._channels[req.request_id] = channel
        try:
            launch(channel, req)
        except BaseException:
            with self._cond:
                self._channels.pop(req.request_id, None)
            raise
        return channel

    def attach(self, request_id: str, wait_s: float) -> RequestChannel:
        """The channel of a request that migrated here (waits up to ``wait_s`` for its arrival)."""
        with self._cond:
            ok = self._cond.wait_for(lambda: request_id in self._channels, timeout=wait_s)
            if not ok:
                raise NotFound(f"request {request_id!r} did not arrive on engine {self.cell_id} "
                               f"within {wait_s:.1f}s")
            channel = self._channels[request_id]
            if channel.attached:
                raise FailedPrecondition(f"request {request_id!r} already has a stream on {self.cell_id}")
            channel.attached = True
            return channel

    def release(self, channel: RequestChannel) -> None:
        """The consumer of ``channel`` is gone: forget it, cancelling the request if still running."""
        with self._cond:
            if self._channels.get(channel.request_id) is channel:
                del self._channels[channel.request_id]
        if not channel.ended:
            self.engine.cancel(channel.request_id)

    def cancel(self, request_id: str) -> bool:
        return self.engine.cancel(request_id)

    def active_requests(self) -> list[str]:
        return self.engine.active_requests()

    def _sweep(self) -> None:
        """Drop finished channels nobody attached to (caller holds the lock)."""
        now = time.monotonic()
        stale = [rid for rid, ch in self._channels.items()
                 if not ch.attached and ch.ended and now - ch.ended_at > UNCLAIMED_TTL_S]
        for rid in stale:
            del self._channels[rid]

    # -- drain / load ------------------------------------------------------------------------
    def drain(self, wait_s: float, *, cancel: bool = False) -> int:
        """Stop accepting requests; wait up to ``wait_s`` for active ones to finish or leave.
        ``cancel``: accept requests again instead."""
        with self._cond:
            self.draining = not cancel
        if cancel:
            return len(self.engine.active_requests())
        deadline = time.monotonic() + wait_s
        while self.engine.active_requests() and time.monotonic() < deadline:
            time.sleep(0.02)
        return len(self.engine.active_requests())

    def load(self) -> dict[str, Any]:
        load: dict[str, Any] = dict(self.engine.load())
        load["request_ids"] = self.engine.active_requests()
        return load

    # -- migration: receiving side -----------------------------------------------------------
    def accept(self, kind: str) -> tuple[str, str]:
        """A receiver address for ``kind`` ("ucx" | "tcp"); a UCX receiver without ucxx serves TCP
        (its address then starts with tcp://). Kinds this engine does not offer fall back too."""
        from services.rollout import kv_transport

        kinds = [kind] + [k for k in self.kv_kinds if k != kind] if kind in self.kv_kinds else list(self.kv_kinds)
        with self._recv_lock:
            for k in kinds:
                if k in self._receivers:
                    return self._scheme(self._receivers[k]), self._receivers[k]
                try:
                    self._receivers[k] = kv_transport.make_receiver(k, self._on_state, host=self.kv_host,
                                                                    key=self.kv_key, max_bytes=self._max_state_bytes(),
                                                                    pool_bytes=self.kv_pool_bytes)
                    return self._scheme(self._receivers[k]), self._receivers[k]
                except Exception as exc:  # deliberate: fall back to the next transport
                    MIGRATION_FALLBACKS.labels(k).inc()
                    self.log.warning("kv receiver unavailable; falling back", kind=k, error=str(exc))
        raise Unavailable(f"engine {self.cell_id} has no working KV receiver ({', '.join(kinds)})")

    def _max_state_bytes(self) -> int:
        """The largest state this engine could import (its context length of KV), so a migration
        header cannot make the receiver allocate more; the transport's default when unknown."""
        from services.rollout import kv_transport

        bound = getattr(self.engine, "max_state_bytes", None)
        return int(bound()) if callable(bound) else kv_transport.DEFAULT_MAX_STATE_BYTES

    @staticmethod
    def _scheme(address: str) -> str:
        return address.split("://", 1)[0]

    def close_receivers(self) -> None:
        from services.rollout import kv_transport

        with self._recv_lock:
            for address in self._receivers.values():
                kv_transport.close_receiver(address)
            self._receivers.clear()

    def _on_state(self, state: MigrationState) -> None:
        """Receiver callback: resume an incoming request here (KV import, or re-prefill)."""
        req = state.request
        channel = RequestChannel(req.request_id, int(req.params.seed or 0))
        with self._cond:
            if req.request_id in self._channels and not self._channels[req.request_id].ended:
                self.log.warning("duplicate migration ignored", request_id=req.request_id)
                return
            self._channels[req.request_id] = channel
            self._cond.notify_all()
        try:
            if state.kv:
                self.engine.import_request(state, channel.on_event)
            else:
                self.engine.reprefill_request(req, state.generated_ids, state.generated_logprobs,
                                              state.rng_state or None, state.weight_version, channel.on_event)
        except BaseException:
            with self._cond:  # refused (e.g. weight-version policy): the sender keeps the request
                if self._channels.get(req.request_id) is channel:
                    del self._channels[req.request_id]
            raise
        MIGRATIONS_IN.labels("kv" if state.kv else "reprefill").inc()
        self.log.info("request migrated in", request_id=req.request_id, kv_tokens=state.kv_tokens,
                      generated=len(state.generated_ids))

    # -- migration: sending side -------------------------------------------------------------
    def migrate_out(self, request_ids: list[str], target: MigrationTarget, transport: str) -> list[MigrationReport]:
        if transport not in CHAINS:
            raise ValueError(f"transport must be one of {tuple(CHAINS)}, got {transport!r}")
        if target.address and target.address == self.address:
            raise ValueError("cannot migrate requests to the engine they are on")
        ids = request_ids or self.engine.active_requests()
        return [self._migrate_one(rid, target, transport) for rid in ids]

    def _migrate_one(self, rid: str, target: MigrationTarget, transport: str) -> MigrationReport:
        t0 = time.perf_counter()
        with self._cond:
            channel = self._channels.get(rid)
        try:
            state = self.engine.export_request(rid)
        except NotFound:  # it finished while the drain was on its way: nothing left to move
            return MigrationReport(rid, self.cell_id, "", FINISHED, 0, time.perf_counter() - t0, 0, True,
                                   "finished before it could migrate")
        except (KeyError, ValueError, LookupError) as exc:
            return MigrationReport(rid, self.cell_id, "", "", 0, time.perf_counter() - t0, 0, False,
                                   f"not migrated: {exc}")
        errors = []
        for kind in CHAINS[transport]:
            try:
                wire = "tcp" if kind == "reprefill" else kind
                _got, address, target_cell = target.accept(wire, [rid])
                payload = replace(state, kv=[]) if kind == "reprefill" else state
                from services.rollout import kv_transport

                sent = kv_transport.send_state_ex(wire, address, payload, key=self.kv_key)
            except Exception as exc:  # deliberate: next transport in the chain
                MIGRATION_FALLBACKS.labels(kind).inc()
                errors.append(f"{kind}: {type(exc).__name__}: {exc}")
                self.log.warning("migration transport failed; falling back", request_id=rid,
                                 transport=kind, error=str(exc))
                continue
            # What actually happened: no KV moved = the target re-prefills; UCX may have become TCP.
            used = "reprefill" if not payload.kv else sent.transport
            if sent.fallback:
                MIGRATION_FALLBACKS.labels(kind).inc()
            duration = time.perf_counter() - t0
            if channel is not None:
                channel.put_migrated(target.address)
                with self._cond:
                    if self._channels.get(rid) is channel:
                        del self._channels[rid]
            MIGRATIONS_OUT.labels(used, "true").inc()
            MIGRATION_BYTES.labels(used).inc(sent.bytes_sent)
            MIGRATION_SECONDS.labels(used).observe(duration)
            context = len(state.request.prompt_ids) + len(state.generated_ids)
            self.log.info("request migrated out", request_id=rid, transport=used, bytes=sent.bytes_sent,
                          duration_s=round(duration, 4), target_cell_id=target_cell, context_tokens=context)
            return MigrationReport(rid, self.cell_id, target_cell, used, sent.bytes_sent, duration,
                                   state.kv_tokens or context, True)
        # Every transport failed: keep the request here; its stream never noticed.
        if channel is not None:
            self.engine.import_request(state, channel.on_event)
        MIGRATIONS_OUT.labels("none", "false").inc()
        self.log.error("migration failed; request resumed locally", request_id=rid, errors=errors)
        return MigrationReport(rid, self.cell_id, "", "", 0, time.perf_counter() - t0, 0, False,
                               "; ".join(errors))
