"""Peer process for the KV transport tests: receives one MigrationState and sends it back.

Run as ``python -m tests.support.rollout_kv_peer KIND REPLY_ADDRESS``: starts a ``KIND`` receiver,
prints its address on stdout, and echoes the first state it receives to ``REPLY_ADDRESS`` over
the same kind of transport, then exits (0 on success). ``python -m tests.support.rollout_kv_peer
die-mid-transfer ADDRESS MIB [lanes]``: a sender that starts a UCX migration of MIB MiB (on the
receiver's receive lanes with ``lanes``) and hangs midway;
``die-while-receiving``: a receiver that accepts a UCX migration and never takes its arrays.
"""

from __future__ import annotations

import queue
import sys

from services.rollout import kv_transport
from services.rollout.engine import MigrationState


def main() -> int:
    if sys.argv[1] == "die-while-receiving":
        return die_while_receiving()
    if sys.argv[1] == "die-mid-transfer":
        return die_mid_transfer(sys.argv[2], int(sys.argv[3]), sys.argv[4:] == ["lanes"])
    kind, reply_to = sys.argv[1], sys.argv[2]
    got: queue.Queue[MigrationState] = queue.Queue()
    address = kv_transport.make_receiver(kind, got.put)
    print(address, flush=True)
    state = got.get(timeout=120)
    result = kv_transport.send_state_ex(kind, reply_to, state)
    print(f"echoed {result.bytes_sent} {result.transport}", flush=True)
    kv_transport.close_receiver(address)
    return 0



def die_mid_transfer(address: str, mib: int, lanes: bool) -> int:
    """A sender that dies mid-transfer: header, then the first of the state's arrays over UCX, then
    it says so on stdout and waits to be killed (the test kills it: a crashed engine). ``lanes``:
    a sender that asks for the receiver's receive lanes (the receiver posts on all of them)."""
    import secrets
    import socket
    import time

    import numpy as np

    from services.rollout.engine import GenRequest, SamplingParams

    _, host, port, worker = kv_transport.parse_address(address)
    n = mib << 18  # float32 elements
    kv = [(np.ones(n, np.float32).reshape(1, 4, -1), np.ones(n, np.float32).reshape(1, 4, -1))]  # 4 tokens
    state = MigrationState(request=GenRequest("dying", np.arange(4, dtype=np.int32), SamplingParams()),
                           generated_ids=np.zeros(1, np.int32), generated_logprobs=np.zeros(1, np.float32),
                           rng_state=b"GYR1", weight_version=0, kv=kv, kv_dtype="float32")
    arrays = kv_transport.state_arrays(state)
    tag = secrets.randbits(47) << 16
    ucx = kv_transport._Ucx.get()
    sock = socket.create_connection((host, port))
    header = kv_transport.state_header(state, arrays, mode="ucx", tag=tag)
    if lanes:
        header["lanes"] = True
    kv_transport._send_msg(sock, header, kv_transport.MAGIC)
    answer = kv_transport._recv_msg(sock)
    assert answer["mode"] == "ucx" and ("lane" in answer) == lanes, answer
    targets = kv_transport.lane_targets(answer, worker, len(arrays))
    assert arrays[0].nbytes
    ucx.call(ucx.send(targets[:1], arrays[:1], tag), 60)  # array 0 of the rest: the receiver waits for more
    print("partial", flush=True)
    time.sleep(3600)
    return 0


def die_while_receiving() -> int:
    """A receiver that dies mid-transfer: it takes a migration's header, answers "ucx", says
    ``posted`` on stdout and then posts no receive (the sender's arrays wait), until killed."""
    import json
    import socket
    import time

    ucx = kv_transport._Ucx.get()
    server = socket.create_server(("127.0.0.1", 0))
    print(f"ucx://127.0.0.1:{server.getsockname()[1]}/{ucx.worker_address.hex()}", flush=True)
    conn, _ = server.accept()
    header = kv_transport._recv_msg(conn, kv_transport.MAGIC)
    assert json.dumps(header) and header.get("mode") == "ucx"
    kv_transport._send_msg(conn, {"mode": "ucx"})
    print("posted", flush=True)
    time.sleep(3600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
