"""Redis access shared by every service: connections that survive a Redis restart, and key names.

Connections retry transient errors (connection refused/reset, timeouts) with exponential backoff
and jitter, so a Redis restart (AOF) is ridden out without a service restart. Key names are
built only through ``Keys`` so the layout of every service is visible in one place:

    gyre:{namespace}:{part}:{part}...   e.g. gyre:sched:job:J1, gyre:traj:exec:E7:calls
"""

from __future__ import annotations

from urllib.parse import urlsplit

import redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from services.common.logging import get_logger

log = get_logger(__name__)

PREFIX = "gyre"


def connect(url: str, *, retries: int = 8, cap_s: float = 2.0, check: bool = True,
            decode_responses: bool = False) -> redis.Redis:
    """A Redis client for ``url`` that retries transient failures with backoff.

    ``check=True`` pings once and turns an unreachable server into one clear ``ValueError``.
    """
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(f"redis_url {url!r} must start with redis://, rediss:// or unix://")
    retry = Retry(ExponentialWithJitterBackoff(cap=cap_s, base=0.05), retries,
                  supported_errors=(RedisConnectionError, RedisTimeoutError, ConnectionResetError))
    client = redis.Redis.from_url(
        url,
        retry=retry,
        socket_connect_timeout=2.0,
        socket_timeout=30.0,
        health_check_interval=10,
        decode_responses=decode_responses,
    )
    if check:
        try:
            client.ping()
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise ValueError(f"Redis at {redact(url)} is unreachable ({exc}); start redis-server or set "
                             f"REDIS_URL / --redis-url to a running one") from None
    return client


def redact(url: str) -> str:
    """The URL with any password replaced, for logs and error messages."""
    parts = urlsplit(url)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return parts._replace(netloc=netloc).geturl()
    return url


class Keys:
    """Key builder for one namespace: ``Keys("sched").key("job", job_id)`` -> ``gyre:sched:job:<id>``."""

    def __init__(self, namespace: str, prefix: str = PREFIX) -> None:
        if not namespace or ":" in namespace:
            raise ValueError(f"key namespace {namespace!r} must be non-empty and contain no ':'")
        self.base = f"{prefix}:{namespace}"

    def key(self, *parts: str | int) -> str:
        return ":".join((self.base, *(str(p) for p in parts)))

    def pattern(self, *parts: str | int) -> str:
        """A SCAN pattern under this namespace, e.g. ``pattern("job", "*")``."""
        return self.key(*parts)

    @staticmethod
    def ns(namespace: str) -> "Keys":
        return Keys(namespace)
