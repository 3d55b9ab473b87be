"""A rollout engine process is SIGKILLed in the middle of a step of concurrent harness sessions:
every call still completes (re-prefilled on the surviving engine), and every call's TITO record
reaches the trajectory service exactly once -- 0 lost calls, 0 lost records.

    harness threads --Generate--> gateway (process) --> engine cell-a (process)  <- SIGKILL
                                     |           \\--> engine cell-b (process)
                                     \\--TITO records--> trajectory (process) --> Redis

(tests/service/test_rollout_failover.py checks one killed stream token by token, with an
in-process gateway; this is the whole path, all processes, many sessions at once.)
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.common.errors import NotFound
from services.rollout.calls import CallMeta, CallResult
from services.rollout.client import GatewayClient, collect
from services.rollout.engine import SamplingParams
from services.trajectory.client import TrajectoryClient
from tests.service.scheduler_support import wait_until
from tests.support.redis_server import RedisServer
from tests.support.service_process import ServiceProcess, stop_all

JOB = "job-kill"
SESSIONS = 8
CALLS_PER_SESSION = 2
NEW_TOKENS = 800  # long enough that the kill lands mid-stream on an idle machine too
ENGINE_ARGS = ["--model", "random-tiny", "--device", "cpu", "--torch-threads", "1", "--max-batch-size", "16",
               "--max-workers", "64", "--kv-transports", "tcp", "--grace-s", "1"]


@pytest.fixture
def cluster(tmp_path: Path, _session_redis: RedisServer) -> Iterator[dict[str, ServiceProcess]]:
    procs: dict[str, ServiceProcess] = {}
    try:
        procs["trajectory"] = ServiceProcess.start("trajectory", "services.trajectory.main", tmp_path, [
            "--redis-url", _session_redis.url, "--spool-dir", str(tmp_path / "spool"), "--grace-s", "1"])
        for cell in ("cell-a", "cell-b"):
            procs[cell] = ServiceProcess.start(cell, "services.rollout.engine_main", tmp_path,
                                               ["--cell-id", cell, *ENGINE_ARGS])
        for p in procs.values():
            p.wait_ready(timeout_s=120)
        procs["gateway"] = ServiceProcess.start("gateway", "services.rollout.gateway_main", tmp_path, [
            "--trajectory-address", procs["trajectory"].address, "--probe-interval-s", "0.5", "--grace-s", "1",
            "--metrics-port", "0",
            "--engine-addresses", f"cell-a={procs['cell-a'].address},cell-b={procs['cell-b'].address}"])
        procs["gateway"].wait_ready(timeout_s=120)
        yield procs
    finally:
        stop_all(list(procs.values()))


def _session(gateway: str, i: int, progress: list[int]) -> tuple[np.ndarray, CallResult]:
    """One harness session: a streamed call (``progress[i]`` counts its tokens), then a follow-up
    call whose prompt extends the first. Returns (first output, second result)."""
    rng = np.random.default_rng(i)
    prompt = rng.integers(1, 200, 24).astype(np.int32)
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS)
    client = GatewayClient(gateway, timeout_s=300)
    try:
        pieces = []
        for piece in client.generate_stream(CallMeta(job_id=JOB, execution_id=f"ex-{i}", call_id="c0",
                                                     agent_id="main"), prompt, params):
            pieces.append(piece)
            progress[i] += len(piece.token_ids)
        first, _lps, last = collect(pieces)
        assert last.finish_reason == "length"
        prompt = np.concatenate([prompt, first, rng.integers(1, 200, 8)]).astype(np.int32)
        second = client.generate(CallMeta(job_id=JOB, execution_id=f"ex-{i}", call_id="c1", agent_id="main"),
                                 prompt, params)
        return first, second
    finally:
        client.close()


def _reprefills(gateway: ServiceProcess) -> float:
    assert gateway.metrics_port, "the gateway must serve metrics"
    text = urllib.request.urlopen(f"http://127.0.0.1:{gateway.metrics_port}/metrics", timeout=10).read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "gyre_rollout_gateway_fallbacks_total" and sample.labels.get("kind") == "reprefill":
                return sample.value
    return 0.0


def test_engine_killed_mid_step_loses_no_call_and_no_record(cluster: dict[str, ServiceProcess]) -> None:
    gateway = cluster["gateway"]
    progress = [0] * SESSIONS
    control = GatewayClient(gateway.address, timeout_s=30)
    try:
        with ThreadPoolExecutor(SESSIONS) as pool:
            futures = [pool.submit(_session, gateway.address, i, progress) for i in range(SESSIONS)]
            # kill once every session is mid-stream: the victim's calls have tokens to re-prefill from
            wait_until(lambda: min(progress) >= 4 or any(f.done() for f in futures), 120, "every stream to start")
            load = {e.cell_id: e.in_flight for e in control.list_engines()}
            victim_cell = max(load, key=lambda c: load[c])
            cluster[victim_cell].kill()
            survivor = "cell-b" if victim_cell == "cell-a" else "cell-a"
            results = [f.result(timeout=300) for f in futures]
    finally:
        control.close()

    # every call completed at full length; the killed engine's streams were re-prefilled, and the
    # follow-up calls went to the survivor
    assert load[victim_cell] >= 1 and progress == [NEW_TOKENS] * SESSIONS
    assert all(len(first) == NEW_TOKENS for first, _ in results)
    assert all(len(second.output_ids) == NEW_TOKENS and second.finish_reason == "length" for _, second in results)
    assert all(second.cell_id == survivor for _, second in results)
    assert _reprefills(gateway) >= 1, "the victim's streams must resume by re-prefill (not restart)"
    assert gateway.alive() and cluster[survivor].alive() and not cluster[victim_cell].alive()

    # every call's TITO record reached the trajectory service, each exactly once
    with TrajectoryClient(cluster["trajectory"].address, timeout_s=30) as traj:
        def recorded(eid: str) -> int:
            try:
                return traj.execution_stats(eid, job_id=JOB).num_calls
            except NotFound:
                return 0

        wait_until(lambda: all(recorded(f"ex-{i}") == CALLS_PER_SESSION for i in range(SESSIONS)), 60,
                   "every call's TITO record at the trajectory service")
        for i in range(SESSIONS):
            stats = traj.execution_stats(f"ex-{i}", job_id=JOB)
            assert stats.num_calls == CALLS_PER_SESSION
            # the second call's prompt extends the first: one path, each shared token stored once
            assert stats.paths == 1 and stats.trainable_tokens == CALLS_PER_SESSION * NEW_TOKENS
