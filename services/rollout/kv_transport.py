"""Ship a ``MigrationState`` (request, generated tokens, RNG state, per-layer KV) between processes.

Two transports behind one seam, chosen by the receiver's address:

- ``tcp://host:port`` (``TcpTransport``): header and array buffers on one socket, each buffer
  sent straight from the numpy memory (no pickling, no concatenation copy).
- ``ucx://host:port/<worker address hex>`` (``UcxTransport``, package ``ucxx``): the same TCP
  socket carries the header and the acks (it also proves the receiver is alive before UCX
  touches it); the arrays go as tagged UCX messages to the receiver's worker address. Endpoints
  made from worker addresses reach shared memory on one host and RDMA where the fabric has it
  (ucxx's listener path would only use TCP); peer error handling is a setting
  (``GYRE_UCX_ENDPOINT_ERROR_HANDLING``, off: it costs the shared-memory path, see below).
  A peer dying mid-transfer is seen on the TCP control connection instead (``watch``): the
  kernel closes a dead process's socket, so either side abandons the transfer within
  ``WATCH_INTERVAL_S`` (the receiver completes its orphaned receives, the sender aborts its
  endpoint), counts it in ``gyre_rollout_kv_transfers_aborted_total`` and goes on serving.

Wire protocol (one migration per TCP connection; JSON header, raw little-endian arrays)::

    sender ── "GYKV" u32 len, header {mode, tag, request, arrays[{dtype, shape}]} ──▶ receiver
    sender ◀── u32 len, {"mode": "ucx"|"tcp"} (receives posted / or: send inline) ── receiver
    sender ── arrays: inline on the socket (tcp) or UCX tag (tag + i) messages ──▶ receiver
    receiver: on_state(MigrationState) (e.g. engine.import_request)
    sender ◀── u32 len, {"ok": true, "bytes": n} | {"ok": false, "error": "..."} ── receiver

Authentication and bounds: receivers and senders of one deployment share a key (the engines'
``kv_auth_key_file``). With a key, every header carries a timestamp, a random nonce and
``mac`` = HMAC-SHA256(key, canonical JSON of the rest); a receiver refuses (``{"ok": false}``,
before any array is allocated or read) a header without a valid MAC, older or newer than
``MAX_CLOCK_SKEW_S``, or with a nonce it has seen (a replay). Every receiver refuses headers of
another protocol version and states whose arrays add up to more than its ``max_bytes`` (the
engine's largest possible state: its context length of KV), so a header cannot make it allocate
more than it could ever hold. Without a key (local runs on 127.0.0.1) only the bounds apply.

Fallbacks, each logged and counted in ``gyre_rollout_migration_fallbacks_total``: a UCX receiver
that cannot start (ucxx missing or failing) is a TCP receiver; a UCX send that cannot import,
connect or finish resends over TCP to the same receiver (every UCX receiver also takes TCP).
A state the receiver refuses (``on_state`` raised) is ``StateRejected``, never retried.

Public API: ``make_receiver(kind, on_state) -> address``, ``close_receiver(address)``,
``send_state(kind, address, state) -> bytes_sent`` and ``send_state_ex`` (also says which
transport carried it).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import hashlib
import hmac
import json
import os
import secrets
import select
import socket
import struct
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
from prometheus_client import Counter

from services.common.logging import get_logger
from services.common.metrics import REGISTRY
from services.rollout.engine import GenRequest, MigrationState, SamplingParams
from services.rollout.grammar import GrammarSpec

log = get_logger(__name__)

KINDS = ("ucx", "tcp")
MAGIC = b"GYKV"
PROTOCOL_VERSION = 1
MAX_HEADER_BYTES = 16 << 20
MAX_ARRAYS = 1 << 16
DEFAULT_MAX_STATE_BYTES = 16 << 30  # a receiver that was not told its engine's bound
DEFAULT_POOL_BYTES = 512 << 20  # idle receive memory a receiver keeps for the next migration
MAX_CLOCK_SKEW_S = 300.0
SEEN_NONCES = 65536
# A receiver gives up on a transfer that stalls this long (seconds) and drops the connection.
STALL_TIMEOUT_S = 120.0
UCX_MIN_BUDGET_S = 5.0  # a UCX transfer gets this plus its bytes at UCX_FLOOR_BYTES_PER_S (then TCP)
UCX_FLOOR_BYTES_PER_S = 20e6
WATCH_INTERVAL_S = 0.2  # how often a UCX transfer's control connection is checked for its peer's death
# UCX endpoints with peer error handling ("1"): a peer dying mid-transfer fails that transfer
# at once. Off by default: on this host it excludes UCX's shared-memory transports, and 256 MiB
# moved at 0.47-0.55 GiB/s instead of 2.1-2.9 GiB/s (below TCP's 1.1-1.4). Without it a dead
# peer's transfer stalls until the sender's UCX budget (then it resends over TCP) and the
# receiver's STALL_TIMEOUT_S drops the connection; neither process goes down.
ENDPOINT_ERROR_HANDLING = os.environ.get("GYRE_UCX_ENDPOINT_ERROR_HANDLING", "0") == "1"
# UCX receive lanes: a receiver spreads a state's arrays over this many ucxx workers, each with its
# own progress thread. On one host a worker's rendezvous read is one thread's cross-memory copy
# (about 0.4x memcpy); two workers copy on two cores at once (bench/results/rollout_engine.md).
RECEIVE_LANES = int(os.environ.get("GYRE_UCX_RECEIVE_LANES", "2"))
if RECEIVE_LANES < 1:
    raise ValueError(f"GYRE_UCX_RECEIVE_LANES must be 1 or more, got {RECEIVE_LANES}")

FALLBACKS = Counter(
    "gyre_rollout_migration_fallbacks_total",
    "KV transport fallbacks (UCX -> TCP), by reason.",
    ["reason"],
    registry=REGISTRY,
)
TRANSFER_BYTES = Counter(
    "gyre_rollout_kv_transfer_bytes_total", "Migration payload bytes sent, by transport.", ["transport"],
    registry=REGISTRY,
)

LANE_BYTES = Counter(
    "gyre_rollout_kv_lane_bytes_total",
    "UCX migration bytes received, by receive lane (a ucxx worker with its own progress thread).",
    ["lane"], registry=REGISTRY,
)

ABORTED = Counter(
    "gyre_rollout_kv_transfers_aborted_total",
    "KV transfers abandoned midway, by side and reason (peer_gone: its connection closed; failed: UCX "
    "reported an error; timeout: no progress within its budget).",
    ["side", "reason"], registry=REGISTRY,
)

OnState = Callable[[MigrationState], None]


class TransportError(ConnectionError):
    """The state could not be delivered (receiver unreachable, connection broke, bad reply)."""


class PeerGone(TransportError):
    """The other process closed the migration's connection mid-transfer (it died or gave up)."""


