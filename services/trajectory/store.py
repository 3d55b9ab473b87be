"""Durable state of the trajectory service: token arrays in the blob spool, the index in Redis.

Nothing large goes into Redis. Layout (``Keys("traj")``, ids hashed into blob paths)::

    gyre:traj:jobs                          set   job ids
    gyre:traj:job:{job}:executions          set   execution ids with records or an outcome
    gyre:traj:job:{job}:steps               set   step numbers
    gyre:traj:calls:{job}:{execution}       list  one JSON entry per accepted record, record order
    gyre:traj:outcome:{job}:{execution}     str   JSON outcome
    gyre:traj:stats:{job}:{execution}       str   JSON tree stats, written when the execution is packed
    gyre:traj:step:{job}:{step}             str   JSON step spec (declared size, budget, sealed)
    gyre:traj:step:{job}:{step}:released    set   group ids whose executions were packed
    gyre:traj:step:{job}:{step}:batches     list  JSON batch metadata (blob key, chunks)
    gyre:traj:step:{job}:{step}:acked       set   acknowledged batch ids

    spool: traj/{h(job)}/{h(execution)}/{index}.npy   int32 [n_new, n_out, new_ids, output_ids, logprob bits]
           traj/{h(job)}/steps/{step}/{batch_id}.npz  PackedBatch

Write order makes crashes harmless: the blob is written (atomically) before the Redis entry that
references it, so Redis never points at a missing blob; a blob without an entry is overwritten
by the retried record.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np
import redis

from services.common.blobs import BlobStore
from services.common.redis_store import Keys
from services.trajectory.records import Outcome, PromptDelta, Status, TitoCall
from services.common.roles import AgentRole


def _str(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def _h(value: str) -> str:
    """Filesystem-safe, fixed-length name for an arbitrary id."""
    return hashlib.blake2b(value.encode(), digest_size=10).hexdigest()


@dataclass(frozen=True)
class StepSpec:
    """What a step was opened with (0 / None = not declared)."""

    num_executions: int = 0
    group_size: int = 0
    token_budget: int = 0
    max_paths: int = 0
    tree_split: str = ""  # "pieces" or "context" ("": the service's, fixed at the step's first release)
    kv_budget_tokens: int = -1  # pieces: the largest tree trained whole (0: no limit; -1: the service's, fixed so)
    sealed: bool = False
    normalize_advantages: bool = False  # the job's [job.algorithm] (services/algorithm.py)
    advantage_eps: float = 0.0  # 0: the default


@dataclass(frozen=True)
class BatchMeta:
    batch_id: str
    blob_key: str
    num_tokens: int
    num_targets: int
    context_tokens: int
    execution_ids: tuple[str, ...]
    chunks: tuple[tuple[str, int], ...]  # (execution id, chunk index) packed into this batch

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> BatchMeta:
        d = json.loads(raw)
        return cls(d["batch_id"], d["blob_key"], d["num_tokens"], d["num_targets"], d["context_tokens"],
                   tuple(d["execution_ids"]), tuple((e, int(i)) for e, i in d["chunks"]))


class TrajectoryStore:
    """Redis index + blob spool. Thread-safe (redis-py clients are)."""

    def __init__(self, client: redis.Redis, blobs: BlobStore, *, namespace: str = "traj") -> None:
        self.r = client
        self.blobs = blobs
        self.keys = Keys(namespace)

    # ----------------------------------------------------------------- records
    def append_call(self, job_id: str, call: TitoCall, index: int, delta: PromptDelta) -> None:
        """Persist record ``index`` of its execution (delta form)."""
        eid = call.execution_id
        blob = f"traj/{_h(job_id)}/{_h(eid)}/{index:07d}.npy"
        parts = [
            np.asarray([len(delta.new_ids), len(call.output_ids)], dtype=np.int32),
            delta.new_ids.astype(np.int32, copy=False),
            call.output_ids.astype(np.int32, copy=False),
            call.output_logprobs.astype(np.float32, copy=False).view(np.int32),
        ]
        if call.output_forced is not None and call.output_policy_logprobs is not None:  # a constrained call
            parts += [call.output_policy_logprobs.astype(np.float32, copy=False).view(np.int32),
                      call.output_forced.astype(np.int32)]
        payload = np.concatenate(parts)
        self.blobs.put_array(blob, payload)
        entry = json.dumps({
            "i": index, "call_id": call.call_id, "agent_id": call.agent_id, "role": int(call.role),
            "base": delta.base_call_id, "shared": delta.shared_prefix_len, "version": call.weight_version,
            "t": call.finished_at_s, "finish": call.finish_reason, "blob": blob,
            **({"c": 1} if call.constrained else {}),
        }, separators=(",", ":"))
        key = self.keys.key("calls", job_id, eid)
        with self.r.pipeline(transaction=True) as p:
            p.sadd(self.keys.key("jobs"), job_id)
            p.sadd(self.keys.key("job", job_id, "executions"), eid)
            p.rpush(key, entry)
            p.execute()

    def attempt(self, job_id: str, execution_id: str) -> int:
        """The lease attempt the execution's stored records belong to (0: none given yet)."""
        raw = self.r.get(self.keys.key("attempt", job_id, execution_id))
        return int(raw) if raw is not None else 0

    def start_attempt(self, job_id: str, execution_id: str, attempt: int, *, drop: bool = True) -> int:
        """Record ``attempt``, dropping the execution's stored records first (an earlier
        attempt's; ``drop=False``: there are none). Returns the blobs deleted."""
        key = self.keys.key("calls", job_id, execution_id)
        deleted = 0
        for raw in self.r.lrange(key, 0, -1) if drop else ():
            self.blobs.delete(json.loads(raw)["blob"])
            deleted += 1
        pipe = self.r.pipeline(transaction=True)
        pipe.delete(key)
        pipe.set(self.keys.key("attempt", job_id, execution_id), attempt)
        pipe.execute()
        return deleted

    def num_calls(self, job_id: str, execution_id: str) -> int:
        return int(self.r.llen(self.keys.key("calls", job_id, execution_id)))

    def call_ids(self, job_id: str, execution_id: str) -> set[str]:
        return {json.loads(raw)["call_id"] for raw in self.r.lrange(self.keys.key("calls", job_id, execution_id), 0, -1)}

    def load_calls(self, job_id: str, execution_id: str) -> list[TitoCall]:
        """Every stored record of an execution, in record order, in delta form."""
        out = []
        for raw in self.r.lrange(self.keys.key("calls", job_id, execution_id), 0, -1):
            e = json.loads(raw)
            arr = self.blobs.get_array(e["blob"])
            n_new, n_out = int(arr[0]), int(arr[1])
            new = arr[2 : 2 + n_new]
            out_ids = arr[2 + n_new : 2 + n_new + n_out]
            lps = arr[2 + n_new + n_out : 2 + n_new + 2 * n_out].view(np.float32)
            policy = forced = None
            if e.get("c"):
                policy = arr[2 + n_new + 2 * n_out : 2 + n_new + 3 * n_out].view(np.float32)
                forced = arr[2 + n_new + 3 * n_out : 2 + n_new + 4 * n_out].astype(bool)
            out.append(TitoCall(
                execution_id=execution_id, call_id=e["call_id"], agent_id=e["agent_id"], role=AgentRole(e["role"]),
                output_ids=out_ids, output_logprobs=lps, weight_version=int(e["version"]),
                delta=PromptDelta(e["base"], int(e["shared"]), new), job_id=job_id,
                finished_at_s=float(e["t"]), finish_reason=e["finish"],
                output_forced=forced, output_policy_logprobs=policy))
        return out

    # ----------------------------------------------------------------- outcomes and stats
    def put_outcome(self, job_id: str, outcome: Outcome) -> None:
        raw = json.dumps({"group_id": outcome.group_id, "status": int(outcome.status), "reward": outcome.reward,
                          "excluded": outcome.excluded, "step": outcome.step})
        with self.r.pipeline(transaction=True) as p:
            p.sadd(self.keys.key("jobs"), job_id)
            p.sadd(self.keys.key("job", job_id, "executions"), outcome.execution_id)
            p.sadd(self.keys.key("job", job_id, "steps"), outcome.step)
            p.set(self.keys.key("outcome", job_id, outcome.execution_id), raw)
            p.execute()

    def outcome(self, job_id: str, execution_id: str) -> Outcome | None:
        raw = self.r.get(self.keys.key("outcome", job_id, execution_id))
        if raw is None:
            return None
        d = json.loads(raw)
        return Outcome(execution_id, d["group_id"], Status(d["status"]), d["reward"], d["excluded"], d["step"],
                       job_id)

    def put_stats(self, job_id: str, execution_id: str, stats: dict[str, int]) -> None:
        self.r.set(self.keys.key("stats", job_id, execution_id), json.dumps(stats))

    def stats(self, job_id: str, execution_id: str) -> dict[str, int] | None:
        raw = self.r.get(self.keys.key("stats", job_id, execution_id))
        return None if raw is None else dict(json.loads(raw))

    def jobs(self) -> list[str]:
        return sorted(_str(x) for x in self.r.smembers(self.keys.key("jobs")))

    def executions(self, job_id: str) -> list[str]:
        return sorted(_str(x) for x in self.r.smembers(self.keys.key("job", job_id, "executions")))

    # ----------------------------------------------------------------- steps and batches
    def put_step(self, job_id: str, step: int, spec: StepSpec) -> None:
        with self.r.pipeline(transaction=True) as p:
            p.sadd(self.keys.key("jobs"), job_id)
            p.sadd(self.keys.key("job", job_id, "steps"), step)
            p.set(self.keys.key("step", job_id, step), json.dumps(asdict(spec)))
            p.execute()

    def step_spec(self, job_id: str, step: int) -> StepSpec | None:
        raw = self.r.get(self.keys.key("step", job_id, step))
        return None if raw is None else StepSpec(**json.loads(raw))

    def steps(self, job_id: str) -> list[int]:
        return sorted(int(x) for x in self.r.smembers(self.keys.key("job", job_id, "steps")))

    def mark_released(self, job_id: str, step: int, group_ids: Iterable[str]) -> None:
        groups = list(group_ids)
        if groups:
            self.r.sadd(self.keys.key("step", job_id, step, "released"), *groups)

    def released(self, job_id: str, step: int) -> set[str]:
        return {_str(x) for x in self.r.smembers(self.keys.key("step", job_id, step, "released"))}

    def add_batch(self, job_id: str, step: int, meta: BatchMeta, data: bytes) -> None:
        self.blobs.put(meta.blob_key, data)
        self.r.rpush(self.keys.key("step", job_id, step, "batches"), meta.to_json())

    def batch_blob_key(self, job_id: str, step: int, batch_id: str) -> str:
        return f"traj/{_h(job_id)}/steps/{step}/{batch_id}.npz"

    def batches(self, job_id: str, step: int) -> list[BatchMeta]:
        return [BatchMeta.from_json(x) for x in self.r.lrange(self.keys.key("step", job_id, step, "batches"), 0, -1)]

    def load_batch(self, meta: BatchMeta) -> bytes:
        return self.blobs.get(meta.blob_key)

    def ack(self, job_id: str, step: int, batch_id: str) -> None:
        self.r.sadd(self.keys.key("step", job_id, step, "acked"), batch_id)

    def unack(self, job_id: str, step: int, batch_ids: Iterable[str]) -> None:
        ids = list(batch_ids)
        if ids:
            self.r.srem(self.keys.key("step", job_id, step, "acked"), *ids)

    def acked(self, job_id: str, step: int) -> set[str]:
        return {_str(x) for x in self.r.smembers(self.keys.key("step", job_id, step, "acked"))}

    def collect_step(self, job_id: str, step: int, execution_ids: Iterable[str], metas: Iterable[BatchMeta]) -> int:
        """Delete the spool payloads of a fully consumed step (records of its executions and its
        batches); Redis keeps outcomes, stats and the step index. Returns blobs deleted."""
        deleted = 0
        for meta in metas:
            self.blobs.delete(meta.blob_key)
            deleted += 1
        for eid in execution_ids:
            key = self.keys.key("calls", job_id, eid)
            for raw in self.r.lrange(key, 0, -1):
                self.blobs.delete(json.loads(raw)["blob"])
                deleted += 1
            self.r.delete(key)
        return deleted
