"""KV transport: a MigrationState crosses two real processes (UCX and TCP) and comes back bit-exact."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from services.rollout import kv_transport
from services.rollout.engine import GenRequest, MigrationState, SamplingParams
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]


def _state(layers: int = 3, tokens: int = 700, kv_dtype: str = "float32") -> MigrationState:
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, 1000, 500).astype(np.int32)
    gen = rng.integers(0, 1000, tokens - 500 + 1).astype(np.int32)
    req = GenRequest("req-1", prompt, SamplingParams(temperature=0.7, top_p=0.9, top_k=40, max_new_tokens=900,
                                                      stop_token_ids=(3, 5), seed=2**63 + 11),
                     execution_id="ex", call_id="c1", agent_id="a", role="subagent")
    if kv_dtype == "bfloat16":
        kv = [(rng.integers(0, 2**16, (2, tokens, 32)).astype(np.uint16),
               rng.integers(0, 2**16, (2, tokens, 32)).astype(np.uint16)) for _ in range(layers)]
    else:
        kv = [(rng.standard_normal((2, tokens, 32), dtype=np.float32),
               rng.standard_normal((2, tokens, 32), dtype=np.float32)) for _ in range(layers)]
    return MigrationState(request=req, generated_ids=gen, generated_logprobs=-rng.random(len(gen), dtype=np.float32),
                          rng_state=b"GYR1" + bytes(range(16)), weight_version=4, kv=kv, kv_dtype=kv_dtype)


def _assert_same(a: MigrationState, b: MigrationState) -> None:
    assert a.request.request_id == b.request.request_id
    assert a.request.params == b.request.params
    assert (a.request.execution_id, a.request.call_id, a.request.agent_id, a.request.role) == (
        b.request.execution_id, b.request.call_id, b.request.agent_id, b.request.role)
    np.testing.assert_array_equal(a.request.prompt_ids, b.request.prompt_ids)
    np.testing.assert_array_equal(a.generated_ids, b.generated_ids)
    np.testing.assert_array_equal(a.generated_logprobs, b.generated_logprobs)
    assert a.rng_state == b.rng_state and a.weight_version == b.weight_version and a.kv_dtype == b.kv_dtype
    assert len(a.kv) == len(b.kv)
    for (ka, va), (kb, vb) in zip(a.kv, b.kv):
        assert ka.dtype == kb.dtype and ka.shape == kb.shape
        np.testing.assert_array_equal(ka, kb)
        np.testing.assert_array_equal(va, vb)


def _round_trip(kind: str, state: MigrationState) -> tuple[MigrationState, kv_transport.SendResult]:
    got: queue.Queue[MigrationState] = queue.Queue()
    mine = kv_transport.make_receiver(kind, got.put)
    assert mine.startswith(f"{kind}://")
    peer = subprocess.Popen([sys.executable, "-m", "tests.support.rollout_kv_peer", kind, mine], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert peer.stdout is not None
        address = peer.stdout.readline().strip()
        assert address.startswith(f"{kind}://"), address
        result = kv_transport.send_state_ex(kind, address, state)
        back = got.get(timeout=120)
        assert peer.wait(timeout=60) == 0
        echoed = peer.stdout.read()
        assert f"echoed {state.nbytes()} {kind}" in echoed
    finally:
        peer.kill()
        kv_transport.close_receiver(mine)
    return back, result


@pytest.mark.parametrize("kind", ["tcp", "ucx"])
def test_state_round_trips_between_processes(kind: str) -> None:
    if kind == "ucx":
        pytest.importorskip("ucxx")
    state = _state()
    back, result = _round_trip(kind, state)
    assert result.transport == kind and not result.fallback
    assert result.bytes_sent == state.nbytes()
    _assert_same(state, back)


def test_lane_split_balances_bytes_and_lane_targets_checks_the_answer() -> None:
    arrays = [np.zeros(n, np.uint8) for n in (10, 0, 100, 100, 100, 100)]
    lane = kv_transport.lane_split(arrays, 2)
    assert lane[1] == 0  # an empty array is never sent
    load = [sum(a.nbytes for a, k in zip(arrays, lane) if k == j) for j in (0, 1)]
    assert sorted(load) == [200, 210]
    assert kv_transport.lane_split(arrays, 1) == [0] * 6
    assert set(kv_transport.lane_split(arrays, 4)[2:]) == {0, 1, 2, 3}
    a, b = b"\x01\x02", b"\x03"
    assert kv_transport.lane_targets({"mode": "ucx"}, a, 3) == [a, a, a]  # a receiver without lanes
    assert kv_transport.lane_targets({"workers": [a.hex(), b.hex()], "lane": [1, 0, 1]}, a, 3) == [b, a, b]
    for bad in ({"workers": [a.hex()], "lane": [0, 1, 0]}, {"workers": [a.hex()], "lane": [0, 0]},
                {"workers": ["zz"], "lane": [0, 0, 0]}, {"workers": None, "lane": [0, 0, 0]},
                {"workers": [a.hex()], "lane": [0, True, -1]}):
        with pytest.raises(kv_transport.TransportError):
            kv_transport.lane_targets(bad, a, 3)


def test_ucx_receiver_spreads_a_state_over_its_receive_lanes() -> None:
    """Each receive lane (its own ucxx worker and progress thread) takes about half of a state's
    bytes, and the state arrives exact."""
    pytest.importorskip("ucxx")
    state = _state(layers=2, tokens=4000)
    got: queue.Queue[MigrationState] = queue.Queue()
    address = kv_transport.make_receiver("ucx", got.put)
    assert len(kv_transport._Ucx.get().lanes) == kv_transport.RECEIVE_LANES == 2
    before = [kv_transport.LANE_BYTES.labels(str(k))._value.get() for k in (0, 1)]
    try:
        result = kv_transport.send_state_ex("ucx", address, state)
        _assert_same(state, got.get(timeout=120))
    finally:
        kv_transport.close_receiver(address)
    assert result.transport == "ucx" and not result.fallback
    moved = [kv_transport.LANE_BYTES.labels(str(k))._value.get() - before[k] for k in (0, 1)]
    assert sum(moved) == state.nbytes()
    kv_bytes = sum(k.nbytes + v.nbytes for k, v in state.kv)
    assert min(moved) >= kv_bytes // 2 - max(k.nbytes for k, _ in state.kv)
    # a receiver made with one lane takes everything on lane 0
    one = kv_transport.make_receiver("ucx", got.put, lanes=1)
    before = [kv_transport.LANE_BYTES.labels(str(k))._value.get() for k in (0, 1)]
    try:
        kv_transport.send_state("ucx", one, state)
        _assert_same(state, got.get(timeout=120))
    finally:
        kv_transport.close_receiver(one)
    assert [kv_transport.LANE_BYTES.labels(str(k))._value.get() - before[k] for k in (0, 1)] == [state.nbytes(), 0]


def test_bfloat16_kv_and_empty_kv_round_trip_over_tcp() -> None:
    state = _state(kv_dtype="bfloat16")
    back, _ = _round_trip("tcp", state)
    _assert_same(state, back)
    bare = _state()
    bare.kv = []
    back, _ = _round_trip("tcp", bare)
    _assert_same(bare, back)


def test_ucx_request_to_tcp_receiver_falls_back_and_counts() -> None:
    got: queue.Queue[MigrationState] = queue.Queue()
    address = kv_transport.make_receiver("tcp", got.put)
    before = kv_transport.FALLBACKS.labels("ucx_send_failed")._value.get()
    try:
        # a ucx:// address whose worker blob is garbage: the UCX path fails, TCP carries it
        port = address.rsplit(":", 1)[1]
        bogus = f"ucx://127.0.0.1:{port}/00ff"
        result = kv_transport.send_state_ex("ucx", bogus, _state(layers=1, tokens=600))
    finally:
        kv_transport.close_receiver(address)
    assert result.transport == "tcp" and result.fallback
    _assert_same(_state(layers=1, tokens=600), got.get(timeout=10))
    after = kv_transport.FALLBACKS.labels("ucx_send_failed")._value.get()
    refused = kv_transport.FALLBACKS.labels("ucx_refused_by_receiver")._value.get()
    assert after + refused > before


def test_refused_state_raises_and_dead_receiver_is_transport_error() -> None:
    def refuse(_state: MigrationState) -> None:
        raise ValueError("kv layers do not match this model")

    address = kv_transport.make_receiver("tcp", refuse)
    try:
        with pytest.raises(kv_transport.StateRejected, match="do not match"):
            kv_transport.send_state("tcp", address, _state(layers=1, tokens=600))
    finally:
        kv_transport.close_receiver(address)
    with pytest.raises(kv_transport.TransportError):
        kv_transport.send_state("tcp", address, _state(layers=1, tokens=600))


@pytest.mark.parametrize("lanes", [True, False])
def test_a_sender_dying_mid_transfer_leaves_the_receiver_serving(lanes: bool) -> None:
    """A crashed engine mid-migration (UCX peer error handling off): the receiver sees its control
    connection close, abandons the transfer, frees the receives it had posted for the arrays that
    never came (on every receive lane; or on lane 0 alone for a sender that asks for no lanes), and
    takes the next migration (from another process) bit-exact."""
    pytest.importorskip("ucxx")
    got: queue.Queue[MigrationState] = queue.Queue()
    mine = kv_transport.make_receiver("ucx", got.put)
    ucx = kv_transport._Ucx.get()
    aborted = kv_transport.ABORTED.labels("receiver", "peer_gone")
    before = aborted._value.get()
    dying = subprocess.Popen([sys.executable, "-m", "tests.support.rollout_kv_peer", "die-mid-transfer", mine, "64"]
                             + ["lanes"] * lanes, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert dying.stdout is not None and dying.stdout.readline().strip() == "partial"
        assert ucx.receiving == 1  # its first array arrived; the receiver waits for the rest
        dying.kill()
        dying.wait()
        wait_until(lambda: aborted._value.get() > before, 60, "the receiver to notice its sender died")
        wait_until(lambda: ucx.receiving == 0, 60, "the dead transfer's posted receives to be completed")
        assert got.empty()  # nothing half-received was delivered
        # the same receiver goes on: a migration from another process arrives whole
        peer = subprocess.Popen([sys.executable, "-m", "tests.support.rollout_kv_peer", "ucx", mine], cwd=ROOT,
                                stdout=subprocess.PIPE, text=True)
        try:
            assert peer.stdout is not None
            state = _state()
            kv_transport.send_state("ucx", peer.stdout.readline().strip(), state)
            _assert_same(state, got.get(timeout=120))
            assert peer.wait(timeout=60) == 0
        finally:
            peer.kill()
    finally:
        dying.kill()
        kv_transport.close_receiver(mine)


def test_a_receiver_dying_mid_transfer_fails_the_send_at_once() -> None:
    """The other way round: the receiving engine dies after taking the header; the sender sees its
    connection close, aborts the UCX endpoint (its pending sends are released) and raises
    TransportError (the resend over TCP finds no one) instead of waiting out its UCX budget."""
    pytest.importorskip("ucxx")
    dying = subprocess.Popen([sys.executable, "-m", "tests.support.rollout_kv_peer", "die-while-receiving"],
                             cwd=ROOT, stdout=subprocess.PIPE, text=True)
    def aborted() -> float:  # seen as the peer's death (its socket closed, or UCX failing), not a timeout
        return sum(kv_transport.ABORTED.labels("sender", r)._value.get() for r in ("peer_gone", "failed"))

    before = aborted()
    try:
        assert dying.stdout is not None
        address = dying.stdout.readline().strip()
        state = _state(layers=2, tokens=4000)  # 4 MB of KV: UCX rendezvous, waits for a receive
        outcome: queue.Queue[BaseException | None] = queue.Queue()

        def send() -> None:
            try:
                kv_transport.send_state("ucx", address, state)
                outcome.put(None)
            except BaseException as exc:  # noqa: BLE001 - handed to the test thread
                outcome.put(exc)

        threading.Thread(target=send, daemon=True).start()
        assert dying.stdout.readline().strip() == "posted"
        dying.kill()
        dying.wait()
        exc = outcome.get(timeout=120)
        assert isinstance(exc, kv_transport.TransportError), exc
        assert aborted() > before
    finally:
        dying.kill()


def test_bad_addresses_and_kinds() -> None:
    with pytest.raises(ValueError):
        kv_transport.parse_address("http://x:1")
    with pytest.raises(ValueError):
        kv_transport.parse_address("ucx://127.0.0.1:5")
    with pytest.raises(ValueError):
        kv_transport.send_state("rdma", "tcp://127.0.0.1:1", _state(layers=1, tokens=600))
    with pytest.raises(ValueError):
        kv_transport.make_receiver("rdma", lambda s: None)


@pytest.mark.parametrize("kind", ["tcp", "ucx"])
def test_signed_migrations_only_and_bounded_before_allocation(kind: str) -> None:
    """A receiver with the deployment key takes only headers signed with it (fresh, never replayed),
    and refuses states larger than its bound before it allocates or reads anything."""
    import json
    import socket
    import struct

    key = b"k" * 32
    got: list[MigrationState] = []
    state = _state(layers=1, tokens=600)
    address = kv_transport.make_receiver(kind, got.append, key=key, max_bytes=10 << 20)
    try:
        sent = kv_transport.send_state_ex(kind, address, state, key=key)
        assert len(got) == 1 and sent.bytes_sent > 0
        _assert_same(got[0], state)
        for wrong in (b"", b"x" * 32):  # unsigned, or signed with another deployment's key
            with pytest.raises(kv_transport.StateRejected, match="not signed"):
                kv_transport.send_state(kind, address, state, key=wrong)
        # a replayed (captured) header and a stale one are refused
        _scheme, host, port, _w = kv_transport.parse_address(address)
        arrays = kv_transport.state_arrays(state)
        header = kv_transport.sign(kv_transport.state_header(state, arrays, mode="tcp", tag=1), key)

        def offer(h: dict) -> dict:
            with socket.create_connection((host, port), timeout=10) as s:
                body = json.dumps(h).encode()
                s.sendall(kv_transport.MAGIC + struct.pack("<I", len(body)) + body)
                n = struct.unpack("<I", s.recv(4))[0]
                return json.loads(s.recv(n))

        assert offer(header) == {"mode": "tcp"}  # first use (the test then hangs up: no state)
        assert "already used" in offer(header)["error"]
        stale = kv_transport.sign(kv_transport.state_header(state, arrays, mode="tcp", tag=2), key)
        stale["ts"] -= 3600
        stale["mac"] = kv_transport._mac(key, stale)  # noqa: SLF001 - correctly signed, but an hour old
        assert "timestamp" in offer(stale)["error"]
        assert "protocol version" in offer({**header, "v": 99})["error"]
        big = kv_transport.state_header(state, arrays, mode="tcp", tag=3)  # 2 x 64 GiB of declared KV
        big["arrays"][4:] = [{"dtype": "<f4", "shape": [1 << 10, 1 << 14, 1 << 10]}] * 2
        assert "bound" in offer(kv_transport.sign(big, key))["error"]  # refused before any allocation
        assert len(got) == 1  # nothing refused reached the engine
    finally:
        kv_transport.close_receiver(address)


def test_fuzzed_bytes_on_the_receiver_port_are_refused_and_it_keeps_serving() -> None:
    """Hypothesis-generated garbage on a signed receiver's port (random bytes, truncated or
    oversized frames, headers of the wrong shape or types, wrong versions and keys): each is
    refused or dropped, nothing reaches the engine, and a real signed migration still lands."""
    import json
    import socket
    import struct

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    key = b"f" * 32
    got: list[MigrationState] = []
    address = kv_transport.make_receiver("tcp", got.append, key=key, max_bytes=8 << 20)
    _scheme, host, port, _w = kv_transport.parse_address(address)
    state = _state(layers=1, tokens=600)
    good = kv_transport.state_header(state, kv_transport.state_arrays(state), mode="tcp", tag=1)
    values = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.text(max_size=6),
                          lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                                       max_size=4), max_leaves=10)
    headers = st.one_of(
        st.dictionaries(st.sampled_from(list(good) + ["mac", "ts", "nonce"]), values, max_size=8),
        st.builds(lambda k, v: {**good, k: v}, st.sampled_from(list(good)), values),  # one field wrong
        st.builds(lambda h, signed_with: kv_transport.sign(h, signed_with),
                  st.just(good), st.sampled_from([b"", b"other-deployment-key-123456789012"])))
    frames = st.one_of(
        st.binary(max_size=64),  # no magic, short reads
        st.builds(lambda n: kv_transport.MAGIC + struct.pack("<I", n), st.integers(0, 2**32 - 1)),  # truncated
        st.builds(lambda h: (lambda b: kv_transport.MAGIC + struct.pack("<I", len(b)) + b)(json.dumps(h).encode()),
                  headers))

    @settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
    @given(frames)
    def offer(frame: bytes) -> None:
        with socket.create_connection((host, port), timeout=10) as s:
            try:  # the receiver may refuse (and hang up) before the whole frame is sent: a refusal too
                s.sendall(frame)
                s.shutdown(socket.SHUT_WR)
                while s.recv(1 << 16):
                    pass
            except OSError:
                pass

    try:
        offer()
        assert got == []
        kv_transport.send_state("tcp", address, state, key=key)  # still serving
        assert len(got) == 1
    finally:
        kv_transport.close_receiver(address)


@pytest.mark.parametrize("kind", ["tcp", "ucx"])
def test_back_to_back_transfers_land_in_the_receive_pool(kind: str) -> None:
    """The receiver lets go of a state before the sender hears its ack, so the next transfer, sent
    the moment the last one was acknowledged (a drain migrating request after request), reuses the
    pool's mapped block instead of faulting in fresh memory."""
    kept: list[int] = []
    pool_bytes = (64 << 20) + 4096 * (kind == "ucx") + 4096  # a pool of its own (pools are shared by size)
    address = kv_transport.make_receiver(kind, lambda s: kept.append(s.nbytes()), pool_bytes=pool_bytes)
    pool = kv_transport.shared_pool(pool_bytes)
    state = _state(layers=4, tokens=4096)
    try:
        for _ in range(4):
            assert kv_transport.send_state_ex(kind, address, state).transport == kind
        assert len(kept) == 4
        assert (pool.fresh, pool.reused) == (1, 3)
    finally:
        kv_transport.close_receiver(address)