class StateRejected(ValueError):
    """The receiver got the state but refused it (its ``on_state`` raised)."""


@dataclass(frozen=True)
class SendResult:
    bytes_sent: int
    transport: str  # what actually carried the arrays: "ucx" | "tcp"
    fallback: bool  # UCX was asked for and TCP carried it
    duration_s: float


# --------------------------------------------------------------------------- serialization
def state_arrays(state: MigrationState) -> list[np.ndarray]:
    """The state's arrays in wire order: prompt, generated ids, logprobs, rng, then k0, v0, k1, ..."""
    arrays = [state.request.prompt_ids, state.generated_ids, state.generated_logprobs,
              np.frombuffer(state.rng_state, dtype=np.uint8)]
    for k, v in state.kv:
        arrays += [k, v]
    return [np.ascontiguousarray(a) for a in arrays]


def state_header(state: MigrationState, arrays: list[np.ndarray], *, mode: str, tag: int) -> dict[str, Any]:
    req, p = state.request, state.request.params
    return {
        "v": PROTOCOL_VERSION,
        "mode": mode,
        "tag": tag,
        "request": {
            "request_id": req.request_id, "execution_id": req.execution_id, "call_id": req.call_id,
            "agent_id": req.agent_id, "role": req.role,
            "params": {"temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k,
                       "max_new_tokens": p.max_new_tokens, "stop_token_ids": list(p.stop_token_ids),
                       "seed": p.seed, "top_logprobs": p.top_logprobs,
                       "grammar": None if p.grammar is None else [p.grammar.kind, p.grammar.source]},
        },
        "weight_version": state.weight_version,
        "kv_dtype": state.kv_dtype,
        "arrays": [{"dtype": a.dtype.str, "shape": list(a.shape)} for a in arrays],
    }


def _mac(key: bytes, header: dict[str, Any]) -> str:
    body = json.dumps({k: v for k, v in header.items() if k != "mac"}, sort_keys=True, separators=(",", ":"))
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()


def sign(header: dict[str, Any], key: bytes) -> dict[str, Any]:
    """``header`` with a timestamp, a nonce and its MAC under ``key`` (unchanged without a key)."""
    if not key:
        return header
    signed = {**header, "ts": time.time(), "nonce": secrets.token_hex(16)}
    signed["mac"] = _mac(key, signed)
    return signed


class Verifier:
    """A receiver's check of signed headers: MAC, clock skew and replay (bounded nonce memory)."""

    def __init__(self, key: bytes) -> None:
        self.key = key
        self._seen: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def check(self, header: dict[str, Any]) -> None:
        if not self.key:
            return
        mac = header.get("mac")
        if not isinstance(mac, str) or not hmac.compare_digest(mac, _mac(self.key, header)):
            raise PermissionError("the migration header is not signed with this deployment's KV key")
        ts, nonce = header.get("ts"), header.get("nonce")
        if not isinstance(ts, (int, float)) or abs(time.time() - float(ts)) > MAX_CLOCK_SKEW_S:
            raise PermissionError(f"the migration header's timestamp is more than {MAX_CLOCK_SKEW_S:.0f}s off")
        with self._lock:
            if not isinstance(nonce, str) or nonce in self._seen:
                raise PermissionError("the migration header was already used (a replay)")
            self._seen[nonce] = None
            while len(self._seen) > SEEN_NONCES:
                self._seen.popitem(last=False)


