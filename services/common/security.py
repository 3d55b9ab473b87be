"""Transport security and caller authentication for Gyre's gRPC servers and clients.

- TLS: a server with ``tls_cert_file``/``tls_key_file`` serves TLS; with ``tls_client_ca_file`` it
  also requires client certificates signed by that CA (mTLS).
- Bearer tokens: with ``auth_token`` set, every RPC except health checks and reflection must carry
  ``authorization: Bearer <token>`` metadata, else UNAUTHENTICATED. One shared token holds every
  role (a simple local setup).
- Per-role tokens (``auth_tokens_file``: lines ``ROLE TOKEN``): a caller's token names its role,
  and each RPC admits only some roles (``METHOD_ROLES``), else PERMISSION_DENIED before the
  handler runs (a refused call writes nothing):

  ``internal``   the services themselves: every RPC (a process sends the file's first internal token)
  ``harness``    gateway calls, leases (Scheduler Harnesses API), workspace submit and scoring, its
                 job's scorer (among those the reward service allows), reading its job
  ``operator``   submit / cancel / watch jobs, cells and cordons, trainer status and admin,
                 gateway engine admin, reading scores and trajectory stats

Set once per process in ``main()`` (``configure``), like logging; ``build_server`` and
``open_channel`` pick it up so every service gets it without its own wiring.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from services.common.roles import AUTH_ROLES

PUBLIC_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
_H, _O = frozenset({"harness"}), frozenset({"operator"})
_HO = _H | _O
# Roles besides ``internal`` (which may call everything) admitted per method; unlisted: internal only.
METHOD_ROLES: dict[str, frozenset[str]] = {
    **{f"/gyre.v1.Harnesses/{m}": _H for m in ("LeaseExecution", "Heartbeat", "CompleteExecution", "MintSession",
                                                 "ReleaseHarness")},
    **{f"/gyre.v1.Gateway/{m}": _H for m in ("Generate", "GenerateStream")},
    **{f"/gyre.v1.Gateway/{m}": _O for m in ("RegisterEngine", "DeregisterEngine", "DrainEngine", "ListEngines",
                                             "JobUsage")},
    "/gyre.v1.Reward/SubmitWorkspace": _H,
    "/gyre.v1.Reward/Score": _H,  # a harness scores the executions it ran
    "/gyre.v1.Reward/GetScore": _HO,
    "/gyre.v1.Reward/ConfigureJob": _HO,  # among the scorers the reward service allows, no other
    **{f"/gyre.v1.Scheduler/{m}": _O for m in ("SubmitJob", "ListJobs", "CancelJob", "WatchJob", "ListCells",
                                                 "CordonCell", "GetExecution")},
    "/gyre.v1.Scheduler/GetJob": _HO,
    **{f"/gyre.v1.Trainer/{m}": _O for m in ("GetStatus", "WaitStep", "StartJob", "StopJob")},
    **{f"/gyre.v1.Trajectory/{m}": _O for m in ("GetExecutionStats", "GetStepPlan")},
}


def roles_for(method: str) -> frozenset[str]:
    """The roles that may call ``method`` (a full gRPC method name)."""
    return METHOD_ROLES.get(method, frozenset()) | {"internal"}


def read_tokens(path: str) -> tuple[tuple[str, str], ...]:
    """``(role, token)`` pairs of a tokens file: ``ROLE TOKEN`` per line, ``#`` comments."""
    if not path:
        return ()
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        role, _, token = line.partition(" ")
        token = token.strip()
        if role not in AUTH_ROLES or len(token) < 16:
            raise ValueError(f"{path}:{n}: expected 'ROLE TOKEN' with ROLE one of {', '.join(AUTH_ROLES)} and a "
                             "token of at least 16 characters")
        out.append((role, token))
    return tuple(out)


