"""gRPC adapters of the rollout service: ``EngineServicer`` (a ROLLOUT cell) and ``GatewayServicer``.

Proto in -> domain (``wire``) -> ``EngineHost`` / ``Gateway`` -> proto out. Domain errors raised
below become status codes in the common server interceptor. When a caller goes away, the RPC's
termination callback cancels the engine-side request.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import numpy as np

from protos.gyre.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from services.common.errors import InvalidArgument
from services.rollout import wire
from services.rollout.calls import CallResult
from services.rollout.client import EngineClient
from services.rollout.engine import GenRequest
from services.rollout.gateway import Gateway, GatewayCall
from services.rollout.host import EngineHost, RequestChannel
from services.rollout.router import EngineEntry
from services.common.weights import WeightAssembler


def _gen_request(request: rollout_pb2.GenerateRequest) -> GenRequest:
    if request.HasField("prompt_delta"):
        raise InvalidArgument("engines take full prompt_ids; prompt_delta is resolved by the gateway")
    meta = wire.meta_from_proto(request.context)
    return GenRequest(request_id=request.request_id or uuid.uuid4().hex, prompt_ids=wire.ids(request.prompt_ids),
                      params=wire.sampling_from_proto(request.sampling), execution_id=meta.execution_id,
                      call_id=meta.call_id, agent_id=meta.agent_id, role=meta.role)


def _response(r: CallResult) -> rollout_pb2.GenerateResponse:
    return rollout_pb2.GenerateResponse(
        request_id=r.request_id, output_ids=r.output_ids.tolist(), output_logprobs=r.output_logprobs.tolist(),
        finish_reason=r.finish_reason, weight_version=r.weight_version, seed=r.seed, prompt_len=r.prompt_len,
        num_migrations=r.num_migrations, num_reprefills=r.num_reprefills, cell_id=r.cell_id,
        cached_prompt_tokens=r.cached_tokens)


class _RemoteTarget:
    """The migration target as ``EngineHost.migrate_out`` sees it: AcceptMigration over gRPC."""

    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self.address = client.address

    def accept(self, kind: str, request_ids: list[str]) -> tuple[str, str, str]:
        return self.client.accept_migration(kind, request_ids)


class EngineServicer(rollout_pb2_grpc.EngineServicer):
    """The ``Engine`` service of one ROLLOUT cell."""

    def __init__(self, host: EngineHost, *, connect: Callable[[str], EngineClient] = EngineClient,
                 attach_wait_s: float = 30.0) -> None:
        self.host = host
        self.connect = connect
        self.attach_wait_s = attach_wait_s
        self._clients: dict[str, EngineClient] = {}

    def _client(self, address: str) -> EngineClient:
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = self.connect(address)
        return client

    def _stream(self, channel: RequestChannel, context: grpc.ServicerContext) -> Iterator[rollout_pb2.GenerateChunk]:
        context.add_callback(lambda: self.host.release(channel))
        for piece in channel.pieces():
            yield wire.piece_to_proto(piece)

    def GenerateStream(self, request: rollout_pb2.GenerateRequest, context: grpc.ServicerContext) -> Any:
        yield from self._stream(self.host.submit(_gen_request(request)), context)

    def ResumeStream(self, request: rollout_pb2.ResumeRequest, context: grpc.ServicerContext) -> Any:
        req = _gen_request(request.request)
        gen, lps = wire.ids(request.generated_ids), wire.floats(request.generated_logprobs)
        if gen.shape != lps.shape:
            raise InvalidArgument(f"{len(gen)} generated_ids but {len(lps)} generated_logprobs")
        channel = self.host.resume(req, gen, lps, request.rng_state or None, request.weight_version)
        yield from self._stream(channel, context)

    def Attach(self, request: rollout_pb2.AttachRequest, context: grpc.ServicerContext) -> Any:
        if not request.request_id:
            raise InvalidArgument("request_id is required")
        channel = self.host.attach(request.request_id, request.wait_s or self.attach_wait_s)
        yield from self._stream(channel, context)

    def Generate(self, request: rollout_pb2.GenerateRequest, context: grpc.ServicerContext) -> Any:
        req = _gen_request(request)
        channel = self.host.submit(req)
        context.add_callback(lambda: self.host.release(channel))
        ids, lps, last, cached = [], [], None, 0
        pieces: Any = channel.pieces()
        while True:
            for piece in pieces:
                ids.append(piece.token_ids)
                lps.append(piece.logprobs)
                last, cached = piece, max(cached, piece.cached_tokens)
            assert last is not None
            if not last.migrated_to:
                break
            # Migrated while a unary caller waits: follow it to the target.
            pieces = self._client(last.migrated_to).attach(req.request_id, self.attach_wait_s)
        out = np.concatenate(ids).astype(np.int32) if ids else np.zeros(0, np.int32)
        return _response(CallResult(req.request_id, out, np.concatenate(lps).astype(np.float32),
                                    last.finish_reason, last.weight_version, last.seed, len(req.prompt_ids),
                                    cell_id=self.host.cell_id, cached_tokens=cached))

    def Cancel(self, request: rollout_pb2.CancelRequest, context: grpc.ServicerContext) -> Any:
        return rollout_pb2.CancelResponse(found=self.host.cancel(request.request_id))

    def MigrateOut(self, request: rollout_pb2.MigrateOutRequest, context: grpc.ServicerContext) -> Any:
        if not request.target_address:
            raise InvalidArgument("target_address is required")
        target = _RemoteTarget(self._client(request.target_address))
        reports = self.host.migrate_out(list(request.request_ids), target,
                                        wire.transport_from_proto(request.transport))
        return rollout_pb2.MigrateOutResponse(results=[wire.report_to_proto(r) for r in reports])

    def AcceptMigration(self, request: rollout_pb2.AcceptMigrationRequest, context: grpc.ServicerContext) -> Any:
        kind = wire.transport_from_proto(request.transport)
        if kind not in ("ucx", "tcp"):
            raise InvalidArgument(f"AcceptMigration takes transport UCX or TCP, got {kind!r}")
        got, address = self.host.accept(kind)
        return rollout_pb2.AcceptMigrationResponse(transport=wire.STR_TO_TRANSPORT[got],
                                                   receiver_address=address, cell_id=self.host.cell_id)

    def UpdateWeights(self, request_iterator: Iterator[common_pb2.WeightChunk], context: grpc.ServicerContext) -> Any:
        asm = WeightAssembler()
        restart = False
        for c in request_iterator:
            asm.add(version=c.version, name=c.name, dtype=c.dtype, shape=tuple(c.shape), data=c.data,
                    offset_bytes=c.offset_bytes, total_bytes=c.total_bytes, last=c.last)
            restart = restart or c.restart
        if asm.version is None:
            raise InvalidArgument("UpdateWeights got no chunks")
        state_dict = asm.state_dict()
        self.host.engine.update_weights(state_dict, asm.version, restart=restart)
        return rollout_pb2.UpdateWeightsResponse(weight_version=asm.version, num_tensors=len(state_dict),
                                                 num_bytes=asm.num_bytes)

    def LoadModel(self, request: rollout_pb2.LoadModelRequest, context: grpc.ServicerContext) -> Any:
        if not request.model or len(request.model) > 4096:
            raise InvalidArgument("model is required: a model name or a checkpoint directory")
        try:
            changed = self.host.load_model(request.model)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        e = self.host.engine
        return rollout_pb2.LoadModelResponse(model=self.host.model, model_name=e.model_name, vocab_size=e.vocab_size,
                                             max_context=e.max_context, changed=changed,
                                             weight_version=e.weight_version)

    def GetLoad(self, request: rollout_pb2.GetLoadRequest, context: grpc.ServicerContext) -> Any:
        load = self.host.load()
        engine = self.host.engine
        return rollout_pb2.EngineLoad(
            cell_id=self.host.cell_id, active=int(load["active"]), kv_tokens=int(load["kv_tokens"]),
            capacity_tokens=int(load["capacity_tokens"]), weight_version=engine.weight_version,
            model_name=engine.model_name, vocab_size=engine.vocab_size, max_context=engine.max_context,
            draining=self.host.draining, request_ids=load["request_ids"], model=self.host.model)

    def Drain(self, request: rollout_pb2.DrainRequest, context: grpc.ServicerContext) -> Any:
        if request.wait_s < 0:
            raise InvalidArgument(f"wait_s must be >= 0, got {request.wait_s}")
        return rollout_pb2.DrainResponse(active=self.host.drain(request.wait_s, cancel=request.cancel))


def engine_info(e: EngineEntry) -> rollout_pb2.EngineInfo:
    return rollout_pb2.EngineInfo(
        cell_id=e.cell_id, address=e.address, state=e.state, in_flight=e.in_flight,
        load=rollout_pb2.EngineLoad(cell_id=e.cell_id, active=max(e.active, 0), kv_tokens=e.kv_tokens,
                                    capacity_tokens=e.capacity_tokens, weight_version=e.weight_version,
                                    model_name=e.model_name, vocab_size=e.vocab_size,
                                    max_context=e.max_context, draining=e.state == "draining"))


class GatewayServicer(rollout_pb2_grpc.GatewayServicer):
    """The ``Gateway`` service: the one address harnesses and the scheduler use."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def _call(self, request: rollout_pb2.GenerateRequest, context: grpc.ServicerContext) -> GatewayCall:
        meta = wire.meta_from_proto(request.context)
        params = wire.sampling_from_proto(request.sampling)
        delta = request.prompt_delta if request.HasField("prompt_delta") else None
        call = self.gateway.new_call(
            meta, params, prompt_ids=wire.ids(request.prompt_ids),
            base_call_id=delta.base_call_id if delta else "",
            shared_prefix_len=delta.shared_prefix_len if delta else 0,
            new_ids=wire.ids(delta.new_ids) if delta else None)
        context.add_callback(call.cancel)
        return call

    def Generate(self, request: rollout_pb2.GenerateRequest, context: grpc.ServicerContext) -> Any:
        return _response(self.gateway.generate(self._call(request, context)))

    def GenerateStream(self, request: rollout_pb2.GenerateRequest, context: grpc.ServicerContext) -> Any:
        for piece in self.gateway.run(self._call(request, context)):
            yield wire.piece_to_proto(piece)

    def RegisterEngine(self, request: rollout_pb2.RegisterEngineRequest, context: grpc.ServicerContext) -> Any:
        return rollout_pb2.RegisterEngineResponse(
            engine=engine_info(self.gateway.register_engine(request.cell_id, request.address)))

    def DeregisterEngine(self, request: rollout_pb2.DeregisterEngineRequest, context: grpc.ServicerContext) -> Any:
        return rollout_pb2.DeregisterEngineResponse(in_flight=self.gateway.deregister_engine(request.cell_id))

    def DrainEngine(self, request: rollout_pb2.DrainEngineRequest, context: grpc.ServicerContext) -> Any:
        if not request.cell_id:
            raise InvalidArgument("cell_id is required")
        reports = self.gateway.drain_engine(request.cell_id, wire.transport_from_proto(request.transport),
                                            keep_registered=request.keep_registered)
        return rollout_pb2.DrainEngineResponse(results=[wire.report_to_proto(r) for r in reports])

    def ListEngines(self, request: rollout_pb2.ListEnginesRequest, context: grpc.ServicerContext) -> Any:
        return rollout_pb2.ListEnginesResponse(engines=[engine_info(e) for e in self.gateway.list_engines()])

    def JobUsage(self, request: rollout_pb2.JobUsageRequest, context: grpc.ServicerContext) -> Any:
        if len(request.job_ids) > 1000:
            raise InvalidArgument(f"JobUsage takes at most 1000 job ids, got {len(request.job_ids)}")
        if any(not j for j in request.job_ids):
            raise InvalidArgument("JobUsage: a job id is empty")
        return rollout_pb2.JobUsageResponse(jobs=[rollout_pb2.JobUsage(**dataclasses.asdict(u))
                                                  for u in self.gateway.usage.snapshot(request.job_ids)])