class ReceivePool:
    """Receive memory reused across migrations, so a state lands in pages that are already
    mapped: fresh arrays cost a page fault per 4 KiB, which halved UCX's bandwidth (measured in
    bench/results/rollout_engine.md: 4.6 GiB/s into fresh arrays, 11 into reused ones, memcpy 14).

    A state's KV arrays are carved from one block; the block comes back to the pool when the last
    array (or tensor) made from it is gone (the engine installs imported KV into its cache, then
    drops them), never earlier. Idle blocks are kept up to ``max_idle_bytes`` in all (a bounded
    cache, like the engine's KV pool; 0: nothing kept, every state gets fresh memory)."""

    ALIGN = 64
    GRAIN = 1 << 20  # block sizes are whole MiB, so states of nearby sizes share blocks

    def __init__(self, max_idle_bytes: int) -> None:
        self.max_idle_bytes = max_idle_bytes
        self._idle: list[np.ndarray] = []
        self._lock = threading.Lock()
        self.reused = 0
        self.fresh = 0

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._idle)

    def arrays(self, plan: list[tuple[tuple[int, ...], np.dtype]]) -> list[np.ndarray]:
        offsets, end = [], 0
        for shape, dtype in plan:
            offsets.append(end)
            end += -(-dtype.itemsize * int(np.prod(shape, dtype=np.int64)) // self.ALIGN) * self.ALIGN
        block = self._take(max(end, 1))
        # a ctypes view of the block per state: every array below refers to it (not to the block),
        # so its finalizer runs when the last of them (or of the tensors made from them) is gone
        view: Any = (ctypes.c_uint8 * max(end, 1)).from_buffer(block)  # type: ignore[arg-type]
        weakref.finalize(view, self._give_back, block)
        return [np.frombuffer(view, dtype=dtype, count=int(np.prod(shape, dtype=np.int64)), offset=off).reshape(shape)
                for (shape, dtype), off in zip(plan, offsets)]

    def _take(self, nbytes: int) -> np.ndarray:
        size = -(-nbytes // self.GRAIN) * self.GRAIN
        with self._lock:
            fits = [i for i, b in enumerate(self._idle) if size <= b.nbytes <= 2 * size]
            if fits:  # (by index: arrays compare element-wise)
                block = self._idle.pop(min(fits, key=lambda i: self._idle[i].nbytes))
                self.reused += 1
                return block
            self.fresh += 1
        return np.empty(size, np.uint8)

    def _give_back(self, block: np.ndarray) -> None:
        with self._lock:
            self._idle.append(block)
            self._idle.sort(key=lambda b: -b.nbytes)
            while sum(b.nbytes for b in self._idle) > self.max_idle_bytes:
                self._idle.pop(0)  # the largest goes first


_POOLS: dict[int, ReceivePool] = {}
_POOLS_LOCK = threading.Lock()


def shared_pool(max_idle_bytes: int) -> ReceivePool:
    """The process's receive pool of that size: an engine's UCX and TCP receivers share one, so
    its idle memory is bounded once, not per receiver."""
    with _POOLS_LOCK:
        return _POOLS.setdefault(max_idle_bytes, ReceivePool(max_idle_bytes))


def empty_arrays(header: dict[str, Any], max_bytes: int = DEFAULT_MAX_STATE_BYTES,
                 pool: ReceivePool | None = None) -> list[np.ndarray]:
    """Receive buffers for a header, validated (ValueError on anything malformed or larger than
    ``max_bytes`` in all: checked before anything is allocated). With a ``pool`` the KV arrays
    come from its reused memory (the four small ones are always fresh: the request keeps its
    prompt for as long as it runs, which must not pin a whole state's block)."""
    specs = header.get("arrays")
    if not isinstance(specs, list) or not (4 <= len(specs) <= MAX_ARRAYS) or len(specs) % 2:
        raise ValueError("header arrays must list prompt, generated ids, logprobs, rng and k/v pairs")
    plan = []
    total = 0
    for spec in specs:
        dtype = np.dtype(spec["dtype"])
        if dtype.hasobject:
            raise ValueError("object arrays are not accepted")
        shape = tuple(int(d) for d in spec["shape"])
        if any(d < 0 for d in shape) or len(shape) > 8:
            raise ValueError(f"bad array shape {shape}")
        total += dtype.itemsize * int(np.prod(shape, dtype=object))  # Python ints: no overflow
        if total > max_bytes:
            raise ValueError(f"the state's arrays exceed this receiver's bound of {max_bytes} bytes")
        plan.append((shape, dtype))
    small = [np.empty(shape, dtype=dtype) for shape, dtype in plan[:4]]
    if pool is None or pool.max_idle_bytes <= 0:
        return small + [np.empty(shape, dtype=dtype) for shape, dtype in plan[4:]]
    return small + pool.arrays(plan[4:])


def build_state(header: dict[str, Any], arrays: list[np.ndarray]) -> MigrationState:
    r = header["request"]
    params = SamplingParams(
        temperature=float(r["params"]["temperature"]), top_p=float(r["params"]["top_p"]),
        top_k=int(r["params"]["top_k"]), max_new_tokens=int(r["params"]["max_new_tokens"]),
        stop_token_ids=tuple(int(t) for t in r["params"]["stop_token_ids"]),
        seed=None if r["params"]["seed"] is None else int(r["params"]["seed"]),
        top_logprobs=int(r["params"].get("top_logprobs", 0)),
        grammar=_grammar(r["params"].get("grammar")),
    )
    req = GenRequest(request_id=str(r["request_id"]), prompt_ids=arrays[0], params=params,
                     execution_id=str(r["execution_id"]), call_id=str(r["call_id"]),
                     agent_id=str(r["agent_id"]), role=str(r["role"]))
    kv = [(arrays[i], arrays[i + 1]) for i in range(4, len(arrays), 2)]
    return MigrationState(request=req, generated_ids=arrays[1], generated_logprobs=arrays[2],
                          rng_state=arrays[3].tobytes(), weight_version=int(header["weight_version"]),
                          kv=kv, kv_dtype=str(header["kv_dtype"]))


def _grammar(g: Any) -> GrammarSpec | None:
    if g is None:
        return None
    if not (isinstance(g, list) and len(g) == 2 and all(isinstance(x, str) for x in g)):
        raise ValueError("the request's grammar must be [kind, source]")
    return GrammarSpec(g[0], g[1])


# --------------------------------------------------------------------------- socket helpers
def _send_msg(sock: socket.socket, obj: dict[str, Any], magic: bytes = b"") -> None:
    body = json.dumps(obj).encode()
    sock.sendall(magic + struct.pack("<I", len(body)) + body)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise TransportError("connection closed mid-message")
        got += n


def _recv_msg(sock: socket.socket, magic: bytes = b"") -> dict[str, Any]:
    if magic and _recv_exact(sock, len(magic)) != magic:
        raise TransportError("peer is not a Gyre KV transport (bad magic)")
    (n,) = struct.unpack("<I", _recv_exact(sock, 4))
    if n > MAX_HEADER_BYTES:
        raise TransportError(f"message of {n} bytes exceeds the {MAX_HEADER_BYTES}-byte header limit")
    return json.loads(_recv_exact(sock, n))


def _recv_arrays(sock: socket.socket, arrays: list[np.ndarray]) -> None:
    for a in arrays:
        _recv_into(sock, _byte_view(a))


def _byte_view(a: np.ndarray) -> memoryview:
    return memoryview(a.reshape(-1).view(np.uint8)) if a.size else memoryview(b"")  # type: ignore[arg-type]


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, 4 << 20)


# --------------------------------------------------------------------------- UCX runtime
class _Ucx:
    """Process-wide ucxx context driven by one asyncio loop thread (ucxx is asyncio-based)."""

    _instance: _Ucx | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
        import ucxx  # may raise ImportError: callers fall back to TCP

        self.ucxx = ucxx
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="ucxx-loop", daemon=True)
        self._thread.start()
        self._endpoints: dict[bytes, Any] = {}
        self.receiving = 0  # transfers with receives posted (changed on the loop thread only)
        self.worker_address: bytes = self.call(self._init(), timeout_s=30)
        self.lanes: list[_Lane] = [_Lane(self.loop, self.ucxx.recv, self.worker_address)]  # 0: this worker
        self._lanes_lock = threading.Lock()

    @classmethod
    def get(cls) -> _Ucx:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    async def _init(self) -> bytes:
        self.ucxx.init(progress_mode="thread")
        return bytes(self.ucxx.get_worker_address())

    def call(self, coro: Any, timeout_s: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=timeout_s)

    async def _endpoint(self, address: bytes) -> Any:
        ep = self._endpoints.get(address)
        if ep is None or ep.closed:
            ep = await self.ucxx.create_endpoint_from_worker_address(
                self.ucxx.get_ucx_address_from_buffer(address), endpoint_error_handling=ENDPOINT_ERROR_HANDLING)
            self._endpoints[address] = ep
        return ep

    def ensure_lanes(self, n: int) -> int:
        """Start receive lanes up to ``n`` (each an extra ucxx context: its own worker, progress
        thread and asyncio loop thread); returns how many there are. A lane that cannot start is
        logged and the receiver goes on with fewer."""
        with self._lanes_lock:
            while len(self.lanes) < n:
                try:
                    self.lanes.append(_start_lane(len(self.lanes)))
                except Exception as exc:  # deliberate: fewer lanes still carry every array
                    log.warning("ucx receive lane unavailable", lanes=len(self.lanes),
                                error=f"{type(exc).__name__}: {exc}")
                    break
            return len(self.lanes)

    async def send(self, targets: list[bytes], arrays: list[np.ndarray], tag: int) -> None:
        """Send ``arrays[i]`` as a message tagged ``tag + i`` to the worker at ``targets[i]``."""
        eps = {address: await self._endpoint(address) for address in set(targets)}
        await asyncio.gather(*(eps[targets[i]].send(a, tag=tag + i, force_tag=True)
                               for i, a in enumerate(arrays) if a.nbytes))

    def drop_endpoint(self, *addresses: bytes) -> None:
        """Abort the endpoints to a peer that died: their pending sends fail (their buffers are
        released) and the next transfer to those addresses makes new ones."""
        async def drop() -> None:
            for address in addresses:
                ep = self._endpoints.pop(address, None)
                if ep is not None and not ep.closed:
                    ep.abort(period=10**9)

        try:
            self.call(drop(), timeout_s=10)
        except Exception as exc:  # deliberate: a leaked endpoint is no reason to fail the caller
            log.warning("ucx endpoint abort failed", error=f"{type(exc).__name__}: {exc}")

    def start_recv(self, arrays: list[np.ndarray], tag: int, lanes: int = 1) -> _Posted:
        """Post the tagged receives of ``arrays`` (tags ``tag + i``), spread over up to ``lanes``
        receive lanes (``posted.lane[i]``: the lane of array ``i``; tell the sender
        ``posted.workers``); wait with ``watch``."""
        lanes = min(lanes, len(self.lanes))
        posted = _Posted(arrays, tag, lane=lane_split(arrays, lanes),
                         workers=[lane.address for lane in self.lanes[:lanes]])

        async def one(i: int, a: np.ndarray) -> None:
            await self.lanes[posted.lane[i]].recv(a, tag=tag + i)
            posted.done[i] = True

        def post(i: int, a: np.ndarray) -> Any:  # on the array's lane's loop
            loop = self.lanes[posted.lane[i]].loop
            if loop is self.loop:
                return one(i, a)
            return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(one(i, a), loop))

        async def every() -> None:
            self.receiving += 1
            try:
                await asyncio.gather(*(post(i, a) for i, a in enumerate(arrays) if a.nbytes))
            finally:
                self.receiving -= 1

        posted.future = asyncio.run_coroutine_threadsafe(every(), self.loop)
        return posted

    def abandon(self, posted: _Posted) -> None:
        """Complete a dead transfer's receives that no message matched yet, with a one-byte
        message from this process to the worker of each one's lane on its tag, so that their
        buffers (up to a whole state) are freed now instead of staying posted for good: ucxx
        cannot cancel one tagged receive, and without peer error handling nothing fails it."""
        missing = [i for i, a in enumerate(posted.arrays) if a.nbytes and not posted.done[i]]
        if not missing:
            return

        async def tombstones() -> None:  # each to the worker of the lane its receive is posted on
            targets = {i: posted.workers[posted.lane[i]] for i in missing}
            eps = {address: await self._endpoint(address) for address in set(targets.values())}
            await asyncio.gather(*(eps[address].send(np.zeros(1, np.uint8), tag=posted.tag + i, force_tag=True)
                                   for i, address in targets.items()))

        try:
            self.call(tombstones(), timeout_s=30)
        except Exception as exc:  # deliberate: the receives stay posted; the process goes on
            log.warning("kv receives of a dead transfer stay posted", tags=len(missing),
                        error=f"{type(exc).__name__}: {exc}")