@dataclass(frozen=True)
class Security:
    """TLS files (PEM paths) and the shared bearer token; all optional."""

    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_client_ca_file: str = ""
    tls_ca_file: str = ""  # CA that clients use to verify servers
    auth_token: str = ""  # what this process sends (and, without ``tokens``, the one token accepted)
    tokens: tuple[tuple[str, str], ...] = ()  # (role, token) this server accepts (auth_tokens_file)

    def __post_init__(self) -> None:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("TLS needs both tls_cert_file and tls_key_file (or neither)")
        for name in ("tls_cert_file", "tls_key_file", "tls_client_ca_file", "tls_ca_file"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ValueError(f"config field '{name}' points to {path!r}, which is not a readable file")

    def server_credentials(self) -> grpc.ServerCredentials | None:
        if not self.tls_cert_file:
            return None
        pair = [(Path(self.tls_key_file).read_bytes(), Path(self.tls_cert_file).read_bytes())]
        if self.tls_client_ca_file:
            return grpc.ssl_server_credentials(pair, root_certificates=Path(self.tls_client_ca_file).read_bytes(),
                                               require_client_auth=True)
        return grpc.ssl_server_credentials(pair)

    def interceptors(self) -> list[grpc.ServerInterceptor]:
        if self.tokens:
            return [RoleAuthInterceptor(self.tokens)]
        return [TokenAuthInterceptor(self.auth_token)] if self.auth_token else []

    @property
    def outgoing_token(self) -> str:
        """The token this process sends: ``auth_token``, else the tokens file's first internal one."""
        return self.auth_token or next((t for r, t in self.tokens if r == "internal"), "")

    def role_of(self, token: str) -> str | None:
        """The role ``token`` holds here ("internal" for the shared token), None if unknown; a
        constant-time comparison with every configured token."""
        found = None
        for role, known in self.tokens or ((("internal", self.auth_token),) if self.auth_token else ()):
            if hmac.compare_digest(token.encode(), known.encode()):
                found = found or role
        return found


def security_from(cfg: Any) -> Security:
    """A process's Security from its ServerConfig (token files read here: secrets never on argv)."""
    token = cfg.auth_token or (Path(cfg.auth_token_file).read_text().strip() if cfg.auth_token_file else "")
    return Security(tls_cert_file=cfg.tls_cert_file, tls_key_file=cfg.tls_key_file,
                    tls_client_ca_file=cfg.tls_client_ca_file, tls_ca_file=cfg.tls_ca_file, auth_token=token,
                    tokens=read_tokens(cfg.auth_tokens_file))


_PROCESS = Security()


def configure(security: Security) -> None:
    """Set this process's security (called once from main)."""
    global _PROCESS
    _PROCESS = security


def configure_client_from_env() -> None:
    """A command-line client's credential (an operator's, a harness's, a health probe's), from the
    environment, never from argv: ``GYRE_TOKEN_FILE`` (or ``GYRE_TOKEN``), ``GYRE_TLS_CA_FILE`` (plus
    ``GYRE_TLS_CERT_FILE``/``GYRE_TLS_KEY_FILE`` for mTLS). Nothing set: plaintext, no token."""
    token = os.environ.get("GYRE_TOKEN", "")
    if os.environ.get("GYRE_TOKEN_FILE"):
        token = Path(os.environ["GYRE_TOKEN_FILE"]).read_text().strip()
    if token or os.environ.get("GYRE_TLS_CA_FILE"):
        configure(Security(auth_token=token, tls_ca_file=os.environ.get("GYRE_TLS_CA_FILE", ""),
                           tls_cert_file=os.environ.get("GYRE_TLS_CERT_FILE", ""),
                           tls_key_file=os.environ.get("GYRE_TLS_KEY_FILE", "")))


def current() -> Security:
    return _PROCESS


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Refuses calls without the right ``authorization: Bearer`` token (constant-time compare)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        if details.method.startswith(PUBLIC_PREFIXES):
            return continuation(details)
        presented = dict(details.invocation_metadata or ()).get("authorization", "")
        if isinstance(presented, str):
            presented = presented.encode()
        if hmac.compare_digest(presented, self._expected):
            return continuation(details)
        return _deny(continuation(details))


class RoleAuthInterceptor(grpc.ServerInterceptor):
    """Per-role tokens: UNAUTHENTICATED for an unknown token, PERMISSION_DENIED for a role the
    method does not admit (``METHOD_ROLES``); both before the handler runs."""

    def __init__(self, tokens: tuple[tuple[str, str], ...]) -> None:
        self._security = Security(tokens=tokens)

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        if details.method.startswith(PUBLIC_PREFIXES):
            return continuation(details)
        presented = dict(details.invocation_metadata or ()).get("authorization", "")
        if isinstance(presented, bytes):
            presented = presented.decode(errors="replace")
        role = self._security.role_of(presented.removeprefix("Bearer ")) if presented.startswith("Bearer ") else None
        if role is None:
            return _deny(continuation(details))
        allowed = roles_for(details.method)
        if role in allowed:
            return continuation(details)
        need = " or ".join(sorted(allowed - {"internal"})) or "internal (a service's)"
        return _deny(continuation(details), grpc.StatusCode.PERMISSION_DENIED,
                     f"a {role} credential may not call {details.method}: it needs an {need} credential")


def _deny(handler: Any, code: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED,
          message: str = "missing or wrong bearer token: send metadata 'authorization: Bearer <token>'") -> Any:
    def abort(_request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, message)

    if handler is None:
        return None
    if handler.unary_unary or handler.stream_unary:
        make = grpc.unary_unary_rpc_method_handler if handler.unary_unary else grpc.stream_unary_rpc_method_handler
    else:
        make = grpc.unary_stream_rpc_method_handler if handler.unary_stream else grpc.stream_stream_rpc_method_handler
    return make(abort, handler.request_deserializer, handler.response_serializer)


class _TokenCallCredentials(grpc.AuthMetadataPlugin):
    def __init__(self, token: str) -> None:
        self.token = token

    def __call__(self, _context: Any, callback: Any) -> None:
        callback((("authorization", f"Bearer {self.token}"),), None)


CONNECT_TIMEOUT_MS = 20_000
"""Least time one connection attempt (TCP, TLS, HTTP/2 settings) is given before it counts as failed."""


def open_channel(address: str, *, security: Security | None = None, max_message_mb: int = 256) -> grpc.Channel:
    """A channel to ``address`` honouring this process's (or the given) TLS and token settings.

    Tokens over plaintext are sent as metadata via an interceptor (local/dev use); with TLS they
    ride as call credentials.
    """
    sec = security or _PROCESS
    limit = max_message_mb * 1024 * 1024
    options = [("grpc.max_send_message_length", limit), ("grpc.max_receive_message_length", limit),
               # a restarted peer is reached again within 2 s (gRPC's defaults back off from 1 s up to
               # 120 s after its connection broke, so a client would sit out a peer's restart for longer)
               ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000),
               # despite its name, gRPC core reads this as the *minimum connect timeout* (the backoff
               # spec's MIN_CONNECT_TIMEOUT): at 200 ms a TLS handshake on a loaded host timed out
               # ("timed out before receiving SETTINGS frame") and the call failed UNAVAILABLE. An
               # attempt gets gRPC's default 20 s; the backoff above still paces the retries.
               ("grpc.min_reconnect_backoff_ms", CONNECT_TIMEOUT_MS)]
    if sec.tls_ca_file or sec.tls_cert_file and sec.tls_client_ca_file:
        root = Path(sec.tls_ca_file).read_bytes() if sec.tls_ca_file else None
        key = Path(sec.tls_key_file).read_bytes() if sec.tls_key_file else None
        cert = Path(sec.tls_cert_file).read_bytes() if sec.tls_cert_file else None
        creds = grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=cert)
        if sec.outgoing_token:
            creds = grpc.composite_channel_credentials(
                creds, grpc.metadata_call_credentials(_TokenCallCredentials(sec.outgoing_token)))
        return grpc.secure_channel(address, creds, options=options)
    channel = grpc.insecure_channel(address, options=options)
    if sec.outgoing_token:
        channel = grpc.intercept_channel(channel, _MetadataInterceptor(sec.outgoing_token))
    return channel


class _MetadataInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                           grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self.pair = ("authorization", f"Bearer {token}")

    def _details(self, details: Any) -> Any:
        metadata = [*(details.metadata or ()), self.pair]
        return _Details(details.method, details.timeout, metadata, details.credentials,
                        getattr(details, "wait_for_ready", None), getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation: Any, details: Any, request_iterator: Any) -> Any:
        return continuation(self._details(details), request_iterator)


class _Details(grpc.ClientCallDetails):
    def __init__(self, method: str, timeout: Any, metadata: Any, credentials: Any, wait_for_ready: Any,
                 compression: Any) -> None:
        self.method = method
        self.timeout = timeout
        self.metadata = metadata
        self.credentials = credentials
        self.wait_for_ready = wait_for_ready
        self.compression = compression
