"""Domain errors that map one-to-one onto gRPC status codes.

Core modules raise these (or a plain ``ValueError`` for bad input); the server interceptor in
``services.common.server`` turns them into ``context.abort(code, message)``, so servicers never
translate errors by hand and a bad request never kills a service.
"""

from __future__ import annotations

import grpc


class GyreError(Exception):
    """Base of Gyre's domain errors; ``code`` is the gRPC status the caller receives."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(GyreError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(GyreError, LookupError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(GyreError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(GyreError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class PermissionDenied(GyreError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(GyreError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(GyreError):
    code = grpc.StatusCode.UNAVAILABLE


class Aborted(GyreError):
    code = grpc.StatusCode.ABORTED


class DeadlineExceeded(GyreError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Unimplemented(GyreError):
    """The server does not serve this method (e.g. a service of an older Gyre under another name)."""

    code = grpc.StatusCode.UNIMPLEMENTED


def status_for(exc: BaseException) -> grpc.StatusCode | None:
    """The status code a domain exception maps to, or None for an unexpected (internal) error."""
    if isinstance(exc, GyreError):
        return exc.code
    if isinstance(exc, (ValueError, OverflowError)):  # OverflowError: a number too large (e.g. a wait)
        return grpc.StatusCode.INVALID_ARGUMENT
    # Redis unreachable (restarting): retryable by the caller, not an internal error.
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    if isinstance(exc, (RedisConnectionError, RedisTimeoutError)):
        return grpc.StatusCode.UNAVAILABLE
    return None


_BY_CODE: dict[grpc.StatusCode, type[GyreError]] = {
    cls.code: cls for cls in (InvalidArgument, NotFound, AlreadyExists, FailedPrecondition, PermissionDenied,
                              ResourceExhausted, Unavailable, Aborted, DeadlineExceeded, Unimplemented)
}


def from_rpc_error(exc: grpc.RpcError, *, unavailable: type[GyreError] = Unavailable) -> GyreError:
    """The domain error a typed client raises for a failed call (the inverse of ``status_for``).

    ``unavailable`` is what UNAVAILABLE becomes (a client may name a finer error, e.g. the rollout
    engine client's ``EngineLost``). INTERNAL and codes without a domain class become a plain
    ``GyreError`` carrying the code.
    """
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else "") or code.name
    cls = unavailable if code == grpc.StatusCode.UNAVAILABLE else _BY_CODE.get(code)
    if cls is None:
        err = GyreError(f"{code.name}: {details}")
        err.code = code
        return err
    return cls(details)