class _Lane(NamedTuple):
    """A UCX receive lane: the asyncio loop its receives are posted on, its receive coroutine
    (``recv(buffer, tag)``) and its worker's address."""

    loop: asyncio.AbstractEventLoop
    recv: Callable[..., Any]
    address: bytes


def _start_lane(index: int) -> _Lane:
    """A receive lane: a ucxx context of its own (worker and progress thread) driven by its own
    asyncio loop thread."""
    from ucxx._lib_async import ApplicationContext

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name=f"ucxx-lane-{index}", daemon=True).start()

    async def make() -> Any:  # on its loop: ucxx starts the context's progress thread for that loop
        return ApplicationContext(progress_mode="thread")

    try:
        ctx = asyncio.run_coroutine_threadsafe(make(), loop).result(timeout=30)
    except BaseException:
        loop.call_soon_threadsafe(loop.stop)
        raise
    return _Lane(loop, ctx.recv, bytes(ctx.worker_address))


def lane_split(arrays: list[np.ndarray], lanes: int) -> list[int]:
    """The receive lane of each array: largest first, each to the lane with the fewest bytes so
    far, so that every lane copies about the same; empty arrays (never sent) stay on lane 0."""
    lane = [0] * len(arrays)
    load = [0] * max(1, lanes)
    for i in sorted(range(len(arrays)), key=lambda i: -arrays[i].nbytes):
        if arrays[i].nbytes:
            lane[i] = min(range(len(load)), key=load.__getitem__)
            load[lane[i]] += arrays[i].nbytes
    return lane


