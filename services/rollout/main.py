"""Entry points of the rollout service: ``gyre-engine`` (a ROLLOUT cell) and ``gyre-gateway``.

    python -m services.rollout.engine_main --cell-id cell-1 --model builtin-tiny --port 50061
    python -m services.rollout.gateway_main --engine-addresses 127.0.0.1:50061 --http-port 8000 \\
        --tokenizer-path builtin-tiny --trajectory-address 127.0.0.1:50051

Heavy imports (torch, transformers) happen inside the build functions, so ``--help`` is fast.
"""

from __future__ import annotations

import dataclasses

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prometheus_client import Counter, Gauge

from protos.gyre.v1 import rollout_pb2, rollout_pb2_grpc
from services.common import security
from services.common.entry import Built, run_service
from services.common.errors import GyreError
from services.common.logging import get_logger
from services.common.metrics import REGISTRY
from services.common.server import advertised_host, build_server, wait_for_ready
from services.rollout.config import EngineConfig, GatewayConfig

log = get_logger(__name__)
ENCODER_TOKENS = Gauge("gyre_gateway_tito_encoder_tokens", "Tokens the TITO delta encoder holds for live executions.",
                       registry=REGISTRY)
FORGOTTEN = Counter("gyre_gateway_tito_forgotten_executions_total",
                    "Executions whose delta-encoder state was dropped because the scheduler ended them.",
                    registry=REGISTRY)

ENGINE_SERVICE = rollout_pb2.DESCRIPTOR.services_by_name["Engine"].full_name
GATEWAY_SERVICE = rollout_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name


def _load_engine(cfg: EngineConfig) -> Any:
    import torch

    from services.rollout.torch_engine import TorchEngine, build_tiny_model

    if cfg.torch_threads:
        torch.set_num_threads(cfg.torch_threads)
    kwargs: dict[str, Any] = dict(
        max_batch_size=cfg.max_batch_size, max_context=cfg.max_context_tokens or None,
        kv_capacity_tokens=cfg.kv_capacity_tokens or None, prefill_chunk_tokens=cfg.prefill_chunk_tokens,
        weight_policy=cfg.weight_policy, torch_threads=cfg.torch_threads or None,
        prefix_cache_bytes=None if cfg.prefix_cache_mb < 0 else cfg.prefix_cache_mb << 20,
        cuda_graphs=None if cfg.cuda_graphs else False)  # None: on when the device is CUDA
    if cfg.model == "random-tiny":
        return TorchEngine(build_tiny_model(), model_name="random-tiny", device=cfg.device, **kwargs)
    from services.models.source import resolve_model

    path = resolve_model(cfg.model, cfg.model_cache_dir)
    return TorchEngine.from_pretrained(str(path), dtype=cfg.dtype, device=cfg.device, **kwargs)


def build_engine(cfg: EngineConfig) -> Built:
    from services.rollout.client import EngineClient, GatewayClient
    from services.rollout.host import EngineHost
    from services.rollout.servicer import EngineServicer

    from services.common.server import advertised_host

    # a wildcard bind advertises the interface towards Redis (the deployment's shared network)
    advertised = advertised_host(cfg.host, cfg.advertise_host, towards=cfg.gateway_address or cfg.redis_url)
    host = EngineHost(_load_engine(cfg), cell_id=cfg.cell_id, kv_kinds=cfg.kv_transports, kv_host=advertised,
                      model=cfg.model, loader=lambda model: _load_engine(dataclasses.replace(cfg, model=model)),
                      kv_key=cfg.kv_key, kv_pool_bytes=cfg.kv_receive_pool_mb << 20)
    servicer = EngineServicer(host, connect=lambda a: EngineClient(a, max_message_mb=cfg.max_message_mb),
                              attach_wait_s=cfg.attach_wait_s)
    server = build_server("engine", [(rollout_pb2_grpc.add_EngineServicer_to_server, servicer)],
                          service_names=[ENGINE_SERVICE], host=cfg.host, port=cfg.port,
                          max_message_mb=cfg.max_message_mb, max_workers=cfg.max_workers)
    host.address = f"{advertised}:{server.port}"
    host.start()

    def register() -> None:  # once we serve, so the gateway's first probe succeeds
        wait_for_ready(host.address)
        GatewayClient(cfg.gateway_address).register_engine(cfg.cell_id, host.address)
        log.info("registered with gateway", gateway=cfg.gateway_address, cell_id=cfg.cell_id)

    if cfg.gateway_address:
        threading.Thread(target=register, name="register", daemon=True).start()

    def on_shutdown() -> None:
        if cfg.gateway_address:
            try:
                GatewayClient(cfg.gateway_address).deregister_engine(cfg.cell_id)
            except Exception as exc:  # deliberate: the gateway may already be gone
                log.warning("deregister failed", error=str(exc))
        left = host.drain(cfg.grace_s)
        log.info("engine stopping", cell_id=cfg.cell_id, unfinished=left)
        host.stop()

    return server, on_shutdown


