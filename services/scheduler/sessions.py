"""Session base URLs: one unguessable token per agent of a leased execution, in Redis.

An unmodified harness knows only a base URL (``OPENAI_BASE_URL``). The scheduler mints a session
for the main agent of every lease, and ``Harnesses.MintSession`` mints more (sub-agents, summaries);
the gateway's HTTP endpoint serves ``/s/<token>/v1/...`` and records each call under the
session's job, execution, agent, role and lease attempt, whatever headers the client sends.

    session:{token}        HASH  job_id (the record job: "<job>-eval" for evaluations), execution_id,
                                 agent_id, role, attempt; expires with the execution's deadline

A session is live while its execution is leased at the session's attempt: once the execution
ended, or its lease expired and it was leased again (a new attempt gets new sessions), calls
through it are refused (HTTP 410). An unknown or expired token is HTTP 404.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

from services.common.roles import AGENT_ROLES
from services.scheduler.state import Keys



@dataclass(frozen=True)
class Session:
    token: str
    job_id: str
    execution_id: str
    agent_id: str
    role: str
    attempt: int
    # the execution's sampling temperature: a call through the session that sends none samples at it
    # (0 for a greedy evaluation); None: the endpoint's default
    temperature: float | None = None


class Sessions:
    """Mint (scheduler) and resolve (gateway) session tokens; thread-safe like redis-py."""

    def __init__(self, client: Any, namespace: str = "sched") -> None:
        self.r = client
        self.keys = Keys(namespace)

    def publish_http_url(self, url: str) -> None:
        """The gateway's HTTP base URL (``http://host:port/v1``) that session base URLs extend."""
        self.r.set(self.keys.gateway_http, url)

    def http_url(self) -> str:
        v = self.r.get(self.keys.gateway_http)
        return v.decode() if isinstance(v, bytes) else (v or "")

    def mint(self, *, job_id: str, execution_id: str, agent_id: str, role: str, attempt: int, ttl_s: float,
             temperature: float | None = None) -> str:
        if role not in AGENT_ROLES:
            raise ValueError(f"role is {role!r}; expected one of {', '.join(AGENT_ROLES)}")
        token = secrets.token_urlsafe(24)  # 192 bits
        key = self.keys.session(token)
        with self.r.pipeline() as pipe:
            pipe.hset(key, mapping={"job_id": job_id, "execution_id": execution_id, "agent_id": agent_id,
                                    "role": role, "attempt": attempt,
                                    "temperature": "" if temperature is None else repr(float(temperature))})
            pipe.pexpire(key, max(1000, int(ttl_s * 1000)))
            pipe.execute()
        return token

    def resolve(self, token: str) -> Session | None:
        """The session of ``token`` (None when unknown or expired)."""
        if not token or len(token) > 64:
            return None
        h = self.r.hgetall(self.keys.session(token))
        if not h:
            return None
        g = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
             for k, v in h.items()}
        t = g.get("temperature") or ""  # absent in sessions minted before the field existed
        return Session(token=token, job_id=g["job_id"], execution_id=g["execution_id"], agent_id=g["agent_id"],
                       role=g["role"], attempt=int(g["attempt"]), temperature=float(t) if t else None)

    def ended_reason(self, session: Session) -> str:
        """Why calls through ``session`` are refused now ("" while its execution is leased at its attempt)."""
        state, attempt = self.r.hmget(self.keys.execution(session.execution_id), "state", "attempt")
        state = state.decode() if isinstance(state, bytes) else (state or "")
        if state == "leased" and int(attempt or 0) == session.attempt:
            return ""
        if state in ("leased", "queued") or int(attempt or 0) != session.attempt:
            return (f"the session of execution {session.execution_id!r} ended: its lease (attempt "
                    f"{session.attempt}) expired and the execution runs again under a new session")
        return f"the session of execution {session.execution_id!r} ended: the execution is {state or 'gone'}"


ENDED = frozenset({"finished", "timeout", "failed", "cancelled"})


def ended_executions(client: Any, execution_ids: list[str], namespace: str = "sched") -> list[str]:
    """Those of ``execution_ids`` that the scheduler has ended (for per-execution state elsewhere,
    e.g. the gateway's delta encoder, to be dropped)."""
    keys = Keys(namespace)
    with client.pipeline(transaction=False) as pipe:
        for eid in execution_ids:
            pipe.hget(keys.execution(eid), "state")
        states = pipe.execute()
    return [e for e, s in zip(execution_ids, states)
            if (s.decode() if isinstance(s, bytes) else s) in ENDED]


def session_base_url(http_base_url: str, token: str) -> str:
    """``http://gateway:port/v1`` + token -> ``http://gateway:port/s/<token>/v1``."""
    root = http_base_url.rstrip("/").removesuffix("/v1")
    return f"{root}/s/{token}/v1"


def cordoned_cells(client: Any, namespace: str = "sched") -> set[str]:
    """Cells an operator cordoned in the scheduler's registry (the gateway routes no new call to
    them while another engine can take it)."""
    keys = Keys(namespace)
    ids = [c.decode() if isinstance(c, bytes) else c for c in client.smembers(keys.cells)]
    with client.pipeline(transaction=False) as pipe:
        for cid in ids:
            pipe.hget(keys.cell(cid), "cordon_reason")
        reasons = pipe.execute()
    return {cid for cid, reason in zip(ids, reasons) if reason}
