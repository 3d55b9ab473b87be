"""Peer process for the KV transport tests: receives one MigrationState and sends it back.

Run as ``python -m tests.support.rollout_kv_peer KIND REPLY_ADDRESS``: starts a ``KIND`` receiver,
prints its address on stdout, and echoes the first state it receives to ``REPLY_ADDRESS`` over
the same kind of transport, then exits (0 on success).
"""

from __future__ import annotations

import queue
import sys

from services.rollout import kv_transport
from services.rollout.engine import MigrationState


def main() -> int:
    kind, reply_to = sys.argv[1], sys.argv[2]
    got: queue.Queue[MigrationState] = queue.Queue()
    address = kv_transport.make_receiver(kind, got.put)
    print(address, flush=True)
    state = got.get(timeout=120)
    result = kv_transport.send_state_ex(kind, reply_to, state)
    print(f"echoed {result.bytes_sent} {result.transport}", flush=True)
    kv_transport.close_receiver(address)
    return 0


if __name__ == "__main__":
    sys.exit(main())
