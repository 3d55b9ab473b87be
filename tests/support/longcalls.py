"""Long generations kept in flight through a gateway, as a long-context harness call would, so a
drain finds something to migrate (e2e tests of switches and KV migration)."""

from __future__ import annotations

import threading
import time

import numpy as np


class LongCalls:
    """Four long greedy generations kept in flight through the gateway once it is up."""

    def __init__(self) -> None:
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []
        self.completed = 0
        self.failed = 0
        # request id (the gateway's) -> tokens received so far, of each call now in flight
        self._live: dict[str, int] = {}
        self._lock = threading.Lock()

    def maybe_start(self, line: str) -> None:
        if line.startswith("report: "):  # the job is over; the stack goes down next
            self.stop()
            return
        if not line.startswith("gateway ") or "worker" in line or self.threads:
            return
        self.start(line.split()[1])

    def start(self, address: str) -> None:
        """Start the calls through the gateway at ``address`` (host:port of its TITO gRPC)."""
        for agent in range(4):  # spread over both engines: each drain finds a call in flight
            t = threading.Thread(target=self._loop, args=(address, agent), daemon=True)
            t.start()
            self.threads.append(t)

    def _loop(self, address: str, agent: int) -> None:
        from services.common.errors import GyreError
        from services.rollout.calls import CallMeta
        from services.rollout.client import GatewayClient
        from services.rollout.engine import SamplingParams

        gateway = GatewayClient(address, timeout_s=120)
        prompt = np.arange(3, 40 + agent, dtype=np.int32)
        params = SamplingParams(temperature=0.0, max_new_tokens=900)  # long calls: ~900 decode steps each
        n = 0
        while not self.stopping.is_set():
            n += 1
            meta = CallMeta(job_id="longcalls", execution_id=f"long-{agent}-{n}", call_id="c0",
                            agent_id=f"long-{agent}")
            rid = ""
            try:
                ids = lps = 0
                for piece in gateway.generate_stream(meta, prompt, params):  # streamed: its id is known early
                    rid = piece.request_id
                    ids += len(piece.token_ids)
                    lps += len(piece.logprobs)
                    with self._lock:
                        self._live[rid] = ids
            except GyreError as exc:
                if "no rollout engine is available" in str(exc):  # every cell trains right now
                    self.stopping.wait(0.5)
                    continue
                if not self.stopping.is_set():
                    self.failed += 1
                    print("long call failed:", exc)
                self.stopping.wait(0.5)
                continue
            finally:
                with self._lock:
                    self._live.pop(rid, None)
            assert ids == lps >= 1
            self.completed += 1
            time.sleep(0.01)
        gateway.close()

    def fresh(self, max_tokens: int = 300) -> set[str]:
        """Gateway request ids of the calls in flight that have received fewer than ``max_tokens``
        tokens so far: most of their ~900 decode steps (seconds) are still ahead."""
        with self._lock:
            return {rid for rid, n in self._live.items() if n < max_tokens}

    def stop(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(timeout=30)
