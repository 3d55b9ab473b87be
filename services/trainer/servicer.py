"""gRPC adapter of the trainer core: ``Trainer`` service -> ``CoreTrainer`` / ``StepMembership``.

Proto in -> domain (``wire``) -> core -> proto out. Every RPC validates its request; domain
errors become status codes in the common server interceptor (InvalidArgument -> INVALID_ARGUMENT,
FailedPrecondition -> FAILED_PRECONDITION, NotFound, DeadlineExceeded ...).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from protos.gyre.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from services.common.errors import FailedPrecondition, InvalidArgument, NotFound
from services.common.logging import get_logger
from services.trainer import wire
from services.trainer.core import CoreTrainer, backend_for
from services.trainer.handoff import SharedHandoff, TensorRef
from services.trainer.metrics import HANDOFFS
from services.trainer.spawn import ReplicaProcesses

log = get_logger(__name__)


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, core: CoreTrainer, *, replicas: ReplicaProcesses | None = None,
                 default_trajectory_address: str = "", chunk_bytes: int = 4 << 20,
                 activation_checkpointing: bool = False, attention: str = "auto",
                 handoff: SharedHandoff | None = None) -> None:
        self.core = core
        self.handoff = handoff  # the shared-memory folder replicas on this host hand off through
        self.attention = attention  # likewise, for jobs whose attention is 'auto' or unset
        # the deployment's default for jobs that do not say (a job's own option wins)
        self.activation_checkpointing = activation_checkpointing
        self.replicas = replicas
        self.default_trajectory_address = default_trajectory_address
        self.chunk_bytes = chunk_bytes

    @property
    def replicas(self) -> ReplicaProcesses | None:
        return self._replicas

    @replicas.setter
    def replicas(self, replicas: ReplicaProcesses | None) -> None:
        """The replica processes this core starts; a replica whose process died is evicted from
        its step at once (not after member_timeout_s)."""
        self._replicas = replicas
        if replicas is not None:
            self.core.replica_alive = replicas.alive

    # -- jobs -------------------------------------------------------------------------------------
    def StartJob(self, request: trainer_pb2.StartJobRequest, context: Any) -> trainer_pb2.StartJobResponse:
        if not request.HasField("job") or not request.job.job_id:
            raise InvalidArgument("StartJob needs job.job_id")
        spec = trainer_pb2.TrainerJobSpec()
        spec.CopyFrom(request.job)
        if not spec.trajectory_address and (spec.source or "trajectory") == "trajectory":
            spec.trajectory_address = self.default_trajectory_address
        if self.activation_checkpointing and "activation_checkpointing" not in spec.options:
            spec.options["activation_checkpointing"] = "true"
        if spec.attention in ("", "auto"):
            spec.attention = self.attention
        job = wire.job_from_proto(spec)
        status = self.core.status()
        if status["job_id"] == job.job_id and status["phase"] not in ("done", "failed", "stopped", "idle"):
            return trainer_pb2.StartJobResponse(job_id=job.job_id, step=int(status["step"]),
                                                weight_version=int(status["weight_version"]), already_running=True)
        self.core.start(job)
        st = self.core.status()
        return trainer_pb2.StartJobResponse(job_id=job.job_id, step=int(st["step"]),
                                            weight_version=int(st["weight_version"]))

    def StopJob(self, request: trainer_pb2.StopJobRequest, context: Any) -> trainer_pb2.StopJobResponse:
        status = self.core.status()
        if request.job_id and request.job_id != status["job_id"]:
            raise NotFound(f"job {request.job_id!r} is not the trainer's job ({status['job_id']!r})")
        self.core.stop()
        return trainer_pb2.StopJobResponse(step=int(self.core.status()["step"]))

    def _pid_of(self, replica_id: str) -> int:
        return self.replicas.pid_of(replica_id) if self.replicas is not None else 0

    def GetStatus(self, request: trainer_pb2.GetStatusRequest, context: Any) -> trainer_pb2.TrainerStatus:
        st = self.core.status()
        return trainer_pb2.TrainerStatus(
            job_id=st["job_id"], phase=st["phase"], step=int(st["step"]), weight_version=int(st["weight_version"]),
            replicas=[wire.replica_info(m, self._pid_of(str(m["replica_id"]))) for m in st["members"]],
            error=st["error"],
            num_steps=int(st.get("num_steps", 0)), last_metrics={k: float(v) for k, v in st.get("last", {}).items()},
            store_address=f"{self.core.store_host}:{self.core.store_port}",
            group=[trainer_pb2.GroupRank(rank=g["rank"], pid=g["pid"], peak_rss_mib=g["peak_rss_mib"],
                                         alive=g["alive"]) for g in st.get("group", [])])

    def WaitStep(self, request: trainer_pb2.WaitStepRequest, context: Any) -> trainer_pb2.StepReport:
        if request.step < 0 or request.timeout_s < 0:
            raise InvalidArgument("WaitStep needs step >= 0 and timeout_s >= 0")
        return wire.step_report_to_proto(self.core.wait_step(request.step, request.timeout_s))

    # -- weights ----------------------------------------------------------------------------------
    def GetWeights(self, request: trainer_pb2.GetWeightsRequest, context: Any) -> Iterator[common_pb2.WeightChunk]:
        if request.version < -1 or request.wait_s < 0 or request.chunk_bytes < 0:
            raise InvalidArgument("GetWeights needs version >= -1, wait_s >= 0 and chunk_bytes >= 0")
        chunks = self.core.weights.chunks(request.version, chunk_bytes=request.chunk_bytes or self.chunk_bytes,
                                          timeout_s=request.wait_s)
        yield from wire.chunks_from_dicts(chunks)

    # -- replica protocol -------------------------------------------------------------------------
    def _membership(self) -> Any:
        if self.core.membership is None:
            raise FailedPrecondition("no job has been started on this trainer")
        return self.core.membership

    def JoinStep(self, request: trainer_pb2.JoinStepRequest, context: Any) -> trainer_pb2.JoinStepResponse:
        if not request.replica_id or not request.cell_id:
            raise InvalidArgument("JoinStep needs replica_id and cell_id")
        ticket = self._membership().join(request.replica_id, request.cell_id)
        job = self.core.job
        return trainer_pb2.JoinStepResponse(
            step=ticket.step, weight_version=ticket.weight_version, store_host=ticket.store_host,
            store_port=ticket.store_port, group_prefix=ticket.group_prefix, job=wire.job_to_proto(job),
            backend=backend_for(self.core.model().parameters().__next__().device),
            heartbeat_interval_s=ticket.heartbeat_interval_s,
            handoff_dir=str(self.handoff.dir) if self.handoff is not None else "",
            handoff_token=self.handoff.token if self.handoff is not None else "")

    def ReplicaAlive(self, request: trainer_pb2.ReplicaAliveRequest, context: Any) -> trainer_pb2.ReplicaAliveResponse:
        if not request.replica_id:
            raise InvalidArgument("ReplicaAlive needs replica_id")
        return trainer_pb2.ReplicaAliveResponse(member=self._membership().heard(request.replica_id))

    def AwaitReduce(self, request: trainer_pb2.AwaitReduceRequest, context: Any) -> trainer_pb2.AwaitReduceResponse:
        if not request.replica_id or request.step < 0:
            raise InvalidArgument("AwaitReduce needs replica_id and step >= 0")
        remaining = context.time_remaining() if context is not None else None
        seal = self._membership().done(request.replica_id, request.step, timeout_s=remaining, held_pg=request.held_pg)
        return trainer_pb2.AwaitReduceResponse(step=seal.step, rank=seal.rank, world_size=seal.world_size,
                                               group_prefix=seal.group_prefix, release=seal.release,
                                               pg_prefix=seal.pg_prefix)

    def LeaveStep(self, request: trainer_pb2.LeaveStepRequest, context: Any) -> trainer_pb2.LeaveStepResponse:
        if not request.replica_id:
            raise InvalidArgument("LeaveStep needs replica_id")
        return trainer_pb2.LeaveStepResponse(step=self._membership().leave(request.replica_id))

    def HandOffGradients(self, request_iterator: Iterator[trainer_pb2.GradientChunk],
                         context: Any) -> trainer_pb2.LeaveStepResponse:
        replica_id, step, grads = wire.gradients_from_stream(request_iterator)
        self.core.hand_off(replica_id, step, grads)
        HANDOFFS.labels(via="stream").inc()
        return trainer_pb2.LeaveStepResponse(step=step)

    def HandOffSharedGradients(self, request: trainer_pb2.SharedGradients,
                               context: Any) -> trainer_pb2.LeaveStepResponse:
        if self.handoff is None:
            raise FailedPrecondition("this trainer has no shared-memory hand-off folder; stream the gradients "
                                     "with HandOffGradients")
        if not request.replica_id or not request.file or request.step < 0:
            raise InvalidArgument("HandOffSharedGradients needs replica_id, step >= 0 and file")
        refs = [TensorRef(name=t.name, dtype=t.dtype, shape=tuple(t.shape), offset_bytes=t.offset_bytes)
                for t in request.tensors]
        grads = self.handoff.take(request.file, refs)  # unlinks the file, taken or not
        self.core.hand_off(request.replica_id, request.step, grads)
        HANDOFFS.labels(via="shared_memory").inc()
        return trainer_pb2.LeaveStepResponse(step=request.step)

    # -- orchestrator -----------------------------------------------------------------------------
    def AddReplica(self, request: trainer_pb2.AddReplicaRequest, context: Any) -> trainer_pb2.AddReplicaResponse:
        if not request.cell_id or request.wait_s < 0:
            raise InvalidArgument("AddReplica needs cell_id and wait_s >= 0")
        if self.replicas is None and not request.hosted:
            raise FailedPrecondition("this trainer does not start replica processes (cell daemons do)")
        self._membership()  # a job runs here
        phase = self.core.status().get("phase")
        if phase in ("done", "failed", "stopped"):
            raise FailedPrecondition(f"the trainer's job is {phase}; no replica joins it")
        if request.hosted:
            return self._await_hosted(request.cell_id, request.wait_s or 120.0)
        assert self.replicas is not None
        spawned = self.replicas.start(request.cell_id, request.switch_id)
        deadline = time.monotonic() + (request.wait_s or 120.0)
        while time.monotonic() < deadline:
            # read afresh: the replica joins the job that runs when it starts (which may be a newer one)
            for mem in self._membership().members():
                if mem["replica_id"] == spawned.replica_id and not mem["left"]:
                    return trainer_pb2.AddReplicaResponse(replica_id=spawned.replica_id, step=int(mem["step"]),
                                                          pid=spawned.proc.pid)
            if spawned.proc.poll() is not None:
                raise FailedPrecondition(f"replica process for cell {request.cell_id!r} exited with code "
                                         f"{spawned.proc.returncode} before joining (log in {spawned.log})")
            if self.replicas.alive(spawned.replica_id) is False:  # a pool process that ended it
                raise FailedPrecondition(f"replica {spawned.replica_id!r} for cell {request.cell_id!r} ended "
                                         f"before joining (log in {spawned.log})")
            time.sleep(0.05)
        raise FailedPrecondition(f"replica for cell {request.cell_id!r} did not join within {request.wait_s or 120.0}s")

    def _await_hosted(self, cell_id: str, wait_s: float) -> trainer_pb2.AddReplicaResponse:
        """A replica another process started for ``cell_id`` (its cell daemon, on the cell's host):
        wait until it has joined a step (a member of that cell that has not left)."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            for mem in self._membership().members():
                if mem["cell_id"] == cell_id and not (mem["left"] or mem["evicted"]):
                    return trainer_pb2.AddReplicaResponse(replica_id=str(mem["replica_id"]), step=int(mem["step"]))
            time.sleep(0.05)
        raise FailedPrecondition(f"no replica of cell {cell_id!r} joined within {wait_s:g}s (the cell's daemon "
                                 f"starts it with its train_command; see that daemon's log)")

    def ReleaseReplica(self, request: trainer_pb2.ReleaseReplicaRequest,
                       context: Any) -> trainer_pb2.ReleaseReplicaResponse:
        if not (request.cell_id or request.replica_id) or request.wait_s < 0:
            raise InvalidArgument("ReleaseReplica needs cell_id or replica_id, and wait_s >= 0")
        membership = self._membership()
        replica_id = request.replica_id
        if not replica_id:
            mems = [x for x in membership.members() if x["cell_id"] == request.cell_id and not x["left"]]
            replica_id = str(mems[-1]["replica_id"]) if mems else (
                self.replicas.replica_of(request.cell_id) if self.replicas else None) or ""
        if not replica_id:
            raise NotFound(f"no replica runs on cell {request.cell_id!r}")
        membership.release(replica_id)
        released = False
        # Only a process this core started can be awaited here; a cell daemon awaits its own.
        if request.wait_s > 0 and self.replicas is not None and request.cell_id \
                and self.replicas.replica_of(request.cell_id) == replica_id:
            # Now, not after the step: the step it sits in may be waiting for rollouts that need
            # this very cell (colocate: it joined the next step right after the last update). It
            # hands its gradient sum to the core, so the update is the same either way.
            self.replicas.terminate(request.cell_id)
            released = self.replicas.wait_exit(request.cell_id, request.wait_s)
        return trainer_pb2.ReleaseReplicaResponse(replica_id=replica_id, released=released)