def _tito_sink(cfg: GatewayConfig) -> Any:
    """``TrajectoryClient.ingest`` with per-execution delta encoding (resends are idempotent)."""
    from services.trajectory.client import TrajectoryClient

    client = TrajectoryClient(cfg.trajectory_address, max_message_mb=cfg.max_message_mb,
                              encoder_tokens=cfg.tito_encoder_tokens)

    def sink(batch: list[Any]) -> None:
        client.ingest(batch, delta_encode=True)

    sink.client = client  # type: ignore[attr-defined]  # the sweeper drops ended executions from it
    return sink


def _forget_ended(client: Any, redis_client: Any, interval_s: float, stop: threading.Event) -> None:
    """Every ``interval_s``: drop the delta-encoding state of executions the scheduler has ended,
    so the gateway's memory returns to its baseline when they do."""
    from services.scheduler.sessions import ended_executions

    while not stop.wait(interval_s):
        try:
            held, _ = client.encoding()
            for eid in ended_executions(redis_client, held) if held else []:
                client.forget(eid)
                FORGOTTEN.inc()
            ENCODER_TOKENS.set(client.encoding()[1])
        except Exception as exc:  # deliberate: Redis briefly away; the encoder stays bounded meanwhile
            log.warning("dropping ended executions' encoder state failed; retrying", error=str(exc))


def _follow_cordons(router: Any, redis_client: Any, interval_s: float, stop: threading.Event) -> None:
    """Every ``interval_s``: route no new call to the cells the scheduler's registry says an
    operator cordoned (so what they host only shrinks and the scheduler's drain of them is quick)."""
    from services.scheduler.sessions import cordoned_cells

    while not stop.wait(interval_s):
        try:
            cordoned = cordoned_cells(redis_client)
        except Exception as exc:  # deliberate: Redis briefly away; the last known set stays
            log.warning("reading cordoned cells failed; retrying", error=str(exc))
            continue
        if router.set_cordoned(cordoned):
            log.info("cordoned cells changed", cordoned=sorted(cordoned))


def _load_tokenizer(cfg: GatewayConfig) -> Any:
    from transformers import AutoTokenizer

    from services.models.source import resolve_model

    path = Path(cfg.tokenizer_path)  # a bare tokenizer directory, or a model name / checkpoint
    if not path.is_dir():
        path = resolve_model(cfg.tokenizer_path, cfg.model_cache_dir)
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _record_hook(forwarder: Any, sync_timeout_s: float) -> Any:
    if forwarder is None:
        return None
    if sync_timeout_s <= 0:
        return forwarder.submit
    return lambda call: forwarder.submit_and_wait(call, sync_timeout_s)


