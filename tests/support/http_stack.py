"""A live stack behind the gateway's HTTP endpoint, in this process: real Redis, a trajectory
service, one engine (loaded as ``gyre-engine`` would, by model name), a gateway forwarding TITO
records, and the asyncio HTTP server with session base URLs minted on that Redis."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest

from services.common.redis_store import connect
from services.rollout.config import EngineConfig, GatewayConfig
from services.rollout.http_async import AsyncOpenAIServer
from services.rollout.main import _load_engine, _load_tokenizer, _tito_sink
from services.rollout.openai_http import OpenAIEndpoint
from services.rollout.tito import TitoForwarder
from services.scheduler.sessions import Sessions
from services.trajectory.client import TrajectoryClient
from services.trajectory.config import TrajectoryConfig
from services.trajectory.main import build_trajectory
from tests.support.redis_server import RedisServer
from tests.support.rollout_cluster import LocalGateway, start_engine, start_gateway


@dataclass
class HttpStack:
    engine: Any  # TorchEngine
    tokenizer: Any
    gateway: LocalGateway
    http: AsyncOpenAIServer
    forwarder: TitoForwarder
    trajectory: TrajectoryClient
    redis_url: str


@contextmanager
def http_stack(tmp_path_factory: pytest.TempPathFactory, *, model: str, served: str, job_id: str,
               max_body_bytes: int, **engine_settings: Any) -> Iterator[HttpStack]:
    """The stack serving ``model`` as ``served``; calls without a job go to ``job_id``."""
    redis_srv = RedisServer(tmp_path_factory.mktemp("redis")).start()
    traj, _ = build_trajectory(TrajectoryConfig(redis_url=redis_srv.url, port=0,
                                                spool_dir=str(tmp_path_factory.mktemp("spool"))))
    traj.start()
    traj.set_serving(True)
    engine = _load_engine(EngineConfig(model=model, device="cpu", torch_threads=1, **engine_settings))
    local = start_engine(f"cell-{job_id}", engine=engine)
    forwarder = TitoForwarder(_tito_sink(GatewayConfig(trajectory_address=traj.address))).start()
    gw = start_gateway(on_record=forwarder.submit)
    gw.client().register_engine(local.cell_id, local.address)
    tokenizer = _load_tokenizer(GatewayConfig(tokenizer_path=model))
    sessions = Sessions(connect(redis_srv.url))  # session base URLs, minted by a scheduler on this Redis
    endpoint = OpenAIEndpoint(gw.gateway, tokenizer=tokenizer, model_name=served, job_id=job_id, sessions=sessions)
    http = AsyncOpenAIServer(endpoint, max_body_bytes=max_body_bytes).start()
    sessions.publish_http_url(http.base_url)
    client = TrajectoryClient(traj.address)
    try:
        yield HttpStack(engine, tokenizer, gw, http, forwarder, client, redis_srv.url)
    finally:
        client.close()
        http.stop()
        gw.stop()
        forwarder.stop(timeout_s=10)
        local.stop()
        traj.stop(0)
        redis_srv.stop()
