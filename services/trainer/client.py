"""Typed client of the ``Trainer`` service (replicas, the scheduler's orchestrator, tools).

Speaks domain types (``TrainerJob``, ``JoinTicket``, ``Seal``, state dicts of tensors) and raises
domain errors (``services.common.errors``) carrying the server's status message.

    core = TrainerClient("127.0.0.1:50061")
    core.start_job(TrainerJob(job_id="j1", model="tiny", source="synthetic:seed=1", num_steps=3))
    report = core.wait_step(2, timeout_s=60)
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import grpc

from protos.gyre.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from services.common.client import GrpcClient
from services.common.weights import chunk_state_dict
from services.trainer import wire
from services.trainer.job import TrainerJob

if TYPE_CHECKING:
    import torch

    from services.trainer.elastic import JoinTicket, Seal


class Interrupted(Exception):
    """A replica's call given up because its cell is wanted back (``stop`` set)."""


class TrainerClient(GrpcClient):
    """Client of one core trainer; thread-safe (one channel). Imports torch only for the calls
    that carry tensors or replica tickets, so the scheduler and tools stay light."""

    def __init__(self, address: str, *, max_message_mb: int = 256, timeout_s: float = 60.0) -> None:
        super().__init__(address, timeout_s=timeout_s, max_message_mb=max_message_mb)
        self._stub = trainer_pb2_grpc.TrainerStub(self._channel)

    # -- jobs -------------------------------------------------------------------------------------
    def start_job(self, job: TrainerJob | trainer_pb2.TrainerJobSpec) -> trainer_pb2.StartJobResponse:
        spec = job if isinstance(job, trainer_pb2.TrainerJobSpec) else wire.job_to_proto(job)
        return self._call(self._stub.StartJob, trainer_pb2.StartJobRequest(job=spec), 600.0)

    def stop_job(self, job_id: str) -> int:
        return int(self._call(self._stub.StopJob, trainer_pb2.StopJobRequest(job_id=job_id), 600.0).step)

    def status(self) -> trainer_pb2.TrainerStatus:
        return self._call(self._stub.GetStatus, trainer_pb2.GetStatusRequest())

    def wait_step(self, step: int, *, timeout_s: float = 60.0) -> trainer_pb2.StepReport:
        return self._call(self._stub.WaitStep, trainer_pb2.WaitStepRequest(step=step, timeout_s=timeout_s),
                          timeout_s + 30.0)

    # -- weights ----------------------------------------------------------------------------------
    def get_weights(self, version: int = -1, *, wait_s: float = 0.0, chunk_bytes: int = 0,
                    stop: threading.Event | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        """(version, state_dict) of a published weight version. ``stop`` set while the weights stream
        in: the stream is cancelled and ``Interrupted`` raised (a replica whose cell is wanted back
        leaves now instead of loading weights it will not use)."""
        from services.trainer.weights import assemble

        req = trainer_pb2.GetWeightsRequest(version=version, wait_s=wait_s, chunk_bytes=chunk_bytes)
        call = self._stub.GetWeights(req, timeout=wait_s + 600.0)

        def chunks() -> Iterator[dict[str, Any]]:
            try:
                for c in call:
                    if stop is not None and stop.is_set():
                        call.cancel()
                        raise Interrupted(f"weights {version} not loaded: interrupted")
                    yield wire.chunk_to_dict(c)
            except grpc.RpcError as exc:
                raise self._error(exc) from None

        return assemble(chunks())

    def weight_chunks(self, version: int = -1, *, chunk_bytes: int = 0) -> Iterator[common_pb2.WeightChunk]:
        """The raw WeightChunk stream of a published version (relayed as is, e.g. to an engine)."""
        req = trainer_pb2.GetWeightsRequest(version=version, chunk_bytes=chunk_bytes)
        return self._stream(self._stub.GetWeights, req, 600.0)

    # -- replica protocol -------------------------------------------------------------------------
    def join_step(self, replica_id: str, cell_id: str) -> tuple[JoinTicket, TrainerJob, str]:
        from services.trainer.elastic import JoinTicket

        r = self._call(self._stub.JoinStep, trainer_pb2.JoinStepRequest(replica_id=replica_id, cell_id=cell_id))
        ticket = JoinTicket(step=r.step, weight_version=r.weight_version, store_host=r.store_host,
                            store_port=r.store_port, group_prefix=r.group_prefix,
                            heartbeat_interval_s=r.heartbeat_interval_s, handoff_dir=r.handoff_dir,
                            handoff_token=r.handoff_token)
        return ticket, wire.job_from_proto(r.job), r.backend

    def replica_alive(self, replica_id: str, *, timeout_s: float = 10.0) -> bool:
        """A member's heartbeat; False when the core no longer counts it in a step."""
        r = self._call(self._stub.ReplicaAlive, trainer_pb2.ReplicaAliveRequest(replica_id=replica_id), timeout_s)
        return bool(r.member)

    def await_reduce(self, replica_id: str, step: int, *, held_pg: str = "", timeout_s: float = 3600.0) -> Seal:
        from services.trainer.elastic import Seal

        r = self._call(self._stub.AwaitReduce,
                       trainer_pb2.AwaitReduceRequest(replica_id=replica_id, step=step, held_pg=held_pg), timeout_s)
        return Seal(step=r.step, rank=r.rank, world_size=r.world_size, group_prefix=r.group_prefix,
                    release=r.release, pg_prefix=r.pg_prefix)

    def leave_step(self, replica_id: str) -> int:
        return int(self._call(self._stub.LeaveStep, trainer_pb2.LeaveStepRequest(replica_id=replica_id)).step)

    def hand_off_gradients(self, replica_id: str, step: int, grads: dict[str, torch.Tensor], *,
                           chunk_bytes: int = 4 << 20) -> int:
        """Stream this replica's gradient sum to the core and leave ``step``."""

        def chunks() -> Iterator[trainer_pb2.GradientChunk]:
            for c in wire.chunks_from_dicts(chunk_state_dict(grads, step, chunk_bytes=chunk_bytes)):
                yield trainer_pb2.GradientChunk(replica_id=replica_id, step=step, chunk=c)

        return int(self._call(self._stub.HandOffGradients, chunks(), 600.0).step)

    def hand_off_shared(self, replica_id: str, step: int, grads: dict[str, torch.Tensor], *, folder: str,
                        token: str) -> int | None:
        """Hand this replica's gradient sum over through the core's shared-memory folder (written
        once, mapped by the core) and leave ``step``; None when this process does not share that
        folder (the caller streams with ``hand_off_gradients``)."""
        from services.trainer import handoff

        written = handoff.write(folder, token, replica_id, grads)
        if written is None:
            return None
        file, refs = written
        req = trainer_pb2.SharedGradients(
            replica_id=replica_id, step=step, file=file,
            tensors=[trainer_pb2.SharedTensor(name=r.name, dtype=r.dtype, shape=list(r.shape),
                                              offset_bytes=r.offset_bytes) for r in refs])
        try:
            return int(self._call(self._stub.HandOffSharedGradients, req, 600.0).step)
        finally:
            handoff.discard(folder, file)  # the core unlinks it when it gets the call; not when the call fails

    # -- orchestrator -----------------------------------------------------------------------------
    def add_replica(self, cell_id: str, *, switch_id: str = "", wait_s: float = 120.0,
                    hosted: bool = False) -> trainer_pb2.AddReplicaResponse:
        req = trainer_pb2.AddReplicaRequest(cell_id=cell_id, switch_id=switch_id, wait_s=wait_s, hosted=hosted)
        return self._call(self._stub.AddReplica, req, wait_s + 30.0)

    def release_replica(self, *, cell_id: str = "", replica_id: str = "",
                        wait_s: float = 0.0) -> trainer_pb2.ReleaseReplicaResponse:
        req = trainer_pb2.ReleaseReplicaRequest(cell_id=cell_id, replica_id=replica_id, wait_s=wait_s)
        return self._call(self._stub.ReleaseReplica, req, wait_s + 30.0)
