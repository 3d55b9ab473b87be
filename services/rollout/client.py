"""Typed clients of the rollout service: ``EngineClient`` (one ROLLOUT cell) and ``GatewayClient``.

Both speak domain types (numpy token arrays, ``SamplingParams``, ``CallMeta``, ``Piece``) and
raise domain errors (``services.common.errors``) carrying the server's status message. An engine
whose connection breaks raises ``EngineLost``, which the gateway answers with a re-prefill.

    gw = GatewayClient("127.0.0.1:50051")
    res = gw.generate(CallMeta(execution_id="e1", call_id="c1"), prompt_ids,
                      SamplingParams(temperature=0.0, max_new_tokens=32))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import grpc
import numpy as np

from protos.gyre.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from services.common import errors
from services.common.client import GrpcClient
from services.common.weights import chunk_state_dict
from services.rollout import wire
from services.rollout.calls import CallMeta, CallResult, EngineLost, MigrationReport, Piece, concat
from services.rollout.engine import SamplingParams
from services.rollout.usage import Usage


class PieceStream:
    """Iterator of ``Piece``s over one server stream; ``cancel()`` from any thread ends it."""

    def __init__(self, call: Any, lost: type[errors.GyreError]) -> None:
        self._call = call
        self._lost = lost
        self.cancelled = False

    def __iter__(self) -> Iterator[Piece]:
        try:
            for chunk in self._call:
                yield wire.piece_from_proto(chunk)
        except grpc.RpcError as exc:
            if self.cancelled:
                return
            # A stream cut by the server going away reads CANCELLED on the client; we did not cancel.
            if exc.code() == grpc.StatusCode.CANCELLED:
                raise self._lost(f"stream cancelled by the server: {exc.details()}") from None
            raise errors.from_rpc_error(exc, unavailable=self._lost) from None
        finally:
            if not self.cancelled:
                self._call.cancel()  # no-op when it completed

    def cancel(self) -> None:
        self.cancelled = True
        self._call.cancel()


class EngineClient(GrpcClient):
    """Client of one engine's ``Engine`` service; thread-safe, one channel. A broken connection
    (UNAVAILABLE) raises ``EngineLost``."""

    unavailable = EngineLost

    def __init__(self, address: str, *, max_message_mb: int = 256, timeout_s: float = 30.0) -> None:
        super().__init__(address, timeout_s=timeout_s, max_message_mb=max_message_mb)
        self._stub = rollout_pb2_grpc.EngineStub(self._channel)

    def generate_stream(self, request_id: str, meta: CallMeta, prompt_ids: np.ndarray,
                        params: SamplingParams) -> PieceStream:
        req = wire.generate_request(request_id, meta, prompt_ids, params)
        return PieceStream(self._stub.GenerateStream(req), EngineLost)

    def resume_stream(self, request_id: str, meta: CallMeta, prompt_ids: np.ndarray, params: SamplingParams,
                      generated_ids: np.ndarray, generated_logprobs: np.ndarray,
                      weight_version: int) -> PieceStream:
        req = rollout_pb2.ResumeRequest(
            request=wire.generate_request(request_id, meta, prompt_ids, params),
            generated_ids=generated_ids.tolist(), generated_logprobs=generated_logprobs.tolist(),
            weight_version=weight_version)
        return PieceStream(self._stub.ResumeStream(req), EngineLost)

    def attach(self, request_id: str, wait_s: float) -> PieceStream:
        req = rollout_pb2.AttachRequest(request_id=request_id, wait_s=wait_s)
        return PieceStream(self._stub.Attach(req), EngineLost)

    def generate(self, request_id: str, meta: CallMeta, prompt_ids: np.ndarray,
                 params: SamplingParams, timeout_s: float | None = None) -> CallResult:
        req = wire.generate_request(request_id, meta, prompt_ids, params)
        return result_from_proto(self._call(self._stub.Generate, req, timeout_s or 3600.0))

    def cancel(self, request_id: str) -> bool:
        return bool(self._call(self._stub.Cancel, rollout_pb2.CancelRequest(request_id=request_id)).found)

    def migrate_out(self, request_ids: list[str], target_address: str, transport: str = "auto",
                    timeout_s: float = 600.0) -> list[MigrationReport]:
        req = rollout_pb2.MigrateOutRequest(request_ids=request_ids, target_address=target_address,
                                            transport=wire.STR_TO_TRANSPORT[transport])
        resp = self._call(self._stub.MigrateOut, req, timeout_s)
        return [wire.report_from_proto(r) for r in resp.results]

    def accept_migration(self, kind: str, request_ids: list[str]) -> tuple[str, str, str]:
        req = rollout_pb2.AcceptMigrationRequest(transport=wire.STR_TO_TRANSPORT[kind], request_ids=request_ids)
        resp = self._call(self._stub.AcceptMigration, req)
        return wire.transport_from_proto(resp.transport), resp.receiver_address, resp.cell_id

    def update_weights_from(self, chunks: Iterable[common_pb2.WeightChunk]) -> rollout_pb2.UpdateWeightsResponse:
        """UpdateWeights from an existing WeightChunk stream (e.g. the trainer's GetWeights)."""
        return self._call(self._stub.UpdateWeights, iter(chunks), 600.0)

    def get_load(self, timeout_s: float | None = None) -> rollout_pb2.EngineLoad:
        return self._call(self._stub.GetLoad, rollout_pb2.GetLoadRequest(), timeout_s)

    def load_model(self, model: str, *, timeout_s: float = 600.0) -> rollout_pb2.LoadModelResponse:
        """Have the engine serve ``model`` (it must host no request); ``changed`` False if it already did."""
        return self._call(self._stub.LoadModel, rollout_pb2.LoadModelRequest(model=model), timeout_s)

    def drain(self, wait_s: float = 0.0, *, cancel: bool = False) -> int:
        req = rollout_pb2.DrainRequest(wait_s=wait_s, cancel=cancel)
        resp = self._call(self._stub.Drain, req, wait_s + self.timeout_s)
        return int(resp.active)

    def update_weights(self, state_dict: Mapping[str, Any], version: int, *, chunk_bytes: int = 4 << 20,
                       restart: bool = False) -> rollout_pb2.UpdateWeightsResponse:
        """Stream a torch state_dict as weight ``version`` (the trainer side of UpdateWeights);
        ``restart``: a new job's first weights (installed whatever version the engine holds)."""
        chunks = (common_pb2.WeightChunk(**c) for c in chunk_state_dict(state_dict, version,
                                                                        chunk_bytes=chunk_bytes, restart=restart))
        return self._call(self._stub.UpdateWeights, chunks, 600.0)


def result_from_proto(r: rollout_pb2.GenerateResponse) -> CallResult:
    return CallResult(request_id=r.request_id, output_ids=wire.ids(r.output_ids),
                      output_logprobs=wire.floats(r.output_logprobs), finish_reason=r.finish_reason,
                      weight_version=r.weight_version, seed=r.seed, prompt_len=r.prompt_len,
                      num_migrations=r.num_migrations, num_reprefills=r.num_reprefills, cell_id=r.cell_id,
                      cached_tokens=r.cached_prompt_tokens)


def collect(pieces: Iterable[Piece]) -> tuple[np.ndarray, np.ndarray, Piece]:
    """Concatenate a finished stream: (ids, logprobs, final piece)."""
    ids, lps, last = [], [], None
    for p in pieces:
        ids.append(p.token_ids)
        lps.append(p.logprobs)
        last = p
    if last is None or not last.finished:
        raise errors.Unavailable("stream ended before the request finished")
    return concat(ids, np.int32), concat(lps, np.float32), last


class GatewayClient(GrpcClient):
    """Client of the rollout ``Gateway`` (what harnesses and the scheduler use); thread-safe."""

    def __init__(self, address: str, *, max_message_mb: int = 256, timeout_s: float = 3600.0) -> None:
        super().__init__(address, timeout_s=timeout_s, max_message_mb=max_message_mb)
        self._stub = rollout_pb2_grpc.GatewayStub(self._channel)

    @staticmethod
    def _request(meta: CallMeta, params: SamplingParams, prompt_ids: np.ndarray | None,
                 base_call_id: str, shared_prefix_len: int, new_ids: np.ndarray | None) -> rollout_pb2.GenerateRequest:
        req = rollout_pb2.GenerateRequest(context=wire.meta_to_proto(meta),
                                          sampling=wire.sampling_to_proto(params))
        if prompt_ids is not None:
            req.prompt_ids.extend(np.asarray(prompt_ids, dtype=np.int32).tolist())
        else:
            req.prompt_delta.base_call_id = base_call_id
            req.prompt_delta.shared_prefix_len = shared_prefix_len
            req.prompt_delta.new_ids.extend(np.asarray(new_ids, dtype=np.int32).tolist())
        return req

    def generate(self, meta: CallMeta, prompt_ids: np.ndarray | None, params: SamplingParams, *,
                 base_call_id: str = "", shared_prefix_len: int = 0,
                 new_ids: np.ndarray | None = None) -> CallResult:
        """One call; pass ``prompt_ids``, or a delta (``base_call_id``, ``shared_prefix_len``, ``new_ids``)."""
        req = self._request(meta, params, prompt_ids, base_call_id, shared_prefix_len, new_ids)
        return result_from_proto(self._call(self._stub.Generate, req))

    def generate_stream(self, meta: CallMeta, prompt_ids: np.ndarray | None, params: SamplingParams, *,
                        base_call_id: str = "", shared_prefix_len: int = 0,
                        new_ids: np.ndarray | None = None) -> PieceStream:
        req = self._request(meta, params, prompt_ids, base_call_id, shared_prefix_len, new_ids)
        return PieceStream(self._stub.GenerateStream(req, timeout=self.timeout_s), errors.Unavailable)

    def register_engine(self, cell_id: str, address: str) -> rollout_pb2.EngineInfo:
        req = rollout_pb2.RegisterEngineRequest(cell_id=cell_id, address=address)
        return self._call(self._stub.RegisterEngine, req, 30.0).engine

    def deregister_engine(self, cell_id: str) -> int:
        req = rollout_pb2.DeregisterEngineRequest(cell_id=cell_id)
        return int(self._call(self._stub.DeregisterEngine, req, 30.0).in_flight)

    def drain_engine(self, cell_id: str, transport: str = "auto", *,
                     keep_registered: bool = False) -> list[MigrationReport]:
        req = rollout_pb2.DrainEngineRequest(cell_id=cell_id, transport=wire.STR_TO_TRANSPORT[transport],
                                             keep_registered=keep_registered)
        return [wire.report_from_proto(r) for r in self._call(self._stub.DrainEngine, req, 600.0).results]

    def list_engines(self) -> list[rollout_pb2.EngineInfo]:
        return list(self._call(self._stub.ListEngines, rollout_pb2.ListEnginesRequest(), 30.0).engines)

    def job_usage(self, job_ids: Sequence[str] = (), timeout_s: float = 10.0) -> dict[str, Usage]:
        """What the gateway served per job (services/rollout/usage.py): job id -> Usage, for the
        jobs of ``job_ids`` that made a call through it (every job it holds when empty)."""
        resp = self._call(self._stub.JobUsage, rollout_pb2.JobUsageRequest(job_ids=list(job_ids)), timeout_s)
        return {u.job_id: Usage(**{f.name: getattr(u, f.name) for f in dataclasses.fields(Usage)}) for u in resp.jobs}
