"""Proto <-> domain conversions of the rollout service (messages only; no stubs, no servers).

Used by ``servicer.py`` (requests in, responses out) and ``client.py`` (the reverse). Token
arrays become numpy arrays at this boundary and stay arrays inside.
"""

from __future__ import annotations

import numpy as np

from protos.gyre.v1 import common_pb2, rollout_pb2
from services.common.errors import InvalidArgument
from services.rollout.calls import FINISHED, CallMeta, MigrationReport, Piece
from services.rollout.engine import SamplingParams
from services.rollout.grammar import GrammarSpec

ROLE_TO_STR: dict[int, str] = {common_pb2.ROLE_UNSPECIFIED: "main", common_pb2.ROLE_MAIN: "main",
               common_pb2.ROLE_SUBAGENT: "subagent", common_pb2.ROLE_SUMMARY: "summary"}
STR_TO_ROLE: dict[str, common_pb2.AgentRole] = {"main": common_pb2.ROLE_MAIN, "subagent": common_pb2.ROLE_SUBAGENT,
               "summary": common_pb2.ROLE_SUMMARY}
TRANSPORT_TO_STR: dict[int, str] = {rollout_pb2.KV_TRANSPORT_UNSPECIFIED: "auto", rollout_pb2.KV_TRANSPORT_AUTO: "auto",
                    rollout_pb2.KV_TRANSPORT_UCX: "ucx", rollout_pb2.KV_TRANSPORT_TCP: "tcp",
                    rollout_pb2.KV_TRANSPORT_REPREFILL: "reprefill"}
STR_TO_TRANSPORT: dict[str, rollout_pb2.KvTransport] = {"auto": rollout_pb2.KV_TRANSPORT_AUTO, "ucx": rollout_pb2.KV_TRANSPORT_UCX,
                    "tcp": rollout_pb2.KV_TRANSPORT_TCP, "reprefill": rollout_pb2.KV_TRANSPORT_REPREFILL,
                    "": rollout_pb2.KV_TRANSPORT_UNSPECIFIED}


def ids(field: object) -> np.ndarray:
    return np.array(field, dtype=np.int32)


def floats(field: object) -> np.ndarray:
    return np.array(field, dtype=np.float32)


# -- call metadata and sampling ------------------------------------------------------------------
def meta_from_proto(ctx: common_pb2.CallContext) -> CallMeta:
    if ctx.role not in ROLE_TO_STR:
        raise InvalidArgument(f"unknown role {ctx.role}")
    return CallMeta(job_id=ctx.job_id, execution_id=ctx.execution_id, call_id=ctx.call_id,
                    agent_id=ctx.agent_id, role=ROLE_TO_STR[ctx.role], attempt=ctx.attempt)


def meta_to_proto(meta: CallMeta) -> common_pb2.CallContext:
    return common_pb2.CallContext(job_id=meta.job_id, execution_id=meta.execution_id,
                                  call_id=meta.call_id, agent_id=meta.agent_id, role=STR_TO_ROLE[meta.role],
                                  attempt=meta.attempt)


def sampling_from_proto(p: common_pb2.SamplingParams) -> SamplingParams:
    """Proto defaults: top_p 0 reads as 1 (no nucleus cut); max_new_tokens must be set (>= 1)."""
    try:
        return SamplingParams(temperature=float(p.temperature), top_p=float(p.top_p) or 1.0,
                              top_k=int(p.top_k), max_new_tokens=int(p.max_new_tokens),
                              stop_token_ids=tuple(int(t) for t in p.stop_token_ids),
                              seed=int(p.seed) if p.has_seed else None, top_logprobs=int(p.top_logprobs),
                              grammar=GrammarSpec(p.grammar.kind, p.grammar.source) if p.HasField("grammar") else None)
    except ValueError as exc:
        raise InvalidArgument(f"invalid sampling params: {exc}") from None


def sampling_to_proto(s: SamplingParams) -> common_pb2.SamplingParams:
    grammar = None if s.grammar is None else common_pb2.Grammar(kind=s.grammar.kind, source=s.grammar.source)
    return common_pb2.SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                                     max_new_tokens=s.max_new_tokens, stop_token_ids=list(s.stop_token_ids),
                                     seed=s.seed or 0, has_seed=s.seed is not None, top_logprobs=s.top_logprobs,
                                     grammar=grammar)


