"""TITO records of gateway calls reach a real trajectory service (real Redis, gRPC on port 0)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from services.rollout.calls import CallMeta
from services.rollout.engine import SamplingParams
from services.rollout.main import _tito_sink
from services.rollout.config import GatewayConfig
from services.rollout.tito import TitoForwarder
from services.trajectory.client import TrajectoryClient
from services.trajectory.config import TrajectoryConfig
from services.trajectory.main import build_trajectory
from tests.support.rollout_cluster import start_engine, start_gateway

torch.set_num_threads(1)


def test_gateway_calls_arrive_as_tito_records(redis_url: str, tmp_path: Path) -> None:
    traj, _ = build_trajectory(TrajectoryConfig(redis_url=redis_url, spool_dir=str(tmp_path / "spool"), port=0))
    traj.start()
    traj.set_serving(True)
    # Records queued while the trajectory service is unreachable are retried, not lost.
    forwarder = TitoForwarder(_tito_sink(GatewayConfig(trajectory_address=traj.address)), backoff_s=0.05).start()
    engine = start_engine("cell-a")
    gw = start_gateway(on_record=forwarder.submit)
    try:
        client = gw.client()
        client.register_engine("cell-a", engine.address)
        greedy = SamplingParams(temperature=0.0, max_new_tokens=8)
        p = np.arange(1, 30, dtype=np.int32)
        first = client.generate(CallMeta(job_id="job-t", execution_id="ex-t", call_id="c1", agent_id="main"), p, greedy)
        second_prompt = np.concatenate([p, first.output_ids, np.array([3, 4, 5], np.int32)])
        client.generate(CallMeta(job_id="job-t", execution_id="ex-t", call_id="c2", agent_id="main"), second_prompt, greedy)
        client.generate(CallMeta(job_id="job-t", execution_id="ex-t", call_id="c3", agent_id="sub", role="subagent"),
                        p[:10], greedy)
        assert forwarder.flush(timeout_s=30)
        stats = TrajectoryClient(traj.address).execution_stats("ex-t", job_id="job-t")
        assert stats.num_calls == 3
        # c2 extends c1 exactly, so the tree stores the shared prefix once.
        assert stats.unique_tokens == len(second_prompt) + 8 + 8
        assert stats.naive_tokens > stats.unique_tokens
    finally:
        forwarder.stop(timeout_s=5)
        gw.stop()
        engine.stop()
        traj.stop(0)