@dataclass
class _Posted:
    """A transfer's posted UCX receives: which arrays arrived, the lane each is posted on, and the
    future of all of them."""

    arrays: list[np.ndarray]
    tag: int
    lane: list[int] = field(default_factory=list)
    workers: list[bytes] = field(default_factory=list)  # the worker address of each lane
    done: list[bool] = field(default_factory=list)
    future: Any = None

    def __post_init__(self) -> None:
        self.done = [a.nbytes == 0 for a in self.arrays]


def watch(future: Any, sock: socket.socket, timeout_s: float) -> None:
    """Wait for a UCX transfer's ``future`` while watching its TCP control connection: the peer
    sends nothing on it during the transfer, so end-of-file (or a reset) there means the peer
    process is gone (the kernel closed its socket) and the transfer is abandoned at once, with
    ``PeerGone``, instead of hanging until ``timeout_s`` (UCX peer error handling is off, see
    ENDPOINT_ERROR_HANDLING). Bytes arriving instead (the receiver's early ack) stop the watch."""
    deadline = time.monotonic() + timeout_s
    watching = True
    while True:
        try:
            future.result(timeout=WATCH_INTERVAL_S)
            return
        except concurrent.futures.TimeoutError:
            pass
        except Exception as exc:  # ucxx's own errors (a dead peer's shared memory, I/O): a broken transfer
            raise TransportError(f"UCX transfer failed: {type(exc).__name__}: {exc}") from exc
        if time.monotonic() > deadline:
            raise TimeoutError(f"UCX transfer did not finish within {timeout_s:.0f}s")
        if watching and select.select([sock], [], [], 0)[0]:
            try:
                alive = bool(sock.recv(1, socket.MSG_PEEK))
            except OSError:
                alive = False
            if not alive:
                raise PeerGone("the peer closed the connection mid-transfer (its process died?)")
            watching = False