def generate_request(request_id: str, meta: CallMeta, prompt_ids: np.ndarray,
                     params: SamplingParams) -> rollout_pb2.GenerateRequest:
    return rollout_pb2.GenerateRequest(context=meta_to_proto(meta), prompt_ids=prompt_ids.tolist(),
                                       sampling=sampling_to_proto(params), request_id=request_id)


# -- streamed pieces ----------------------------------------------------------------------------
def piece_to_proto(p: Piece) -> rollout_pb2.GenerateChunk:
    c = rollout_pb2.GenerateChunk(request_id=p.request_id, token_ids=p.token_ids.tolist(),
                                  logprobs=p.logprobs.tolist(), offset=p.offset, finished=p.finished,
                                  finish_reason=p.finish_reason, weight_version=p.weight_version,
                                  migrated_to=p.migrated_to, seed=p.seed, cached_prompt_tokens=p.cached_tokens)
    if p.top_ids is not None and p.top_logprobs is not None and p.top_ids.size:
        c.top_k = int(p.top_ids.shape[1])
        c.top_ids.extend(p.top_ids.reshape(-1).tolist())
        c.top_logprobs.extend(p.top_logprobs.reshape(-1).tolist())
    if p.forced is not None and p.policy_logprobs is not None:
        c.forced.extend(p.forced.tolist())
        c.policy_logprobs.extend(p.policy_logprobs.tolist())
    return c


def piece_from_proto(c: rollout_pb2.GenerateChunk) -> Piece:
    tops: tuple[np.ndarray, np.ndarray] | tuple[None, None] = (None, None)
    if c.top_k > 0:
        if len(c.top_ids) != c.top_k * len(c.token_ids) or len(c.top_logprobs) != len(c.top_ids):
            raise InvalidArgument(f"chunk of {len(c.token_ids)} tokens has {len(c.top_ids)} top ids for top_k {c.top_k}")
        tops = (ids(c.top_ids).reshape(-1, c.top_k), floats(c.top_logprobs).reshape(-1, c.top_k))
    forced = policy = None
    if len(c.forced) or len(c.policy_logprobs):
        if not len(c.forced) == len(c.policy_logprobs) == len(c.token_ids):
            raise InvalidArgument(f"chunk of {len(c.token_ids)} tokens has {len(c.forced)} forced flags and "
                                  f"{len(c.policy_logprobs)} policy logprobs; each needs one per token")
        forced, policy = np.array(c.forced, dtype=bool), floats(c.policy_logprobs)
    return Piece(request_id=c.request_id, token_ids=ids(c.token_ids), logprobs=floats(c.logprobs),
                 offset=c.offset, finished=c.finished, finish_reason=c.finish_reason,
                 weight_version=c.weight_version, seed=c.seed, migrated_to=c.migrated_to,
                 top_ids=tops[0], top_logprobs=tops[1], cached_tokens=c.cached_prompt_tokens,
                 forced=forced, policy_logprobs=policy)


# -- migration ----------------------------------------------------------------------------------
def report_to_proto(r: MigrationReport) -> rollout_pb2.MigrationResult:
    return rollout_pb2.MigrationResult(
        request_id=r.request_id, source_cell_id=r.source_cell_id, target_cell_id=r.target_cell_id,
        transport=(rollout_pb2.KV_TRANSPORT_FINISHED if r.transport == FINISHED
                   else STR_TO_TRANSPORT.get(r.transport, rollout_pb2.KV_TRANSPORT_UNSPECIFIED)),
        bytes=r.bytes, duration_s=r.duration_s, kv_tokens=r.kv_tokens, ok=r.ok, error=r.error)


def report_from_proto(m: rollout_pb2.MigrationResult) -> MigrationReport:
    transport = (FINISHED if m.transport == rollout_pb2.KV_TRANSPORT_FINISHED
                 else TRANSPORT_TO_STR.get(m.transport, "") if m.transport != rollout_pb2.KV_TRANSPORT_UNSPECIFIED else "")
    return MigrationReport(m.request_id, m.source_cell_id, m.target_cell_id, transport, m.bytes,
                           m.duration_s, m.kv_tokens, m.ok, m.error)


def transport_from_proto(t: int) -> str:
    if t not in TRANSPORT_TO_STR:
        raise InvalidArgument(f"unknown KV transport {t}")
    return TRANSPORT_TO_STR[t]
