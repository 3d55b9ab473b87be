"""The rollout gateway core: routes TITO calls to engines and keeps each caller's stream whole.

One ``GatewayCall`` per model call. Its stream survives whatever happens to engines underneath:

    caller ◀── pieces (offsets renumbered, duplicates dropped) ── GatewayCall.run()
                   │ route: Router.pick (load-aware, sticky per (execution, agent))
                   ▼
      engine A GenerateStream ──...── final chunk migrated_to=B ─▶ Attach(B) ─▶ continues
                   │ EngineLost (process died, connection cut)
                   ▼
      engine C ResumeStream(prompt + tokens already streamed, seed) = re-prefill ─▶ continues

``drain_engine`` (the scheduler consolidating a cell) marks the engine draining, plans a target
per active request (least loaded first) and asks the source to ``MigrateOut`` each group; the
streams re-attach by themselves. A dead source is drained by the streams' own re-prefill.

Every finished call becomes a ``TitoCall`` for ``on_record`` (the trajectory forwarder) and is
remembered in the ``CallCache`` so the next call of the execution may send a prompt delta.
No gRPC here: engines are reached through ``EngineConn`` (``client.EngineClient`` in production).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
from prometheus_client import Counter, Gauge, Histogram

from services.common.errors import Aborted, InvalidArgument, NotFound, Unavailable
from services.common.logging import get_logger
from services.common.metrics import REGISTRY
from services.rollout.call_cache import CallCache
from services.rollout.calls import (FINISHED, CallMeta, CallResult, EngineLost, MigrationReport, Piece,
                                    check_prompt, check_stop_ids, concat)
from services.rollout.engine import SamplingParams
from services.rollout.router import DEAD, DRAINING, READY, EngineEntry, Router
from services.rollout.usage import UsageBook
from services.trajectory.records import TitoCall
from services.common.roles import AgentRole

log = get_logger(__name__)

CALLS = Counter("gyre_rollout_gateway_calls_total", "Calls finished, by finish reason or error.",
                ["outcome"], registry=REGISTRY)
TOKENS = Counter("gyre_rollout_gateway_tokens_total", "Prompt and output tokens of finished calls.",
                 ["kind"], registry=REGISTRY)
JOB_PROMPT_TOKENS = Counter("gyre_rollout_gateway_job_prompt_tokens_total",
                            "Prompt tokens of finished calls per job: all (kind=prompt), and those an engine took "
                            "from its prefix cache instead of prefilling (kind=cached).", ["job_id", "kind"],
                            registry=REGISTRY)
MIGRATIONS = Counter("gyre_rollout_gateway_migrations_total",
                     "Requests moved between engines, by transport used.", ["transport"], registry=REGISTRY)
FALLBACKS = Counter("gyre_rollout_gateway_fallbacks_total",
                    "Recoveries: re-prefill after an engine died, retry after a refused start.",
                    ["kind"], registry=REGISTRY)
LATENCY = Histogram("gyre_rollout_gateway_call_seconds", "Call latency, routing to last token.",
                    registry=REGISTRY, buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5,
                                                10, 30, 60, 120, 300))
FIRST_TOKEN = Histogram("gyre_rollout_gateway_first_token_seconds", "Time to the first output token.",
                        registry=REGISTRY, buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5,
                                                    5, 10, 30))
IN_FLIGHT = Gauge("gyre_rollout_gateway_in_flight", "Calls being streamed now.", registry=REGISTRY)


class PieceSource(Protocol):
    def __iter__(self) -> Iterator[Piece]: ...
    def cancel(self) -> None: ...


class EngineConn(Protocol):
    """What the gateway needs from an engine (``client.EngineClient`` implements it)."""

    address: str

    def generate_stream(self, request_id: str, meta: CallMeta, prompt_ids: np.ndarray,
                        params: SamplingParams) -> PieceSource: ...
    def resume_stream(self, request_id: str, meta: CallMeta, prompt_ids: np.ndarray, params: SamplingParams,
                      generated_ids: np.ndarray, generated_logprobs: np.ndarray,
                      weight_version: int) -> PieceSource: ...
    def attach(self, request_id: str, wait_s: float) -> PieceSource: ...
    def migrate_out(self, request_ids: list[str], target_address: str, transport: str) -> list[MigrationReport]: ...
    def get_load(self, timeout_s: float | None = None) -> Any: ...
    def drain(self, wait_s: float, *, cancel: bool = False) -> int: ...
    def close(self) -> None: ...


@dataclass
class GatewayCall:
    """One call in flight. Iterate ``gateway.run(call)``; ``result()`` once it finished."""

    request_id: str
    meta: CallMeta
    prompt_ids: np.ndarray
    params: SamplingParams
    cell_id: str = ""
    out_ids: list[np.ndarray] = field(default_factory=list)
    out_logprobs: list[np.ndarray] = field(default_factory=list)
    out_top_ids: list[np.ndarray] = field(default_factory=list)  # [k, K] per piece (top_logprobs > 0)
    out_top_lps: list[np.ndarray] = field(default_factory=list)
    out_forced: list[np.ndarray] = field(default_factory=list)  # per piece, grammar-constrained calls only
    out_policy: list[np.ndarray] = field(default_factory=list)
    generated: int = 0
    weight_version: int = -1
    seed: int = 0
    finish_reason: str = ""
    num_migrations: int = 0
    num_reprefills: int = 0
    cached_tokens: int = 0  # prompt tokens an engine took from its prefix cache (the most, over re-prefills)
    moves: list[MigrationReport] = field(default_factory=list)
    # the cell it was on when that engine was lost, from the moment its recovery starts (its
    # cell_id changes before the move is recorded: a drain of the dead cell waits for it meanwhile)
    lost_cell_id: str = ""
    started_s: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    # The caller found a stop string: end the call as "stop" with only this many output tokens
    # (set between two pieces; the record holds the cut output).
    stop_at: int | None = None
    _source: PieceSource | None = None

    def cancel(self) -> None:
        """The caller went away: stop the engine-side request (any thread)."""
        self.cancelled = True
        if self._source is not None:
            self._source.cancel()

    def output(self) -> tuple[np.ndarray, np.ndarray]:
        return concat(self.out_ids, np.int32), concat(self.out_logprobs, np.float32)

    def constrained_output(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(forced bool[n], unmasked-policy logprobs float32[n]) of a grammar-constrained call."""
        if self.params.grammar is None:
            return None
        forced, policy = concat(self.out_forced, np.bool_), concat(self.out_policy, np.float32)
        if len(forced) != self.generated:  # an engine that reported none: every token a free choice
            return np.zeros(self.generated, bool), self.output()[1]
        return forced, policy

    def top_output(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Each output position's K most likely ids and logprobs ([n, K]), when asked for."""
        if not self.out_top_ids:
            return None
        ids, lps = np.concatenate(self.out_top_ids), np.concatenate(self.out_top_lps)
        return (ids, lps) if len(ids) == self.generated else None  # (an engine that gives none)

    def _cut(self) -> None:
        """Apply ``stop_at``: keep that many output tokens, finished as "stop"."""
        assert self.stop_at is not None
        ids, lps = self.output()
        keep = max(0, min(self.stop_at, len(ids)))
        tops = self.top_output()
        if tops is not None:
            self.out_top_ids, self.out_top_lps = [tops[0][:keep]], [tops[1][:keep]]
        constrained = self.constrained_output()
        if constrained is not None:
            self.out_forced, self.out_policy = [constrained[0][:keep]], [constrained[1][:keep]]
        self.out_ids, self.out_logprobs = [ids[:keep]], [lps[:keep]]
        self.generated = keep
        self.finish_reason = "stop"

    def result(self) -> CallResult:
        ids, lps = self.output()
        return CallResult(self.request_id, ids, lps, self.finish_reason, max(self.weight_version, 0),
                          self.seed, len(self.prompt_ids), self.num_migrations, self.num_reprefills,
                          self.cell_id, self.cached_tokens)


class Gateway:
    """See module docstring. Thread-safe; one instance per gateway process.

    Lifecycle: construct -> start() (probe thread) -> register_engine / run calls -> stop().
    """

    def __init__(self, *, connect: Callable[[str], EngineConn], router: Router | None = None,
                 call_cache: CallCache | None = None, on_record: Callable[[TitoCall], Any] | None = None,
                 attach_wait_s: float = 30.0, max_recoveries: int = 3, probe_interval_s: float = 2.0,
                 probe_timeout_s: float = 2.0) -> None:
        self.router = router or Router()
        self.calls = call_cache or CallCache()
        self.on_record = on_record
        self._known_addresses: dict[str, str] = {}
        self.attach_wait_s = attach_wait_s
        self.max_recoveries = max_recoveries
        self.probe_interval_s = probe_interval_s
        self.probe_timeout_s = probe_timeout_s
        self._connect = connect
        self._conns: dict[str, EngineConn] = {}
        self._active: dict[str, GatewayCall] = {}
        self._lock = threading.Lock()
        self._moved = threading.Condition(self._lock)
        self._stop = threading.Event()
        self._prober = threading.Thread(target=self._probe_loop, name="gateway-probe", daemon=True)
        self.usage = UsageBook()  # per-job calls and tokens (JobUsage)

    def start(self) -> "Gateway":
        self._prober.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            calls = list(self._active.values())
            conns = list(self._conns.values())
        for call in calls:
            call.cancel()
        if self._prober.is_alive():
            self._prober.join(timeout=5)
        for conn in conns:
            conn.close()

    def conn(self, address: str) -> EngineConn:
        with self._lock:
            conn = self._conns.get(address)
            if conn is None:
                conn = self._conns[address] = self._connect(address)
            return conn

    # -- engines ----------------------------------------------------------------------------
    def register_engine(self, cell_id: str, address: str) -> EngineEntry:
        """Make ``cell_id`` routable at ``address``; an empty address re-enables the engine this
        gateway last knew for the cell (how a cell returns to ROLLOUT after a drain)."""
        if not address:
            address = self._known_addresses.get(cell_id, "")
            if not address:
                raise NotFound(f"no engine address is known for cell {cell_id!r}; register it with an address")
        entry = self.router.register(cell_id, address)
        self._known_addresses[cell_id] = address
        try:
            self.conn(address).drain(0.0, cancel=True)  # registered = serving: undo an earlier drain
        except Exception as exc:  # deliberate: it may still be starting; probes follow it
            log.warning("engine not reachable at registration", cell_id=cell_id, error=str(exc))
        self._probe(entry)
        log.info("engine registered", cell_id=cell_id, address=address, state=entry.state)
        return entry

    def deregister_engine(self, cell_id: str) -> int:
        entry = self.router.deregister(cell_id)
        log.info("engine deregistered", cell_id=cell_id, in_flight=entry.in_flight)
        return entry.in_flight

    def list_engines(self) -> list[EngineEntry]:
        return self.router.entries()

    def _probe(self, entry: EngineEntry) -> None:
        try:
            load = self.conn(entry.address).get_load(timeout_s=self.probe_timeout_s)
        except Exception as exc:  # deliberate: a failed probe is data, not an error
            self.router.record_probe(entry.cell_id, ok=False)
            log.debug("engine probe failed", cell_id=entry.cell_id, error=str(exc))
            return
        self.router.record_probe(entry.cell_id, ok=True, active=load.active, kv_tokens=load.kv_tokens,
                                 capacity_tokens=load.capacity_tokens, weight_version=load.weight_version,
                                 vocab_size=load.vocab_size, max_context=load.max_context,
                                 model_name=load.model_name, draining=load.draining)

    def _probe_loop(self) -> None:
        while not self._stop.wait(self.probe_interval_s):
            for entry in self.router.entries():
                if entry.state != DRAINING:
                    self._probe(entry)

    # -- calls ------------------------------------------------------------------------------
    def new_call(self, meta: CallMeta, params: SamplingParams, *, prompt_ids: np.ndarray | None = None,
                 base_call_id: str = "", shared_prefix_len: int = 0, new_ids: np.ndarray | None = None,
                 request_id: str = "") -> GatewayCall:
        """Resolve the prompt (full, or a delta against a cached call) and validate the call."""
        if prompt_ids is not None and len(prompt_ids) and (base_call_id or new_ids is not None and len(new_ids)):
            raise InvalidArgument("give either prompt_ids or prompt_delta, not both")
        if prompt_ids is not None and len(prompt_ids):
            prompt = np.asarray(prompt_ids, dtype=np.int32)
        else:
            prompt = self.calls.resolve(meta.execution_id, base_call_id, shared_prefix_len,
                                        np.zeros(0, np.int32) if new_ids is None else new_ids)
        if len(prompt) == 0:
            raise InvalidArgument("the prompt is empty: give prompt_ids or a prompt_delta")
        return GatewayCall(request_id or uuid.uuid4().hex, meta, prompt, params)

    def generate(self, call: GatewayCall) -> CallResult:
        for _ in self.run(call):
            pass
        return call.result()

    def run(self, call: GatewayCall) -> Iterator[Piece]:
        """Stream ``call``'s output; survives migrations and engine deaths (see module docstring)."""
        key = call.meta.sticky_key
        entry = self.router.pick(key)
        self._check(call, entry)
        call.cell_id = entry.cell_id
        with self._lock:
            self._active[call.request_id] = call
        IN_FLIGHT.inc()
        job_id = call.meta.job_id
        if job_id:
            self.usage.started(job_id)
        outcome = "error"
        bound = log.bind(request_id=call.request_id, execution_id=call.meta.execution_id,
                         call_id=call.meta.call_id)
        try:
            call._source = self.conn(entry.address).generate_stream(call.request_id, call.meta,
                                                                   call.prompt_ids, call.params)
            recoveries = 0
            while True:
                try:
                    moved_to = yield from self._pump(call)
                except EngineLost as exc:
                    if call.cancelled:
                        raise Aborted("the call was cancelled") from None
                    recoveries += 1
                    if recoveries > self.max_recoveries:
                        raise Unavailable(f"gave up after {self.max_recoveries} engine failures: {exc}") from None
                    self._recover(call, exc, bound)
                    continue
                if moved_to is None:
                    if call.stop_at is not None:  # a stop string in the last piece: the record is cut too
                        call._cut()
                    outcome = call.finish_reason
                    self._finish(call)
                    return
                self._follow(call, moved_to, bound)
        finally:
            if call._source is not None and call.finish_reason == "":
                call._source.cancel()  # the caller left (or we failed): stop the engine request
            self.router.release(call.cell_id)
            with self._moved:
                self._active.pop(call.request_id, None)
                self._moved.notify_all()
            IN_FLIGHT.dec()
            CALLS.labels(outcome if not call.cancelled else "cancelled").inc()
            if job_id:
                finished = outcome != "error" and not call.cancelled
                self.usage.ended(job_id, prompt_tokens=len(call.prompt_ids), cached_tokens=call.cached_tokens,
                                 output_tokens=len(call.output()[0]) if finished else 0, finished=finished)

    def _check(self, call: GatewayCall, entry: EngineEntry) -> None:
        """Validate against what the chosen engine reported (it validates again itself)."""
        try:
            check_prompt(call.prompt_ids, vocab_size=entry.vocab_size, max_context=entry.max_context)
            check_stop_ids(call.params.stop_token_ids, vocab_size=entry.vocab_size)
        except BaseException:
            self.router.release(entry.cell_id)
            raise

    def _pump(self, call: GatewayCall) -> Generator[Piece, None, str | None]:
        """Forward the current source; return the address the request moved to, or None when done."""
        assert call._source is not None
        for piece in call._source:
            fresh_ids, fresh_lps = piece.token_ids[:0], piece.logprobs[:0]
            if len(piece.token_ids):
                skip = call.generated - piece.offset
                if skip < 0:
                    raise EngineLost(f"gap in the stream: expected token {call.generated}, got {piece.offset}")
                fresh_ids, fresh_lps = piece.token_ids[skip:], piece.logprobs[skip:]
            if len(fresh_ids):
                if call.generated == 0:
                    FIRST_TOKEN.observe(time.perf_counter() - call.started_s)
                call.out_ids.append(fresh_ids)
                call.out_logprobs.append(fresh_lps)
                if piece.top_ids is not None and piece.top_logprobs is not None:
                    call.out_top_ids.append(piece.top_ids[skip:])
                    call.out_top_lps.append(piece.top_logprobs[skip:])
                if piece.forced is not None and piece.policy_logprobs is not None:
                    call.out_forced.append(piece.forced[skip:])
                    call.out_policy.append(piece.policy_logprobs[skip:])
                version = piece.weight_version
                call.weight_version = version if call.weight_version < 0 else min(call.weight_version, version)
            call.seed = piece.seed or call.seed
            call.cached_tokens = max(call.cached_tokens, piece.cached_tokens)
            offset = call.generated
            call.generated += len(fresh_ids)
            if piece.finished:
                call.finish_reason = piece.finish_reason or "stop"
                if call.weight_version < 0:
                    call.weight_version = piece.weight_version
                yield Piece(call.request_id, fresh_ids, fresh_lps, offset, finished=True,
                            finish_reason=call.finish_reason, weight_version=piece.weight_version,
                            seed=call.seed)
                return None
            if len(fresh_ids):
                yield Piece(call.request_id, fresh_ids, fresh_lps, offset,
                            weight_version=piece.weight_version, seed=call.seed)
                if call.stop_at is not None:  # the caller saw a stop string: the engine stops here
                    call._cut()
                    call._source.cancel()
                    return None
            if piece.migrated_to:
                return piece.migrated_to
        if call.cancelled:
            raise Aborted("the call was cancelled")
        raise EngineLost(f"stream from {call.cell_id} ended before the request finished")

    def _follow(self, call: GatewayCall, address: str, bound: Any) -> None:
        """Live migration: re-attach the caller's stream to the target engine."""
        target = self.router.by_address(address)
        self.router.release(call.cell_id)
        call.cell_id = target.cell_id if target is not None else address
        self.router.acquire(call.cell_id)
        self.router.rebind(call.meta.sticky_key, call.cell_id)
        call.num_migrations += 1
        bound.info("stream re-attached after migration", cell_id=call.cell_id, generated=call.generated)
        call._source = self.conn(address).attach(call.request_id, self.attach_wait_s)

    def _recover(self, call: GatewayCall, exc: Exception, bound: Any) -> None:
        """The engine was lost: resume on another one from what was already streamed."""
        lost = call.cell_id
        with self._moved:
            call.lost_cell_id = lost
        try:
            if self.router.get(lost).state == READY:
                self.router.set_state(lost, DEAD)  # probes revive it if it answers again
        except NotFound:
            pass
        self.router.release(lost)
        call.cell_id = ""
        t0 = time.perf_counter()
        entry = self.router.pick(call.meta.sticky_key, exclude={lost})
        call.cell_id = entry.cell_id
        conn = self.conn(entry.address)
        if call.generated == 0:
            FALLBACKS.labels("restart").inc()
            bound.warning("engine lost before the first token; restarting elsewhere", lost_cell_id=lost,
                          cell_id=entry.cell_id, error=str(exc))
            call._source = conn.generate_stream(call.request_id, call.meta, call.prompt_ids, call.params)
            return
        ids, lps = call.output()
        params = call.params if call.params.seed is not None or not call.seed else \
            _with_seed(call.params, call.seed)
        call._source = conn.resume_stream(call.request_id, call.meta, call.prompt_ids, params, ids, lps,
                                          max(call.weight_version, 0))
        call.num_reprefills += 1
        FALLBACKS.labels("reprefill").inc()
        MIGRATIONS.labels("reprefill").inc()
        report = MigrationReport(call.request_id, lost, entry.cell_id, "reprefill", 0,
                                 time.perf_counter() - t0, len(call.prompt_ids) + call.generated, True)
        with self._moved:
            call.moves.append(report)
            self._moved.notify_all()
        bound.warning("engine lost; re-prefilling on another engine", lost_cell_id=lost,
                      cell_id=entry.cell_id, generated=call.generated, error=str(exc))

    def _finish(self, call: GatewayCall) -> None:
        ids, lps = call.output()
        LATENCY.observe(time.perf_counter() - call.started_s)
        TOKENS.labels("prompt").inc(len(call.prompt_ids))
        TOKENS.labels("output").inc(len(ids))
        JOB_PROMPT_TOKENS.labels(call.meta.job_id, "prompt").inc(len(call.prompt_ids))
        JOB_PROMPT_TOKENS.labels(call.meta.job_id, "cached").inc(call.cached_tokens)
        self.calls.put(call.meta.execution_id, call.meta.call_id, np.concatenate([call.prompt_ids, ids]))
        if self.on_record is not None and call.meta.execution_id:
            m = call.meta
            forced, policy = call.constrained_output() or (None, None)
            self.on_record(TitoCall(
                execution_id=m.execution_id, call_id=m.call_id or call.request_id, agent_id=m.agent_id,
                role=AgentRole.parse(m.role), output_ids=ids, output_logprobs=lps, weight_version=max(call.weight_version, 0),
                prompt_ids=call.prompt_ids, job_id=m.job_id, finished_at_s=time.time(),
                finish_reason=call.finish_reason, attempt=m.attempt, output_forced=forced,
                output_policy_logprobs=policy))

    # -- draining ---------------------------------------------------------------------------
    def drain_engine(self, cell_id: str, transport: str = "auto", *, keep_registered: bool = False,
                     wait_s: float = 30.0) -> list[MigrationReport]:
        """Move every in-flight request off ``cell_id``; then deregister it (unless kept)."""
        entry = self.router.get(cell_id)
        previous = entry.state
        self.router.set_state(cell_id, DRAINING)
        source = self.conn(entry.address)
        t0 = time.perf_counter()
        try:
            source.drain(0.0)
            active = list(source.get_load().request_ids)
            alive = True
        except EngineLost:
            active, alive = [], False
        reports: list[MigrationReport] = []
        if alive and active:
            plan = self.router.plan(len(active), exclude={cell_id})
            if not plan:
                self.router.set_state(cell_id, previous)
                raise Unavailable(f"cannot drain {cell_id}: no other ready engine to take "
                                  f"its {len(active)} requests")
            groups: dict[str, list[str]] = {}
            for rid, target in zip(active, plan):
                groups.setdefault(target, []).append(rid)
            with ThreadPoolExecutor(max_workers=len(groups)) as pool:
                futures = [pool.submit(self._migrate_group, source, target, rids, transport)
                           for target, rids in groups.items()]
                for fut in futures:
                    reports.extend(fut.result())
        if not alive:
            self.router.set_state(cell_id, DEAD)
            reports = self._await_recoveries(cell_id, t0, wait_s)
        finished = sum(r.transport == FINISHED for r in reports)
        reports = [r for r in reports if r.transport != FINISHED]  # ended on the source: nothing in flight
        for r in reports:
            if r.ok and alive:  # a dead source's re-prefills were counted by the streams
                MIGRATIONS.labels(r.transport).inc()
        if not keep_registered:
            self.router.deregister(cell_id)
        log.info("engine drained", cell_id=cell_id, requests=len(reports), finished_meanwhile=finished, alive=alive,
                 ok=sum(r.ok for r in reports), duration_s=round(time.perf_counter() - t0, 3))
        return reports

    def _migrate_group(self, source: EngineConn, target_cell: str, rids: list[str],
                       transport: str) -> list[MigrationReport]:
        target = self.router.get(target_cell)
        try:
            return source.migrate_out(rids, target.address, transport)
        except EngineLost as exc:
            # The source died mid-drain: the streams re-prefill on their own.
            return [MigrationReport(r, "", target_cell, "", 0, 0.0, 0, False, str(exc)) for r in rids]

    def _await_recoveries(self, cell_id: str, t0: float, wait_s: float) -> list[MigrationReport]:
        """A dead source: wait for the calls that were on it to re-prefill elsewhere."""
        def moved_from(c: GatewayCall) -> MigrationReport | None:
            return next((m for m in reversed(c.moves) if m.source_cell_id == cell_id), None)

        with self._moved:
            affected = [c for c in self._active.values()
                        if c.cell_id == cell_id or c.lost_cell_id == cell_id or moved_from(c)]
            self._moved.wait_for(lambda: all(moved_from(c) or c.request_id not in self._active
                                             for c in affected), timeout=wait_s)
            reports = []
            for c in affected:
                move = moved_from(c)
                reports.append(move or MigrationReport(c.request_id, cell_id, "", "", 0, time.perf_counter() - t0,
                                                       0, False, "not re-prefilled in time"))
            return reports


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, seed=seed)


__all__ = ["Gateway", "GatewayCall", "EngineConn", "DEAD", "DRAINING", "READY"]