# --------------------------------------------------------------------------- receiver
class Receiver:
    """Accepts migrations on a TCP port (and a UCX worker for kind "ucx"); calls ``on_state``.

    Lifecycle: Receiver(kind, on_state) -> .address handed to senders -> close(). Each connection
    is served by its own thread, so a slow import never blocks another transfer.
    """

    def __init__(self, kind: str, on_state: OnState, *, host: str = "127.0.0.1", key: bytes = b"",
                 max_bytes: int = DEFAULT_MAX_STATE_BYTES, pool_bytes: int = DEFAULT_POOL_BYTES,
                 lanes: int = RECEIVE_LANES) -> None:
        if kind not in KINDS:
            raise ValueError(f"KV transport kind must be one of {KINDS}, got {kind!r}")
        self.on_state = on_state
        self.verifier = Verifier(key)
        self.max_bytes = max_bytes
        self.pool = shared_pool(pool_bytes)
        self._ucx: _Ucx | None = None
        self.lanes = 1  # UCX receive lanes this receiver spreads a state over
        if kind == "ucx":
            try:
                self._ucx = _Ucx.get()
                self.lanes = min(max(1, lanes), self._ucx.ensure_lanes(lanes))
            except Exception as exc:  # deliberate fallback: a TCP receiver still works
                FALLBACKS.labels("ucx_receiver_unavailable").inc()
                log.warning("ucx receiver unavailable; serving TCP", error=f"{type(exc).__name__}: {exc}")
        self._sock = socket.create_server((host, 0))
        port = self._sock.getsockname()[1]
        self.kind = "ucx" if self._ucx else "tcp"
        self.address = (f"ucx://{host}:{port}/{self._ucx.worker_address.hex()}" if self._ucx
                        else f"tcp://{host}:{port}")
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name=f"kv-recv-{port}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            _tune(conn)
            conn.settimeout(STALL_TIMEOUT_S)
            try:
                header = _recv_msg(conn, MAGIC)
            except (TransportError, OSError, ValueError) as exc:
                log.warning("kv header rejected", error=str(exc))
                return
            try:
                if not isinstance(header, dict) or header.get("v") != PROTOCOL_VERSION:
                    got = header.get("v") if isinstance(header, dict) else None
                    raise ValueError(f"protocol version {got} != {PROTOCOL_VERSION}")
                self.verifier.check(header)
                arrays = empty_arrays(header, self.max_bytes, self.pool)
            except (PermissionError, ValueError, KeyError, TypeError) as exc:
                log.warning("kv header rejected", error=str(exc))
                try:  # the sender learns why (nothing was allocated or read)
                    _send_msg(conn, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
                except OSError:
                    pass
                return
            mode = "ucx" if header.get("mode") == "ucx" and self._ucx is not None else "tcp"
            posted = None
            answer: dict[str, Any] = {"mode": mode}
            try:
                if mode == "ucx":
                    assert self._ucx is not None
                    # a sender that reads lanes from the answer gets them; any other sends to lane 0
                    lanes = self.lanes if header.get("lanes") is True else 1
                    posted = self._ucx.start_recv(arrays, int(header["tag"]), lanes)
                    if lanes > 1:
                        answer.update(workers=[w.hex() for w in posted.workers], lane=posted.lane)
                _send_msg(conn, answer)
                if posted is not None:
                    watch(posted.future, conn, STALL_TIMEOUT_S)
                else:
                    _recv_arrays(conn, arrays)
            except Exception as exc:  # transfer broke: the sender sees the closed socket and retries
                ABORTED.labels("receiver", "peer_gone" if isinstance(exc, PeerGone) else
                               "timeout" if isinstance(exc, TimeoutError) else "failed").inc()
                log.warning("kv transfer failed", mode=mode, error=f"{type(exc).__name__}: {exc}")
                if posted is not None and self._ucx is not None:
                    self._ucx.abandon(posted)
                return
            nbytes = sum(a.nbytes for a in arrays)
            if posted is not None:
                for lane in sorted(set(posted.lane)):
                    LANE_BYTES.labels(str(lane)).inc(sum(a.nbytes for a, k in zip(arrays, posted.lane) if k == lane))
            try:
                state = build_state(header, arrays)
                self.on_state(state)
                reply: dict[str, Any] = {"ok": True, "bytes": nbytes}
            except Exception as exc:  # deliberate: report the refusal to the sender
                reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            # This thread lets go of the state before the sender hears the ack: what on_state kept is
            # all that holds its receive block, so a sender that starts the next transfer at once (a
            # drain moving several requests) lands it in these mapped pages, not in fresh ones that
            # fault in per 4 KiB (which halves UCX's bandwidth).
            state = posted = arrays = None  # type: ignore[assignment]
            try:
                _send_msg(conn, reply)
            except OSError as exc:
                log.warning("kv ack lost", error=str(exc))


_RECEIVERS: dict[str, Receiver] = {}
_RECEIVERS_LOCK = threading.Lock()


def make_receiver(kind: str, on_state: OnState, *, host: str = "127.0.0.1", key: bytes = b"",
                  max_bytes: int = DEFAULT_MAX_STATE_BYTES, pool_bytes: int = DEFAULT_POOL_BYTES,
                  lanes: int = RECEIVE_LANES) -> str:
    """Start a receiver for ``kind`` ("ucx" | "tcp"); returns the address senders use. A UCX
    receiver spreads each state over up to ``lanes`` receive lanes (``GYRE_UCX_RECEIVE_LANES``).

    ``kind="ucx"`` without a working ucxx serves TCP (logged, counted): the address then starts
    with ``tcp://``. Close with ``close_receiver(address)``.
    """
    recv = Receiver(kind, on_state, host=host, key=key, max_bytes=max_bytes, pool_bytes=pool_bytes, lanes=lanes)
    with _RECEIVERS_LOCK:
        _RECEIVERS[recv.address] = recv
    return recv.address


def close_receiver(address: str) -> None:
    with _RECEIVERS_LOCK:
        recv = _RECEIVERS.pop(address, None)
    if recv is not None:
        recv.close()


# --------------------------------------------------------------------------- sender
def parse_address(address: str) -> tuple[str, str, int, bytes]:
    """``(scheme, host, port, ucx worker address)``; ValueError on a malformed address."""
    scheme, sep, rest = address.partition("://")
    if not sep or scheme not in KINDS:
        raise ValueError(f"KV receiver address must start with ucx:// or tcp://, got {address!r}")
    hostport, _, worker_hex = rest.partition("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"KV receiver address {address!r} lacks host:port")
    worker = bytes.fromhex(worker_hex) if worker_hex else b""
    if scheme == "ucx" and not worker:
        raise ValueError(f"ucx address {address!r} lacks the worker address")
    return scheme, host, int(port), worker


def send_state(kind: str, address: str, state: MigrationState, *, timeout_s: float = STALL_TIMEOUT_S,
               key: bytes = b"") -> int:
    """Deliver ``state`` to the receiver at ``address``; returns payload bytes sent.

    ``kind`` is the transport asked for ("ucx" | "tcp"); UCX falls back to TCP (logged, counted).
    Raises ``TransportError`` when it could not be delivered, ``StateRejected`` when refused.
    """
    return send_state_ex(kind, address, state, timeout_s=timeout_s, key=key).bytes_sent


def send_state_ex(kind: str, address: str, state: MigrationState, *, timeout_s: float = STALL_TIMEOUT_S,
                  key: bytes = b"") -> SendResult:
    """Like ``send_state``, also reporting the transport that carried the arrays."""
    if kind not in KINDS:
        raise ValueError(f"KV transport kind must be one of {KINDS}, got {kind!r}")
    scheme, host, port, worker = parse_address(address)
    t0 = time.perf_counter()
    arrays = state_arrays(state)
    if kind == "ucx" and scheme == "ucx":
        ucx: _Ucx | None = None
        try:
            ucx = _Ucx.get()
        except Exception as exc:  # deliberate fallback
            FALLBACKS.labels("ucx_sender_unavailable").inc()
            log.warning("ucx unavailable here; sending over TCP", error=f"{type(exc).__name__}: {exc}")
        if ucx is not None:
            try:
                n, used = _send(host, port, state, arrays, ucx, worker, timeout_s, key)
            except (TransportError, OSError, TimeoutError) as exc:
                FALLBACKS.labels("ucx_send_failed").inc()
                log.warning("ucx send failed; resending over TCP", error=f"{type(exc).__name__}: {exc}")
            else:
                if used != "ucx":
                    FALLBACKS.labels("ucx_refused_by_receiver").inc()
                return SendResult(n, used, used != "ucx", time.perf_counter() - t0)
        n, used = _send(host, port, state, arrays, None, b"", timeout_s, key)
        return SendResult(n, used, True, time.perf_counter() - t0)
    n, used = _send(host, port, state, arrays, None, b"", timeout_s, key)
    return SendResult(n, used, False, time.perf_counter() - t0)


def lane_targets(answer: dict[str, Any], worker: bytes, n: int) -> list[bytes]:
    """The worker address each of a state's ``n`` arrays goes to: the receive lanes a UCX
    receiver's answer names (``workers`` and ``lane``), or its address's worker for every array
    when the answer names none. TransportError (the sender then resends over TCP) on an answer
    whose lanes do not fit."""
    workers, lane = answer.get("workers"), answer.get("lane")
    if workers is None and lane is None:
        return [worker] * n
    try:
        addresses = [bytes.fromhex(w) for w in workers]  # type: ignore[union-attr]
        if not isinstance(lane, list) or len(lane) != n:
            raise ValueError(f"{n} arrays but {len(lane) if isinstance(lane, list) else lane!r} lanes")
        if not all(type(i) is int and 0 <= i < len(addresses) for i in lane):
            raise ValueError(f"a lane outside the {len(addresses)} workers")
        return [addresses[i] for i in lane]
    except (TypeError, ValueError, IndexError) as exc:
        raise TransportError(f"the receiver's UCX lanes do not fit the state: {exc}") from exc


def ucx_budget_s(arrays: list[np.ndarray], timeout_s: float) -> float:
    """How long a UCX transfer may take before the sender gives up on it and resends over TCP:
    a few seconds plus the bytes at a slow link's rate, never more than ``timeout_s``. A UCX
    endpoint that cannot make progress (a transport chosen for peers it wrongly believes local,
    a fabric that drops the connection) hangs rather than fails; the migration must not."""
    nbytes = sum(a.nbytes for a in arrays)
    return min(timeout_s, UCX_MIN_BUDGET_S + nbytes / UCX_FLOOR_BYTES_PER_S)


def _send(host: str, port: int, state: MigrationState, arrays: list[np.ndarray], ucx: _Ucx | None,
          worker: bytes, timeout_s: float, key: bytes = b"") -> tuple[int, str]:
    tag = secrets.randbits(47) << 16
    header = state_header(state, arrays, mode="ucx" if ucx else "tcp", tag=tag)
    if ucx:
        header["lanes"] = True  # this sender sends each array to the receive lane the answer names
    header = sign(header, key)
    try:
        sock = socket.create_connection((host, port), timeout=timeout_s)
    except OSError as exc:
        raise TransportError(f"KV receiver {host}:{port} unreachable: {exc}") from exc
    with sock:
        _tune(sock)
        try:
            _send_msg(sock, header, MAGIC)
            answer = _recv_msg(sock)
            if answer.get("ok") is False:  # the header was refused: nothing was sent
                raise StateRejected(f"receiver refused the header: {answer.get('error')}")
            mode = answer.get("mode")
            if mode == "ucx":
                assert ucx is not None
                targets = lane_targets(answer, worker, len(arrays))
                sending = asyncio.run_coroutine_threadsafe(ucx.send(targets, arrays, tag), ucx.loop)
                try:
                    watch(sending, sock, ucx_budget_s(arrays, timeout_s))
                except (TransportError, TimeoutError) as exc:
                    reason = "peer_gone" if isinstance(exc, PeerGone) else (
                        "failed" if isinstance(exc, TransportError) else "timeout")
                    ABORTED.labels("sender", reason).inc()
                    ucx.drop_endpoint(*set(targets))  # their pending sends fail and release their arrays
                    raise
            else:
                for a in arrays:
                    sock.sendall(_byte_view(a))
            reply = _recv_msg(sock)
        except (OSError, TransportError, json.JSONDecodeError) as exc:
            raise TransportError(f"KV transfer to {host}:{port} failed: {type(exc).__name__}: {exc}") from exc
    if not reply.get("ok"):
        raise StateRejected(f"receiver refused the state: {reply.get('error')}")
    nbytes = int(reply["bytes"])
    TRANSFER_BYTES.labels(str(mode)).inc(nbytes)
    return nbytes, str(mode)