def build_gateway(cfg: GatewayConfig) -> Built:
    from services.rollout.call_cache import CallCache
    from services.rollout.client import EngineClient
    from services.rollout.gateway import Gateway
    from services.rollout.http_server import OpenAIServer
    from services.rollout.openai_http import OpenAIEndpoint
    from services.rollout.router import Router
    from services.rollout.servicer import GatewayServicer
    from services.rollout.tito import TitoForwarder

    from services.common.redis_store import connect

    redis_client = connect(cfg.redis_url, check=False)  # the scheduler's: sessions, ended executions
    forwarder = None
    sweeper_stop = threading.Event()
    if cfg.trajectory_address:
        sink = _tito_sink(cfg)
        forwarder = TitoForwarder(sink, max_queue_bytes=cfg.tito_queue_mb << 20).start()
        threading.Thread(target=_forget_ended, args=(sink.client, redis_client, cfg.tito_forget_interval_s,
                                                     sweeper_stop), name="forget-ended", daemon=True).start()
    gateway = Gateway(connect=lambda a: EngineClient(a, max_message_mb=cfg.max_message_mb),
                      router=Router(sticky_slack=cfg.sticky_slack), call_cache=CallCache(max_tokens=cfg.call_cache_tokens),
                      on_record=_record_hook(forwarder, cfg.tito_sync_timeout_s), attach_wait_s=cfg.attach_wait_s,
                      max_recoveries=cfg.max_recoveries, probe_interval_s=cfg.probe_interval_s).start()
    threading.Thread(target=_follow_cordons, args=(gateway.router, redis_client, cfg.probe_interval_s / 4,
                                                   sweeper_stop), name="follow-cordons", daemon=True).start()
    for spec in cfg.engine_addresses:
        cell_id, _, address = spec.rpartition("=")
        if not cell_id:  # ask the engine its cell id: it must be up now
            try:
                cell_id = gateway.conn(address).get_load(timeout_s=30.0).cell_id
            except GyreError as exc:
                gateway.stop()
                raise ValueError(
                    f"engine {address} did not answer ({exc}); start it first, or list it as CELL_ID={address} "
                    "so the gateway registers it now and routes to it once it is up") from None
        gateway.register_engine(cell_id, address)
    server = build_server("gateway", [(rollout_pb2_grpc.add_GatewayServicer_to_server, GatewayServicer(gateway))],
                          service_names=[GATEWAY_SERVICE], host=cfg.host, port=cfg.port,
                          max_message_mb=cfg.max_message_mb, max_workers=cfg.max_workers)
    http: Any = None  # AsyncOpenAIServer or OpenAIServer (http_server)
    if cfg.http_port >= 0:
        from services.scheduler.sessions import Sessions

        sessions = Sessions(redis_client)  # the scheduler's: it mints them
        endpoint = OpenAIEndpoint(gateway, tokenizer=_load_tokenizer(cfg), model_name=cfg.served_model_name,
                                  job_id=cfg.job_id, default_max_tokens=cfg.default_max_tokens,
                                  prompt_cache_tokens=cfg.prompt_cache_tokens, sessions=sessions,
                                  tool_parser=cfg.tool_parser)
        limits: dict[str, Any] = dict(
            host=cfg.http_host, port=cfg.http_port, max_body_bytes=cfg.http_max_body_mb << 20,
            auth_token=security.current().auth_token, tokens=security.current().tokens,
            idle_timeout_s=cfg.http_idle_timeout_s, max_connections=cfg.http_max_connections,
            tls_cert_file=cfg.tls_cert_file, tls_key_file=cfg.tls_key_file)
        if cfg.http_server == "async":
            from services.rollout.http_async import AsyncOpenAIServer

            http = AsyncOpenAIServer(endpoint, workers=cfg.http_workers, **limits).start()
        else:
            http = OpenAIServer(endpoint, **limits).start()
        public = cfg.http_advertise_url or (f"{http.scheme}://{advertised_host(cfg.http_host, towards=cfg.redis_url)}:"
                                            f"{http.port}/v1")
        threading.Thread(target=_publish_http_url, args=(sessions, public), name="publish-http", daemon=True).start()
        log.info("openai endpoint", base_url=public)
        server.info["http"] = public  # in the port file, so `gyre status` shows it

    def on_shutdown() -> None:
        sweeper_stop.set()
        if http is not None:
            http.stop(cfg.grace_s)  # in-flight HTTP calls finish too
        server.stop(cfg.grace_s)  # in-flight calls get the grace period
        if forwarder is not None:
            forwarder.stop(timeout_s=cfg.grace_s)
        gateway.stop()

    return server, on_shutdown


def _publish_http_url(sessions: Any, url: str) -> None:
    """Tell the scheduler (through Redis) the base URL that its session URLs extend; retried
    until Redis answers."""
    pause = 0.5
    while True:
        try:
            sessions.publish_http_url(url)
            return
        except Exception as exc:  # deliberate: Redis not up yet; sessions wait for it
            log.warning("publishing the HTTP base URL failed; retrying", error=str(exc))
            time.sleep(pause)
            pause = min(pause * 2, 10.0)


def engine_main(argv: Sequence[str] | None = None) -> int:
    return run_service("engine", EngineConfig, build_engine, argv)


def gateway_main(argv: Sequence[str] | None = None) -> int:
    return run_service("gateway", GatewayConfig, build_gateway, argv)
